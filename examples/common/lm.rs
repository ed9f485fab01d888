//! The model, data and run of `examples/train_lm.rs`, shared with the tests (which include
//! this file with `#[path]`; the library exports no example model): a GPT-style causal
//! language model over bytes, built from Burn's own `nn` and trained through Burn's
//! `SupervisedTraining` and `with_accelerate`.
//!
//! - **Tokens:** bytes (a vocabulary of [`VOCAB`]), so any text trains, with no tokenizer
//!   to download.
//! - **Data:** the text cut into windows of `seq_len + 1` bytes, one every `seq_len` bytes
//!   ([`split_windows`]); the last tenth are the validation windows.
//! - **Model** ([`CausalLm`]): token and learned position embeddings, added; Burn's
//!   `TransformerEncoder` with `norm_first` (pre-norm, GELU) under a causal mask; a final
//!   layer norm; the vocabulary projection.
//! - **Optimizer:** Adam (ε 1e-8, as torch's) with a linear warm-up ([`WarmupLr`]).
//!
//! `benches/accelerate_lm.py` is its twin in PyTorch and Accelerate: the same windows,
//! model, initialisation distributions, optimizer and schedule (not the same random draws).
//!
//! ```text
//! let config = LmConfig::new().with_precision(Precision::Bf16).with_steps(Some(20));
//! let outcome = lm::run::<Accelerated<Autodiff<Flex>>>(&config, &text, &Default::default())?;
//! println!("{}", outcome.summary_line());
//! ```

// Each example and test that includes this file uses a part of it.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use burn::config::Config;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::LrScheduler;
use burn::module::Module;
use burn::nn::attention::generate_autoregressive_mask;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
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

use burn_accelerate::autocast::{LowerOpTally, SmallOps, thread_tally};
use burn_accelerate::data::{BatchSplit, DataLoaderConfig, ShardLoaderBuilder};
use burn_accelerate::distributed::{ProcessState, ReduceOp};
use burn_accelerate::train::{AccelerateStrategy, TrainingStats, WithAccelerate};
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{AccelerateConfig, AccelerateError, Precision};

/// Tokens are bytes.
pub const VOCAB: usize = 256;

/// Optimizer steps whose times are left out of the median: the first steps allocate the
/// buffers later steps reuse, and fault in the model's and the optimizer's pages.
pub const WARM_UP_STEPS: usize = 3;

/// The model and the run (defaults: the model of Burn's text-generation example, 10.8M
/// parameters, at sequence 256).
#[derive(Config, Debug)]
pub struct LmConfig {
    /// Width of the embeddings and of the residual stream.
    #[config(default = 384)]
    pub d_model: usize,
    /// Transformer layers.
    #[config(default = 6)]
    pub layers: usize,
    /// Attention heads (dividing `d_model`).
    #[config(default = 12)]
    pub heads: usize,
    /// Width of the feed-forward layers.
    #[config(default = 1536)]
    pub d_ff: usize,
    /// Tokens per sequence.
    #[config(default = 256)]
    pub seq_len: usize,
    /// Dropout probability (attention scores, residual branches, feed-forward).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Sequences per batch, per process.
    #[config(default = 8)]
    pub batch_size: usize,
    /// Adam's learning rate after the warm-up.
    #[config(default = 1e-3)]
    pub lr: f64,
    /// Optimizer steps of linear warm-up.
    #[config(default = 20)]
    pub warmup: usize,
    /// Seeds the initialisation, the dropout masks and the data order.
    #[config(default = 42)]
    pub seed: u64,
    /// Optimizer steps per epoch: the training windows are cut to as many as they take
    /// (`None`: every training window, each epoch).
    pub steps: Option<usize>,
    /// Epochs to train.
    #[config(default = 1)]
    pub epochs: usize,
    /// Autocast precision.
    #[config(default = "Precision::F32")]
    pub precision: Precision,
    /// Batches per optimizer step.
    #[config(default = 1)]
    pub grad_accum: usize,
    /// How the training state is sharded across processes.
    #[config(default = "ZeroStage::None")]
    pub zero_stage: ZeroStage,
    /// Run in f32 when the device cannot run `precision`, instead of failing.
    #[config(default = true)]
    pub allow_fallback: bool,
    /// Print a progress line to stderr every this many optimizer steps (0: none).
    #[config(default = 10)]
    pub progress_every: usize,
    /// The training's small-op rule ([`AccelerateConfig::small_ops`]); `None`: the one in
    /// force.
    #[config(default = "None")]
    pub small_ops: Option<SmallOps>,
}

