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
//! Each fit builds its own [`Context`](crate::Context) ([`Autocast::context`]), with an fp8
//! state of its own: two trainings may run at once on two threads of one process, in
//! different precisions (fp8 included).
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
//! the same overflowing one, on any backend. Every process validates its own whole batches of
//! the validation loader ([`AccelerateStrategy::prepare_valid_loader`]), in the training's
//! precision, and the validation metrics of all processes are combined before anything reads
//! them ([`ProcessMetricLogger`]): every process's Burn metrics (its event store, so early
//! stopping and the metric-based checkpointing strategies) hold the values of one process
//! validating everything, as Accelerate's `gather_for_metrics` gives every process the
//! gathered results. Burn's renderer still shows this process's own batches while they run.
//! Every process asks its early stopping; the main process's answer is every process's. Only
//! the main process writes checkpoints (give every process the same directory); every process
//! restores them. Burn's metric log files and learner summary are the main process's: give
//! the strategy the artifact directory ([`AccelerateStrategy::with_artifact_dir`]); the other
//! processes keep their metric logs in memory ([`WithAccelerate::with_accelerate`]) and make no
//! summary (they would write the same log files of the same directory as the main process,
//! and read them while it writes: Burn's summary then fails to parse them); their renderers
//! still see their own training items.
//!
//! With a ZeRO stage ([`AccelerateConfig::zero_stage`], see
//! [`ZeroStage`]), each process's optimizer steps and keeps
//! state for its own partition of the parameters, and the updated parameters are shared back
//! after each step; at stage 2 each process keeps only its partition's averaged gradients,
//! and an overflow in any partition skips the step on every process. At stage 3 each
//! process's part is its slice of every parameter instead (its gradients, its optimizer
//! state, and between steps the parameters themselves). Burn's checkpoints hold
//! the whole optimizer state, gathered on the main process before it writes, so a run
//! resumes at any stage and on any number of processes. The optimizer's record must keep its
//! state per parameter ([`ParamStateRecord`]: every Burn optimizer's does).
//!
//! At stage 3 the learner's model keeps each process's slice of every parameter from the
//! start of the fit (released before its first forward pass, as the `Accelerator`'s
//! `prepare_model` releases it, so that the first accumulation window is sharded too) and
//! between steps; [`AccelerateStrategy::prepare_model`] releases it before Burn's `launch`,
//! which would otherwise initialise a lazy model whole on every process, and the fit then
//! releases nothing again. Before its optimizer steps, the learner is given the model of
//! this process's slices (Burn's optimizers step them as they would whole parameters); after
//! it, Burn reloads the released model (its `load_model`), and on the decorator
//! ([`Accelerated`](crate::Accelerated)) every parameter comes back as a placeholder,
//! gathered from every process's slice where an op reads it (on Burn's backends without the
//! decorator it is gathered whole at the reload, as their lazy gather would at the first use:
//! stage 2's peak). For a checkpoint (Burn's file checkpointer, the strategy's own) the
//! model's record is gathered on the main process parameter by parameter, from every
//! process's slices, and its learner holds the whole model while they write it. The fit hands
//! Burn back the model whole on every process. Burn's parameter mappers (`Param::save_mapper`,
//! `load_mapper`) are not supported at stage 3 here: the reload after each step would run
//! them on placeholders.
//!
//! Burn's own DDP (`ExecutionStrategy::DistributedDataParallel`) is not used: its gradient
//! all-reduce is `DistributedBackend::all_reduce`, which only cubecl's CUDA runtime
//! implements (NCCL), and which Flex and NdArray do not implement at all.

mod checkpoint;
mod fit;
pub mod metrics;
mod replicas;
mod report;
mod resume;
mod tap;
mod valid;
mod valid_metrics;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::module::{AutodiffModule, Module};
use burn::tensor::Device;
use burn::tensor::backend::Backend;
use burn::train::logger::{FileMetricLogger, InMemoryMetricLogger, MetricLogger};
use burn::train::metric::store::{Aggregate, EventStoreClient, Split};
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, Learner,
    LearnerEvent, LearnerOptimizerRecord, LearningCheckpointer, LearningComponentsTypes,
    LearningResult, SupervisedLearningStrategy, SupervisedTraining,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingBackend, TrainingComponents,
    TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};

