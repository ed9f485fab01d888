//! Burn's own settings under `with_accelerate`: a loader of Burn's `DataLoaderBuilder` under
//! `burn-accelerate launch` (sliced per process, with Burn's metric logs and summary on the
//! main process alone), and `SupervisedTraining::grads_accumulation(n)` (honoured with Burn's
//! meaning, or refused when Accelerate's setting is given too).
//!
//! The trainings in this binary run one at a time (a lock): they seed the backend's generator,
//! which is the process's (Burn's `Backend::seed`), and Burn draws a model's initial weights
//! during the fit.
#![cfg(feature = "flex")]

#[allow(dead_code)] // The helpers of the processes suite this file does not need.
#[path = "processes/harness.rs"]
mod harness;
#[path = "../examples/common/lm.rs"]
mod lm;
#[path = "../examples/common/mlp.rs"]
mod mlp;
mod param_bits;

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn::train::{Learner, SupervisedTraining};
use burn_accelerate::AccelerateConfig;
use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
use harness::{launch, report, worker};
use mlp::{BlobBatcher, Mlp, MlpComponents, QuietRenderer, blobs};
use param_bits::param_bits;
use serde::{Deserialize, Serialize};

// Held for Burn's process-wide seed only (`Backend::seed`, see the module docs): every
// training here seeds it, a refused one included.
static ONE_TRAINING: Mutex<()> = Mutex::new(());

fn one_training() -> MutexGuard<'static, ()> {
    ONE_TRAINING.lock().unwrap_or_else(|e| e.into_inner())
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-burn-settings-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

// ---------------------------------------------------------------------------------------
// Burn's `grads_accumulation(n)`.

mod accumulation {
    use super::*;

    pub type B = Autodiff<Flex>;
    type Components = MlpComponents<B>;

    /// 128 items in batches of 16, no shuffle: 8 batches, 4 windows of 2 (no partial window,
    /// which Burn's loop would drop and the strategy completes).
    pub fn train(burn_accumulation: usize, accelerate: Option<AccelerateConfig>) -> Vec<u32> {
        let device = Default::default();
        let loader = || {
            DataLoaderBuilder::<B, _, _>::new(BlobBatcher)
                .batch_size(16)
                .build(InMemDataset::new(blobs(128, 1)))
        };
        let valid = DataLoaderBuilder::<Flex, _, _>::new(BlobBatcher)
            .batch_size(16)
            .build(InMemDataset::new(blobs(16, 2)));
        B::seed(&device, 3);
        let model = Mlp::<B>::new(16, &device);
        // A constant learning rate: Burn's loop steps its scheduler every batch, the strategy
        // every optimizer step.
        let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
        let dir = scratch(&format!("accumulation-{}", accelerate.is_some()));
        let mut builder = SupervisedTraining::new(&dir, loader(), valid)
            .num_epochs(1)
            .renderer(QuietRenderer)
            .with_application_logger(None)
            .grads_accumulation(burn_accumulation);
        if let Some(config) = accelerate {
            let config_window = config.gradient_accumulation_steps;
            let strategy = AccelerateStrategy::<Components>::new(config, &device).unwrap();
            let report = strategy.report();
            builder = builder.with_accelerate(strategy);
            let model = builder.launch(learner).model;
            let window = burn_accumulation.max(config_window);
            assert_eq!(report.stats().optimizer_steps(), 8 / window);
            let _ = std::fs::remove_dir_all(&dir);
            return param_bits(&model);
        }
        let model = builder.launch(learner).model;
        let _ = std::fs::remove_dir_all(&dir);
        param_bits(&model)
    }
}

#[test]
fn burns_grads_accumulation_sums_the_window_as_burns_own_loop() {
    let _one = one_training();
    let burn = accumulation::train(2, None);
    let accelerated = accumulation::train(2, Some(AccelerateConfig::new()));
    // The same sums of the same gradients, multiplied by nothing: bit for bit.
    assert_eq!(accelerated, burn);
    // And not what Accelerate's averaging window gives (half the summed gradients; Adam is
    // nearly scale-invariant, but not bit for bit).
    let averaged = accumulation::train(
        1,
        Some(AccelerateConfig::new().with_gradient_accumulation_steps(2)),
    );
    assert_ne!(averaged, burn);
}