impl LmConfig {
    /// Refuses settings the model or the run cannot take, naming the setting.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for a zero size, heads that do not divide
    /// `d_model`, a dropout outside `[0, 1)`, or a non-positive learning rate.
    pub fn validate(&self) -> Result<(), AccelerateError> {
        let invalid =
            |field, value: String, fix| Err(AccelerateError::InvalidConfig { field, value, fix });
        for (field, value) in [
            ("d_model", self.d_model),
            ("layers", self.layers),
            ("heads", self.heads),
            ("d_ff", self.d_ff),
            ("seq_len", self.seq_len),
            ("batch_size", self.batch_size),
            ("epochs", self.epochs),
            ("grad_accum", self.grad_accum),
        ] {
            if value == 0 {
                return invalid(field, "0".into(), "give at least 1");
            }
        }
        if !self.d_model.is_multiple_of(self.heads) {
            return invalid(
                "heads",
                self.heads.to_string(),
                "give a number of heads that divides d_model",
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return invalid(
                "dropout",
                self.dropout.to_string(),
                "give a probability in [0, 1)",
            );
        }
        if self.lr.is_nan() || self.lr <= 0.0 {
            return invalid("lr", self.lr.to_string(), "give a positive learning rate");
        }
        if self.steps == Some(0) {
            return invalid(
                "steps",
                "0".into(),
                "give at least 1, or none for whole epochs",
            );
        }
        Ok(())
    }
}

/// `seq_len + 1` bytes of the text: the inputs are the first `seq_len`, the targets the last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window(pub Vec<u8>);

/// The text's windows, training and validation: window `i` is
/// `text[i * seq_len .. i * seq_len + seq_len + 1]`, and the last `max(1, n / 10)` of the `n`
/// windows are the validation ones.
///
/// # Errors
/// [`AccelerateError::InvalidConfig`] when the text holds fewer than two windows.
pub fn split_windows(
    text: &[u8],
    seq_len: usize,
) -> Result<(Vec<Window>, Vec<Window>), AccelerateError> {
    let n = text.len().saturating_sub(1) / seq_len.max(1);
    if n < 2 {
        return Err(AccelerateError::InvalidConfig {
            field: "seq_len",
            value: format!("{seq_len} for a text of {} bytes", text.len()),
            fix: "give a text of at least 2 × seq_len + 1 bytes, or a shorter seq_len",
        });
    }
    let mut windows: Vec<Window> = (0..n)
        .map(|i| Window(text[i * seq_len..i * seq_len + seq_len + 1].to_vec()))
        .collect();
    let valid = windows.split_off(n - (n / 10).max(1));
    Ok((windows, valid))
}

/// A batch of windows as token tensors.
#[derive(Debug, Clone)]
pub struct LmBatch<B: Backend> {
    /// `[batch, seq_len]` input tokens.
    pub inputs: Tensor<B, 2, Int>,
    /// `[batch, seq_len]` next tokens.
    pub targets: Tensor<B, 2, Int>,
}

/// Turns [`Window`]s into an [`LmBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct LmBatcher;

impl<B: Backend> Batcher<B, Window, LmBatch<B>> for LmBatcher {
    fn batch(&self, items: Vec<Window>, device: &B::Device) -> LmBatch<B> {
        let n = items.len();
        let seq = items.first().map_or(0, |w| w.0.len() - 1);
        let tokens = |range: fn(&[u8]) -> &[u8]| -> Vec<i64> {
            items
                .iter()
                .flat_map(|w| range(&w.0).iter().map(|&b| i64::from(b)))
                .collect()
        };
        LmBatch {
            inputs: Tensor::from_data(
                TensorData::new(tokens(|w| &w[..w.len() - 1]), [n, seq]),
                device,
            ),
            targets: Tensor::from_data(TensorData::new(tokens(|w| &w[1..]), [n, seq]), device),
        }
    }
}

/// The language model.
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    tokens: Embedding<B>,
    positions: Embedding<B>,
    transformer: TransformerEncoder<B>,
    norm: LayerNorm<B>,
    output: Linear<B>,
}

