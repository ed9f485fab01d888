//! The model, data and run of `examples/train_mlp.rs`, shared with the tests (which include
//! this file with `#[path]`; the library exports no example model): an MLP classifier trained
//! through Burn's `SupervisedTraining` and `with_accelerate` on a dataset this file makes
//! (overlapping Gaussian blobs; nothing is downloaded).
//!
//! # Test hook
//!
//! [`FAIL_AT`] (`BURN_ACCELERATE_TEST_FAIL_AT`), for tests only, makes a process of [`run`]
//! fail at a training step of its choosing, in one attempt of a restarted run: a value
//! `RESTART:RANK:STEP[:ACTION]` (several, comma-separated) makes process `RANK` of the attempt
//! whose restart count is `RESTART` (0: the first start) kill itself with `SIGKILL` (`kill`,
//! the default), freeze with `SIGSTOP` (`stop`: its peers' liveness check then fails the run)
//! or exit with status `N` (`exit=N`) as its `STEP`th training step (counted from 1 in that
//! process, a resumed one from its resumed epoch) begins. The tests of restarts use
//! it to fail a run in the middle of an epoch at a place that does not depend on timing.

// Each example and test that includes this file uses a part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::config::Config;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::LrScheduler;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn::train::metric::{LossMetric, MetricDefinition};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};

use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
use burn_accelerate::distributed::{DistributedError, ProcessState};
use burn_accelerate::scaler::GradScalerConfig;
use burn_accelerate::train::metrics::AccelerateMetric;
use burn_accelerate::train::{AccelerateStrategy, TrainingStats, WithAccelerate};
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{AccelerateConfig, AccelerateError, Precision};

/// Input features of a sample.
pub const FEATURES: usize = 8;
/// Classes to tell apart.
pub const CLASSES: usize = 4;

/// One labelled sample of the blobs dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The features.
    pub x: [f32; FEATURES],
    /// The class, below [`CLASSES`].
    pub label: usize,
}

// SplitMix64 (Steele, Lea, Flood 2014), the loader's generator: dependency-free, so the
// dataset is the same everywhere.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    // Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    // Box-Muller.
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * core::f64::consts::PI * v).cos()
    }
}

/// `n` samples of [`CLASSES`] Gaussian blobs in [`FEATURES`] dimensions whose centres (fixed
/// by `seed`) lie close enough for the classes to overlap: the loss plateaus well above zero,
/// so runs in different precisions can be compared by their final loss.
pub fn blobs(n: usize, seed: u64) -> Vec<Sample> {
    let mut centres = SplitMix(0xB10B5);
    let centres: Vec<[f64; FEATURES]> = (0..CLASSES)
        .map(|_| core::array::from_fn(|_| centres.normal()))
        .collect();
    let mut rng = SplitMix(seed);
    (0..n)
        .map(|i| {
            let label = i % CLASSES;
            let x = core::array::from_fn(|f| (centres[label][f] + 1.2 * rng.normal()) as f32);
            Sample { x, label }
        })
        .collect()
}

/// A batch of [`Sample`]s as tensors.
#[derive(Debug, Clone)]
pub struct BlobBatch<B: Backend> {
    /// `[batch, FEATURES]`.
    pub x: Tensor<B, 2>,
    /// `[batch]` class indices.
    pub labels: Tensor<B, 1, Int>,
}

/// Turns [`Sample`]s into a [`BlobBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct BlobBatcher;

impl<B: Backend> Batcher<B, Sample, BlobBatch<B>> for BlobBatcher {
    fn batch(&self, items: Vec<Sample>, device: &B::Device) -> BlobBatch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|s| s.x).collect();
        let labels: Vec<i64> = items.iter().map(|s| s.label as i64).collect();
        BlobBatch {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// The classifier: two hidden ReLU layers.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Mlp<B> {
    /// A new model on `device` (seed the backend first for a reproducible one).
    pub fn new(hidden: usize, device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, hidden).init(device),
            fc2: LinearConfig::new(hidden, hidden).init(device),
            out: LinearConfig::new(hidden, CLASSES).init(device),
            relu: Relu::new(),
        }
    }

    /// Logits, `[batch, CLASSES]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.relu.forward(self.fc1.forward(x));
        let x = self.relu.forward(self.fc2.forward(x));
        self.out.forward(x)
    }

    /// The cross-entropy loss and outputs of a batch.
    pub fn classify(&self, batch: BlobBatch<B>) -> ClassificationOutput<B> {
        let output = self.forward(batch.x);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, output, batch.labels)
    }
}

impl<B: AutodiffBackend> TrainStep for Mlp<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        fail_if_asked();
        let item = self.classify(batch);
        // Unmodified: the strategy's armed scale reaches this backward.
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Mlp<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}

