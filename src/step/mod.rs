//! What a training step is, written once: the loss scale, the gradient-accumulation window
//! and its divisor ([`LossTransform`] and the rule beside it), the gradient sync (none, an
//! all-reduce, ZeRO stage 1 or 2 over its partition, or stage 3 over slices of every
//! parameter), the agreement on overflow, clipping by the global norm, the fp8 recipe's step,
//! and the optimizer step over the parameters (or, at stage 3, the slices) this process owns.
//!
//! The [`Accelerator`](crate::Accelerator) (a hand-written loop's calls) and the
//! `with_accelerate` strategy ([`train`](crate::train), Burn's events) are adapters over one
//! `StepCore`, as DDP, ZeRO and torch's optimizers sit on one `Reducer`: a fix here is a fix in
//! both, and the same model, data and settings give the same bits through either
//! (`tests/step_core.rs`).
//!
//! The divisor rule, once: every batch's loss is divided by the window's length `k` and
//! multiplied by the loss scale before it is differentiated, as Accelerate's
//! `accelerator.backward` does (the `Accelerator` transforms the loss it is given; the strategy
//! arms the decorator's `backward` with the same transform for the user's `TrainStep`). When the
//! window completes, its summed gradients are averaged over the processes, multiplied once by
//! the inverse scale (times `k / n` for a partial last window of `n` batches where the
//! configuration asks for it, divided by the devices of a data-parallel process) and checked
//! for overflow. Burn's own `grads_accumulation` sums its window instead: nothing divides by
//! its length.

pub(crate) mod divisor;
pub(crate) mod restore;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};

pub use divisor::LossTransform;
use divisor::Window;
pub(crate) use restore::{check_accumulation, restore_position};

use crate::context::Context;
use crate::distributed::{self, ProcessGroup};
use crate::error::AccelerateError;
use crate::gradient_state::{GradientState, GradientStateSnapshot};
use crate::grads::{self, OverflowCheck};
use crate::scaler::LossScale;
use crate::zero::{self, ParamStateRecord, Partition, ZeroStage};

/// What a batch's optimizer step did ([`Accelerator::optimizer_step`](crate::Accelerator::optimizer_step)).
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

/// What the step reads of the configuration
/// ([`AccelerateConfig`](crate::AccelerateConfig)'s fields of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepSettings {
    pub divide_partial_window_by_length: bool,
    pub zero_stage: ZeroStage,
    pub max_grad_norm: Option<f32>,
    // `mixed_precision` is fp8.
    pub fp8: bool,
}

/// One training loop's step state and the step itself (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct StepCore<B: AutodiffBackend> {
    state: GradientState,
    window: Window,
    loss_scale: LossScale,
    grads: GradientsParams,
    // Some once this window's gradients are unscaled (by a clip, or on request): they must
    // not be unscaled twice, and the step reads this check instead of a new one.
    unscaled: Option<OverflowCheck<B::InnerBackend>>,
    group: Option<ProcessGroup>,
    zero_stage: ZeroStage,
    // The parameters' owners, once a sharded step saw the model (at stage 3, the layout of a
    // sharded checkpoint's files).
    partition: Option<Partition>,
    // Model replicas on this process's devices whose gradients the window sums.
    replicas: usize,
    max_grad_norm: Option<f32>,
    // Clipped this window (by the loop, or by `max_grad_norm`).
    clipped: bool,
    fp8: bool,
    // The training's context, entered for fp8's step: the forward passes recorded their amaxes
    // in its fp8 state, whichever thread ends the pass.
    context: Option<Context>,
    // Stage 3: this window's gradients were reduce-scattered in its last backward pass
    // (`zero::post_backward`); `grads` holds this process's slices of the means.
    reduced_in_backward: bool,
    // Stage 3: gradients of backward passes after that one in the same window (a loop that
    // differentiates twice before its step), reduce-scattered at the unscale.
    unreduced: GradientsParams,
    // Stage 3: the parameters were released (by `prepare_model` or a step) and not gathered
    // whole since. Before that no pass reduces in backward, and the model handed to
    // `backward_pass` is not visited: a lazy parameter of a copy (the strategy's, taken
    // before Burn's first forward pass initialises the learner's own) would be initialised
    // apart, drawing from the RNG.
    released: bool,
}