impl<B: Backend> CausalLm<B> {
    /// A new model on `device` (seed the backend first for a reproducible one).
    pub fn new(config: &LmConfig, device: &B::Device) -> Self {
        Self {
            tokens: EmbeddingConfig::new(VOCAB, config.d_model).init(device),
            positions: EmbeddingConfig::new(config.seq_len, config.d_model).init(device),
            transformer: TransformerEncoderConfig::new(
                config.d_model,
                config.d_ff,
                config.heads,
                config.layers,
            )
            .with_dropout(config.dropout)
            .with_norm_first(true)
            .init(device),
            norm: LayerNormConfig::new(config.d_model).init(device),
            output: LinearConfig::new(config.d_model, VOCAB).init(device),
        }
    }

    /// Logits of the next token at each position, `[batch, seq, VOCAB]`.
    pub fn forward(&self, inputs: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = inputs.dims();
        let device = inputs.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        // `[1, seq, d]` broadcast over the batch.
        let x = self.tokens.forward(inputs) + self.positions.forward(positions);
        let causal = generate_autoregressive_mask::<B>(batch, seq, &device);
        let x = self
            .transformer
            .forward(TransformerEncoderInput::new(x).mask_attn(causal));
        self.output.forward(self.norm.forward(x))
    }

    /// The mean cross-entropy over every token of the batch, with the logits and targets
    /// flattened to `[batch × seq, …]` for Burn's metrics.
    pub fn loss(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        let [n, seq] = batch.inputs.dims();
        let logits = self.forward(batch.inputs).reshape([n * seq, VOCAB]);
        let targets = batch.targets.reshape([n * seq]);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), targets.clone());
        ClassificationOutput::new(loss, logits, targets)
    }
}

impl<B: AutodiffBackend> TrainStep for CausalLm<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.loss(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for CausalLm<B> {
    type Input = LmBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: LmBatch<B>) -> ClassificationOutput<B> {
        self.loss(batch)
    }
}

/// A linear warm-up to `peak` over `warmup` optimizer steps, constant after: step `s`
/// (from 0) runs at `peak × min(1, (s + 1) / warmup)`, as torch's
/// `LambdaLR(lambda s: min(1, (s + 1) / warmup))`.
///
/// (`tests/train_lm.rs` checks the rates.)
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupLr {
    peak: f64,
    warmup: usize,
    steps: usize,
}

impl WarmupLr {
    /// `peak` after `warmup` steps (0 or 1: `peak` from the first step).
    pub fn new(peak: f64, warmup: usize) -> Self {
        Self {
            peak,
            warmup: warmup.max(1),
            steps: 0,
        }
    }
}

impl LrScheduler for WarmupLr {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> f64 {
        self.steps += 1;
        self.peak * (self.steps as f64 / self.warmup as f64).min(1.0)
    }

    fn to_record<B: Backend>(&self) -> usize {
        self.steps
    }

    fn load_record<B: Backend>(self, steps: usize) -> Self {
        Self { steps, ..self }
    }
}

// What the renderer saw of the training items: when each ended and its loss.
#[derive(Debug, Default)]
struct Trace {
    // (epoch, end of the item, its loss)
    items: Vec<(usize, Instant, f64)>,
    loss: Option<f64>,
}