/// The learning components of an [`Mlp`] trained by Adam at a constant learning rate, in
/// Burn's terms: what a strategy for it is built over (`AccelerateStrategy::<MlpComponents<B>>`)
/// outside [`run`].
pub type MlpComponents<B> = burn::train::LearningComponentsMarker<
    B,
    f64,
    Mlp<B>,
    burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Mlp<B>, B>,
>;

/// A learning-rate scheduler that counts its steps (on a shared counter) and delegates to
/// another: how the tests see that the scheduler steps once per optimizer step.
#[derive(Debug, Clone)]
pub struct CountedScheduler<S> {
    inner: S,
    steps: Arc<AtomicUsize>,
}

impl<S> CountedScheduler<S> {
    /// Counts `inner`'s steps.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            steps: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The counter, shared by every clone.
    pub fn counter(&self) -> Arc<AtomicUsize> {
        self.steps.clone()
    }
}

impl<S: LrScheduler> LrScheduler for CountedScheduler<S> {
    type Record<B: Backend> = S::Record<B>;

    fn step(&mut self) -> f64 {
        self.steps.fetch_add(1, Ordering::SeqCst);
        self.inner.step()
    }

    fn to_record<B: Backend>(&self) -> Self::Record<B> {
        self.inner.to_record::<B>()
    }

    fn load_record<B: Backend>(self, record: Self::Record<B>) -> Self {
        Self {
            inner: self.inner.load_record::<B>(record),
            steps: self.steps,
        }
    }
}

/// A renderer that shows nothing: the example prints its own summary.
#[derive(Debug, Default)]
pub struct QuietRenderer;

impl MetricsRendererTraining for QuietRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for QuietRenderer {
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl MetricsRenderer for QuietRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// The settings of one demo run.
#[derive(Config, Debug)]
pub struct DemoConfig {
    /// Autocast precision.
    #[config(default = "Precision::F32")]
    pub precision: Precision,
    /// Batches per optimizer step.
    #[config(default = 1)]
    pub grad_accum: usize,
    /// Epochs to train.
    #[config(default = 8)]
    pub epochs: usize,
    /// Seeds the model's initialisation and the loader's shuffle.
    #[config(default = 42)]
    pub seed: u64,
    /// Training samples.
    #[config(default = 4096)]
    pub train_items: usize,
    /// Validation samples (the final loss and accuracy are measured on them).
    #[config(default = 1024)]
    pub valid_items: usize,
    /// Samples per batch, per process: under `burn-accelerate launch --num-processes N` a
    /// step sees `N × batch_size` samples.
    #[config(default = 64)]
    pub batch_size: usize,
    /// Hidden width.
    #[config(default = 64)]
    pub hidden: usize,
    /// Adam's learning rate (constant). At 3e-3 the 8-epoch run is chaotic enough that
    /// summing the same gradients in another order (2 processes of 32 against 1 of 64) moved
    /// the final loss by 2e-4 (seed 42); at 1e-3 every seed tried ends within 1e-6.
    #[config(default = 1e-3)]
    pub lr: f64,
    /// Run in f32 when the device cannot run `precision`, instead of failing.
    #[config(default = true)]
    pub allow_fallback: bool,
    /// The loss scale to start from (f16), instead of torch's 2^16; a huge one makes the
    /// first steps overflow, to watch the scaler back off.
    pub init_scale: Option<f64>,
    /// How the training state is sharded across processes.
    #[config(default = "ZeroStage::None")]
    pub zero_stage: ZeroStage,
    /// The training's small-op rule (`AccelerateConfig::small_ops`); `None`: the one in force.
    pub small_ops: Option<burn_accelerate::autocast::SmallOps>,
    /// Where to checkpoint every epoch, crash-safely, and resume from when started again
    /// (`AccelerateStrategy::with_checkpoint_dir`); `None`: no checkpoints.
    pub checkpoint_dir: Option<String>,
}

/// What a demo run ended with.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoOutcome {
    /// Mean cross-entropy on the validation samples after training, in the training's
    /// precision (under its autocast, as Accelerate's prepared model evaluates), on every
    /// process.
    pub loss: f32,
    /// Fraction of validation samples classified right.
    pub accuracy: f32,
    /// Learning-rate scheduler steps counted over the run.
    pub scheduler_steps: usize,
    /// What the strategy reported.
    pub stats: TrainingStats,
    /// Each epoch's validation phase's wall time on this process, in seconds
    /// (`TrainingReport::valid_seconds`).
    pub valid_seconds: Vec<f64>,
}