impl<B: AutodiffBackend> StepCore<B> {
    /// A step as `settings` say, counting batches with `state` (configured already), starting
    /// at `loss_scale`, averaging over `group` when there are several processes.
    pub fn new(
        settings: StepSettings,
        loss_scale: LossScale,
        state: GradientState,
        group: Option<ProcessGroup>,
    ) -> Self {
        let window = Window {
            steps: state.num_steps(),
            sums: false,
            divide_partial_by_length: settings.divide_partial_window_by_length,
            loss_divided: true,
        };
        Self {
            state,
            window,
            loss_scale,
            grads: GradientsParams::new(),
            unscaled: None,
            group,
            zero_stage: settings.zero_stage,
            partition: None,
            replicas: 1,
            max_grad_norm: settings.max_grad_norm,
            clipped: false,
            fp8: settings.fp8,
            context: None,
            reduced_in_backward: false,
            unreduced: GradientsParams::new(),
            released: false,
        }
    }

    /// The window's gradients are summed, as Burn's `grads_accumulation` sums them.
    pub fn summing_the_window(mut self) -> Self {
        self.window.sums = true;
        self
    }

    /// The losses are differentiated as they are (a backend whose `backward` cannot be
    /// armed): the window's sum is divided by its length instead.
    pub fn dividing_the_window(mut self) -> Self {
        self.window.loss_divided = false;
        self
    }

    /// The window sums the gradients of `replicas` model replicas a batch (one per device of
    /// a data-parallel process), averaged when it completes.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// The gradient state the window is counted with.
    pub fn state(&self) -> &GradientState {
        &self.state
    }

    /// What a batch's loss goes through before it is differentiated.
    pub fn loss_transform(&self) -> LossTransform {
        LossTransform {
            divisor: self.window.loss_divisor(),
            scale: match self.loss_scale {
                LossScale::None => None,
                _ => Some(self.loss_scale.loss_scale()),
            },
        }
    }

    /// The loss to differentiate, for a loop that calls `backward` itself.
    pub fn transform_loss<const D: usize>(&self, loss: Tensor<B, D>) -> Tensor<B, D> {
        self.loss_transform().apply(loss)
    }

    /// Adds one backward pass's gradients to the window.
    pub fn add_gradients<M: AutodiffModule<B>>(&mut self, model: &M, grads: GradientsParams) {
        if self.reduced_in_backward {
            // Not reduced, unlike the window's: kept apart until the unscale reduces them.
            grads::accumulate::<B, M>(model, &mut self.unreduced, grads);
        } else {
            grads::accumulate::<B, M>(model, &mut self.grads, grads);
        }
    }

    /// One backward pass through `model`: `pass` differentiates the loss (the forward pass
    /// may run inside it too) and returns the gradients it found for `model`'s parameters,
    /// with anything else it made (`R`); the gradients go to the window. Both entry points
    /// differentiate through here: the [`Accelerator`](crate::Accelerator)'s `backward`, and
    /// the strategy around the user's `TrainStep`, whose `loss.backward()` is the pass.
    ///
    /// At ZeRO stage 3 (parameters released, on the decorator), the pass that completes a
    /// window (its first such pass) reduce-scatters each parameter's gradient as soon as it is
    /// final, the window's earlier sums included (`zero::post_backward`), and the parameters
    /// the pass does not reach are reduced after it: afterwards this process holds its slice
    /// of every gradient only. `model` must hold the very parameter values the pass
    /// reads (the same tensors, not a lazy copy initialised apart): their autodiff nodes are
    /// what the window's sums are handed to. It is visited only once the parameters were
    /// released (`prepare_model`, or a step).
    pub fn backward_pass<M: AutodiffModule<B>, R>(
        &mut self,
        model: &M,
        pass: impl FnOnce() -> (GradientsParams, R),
    ) -> R {
        let reduces = !self.reduced_in_backward
            && self.released
            && self.state.sync_gradients()
            && self
                .sharded()
                .is_some_and(|(_, stage)| stage.shards_parameters())
            && zero::post_backward::begin::<B, M>(model, &mut self.grads);
        if reduces {
            self.reduced_in_backward = true;
        }
        let (mut grads, made) = pass();
        // Any anchor left was made by a forward pass that was not differentiated (an
        // evaluation on the training model): the next pass makes its own.
        zero::discard_anchors();
        if reduces {
            zero::post_backward::end::<B, M>(model, &mut grads);
            grads::accumulate::<B, M>(model, &mut self.grads, grads);
        } else {
            self.add_gradients(model, grads);
        }
        made
    }