use crate::accelerator::LossScaledBy;
use crate::autocast::{self, Autocast, LowerOpTally};
use crate::checkpoint::LoadedCheckpoint;
use crate::checkpoint::records::Scheme;
use crate::data::{EvenSplit, ProcessShare, ProcessSlice, ShardLoader, move_and_identify};
use crate::distributed::{ProcessGroup, ProcessState};
use crate::gradient_state::GradientState;
use crate::placement::check_data_parallel;
use crate::scaler::{LossScale, ThreadArmed};
use crate::step::{StepCore, StepOutcome};
use crate::zero::{ParamStateRecord, ZeroStage};
use crate::{AccelerateConfig, AccelerateError, AcceleratorState, Precision};
pub use checkpoint::AccelerateCheckpoint;
use checkpoint::LoaderPosition;
use fit::{Accumulation, fail};
use replicas::{DeviceWorkers, StepInput};
pub use report::{EpochReport, TrainingReport, TrainingStats};
use tap::RecordTap;
pub use valid_metrics::ProcessMetricLogger;
use valid_metrics::ProcessMetrics;

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
    /// On several processes, also registers the run's metric logger, a
    /// [`ProcessMetricLogger`]: every process validates its own batches and the logger combines
    /// the validation entries of all processes (see [`AccelerateStrategy::prepare_valid_loader`]),
    /// so that Burn's epoch values, early stopping, checkpoint choice and summary read the
    /// same numbers on every process (Burn's perplexity included, whose entries are rebuilt).
    /// A numeric metric whose entries cannot be combined (an entry that carries state from
    /// the batches before it) is shown per process and named in a warning and in
    /// [`TrainingStats::valid_metrics_per_process`]. It writes Burn's metric log files in the artifact
    /// directory on the main process
    /// ([`AccelerateStrategy::with_artifact_dir`]: Burn does not tell a strategy its builder's
    /// directory) and keeps them in memory on the others, which share the directory (every
    /// process would truncate and write the same files, which Burn's summary then cannot
    /// parse). It replaces Burn's default file logger; a metric logger registered with
    /// `with_metric_logger` is the user's own, sees this process's validation entries only,
    /// and must be registered after `with_accelerate` (Burn reads epoch values from the first
    /// logger registered).
    fn with_accelerate(self, mut strategy: AccelerateStrategy<LC>) -> Self {
        let builder = if strategy.process.is_distributed() {
            let metrics = ProcessMetrics::new(strategy.metric_logger());
            let builder = self.with_metric_logger(metrics.logger());
            strategy.valid_metrics = Some(metrics);
            builder
        } else {
            self
        };
        builder.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
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
    /// The checkpoint [`try_with_checkpoint_dir`](Self::try_with_checkpoint_dir) read and
    /// verified, held for the resume to load without reading and hashing its files again (of
    /// a sharded one, the shard files this process surely reads alone:
    /// `sharded::kept_at_start_up`).
    verified: Mutex<Option<LoadedCheckpoint>>,
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
    /// Where the main process writes Burn's metric logs on several processes.
    artifact_dir: Option<PathBuf>,
    /// The validation metrics of the processes, combined (on several processes; set by
    /// [`WithAccelerate::with_accelerate`]).
    valid_metrics: Option<ProcessMetrics>,
}