#[test]
fn burns_and_accelerates_accumulation_together_are_refused_at_the_start_of_the_fit() {
    let _one = one_training();
    for (burn, ours) in [(2, 4), (3, 3)] {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            accumulation::train(
                burn,
                Some(AccelerateConfig::new().with_gradient_accumulation_steps(ours)),
            )
        }));
        let payload = outcome.expect_err("refused");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        for part in [
            "invalid grads_accumulation",
            &format!("{burn} in Burn's `SupervisedTraining::grads_accumulation`"),
            &format!("{ours} in `AccelerateConfig::gradient_accumulation_steps`"),
            "preferably `AccelerateConfig::gradient_accumulation_steps`",
            "Burn's sums the window's gradients",
            "Accelerate's averages them",
        ] {
            assert!(message.contains(part), "{part:?} not in {message:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Burn's `DataLoaderBuilder` loaders under the launcher: a small text-generation loop.

mod lm_loaders {
    use crate::lm::split_windows;
    use crate::lm::{CausalLm, LmBatch, LmBatcher, LmConfig, Window};
    use burn::data::dataloader::DataLoader;
    use burn::module::AutodiffModule;
    use burn::tensor::ElementConversion;
    use burn::train::metric::{LossMetric, MetricDefinition};
    use burn::train::renderer::{
        EvaluationName, EvaluationProgress, MetricState, MetricsRenderer,
        MetricsRendererEvaluation, MetricsRendererTraining, ProgressType, TrainingProgress,
    };
    use burn::train::{LearnerSummary, LearningComponentsMarker};
    use burn_accelerate::Accelerated;
    use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder, StreamLoaderBuilder};
    use burn_accelerate::distributed::ProcessState;

    use super::*;

    type Train = Accelerated<Autodiff<Flex>>;
    type Valid = Accelerated<Flex>;
    type Components = LearningComponentsMarker<
        Train,
        f64,
        CausalLm<Train>,
        burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, CausalLm<Train>, Train>,
    >;

    /// Training windows (of 17 bytes); a multiple of 2 × 8, so that every run ends on whole
    /// batches.
    pub const ITEMS: usize = 96;
    const SEED: u64 = 17;

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Run {
        /// Per process.
        pub batch_size: usize,
    }

    /// The training and validation losses of Burn's learner summary (`None` where it made
    /// none).
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Summary {
        pub train: Vec<f64>,
        pub valid: Vec<f64>,
    }

    /// What `prepare_loader` made of loaders on this process.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Prepared {
        /// Refusing a Burn loader of 1 item.
        pub refusal: String,
        /// Items of this process's part of a Burn loader of 9 items.
        pub part_items: usize,
        /// The first window of that part, as its first batch holds it.
        pub part_first: Vec<i64>,
        /// Items of this process's part, prepared again.
        pub again_items: usize,
        /// Items of a `ShardLoader` of the same 9 items, and after `prepare_loader`.
        pub shard_items: (usize, usize),
        /// Batches of a `StreamLoader` of the same 9 items, and after `prepare_loader`.
        pub stream_batches: (usize, usize),
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct RunReport {
        pub processes: usize,
        pub batches: usize,
        pub optimizer_steps: usize,
        pub parameters: Vec<u32>,
        /// The mean loss over the validation windows before and after training (f32).
        pub initial_loss: f64,
        pub valid_loss: f64,
        /// `None`: Burn's `train` ended without a summary.
        pub summary: Option<Summary>,
        /// Whether Burn's renderer saw the training end.
        pub ended: bool,
        /// The crate's log lines (`burn-accelerate: ...`), as `LEVEL message`.
        pub logs: Vec<String>,
        pub prepared: Option<Prepared>,
    }

    fn config() -> LmConfig {
        LmConfig::new()
            .with_d_model(16)
            .with_layers(1)
            .with_heads(2)
            .with_d_ff(32)
            .with_seq_len(16)
            .with_dropout(0.0)
    }

    fn windows() -> (Vec<Window>, Vec<Window>) {
        // Text that does not change from one commit to the next.
        let text = include_bytes!("../LICENSE-APACHE");
        let (mut train, valid) = split_windows(text, config().seq_len).unwrap();
        train.truncate(ITEMS);
        (train, valid)
    }

    // The crate's log lines, kept for the report.
    static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

    struct Captured;

    impl log::Log for Captured {
        fn enabled(&self, _metadata: &log::Metadata) -> bool {
            true
        }

        fn log(&self, record: &log::Record) {
            let message = record.args().to_string();
            if message.starts_with("burn-accelerate:") {
                let line = format!("{} {message}", record.level());
                LOGS.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        }

        fn flush(&self) {}
    }

    /// Keeps what Burn's `train` gives the renderer at its end.
    #[derive(Clone, Default)]
    struct SummaryCatcher(Arc<Mutex<Option<Option<Summary>>>>);

    impl MetricsRendererTraining for SummaryCatcher {
        fn update_train(&mut self, _state: MetricState) {}
        fn update_valid(&mut self, _state: MetricState) {}
        fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
        fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}

        fn on_train_end(
            &mut self,
            summary: Option<LearnerSummary>,
        ) -> Result<(), Box<dyn std::error::Error>> {
            let losses = |metrics: &[burn::train::MetricSummary]| -> Vec<f64> {
                metrics
                    .iter()
                    .filter(|m| m.name == "Loss")
                    .flat_map(|m| m.entries.iter().map(|e| e.value))
                    .collect()
            };
            let summary = summary.map(|s| Summary {
                train: losses(&s.metrics.train),
                valid: losses(&s.metrics.valid),
            });
            *self.0.lock().unwrap() = Some(summary);
            Ok(())
        }
    }

    impl MetricsRendererEvaluation for SummaryCatcher {
        fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
        fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    }

    impl MetricsRenderer for SummaryCatcher {
        fn manual_close(&mut self) {}
        fn register_metric(&mut self, _definition: MetricDefinition) {}
    }

    fn mean_loss(model: &CausalLm<Valid>, windows: &[Window]) -> f64 {
        use burn::data::dataloader::batcher::Batcher;
        let device = Default::default();
        let (mut sum, mut count) = (0.0, 0);
        for chunk in windows.chunks(16) {
            let batch: LmBatch<Valid> = LmBatcher.batch(chunk.to_vec(), &device);
            let loss: f64 = model.loss(batch).loss.into_scalar().elem();
            sum += loss * chunk.len() as f64;
            count += chunk.len();
        }
        sum / count as f64
    }

    fn first_window(loader: &Arc<dyn DataLoader<Train, LmBatch<Train>>>) -> Vec<i64> {
        let batch = loader.iter().next().expect("a batch");
        let [_, seq] = batch.inputs.dims();
        let tokens = batch.inputs.into_data().convert::<i64>();
        tokens.to_vec::<i64>().unwrap()[..seq].to_vec()
    }

    // What `prepare_loader` does with loaders of 1 and 9 items, Burn's and the crate's.
    fn prepare(state: &ProcessState, windows: &[Window]) -> Prepared {
        let device = Default::default();
        let strategy =
            AccelerateStrategy::<Components>::new(AccelerateConfig::new(), &device).unwrap();
        let burn = |items: usize| {
            DataLoaderBuilder::<Train, _, _>::new(LmBatcher)
                .batch_size(2)
                .build(InMemDataset::new(windows[..items].to_vec()))
        };
        let refusal = strategy
            .prepare_loader(&burn(1))
            .err()
            .expect("1 item for 2 processes")
            .to_string();
        let part = strategy.prepare_loader(&burn(9)).unwrap();
        let again = strategy.prepare_loader(&part).unwrap();
        let shard = ShardLoaderBuilder::new(
            DataLoaderConfig::new(2),
            InMemDataset::new(windows[..9].to_vec()),
            LmBatcher,
        )
        .build_for(state, device)
        .unwrap();
        let shard_items = shard.num_items();
        let prepared = strategy.prepare_loader(&(Arc::new(shard) as _)).unwrap();
        let nine = windows[..9].to_vec();
        let stream = StreamLoaderBuilder::new(
            DataLoaderConfig::new(2),
            move |_epoch: u64| nine.clone().into_iter(),
            LmBatcher,
        )
        .build_for(state, device)
        .unwrap();
        let stream_batches = stream.iter().count();
        let stream = strategy.prepare_loader(&(Arc::new(stream) as _)).unwrap();
        Prepared {
            refusal,
            part_items: part.num_items(),
            part_first: first_window(&part),
            again_items: again.num_items(),
            shard_items: (shard_items, prepared.num_items()),
            stream_batches: (stream_batches, stream.iter().count()),
        }
    }

    pub fn train(args: &Run) -> RunReport {
        let state = ProcessState::from_env().unwrap();
        let launched = harness::worker::<Run>().is_some();
        if launched {
            let _ = log::set_logger(&Captured);
            log::set_max_level(log::LevelFilter::Info);
        }
        let device = Default::default();
        let (train, valid) = windows();
        let prepared = (state.num_processes() > 1).then(|| prepare(&state, &train));

        // Burn's own text-generation loop: its loaders, shuffled with a seed.
        let loader = DataLoaderBuilder::<Train, _, _>::new(LmBatcher)
            .batch_size(args.batch_size)
            .shuffle(SEED)
            .build(InMemDataset::new(train));
        let valid_loader = DataLoaderBuilder::<Valid, _, _>::new(LmBatcher)
            .batch_size(args.batch_size)
            .build(InMemDataset::new(valid[..8].to_vec()));
        // The processes share the artifact directory, as a script run unchanged does.
        let dir = if launched {
            harness::worker_dir().join("artifacts")
        } else {
            scratch(&format!("lm-{}", args.batch_size))
        };
        // Where the main process writes Burn's metric logs, of every process's validation.
        let strategy = AccelerateStrategy::<Components>::new(AccelerateConfig::new(), &device)
            .unwrap()
            .with_artifact_dir(&dir);
        let stats = strategy.report();
        Train::seed(&device, 7);
        let model = CausalLm::<Train>::new(&config(), &device);
        let initial_loss = mean_loss(&model.valid(), &valid);
        let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
        let catcher = SummaryCatcher::default();
        let result = SupervisedTraining::new(&dir, loader, valid_loader)
            .num_epochs(1)
            .metric_train_numeric(LossMetric::new())
            .metric_valid_numeric(LossMetric::new())
            .renderer(catcher.clone())
            .with_application_logger(None)
            .summary()
            .with_accelerate(strategy)
            .launch(learner);
        if !launched {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let stats = stats.stats();
        let ended = catcher.0.lock().unwrap().take();
        RunReport {
            processes: state.num_processes(),
            batches: stats.epochs.iter().map(|e| e.batches).sum(),
            optimizer_steps: stats.optimizer_steps(),
            parameters: param_bits(&result.model),
            initial_loss,
            valid_loss: mean_loss(&result.model, &valid),
            ended: ended.is_some(),
            summary: ended.flatten(),
            logs: std::mem::take(&mut *LOGS.lock().unwrap()),
            prepared,
        }
    }
}

#[test]
fn burns_own_loaders_are_sliced_per_process_and_only_the_main_process_logs() {
    const TEST: &str = "burns_own_loaders_are_sliced_per_process_and_only_the_main_process_logs";
    if let Some(args) = worker::<lm_loaders::Run>() {
        return report(&lm_loaders::train(&args));
    }
    let run = |batch_size| lm_loaders::Run { batch_size };
    let (one, double) = {
        let _one = one_training();
        (lm_loaders::train(&run(4)), lm_loaders::train(&run(8)))
    };
    assert_eq!(one.optimizer_steps, lm_loaders::ITEMS / 4);
    assert_eq!(double.optimizer_steps, lm_loaders::ITEMS / 8);
    let launched = launch(TEST, 2, &run(4), &[]);
    launched.assert_success();
    assert!(
        !launched.output().contains("panicked"),
        "{}",
        launched.output()
    );
    let pair: Vec<lm_loaders::RunReport> = launched.reports(2);

    // Each process read its half: half the steps of one process at the same batch size.
    for (rank, r) in pair.iter().enumerate() {
        assert_eq!(r.processes, 2);
        assert_eq!(r.optimizer_steps, one.optimizer_steps / 2, "rank {rank}");
        assert_eq!(r.batches, r.optimizer_steps, "rank {rank}");
        let part = format!(
            "INFO burn-accelerate: the training loader holds the whole data set (96 items): \
             process {rank} of 2 trains on its items {}..{}",
            48 * rank,
            48 * (rank + 1)
        );
        assert!(
            r.logs.iter().any(|l| l.starts_with(&part)),
            "{part:?} not in {:#?}",
            r.logs
        );
        // And validates its own batch of the validation loader's two.
        let valid_part = format!(
            "INFO burn-accelerate: process {rank} of 2 validates items {}..{} of 8 (1 batches \
             of 4)",
            4 * rank,
            4 * (rank + 1)
        );
        assert!(
            r.logs.iter().any(|l| l.starts_with(&valid_part)),
            "{valid_part:?} not in {:#?}",
            r.logs
        );
    }
    assert_eq!(pair[0].parameters, pair[1].parameters);
    // The loss one process reaches with the two halves' batches together (batch 8, 12 steps),
    // up to which items share a step: each step of the pair has 4 from each half of the
    // text, one process's has 8 from anywhere. Measured: a relative difference of about
    // 0.5%; the loss falls by about a third.
    let relative = (pair[0].valid_loss - double.valid_loss).abs() / double.valid_loss;
    assert!(
        relative < 0.03,
        "2 × 4: {} vs 1 × 8: {} ({relative:e})",
        pair[0].valid_loss,
        double.valid_loss
    );
    assert!(
        pair[0].valid_loss < 0.85 * pair[0].initial_loss,
        "{} from {}",
        pair[0].valid_loss,
        pair[0].initial_loss
    );

    // Burn's summary: the main process's, from the logs it alone wrote (its last validation
    // epoch included, combined from both processes' batches); none elsewhere.
    let main = pair[0]
        .summary
        .as_ref()
        .expect("the main process's summary");
    assert_eq!(main.train.len(), 1, "{main:?}");
    assert_eq!(main.valid.len(), 1, "{main:?}");
    assert!(
        main.train.iter().chain(&main.valid).all(|v| v.is_finite()),
        "{main:?}"
    );
    assert!(pair[1].ended && pair[1].summary.is_none(), "{:?}", pair[1]);
    for needle in [
        "INFO burn-accelerate: process 1 of 2: no learner summary here",
        "INFO burn-accelerate: process 1 of 2: Burn's metric logs are kept in memory here, not \
         written to the artifact directory",
    ] {
        assert!(
            pair[1].logs.iter().any(|l| l.starts_with(needle)),
            "{needle:?} not in {:#?}",
            pair[1].logs
        );
        assert!(!pair[0].logs.iter().any(|l| l.starts_with(needle)));
    }

    // `prepare_loader`, on each process: Burn's loader of 9 items gives each process 4 (in
    // order; the last item is dropped, with a warning), is not sliced again, and a loader of
    // 1 item is refused, naming the crate's loader; the crate's shard and stream loaders are
    // only moved.
    for (rank, r) in pair.iter().enumerate() {
        let prepared = r.prepared.as_ref().unwrap();
        assert!(
            prepared
                .refusal
                .contains("a loader of 1 items for 2 processes")
                && prepared.refusal.contains("ShardLoaderBuilder::build_for"),
            "{}",
            prepared.refusal
        );
        assert_eq!(prepared.part_items, 4);
        assert_eq!(prepared.again_items, 4);
        let (windows, _) = {
            let text = include_bytes!("../LICENSE-APACHE");
            crate::lm::split_windows(text, 16).unwrap()
        };
        let first: Vec<i64> = windows[4 * rank].0[..16]
            .iter()
            .map(|&b| i64::from(b))
            .collect();
        assert_eq!(prepared.part_first, first, "rank {rank}");
        assert_eq!(prepared.shard_items.0, prepared.shard_items.1);
        assert_eq!(prepared.stream_batches.0, prepared.stream_batches.1);
        assert!(
            prepared.stream_batches.0 >= 2,
            "{:?}",
            prepared.stream_batches
        );
        assert!(
            r.logs.iter().any(|l| l.starts_with(
                "WARN burn-accelerate: the last 1 of the training loader's 9 items are not read"
            )),
            "{:#?}",
            r.logs
        );
    }
    // The artifact directory's metric logs are the main process's alone: one line per batch
    // of its own training, and one per validation batch of both processes (each validated one
    // of the two), each one that parses (both processes wrote there before, over each
    // other).
    let logged = |split: &str, lines: usize| {
        let path = launched
            .dir()
            .join("artifacts")
            .join(split)
            .join("epoch-1/Loss.log");
        let text = std::fs::read_to_string(&path).unwrap();
        let values: Vec<f64> = text
            .lines()
            .map(|l| l.split(',').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(values.len(), lines, "{}:\n{text}", path.display());
    };
    logged("train", pair[0].batches);
    logged("valid", 2);
    harness::clean(launched.dir());
}