    /// Ends one forward and backward pass (on every device): one step of fp8's delayed-scaling
    /// recipe, whose per-tensor scales are keyed by call order since the last one.
    pub fn end_pass(&self) {
        if self.fp8 {
            let _entered = self.context.as_ref().map(Context::enter);
            crate::fp8::step();
        }
    }

    /// This step with the training's `context`, whose fp8 state [`end_pass`](Self::end_pass)
    /// steps (without one, the thread's).
    pub fn with_context(mut self, context: Context) -> Self {
        self.context = Some(context);
        self
    }

    /// The window's gradients so far.
    pub fn gradients(&self) -> &GradientsParams {
        &self.grads
    }

    /// The window's gradients, to edit.
    pub fn gradients_mut(&mut self) -> &mut GradientsParams {
        &mut self.grads
    }

    /// Drops the window's gradients.
    pub fn zero_grad(&mut self) {
        self.grads = GradientsParams::new();
        self.unscaled = None;
        self.clipped = false;
        self.reduced_in_backward = false;
        self.unreduced = GradientsParams::new();
    }

    /// The loss scale in force.
    pub fn loss_scale(&self) -> &LossScale {
        &self.loss_scale
    }

    /// Replaces the loss scale (a restored checkpoint's).
    pub fn set_loss_scale(&mut self, loss_scale: LossScale) {
        self.loss_scale = loss_scale;
    }