/// Burn's renderer for this run: it keeps each training item's end time and loss (the step
/// times and the final training loss come from them) and prints a progress line every
/// `every` optimizer steps to stderr, as Burn's own renderers show progress.
#[derive(Debug, Clone)]
struct StepClock {
    trace: Arc<Mutex<Trace>>,
    start: Instant,
    grad_accum: usize,
    total_steps: Option<usize>,
    every: usize,
}

impl StepClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Trace> {
        self.trace.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MetricsRendererTraining for StepClock {
    fn update_train(&mut self, state: MetricState) {
        // The only numeric training metric registered is the loss.
        if let MetricState::Numeric(_, value) = state {
            self.lock().loss = Some(value.current());
        }
    }

    fn update_valid(&mut self, _state: MetricState) {}

    fn render_train(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        let now = Instant::now();
        let (every, accum, total) = (self.every, self.grad_accum, self.total_steps);
        let mut trace = self.lock();
        let loss = trace.loss.take().unwrap_or(f64::NAN);
        trace
            .items
            .push((item.global_progress.items_processed, now, loss));
        let items = trace.items.len();
        if every > 0 && items.is_multiple_of(every * accum) {
            let step = items / accum;
            // From the end of the previous step (the start, for the first).
            let before = match items.checked_sub(accum + 1) {
                Some(i) => trace.items[i].1,
                None => self.start,
            };
            let ms = now.duration_since(before).as_secs_f64() * 1e3;
            let of = total.map_or(String::new(), |t| format!("/{t}"));
            eprintln!("step {step}{of} loss={loss:.4} ms={ms:.1}");
        }
    }

    fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRendererEvaluation for StepClock {
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl MetricsRenderer for StepClock {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// The optimizer steps' wall times, in seconds, from the items' end times: a step ends with
/// its window's last item, and lasts from the previous step's end. The first
/// [`WARM_UP_STEPS`] steps and each epoch's first step (after the previous epoch's
/// validation) are left out.
pub fn step_times(items: &[(usize, Instant, f64)], grad_accum: usize) -> Vec<f64> {
    let ends: Vec<(usize, Instant)> = items
        .chunks(grad_accum)
        .filter(|window| window.len() == grad_accum)
        .map(|window| {
            let (epoch, end, _) = window[grad_accum - 1];
            (epoch, end)
        })
        .collect();
    ends.windows(2)
        .enumerate()
        .filter(|&(i, pair)| i + 1 >= WARM_UP_STEPS && pair[0].0 == pair[1].0)
        .map(|(_, pair)| pair[1].1.duration_since(pair[0].1).as_secs_f64())
        .collect()
}

/// The median of `values` (NaN for none).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if !n.is_multiple_of(2) => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// What a run of [`run`] ended with.
#[derive(Debug, Clone, PartialEq)]
pub struct LmOutcome {
    /// The model's parameters.
    pub parameters: usize,
    /// Processes that trained.
    pub processes: usize,
    /// Optimizer steps taken (over all epochs).
    pub steps: usize,
    /// The loss of this process's first training batch.
    pub initial_loss: f64,
    /// The mean training loss of the last `min(10, n)` batches, averaged over the processes.
    pub train_loss: f64,
    /// The mean cross-entropy over every validation token after training, without dropout,
    /// in the training's precision (under its autocast, as Accelerate's prepared model
    /// evaluates): every process evaluates its own batches of the windows and the sums are
    /// combined, so every process has the same value.
    pub valid_loss: f64,
    /// What the final validation's lower-class ops ran in (half type, or f32 and why).
    pub final_valid_ops: LowerOpTally,
    /// The median optimizer step, in milliseconds (see [`WARM_UP_STEPS`]).
    pub step_ms: f64,
    /// Tokens trained per second over the timed steps, all processes together.
    pub tokens_per_s: f64,
    /// The largest peak resident memory of the processes, in MiB (0 where it cannot be read).
    pub peak_rss_mib: f64,
    /// What the strategy reported (precision, loss scale, steps, lower-class ops).
    pub stats: TrainingStats,
}

impl LmOutcome {
    /// The example's last line, with the keys `benches/accelerate_lm.py` prints too:
    /// `final steps=… step_ms=… tokens_per_s=… train_loss=… valid_loss=… peak_rss_mib=…
    /// precision=… processes=…`, then what autocast did with the lower-class ops.
    pub fn summary_line(&self) -> String {
        format!(
            "final steps={} step_ms={:.1} tokens_per_s={:.1} train_loss={:.6} valid_loss={:.6} \
             peak_rss_mib={:.0} precision={} processes={} skipped_steps={} {} {} \
             final_valid_half_ops={}/{}",
            self.steps,
            self.step_ms,
            self.tokens_per_s,
            self.train_loss,
            self.valid_loss,
            self.peak_rss_mib,
            self.stats.precision.short_name(),
            self.processes,
            self.stats.skipped_steps(),
            self.stats.lower_ops.summary(),
            self.stats.validation_summary(),
            self.final_valid_ops.half_ops,
            self.final_valid_ops.ops(),
        )
    }
}

// This process's peak resident memory, as the other examples that measure memory read it.
#[path = "memory.rs"]
mod memory;

// The cross-entropy summed over every token of `windows`, in batches of `batch_size`, and
// the tokens.
fn loss_sum<B: Backend>(
    model: &CausalLm<B>,
    windows: &[Window],
    batch_size: usize,
    device: &B::Device,
) -> (f64, usize) {
    let (mut sum, mut tokens) = (0.0, 0usize);
    for chunk in windows.chunks(batch_size) {
        let batch: LmBatch<B> = LmBatcher.batch(chunk.to_vec(), device);
        let n = batch.targets.shape().num_elements();
        let loss: f64 = model.loss(batch).loss.into_scalar().elem();
        sum += loss * n as f64;
        tokens += n;
    }
    (sum, tokens)
}

/// Trains a [`CausalLm`] on `text` through `SupervisedTraining` + `with_accelerate` on
/// `device`; `B` should be `Accelerated<Autodiff<_>>` for a mixed precision.
///
/// Under `burn-accelerate launch` (or torchrun, mpirun, srun) each process trains on its
/// Accelerate shard of the windows and the gradients are averaged: `N` processes at batch
/// size `b` take the steps of one process at `N × b`. Burn's validation each epoch reads one
/// batch (for its metrics); the final validation loss is measured after training on every
/// validation window, in the training's precision, each process its own batches (see
/// [`LmOutcome::valid_loss`]).
///
/// # Errors
/// A config the model cannot take ([`LmConfig::validate`]), a text too short for two
/// windows or for `steps`, what [`AccelerateStrategy::new`] returns, a bad launch
/// environment or a failed collective.
pub fn run<B: AutodiffBackend>(
    config: &LmConfig,
    text: &[u8],
    device: &B::Device,
) -> Result<LmOutcome, AccelerateError> {
    config.validate()?;
    let process = ProcessState::from_env()?;
    let processes = process.num_processes();
    let (mut train_windows, valid_windows) = split_windows(text, config.seq_len)?;
    if let Some(steps) = config.steps {
        let needed = steps * config.batch_size * config.grad_accum * processes;
        if needed > train_windows.len() {
            return Err(AccelerateError::InvalidConfig {
                field: "steps",
                value: format!(
                    "{steps} ({needed} windows of {} bytes; the text has {})",
                    config.seq_len + 1,
                    train_windows.len()
                ),
                fix: "give fewer steps, a smaller batch_size or seq_len, or a longer text",
            });
        }
        train_windows.truncate(needed);
    }

    let strategy = AccelerateStrategy::new(
        AccelerateConfig::new()
            .with_mixed_precision(config.precision)
            .with_gradient_accumulation_steps(config.grad_accum)
            .with_allow_fallback(config.allow_fallback)
            .with_zero_stage(config.zero_stage)
            .with_small_ops(config.small_ops),
        device,
    )?;
    let report = strategy.report();
    let autocast = *strategy.autocast();
    let train = ShardLoaderBuilder::<B, Window, LmBatch<B>>::new(
        DataLoaderConfig::new(config.batch_size)
            .with_shuffle(true)
            .with_data_seed(Some(config.seed)),
        InMemDataset::new(train_windows),
        LmBatcher,
    )
    .build_for(&process, device.clone())?;
    let valid: Arc<dyn DataLoader<B::InnerBackend, LmBatch<B::InnerBackend>>> =
        DataLoaderBuilder::<B::InnerBackend, _, _>::new(LmBatcher)
            .batch_size(config.batch_size)
            .build(InMemDataset::new(
                valid_windows
                    .iter()
                    .take(config.batch_size)
                    .cloned()
                    .collect::<Vec<_>>(),
            ));

    B::seed(device, config.seed);
    let model = CausalLm::<B>::new(config, device);
    let parameters = model.num_params();
    let optimizer = AdamConfig::new().with_epsilon(1e-8).init();
    let learner = Learner::new(model, optimizer, WarmupLr::new(config.lr, config.warmup));
    let clock = StepClock {
        trace: Arc::default(),
        start: Instant::now(),
        grad_accum: config.grad_accum,
        total_steps: config.steps.map(|s| s * config.epochs),
        every: if process.is_main_process() {
            config.progress_every
        } else {
            0
        },
    };
    let trace = clock.trace.clone();
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-train-lm-{}-{}",
        std::process::id(),
        config.precision.accelerate_name()
    ));
    let result = SupervisedTraining::new(&dir, Arc::new(train), valid)
        .num_epochs(config.epochs)
        .metric_train_numeric(LossMetric::new())
        .renderer(clock)
        .with_application_logger(None)
        .with_accelerate(strategy.with_artifact_dir(&dir))
        .launch(learner);
    let _ = std::fs::remove_dir_all(&dir);

    let items = std::mem::take(&mut trace.lock().unwrap_or_else(PoisonError::into_inner).items);
    let times = step_times(&items, config.grad_accum);
    let timed: f64 = times.iter().sum();
    let tokens_per_step = config.batch_size * config.grad_accum * processes * config.seq_len;
    let tail = &items[items.len().saturating_sub(10)..];
    let mut train_loss = [tail.iter().map(|i| i.2).sum::<f64>() / tail.len().max(1) as f64];
    let mut peak = memory::peak_memory_mib();
    // This process's whole batches of the validation windows, evaluated as the fit validates.
    let part = BatchSplit::of(
        valid_windows.len(),
        config.batch_size,
        processes,
        process.process_index(),
    )
    .expect("a batch size of at least 1 (validated) and a process of the run");
    let tally = thread_tally();
    let (sum, tokens) = {
        let _autocast = autocast.enter();
        loss_sum(
            &result.model,
            &valid_windows[part.start..part.end],
            config.batch_size,
            device,
        )
    };
    let final_valid_ops = thread_tally().since(&tally);
    let mut valid = [sum, tokens as f64];
    if processes > 1 {
        let group = process.group()?;
        group.all_reduce(&mut train_loss, ReduceOp::Mean)?;
        group.all_reduce(&mut valid, ReduceOp::Sum)?;
        peak = group.all_gather(&[peak])?.into_iter().fold(0.0, f64::max);
    }
    let valid_loss = valid[0] / valid[1].max(1.0);
    let stats = report.stats();
    Ok(LmOutcome {
        parameters,
        processes,
        steps: stats.optimizer_steps(),
        initial_loss: items.first().map_or(f64::NAN, |i| i.2),
        train_loss: train_loss[0],
        valid_loss,
        final_valid_ops,
        step_ms: median(&times) * 1e3,
        tokens_per_s: if timed > 0.0 {
            (times.len() * tokens_per_step) as f64 / timed
        } else {
            f64::NAN
        },
        peak_rss_mib: peak,
        stats,
    })
}
