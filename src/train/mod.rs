//! `with_accelerate` on Burn's [`SupervisedTraining`]: Accelerate's training semantics inside
//! Burn's own training loop, keeping its metrics, renderer, checkpointer, early stopping and
//! interrupter.
//!
//! ```text
//! type Backend = Accelerated<Autodiff<Flex>>;
//! let strategy = AccelerateStrategy::new(AccelerateConfig::new()
//!     .with_mixed_precision(Precision::Bf16)
//!     .with_gradient_accumulation_steps(4), device)?;
//! let report = strategy.report(); // skipped steps, loss scale, precision, steps per epoch
//! let result = SupervisedTraining::new(dir, train, valid)
//!     .with_accelerate(strategy)
//!     .launch(learner);
//! ```
//!
//! Where the loop differs from Burn 0.21's single-device one:
//! - the last batch of an epoch always completes its gradient-accumulation window (Burn drops
//!   a partial last window), when `sync_with_dataloader` is on (the default);
//! - each batch's gradients are divided by `gradient_accumulation_steps`, as Accelerate divides
//!   the loss (gradients are linear in the loss, so dividing them is the same division);
//! - the learning-rate scheduler steps once per optimizer step (Burn steps it every batch);
//! - with loss scaling (fp16), the user's unmodified `loss.backward()` is scaled through the
//!   armed scale ([`ArmedLossScale`]), the window's gradients are unscaled and checked with one
//!   host read, and on overflow neither the optimizer nor the scheduler steps;
//! - autocast is the process default for the whole fit, so training and validation, on any
//!   thread, run in the precision asked for.
//!
//! Autocast and the armed loss scale are process-wide: run one accelerated training per
//! process at a time (tests that train must not run in parallel with each other).
//!
//! With [`AccelerateStrategy::with_checkpoint_dir`], the loss scale and gradient state are
//! saved beside each of Burn's checkpoints and restored by `.checkpoint(epoch)`.
//!
//! The loss scale and skipped steps show in Burn's dashboard and logs as [`metrics`].
//!
//! Not yet here: Burn's multi-device and DDP execution (the strategy trains on one device),
//! and the data loader's position in the checkpoints (a resumed run sees another shuffle than
//! the interrupted one would have).

pub mod demo;
pub mod metrics;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use burn::config::Config;

use burn::data::dataloader::Progress;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Tensor};
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningComponentsTypes, SupervisedLearningStrategy, SupervisedTraining,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingBackend, TrainingComponents,
    TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};

use crate::autocast::{self, Autocast};
use crate::gradient_state::GradientState;
use crate::grads;
use crate::scaler::{ArmedLossScale, LossScale};
use crate::{AccelerateConfig, AccelerateError, AcceleratorState, Precision};

/// Adds [`with_accelerate`](WithAccelerate::with_accelerate) to Burn's training builder.
pub trait WithAccelerate<LC: LearningComponentsTypes>: Sized {
    /// Trains with `strategy`'s Accelerate semantics (see the [module docs](crate::train)), replacing
    /// the training strategy set so far.
    fn with_accelerate(self, strategy: AccelerateStrategy<LC>) -> Self;
}

impl<LC: LearningComponentsTypes + 'static> WithAccelerate<LC> for SupervisedTraining<LC> {
    fn with_accelerate(self, strategy: AccelerateStrategy<LC>) -> Self {
        self.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
    }
}

/// What an accelerated training did, per epoch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpochReport {
    /// The epoch (1-based, as Burn counts).
    pub epoch: usize,
    /// Training batches processed.
    pub batches: usize,
    /// Optimizer steps applied.
    pub optimizer_steps: usize,
    /// Learning-rate scheduler steps taken.
    pub scheduler_steps: usize,
    /// Optimizer steps skipped because the scaled gradients overflowed.
    pub skipped_steps: usize,
    /// The loss scale at the end of the epoch (1 without loss scaling).
    pub loss_scale: f32,
}

/// What an accelerated training did so far: precision, loss scale and step counts.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingStats {
    /// The precision asked for.
    pub requested: Precision,
    /// The precision the ops ran in (f32 after a fallback).
    pub precision: Precision,
    /// Whether the device could not run `requested` and f32 was used instead.
    pub fell_back: bool,
    /// The loss scale in force (after the last optimizer step).
    pub loss_scale: LossScale,
    /// Every epoch trained, in order.
    pub epochs: Vec<EpochReport>,
    // Skipped steps so far, the current epoch included (for the live metric).
    skipped_live: usize,
}

impl TrainingStats {
    /// Optimizer steps skipped on overflow, over all epochs.
    pub fn skipped_steps(&self) -> usize {
        self.epochs.iter().map(|e| e.skipped_steps).sum()
    }

