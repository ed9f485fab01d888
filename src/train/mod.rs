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
//! - each batch's loss is divided by `gradient_accumulation_steps` before the user's
//!   unmodified `loss.backward()` differentiates it, as Accelerate divides it (the decorator's
//!   `backward` does it, armed on the threads that run the steps: see [`step`](crate::step));
//! - the learning-rate scheduler steps once per optimizer step (Burn steps it every batch);
//! - with loss scaling (fp16), the same armed transform scales the loss, the window's
//!   gradients are unscaled and checked with one host read, and on overflow neither the
//!   optimizer nor the scheduler steps;
//! - autocast (the precision, and [`AccelerateConfig::small_ops`], `half_path`, `op_classes`
//!   and the fp8 recipe) is entered on the threads that run the fit's steps and validation,
//!   for the fit: not the process's default, so a training on another thread of the process
//!   keeps its own;
//! - Burn's own `SupervisedTraining::grads_accumulation(n)` is honoured with Burn's meaning:
//!   the window's gradients are summed, not divided by `n` (Burn's text-generation example
//!   divides its learning rate by `n` for that); they are still averaged over the devices and
//!   processes, and the window still completes at the end of an epoch. It cannot be combined
//!   with [`AccelerateConfig::gradient_accumulation_steps`] (which averages over the window):
//!   a fit given both is refused at its start.
//!
//! What is still process-wide: the fp8 amax histories ([`fp8`](crate::fp8), where the module
//! says why): two fp8 trainings must not run at once in one process.
//!
//! With [`AccelerateStrategy::with_checkpoint_dir`], every epoch ends with a checkpoint a
//! crash cannot corrupt (the model, optimizer and scheduler records, the loss scale, the
//! gradient state and the positions of the crate's loaders: the data-parallel shards, or the
//! one given to [`AccelerateStrategy::with_checkpointed_loader`]), and a training started
//! again (by `burn-accelerate launch --max-restarts`, torchrun, or by hand) resumes from the
//! newest complete one by itself, through Burn's own `.checkpoint(epoch)` path; the steps
//! after it are redone, the same steps, and the run ends bit for bit where it would have.
//!
//! The loss scale and skipped steps show in Burn's dashboard and logs as [`metrics`].
//!
//! On several devices ([`AccelerateStrategy::data_parallel`]), each device trains a replica
//! of the model on a worker thread over its Accelerate shard (the crate's
//! [`ShardLoader`]), and the gradients are averaged, checked and applied once on the main
//! device, as Burn's multi-device loop with its main-device optimizer does. A model spread
//! over several devices is refused there (see [`check_data_parallel`]).
//!
//! On several processes (started by `burn-accelerate launch`, see
//! [`crate::distributed`]), every process runs the same training over its own
//! shard (a [`ShardLoader`] built with
//! [`ShardLoaderBuilder::build_for`](crate::data::ShardLoaderBuilder::build_for); any other
//! training loader, Burn's `DataLoaderBuilder`'s for one, is sliced per process as
//! [`AccelerateStrategy::prepare_loader`] says); at each
//! synchronising step the window's gradients are averaged over the processes (never while
//! accumulating), then unscaled and checked, so every process applies the same step or skips
//! the same overflowing one, on any backend. Only the main process validates (its metrics are
//! the single-process run's: the processes hold the same model) and writes checkpoints (give
//! every process the same directory); every process restores them, and stops when the main
//! process's early stopping says so. Burn's metric log files and learner summary are the
//! main process's too: the other processes keep their metric logs in memory
//! ([`WithAccelerate::with_accelerate`]) and make no summary (they would write the same log
//! files of the same directory as the main process, and read them while it writes: Burn's
//! summary then fails to parse them); their renderers still see their own training items.
//!
//! With a ZeRO stage ([`AccelerateConfig::zero_stage`], see
//! [`ZeroStage`]), each process's optimizer steps and keeps
//! state for its own partition of the parameters, and the updated parameters are shared back
//! after each step; at stage 2 each process keeps only its partition's averaged gradients,
//! and an overflow in any partition skips the step on every process. Burn's checkpoints hold
//! the whole optimizer state, gathered on the main process before it writes, so a run
//! resumes at any stage and on any number of processes. The optimizer's record must keep its
//! state per parameter ([`ParamStateRecord`]: every Burn optimizer's does).
//!
//! Burn's own DDP (`ExecutionStrategy::DistributedDataParallel`) is not used: its gradient
//! all-reduce is `DistributedBackend::all_reduce`, which only cubecl's CUDA runtime
//! implements (NCCL), and which Flex and NdArray do not implement at all.

pub mod demo;
pub mod lm;
pub mod metrics;
mod replicas;
mod resume;
mod sharded;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use burn::config::Config;

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Tensor};
use burn::train::logger::InMemoryMetricLogger;
use burn::train::metric::store::{Aggregate, EventStoreClient, Split};
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerOptimizerRecord, LearningCheckpointer, LearningComponentsTypes,
    LearningResult, SupervisedLearningStrategy, SupervisedTraining,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingBackend, TrainingComponents,
    TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};

use crate::autocast::{self, Autocast, LowerOpTally};
use crate::data::{
    DataLoaderError, EvenSplit, LoaderState, ProcessShare, ProcessSlice, ShardLoader,
    move_and_identify,
};
use crate::distributed::{ProcessGroup, ProcessState};
use crate::gradient_state::GradientState;
use crate::placement::check_data_parallel;
use crate::scaler::{LossScale, ThreadArmed};
use crate::step::{StepCore, StepOutcome};
use crate::zero::{self, ParamStateRecord, ZeroStage};
use crate::{AccelerateConfig, AccelerateError, AcceleratorState, Precision};
use replicas::{DeviceWorkers, StepInput};
use sharded::OptimizerTap;

/// Adds [`with_accelerate`](WithAccelerate::with_accelerate) to Burn's training builder.
pub trait WithAccelerate<LC: LearningComponentsTypes>: Sized {
    /// Trains with `strategy`'s Accelerate semantics (see the [module docs](crate::train)), replacing
    /// the training strategy set so far.
    fn with_accelerate(self, strategy: AccelerateStrategy<LC>) -> Self;
}

