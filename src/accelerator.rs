//! The [`Accelerator`] for hand-written training loops: Accelerate's `backward`,
//! `accumulate`, `clip_grad_norm_` / `clip_grad_value_` and the optimizer step of its
//! `AcceleratedOptimizer` and `AcceleratedScheduler`, for Burn modules, optimizers and
//! learning-rate schedulers.
//!
//! ```
//! # #[cfg(feature = "flex")] {
//! use burn::backend::{Autodiff, Flex};
//! use burn::nn::LinearConfig;
//! use burn::optim::SgdConfig;
//! use burn::tensor::Tensor;
//! use burn_accelerate::{AccelerateConfig, GradientState, StepOutcome};
//!
//! type B = Autodiff<Flex>;
//! let device = Default::default();
//! let mut model = LinearConfig::new(4, 1).init::<B>(&device);
//! let mut optim = SgdConfig::new().init();
//! let mut lr = 0.01; // any Burn `LrScheduler`; a bare learning rate is a constant one
//!
//! let config = AccelerateConfig::new().with_gradient_accumulation_steps(2);
//! let mut accelerator = config.init_with_state::<B>(&device, GradientState::new())?;
//! let mut outcomes = Vec::new();
//! for _batch in 0..4 {
//!     let _step = accelerator.accumulate(&model); // `with accelerator.accumulate(model):`
//!     let loss = model.forward(Tensor::<B, 2>::ones([8, 4], &device)).mean();
//!     accelerator.backward(loss, &model);
//!     let (next, outcome) = accelerator.optimizer_step(&mut optim, model, &mut lr)?;
//!     model = next;
//!     outcomes.push(outcome);
//! }
//! assert_eq!(outcomes[0], StepOutcome::Accumulating);
//! assert_eq!(outcomes[1], StepOutcome::Applied { lr: 0.01 });
//! # }
//! # Ok::<(), burn_accelerate::AccelerateError>(())
//! ```

use burn::config::Config;
use burn::lr_scheduler::LrScheduler;
use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use serde::{Deserialize, Serialize};

use crate::autocast::{self, Autocast, AutocastConfig, AutocastScope, LowerOpTally, SmallOps};
use crate::context::Context;
use crate::distributed::{ProcessGroup, ProcessState};
use crate::fp8::DelayedScaling;
use crate::gradient_state::{Accumulate, GradientState, GradientStateSnapshot};
use crate::scaler::{GradScalerConfig, LossScale};
use crate::step::{StepCore, StepOutcome, StepSettings};
use crate::zero::{ParamStateRecord, ZeroStage};
use crate::{AccelerateError, Precision};