    /// Optimizer steps applied, over all epochs.
    pub fn optimizer_steps(&self) -> usize {
        self.epochs.iter().map(|e| e.optimizer_steps).sum()
    }
}

/// A handle on an [`AccelerateStrategy`]'s [`TrainingStats`], readable during and after
/// training (the strategy itself moves into Burn's builder).
#[derive(Debug, Clone)]
pub struct TrainingReport {
    inner: Arc<Mutex<TrainingStats>>,
}

impl TrainingReport {
    /// A copy of the statistics now.
    pub fn stats(&self) -> TrainingStats {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TrainingStats> {
        // The stats are plain counters: a panic elsewhere leaves them usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Burn's single-device training strategy with Accelerate's semantics; install it with
/// [`WithAccelerate::with_accelerate`].
pub struct AccelerateStrategy<LC: LearningComponentsTypes> {
    device: Device<TrainingBackend<LC>>,
    config: AccelerateConfig,
    autocast: Autocast,
    initial_scale: LossScale,
    state: GradientState,
    report: TrainingReport,
    checkpoint_dir: Option<PathBuf>,
}

/// The loss scale and gradient-state position saved beside Burn's checkpoint of an epoch
/// (`accelerate-<epoch>.json`), so that a run resumed with `.checkpoint(epoch)` goes on with
/// the scale the interrupted run had reached instead of overflowing again from the initial one.
#[derive(Config, Debug)]
pub struct AccelerateCheckpoint {
    /// The saved state.
    pub state: AcceleratorState,
}

impl AccelerateCheckpoint {
    /// The file that holds epoch `epoch`'s state in `dir`.
    pub fn path(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(format!("accelerate-{epoch}.json"))
    }

    /// Writes it for `epoch` into `dir`.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when the file cannot be written.
    pub fn save_epoch(&self, dir: &Path, epoch: usize) -> Result<(), AccelerateError> {
        let path = Self::path(dir, epoch);
        std::fs::create_dir_all(dir)
            .and_then(|()| self.save(&path))
            .map_err(|e| AccelerateError::Checkpoint {
                path: path.display().to_string(),
                reason: e.to_string(),
            })
    }

    /// Reads epoch `epoch`'s state from `dir`; `None` when there is no such file.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when the file exists but cannot be read or parsed.
    pub fn load_epoch(dir: &Path, epoch: usize) -> Result<Option<Self>, AccelerateError> {
        let path = Self::path(dir, epoch);
        if !path.exists() {
            return Ok(None);
        }
        Self::load(&path)
            .map(Some)
            .map_err(|e| AccelerateError::Checkpoint {
                path: path.display().to_string(),
                reason: e.to_string(),
            })
    }
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    /// A strategy training on `device` as `config` says.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for zero accumulation steps or an invalid scaler
    /// setting; [`AccelerateError::UnsupportedPrecision`] when the device cannot run
    /// `mixed_precision` and `allow_fallback` is off;
    /// [`AccelerateError::NotAccelerated`] for bf16 or f16 on a training backend that is not
    /// [`Accelerated`](crate::Accelerated) (autocast would do nothing there).
    pub fn new(
        config: AccelerateConfig,
        device: &Device<TrainingBackend<LC>>,
    ) -> Result<Self, AccelerateError> {
        let (autocast, initial_scale) =
            config.init_mixed_precision::<TrainingBackend<LC>>(device)?;
        ensure_accelerated::<TrainingBackend<LC>>(&autocast, device)?;
        // A gradient state of its own: the process-wide one may be configured by a
        // hand-written loop's `Accelerator` with other settings.
        let state = GradientState::new();
        state.configure(
            config.gradient_accumulation_steps,
            config.sync_with_dataloader,
        )?;
        let report = TrainingReport {
            inner: Arc::new(Mutex::new(TrainingStats {
                requested: autocast.requested(),
                precision: autocast.precision(),
                fell_back: autocast.fell_back(),
                loss_scale: initial_scale,
                epochs: Vec::new(),
                skipped_live: 0,
            })),
        };
        Ok(Self {
            device: device.clone(),
            config,
            autocast,
            initial_scale,
            state,
            report,
            checkpoint_dir: None,
        })
    }

    /// Saves the loss scale and gradient state of every epoch Burn checkpoints into `dir`
    /// (an [`AccelerateCheckpoint`]; Burn's own checkpoint directory, `<dir>/checkpoint`, is a
    /// good place), and restores them when the training resumes with `.checkpoint(epoch)`.
    ///
    /// Old files are not deleted when Burn's checkpointing strategy deletes its own.
    pub fn with_checkpoint_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        self
    }

    // The state Burn's checkpoint of `epoch` was saved with, if any was.
    fn restore(&self, epoch: usize) -> Result<Option<LossScale>, AccelerateError> {
        let Some(dir) = &self.checkpoint_dir else {
            return Ok(None);
        };
        let Some(saved) = AccelerateCheckpoint::load_epoch(dir, epoch)? else {
            log::warn!(
                "burn-accelerate: no {} to resume from: the loss scale restarts",
                AccelerateCheckpoint::path(dir, epoch).display()
            );
            return Ok(None);
        };
        let kind = |s: &LossScale| core::mem::discriminant(s);
        if kind(&saved.state.loss_scale) != kind(&self.initial_scale) {
            return Err(AccelerateError::StateMismatch {
                what: "loss scaling",
                saved: format!("{:?}", saved.state.loss_scale),
                current: format!("{:?}", self.initial_scale),
            });
        }
        self.state.restore(&saved.state.gradient_state)?;
        Ok(Some(saved.state.loss_scale))
    }

    /// The handle to read what the training did.
    pub fn report(&self) -> TrainingReport {
        self.report.clone()
    }

    /// The autocast checked against the device (the precision training will run in).
    pub fn autocast(&self) -> &Autocast {
        &self.autocast
    }
}

// Autocast runs only through the `Accelerated` decorator; a plain `Autodiff<B>` would train in
// f32 while reporting bf16. Checked with a thread-local guard, so that nothing process-wide
// changes (other threads may be training).
fn ensure_accelerated<B: Backend>(
    autocast: &Autocast,
    device: &B::Device,
) -> Result<(), AccelerateError> {
    let Some(low) = autocast.precision().low_dtype() else {
        return Ok(());
    };
    let _guard = autocast.enter();
    let x = Tensor::<B, 2>::ones([2, 2], device);
    if x.clone().matmul(x).dtype() == low.into() {
        Ok(())
    } else {
        Err(AccelerateError::NotAccelerated {
            precision: autocast.precision(),
            backend: B::name(device),
        })
    }
}

// Restores the process-wide autocast default however `fit` ends (a panic included).
struct DefaultAutocast(Option<Precision>);

impl Drop for DefaultAutocast {
    fn drop(&mut self) {
        autocast::set_default(self.0);
    }
}

// The loss scale and the window's gradients, carried across epochs (windows do cross epochs
// when `sync_with_dataloader` is off).
struct Scaling {
    loss_scale: LossScale,
    armed: Option<ArmedLossScale>,
    window: GradientsParams,
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    #[allow(clippy::too_many_arguments)] // the pieces of Burn's loop, as its own epoch takes
    fn train_epoch(
        &self,
        learner: &mut Learner<LC>,
        dataloader: &TrainLoader<LC>,
        global_progress: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
        scaling: &mut Scaling,
    ) -> EpochReport {
        let epoch = global_progress.items_processed;
        let mut report = EpochReport {
            epoch,
            ..EpochReport::default()
        };
        let steps = self.state.num_steps();
        let mut iterator = dataloader.iter();
        let loader = self.state.begin_dataloader();
        let mut next = iterator.next();
        while let Some(item) = next.take() {
            report.batches += 1;
            let progress = iterator.progress();
            // One batch of look-ahead, as Accelerate's loader: the last batch must be known
            // before its accumulate decision, so that it completes the window.
            next = iterator.next();
            if next.is_none() {
                loader.set_end_of_dataloader(None);
            }
            let batch = self.state.accumulate();
            let output = learner.train_step(item);
            // One forward and backward pass is one step of fp8's delayed-scaling recipe (its
            // per-tensor scales are keyed by call order since the last step).
            if matches!(self.config.mixed_precision, Precision::Fp8(_)) {
                crate::fp8::step();
            }
            let model: TrainingModel<LC> = learner.model();
            grads::accumulate::<TrainingBackend<LC>, _>(&model, &mut scaling.window, output.grads);

            if batch.sync_gradients() {
                let window = batch.window_batches();
                let divisor = if self.config.divide_partial_window_by_length && window < steps {
                    window
                } else {
                    steps
                };
                let factor = (f64::from(scaling.loss_scale.inv_scale()) / divisor as f64) as f32;
                let found_inf = if scaling.loss_scale.checks_overflow() {
                    grads::unscale_and_check::<TrainingBackend<LC>, _>(
                        &model,
                        &mut scaling.window,
                        factor,
                    )
                    .found_inf()
                } else {
                    grads::scale::<TrainingBackend<LC>, _>(&model, &mut scaling.window, factor);
                    false
                };
                scaling.loss_scale = scaling.loss_scale.adjust(found_inf);
                if let Some(armed) = &scaling.armed {
                    armed.set(scaling.loss_scale.loss_scale());
                }
                let grads = core::mem::take(&mut scaling.window);
                {
                    // Live values for the metrics; the epoch's report lands at its end.
                    let mut stats = self.report.lock();
                    stats.loss_scale = scaling.loss_scale;
                    stats.skipped_live += usize::from(found_inf);
                }
                if found_inf {
                    report.skipped_steps += 1;
                } else {
                    learner.lr_step();
                    report.scheduler_steps += 1;
                    learner.optimizer_step(grads);
                    report.optimizer_steps += 1;
                }
            }
            drop(batch);

            let item = TrainingItem::new(
                output.item,
                progress,
                global_progress.clone(),
                Some(report.batches),
                Some(learner.lr_current()),
            );
            processor.process_train(LearnerEvent::ProcessedItem(item));
            if interrupter.should_stop() {
                break;
            }
        }
        drop(loader);
        report.loss_scale = scaling.loss_scale.loss_scale();
        processor.process_train(LearnerEvent::EndEpoch(epoch));
        report
    }

    fn valid_epoch(
        &self,
        learner: &Learner<LC>,
        dataloader: &ValidLoader<LC>,
        global_progress: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
    ) {
        let epoch = global_progress.items_processed;
        let model = learner.model().valid();
        let mut iterator = dataloader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            let progress = iterator.progress();
            iteration += 1;
            let item = TrainingItem::new(
                model.step(item),
                progress,
                global_progress.clone(),
                Some(iteration),
                None,
            );
            processor.process_valid(LearnerEvent::ProcessedItem(item));
            if interrupter.should_stop() {
                break;
            }
        }
        processor.process_valid(LearnerEvent::EndEpoch(epoch));
    }
}

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for AccelerateStrategy<LC> {
    fn fit(
        &self,
        training_components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        use burn::tensor::backend::DeviceOps;

        let dataloader_train = dataloader_train.to_device(&self.device);
        let dataloader_valid = dataloader_valid.to_device(self.device.inner());
        learner.fork(&self.device);
        let mut event_processor = training_components.event_processor;
        let mut checkpointer = training_components.checkpointer;
        let mut early_stopping = training_components.early_stopping;
        let interrupter = &training_components.interrupter;

        // Every thread Burn or the loaders start sees the precision (a thread-local guard
        // would miss them); the previous default comes back when the fit ends.
        let _restore = DefaultAutocast(autocast::default_precision());
        self.autocast.set_default();
        let loss_scale = if starting_epoch > 1 {
            // Burn's `fit` has no error channel, and it panics itself on a checkpoint it
            // cannot load: a resumed run must not silently go on from the wrong state.
            match self.restore(starting_epoch - 1) {
                Ok(saved) => saved.unwrap_or(self.initial_scale),
                Err(err) => panic!("burn-accelerate: cannot resume: {err}"),
            }
        } else {
            self.initial_scale
        };
        let mut scaling = Scaling {
            armed: (loss_scale != LossScale::None)
                .then(|| ArmedLossScale::arm(loss_scale.loss_scale())),
            loss_scale,
            window: GradientsParams::new(),
        };

        for epoch in starting_epoch..=training_components.num_epochs {
            let progress = Progress {
                items_processed: epoch,
                items_total: training_components.num_epochs,
            };
            let report = self.train_epoch(
                &mut learner,
                &dataloader_train,
                &progress,
                &mut event_processor,
                interrupter,
                &mut scaling,
            );
            {
                let mut stats = self.report.lock();
                stats.epochs.push(report);
                stats.loss_scale = scaling.loss_scale;
            }
            if interrupter.should_stop() {
                let reason = interrupter
                    .get_message()
                    .unwrap_or_else(|| String::from("reason unknown"));
                log::info!("Training interrupted: {reason}");
                break;
            }
            self.valid_epoch(
                &learner,
                &dataloader_valid,
                &progress,
                &mut event_processor,
                interrupter,
            );
            if let Some(checkpointer) = &mut checkpointer {
                checkpointer.checkpoint(&learner, epoch, &training_components.event_store);
                if let Some(dir) = &self.checkpoint_dir {
                    let saved = AccelerateCheckpoint {
                        state: AcceleratorState {
                            loss_scale: scaling.loss_scale,
                            gradient_state: self.state.snapshot(),
                        },
                    };
                    if let Err(err) = saved.save_epoch(dir, epoch) {
                        log::warn!("burn-accelerate: {err}");
                    }
                }
            }
            if let Some(early_stopping) = &mut early_stopping
                && early_stopping.should_stop(epoch, &training_components.event_store)
            {
                break;
            }
        }
        (learner.model(), event_processor)
    }
}