    /// The process group, when there are several processes.
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.group.as_ref()
    }

    /// The group and the ZeRO stage, when the stage shards anything (several processes).
    pub fn sharded(&self) -> Option<(&ProcessGroup, ZeroStage)> {
        let group = self.group.as_ref()?;
        zero::shards(self.zero_stage, Some(group)).then_some((group, self.zero_stage))
    }

    /// The parameters' owners for `model` (computed at the first call), when sharded.
    pub fn partition<M: AutodiffModule<B>>(&mut self, model: &M) -> Option<&Partition> {
        let world = self.sharded()?.0.world_size();
        Some(
            self.partition
                .get_or_insert_with(|| Partition::of::<B, M>(model, world)),
        )
    }

    /// Goes on from a checkpoint's position and loss scale (see [`restore_position`]), with
    /// no gradients.
    ///
    /// # Errors
    /// What [`restore_position`] returns; nothing changes then.
    pub fn restore(
        &mut self,
        saved: &GradientStateSnapshot,
        saved_scale: LossScale,
    ) -> Result<(), AccelerateError> {
        restore_position(&self.state, &self.loss_scale, saved, &saved_scale)?;
        self.set_loss_scale(saved_scale);
        self.zero_grad();
        Ok(())
    }

    /// The whole optimizer state, for a checkpoint, on process 0 (`None` on the others),
    /// from this process's `record` of it: merged from every process's partition when
    /// sharded (every process must call it at the same step), as it is otherwise. Its
    /// tensors go to `device`.
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when a process left, or sent a state this process
    /// cannot read.
    pub fn whole_optimizer_record<M: AutodiffModule<B>, R: ParamStateRecord<B>>(
        &self,
        model: &M,
        record: R,
        device: &B::Device,
    ) -> Result<Option<R>, AccelerateError> {
        match self.sharded() {
            Some((group, stage)) => Ok(zero::consolidate_state::<B, M, R>(
                group,
                model,
                record,
                0,
                stage.shards_parameters(),
                device,
            )?),
            None => Ok(self
                .group
                .as_ref()
                .is_none_or(|group| group.rank() == 0)
                .then_some(record)),
        }
    }

    /// The whole record of `model`, for a checkpoint, on process 0 (`None` on the others):
    /// gathered parameter by parameter from every process's slice at ZeRO stage 3 (every
    /// process must call it at the same point; see [`zero::gather_model_record`]), the main
    /// process's own model's otherwise (the others hold the same model, and send nothing).
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] for a group that cannot gather on process 0.
    pub fn whole_model_record<M: AutodiffModule<B>>(
        &self,
        model: &M,
    ) -> Result<Option<M::Record>, AccelerateError> {
        match self.sharded() {
            Some((group, stage)) if stage.gathers_whole_model() => {
                Ok(zero::gather_model_record::<B, M>(group, model, 0)?)
            }
            _ => Ok(self
                .group
                .as_ref()
                .is_none_or(|group| group.rank() == 0)
                .then(|| model.clone().into_record())),
        }
    }

    /// `model` with every parameter whole on this process, for what follows the training: at
    /// ZeRO stage 3 each released parameter is gathered from every process's slice (every
    /// process must call it at the same point; see [`zero::gather_model`]) and no parameter is
    /// gathered at its uses any more; otherwise `model`, whose parameters are whole already.
    pub fn whole_model<M: AutodiffModule<B>>(&self, model: M) -> M {
        match self.sharded() {
            Some((_, stage)) if stage.gathers_whole_model() => {
                let model = zero::gather_model::<B, M>(model);
                zero::end_sharding();
                model
            }
            _ => model,
        }
    }

    /// The part of a whole optimizer `record` (a checkpoint's, or a fresh optimizer's) that
    /// this process steps: its partition's when sharded (at stage 3, its slice of every
    /// parameter's state, on `device`), all of it otherwise. The partition is computed anew
    /// from `model` (one loaded from a checkpoint has the checkpoint's parameter ids) and kept
    /// for the steps.
    ///
    /// # Errors
    /// [`AccelerateError::OptimizerState`] where stage 3 cannot slice the record.
    pub fn own_optimizer_record<M: AutodiffModule<B>, R: ParamStateRecord<B>>(
        &mut self,
        model: &M,
        record: R,
        device: &B::Device,
    ) -> Result<R, AccelerateError> {
        let Some((group, stage)) = self.sharded() else {
            return Ok(record);
        };
        let (rank, world) = (group.rank(), group.world_size());
        let partition = Partition::of::<B, M>(model, world);
        let own = if stage.shards_parameters() {
            zero::keep_own_slices::<B, M, R>(model, record, world, rank, device)
                .map_err(|reason| AccelerateError::OptimizerState { reason })?
        } else {
            zero::keep_own_state(record, &partition, rank)
        };
        self.partition = Some(partition);
        Ok(own)
    }

    /// Averages the window's gradients over the processes (at stage 2, this process's
    /// partition's only; at stage 3, this process's slices), unscales them and records whether
    /// they overflowed: once per window, on the batch that completes it, and nowhere else.
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when the processes' gradients cannot be averaged.
    pub fn unscale<M: AutodiffModule<B>>(&mut self, model: &M) -> Result<(), AccelerateError> {
        if self.unscaled.is_some() || !self.state.sync_gradients() {
            return Ok(());
        }
        match self.sharded().map(|(_, stage)| stage.scatters_gradients()) {
            // Stage 3 reduced them in the window's last backward pass; a later pass's are
            // reduce-scattered here and added.
            Some(true) if self.reduced_in_backward => {
                if !self.unreduced.is_empty() {
                    let Some(group) = &self.group else {
                        unreachable!("sharded, so a group");
                    };
                    let mut late = core::mem::take(&mut self.unreduced);
                    zero::reduce_scatter_slices::<B, M>(group, model, &mut late)?;
                    grads::accumulate::<B, M>(model, &mut self.grads, late);
                }
            }
            Some(true) => {
                if self.partition.is_none()
                    && let Some(group) = &self.group
                {
                    // Before the first partition: processes whose models differ fail naming
                    // the parameter, not inside the reduce-scatter.
                    zero::check_same_model::<B, M>(group, model)?;
                }
                self.partition(model);
                let (Some(group), Some(partition)) = (&self.group, &self.partition) else {
                    unreachable!("sharded, so a group and its partition");
                };
                if self.zero_stage.shards_parameters() {
                    zero::reduce_scatter_slices::<B, M>(group, model, &mut self.grads)?;
                } else {
                    zero::reduce_scatter_gradients::<B, M>(
                        group,
                        model,
                        &mut self.grads,
                        partition,
                    )?;
                }
            }
            _ => {
                if let Some(group) = &self.group {
                    distributed::all_reduce_gradients::<B, M>(group, model, &mut self.grads)?;
                }
            }
        }
        let factor = divisor::unscale_factor(
            &self.window,
            self.loss_scale.inv_scale(),
            self.state.window_batches(),
            self.replicas,
        );
        let check = if self.loss_scale.checks_overflow() {
            grads::unscale_and_check::<B, M>(model, &mut self.grads, factor)
        } else {
            grads::scale::<B, M>(model, &mut self.grads, factor);
            OverflowCheck::clean()
        };
        self.unscaled = Some(check);
        Ok(())
    }

    /// Clips the window's gradients, unscaled first, to a global 2-norm of `max_norm` and
    /// returns the norm before clipping (`None` on a batch that does not sync, or without
    /// gradients). Sharded at stages 2 and 3, the norm sums every process's part (its
    /// partition's gradients, or its slices).
    ///
    /// # Errors
    /// What [`unscale`](Self::unscale) returns; [`AccelerateError::Distributed`] when the
    /// partitions' norms cannot be summed.
    pub fn clip_grad_norm<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        max_norm: f32,
    ) -> Result<Option<Tensor<B::InnerBackend, 1>>, AccelerateError> {
        if !self.state.sync_gradients() {
            return Ok(None);
        }
        self.unscale(model)?;
        self.clipped = true;
        let (Some(group), Some(true)) = (
            &self.group,
            self.sharded().map(|(_, stage)| stage.scatters_gradients()),
        ) else {
            return Ok(grads::clip_grad_norm::<B, M>(
                model,
                &mut self.grads,
                max_norm,
            ));
        };
        // Each process holds its part of the gradients (a partition's, or slices): the global
        // norm sums every process's part (ShardedGradScaler's and FSDP's clip_grad_norm_).
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

    /// Clamps the window's gradients, unscaled first, to `[-clip_value, clip_value]`; nothing
    /// on a batch that does not sync.
    ///
    /// # Errors
    /// What [`unscale`](Self::unscale) returns.
    pub fn clip_grad_value<M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        clip_value: f32,
    ) -> Result<(), AccelerateError> {
        if self.state.sync_gradients() {
            self.unscale(model)?;
            grads::clip_grad_value::<B, M>(model, &mut self.grads, clip_value);
        }
        Ok(())
    }

    /// The optimizer step of a batch. On a batch that completes its window: unscales the
    /// gradients (unless done), clips them to `max_grad_norm` (unless the loop clipped),
    /// agrees with the other processes on an overflow (stages 2 and 3: each checked its own
    /// part), adjusts the loss scale, and then either skips the step or runs `apply` (the
    /// scheduler's and the optimizer's step: it returns the model and the learning rate) on
    /// this process's gradients (at stage 1, its partition's), after which every parameter
    /// comes from its owner. At stage 3 `apply` is given the model of this process's slices
    /// and their gradients (`zero::to_slices`), and the stepped slices are released again
    /// until the parameters' next use (on a skipped step the parameters are released as they
    /// were). Drops the window's gradients either way. Elsewhere, nothing.
    ///
    /// # Errors
    /// [`AccelerateError::Distributed`] when the processes cannot average, agree or share.
    pub fn step<M: AutodiffModule<B>>(
        &mut self,
        model: M,
        apply: impl FnOnce(M, GradientsParams) -> (M, f64),
    ) -> Result<(M, StepOutcome), AccelerateError> {
        if !self.state.sync_gradients() {
            return Ok((model, StepOutcome::Accumulating));
        }
        self.unscale(&model)?;
        if let Some(max_norm) = self.max_grad_norm.filter(|_| !self.clipped) {
            self.clip_grad_norm(&model, max_norm)?;
        }
        let found_inf = self.unscaled.take().is_some_and(OverflowCheck::found_inf);
        let grads = core::mem::take(&mut self.grads);
        self.clipped = false;
        self.reduced_in_backward = false;
        let found_inf = self.agree_on_overflow(found_inf)?;
        self.set_loss_scale(self.loss_scale.adjust(found_inf));
        if found_inf {
            // A skipped step leaves the parameters as they were: sharded at rest, as after a
            // step, where the stage keeps them so.
            let model = self.release(model);
            return Ok((model, StepOutcome::SkippedOverflow));
        }
        let Some((_, stage)) = self.sharded() else {
            let (model, lr) = apply(model, grads);
            return Ok((model, StepOutcome::Applied { lr }));
        };
        self.partition(&model);
        let (Some(group), Some(partition)) = (&self.group, &self.partition) else {
            unreachable!("sharded, so a group and its partition");
        };
        let mut grads = grads;
        if stage.drops_others_gradients() {
            zero::keep_own::<B, M>(&model, &mut grads, partition, group.rank());
        }
        let model = if stage.shards_parameters() {
            // The optimizer steps this process's slices, and reads nothing else: no
            // collective from here to the release.
            let model = zero::to_slices::<B, M>(group, model);
            zero::end_gathers();
            model
        } else {
            model
        };
        let (model, lr) = apply(model, grads);
        let model = if stage.shards_parameters() {
            let model = zero::release_stepped::<B, M>(group, model);
            self.released = group.world_size() > 1;
            model
        } else {
            zero::share_parameters::<B, M>(group, model, partition)?
        };
        Ok((model, StepOutcome::Applied { lr }))
    }

    /// `model` before its first step: at ZeRO stage 3 across processes, every parameter
    /// released (this process keeping its slice), as after a step (the first window is then
    /// sharded too); otherwise `model` as it is. Every process must call it at the same point.
    /// A model released already (by another core's `prepare_model`, the strategy's, or a
    /// sharded checkpoint's resume) is taken as it is: released again, each placeholder would
    /// only be replaced by another.
    pub fn prepare_model<M: AutodiffModule<B>>(&mut self, model: M) -> M {
        let shards_parameters = self
            .sharded()
            .is_some_and(|(_, stage)| stage.shards_parameters());
        if shards_parameters && zero::holds_released::<B, M>(&model) {
            self.partition(&model);
            self.released = true;
            return model;
        }
        self.release(model)
    }

    // Where the stage keeps the parameters sharded between steps: every parameter released
    // (this process keeping its slice), to be gathered at its next use. Elsewhere the model.
    fn release<M: AutodiffModule<B>>(&mut self, model: M) -> M {
        match self.sharded() {
            Some((group, stage)) if stage.shards_parameters() => {
                let model = zero::release_parameters::<B, M>(group, model);
                self.released = true;
                model
            }
            _ => model,
        }
    }

    // At stages 2 and 3 each process checked its own part: an inf in any skips the step on
    // every process (ShardedGradScaler). Elsewhere every process checked the same gradients.
    fn agree_on_overflow(&self, found_inf: bool) -> Result<bool, AccelerateError> {
        let Some((group, _)) = self
            .sharded()
            .filter(|(_, stage)| stage.scatters_gradients())
        else {
            return Ok(found_inf);
        };
        let mut any = [u32::from(found_inf)];
        group.all_reduce(&mut any, distributed::ReduceOp::Sum)?;
        Ok(any[0] > 0)
    }
}