/// How to accelerate a training loop, with Accelerate's names.
///
/// Serialises with Accelerate's spellings (`"mixed_precision": "fp16"`), like any Burn config.
///
/// Accelerate's `adjust_scheduler` has no field here: accelerate 1.16 drops it from the
/// plugin's settings whenever it is at its default, and then reads it as off, so in effect it
/// is always off there, and it only touched a step counter of torch's that does not change the
/// learning rate. The scheduler here steps once per applied optimizer step, which is what
/// accelerate does.
#[derive(Config, Debug, PartialEq)]
pub struct AccelerateConfig {
    /// The mixed-precision mode: `"no"`, `"bf16"` or `"fp16"`.
    #[config(default = "Precision::F32")]
    pub mixed_precision: Precision,
    /// Batches whose gradients are summed before each optimizer step; each batch's loss is
    /// divided by it, as Accelerate does.
    #[config(default = 1)]
    pub gradient_accumulation_steps: usize,
    /// Loss scaling (on by default for fp16 only).
    #[config(default = "GradScalerConfig::new()")]
    pub grad_scaler: GradScalerConfig,
    /// Whether a data loader's last batch always completes a window (so that no gradients
    /// carry over into the next epoch). With `false`, windows run across epochs.
    #[config(default = true)]
    pub sync_with_dataloader: bool,
    /// Beyond Accelerate, which divides every batch's loss by `gradient_accumulation_steps`:
    /// when a data loader's last window is shorter (`n` batches, `n < k`), rescale its
    /// gradients by `k / n` at the optimizer step, so the step sees the window's mean
    /// gradient rather than `n / k` of it.
    #[config(default = false)]
    pub divide_partial_window_by_length: bool,
    /// Run in f32 (reported once) instead of failing when the device cannot run
    /// `mixed_precision`.
    #[config(default = false)]
    pub allow_fallback: bool,
    /// Run `mixed_precision` even where the device runs it far slower than f32 (see
    /// [`AutocastConfig::allow_slow`](crate::AutocastConfig)).
    #[config(default = false)]
    pub allow_slow: bool,
    /// How fp8 tensors are scaled when `mixed_precision` is fp8 (Accelerate's
    /// `FP8RecipeKwargs`; Transformer Engine's defaults). fp8 needs no loss scaling.
    #[config(default = "DelayedScaling::default()")]
    pub fp8_recipe: DelayedScaling,
    /// Sharded data parallel over several processes (DeepSpeed's ZeRO stages; see
    /// [`ZeroStage`]): each process steps, and keeps optimizer state for, its own partition
    /// of the parameters (at stage 3, its slice of every parameter, and it keeps only those
    /// slices between steps). Nothing changes for one process.
    #[config(default = "ZeroStage::None")]
    pub zero_stage: ZeroStage,
    /// How a checkpoint of a sharded run is written
    /// ([`CheckpointLayout`](crate::zero::CheckpointLayout)), by
    /// [`save_checkpoint`](Accelerator::save_checkpoint) and by `with_accelerate`'s own
    /// checkpoints (`AccelerateStrategy::with_checkpoint_dir`): consolidated on the main
    /// process (the default), or each process's partition in files of its own. Burn's own
    /// file checkpointer, under `with_accelerate`, writes whole files either way.
    #[config(default = "crate::zero::CheckpointLayout::Consolidated")]
    pub checkpoint_layout: crate::zero::CheckpointLayout,
    /// Clips every window's gradients, unscaled, to this global 2-norm before the optimizer
    /// steps (what Transformers' Trainer does with `max_grad_norm` through Accelerate's
    /// `clip_grad_norm_`), in both the `Accelerator`'s loop (unless it clipped by hand that
    /// window) and `with_accelerate`'s. `None`: no clipping.
    pub max_grad_norm: Option<f32>,
    /// Which lower-class ops stay in f32 as too small for the half type to pay (see
    /// [`SmallOps`]), on the threads that run this training's steps (the `Accelerator`'s
    /// [`autocast`](Accelerator::autocast) guard, `with_accelerate`'s fit and device workers):
    /// a setting of this training, not of the process. `None`: the rule in force there.
    pub small_ops: Option<SmallOps>,
    /// Which path half-precision ops take where the crate has its own kernels
    /// ([`HalfPath`](crate::capability::HalfPath): `Widened` gives Flex's own bf16 bits on every
    /// CPU), on the threads that run this training's steps, as `small_ops`. `None`: the one
    /// in force there.
    pub half_path: Option<crate::capability::HalfPath>,
    /// Overrides of the autocast op table's classes ([`OpClasses`](crate::autocast::OpClasses)),
    /// on the threads that run this training's steps, as `small_ops`. Empty (the default):
    /// the classes in force there.
    #[config(default = "crate::autocast::OpClasses::new()")]
    pub op_classes: crate::autocast::OpClasses,
}

/// Who scales a half-precision training's loss, which decides what a backend without the
/// [`Accelerated`](crate::Accelerated) decorator (where autocast does nothing) costs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LossScaledBy {
    /// The decorator's `backward` (`with_accelerate`: the user's `TrainStep` calls
    /// `loss.backward()` itself). Without the decorator an f16 loss would go unscaled and its
    /// gradients underflow: refused ([`AccelerateError::NotAccelerated`]).
    Decorator,
    /// The [`Accelerator`]'s own `backward`, on any backend. Without the decorator the
    /// training is right but runs in f32 while asked for a half precision: said once per
    /// backend and precision.
    Accelerator,
}