impl<LC> WithAccelerate<LC> for SupervisedTraining<LC>
where
    LC: LearningComponentsTypes + 'static,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    /// On a process other than the main one, also keeps Burn's metric logs in memory
    /// (`InMemoryMetricLogger`) instead of Burn's default files in the artifact directory,
    /// which the processes of a run share: there every process would truncate and write the
    /// same files, which Burn's summary then cannot parse. A metric logger registered with
    /// `with_metric_logger` is the user's own, on every process.
    fn with_accelerate(self, strategy: AccelerateStrategy<LC>) -> Self {
        let builder = if strategy.process.is_main_process() {
            self
        } else {
            log::info!(
                "burn-accelerate: process {} of {}: Burn's metric logs are kept in memory here, \
                 not written to the artifact directory (the main process writes them)",
                strategy.process.process_index(),
                strategy.process.num_processes()
            );
            self.with_metric_logger(InMemoryMetricLogger::new())
        };
        builder.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
    }
}

/// What an accelerated training did, per epoch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpochReport {
    /// The epoch (1-based, as Burn counts).
    pub epoch: usize,
    /// Training steps taken: one batch on every device (whose shard still had one).
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
    /// The lower-class ops of the training and validation steps (on the thread that runs
    /// them: the main device's) by what they ran in: half type, or f32 and why; set when the
    /// fit ends.
    pub lower_ops: LowerOpTally,
    /// The epoch whose checkpoint this training resumed from (`None`: it started afresh).
    pub resumed_from: Option<usize>,
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

/// Burn's training strategy with Accelerate's semantics, on one device
/// ([`new`](Self::new)) or data-parallel over several ([`data_parallel`](Self::data_parallel));
/// install it with [`WithAccelerate::with_accelerate`].
pub struct AccelerateStrategy<LC: LearningComponentsTypes> {
    /// The main device: the model, the optimizer and validation live here.
    device: Device<TrainingBackend<LC>>,
    /// Data-parallel: one shard per device, the main device's first; `None` trains on the main
    /// device alone, from the loader given to Burn's builder.
    shards: Option<Vec<Shard<LC>>>,
    config: AccelerateConfig,
    autocast: Autocast,
    initial_scale: LossScale,
    state: GradientState,
    report: TrainingReport,
    checkpoint_dir: Option<PathBuf>,
    /// Whether to resume by itself, and how many checkpoints to keep.
    resume: resume::ResumeSettings,
    /// The loaders whose epoch and position the checkpoints hold, in device order: the shards
    /// of a data-parallel training, or the one given to [`with_checkpointed_loader`](Self::with_checkpointed_loader).
    positions: Vec<Arc<dyn LoaderPosition>>,
    /// Which process of the run this is.
    process: ProcessState,
    /// The process group, when there are several processes.
    group: Option<ProcessGroup>,
    /// The training backend is the decorator, whose `backward` divides and scales a step's
    /// loss when armed (see [`step`](crate::step)).
    divides_loss: bool,
}

// One device of a data-parallel training and the loader of its Accelerate shard.
struct Shard<LC: LearningComponentsTypes> {
    device: Device<TrainingBackend<LC>>,
    loader: TrainLoader<LC>,
}

// A loader whose epoch and position a checkpoint holds, whatever its item types. Copies of a
// `ShardLoader` share its position, so the strategy's copy sees what Burn's copy iterates.
trait LoaderPosition: Send + Sync {
    fn state(&self) -> LoaderState;
    fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError>;
}

impl<B, I, O> LoaderPosition for ShardLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn state(&self) -> LoaderState {
        ShardLoader::state(self)
    }

    fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError> {
        ShardLoader::load_state(self, state)
    }
}