impl DemoOutcome {
    /// The example's last line: `final loss=<f> accuracy=<f> skipped_steps=<n> precision=<p>`,
    /// then how many of the lower-class ops ran in the half type and how many autocast kept
    /// in f32 (`half_ops=<n>/<all> half_flops=<pct>% kept_f32=<n> small,<n> unsupported`),
    /// and, where a half precision ran none of them because all were small, why; last
    /// `valid_precision=<p>`: the validation (Burn's in the fit, and this final one) runs in the
    /// training's precision, as Accelerate's prepared model evaluates under autocast.
    pub fn summary_line(&self) -> String {
        let ops = &self.stats.lower_ops;
        let why = if ops.half_ops == 0 && ops.small_ops > 0 {
            " (every linear is below autocast's small-op threshold and ran in f32, so the \
             precisions end alike: --hidden 512 runs the hidden layer in the half type)"
        } else {
            ""
        };
        format!(
            "final loss={:.6} accuracy={:.4} skipped_steps={} precision={} {}{why} \
             valid_precision={}",
            self.loss,
            self.accuracy,
            self.stats.skipped_steps(),
            self.stats.precision.short_name(),
            ops.summary(),
            self.stats.precision.short_name(),
        )
    }
}

/// Trains the [`Mlp`] on [`blobs`] through `SupervisedTraining` + `with_accelerate` on
/// `device`; `B` should be `Accelerated<Autodiff<_>>` for a mixed precision.
///
/// The training data is read through this process's Accelerate shard (shuffled with `seed`):
/// under `burn-accelerate launch` each process trains on its own batches and the gradients
/// are averaged, so `N` processes with batch size `b` see the batches of one process with
/// batch size `N × b`.
///
/// # Errors
/// What [`AccelerateStrategy::new`] returns for the config; a bad launch environment.
pub fn run<B: AutodiffBackend>(
    config: &DemoConfig,
    device: &B::Device,
) -> Result<DemoOutcome, AccelerateError> {
    let accelerate = AccelerateConfig::new()
        .with_mixed_precision(config.precision)
        .with_gradient_accumulation_steps(config.grad_accum)
        .with_allow_fallback(config.allow_fallback)
        .with_zero_stage(config.zero_stage)
        .with_small_ops(config.small_ops);
    let accelerate = match config.init_scale {
        Some(scale) => accelerate.with_grad_scaler(GradScalerConfig::new().with_init_scale(scale)),
        None => accelerate,
    };
    let mut strategy = AccelerateStrategy::new(accelerate, device)?;
    let report = strategy.report();
    let autocast = *strategy.autocast();
    arm_failures()?;

    let process = ProcessState::from_env()?;
    let train = ShardLoaderBuilder::<B, Sample, BlobBatch<B>>::new(
        DataLoaderConfig::new(config.batch_size)
            .with_shuffle(true)
            .with_data_seed(Some(config.seed)),
        InMemDataset::new(blobs(config.train_items, 1)),
        BlobBatcher,
    )
    .build_for(&process, device.clone())?;
    if let Some(dir) = &config.checkpoint_dir {
        // Burn's fit has no error channel: a directory whose manifest is damaged, whose
        // listed checkpoints all fail their checksums, or whose chosen state file does not
        // decode, is said here as a typed error, before training. The loader's position too:
        // a resumed epoch must see the order the uninterrupted run's did.
        strategy = strategy
            .try_with_checkpoint_dir(dir)?
            .with_checkpointed_loader(&train);
    }
    let valid_data = blobs(config.valid_items, 2);
    let valid = DataLoaderBuilder::<B::InnerBackend, _, _>::new(BlobBatcher)
        .batch_size(config.batch_size)
        .build(InMemDataset::new(valid_data.clone()));

    B::seed(device, config.seed);
    let model = Mlp::<B>::new(config.hidden, device);
    // A checkpoint of another model (other parameter names or shapes): said here too.
    strategy.check_checkpoint_fits(&model)?;
    let scheduler = CountedScheduler::new(config.lr);
    let scheduler_steps = scheduler.counter();
    let learner = Learner::new(model, AdamConfig::new().init(), scheduler);
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-train-mlp-{}-{}",
        std::process::id(),
        config.precision.accelerate_name()
    ));
    let result = SupervisedTraining::new(&dir, Arc::new(train), valid)
        .num_epochs(config.epochs)
        .metric_train_numeric(AccelerateMetric::loss_scale(&report))
        .metric_train_numeric(AccelerateMetric::skipped_steps(&report))
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .renderer(QuietRenderer)
        .with_application_logger(None)
        .with_accelerate(strategy.with_artifact_dir(&dir))
        .launch(learner);
    let _ = std::fs::remove_dir_all(&dir);

    // Evaluated in the training's precision, as the fit validates; on every process the whole
    // set (one batch: every process ends with the single-process run's numbers, to every
    // digit).
    let (loss, accuracy) = {
        let _autocast = autocast.enter();
        let batch = Batcher::<B::InnerBackend, _, _>::batch(&BlobBatcher, valid_data, device);
        let labels = batch.labels.clone();
        let output = result.model.classify(batch);
        let n = labels.dims()[0];
        let correct: i64 = output
            .output
            .argmax(1)
            .flatten::<1>(0, 1)
            .equal(labels)
            .int()
            .sum()
            .into_scalar()
            .elem();
        let loss: f32 = output.loss.into_scalar().elem();
        (loss, correct as f32 / n as f32)
    };
    Ok(DemoOutcome {
        loss,
        accuracy,
        scheduler_steps: scheduler_steps.load(Ordering::SeqCst),
        stats: report.stats(),
        valid_seconds: report.valid_seconds(),
    })
}