impl AccelerateConfig {
    /// Checks the settings, probes `device` for the precision, checks that autocast reaches
    /// `B`'s ops (what a backend without the decorator means is `scaled_by`'s), and returns
    /// the autocast and the initial loss scale: the part of building an [`Accelerator`] that
    /// the training strategy shares.
    ///
    /// Everything is checked before the device probe, so that a wrong config costs nothing
    /// and changes no shared state.
    pub(crate) fn init_mixed_precision<B: Backend>(
        &self,
        device: &B::Device,
        scaled_by: LossScaledBy,
    ) -> Result<(Autocast, LossScale), AccelerateError> {
        if self.gradient_accumulation_steps == 0 {
            return Err(AccelerateError::InvalidConfig {
                field: "gradient_accumulation_steps",
                value: "0".into(),
                fix: "set at least 1 (1 means no accumulation: the optimizer steps every batch)",
            });
        }
        if let Some(max_norm) = self.max_grad_norm.filter(|n| !(n.is_finite() && *n > 0.0)) {
            return Err(AccelerateError::InvalidConfig {
                field: "max_grad_norm",
                value: max_norm.to_string(),
                fix: "clip to a positive finite norm, or None for no clipping",
            });
        }
        self.grad_scaler.init(self.mixed_precision)?;
        let autocast = AutocastConfig::new(self.mixed_precision)
            .with_allow_fallback(self.allow_fallback)
            .with_allow_slow(self.allow_slow)
            .with_fp8_recipe(self.fp8_recipe)
            .with_small_ops(self.small_ops)
            .with_half_path(self.half_path)
            .with_op_classes(self.op_classes)
            .init::<B>(device)?;
        if !autocast_reaches::<B>(&autocast, device) {
            let (precision, backend) = (autocast.precision(), B::name(device));
            match scaled_by {
                LossScaledBy::Decorator => {
                    return Err(AccelerateError::NotAccelerated { precision, backend });
                }
                LossScaledBy::Accelerator => {
                    crate::warnings::once(
                        "autocast without the decorator",
                        (precision, backend.clone()),
                        || {
                            log::warn!(
                                "burn-accelerate: {precision} asked of {backend}, which is \
                                 not wrapped as `Accelerated<Autodiff<B>>`: the loss is \
                                 scaled, but the ops run in f32 (change the backend's type \
                                 alias to train in {precision})"
                            )
                        },
                    );
                }
            }
        }
        let loss_scale = self.grad_scaler.init(autocast.precision())?;
        Ok((autocast, loss_scale))
    }

    /// Joins this process's run (its process group when there are several) and configures
    /// `state` with the accumulation settings: the part of building an [`Accelerator`] after
    /// the precision that the training strategy shares.
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] for a bad launch environment or a process group that
    /// cannot be joined; what [`GradientState::configure`] returns.
    pub(crate) fn join_run(
        &self,
        state: &GradientState,
    ) -> Result<(ProcessState, Option<ProcessGroup>), AccelerateError> {
        let process = ProcessState::from_env()?;
        let group = process
            .is_distributed()
            .then(|| process.group())
            .transpose()?;
        state.configure(self.gradient_accumulation_steps, self.sync_with_dataloader)?;
        Ok((process, group))
    }

    // What the step core reads of the configuration.
    pub(crate) fn step_settings(&self) -> StepSettings {
        StepSettings {
            divide_partial_window_by_length: self.divide_partial_window_by_length,
            zero_stage: self.zero_stage,
            max_grad_norm: self.max_grad_norm,
            fp8: matches!(self.mixed_precision, Precision::Fp8(_)),
        }
    }

    /// Builds an [`Accelerator`] on `device`, sharing the process-wide
    /// [`GradientState::global`] (as Accelerate's singleton is shared).
    ///
    /// # Errors
    /// See [`Accelerator::with_gradient_state`].
    pub fn init<B: AutodiffBackend>(
        &self,
        device: &B::Device,
    ) -> Result<Accelerator<B>, AccelerateError> {
        Accelerator::new(self.clone(), device)
    }

    /// Builds an [`Accelerator`] on `device` that uses `state` instead of the process-wide
    /// gradient state.
    ///
    /// # Errors
    /// See [`Accelerator::with_gradient_state`].
    pub fn init_with_state<B: AutodiffBackend>(
        &self,
        device: &B::Device,
        state: GradientState,
    ) -> Result<Accelerator<B>, AccelerateError> {
        Accelerator::with_gradient_state(self.clone(), device, state)
    }
}