/// The loss scale, gradient-state position and loader positions saved beside Burn's
/// checkpoint of an epoch (`accelerate-<epoch>.json`), so that a run resumed with
/// `.checkpoint(epoch)` goes on with the scale the interrupted run had reached (instead of
/// overflowing again from the initial one) and with the shuffled order it would have seen.
#[derive(Config, Debug)]
pub struct AccelerateCheckpoint {
    /// The saved state.
    pub state: AcceleratorState,
    /// Where each checkpointed loader was (epoch, position, seeds), in device order; empty
    /// when the strategy tracked none, or in a file written before loaders were saved. With
    /// several processes, the main process's (the others are at the same epoch and position).
    #[config(default = "Vec::new()")]
    pub loaders: Vec<LoaderState>,
    /// The number of processes of the run that wrote it.
    #[config(default = 1)]
    pub num_processes: usize,
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
        std::fs::create_dir_all(dir).map_err(|e| AccelerateError::Checkpoint {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        // Written aside and renamed, so that no process reads half of it; a checkpoint of the
        // strategy's that lists it is told what it holds now.
        let bytes = serde_json::to_vec_pretty(self).expect("the strategy's state serialises");
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let digest = crate::checkpoint::write_atomic(dir, name.as_deref().unwrap_or(""), &bytes)?;
        crate::checkpoint::Manifest::read(dir)?
            .relisted(epoch, digest)
            .map_or(Ok(()), |manifest| manifest.write(dir))
    }

    /// Deletes the files in `dir` of the epochs before `latest` whose model checkpoint Burn's
    /// checkpointing strategy has deleted from `dir`, unless a checkpoint of the strategy's own
    /// lists them. Does nothing unless `dir` holds Burn's model checkpoint of `latest`
    /// (`model-<latest>.*`): in any other directory there is no way to tell which epochs Burn
    /// kept.
    pub fn prune(dir: &Path, latest: usize) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let names: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        let has_model = |epoch: usize| {
            let prefix = format!("model-{epoch}.");
            names.iter().any(|n| n.starts_with(&prefix))
        };
        if !has_model(latest) {
            return;
        }
        let listed: Vec<usize> = crate::checkpoint::Manifest::read(dir)
            .map(|m| m.checkpoints.iter().map(|c| c.epoch).collect())
            .unwrap_or_default();
        for name in &names {
            let epoch = name
                .strip_prefix("accelerate-")
                .and_then(|rest| rest.strip_suffix(".json"))
                .and_then(|n| n.parse::<usize>().ok());
            if let Some(epoch) = epoch
                && epoch < latest
                && !has_model(epoch)
                && !listed.contains(&epoch)
            {
                let _ = std::fs::remove_file(dir.join(name));
            }
        }
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
    /// [`Accelerated`](crate::Accelerated) (autocast would do nothing there);
    /// [`AccelerateError::Distributed`] for a bad launch environment or a process group that
    /// cannot be joined.
    pub fn new(
        config: AccelerateConfig,
        device: &Device<TrainingBackend<LC>>,
    ) -> Result<Self, AccelerateError> {
        let (autocast, initial_scale) =
            config.init_mixed_precision::<TrainingBackend<LC>>(device)?;
        ensure_accelerated::<TrainingBackend<LC>>(&autocast, device)?;
        let process = ProcessState::from_env()?;
        let group = process
            .is_distributed()
            .then(|| process.group())
            .transpose()?;
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
                lower_ops: LowerOpTally::default(),
                resumed_from: None,
                skipped_live: 0,
            })),
        };
        Ok(Self {
            device: device.clone(),
            shards: None,
            config,
            autocast,
            initial_scale,
            state,
            report,
            checkpoint_dir: None,
            resume: resume::ResumeSettings::default(),
            positions: Vec::new(),
            process,
            group,
            divides_loss: TrainingBackend::<LC>::name(device).starts_with("accelerated<"),
        })
    }

    /// A strategy training data-parallel on the devices of `shards`, one model replica per
    /// device, as Burn's multi-device loop does and with Accelerate's semantics: each step,
    /// every device runs the user's `TrainStep` on a worker thread over the next batch of its
    /// shard, their gradients are averaged on the main device (the first shard's, as DDP's
    /// all-reduce averages them), unscaled and checked for overflow once, and the optimizer
    /// steps once there; the next step's replicas are forked from the updated model.
    ///
    /// `shards` are the loaders of [`ShardLoaderBuilder::build`](crate::data::ShardLoaderBuilder::build)
    /// for the devices, in process order, so every device sees the batches Accelerate would
    /// give its process; they replace the training loader given to `SupervisedTraining::new`,
    /// which is not read (pass one of the shards there). `model` is the model the learner
    /// will train: one spread over several devices cannot be replicated whole and is refused.
    /// The numbers of a run equal the single-device run's over the combined batches (the
    /// same items with `split_batches`, or a batch size `devices × batch_size` without it),
    /// up to the rounding of summing in another order.
    ///
    /// With loss scaling, all devices' gradients are in the one overflow check: when any
    /// device overflows, the step is skipped for all of them, and the loss scale backs off
    /// once.
    ///
    /// # Errors
    /// What [`new`](Self::new) returns, for any of the devices (they must all run the same
    /// precision); [`AccelerateError::InvalidConfig`] when `shards`
    /// is empty or is not one complete set of shards in process order;
    /// [`AccelerateError::InvalidConfig`] for a ZeRO stage (it shards across processes);
    /// [`AccelerateError::Placement`] ([`SpreadForDataParallel`](crate::placement::PlacementError::SpreadForDataParallel))
    /// when `model`'s parameters live on several devices; [`AccelerateError::InvalidConfig`]
    /// when the process was launched as one of several (run one process per device instead).
    pub fn data_parallel<I>(
        config: AccelerateConfig,
        shards: Vec<ShardLoader<TrainingBackend<LC>, I, StepInput<LC>>>,
        model: &TrainingModel<LC>,
    ) -> Result<Self, AccelerateError>
    where
        I: Send + Sync + Clone + 'static,
    {
        let Some(first) = shards.first() else {
            return Err(AccelerateError::InvalidConfig {
                field: "shards",
                value: "none".into(),
                fix: "pass one shard per device, from `ShardLoaderBuilder::build(&devices)`",
            });
        };
        let main = first.device().clone();
        for (index, shard) in shards.iter().enumerate() {
            let spec = shard.spec();
            if spec.num_processes() != shards.len() || spec.process_index() != index {
                return Err(AccelerateError::InvalidConfig {
                    field: "shards",
                    value: format!(
                        "shard {index} of {} is process {} of {}",
                        shards.len(),
                        spec.process_index(),
                        spec.num_processes()
                    ),
                    fix: "pass all the loaders of one `ShardLoaderBuilder::build(&devices)`, \
                          in its order",
                });
            }
        }
        if config.zero_stage != ZeroStage::None {
            // Replicas on one process's devices share its one optimizer: nothing to shard.
            return Err(AccelerateError::InvalidConfig {
                field: "zero_stage",
                value: format!(
                    "{:?} on {} devices of one process",
                    config.zero_stage,
                    shards.len()
                ),
                fix: "shard across processes (burn-accelerate launch, one device each, with \
                      AccelerateStrategy::new), or train data-parallel with ZeroStage::None",
            });
        }
        let devices: Vec<_> = shards.iter().map(|s| s.device().clone()).collect();
        check_data_parallel(model, &devices)?;
        let mut strategy = Self::new(config, &main)?;
        if strategy.process.is_distributed() {
            return Err(AccelerateError::InvalidConfig {
                field: "shards",
                value: format!(
                    "{} devices in process {} of {}",
                    shards.len(),
                    strategy.process.process_index(),
                    strategy.process.num_processes()
                ),
                fix: "with several processes, give each process one device: build its loader \
                      with `ShardLoaderBuilder::build_for` and use `AccelerateStrategy::new`",
            });
        }
        for device in &devices[1..] {
            strategy.ensure_same_precision(device)?;
        }
        strategy.positions = shards
            .iter()
            .map(|shard| Arc::new(shard.clone()) as Arc<dyn LoaderPosition>)
            .collect();
        strategy.shards = Some(
            shards
                .into_iter()
                .map(|shard| Shard {
                    device: shard.device().clone(),
                    loader: Arc::new(shard) as TrainLoader<LC>,
                })
                .collect(),
        );
        Ok(strategy)
    }

    // The replicas enter one autocast: every device must run what the main device runs.
    fn ensure_same_precision(
        &self,
        device: &Device<TrainingBackend<LC>>,
    ) -> Result<(), AccelerateError> {
        let (autocast, _) = self
            .config
            .init_mixed_precision::<TrainingBackend<LC>>(device)?;
        if autocast.precision() == self.autocast.precision() {
            return Ok(());
        }
        // The probe without the fallback names what this device cannot run.
        self.config
            .clone()
            .with_allow_fallback(false)
            .init_mixed_precision::<TrainingBackend<LC>>(device)?;
        Err(AccelerateError::InvalidConfig {
            field: "mixed_precision",
            value: format!(
                "{} on {device:?}, {} on the main device",
                autocast.precision(),
                self.autocast.precision()
            ),
            fix: "train on devices that run the same precision, or in a precision all can run",
        })
    }

    /// The devices training runs on; the first is the main device.
    pub fn devices(&self) -> Vec<Device<TrainingBackend<LC>>> {
        match &self.shards {
            Some(shards) => shards.iter().map(|s| s.device.clone()).collect(),
            None => vec![self.device.clone()],
        }
    }

    /// Accelerate's `prepare(dataloader)` for a training loader: the loader this process
    /// trains on, moved to the main device. The fit does this itself with the loader given to
    /// `SupervisedTraining::new` (panicking where this returns an error, since Burn's `fit`
    /// has no error channel); call it first to get the error as a value, and pass Burn's
    /// builder what it returns.
    ///
    /// - One of the crate's loaders ([`ShardLoader`], `StreamLoader`, or what this returned)
    ///   is per-process already and is only moved.
    /// - On one process, and in a [`data_parallel`](Self::data_parallel) training (which
    ///   reads its own shards), any loader is only moved.
    /// - On several processes, any other loader (Burn's `DataLoaderBuilder`'s) holds the
    ///   whole data set: each process takes its [`DataLoader::slice`], as Burn's multi-device
    ///   loop splits one: contiguous parts in process order, of `num_items / num_processes`
    ///   items each, so that every process runs the same number of steps. The last
    ///   `num_items % num_processes` items are not read (a warning says how many). Burn's
    ///   shuffle then shuffles within each part, and the parts stay the same from epoch to
    ///   epoch; for Accelerate's sharding of the shuffled order, build the loader with
    ///   [`ShardLoaderBuilder::build_for`](crate::data::ShardLoaderBuilder::build_for).
    ///
    /// [`DataLoader::slice`]: burn::data::dataloader::DataLoader::slice
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] (`dataloader_train`) for a loader of the whole
    /// data set with fewer items than processes.
    pub fn prepare_loader(
        &self,
        loader: &TrainLoader<LC>,
    ) -> Result<TrainLoader<LC>, AccelerateError> {
        let (moved, share) = move_and_identify(loader, &self.device);
        let processes = self.process.num_processes();
        let rank = self.process.process_index();
        if let Some(share) = share {
            if share.num_processes.is_some_and(|n| n != processes)
                || (processes > 1 && share.process_index != rank)
            {
                log::warn!(
                    "burn-accelerate: the training loader holds the data of process {} of {} \
                     but this is process {rank} of {processes}: build it with \
                     `ShardLoaderBuilder::build_for` and this process's `ProcessState`",
                    share.process_index,
                    share
                        .num_processes
                        .map_or_else(|| "?".into(), |n| n.to_string()),
                );
            }
            return Ok(moved);
        }
        if processes == 1 || self.shards.is_some() {
            return Ok(moved);
        }
        let items = moved.num_items();
        let Some(part) = EvenSplit::of(items, processes, rank) else {
            return Err(AccelerateError::InvalidConfig {
                field: "dataloader_train",
                value: format!("a loader of {items} items for {processes} processes"),
                fix: "give every process at least one item, or build the training loader with \
                      `ShardLoaderBuilder::build_for` (Accelerate's sharding, which pads a \
                      short data set so that every process gets a batch)",
            });
        };
        log::info!(
            "burn-accelerate: the training loader holds the whole data set ({items} items): \
             process {rank} of {processes} trains on its items {}..{} (Burn's \
             `DataLoader::slice`, {} items per process)",
            part.start,
            part.end,
            part.end - part.start,
        );
        if part.dropped > 0 {
            log::warn!(
                "burn-accelerate: the last {} of the training loader's {items} items are not \
                 read: {items} items do not divide between {processes} processes, and every \
                 process must take as many steps (`ShardLoaderBuilder` pads instead)",
                part.dropped,
            );
        }
        let share = ProcessShare {
            num_processes: Some(processes),
            process_index: rank,
        };
        Ok(Arc::new(ProcessSlice::new(
            moved.slice(part.start, part.end),
            share,
        )))
    }

    /// The accumulation window the fit runs: Accelerate's
    /// ([`AccelerateConfig::gradient_accumulation_steps`], averaged), or Burn's builder's
    /// `grads_accumulation` (`burn`; summed, as Burn's loop sums it).
    fn accumulation(&self, burn: Option<usize>) -> Result<Accumulation, AccelerateError> {
        let ours = self.config.gradient_accumulation_steps;
        // Burn's loop steps the optimizer every batch for 0 or 1.
        match burn.filter(|&n| n > 1) {
            None => Ok(Accumulation {
                steps: ours,
                sums: false,
            }),
            Some(n) if ours == 1 => Ok(Accumulation {
                steps: n,
                sums: true,
            }),
            Some(n) => Err(AccelerateError::InvalidConfig {
                field: "grads_accumulation",
                value: format!(
                    "{n} in Burn's `SupervisedTraining::grads_accumulation` and {ours} in \
                     `AccelerateConfig::gradient_accumulation_steps`"
                ),
                fix: "set one of them, preferably `AccelerateConfig::gradient_accumulation_steps` \
                      (drop `.grads_accumulation(..)` from Burn's builder): they differ by the \
                      window's length, Burn's sums the window's gradients (so its users divide \
                      the learning rate by it) and Accelerate's averages them",
            }),
        }
    }

    /// Checkpoints every epoch into `dir`, crash-safely, and resumes from there (give every
    /// process the same directory; Burn's own checkpoint directory, `<dir>/checkpoint`, is a
    /// good place):
    ///
    /// - after each epoch the main process writes the model's, the optimizer's (whole, under
    ///   ZeRO) and the scheduler's records in full precision, and the loss scale, gradient
    ///   state and loader positions (an [`AccelerateCheckpoint`]), each file written aside and
    ///   renamed, then lists them with their checksums in the directory's manifest
    ///   ([`crate::checkpoint`]); the newest 2 are kept
    ///   ([`with_checkpoints_kept`](Self::with_checkpoints_kept));
    /// - when the training starts, it resumes from the newest listed checkpoint whose files
    ///   verify, without being asked ([`with_auto_resume`](Self::with_auto_resume) turns that
    ///   off): a damaged newer one is passed over with a warning, and a directory whose every
    ///   listed checkpoint is damaged stops the training (rather than silently start it over).
    ///   The main process chooses and every process loads its choice, through Burn's own
    ///   resume path (`LearningCheckpointer::load_checkpoint`); the run goes on from the next
    ///   epoch. The steps taken after that checkpoint by the run that stopped are redone, and
    ///   they are the same steps (the loaders' saved positions and seeds give the same
    ///   batches), so the run ends where an uninterrupted one does, bit for bit.
    ///   `.checkpoint(epoch)` on Burn's builder resumes from that epoch instead (from Burn's
    ///   own files when the strategy has no whole checkpoint of it).
    ///
    /// With Burn's file checkpointer set as well, Burn still writes its own files (your
    /// recorder, your checkpointing strategy) beside these: drop `with_file_checkpointer` to
    /// write each epoch once. A strategy-state file goes with its checkpoint, unless Burn
    /// still keeps that epoch's model in `dir`.
    pub fn with_checkpoint_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        self
    }

    /// Saves `loader`'s epoch and position (and its seeds) with every checkpoint, and restores
    /// them when the training resumes with `.checkpoint(epoch)`, so that the resumed epochs
    /// see the shuffled order an uninterrupted run would have (the seedable sampler's order
    /// depends on the loader's epoch, which starts at 0 in a new process). Pass the
    /// [`ShardLoader`] given to `SupervisedTraining::new` (its copies share the position); a
    /// [`data_parallel`](Self::data_parallel) strategy saves its shards' without being asked.
    /// Needs [`with_checkpoint_dir`](Self::with_checkpoint_dir).
    ///
    /// ```no_run
    /// # #[cfg(feature = "flex")] {
    /// # use burn::backend::{Autodiff, Flex};
    /// # use burn::data::dataset::InMemDataset;
    /// # use burn_accelerate::{AccelerateConfig, Accelerated};
    /// # use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
    /// # use burn_accelerate::train::AccelerateStrategy;
    /// # use burn_accelerate::train::demo::{BlobBatcher, MlpComponents, blobs};
    /// # type Train = Accelerated<Autodiff<Flex>>;
    /// # type Components = MlpComponents<Train>;
    /// let device = Default::default();
    /// let loader = ShardLoaderBuilder::new(
    ///     DataLoaderConfig::new(32).with_shuffle(true).with_data_seed(Some(7)),
    ///     InMemDataset::new(blobs(256, 1)),
    ///     BlobBatcher,
    /// )
    /// .build(&[device])?
    /// .remove(0);
    /// let strategy = AccelerateStrategy::<Components>::new(AccelerateConfig::new(), &device)?
    ///     .with_checkpoint_dir("/tmp/run/checkpoint")
    ///     .with_checkpointed_loader(&loader);
    /// // SupervisedTraining::new("/tmp/run", loader, valid).with_accelerate(strategy)...
    /// # }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_checkpointed_loader<I>(
        mut self,
        loader: &ShardLoader<TrainingBackend<LC>, I, StepInput<LC>>,
    ) -> Self
    where
        I: Send + Sync + Clone + 'static,
    {
        self.positions = vec![Arc::new(loader.clone())];
        self
    }

    // What goes beside Burn's checkpoint.
    fn checkpoint(&self, loss_scale: LossScale) -> AccelerateCheckpoint {
        AccelerateCheckpoint {
            state: AcceleratorState {
                loss_scale,
                gradient_state: self.state.snapshot(),
            },
            loaders: self.positions.iter().map(|p| p.state()).collect(),
            num_processes: self.process.num_processes(),
        }
    }

    // The saved loaders' positions restored into the tracked ones.
    fn restore_loaders(&self, saved: &[LoaderState]) -> Result<(), AccelerateError> {
        if self.positions.is_empty() {
            if !saved.is_empty() {
                log::warn!(
                    "burn-accelerate: the checkpoint holds {} loader positions but the strategy \
                     tracks no loader: the training loader starts its own first epoch's order \
                     (pass it to `with_checkpointed_loader` to resume where it was)",
                    saved.len()
                );
            }
            return Ok(());
        }
        if saved.is_empty() {
            log::warn!(
                "burn-accelerate: the checkpoint holds no loader position: the loaders restart \
                 at their first epoch's order"
            );
            return Ok(());
        }
        if saved.len() != self.positions.len() {
            return Err(AccelerateError::StateMismatch {
                what: "checkpointed loaders",
                saved: format!("{} loader positions", saved.len()),
                current: format!("{} loaders", self.positions.len()),
            });
        }
        for (position, state) in self.positions.iter().zip(saved) {
            position.load_state(*state)?;
        }
        Ok(())
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
        let processes = self.process.num_processes();
        if saved.num_processes != processes {
            // Burn checkpoints at the end of an epoch, where every shard's position is 0: the
            // next epoch's order depends on the seed and the epoch only, and the loaders built
            // for this run shard it anew. A position inside an epoch has no such mapping.
            if let Some(inside) = saved.loaders.iter().find(|l| l.position != 0) {
                return Err(AccelerateError::StateMismatch {
                    what: "number of processes",
                    saved: format!(
                        "{} processes, {} batches into epoch {}",
                        saved.num_processes, inside.position, inside.epoch
                    ),
                    current: format!("{processes} processes"),
                });
            }
            log::info!(
                "burn-accelerate: resuming a run of {} processes on {processes}: the data is \
                 sharded anew from the next epoch",
                saved.num_processes
            );
        }
        self.state.restore(&saved.state.gradient_state)?;
        self.restore_loaders(&saved.loaders)?;
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

// The training step of a fit: its loss scale and window's gradients are carried across epochs
// (windows do cross epochs when `sync_with_dataloader` is off).
type Core<LC> = StepCore<TrainingBackend<LC>>;

// Ends the fit where something it cannot go on without failed. Burn's
// `SupervisedLearningStrategy::fit` returns the model and the event processor, with no error
// channel (burn-train 0.21, `learner/supervised/strategies/base.rs`), and a fit that went on
// would train the wrong thing (a process that left would leave the others waiting, a resume
// from the wrong state would look like a good run): so it panics, with the reason, in this one
// place. What can be checked before the fit is checked by `AccelerateStrategy::new`,
// `data_parallel` and `prepare_loader`, which return typed errors.
fn fail(what: &str, err: impl core::fmt::Display) -> ! {
    panic!("burn-accelerate: {what}: {err}")
}

// The gradient-accumulation window of a fit (see `AccelerateStrategy::accumulation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Accumulation {
    // Batches per window.
    steps: usize,
    // Summed (Burn's `grads_accumulation`) rather than averaged (Accelerate's).
    sums: bool,
}

