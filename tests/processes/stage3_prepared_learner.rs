//! ZeRO stage 3 under `with_accelerate` with the model sharded before Burn's `Learner` is built
//! (issue 48): `AccelerateStrategy::prepare_model` releases a lazily built model (Burn's
//! `Config::init`) one parameter at a time, so that Burn's `launch`, whose `devices()` reads
//! every parameter before the strategy sees the learner, finds placeholders instead of
//! initialising the whole model on every process.
//!
//! What a process holds whole of the parameters outside its share of `zero::partition` (the test's
//! observed set: at stage 3 no process keeps a parameter whole, each keeps a slice of every one) is
//! observed at their source: every lazy parameter of the model is wrapped in one whose initializer
//! runs Burn's own (the same values, drawn in the same order) and keeps a weak reference to the
//! storage of the value it made. At each initialisation, the bytes of such values of the observed
//! parameters that are still alive anywhere in the process are summed; the most at once is what the
//! test bounds by one layer. Gathers during the passes are counted by `zero::gathered_bytes`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::{ClassificationOutput, InferenceStep, Learner, TrainOutput, TrainStep};
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{AccelerateConfig, Accelerated};
use serde::{Deserialize, Serialize};

use crate::harness::{self, launch, report, worker};
use crate::mlp::{BlobBatch, CLASSES, FEATURES};
use crate::supervised::{self, FitDir};
use crate::{assert_like_stage_2, bits};
use crate::{parameters, resume};

type Train = Accelerated<Autodiff<Flex>>;

/// The widths of the stack's linear layers: five layers, none holding more than a fifth of
/// the model, so that the parameters outside a process's share are more than one layer on 2
/// and 3 processes.
const WIDTHS: [usize; 6] = [FEATURES, 16, 16, 16, 16, CLASSES];

/// Linear layers with ReLUs between them, built by Burn's `LinearConfig::init` (lazy).
#[derive(Module, Debug)]
struct Stack<B: Backend> {
    layers: Vec<Linear<B>>,
    relu: Relu,
}

impl<B: Backend> Stack<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            layers: WIDTHS
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
            relu: Relu::new(),
        }
    }

    fn classify(&self, batch: BlobBatch<B>) -> ClassificationOutput<B> {
        let last = self.layers.len() - 1;
        let mut x = batch.x;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = self.relu.forward(x);
            }
        }
        let loss = CrossEntropyLossConfig::new()
            .init(&x.device())
            .forward(x.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, x, batch.labels)
    }
}

/// What the first training step of this process saw (one fit per process).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct FirstStep {
    /// The most gathered bytes whole at once from before `prepare_model` to the end of the
    /// first step's backward pass.
    gathered_peak: u64,
    /// Bytes of Burn-initialised values of parameters outside this process's share still alive.
    not_owned_alive: u64,
}

static FIRST_STEP: Mutex<Option<FirstStep>> = Mutex::new(None);

impl<B: AutodiffBackend> TrainStep for Stack<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> TrainOutput<Self::Output> {
        let item = self.classify(batch);
        let grads = item.loss.backward();
        let mut first = FIRST_STEP.lock().unwrap();
        if first.is_none() {
            *first = Some(FirstStep {
                gathered_peak: burn_accelerate::zero::gathered_bytes().peak,
                not_owned_alive: not_owned_alive(),
            });
        }
        TrainOutput::new(self, grads, item)
    }
}

impl<B: Backend> InferenceStep for Stack<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> Self::Output {
        self.classify(batch)
    }
}

type Components = supervised::AdamComponents<Stack<Train>>;

/// A value Burn's initializer made for the parameter at a place in visiting order: its bytes,
/// and whether its storage is still alive.
struct Initialised {
    place: usize,
    bytes: u64,
    alive: Box<dyn Fn() -> bool + Send>,
}

/// Every value Burn's initializers made on this process, and which places `zero::partition`
/// gives this process (the others are observed).
static INITIALISED: Mutex<Vec<Initialised>> = Mutex::new(Vec::new());
static OWNED: Mutex<Vec<bool>> = Mutex::new(Vec::new());
/// The most bytes of such values of parameters outside this process's share alive at once.
static NOT_OWNED_PEAK: AtomicU64 = AtomicU64::new(0);

fn not_owned_alive() -> u64 {
    let owned = OWNED.lock().unwrap();
    INITIALISED
        .lock()
        .unwrap()
        .iter()
        .filter(|value| !owned[value.place] && (value.alive)())
        .map(|value| value.bytes)
        .sum()
}