// Whether `autocast`'s precision reaches `B`'s ops: autocast runs only through the
// `Accelerated` decorator, and a plain `Autodiff<B>` computes in f32 whatever the autocast
// says. Probed with the autocast entered on this thread only, so that nothing process-wide
// changes (other threads may be training).
fn autocast_reaches<B: Backend>(autocast: &Autocast, device: &B::Device) -> bool {
    let Some(low) = autocast.precision().low_dtype() else {
        return true;
    };
    let _guard = autocast.enter();
    let x = Tensor::<B, 2>::ones([2, 2], device);
    x.clone().matmul(x).dtype() == low.into()
}

impl StepOutcome {
    /// Whether the parameters were updated.
    pub fn applied(&self) -> bool {
        matches!(self, StepOutcome::Applied { .. })
    }
}

/// The loss scale and gradient-state position to save with a checkpoint.
///
/// Save it when a window is complete (after an optimizer step): gradients accumulated in an
/// unfinished window are not part of it, as in Accelerate's `save_state`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AcceleratorState {
    /// The loss scale, with the dynamic scale's growth tracker.
    pub loss_scale: LossScale,
    /// The accumulation counter and flags.
    pub gradient_state: GradientStateSnapshot,
}

/// Loss scaling, gradient accumulation and clipping for a hand-written Burn training loop.
///
/// Per batch: [`accumulate`](Self::accumulate) (keep the guard for the batch),
/// [`backward`](Self::backward), then [`optimizer_step`](Self::optimizer_step), which steps
/// only when the window is complete and reports what it did. Works with any
/// `B: AutodiffBackend`, [`Accelerated`](crate::Accelerated) or not: without the decorator a
/// half precision's loss is still scaled, but the ops run in f32 (a warning says so once),
/// where `with_accelerate`, whose loss scaling goes through the decorator, refuses.
///
/// Started by `burn-accelerate launch` (see [`distributed`](crate::distributed)), every
/// process runs the same loop on its own shard: the window's gradients are averaged over the
/// processes once, when it completes (never while accumulating), before they are unscaled and
/// checked, so every process takes the same step, or skips the same overflowing one.
///
/// The accelerator scales the loss it is given itself and never arms the decorator's
/// process-wide scale ([`ArmedLossScale`](crate::scaler::ArmedLossScale)): with both, the loss
/// would be scaled twice. Do not arm one while an accelerator drives the loop.
#[derive(Debug)]
pub struct Accelerator<B: AutodiffBackend> {
    config: AccelerateConfig,
    autocast: Autocast,
    // The training's context (the autocast's settings and its own fp8 state), which
    // `autocast()` enters.
    context: Context,
    process: ProcessState,
    // The loss scale, the window, the sync and the step (shared with `with_accelerate`).
    core: StepCore<B>,
    // Where a consolidated optimizer state is read back to.
    device: B::Device,
    // The creating thread's op tally when the accelerator was made.
    tally_start: LowerOpTally,
}

impl<B: AutodiffBackend> Accelerator<B> {
    /// An accelerator on `device` sharing the process-wide [`GradientState::global`].
    ///
    /// # Errors
    /// See [`with_gradient_state`](Self::with_gradient_state).
    pub fn new(config: AccelerateConfig, device: &B::Device) -> Result<Self, AccelerateError> {
        Self::with_gradient_state(config, device, GradientState::global())
    }

    /// An accelerator on `device` that uses `state` for gradient synchronisation, configured
    /// with this config's accumulation settings.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for zero accumulation steps or an invalid scaler
    /// setting; [`AccelerateError::UnsupportedPrecision`] when `device` cannot run
    /// `mixed_precision` and `allow_fallback` is off; [`AccelerateError::SlowPrecision`] when
    /// it runs far slower than f32 and neither `allow_slow` nor `allow_fallback` is on; the
    /// fp8 errors of
    /// [`AutocastConfig::init`] for an fp8 precision; [`AccelerateError::Distributed`] for a
    /// bad launch environment or a process group that cannot be joined.
    pub fn with_gradient_state(
        config: AccelerateConfig,
        device: &B::Device,
        state: GradientState,
    ) -> Result<Self, AccelerateError> {
        // Before touching the (maybe shared) state, so that a wrong config changes nothing.
        let (autocast, loss_scale) =
            config.init_mixed_precision::<B>(device, LossScaledBy::Accelerator)?;
        let (process, group) = config.join_run(&state)?;
        let context = autocast.context();
        let core = StepCore::new(config.step_settings(), loss_scale, state, group)
            .with_context(context.clone());
        Ok(Self {
            config,
            autocast,
            context,
            process,
            core,
            device: device.clone(),
            tally_start: autocast::thread_tally(),
        })
    }