// One device of a data-parallel training and the loader of its Accelerate shard.
struct Shard<LC: LearningComponentsTypes> {
    device: Device<TrainingBackend<LC>>,
    loader: TrainLoader<LC>,
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    /// A strategy training on `device` as `config` says.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for zero accumulation steps or an invalid scaler
    /// setting; [`AccelerateError::UnsupportedPrecision`]
    /// when the device cannot run `mixed_precision` and `allow_fallback` is off;
    /// [`AccelerateError::NotAccelerated`] for bf16 or f16 on a training backend that is not
    /// [`Accelerated`](crate::Accelerated) (autocast would do nothing there);
    /// [`AccelerateError::Distributed`] for a bad launch environment or a process group that
    /// cannot be joined.
    pub fn new(
        config: AccelerateConfig,
        device: &Device<TrainingBackend<LC>>,
    ) -> Result<Self, AccelerateError> {
        // Refused on a backend without the decorator: its `backward` scales the loss here.
        let (autocast, initial_scale) =
            config.init_mixed_precision::<TrainingBackend<LC>>(device, LossScaledBy::Decorator)?;
        // A gradient state of its own: the process-wide one may be configured by a
        // hand-written loop's `Accelerator` with other settings.
        let state = GradientState::new();
        let (process, group) = config.join_run(&state)?;
        let report = TrainingReport {
            inner: Arc::new(Mutex::new(TrainingStats {
                requested: autocast.requested(),
                precision: autocast.precision(),
                fell_back: autocast.fell_back(),
                loss_scale: initial_scale,
                epochs: Vec::new(),
                lower_ops: LowerOpTally::default(),
                valid_lower_ops: LowerOpTally::default(),
                valid_processes: 1,
                valid_metrics_per_process: Vec::new(),
                resumed_from: None,
                skipped_live: 0,
            })),
            valid_seconds: Arc::default(),
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
            verified: Mutex::new(None),
            resume: resume::ResumeSettings::default(),
            positions: Vec::new(),
            process,
            group,
            divides_loss: TrainingBackend::<LC>::name(device).starts_with("accelerated<"),
            artifact_dir: None,
            valid_metrics: None,
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
            .init_mixed_precision::<TrainingBackend<LC>>(device, LossScaledBy::Decorator)?;
        if autocast.precision() == self.autocast.precision() {
            return Ok(());
        }
        // The probe without the fallback names what this device cannot run.
        self.config
            .clone()
            .with_allow_fallback(false)
            .init_mixed_precision::<TrainingBackend<LC>>(device, LossScaledBy::Decorator)?;
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

    /// Accelerate's `prepare(model)` for the model the learner will train, before Burn's
    /// `Learner` is built: at ZeRO stage 3
    /// ([`ZeroStage::Parameters`]) across processes, each
    /// process keeps only its slice of every parameter from here on, as the fit keeps them
    /// after every step. Parameters Burn has not initialised yet (`Module::init`'s lazy ones)
    /// are initialised one at a time, in visiting order, and dropped once this process cut its
    /// slice: a model no process can hold whole is never whole on any process.
    ///
    /// Without it the fit still shards the model before its first forward pass, but Burn's
    /// `SupervisedTraining::launch` reads the learner's model (`devices()`) before the strategy
    /// sees it, and so initialises every lazy parameter whole on every process, from `launch`
    /// until the fit starts. With it, that read finds each released parameter's placeholder
    /// (a few bytes, on the decorator [`Accelerated`](crate::Accelerated)), and the fit
    /// releases nothing again. The numbers are the same either way: the
    /// parameters are initialised in the order `launch` would initialise them.
    ///
    /// At other stages, or on one process, `model` as it is. Every process must call it, with
    /// the same model (the partition is computed from its parameters' shapes). The strategy's
    /// checkpoints and their resume (consolidated or sharded) work as without it.
    ///
    /// ```text
    /// let strategy = AccelerateStrategy::<LC>::new(
    ///     AccelerateConfig::new().with_zero_stage(ZeroStage::Parameters),
    ///     &device,
    /// )?;
    /// let model = strategy.prepare_model(ModelConfig::new().init(&device));
    /// let learner = Learner::new(model, AdamConfig::new().init(), 1e-3);
    /// SupervisedTraining::new(dir, train, valid)
    ///     .with_accelerate(strategy)
    ///     .launch(learner);
    /// ```
    pub fn prepare_model(&self, model: TrainingModel<LC>) -> TrainingModel<LC> {
        // The step core's release, the one the fit and the `Accelerator` run (a core of its
        // own: it counts no batch, and the fit's core computes the same partition).
        StepCore::<TrainingBackend<LC>>::new(
            self.config.step_settings(),
            self.initial_scale,
            self.state.clone(),
            self.group.clone(),
        )
        .prepare_model(model)
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
    /// With `AccelerateConfig::with_checkpoint_layout(CheckpointLayout::Sharded)` at ZeRO
    /// stages 1 to 3 on several processes, each process writes its own partition's model and
    /// optimizer files (`model-N.shard-R-of-W.mpk`, `optimizer-N.shard-R-of-W.mpk`, as the
    /// `Accelerator`'s `save_checkpoint` does) and the main process the scheduler's record and
    /// the state, listed once every process wrote; the resume reads either kind on any number
    /// of processes at any stage.
    ///
    /// With Burn's file checkpointer set as well, Burn still writes its own files (your
    /// recorder, your checkpointing strategy) beside these, whole whatever the layout (the
    /// main process gathers the model and optimizer state for them): drop
    /// `with_file_checkpointer` to write each epoch once. A strategy-state file goes with its
    /// checkpoint, unless Burn still keeps that epoch's model in `dir`.
    ///
    /// Burn's `fit` has no error channel: a directory that cannot be resumed from (a damaged
    /// manifest, every listed checkpoint missing a file, a record of another model, a state
    /// saved with another accumulation window, `sync_with_dataloader` or kind of loss scaling,
    /// which the `Accelerator`'s `load_state` refuses too) stops the training with a panic that
    /// says why. [`try_with_checkpoint_dir`](Self::try_with_checkpoint_dir)
    /// checks what can be checked before the training starts and returns it as an error, and
    /// [`check_checkpoint_fits`](Self::check_checkpoint_fits) the model's record against the
    /// model.
    pub fn with_checkpoint_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        // What was verified in another directory is not this one's.
        self.verified = Mutex::new(None);
        self
    }

    /// [`with_checkpoint_dir`](Self::with_checkpoint_dir), once `dir` is found fit to resume
    /// from in all that can be checked without the model: its manifest
    /// (`accelerate-checkpoints.json`) is absent (a fresh run) or reads, and the checkpoint the
    /// resume would choose (the newest whose files all have their listed lengths and SHA-256;
    /// a newer one that does not is passed over, as the resume passes it over) lists every
    /// file the resume reads, and its state file (`accelerate-N.json`) decodes. Call it where
    /// the strategy is built, so that a damaged directory is an error the program prints in
    /// one line, not a panic inside Burn's `fit`. The model's record is checked against the
    /// model by [`check_checkpoint_fits`](Self::check_checkpoint_fits) (and again when the
    /// training resumes); an epoch asked for with `.checkpoint(epoch)` is not known here, and
    /// is checked then.
    ///
    /// The checkpoint chosen is held, read and verified, until the training starts, and the
    /// resume loads that copy (the loss scale and the loaders' positions included): the files
    /// held are not read or hashed again, and such a file changed on disk in between changes
    /// nothing.
    /// (The bytes are held from here rather than only while resuming: the resume holds them
    /// and their decoded records at once anyway.) Of a sharded checkpoint
    /// (`CheckpointLayout::Sharded`) each process holds only the shard files it surely loads:
    /// its own, when it runs on as many processes as saved it, none otherwise (the model is
    /// not known here); every other file is verified without being held, and read when the
    /// resume (or [`check_checkpoint_fits`](Self::check_checkpoint_fits)) needs it, checked
    /// against the checksum it verified with: one changed in between stops the resume with an
    /// error naming it, and is never loaded. No process so holds the whole model and optimizer
    /// state of a ZeRO stage 3 run at start-up.
    ///
    /// ```
    /// use burn::train::{LearningComponentsTypes, TrainingBackend};
    /// use burn::tensor::Device;
    /// use burn_accelerate::train::AccelerateStrategy;
    /// use burn_accelerate::{AccelerateConfig, AccelerateError};
    ///
    /// fn strategy<LC: LearningComponentsTypes>(
    ///     device: &Device<TrainingBackend<LC>>,
    /// ) -> Result<AccelerateStrategy<LC>, AccelerateError> {
    ///     AccelerateStrategy::new(AccelerateConfig::new(), device)?
    ///         .try_with_checkpoint_dir("runs/mlp/checkpoint")
    /// }
    /// ```
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] naming the manifest when it cannot be read or parsed,
    /// when it lists checkpoints and none verifies (each one's first missing, cut or altered
    /// file named), or when the one chosen lacks a file; naming the state file when it does not
    /// decode (the resume would stop there too, not fall back).
    pub fn try_with_checkpoint_dir(self, dir: impl Into<PathBuf>) -> Result<Self, AccelerateError> {
        let dir = dir.into();
        let verified = self.precheck(&dir)?;
        let mut strategy = self.with_checkpoint_dir(dir);
        strategy.verified = Mutex::new(verified);
        Ok(strategy)
    }

    // The start-up check of `dir` for this process (`sharded::precheck`).
    fn precheck(&self, dir: &std::path::Path) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
        let (rank, world) = (self.process.process_index(), self.process.num_processes());
        crate::checkpoint::sharded::precheck(dir, Scheme::Strategy, rank, world)
    }