/// The test hook's variable (see the [module docs](self)); for tests only.
pub const FAIL_AT: &str = "BURN_ACCELERATE_TEST_FAIL_AT";

/// What a failure of the test hook does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAction {
    /// `SIGKILL` to its own process (an OOM kill, a pre-empted machine).
    Kill,
    /// `SIGSTOP` to its own process (a frozen process, a machine swapping): its peers'
    /// liveness check fails the run.
    Stop,
    /// Exit with this status (a script that gives up).
    Exit(i32),
}

/// One failure the test hook asks for: process `rank` of the attempt whose restart count is
/// `restart` fails as its `step`th training step begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepFailure {
    /// The attempt's restart count (0: the first start).
    pub restart: u64,
    /// The process.
    pub rank: usize,
    /// The training step, counted from 1 in that process.
    pub step: usize,
    /// What it does.
    pub action: FailAction,
}

/// The failures a [`FAIL_AT`] value asks for.
///
/// # Errors
/// What is wrong with the value, in words.
pub fn parse_fail_at(value: &str) -> Result<Vec<StepFailure>, String> {
    let number = |part: &str, what: &str| {
        part.trim()
            .parse::<u64>()
            .map_err(|_| format!("{what} {part:?} is not a number"))
    };
    value
        .split(',')
        .filter(|f| !f.trim().is_empty())
        .map(|failure| {
            let parts: Vec<&str> = failure.split(':').collect();
            let [restart, rank, step, action @ ..] = parts.as_slice() else {
                return Err(format!(
                    "{failure:?} is not RESTART:RANK:STEP[:kill|:stop|:exit=N]"
                ));
            };
            let action = match action {
                [] | ["kill"] => FailAction::Kill,
                ["stop"] => FailAction::Stop,
                [exit] if exit.starts_with("exit=") => FailAction::Exit(
                    exit["exit=".len()..]
                        .parse()
                        .map_err(|_| format!("{exit:?} is not exit=N"))?,
                ),
                other => return Err(format!("{other:?} is not `kill`, `stop` or `exit=N`")),
            };
            Ok(StepFailure {
                restart: number(restart, "the restart count")?,
                rank: number(rank, "the rank")? as usize,
                step: number(step, "the step")? as usize,
                action,
            })
        })
        .collect()
}

// The training steps this process has begun, and the failures armed for it.
static STEPS: AtomicUsize = AtomicUsize::new(0);
static ARMED: std::sync::Mutex<Vec<(usize, FailAction)>> = std::sync::Mutex::new(Vec::new());

// Arms this process's failures from the test hook, and starts counting its steps.
fn arm_failures() -> Result<(), AccelerateError> {
    let armed = match std::env::var(FAIL_AT) {
        Err(_) => Vec::new(),
        Ok(value) => {
            let failures = parse_fail_at(&value).map_err(|why| {
                AccelerateError::Distributed(DistributedError::InvalidVariable {
                    name: FAIL_AT,
                    value: value.clone(),
                    expected: why,
                })
            })?;
            let restart = burn_accelerate::distributed::restart_count()?;
            let rank = ProcessState::from_env()?.process_index();
            failures
                .into_iter()
                .filter(|f| f.restart == restart && f.rank == rank)
                .map(|f| (f.step, f.action))
                .collect()
        }
    };
    STEPS.store(0, Ordering::SeqCst);
    *ARMED.lock().unwrap_or_else(|e| e.into_inner()) = armed;
    Ok(())
}

fn fail_if_asked() {
    let step = STEPS.fetch_add(1, Ordering::SeqCst) + 1;
    let armed = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_, action)) = armed.iter().find(|(at, _)| *at == step) else {
        return;
    };
    eprintln!("burn-accelerate test hook ({FAIL_AT}): failing at step {step}: {action:?}");
    match action {
        FailAction::Exit(code) => std::process::exit(*code),
        FailAction::Stop => {
            #[cfg(unix)]
            {
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
            }
        }
        FailAction::Kill => {
            #[cfg(unix)]
            {
                let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
            }
            std::process::abort()
        }
    }
}