// The batches of one training step: one per device whose shard still has one (index into the
// loaders), and the loaders' combined progress after handing them out.
struct Step<LC: LearningComponentsTypes> {
    inputs: Vec<(usize, StepInput<LC>)>,
    progress: Progress,
}

// Draws the next step's batches; `None` when every loader's epoch is over.
fn next_step<LC: LearningComponentsTypes>(
    iterators: &mut [Box<dyn DataLoaderIterator<StepInput<LC>> + '_>],
) -> Option<Step<LC>> {
    let mut inputs = Vec::with_capacity(iterators.len());
    let mut progress = Progress::new(0, 0);
    for (index, iterator) in iterators.iter_mut().enumerate() {
        if let Some(input) = iterator.next() {
            inputs.push((index, input));
        }
        let p = iterator.progress();
        progress.items_processed += p.items_processed;
        progress.items_total += p.items_total;
    }
    (!inputs.is_empty()).then_some(Step { inputs, progress })
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    #[allow(clippy::too_many_arguments)] // the pieces of Burn's loop, as its own epoch takes
    fn train_epoch(
        &self,
        learner: &mut Learner<LC>,
        loaders: &[TrainLoader<LC>],
        workers: Option<&DeviceWorkers<LC>>,
        global_progress: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
        core: &mut Core<LC>,
        armed: &ThreadArmed,
    ) -> EpochReport {
        let epoch = global_progress.items_processed;
        let mut report = EpochReport {
            epoch,
            ..EpochReport::default()
        };
        let mut iterators: Vec<_> = loaders.iter().map(|loader| loader.iter()).collect();
        let loader = self.state.begin_dataloader();
        let mut iteration = 0;
        let mut next = next_step::<LC>(&mut iterators);
        while let Some(step) = next.take() {
            report.batches += 1;
            // One step of look-ahead, as Accelerate's loader: the last step must be known
            // before its accumulate decision, so that it completes the window.
            next = next_step::<LC>(&mut iterators);
            if next.is_none() {
                loader.set_end_of_dataloader(None);
            }
            let batch = self.state.accumulate();
            let outputs = match workers {
                Some(workers) => workers.step(&learner.model(), step.inputs, core.loss_transform()),
                None => step
                    .inputs
                    .into_iter()
                    .map(|(_, input)| learner.train_step(input))
                    .collect(),
            };
            // One forward and backward pass on every device is one pass of fp8's recipe
            // (replicas record their amaxes under the same keys, and the history keeps the
            // largest, as Transformer Engine reduces amaxes over the data-parallel group).
            core.end_pass();
            let model: TrainingModel<LC> = learner.model();
            let mut items = Vec::with_capacity(outputs.len());
            for output in outputs {
                core.add_gradients(&model, output.grads);
                items.push(output.item);
            }

            if batch.sync_gradients() {
                let stepped = core.step(model, |_, grads| {
                    learner.lr_step();
                    learner.optimizer_step(grads);
                    (learner.model(), learner.lr_current())
                });
                let (model, outcome) = stepped.unwrap_or_else(|err| fail("cannot step", err));
                // The next batches' losses at the adjusted scale.
                armed.set(core.loss_transform());
                if core.sharded().is_some() {
                    // Every parameter as its owner stepped it.
                    learner.load_model(model.into_record());
                }
                {
                    // Live values for the metrics; the epoch's report lands at its end.
                    let mut stats = self.report.lock();
                    stats.loss_scale = *core.loss_scale();
                    stats.skipped_live += usize::from(outcome == StepOutcome::SkippedOverflow);
                }
                match outcome {
                    StepOutcome::SkippedOverflow => report.skipped_steps += 1,
                    StepOutcome::Applied { .. } => {
                        report.scheduler_steps += 1;
                        report.optimizer_steps += 1;
                    }
                    StepOutcome::Accumulating => {}
                }
            }
            drop(batch);

            for item in items {
                iteration += 1;
                let item = TrainingItem::new(
                    item,
                    step.progress.clone(),
                    global_progress.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                );
                processor.process_train(LearnerEvent::ProcessedItem(item));
            }
            if interrupter.should_stop() {
                break;
            }
        }
        drop(loader);
        report.loss_scale = core.loss_scale().loss_scale();
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

impl<LC> SupervisedLearningStrategy<LC> for AccelerateStrategy<LC>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    /// Burn's own `train`, without the summary on processes other than the main one: it reads
    /// the metric logs of the artifact directory, which only the main process writes (see
    /// [`WithAccelerate::with_accelerate`]), while the main process may still be writing them.
    fn train(
        &self,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut training_components: TrainingComponents<LC>,
    ) -> LearningResult<<LC as LearningComponentsTypes>::InferenceModel> {
        if !self.process.is_main_process() && training_components.summary.take().is_some() {
            log::info!(
                "burn-accelerate: process {} of {}: no learner summary here (the main process \
                 makes it from the metric logs it alone writes)",
                self.process.process_index(),
                self.process.num_processes()
            );
        }
        let (learner, resumed) = self.resume_before_fit(learner, &mut training_components);
        self.report.lock().resumed_from = resumed.or(training_components.checkpoint);
        BurnTrain(self, resumed).train(
            learner,
            dataloader_train,
            dataloader_valid,
            training_components,
        )
    }

    fn fit(
        &self,
        training_components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        // Burn calls `fit` on the builder's thread, outside rayon's pool: on a pool's thread
        // the steps' parallel ops are computed there too (`threads::run_on_step_pool`).
        on_step_thread(|| {
            self.fit_here(
                training_components,
                learner,
                dataloader_train,
                dataloader_valid,
                starting_epoch,
            )
        })
    }
}

// Burn's default `SupervisedLearningStrategy::train` around the strategy's `fit` (an
// overriding `train` cannot call the default it overrides).
// With the epoch the strategy resumed from itself (Burn's `train` then starts at epoch 1).
struct BurnTrain<'a, S>(&'a S, Option<usize>);

impl<LC> SupervisedLearningStrategy<LC> for BurnTrain<'_, AccelerateStrategy<LC>>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    fn fit(
        &self,
        training_components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        self.0.fit(
            training_components,
            learner,
            dataloader_train,
            dataloader_valid,
            self.1.map_or(starting_epoch, |resumed| resumed + 1),
        )
    }
}