    /// Which process of the run this is (one process when not launched by
    /// `burn-accelerate launch` or torchrun).
    pub fn process(&self) -> &ProcessState {
        &self.process
    }

    /// Whether this is the main process (the one that prints and writes checkpoints).
    pub fn is_main_process(&self) -> bool {
        self.process.is_main_process()
    }

    /// Waits until every process reaches this point (Accelerate's `wait_for_everyone`).
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when a process left or the wait timed out.
    pub fn wait_for_everyone(&self) -> Result<(), AccelerateError> {
        Ok(self.process.wait_for_everyone()?)
    }

    /// The device it was built for (where checkpoints' records are loaded).
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The configuration this accelerator was built from.
    pub fn config(&self) -> &AccelerateConfig {
        &self.config
    }

    /// The precision forward passes run in under [`autocast`](Self::autocast) (f32 after a
    /// fallback).
    pub fn precision(&self) -> Precision {
        self.autocast.precision()
    }

    /// Autocasts this thread until the guard drops (`with accelerator.autocast():`); for an
    /// [`Accelerated`](crate::Accelerated) backend. It enters the accelerator's
    /// [`context`](Self::context): its settings and its own fp8 state, so that two
    /// accelerators on two threads of one process never share them. Use
    /// [`Context::set_as_default`] on it for threads the crate does not start.
    #[must_use = "autocast is only on while the guard lives"]
    pub fn autocast(&self) -> AutocastScope {
        self.context.enter()
    }

    /// The training's context: what [`autocast`](Self::autocast) enters.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// What autocast did with the lower-class ops this thread ran since the accelerator was
    /// made (on this thread): how many, and their flops, ran in the half type, and how many
    /// it kept in f32 and why (too small, or the device cannot run the precision). Counted per
    /// thread: ops of other threads are not in it.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn::backend::{Autodiff, Flex};
    /// use burn::tensor::Tensor;
    /// use burn_accelerate::{AccelerateConfig, Accelerated, GradientState, Precision};
    ///
    /// type B = Accelerated<Autodiff<Flex>>;
    /// let device = Default::default();
    /// let accelerator = AccelerateConfig::new()
    ///     .with_mixed_precision(Precision::Bf16)
    ///     .init_with_state::<B>(&device, GradientState::new())?;
    /// let x = Tensor::<B, 2>::ones([256, 256], &device);
    /// {
    ///     let _autocast = accelerator.autocast();
    ///     let _ = x.clone().matmul(x); // a bare matmul is cast whatever its size
    /// }
    /// assert_eq!(accelerator.lower_ops().half_ops, 1);
    /// # }
    /// # Ok::<(), burn_accelerate::AccelerateError>(())
    /// ```
    pub fn lower_ops(&self) -> LowerOpTally {
        autocast::thread_tally().since(&self.tally_start)
    }

    /// The autocast checked against the device at construction.
    pub fn autocast_config(&self) -> &Autocast {
        &self.autocast
    }

    /// The loss scale in force.
    pub fn loss_scale(&self) -> &LossScale {
        self.core.loss_scale()
    }

    /// The gradient state this accelerator syncs with.
    pub fn gradient_state(&self) -> &GradientState {
        self.core.state()
    }

    /// Whether the current batch completes a window (Accelerate's `sync_gradients`).
    pub fn sync_gradients(&self) -> bool {
        self.core.state().sync_gradients()
    }