    /// The files of the checkpoint the start-up check
    /// ([`try_with_checkpoint_dir`](Self::try_with_checkpoint_dir)) holds in memory for the
    /// resume, by name with their length in bytes, until the training starts (empty when it
    /// holds none): what the tests of issue 48 read to show that a process holds no other
    /// process's shard files.
    #[doc(hidden)]
    pub fn start_up_check_held_files(&self) -> Vec<(String, usize)> {
        let verified = self.verified.lock().unwrap_or_else(PoisonError::into_inner);
        verified
            .iter()
            .flat_map(|loaded| &loaded.files)
            .map(|(name, bytes)| (name.clone(), bytes.len()))
            .collect()
    }

    /// Checks that the model's record of the checkpoint the training would resume from
    /// (the one [`try_with_checkpoint_dir`](Self::try_with_checkpoint_dir) verified) holds
    /// exactly `model`'s parameters, each under the same path and of the same shape, before
    /// the training starts: a checkpoint of another model is then an error the program prints
    /// in one line, not a panic inside Burn's `fit`. `model` is not changed (the record is
    /// loaded into a copy, which is dropped; lazy parameters stay uninitialised). Nothing to
    /// check without a checkpoint directory, or in one with no checkpoint yet.
    ///
    /// ```
    /// use burn::train::{LearningComponentsTypes, TrainingModel};
    /// use burn_accelerate::train::AccelerateStrategy;
    /// use burn_accelerate::AccelerateError;
    ///
    /// fn checked<LC: LearningComponentsTypes>(
    ///     strategy: AccelerateStrategy<LC>,
    ///     model: &TrainingModel<LC>,
    /// ) -> Result<AccelerateStrategy<LC>, AccelerateError> {
    ///     let strategy = strategy.try_with_checkpoint_dir("runs/mlp/checkpoint")?;
    ///     strategy.check_checkpoint_fits(model)?;
    ///     Ok(strategy)
    /// }
    /// ```
    ///
    /// # Errors
    /// What [`try_with_checkpoint_dir`](Self::try_with_checkpoint_dir) returns, when the
    /// directory was given with [`with_checkpoint_dir`](Self::with_checkpoint_dir) and is
    /// checked here; [`AccelerateError::Checkpoint`] naming the model's record file and the
    /// first parameter of `model` that it lacks or holds in another shape, or why it does not
    /// decode as `model`'s record.
    pub fn check_checkpoint_fits(&self, model: &TrainingModel<LC>) -> Result<(), AccelerateError> {
        let Some(dir) = &self.checkpoint_dir else {
            return Ok(());
        };
        let mut verified = self.verified.lock().unwrap_or_else(PoisonError::into_inner);
        if verified.is_none() {
            *verified = self.precheck(dir)?;
        }
        match &*verified {
            Some(loaded) => crate::checkpoint::sharded::precheck_model::<TrainingBackend<LC>, _>(
                dir,
                loaded,
                Scheme::Strategy,
                model,
                &self.device,
            ),
            None => Ok(()),
        }
    }