// Waits until Burn's event processor has handed the fit's events to the event store, and the
// store has written them to the metric logs: Burn's `train` makes its summary from the log
// files as soon as `fit` returns (Burn's own strategies do not wait, and their summaries can
// miss the last validation epoch).
fn flush_events<LC: LearningComponentsTypes>(
    processor: &mut SupervisedTrainingEventProcessor<LC>,
    store: &EventStoreClient,
) {
    // The processor's worker takes one event at a time from a channel that holds one, and a
    // validation `Start` does nothing there (burn-train 0.21): once the second is in the
    // channel, the worker took the first, so it had processed every event before it.
    processor.process_valid(LearnerEvent::Start);
    processor.process_valid(LearnerEvent::Start);
    // The store handles its messages in order, and this query (of no metric: nothing read,
    // nothing cached) answers after the events sent before it, among them each epoch's end,
    // which closes its log files and joins their writers.
    let _ = store.find_metric("burn-accelerate flush", 1, Aggregate::Mean, &Split::Valid);
}

#[cfg(feature = "flex")]
fn on_step_thread<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    crate::threads::run_on_step_pool(work)
}

// Without Flex, no CPU kernel of ours or the backend's runs on rayon's pool.
#[cfg(not(feature = "flex"))]
fn on_step_thread<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    work()
}

