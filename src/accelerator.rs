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
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};
use serde::{Deserialize, Serialize};

use crate::autocast::{Autocast, AutocastConfig, AutocastGuard};
use crate::distributed::{
    self, ParamStateRecord, Partition, ProcessGroup, ProcessState, ZeroStage,
};
use crate::fp8::DelayedScaling;
use crate::gradient_state::{Accumulate, GradientState, GradientStateSnapshot};
use crate::grads::{self, OverflowCheck};
use crate::scaler::{GradScalerConfig, LossScale};
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
    /// of the parameters. Nothing changes for one process.
    #[config(default = "ZeroStage::None")]
    pub zero_stage: ZeroStage,
}

impl AccelerateConfig {
    /// Checks the settings, probes `device` for the precision and returns the autocast and
    /// the initial loss scale: the part of building an [`Accelerator`] that the training
    /// strategy shares.
    ///
    /// Everything is checked before the device probe, so that a wrong config costs nothing
    /// and changes no shared state.
    pub(crate) fn init_mixed_precision<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<(Autocast, LossScale), AccelerateError> {
        if self.gradient_accumulation_steps == 0 {
            return Err(AccelerateError::InvalidConfig {
                field: "gradient_accumulation_steps",
                value: "0".into(),
                fix: "set at least 1 (1 means no accumulation: the optimizer steps every batch)",
            });
        }
        self.grad_scaler.init(self.mixed_precision)?;
        let autocast = AutocastConfig::new(self.mixed_precision)
            .with_allow_fallback(self.allow_fallback)
            .with_allow_slow(self.allow_slow)
            .with_fp8_recipe(self.fp8_recipe)
            .init::<B>(device)?;
        let loss_scale = self.grad_scaler.init(autocast.precision())?;
        Ok((autocast, loss_scale))
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

/// What [`Accelerator::optimizer_step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// The optimizer stepped with this learning rate, and the scheduler advanced.
    Applied {
        /// The learning rate the scheduler gave for this step.
        lr: f64,
    },
    /// The scaled gradients held an inf or a NaN: neither the optimizer nor the scheduler
    /// stepped, the parameters are unchanged, the gradients were dropped and the loss scale
    /// backed off.
    SkippedOverflow,
    /// The window is not complete: the gradients are kept for the next batches.
    Accumulating,
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
/// `B: AutodiffBackend`, [`Accelerated`](crate::Accelerated) or not.
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
    loss_scale: LossScale,
    state: GradientState,
    grads: GradientsParams,
    // Some once this window's gradients are unscaled (by a clip, or `unscale_gradients`):
    // they must not be unscaled twice, and the step reads this check instead of a new one.
    unscaled: Option<OverflowCheck<B::InnerBackend>>,
    process: ProcessState,
    // The process group when there are several processes.
    group: Option<ProcessGroup>,
    // The parameters' owners, once the first sharded step saw the model.
    partition: Option<Partition>,
    // Where a consolidated optimizer state is read back to.
    device: B::Device,
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
        let (autocast, loss_scale) = config.init_mixed_precision::<B>(device)?;
        let process = ProcessState::from_env()?;
        let group = process
            .is_distributed()
            .then(|| process.group())
            .transpose()?;
        state.configure(
            config.gradient_accumulation_steps,
            config.sync_with_dataloader,
        )?;
        Ok(Self {
            config,
            autocast,
            loss_scale,
            state,
            grads: GradientsParams::new(),
            unscaled: None,
            process,
            group,
            partition: None,
            device: device.clone(),
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
    /// [`Accelerated`](crate::Accelerated) backend. Use
    /// [`Autocast::set_default`] on [`autocast_config`](Self::autocast_config) for every
    /// thread.
    #[must_use = "autocast is only on while the guard lives"]
    pub fn autocast(&self) -> AutocastGuard {
        self.autocast.enter()
    }

    /// The autocast checked against the device at construction.
    pub fn autocast_config(&self) -> &Autocast {
        &self.autocast
    }

    /// The loss scale in force.
    pub fn loss_scale(&self) -> &LossScale {
        &self.loss_scale
    }

    /// The gradient state this accelerator syncs with.
    pub fn gradient_state(&self) -> &GradientState {
        &self.state
    }

    /// Whether the current batch completes a window (Accelerate's `sync_gradients`).
    pub fn sync_gradients(&self) -> bool {
        self.state.sync_gradients()
    }

    /// Batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.state.num_steps()
    }

    /// Decides whether this batch syncs; keep the guard for the batch
    /// (`with accelerator.accumulate(model):`).
    ///
    /// The model is taken for parity with Accelerate, where it names the modules whose
    /// gradient all-reduce is held back while accumulating; here the gradients of every
    /// process are averaged only when a window completes, so nothing happens to it.
    #[must_use = "the accumulate guard marks the batch; keep it for the batch's backward and step"]
    pub fn accumulate<M: AutodiffModule<B>>(&self, _model: &M) -> Accumulate {
        self.state.accumulate()
    }

    /// Differentiates `loss / gradient_accumulation_steps × loss scale` and adds the
    /// gradients of `model`'s parameters to the window's.
    ///
    /// The division happens on every batch, as in Accelerate (see
    /// [`AccelerateConfig::divide_partial_window_by_length`] for the last partial window).
    pub fn backward<M: AutodiffModule<B>, const D: usize>(
        &mut self,
        loss: Tensor<B, D>,
        model: &M,
    ) {
        let steps = self.state.num_steps();
        let loss = if steps == 1 {
            loss
        } else {
            loss.div_scalar(steps as f32)
        };
        let loss = self.loss_scale.scale(loss);
        let grads = GradientsParams::from_grads(loss.backward(), model);
        grads::accumulate::<B, M>(model, &mut self.grads, grads);
        // fp8 keys its per-tensor scales by call order since the last step: one forward and
        // backward pass is one step of the delayed-scaling recipe.
        if matches!(self.config.mixed_precision, Precision::Fp8(_)) {
            crate::fp8::step();
        }
    }

    /// The window's gradients so far (scaled, unless already unscaled this step).
    pub fn gradients(&self) -> &GradientsParams {
        &self.grads
    }

    /// The window's gradients, to inspect or edit before the step.
    pub fn gradients_mut(&mut self) -> &mut GradientsParams {
        &mut self.grads
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
        if self.unscaled.is_some() || !self.state.sync_gradients() {
            return Ok(());
        }
        match (&self.group, self.sharded()) {
            (Some(group), Some(ZeroStage::Gradients)) => {
                let partition = self
                    .partition
                    .get_or_insert_with(|| Partition::of::<B, M>(model, group.world_size()));
                distributed::reduce_scatter_gradients::<B, M>(
                    group,
                    model,
                    &mut self.grads,
                    partition,
                )?;
            }
            (Some(group), _) => {
                distributed::all_reduce_gradients::<B, M>(group, model, &mut self.grads)?;
            }
            (None, _) => {}
        }
        let factor = self.unscale_factor();
        let check = if self.loss_scale.checks_overflow() {
            grads::unscale_and_check::<B, M>(model, &mut self.grads, factor)
        } else {
            grads::scale::<B, M>(model, &mut self.grads, factor);
            OverflowCheck::clean()
        };
        self.unscaled = Some(check);
        Ok(())
    }

    // The inverse loss scale, times k / n for a partial last window when asked to.
    fn unscale_factor(&self) -> f32 {
        let inv_scale = self.loss_scale.inv_scale();
        let steps = self.state.num_steps();
        let batches = self.state.window_batches();
        if self.config.divide_partial_window_by_length && batches > 0 && batches < steps {
            (f64::from(inv_scale) * steps as f64 / batches as f64) as f32
        } else {
            inv_scale
        }
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
        if !self.state.sync_gradients() {
            return Ok(None);
        }
        self.unscale_gradients(model)?;
        let (Some(group), Some(ZeroStage::Gradients)) = (&self.group, self.sharded()) else {
            return Ok(grads::clip_grad_norm::<B, M>(
                model,
                &mut self.grads,
                max_norm,
            ));
        };
        // Each process holds its partition's gradients: the global norm sums every process's
        // part (ShardedGradScaler's and FSDP's clip_grad_norm_).
        let local = grads::sum_of_squares::<B, M>(model, &self.grads);
        let mut total = [local
            .as_ref()
            .map_or(0.0, |t| t.clone().into_scalar().elem::<f32>())];
        group.all_reduce(&mut total, distributed::ReduceOp::Sum)?;
        let Some(local) = local else {
            return Ok(None);
        };
        let norm = Tensor::<B::InnerBackend, 1>::from_floats([total[0].sqrt()], &local.device());
        grads::clip_to_norm::<B, M>(model, &mut self.grads, norm.clone(), max_norm);
        Ok(Some(norm))
    }

    // The stage, when it shards anything (several processes).
    fn sharded(&self) -> Option<ZeroStage> {
        distributed::shards(self.config.zero_stage, self.group.as_ref())
            .then_some(self.config.zero_stage)
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
        if self.state.sync_gradients() {
            self.unscale_gradients(model)?;
            grads::clip_grad_value::<B, M>(model, &mut self.grads, clip_value);
        }
        Ok(())
    }

    /// Drops the window's gradients on a batch that syncs, and does nothing on the others, as
    /// Accelerate's wrapped `optimizer.zero_grad()` does. [`optimizer_step`](Self::optimizer_step)
    /// already drops them after stepping, so a loop needs this only to discard a window.
    pub fn zero_grad(&mut self) {
        if self.state.sync_gradients() {
            self.grads = GradientsParams::new();
            self.unscaled = None;
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
        if !self.state.sync_gradients() {
            return Ok((model, StepOutcome::Accumulating));
        }
        self.unscale_gradients(&model)?;
        let mut found_inf = self.unscaled.take().is_some_and(OverflowCheck::found_inf);
        let mut grads = core::mem::take(&mut self.grads);
        let sharded = self.sharded();
        if let (Some(group), Some(ZeroStage::Gradients)) = (&self.group, sharded) {
            // An inf in any partition skips the step on every process (ShardedGradScaler).
            let mut any = [u32::from(found_inf)];
            group.all_reduce(&mut any, distributed::ReduceOp::Sum)?;
            found_inf = any[0] > 0;
        }
        self.loss_scale = self.loss_scale.adjust(found_inf);
        if found_inf {
            return Ok((model, StepOutcome::SkippedOverflow));
        }
        let (Some(group), Some(stage)) = (&self.group, sharded) else {
            let lr = scheduler.step();
            return Ok((
                optimizer.step(lr, model, grads),
                StepOutcome::Applied { lr },
            ));
        };
        let partition = self
            .partition
            .get_or_insert_with(|| Partition::of::<B, M>(&model, group.world_size()));
        if stage == ZeroStage::OptimizerState {
            distributed::keep_own::<B, M>(&model, &mut grads, partition, group.rank());
        }
        let lr = scheduler.step();
        let model = optimizer.step(lr, model, grads);
        let model = distributed::share_parameters::<B, M>(group, model, partition)?;
        Ok((model, StepOutcome::Applied { lr }))
    }

    /// The whole optimizer state on the main process, for a checkpoint (`None` on the other
    /// processes): give it the model the optimizer steps and the optimizer's own record.
    /// Every process must call it at the same step.
    ///
    /// At ZeRO stages 1 and 2 each process's optimizer holds its partition's state only: the
    /// parts are merged on the main process (torch's `consolidate_state_dict`), so the record
    /// is the one a stage 0 run saves, and resumes at any stage on any number of processes
    /// ([`shard_optimizer_record`](Self::shard_optimizer_record)). Otherwise every process
    /// holds the whole state already and nothing is sent.
    ///
    /// ```no_run
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::module::Module;
    /// # use burn::nn::{Linear, LinearConfig};
    /// # use burn::optim::{AdamConfig, Optimizer};
    /// # use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
    /// # use burn_accelerate::{AccelerateConfig, distributed::ZeroStage};
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
        match (&self.group, self.sharded()) {
            (Some(group), Some(_)) => Ok(distributed::consolidate_state::<B, M, R>(
                group,
                model,
                record,
                0,
                &self.device,
            )?),
            _ => Ok(self.is_main_process().then_some(record)),
        }
    }

    /// The part of a whole optimizer state (a checkpoint's, from
    /// [`consolidate_optimizer_record`](Self::consolidate_optimizer_record) or a stage 0 run)
    /// that this process steps at this run's ZeRO stage, for the optimizer's `load_record`:
    /// its own partition's at stages 1 and 2, whatever the number of processes that saved
    /// it; all of it otherwise. `model` is the model the optimizer steps (loaded from the
    /// same checkpoint: the state is keyed by its parameters' ids).
    pub fn shard_optimizer_record<M: AutodiffModule<B>, R: ParamStateRecord<B>>(
        &mut self,
        model: &M,
        record: R,
    ) -> R {
        let Some(group) = self.group.as_ref().filter(|_| self.sharded().is_some()) else {
            return record;
        };
        // Anew: a model loaded from a checkpoint has the checkpoint's parameter ids.
        let partition = Partition::of::<B, M>(model, group.world_size());
        let own = distributed::keep_own_state(record, &partition, group.rank());
        self.partition = Some(partition);
        own
    }

    /// The loss scale and gradient-state position, for a checkpoint.
    pub fn state(&self) -> AcceleratorState {
        AcceleratorState {
            loss_scale: self.loss_scale,
            gradient_state: self.state.snapshot(),
        }
    }

    /// Restores a checkpoint's [`state`](Self::state).
    ///
    /// # Errors
    /// [`AccelerateError::StateMismatch`] when the checkpoint was saved with different
    /// accumulation settings or another kind of loss scaling (none / static / dynamic).
    pub fn load_state(&mut self, saved: &AcceleratorState) -> Result<(), AccelerateError> {
        let g = &saved.gradient_state;
        if g.num_steps != self.config.gradient_accumulation_steps {
            return Err(AccelerateError::StateMismatch {
                what: "gradient_accumulation_steps",
                saved: g.num_steps.to_string(),
                current: self.config.gradient_accumulation_steps.to_string(),
            });
        }
        if g.sync_with_dataloader != self.config.sync_with_dataloader {
            return Err(AccelerateError::StateMismatch {
                what: "sync_with_dataloader",
                saved: g.sync_with_dataloader.to_string(),
                current: self.config.sync_with_dataloader.to_string(),
            });
        }
        let kind = |s: &LossScale| match s {
            LossScale::None => "no loss scaling",
            LossScale::Static { .. } => "a static loss scale",
            LossScale::Dynamic(_) => "a dynamic loss scale",
        };
        if kind(&saved.loss_scale) != kind(&self.loss_scale) {
            return Err(AccelerateError::StateMismatch {
                what: "loss scaling",
                saved: kind(&saved.loss_scale).into(),
                current: kind(&self.loss_scale).into(),
            });
        }
        self.state.restore(g)?;
        self.loss_scale = saved.loss_scale;
        self.grads = GradientsParams::new();
        self.unscaled = None;
        Ok(())
    }
}