    /// Saves `loader`'s epoch and position (and its seeds) with every checkpoint, and restores
    /// them when the training resumes with `.checkpoint(epoch)`, so that the resumed epochs
    /// see the shuffled order an uninterrupted run would have (the seedable sampler's order
    /// depends on the loader's epoch, which starts at 0 in a new process). Pass the
    /// [`ShardLoader`] given to `SupervisedTraining::new` (its copies share the position); a
    /// [`data_parallel`](Self::data_parallel) strategy saves its shards' without being asked.
    /// Needs [`with_checkpoint_dir`](Self::with_checkpoint_dir).
    ///
    /// ```text
    /// // As `examples/common/mlp.rs`'s `run` does, for the MLP of `examples/train_mlp.rs`:
    /// let train = ShardLoaderBuilder::<B, Sample, BlobBatch<B>>::new(
    ///     DataLoaderConfig::new(64).with_shuffle(true).with_data_seed(Some(42)),
    ///     InMemDataset::new(samples),
    ///     BlobBatcher,
    /// )
    /// .build_for(&ProcessState::from_env()?, device.clone())?;
    /// let strategy = AccelerateStrategy::new(AccelerateConfig::new(), &device)?
    ///     .with_checkpoint_dir("/tmp/run/checkpoint")
    ///     .with_checkpointed_loader(&train);
    /// // SupervisedTraining::new("/tmp/run", Arc::new(train), valid).with_accelerate(strategy)...
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