impl<LC> AccelerateStrategy<LC>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    // The fit, on the thread that runs the steps.
    fn fit_here(
        &self,
        training_components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        use burn::tensor::backend::DeviceOps;

        let tally_start = autocast::thread_tally();

        // Before anything process-wide is set.
        let accumulation = self.fit_window(training_components.grad_accumulation);
        let devices = self.devices();
        // Before the fork below would gather a spread model onto the main device.
        // `data_parallel` checked the model it was given; this catches a learner built around
        // another one.
        if let Err(err) = check_data_parallel(&learner.model(), &devices) {
            fail("cannot train data-parallel", err);
        }
        let loaders = self.fit_loaders(&dataloader_train, &devices);
        let dataloader_valid = dataloader_valid.to_device(self.device.inner());
        learner.fork(&self.device);
        let mut event_processor = training_components.event_processor;
        let mut checkpointer = training_components.checkpointer;
        let mut early_stopping = training_components.early_stopping;
        let interrupter = &training_components.interrupter;

        // The fit's precision and small-op rule are this thread's (the steps and the
        // validation run here; device workers enter them on theirs), not the process's: a
        // training on another thread, or Burn's metric threads, keep their own.
        let _autocast = self.autocast.enter();
        let loss_scale = if starting_epoch > 1 {
            // Burn's `fit` has no error channel, and it panics itself on a checkpoint it
            // cannot load: a resumed run must not silently go on from the wrong state.
            match self.restore(starting_epoch - 1) {
                Ok(saved) => saved.unwrap_or(self.initial_scale),
                Err(err) => fail("cannot resume", err),
            }
        } else {
            self.initial_scale
        };
        // Each enters the fit's autocast on its own thread.
        let workers =
            (devices.len() > 1).then(|| DeviceWorkers::<LC>::start(&devices, self.autocast));
        let mut core = self.fit_core(accumulation, loss_scale, loaders.len());
        // The user's `TrainStep` calls `loss.backward()` itself: the decorator's backward
        // divides and scales its loss as the `Accelerator`'s `backward` would, on this thread.
        let armed = ThreadArmed::arm(core.loss_transform());
        // Sharded, this process's optimizer keeps its partition's state only (a resumed run's
        // learner was just given the whole state), and the tap reads it for checkpoints.
        let mut tap = core.sharded().map(|_| OptimizerTap::<LC>::new());
        if let Some(tap) = tap.as_mut() {
            let model = learner.model();
            let rank = core.sharded().map_or(0, |(group, _)| group.rank());
            let whole = tap.record(&learner, &training_components.event_store);
            let partition = core.partition(&model).expect("sharded, so partitioned");
            learner.load_optim(zero::keep_own_state(whole, partition, rank));
        }

        // What the main process's own checkpoints read the optimizer and scheduler with.
        let mut records = (self.checkpoint_dir.is_some() && self.process.is_main_process())
            .then(resume::LearnerTap::<LC>::new);
        for epoch in starting_epoch..=training_components.num_epochs {
            let progress = Progress {
                items_processed: epoch,
                items_total: training_components.num_epochs,
            };
            let report = self.train_epoch(
                &mut learner,
                &loaders,
                workers.as_ref(),
                &progress,
                &mut event_processor,
                interrupter,
                &mut core,
                &armed,
            );
            {
                let mut stats = self.report.lock();
                stats.epochs.push(report);
                stats.loss_scale = *core.loss_scale();
            }
            if interrupter.should_stop() {
                let reason = interrupter
                    .get_message()
                    .unwrap_or_else(|| String::from("reason unknown"));
                log::info!("Training interrupted: {reason}");
                break;
            }
            // With several processes, the main one validates (on the loader it was given) and
            // the others go on: they hold the same model, so the main process's metrics are
            // the single-process run's, and no process repeats its work.
            let validates = self.process.is_main_process();
            if validates {
                self.valid_epoch(
                    &learner,
                    &dataloader_valid,
                    &progress,
                    &mut event_processor,
                    interrupter,
                );
            }
            self.checkpoint_epoch(
                epoch,
                &mut learner,
                &core,
                tap.as_mut(),
                checkpointer.as_mut(),
                records.as_mut(),
                &training_components.event_store,
            );
            if self.stops_early(
                epoch,
                validates,
                early_stopping.as_mut(),
                &training_components.event_store,
            ) {
                break;
            }
        }
        // Once, however the epochs ended (an interrupt, early stopping).
        self.report.lock().lower_ops = autocast::thread_tally().since(&tally_start);
        if self.process.is_main_process() {
            flush_events::<LC>(&mut event_processor, &training_components.event_store);
        }
        (learner.model(), event_processor)
    }

    // The fit's accumulation window, the gradient state configured for it (at every fit, so
    // that a strategy fitted again without Burn's setting goes back to its own).
    fn fit_window(&self, burn: Option<usize>) -> Accumulation {
        let accumulation = self
            .accumulation(burn)
            .unwrap_or_else(|err| fail("cannot accumulate as asked", err));
        if accumulation.sums {
            log::info!(
                "burn-accelerate: Burn's grads_accumulation({}): the gradients of {0} batches \
                 are summed before each optimizer step, as Burn's loop sums them \
                 (`AccelerateConfig::gradient_accumulation_steps` would average them)",
                accumulation.steps
            );
        }
        if let Err(err) = self
            .state
            .configure(accumulation.steps, self.config.sync_with_dataloader)
        {
            fail("cannot accumulate as asked", err);
        }
        accumulation
    }

    // The loaders the fit trains on, one per device: the strategy's shards, or this process's
    // part of the builder's loader.
    fn fit_loaders(
        &self,
        dataloader_train: &TrainLoader<LC>,
        devices: &[Device<TrainingBackend<LC>>],
    ) -> Vec<TrainLoader<LC>> {
        match &self.shards {
            Some(shards) => {
                log::info!(
                    "burn-accelerate: training data-parallel on {devices:?}, from the \
                     strategy's shards (the builder's training loader is not read)"
                );
                shards.iter().map(|s| s.loader.clone()).collect()
            }
            None => vec![
                self.prepare_loader(dataloader_train)
                    .unwrap_or_else(|err| fail("cannot shard the training loader", err)),
            ],
        }
    }

    // The fit's training step, over `replicas` devices.
    fn fit_core(
        &self,
        accumulation: Accumulation,
        loss_scale: LossScale,
        replicas: usize,
    ) -> Core<LC> {
        let mut core = Core::<LC>::new(
            self.config.step_settings(),
            loss_scale,
            self.state.clone(),
            self.group.clone(),
        )
        .with_replicas(replicas);
        if accumulation.sums {
            core = core.summing_the_window();
        }
        if !self.divides_loss {
            core = core.dividing_the_window();
        }
        core
    }

    // Burn's checkpoint of an epoch (with Burn's file checkpointer), and the strategy's own
    // (with a checkpoint directory). Only the main process writes: every process holds the
    // same model, and they share the directory. Sharded, it first gathers the whole optimizer
    // state, so that the checkpoint is the one a stage 0 run writes (every process takes part
    // in the gathering).
    #[allow(clippy::too_many_arguments)] // the pieces of Burn's loop that a checkpoint reads
    fn checkpoint_epoch(
        &self,
        epoch: usize,
        learner: &mut Learner<LC>,
        core: &Core<LC>,
        tap: Option<&mut OptimizerTap<LC>>,
        checkpointer: Option<&mut LearningCheckpointer<LC>>,
        records: Option<&mut resume::LearnerTap<LC>>,
        event_store: &EventStoreClient,
    ) {
        let writes = checkpointer.is_some() || self.checkpoint_dir.is_some();
        let own = match (core.sharded(), tap, writes) {
            (Some((group, _)), Some(tap), true) => {
                // Read twice: records need not be `Clone`, and their tensors are shared.
                let own = tap.record(learner, event_store);
                let part = tap.record(learner, event_store);
                let whole = zero::consolidate_state::<TrainingBackend<LC>, _, _>(
                    group,
                    &learner.model(),
                    part,
                    0,
                    &self.device,
                )
                .unwrap_or_else(|err| fail("cannot gather the optimizer state", err));
                if let Some(whole) = whole {
                    learner.load_optim(whole);
                }
                Some(own)
            }
            _ => None,
        };
        if !self.process.is_main_process() {
            return;
        }
        if let Some(checkpointer) = checkpointer {
            checkpointer.checkpoint(learner, epoch, event_store);
        }
        if let (Some(dir), Some(records)) = (&self.checkpoint_dir, records) {
            let state = self.checkpoint(*core.loss_scale());
            if let Err(err) =
                self.save_checkpoint(dir, epoch, learner, records, &state, event_store)
            {
                // The checkpoints listed before stay whole: a restart resumes from the newest.
                log::warn!(
                    "burn-accelerate: the checkpoint of epoch {epoch} was not written (a \
                     restart would resume from an earlier one): {err}"
                );
            }
        }
        if let Some(own) = own {
            learner.load_optim(own);
        }
        if let Some(dir) = &self.checkpoint_dir {
            AccelerateCheckpoint::prune(dir, epoch);
        }
    }

    // Whether Burn's early stopping ends the fit after `epoch`. The main process decides (it
    // alone has the validation metrics), and every process stops with it: one going on alone
    // would wait for the others forever.
    fn stops_early(
        &self,
        epoch: usize,
        validates: bool,
        early_stopping: Option<&mut Box<dyn CloneEarlyStoppingStrategy>>,
        event_store: &EventStoreClient,
    ) -> bool {
        let Some(early_stopping) = early_stopping else {
            return false;
        };
        let stop = validates && early_stopping.should_stop(epoch, event_store);
        match &self.group {
            Some(group) => group
                .broadcast_object(&stop, 0)
                .unwrap_or_else(|err| fail("cannot agree on early stopping", err)),
            None => stop,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecars_go_with_burns_model_checkpoints_and_only_in_burns_directory() {
        let dir =
            std::env::temp_dir().join(format!("burn-accelerate-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let touch = |name: &str| std::fs::write(dir.join(name), b"{}").unwrap();
        let present = |name: &str| dir.join(name).exists();
        for epoch in 1..=4 {
            touch(&format!("accelerate-{epoch}.json"));
        }
        touch("notes.json");

        // No model checkpoint of the latest epoch here: not Burn's directory, nothing goes.
        AccelerateCheckpoint::prune(&dir, 4);
        assert!((1..=4).all(|e| present(&format!("accelerate-{e}.json"))));

        // Burn kept epochs 3 and 4 (its default keeps the last two).
        touch("model-3.mpk");
        touch("model-4.mpk");
        AccelerateCheckpoint::prune(&dir, 4);
        let kept: Vec<bool> = (1..=4)
            .map(|e| present(&format!("accelerate-{e}.json")))
            .collect();
        assert_eq!(kept, [false, false, true, true]);
        assert!(present("notes.json"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