// Notes a value just made by Burn's initializer, and the not-owned bytes alive now.
fn note_initialised<const D: usize>(place: usize, value: &Tensor<Train, D>) {
    let storage = value.clone().into_primitive().tensor().primitive.data_arc();
    let weak = Arc::downgrade(&storage);
    drop(storage);
    let bytes = (value.shape().num_elements() * 4) as u64;
    INITIALISED.lock().unwrap().push(Initialised {
        place,
        bytes,
        alive: Box::new(move || weak.strong_count() > 0),
    });
    NOT_OWNED_PEAK.fetch_max(not_owned_alive(), Ordering::SeqCst);
}

/// Wraps every (lazy) float parameter in one whose initializer runs the original's on a lazy
/// copy (Burn's initializer, the same draws in the same order) and notes the value.
struct Watch {
    place: usize,
}

impl ModuleMapper<Train> for Watch {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Train, D>>,
    ) -> Param<Tensor<Train, D>> {
        assert!(!param.is_initialized(), "the model is built lazily");
        let (id, shape, device) = (param.id, param.lazy_shape(), param.lazy_device());
        let place = self.place;
        self.place += 1;
        let init = move |_: &burn::tensor::Device<Train>, _: bool| {
            let value = param.clone().val();
            note_initialised(place, &value);
            value
        };
        Param::uninitialized(id, init, device, true, shape)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Run {
    zero_stage: u8,
    /// Whether the model goes through `AccelerateStrategy::prepare_model`.
    prepare: bool,
    epochs: usize,
    /// Checkpoints in `dir/checkpoint` (resumed from by themselves when there are some).
    dir: Option<PathBuf>,
    sharded_checkpoint: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct RunReport {
    parameters: Vec<f32>,
    optimizer_steps: usize,
    epochs: Vec<usize>,
    first_step: FirstStep,
    not_owned_peak: u64,
}

impl resume::Trained for RunReport {
    fn parameters(&self) -> &[f32] {
        &self.parameters
    }
}

/// Each parameter's number of values, in visiting order.
fn sizes() -> Vec<usize> {
    WIDTHS
        .windows(2)
        .flat_map(|w| [w[0] * w[1], w[1]])
        .collect()
}

/// One layer's weight and bias, in f32 bytes: the most that may be whole at once of the
/// parameters outside a process's share.
fn largest_layer() -> u64 {
    WIDTHS
        .windows(2)
        .map(|w| ((w[0] * w[1] + w[1]) * 4) as u64)
        .max()
        .unwrap()
}

/// Burn's `SupervisedTraining` with `with_accelerate` of the stack, Adam through Burn's
/// learner, 16 items a batch per process over 128.
fn train(args: &Run) -> RunReport {
    let device = Default::default();
    let state = ProcessState::from_env().unwrap();
    let (rank, processes) = (state.process_index(), state.num_processes());
    let owners = burn_accelerate::zero::partition(&sizes(), processes);
    *OWNED.lock().unwrap() = owners.iter().map(|&o| o == rank).collect();
    let loader = supervised::blob_loader(16, 128);
    let config = AccelerateConfig::new()
        .with_zero_stage(ZeroStage::from_number(args.zero_stage).unwrap())
        .with_checkpoint_layout(supervised::checkpoint_layout(args.sharded_checkpoint));
    let strategy = AccelerateStrategy::<Components>::new(config, &device).unwrap();
    let (strategy, dir) = FitDir::of(strategy, args.dir.as_deref(), &loader, "prepared");
    let stats = strategy.report();
    let builder = supervised::quiet_training(dir.path(), loader, 32, args.epochs);
    Train::seed(&device, 5);
    burn_accelerate::zero::reset_gathered_peak();
    let model = Stack::<Train>::new(&device).map(&mut Watch { place: 0 });
    let model = if args.prepare {
        strategy.prepare_model(model)
    } else {
        model
    };
    let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
    let model = builder.with_accelerate(strategy).launch(learner).model;
    let stats = stats.stats();
    RunReport {
        parameters: parameters(&model),
        optimizer_steps: stats.optimizer_steps(),
        epochs: stats.epochs.iter().map(|e| e.epoch).collect(),
        first_step: FIRST_STEP.lock().unwrap().unwrap_or_default(),
        not_owned_peak: NOT_OWNED_PEAK.load(Ordering::SeqCst),
    }
}

/// A lazily built model prepared by `AccelerateStrategy::prepare_model` before Burn's `Learner`
/// and `launch`, on 2 and 3 processes: (i) at stage 2 (where preparing changes nothing) and
/// stage 3 the parameters end alike (bit for bit on 2 processes, to rounding on 3: slices sum
/// in another order); (ii) at stage 3 no process ever holds more of the parameters outside its
/// `zero::partition` share than one layer, from their initialisation through `launch` to the
/// end of the first step (Burn's initialised values, then the gathers), and none of those
/// values is alive at the first step. Without `prepare_model` (the same run), Burn's `launch`
/// initialises every parameter whole on every process: more than one layer of them is alive
/// at once, which shows that the observation sees it.
#[test]
fn a_model_prepared_before_the_learner_is_never_whole_and_trains_as_stage_2() {
    const TEST: &str = "stage3_prepared_learner::\
        a_model_prepared_before_the_learner_is_never_whole_and_trains_as_stage_2";
    if let Some(args) = worker::<Run>() {
        return report(&train(&args));
    }
    let layer = largest_layer();
    for processes in [2, 3] {
        let go = |zero_stage: u8, prepare: bool| -> Vec<RunReport> {
            let run = Run {
                zero_stage,
                prepare,
                epochs: 2,
                dir: None,
                sharded_checkpoint: false,
            };
            launch(TEST, processes, &run, &[])
                .assert_success()
                .reports(processes)
        };
        let (stage2, prepared, unprepared) = (go(2, true), go(3, true), go(3, false));
        for rank in 0..processes {
            let what = format!("{processes} processes, rank {rank}");
            let (s2, s3, bare) = (&stage2[rank], &prepared[rank], &unprepared[rank]);
            // (i) The same training: prepared or not, the same bits; stage 2's as
            // `assert_like_stage_2` says.
            assert!(s3.optimizer_steps > 0, "{what}");
            assert_eq!(s3.optimizer_steps, s2.optimizer_steps, "{what}");
            assert_like_stage_2(&s3.parameters, &s2.parameters, processes == 2, &what);
            assert_eq!(bits(&bare.parameters), bits(&s3.parameters), "{what}");
            // (ii) Never more than one layer of the parameters outside this process's share.
            assert!(
                s3.not_owned_peak > 0 && s3.not_owned_peak <= layer,
                "{what}: {} bytes of parameters it does not own were whole at once, one \
                 layer is {layer}",
                s3.not_owned_peak
            );
            assert!(
                s3.first_step.gathered_peak <= layer,
                "{what}: {} bytes gathered at once, one layer is {layer}",
                s3.first_step.gathered_peak
            );
            assert_eq!(s3.first_step.not_owned_alive, 0, "{what}");
            // Without `prepare_model`, Burn's `launch` holds them whole.
            assert!(
                bare.not_owned_peak > layer,
                "{what}: unprepared, {} bytes not owned whole at once",
                bare.not_owned_peak
            );
        }
    }
}

/// A prepared stage 3 model (2 processes) checkpointed by the strategy after epoch 2, and
/// resumed by itself with a prepared model as well, on the same processes: the run ends bit
/// for bit where the uninterrupted one does, with a consolidated checkpoint and a sharded one
/// (where each process reads its partition's files).
#[test]
fn a_prepared_stage_3_model_resumes_from_its_checkpoint_bit_for_bit() {
    const TEST: &str =
        "stage3_prepared_learner::a_prepared_stage_3_model_resumes_from_its_checkpoint_bit_for_bit";
    if let Some(args) = worker::<Run>() {
        return report(&train(&args));
    }
    let processes = 2;
    for sharded_checkpoint in [false, true] {
        let what = if sharded_checkpoint {
            "sharded"
        } else {
            "consolidated"
        };
        let run = |epochs: usize, dir: &PathBuf| Run {
            zero_stage: 3,
            prepare: true,
            epochs,
            dir: Some(dir.clone()),
            sharded_checkpoint,
        };
        let whole_dir = harness::scratch_dir(&format!("prepared-whole-{what}"));
        let whole: Vec<RunReport> = launch(TEST, processes, &run(3, &whole_dir), &[])
            .assert_success()
            .reports(processes);
        assert_eq!(whole[0].epochs, [1, 2, 3], "{what}");
        let dir = harness::scratch_dir(&format!("prepared-resume-{what}"));
        launch(TEST, processes, &run(2, &dir), &[]).assert_success();
        let resumed: Vec<RunReport> = launch(TEST, processes, &run(3, &dir), &[])
            .assert_success()
            .reports(processes);
        assert_eq!(resumed[0].epochs, [3], "{what}: resumed after epoch 2");
        resume::assert_bit_for_bit(&resumed, &whole, what);
        harness::clean(&whole_dir);
        harness::clean(&dir);
    }
}