    /// The directory given to `SupervisedTraining::new`, where the main process of a run on
    /// several processes writes Burn's metric logs (which Burn's learner summary reads). There
    /// [`WithAccelerate::with_accelerate`] replaces Burn's file logger with one that combines
    /// the validation metrics of the processes, and Burn does not tell a strategy its
    /// builder's directory: without this, the logs are kept in memory (the metrics, early
    /// stopping and checkpoint choice still work) and a warning says so. Not needed on one
    /// process, where Burn's own logger writes them.
    ///
    /// ```
    /// use burn::train::LearningComponentsTypes;
    /// use burn_accelerate::train::AccelerateStrategy;
    ///
    /// fn with_logs<LC: LearningComponentsTypes>(
    ///     strategy: AccelerateStrategy<LC>,
    /// ) -> AccelerateStrategy<LC> {
    ///     let dir = "/tmp/run";
    ///     // SupervisedTraining::new(dir, train, valid).with_accelerate(strategy)...
    ///     strategy.with_artifact_dir(dir)
    /// }
    /// ```
    pub fn with_artifact_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.artifact_dir = Some(dir.into());
        self
    }

    // The logger the combined metrics of this process go to (see `with_accelerate`).
    //
    // Why the directory must be given again: burn-train 0.21 keeps it where neither
    // `with_accelerate` nor the strategy can read it. `SupervisedTraining`'s `directory` is a
    // private field (src/learner/supervised/paradigm.rs:60) with no getter among its public
    // methods (paradigm.rs:92-328); `launch` uses it for its own file logger only when no
    // logger was registered (paradigm.rs:338-341), and `with_accelerate` registers this one.
    // What reaches the strategy's `train` is `TrainingComponents` (src/learner/supervised/
    // strategies/base.rs:144-163), which holds no directory; its `summary`, a
    // `LearnerSummaryConfig`, holds it as `pub(crate)` (src/learner/summary.rs:388-391), and
    // only when `.summary()` was called.
    fn metric_logger(&self) -> Box<dyn MetricLogger> {
        let rank = self.process.process_index();
        let processes = self.process.num_processes();
        match (&self.artifact_dir, self.process.is_main_process()) {
            (Some(dir), true) => Box::new(FileMetricLogger::new(dir)),
            (None, true) => {
                log::warn!(
                    "burn-accelerate: process {rank} of {processes}: Burn's metric logs are \
                     kept in memory, not written (no summary either): give the strategy the \
                     artifact directory with `.with_artifact_dir(dir)`"
                );
                Box::new(InMemoryMetricLogger::new())
            }
            (_, false) => {
                log::info!(
                    "burn-accelerate: process {rank} of {processes}: Burn's metric logs are \
                     kept in memory here, not written to the artifact directory (the main \
                     process writes them)"
                );
                Box::new(InMemoryMetricLogger::new())
            }
        }
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