    /// Batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.core.state().num_steps()
    }

    /// Decides whether this batch syncs; keep the guard for the batch
    /// (`with accelerator.accumulate(model):`).
    ///
    /// The model is taken for parity with Accelerate, where it names the modules whose
    /// gradient all-reduce is held back while accumulating; here the gradients of every
    /// process are averaged only when a window completes, so nothing happens to it.
    ///
    /// At ZeRO stage 3 the batch's forward pass starts here: a forward pass of the training
    /// model run since the last backward and dropped without one (an evaluation that reads
    /// its loss) leaves nothing to it. Call it before the batch's forward pass, and run such
    /// evaluations outside the guard's batch (after its step, or through `model.valid()`).
    #[must_use = "the accumulate guard marks the batch; keep it for the batch's backward and step"]
    pub fn accumulate<M: AutodiffModule<B>>(&self, _model: &M) -> Accumulate {
        // At ZeRO stage 3 the batch's pass reads the parameters through anchors of its own,
        // not those of a forward pass dropped since the last backward (an evaluation).
        crate::zero::discard_anchors();
        self.core.state().accumulate()
    }

    /// Differentiates `loss / gradient_accumulation_steps × loss scale` and adds the
    /// gradients of `model`'s parameters to the window's.
    ///
    /// The division happens on every batch, as in Accelerate (see
    /// [`AccelerateConfig::divide_partial_window_by_length`] for the last partial window).
    ///
    /// At ZeRO stage 3 ([`ZeroStage::Parameters`](crate::zero::ZeroStage::Parameters), on
    /// `Accelerated<Autodiff<B>>`, from the second window on, or from the first after
    /// [`prepare_model`](Self::prepare_model)), the backward pass of the batch
    /// that completes a window reduce-scatters each gradient as soon as it is final (FSDP's
    /// post-backward reduce-scatter): afterwards [`gradients`](Self::gradients) holds this
    /// process's slice of every averaged gradient only (shaped `[1, .., 1, slice]`), as the
    /// optimizer steps the slices. Every
    /// process must call it for the same batches.
    pub fn backward<M: AutodiffModule<B>, const D: usize>(
        &mut self,
        loss: Tensor<B, D>,
        model: &M,
    ) {
        let loss = self.core.transform_loss(loss);
        // At ZeRO stage 3, the pass that completes a window reduce-scatters each gradient as
        // soon as it is final.
        let context = &self.context;
        self.core.backward_pass(model, || {
            // In the training's context: fp8's backward records its gradients' amaxes there.
            let _entered = context.enter();
            (GradientsParams::from_grads(loss.backward(), model), ())
        });
        self.core.end_pass();
    }

    /// The window's gradients so far (scaled, unless already unscaled this step).
    pub fn gradients(&self) -> &GradientsParams {
        self.core.gradients()
    }

    /// The window's gradients, to inspect or edit before the step.
    pub fn gradients_mut(&mut self) -> &mut GradientsParams {
        self.core.gradients_mut()
    }

    /// Unscales the window's gradients in place and records (on the device) whether they
    /// overflowed; at most once per optimizer step, and only on a batch that syncs (on the
    /// others the window is still being summed at the current scale). With several
    /// processes, the gradients are first averaged over them (every process must call it at
    /// the same batch, as every process runs the same loop).
    ///
    /// [`optimizer_step`](Self::optimizer_step) and the clipping functions call it; call it
    /// yourself to look at unscaled gradients before the step (Accelerate's
    /// `unscale_gradients`). Call it after the window's last [`backward`](Self::backward):
    /// gradients added afterwards would stay scaled, as with torch's `unscale_`.
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when the processes' gradients cannot be averaged (a
    /// process left, or did not come in time).
    pub fn unscale_gradients<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
    ) -> Result<(), AccelerateError> {
        self.core.unscale(model)
    }

    /// Clips the window's gradients to a global 2-norm of `max_norm`, after unscaling them
    /// (as Accelerate's `clip_grad_norm_` does), and returns the norm before clipping, on the
    /// device (reading it is a host synchronisation of its own).
    ///
    /// Returns `None` on a batch that does not sync (there is nothing final to clip yet) or
    /// when there are no gradients, so it can be called on every batch.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] unless `max_norm` is positive and finite; what
    /// [`unscale_gradients`](Self::unscale_gradients) returns.
    pub fn clip_grad_norm<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        max_norm: f32,
    ) -> Result<Option<Tensor<B::InnerBackend, 1>>, AccelerateError> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(AccelerateError::InvalidConfig {
                field: "max_norm",
                value: max_norm.to_string(),
                fix: "clip to a positive finite norm (to drop the gradients, skip the step instead)",
            });
        }
        self.core.clip_grad_norm(model, max_norm)
    }

    /// Clamps the window's gradients to `[-clip_value, clip_value]` after unscaling them (as
    /// Accelerate's `clip_grad_value_` does). Does nothing on a batch that does not sync.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] unless `clip_value` is positive and finite; what
    /// [`unscale_gradients`](Self::unscale_gradients) returns.
    pub fn clip_grad_value<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        clip_value: f32,
    ) -> Result<(), AccelerateError> {
        if !(clip_value.is_finite() && clip_value > 0.0) {
            return Err(AccelerateError::InvalidConfig {
                field: "clip_value",
                value: clip_value.to_string(),
                fix: "clip to a positive finite value",
            });
        }
        self.core.clip_grad_value(model, clip_value)
    }

    /// Drops the window's gradients on a batch that syncs, and does nothing on the others, as
    /// Accelerate's wrapped `optimizer.zero_grad()` does. [`optimizer_step`](Self::optimizer_step)
    /// already drops them after stepping, so a loop needs this only to discard a window.
    pub fn zero_grad(&mut self) {
        if self.core.state().sync_gradients() {
            self.core.zero_grad();
        }
    }

    /// The optimizer step of a batch: on a batch that completes its window, unscales the
    /// gradients (unless a clip already did), reads the overflow check (the step's one host
    /// synchronisation), then either steps the scheduler and the optimizer, or, on overflow,
    /// neither, leaving `model` bit for bit as it was. Updates the loss scale either way and
    /// drops the window's gradients. On the other batches it does nothing.
    ///
    /// Returns the model (Burn optimizers take it by value) and what happened.
    ///
    /// # Errors
    /// What [`unscale_gradients`](Self::unscale_gradients) returns (with several processes
    /// only).
    pub fn optimizer_step<M, O, S>(
        &mut self,
        optimizer: &mut O,
        model: M,
        scheduler: &mut S,
    ) -> Result<(M, StepOutcome), AccelerateError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        S: LrScheduler,
    {
        self.core.step(model, |model, grads| {
            let lr = scheduler.step();
            (optimizer.step(lr, model, grads), lr)
        })
    }

    /// `model`, prepared for training (Accelerate's `prepare_model`): at ZeRO stage 3
    /// ([`ZeroStage::Parameters`](crate::zero::ZeroStage::Parameters)) across processes, each
    /// process keeps only its slice of every parameter from here on, as after every step,
    /// instead of holding the whole model until the first step (FSDP shards a model when it
    /// wraps it). Parameters Burn has not initialised yet (`Module::init`'s lazy ones) are
    /// initialised one at a time and dropped once this process cut its slice, so a model
    /// larger than one process can hold never is whole. Every process must call it, at
    /// the same point, before the first forward pass. At other stages, or on one process, the
    /// model as it is.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::nn::{Linear, LinearConfig};
    /// # use burn_accelerate::{AccelerateConfig, Accelerated, zero::ZeroStage};
    /// # type B = Accelerated<Autodiff<Flex>>;
    /// # let device = Default::default();
    /// let mut accelerator = AccelerateConfig::new()
    ///     .with_zero_stage(ZeroStage::Parameters)
    ///     .init::<B>(&device)?;
    /// let model: Linear<B> = LinearConfig::new(4, 4).init(&device);
    /// let model = accelerator.prepare_model(model);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn prepare_model<M: AutodiffModule<B>>(&mut self, model: M) -> M {
        self.core.prepare_model(model)
    }

    /// The whole optimizer state on the main process, for a checkpoint (`None` on the other
    /// processes): give it the model the optimizer steps and the optimizer's own record.
    /// Every process must call it at the same step.
    ///
    /// At ZeRO stages 1 and 2 each process's optimizer holds its partition's state only: the
    /// parts are merged on the main process (torch's `consolidate_state_dict`), so the record
    /// is the one a stage 0 run saves, and resumes at any stage on any number of processes
    /// ([`shard_optimizer_record`](Self::shard_optimizer_record)). At stage 3 each holds its
    /// slice of every parameter's state: the slices are joined on the main process into the
    /// same record. Otherwise every process holds the whole state already and nothing is sent.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::module::Module;
    /// # use burn::nn::{Linear, LinearConfig};
    /// # use burn::optim::{AdamConfig, Optimizer};
    /// # use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
    /// # use burn_accelerate::{AccelerateConfig, zero::ZeroStage};
    /// # type B = Autodiff<Flex>;
    /// # let device = Default::default();
    /// # let model: Linear<B> = LinearConfig::new(4, 4).init(&device);
    /// let accelerator = AccelerateConfig::new()
    ///     .with_zero_stage(ZeroStage::Gradients)
    ///     .init::<B>(&device)?;
    /// let optimizer = AdamConfig::new().init::<B, Linear<B>>();
    /// // ... training ...
    /// let whole = accelerator.consolidate_optimizer_record(&model, optimizer.to_record())?;
    /// if let Some(record) = whole {
    ///     NamedMpkFileRecorder::<FullPrecisionSettings>::new().record(record, "optim".into())?;
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when a process left, or sent a state this process
    /// cannot read.
    pub fn consolidate_optimizer_record<M: AutodiffModule<B>, R: ParamStateRecord<B>>(
        &self,
        model: &M,
        record: R,
    ) -> Result<Option<R>, AccelerateError> {
        self.core
            .whole_optimizer_record(model, record, &self.device)
    }

    /// The whole record of `model` for a checkpoint, on the main process (`None` on the
    /// others): Burn's `into_record`, each parameter's save mapper applied, so any Burn
    /// program loads it without this crate. At ZeRO stage 3, where each process holds only
    /// its slice of every parameter between steps, every process sends its slices to the
    /// main process alone, point to point (FSDP's `FULL_STATE_DICT` on rank 0), which joins
    /// them: every process must call it at the same point, the processes other than the main
    /// one hold no parameter whole, and the model stays sharded. Otherwise the main process's
    /// own model is recorded and nothing is sent.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::nn::{Linear, LinearConfig};
    /// # use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
    /// # use burn_accelerate::{AccelerateConfig, zero::ZeroStage};
    /// # type B = Autodiff<Flex>;
    /// # let device = Default::default();
    /// # let model: Linear<B> = LinearConfig::new(4, 4).init(&device);
    /// let accelerator = AccelerateConfig::new()
    ///     .with_zero_stage(ZeroStage::Parameters)
    ///     .init::<B>(&device)?;
    /// // ... training ...
    /// if let Some(record) = accelerator.consolidate_model_record(&model)? {
    ///     NamedMpkFileRecorder::<FullPrecisionSettings>::new().record(record, "model".into())?;
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when the group cannot gather on the main process (a
    /// process that left, or whose model differs).
    pub fn consolidate_model_record<M: AutodiffModule<B>>(
        &self,
        model: &M,
    ) -> Result<Option<M::Record>, AccelerateError> {
        self.core.whole_model_record(model)
    }

    /// The part of a whole optimizer state (a checkpoint's, from
    /// [`consolidate_optimizer_record`](Self::consolidate_optimizer_record) or a stage 0 run)
    /// that this process steps at this run's ZeRO stage, for the optimizer's `load_record`:
    /// its own partition's at stages 1 and 2 (its slice of every parameter's at stage 3),
    /// whatever the number of processes that saved it; all of it otherwise. `model` is the
    /// model the optimizer steps (loaded from the same checkpoint: the state is keyed by its
    /// parameters' ids).
    ///
    /// # Errors
    /// [`AccelerateError::OptimizerState`] where ZeRO stage 3 cannot cut the record into this
    /// process's slices.
    pub fn shard_optimizer_record<M: AutodiffModule<B>, R: ParamStateRecord<B>>(
        &mut self,
        model: &M,
        record: R,
    ) -> Result<R, AccelerateError> {
        self.core.own_optimizer_record(model, record, &self.device)
    }

    // The process group of the steps, when there are several processes.
    pub(crate) fn core_group(&self) -> Option<&crate::distributed::ProcessGroup> {
        self.core.group()
    }

    /// The loss scale and gradient-state position, for a checkpoint.
    pub fn state(&self) -> AcceleratorState {
        AcceleratorState {
            loss_scale: *self.core.loss_scale(),
            gradient_state: self.core.state().snapshot(),
        }
    }

    /// Restores a checkpoint's [`state`](Self::state).
    ///
    /// # Errors
    /// [`AccelerateError::StateMismatch`] when the checkpoint was saved with different
    /// accumulation settings or another kind of loss scaling (none / static / dynamic).
    pub fn load_state(&mut self, saved: &AcceleratorState) -> Result<(), AccelerateError> {
        let g = &saved.gradient_state;
        crate::step::check_accumulation(
            g,
            self.config.gradient_accumulation_steps,
            self.config.sync_with_dataloader,
        )?;
        self.core.restore(g, saved.loss_scale)?;
        Ok(())
    }
}
