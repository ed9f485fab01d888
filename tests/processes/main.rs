//! Training on several real processes of this machine, started by `burn-accelerate launch`
//! (see `harness.rs`): the hand-written loop's `Accelerator` and Burn's `SupervisedTraining`
//! with `with_accelerate` against one process on the same global batches, an overflow on one
//! rank, checkpoints resumed on as many and on fewer processes, the shard loaders against the
//! golden vectors, seeds, and what a dead rank or a bad launch does.
#![cfg(feature = "flex")]

mod harness;
#[path = "../../examples/common/lm.rs"]
mod lm;
#[path = "../../examples/common/mlp.rs"]
mod mlp;
#[path = "../needs/mod.rs"]
mod needs;
mod one_save;
mod precheck_memory;
mod resume;
mod sharded_resume;
mod stage3_autocast_more;
mod stage3_backends;
mod stage3_bounds;
mod stage3_conv;
mod stage3_eval_forward;
mod stage3_norm;
mod stage3_prepared_learner;
mod stage3_supervised_first_window;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::SgdConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder, StreamLoaderBuilder};
use burn_accelerate::distributed::{DistributedError, ProcessState, seed_for, set_seed};
use burn_accelerate::fp8::Fp8Mode;
use burn_accelerate::train::AccelerateCheckpoint;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use harness::{launch, max_relative_difference, report, worker};
use resume::{HandCheckpoint, StrategyCheckpoint};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sharded_resume::FromCopy;

/// Every float parameter of `module`, in visiting order.
fn parameters<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let values = param.val().into_data().convert::<f32>();
            self.0.extend(values.to_vec::<f32>().unwrap());
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// An int tensor's values, whatever the backend's int dtype.
fn ints<B: Backend, const D: usize>(tensor: Tensor<B, D, Int>) -> Vec<i64> {
    tensor.into_data().convert::<i64>().to_vec().unwrap()
}

/// Checks the bytes a process sent against the formula: what `zero::sent_bytes` counts, the
/// built-in engine's ring payload. Under mpirun the MPI engine moves the bytes with MPI's own
/// algorithms, which the counter does not see: there it stays 0 (as documented), and the
/// formula is not checked.
fn assert_sent(sent: u64, expected: u64, what: &str) {
    if harness::under_mpi() {
        assert_eq!(sent, 0, "{what} (the MPI engine's traffic is not counted)");
    } else {
        assert_eq!(sent, expected, "{what}");
    }
}

/// Per parameter of `module` in visiting order: whether `grads` holds its gradient.
fn holds_gradient<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &burn::optim::GradientsParams,
) -> Vec<bool> {
    struct Holds<'a>(&'a burn::optim::GradientsParams, Vec<bool>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Holds<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let held = self.0.get::<B::InnerBackend, D>(param.id).is_some();
            self.1.push(held);
        }
    }
    let mut holds = Holds(grads, Vec::new());
    module.visit(&mut holds);
    holds.1
}

/// The bytes each of `processes` processes sends over the built-in engine's ring for one
/// batch at stage 3, for parameters given as `(values, width, again)` (the values, the bytes
/// a gathered value takes, and whether backward gathers it again): each process holds a slice
/// of `zero::slice_len` values of every parameter (padded); each gather is a ring all-gather
/// of the slices (every process sends the `processes - 1` slices not its own on, in the
/// gather's width), each reduction, on a batch that completes a window (`reduces`), a ring
/// reduce-scatter of the padded f32 gradient (every process sends `processes - 1` slices), and
/// every collective first sends 2 × 8 bytes to each other process.
fn stage_3_sent(
    params: impl IntoIterator<Item = (usize, u64, bool)>,
    processes: usize,
    reduces: bool,
) -> u64 {
    let others = (processes - 1) as u64;
    let fixed = 2 * 8 * others;
    params
        .into_iter()
        .map(|(values, width, again)| {
            let slices = others * burn_accelerate::zero::slice_len(values, processes) as u64;
            let gather = fixed + slices * width;
            let reduce = fixed + slices * 4;
            gather * (1 + u64::from(again)) + if reduces { reduce } else { 0 }
        })
        .sum()
}

/// One parameter as stage 3 gathers it: its values, the bytes a gathered value takes (the
/// dtype it is gathered in), and whether backward gathers it again (an op's backward reads it
/// for the other operand's gradient).
type Gathered = (usize, u64, bool);

/// A layer's weight of `weight` values and bias of `bias`, gathered `width` bytes a value;
/// backward gathers the weight again where `again` (the layer's input needs a gradient).
fn weight_and_bias(weight: usize, bias: usize, width: u64, again: bool) -> Vec<Gathered> {
    vec![(weight, width, again), (bias, width, false)]
}

/// What stage 3 does with a model's parameters on `processes` processes, each process
/// holding a slice of every parameter (`zero::slice_len`): the bytes each process sends, the
/// most it holds gathered at once, the gradients it keeps. The one home of these
/// expectations.
struct Stage3Expected {
    /// The parameters in visiting order, by layer: a layer's forward op gathers all of its
    /// parameters at once.
    layers: Vec<Vec<Gathered>>,
    processes: usize,
}

/// How a test bounds each batch's gathered peak at stage 3, besides at most the largest
/// layer's gathered bytes and below every parameter's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peak {
    /// Something is gathered.
    OneLayer,
    /// Exactly `Stage3Expected::bound`.
    Bound,
}

impl Stage3Expected {
    fn new(layers: Vec<Vec<Gathered>>, processes: usize) -> Self {
        Self { layers, processes }
    }

    /// The bytes each process sends in a training batch's forward and backward passes (every
    /// process the same): `stage_3_sent` of the gathers in each parameter's width and, where
    /// the batch completes a window (`reduces`), the reduce-scatters of the f32 gradients.
    fn sent(&self, reduces: bool) -> u64 {
        stage_3_sent(
            self.layers.iter().flatten().copied(),
            self.processes,
            reduces,
        )
    }

    /// The bytes each process sends in a forward pass without a backward (an evaluation's):
    /// one gather per parameter.
    fn sent_by_forward(&self) -> u64 {
        let params = self.layers.iter().flatten();
        let params = params.map(|&(values, width, _)| (values, width, false));
        stage_3_sent(params, self.processes, false)
    }

    /// Per layer, the bytes of its gathered parameters.
    fn layer_bytes(&self) -> Vec<u64> {
        let layer = |layer: &Vec<Gathered>| -> u64 {
            layer
                .iter()
                .map(|&(values, width, _)| values as u64 * width)
                .sum()
        };
        self.layers.iter().map(layer).collect()
    }

    /// Per parameter in visiting order, whether a process keeps a gradient for it after the
    /// backward pass that completes a window: its slice's, of every parameter.
    fn own(&self) -> Vec<bool> {
        vec![true; self.layers.iter().flatten().count()]
    }

    /// The largest layer's gathered bytes: at most one layer's parameters whole at a time.
    fn largest(&self) -> u64 {
        self.layer_bytes().into_iter().max().unwrap()
    }

    /// The most a process holds gathered at once where each layer's parameters are whole for
    /// its ops alone: the largest layer's bytes (a layer's forward op gathers them all; its
    /// backward, the weight again, no more). An op that kept its gathered parameters until
    /// the step would add them to every later layer's.
    fn bound(&self) -> u64 {
        self.largest()
    }

    /// Checks a process's stage 3 report of `training`, batch by batch: nothing gathered
    /// is left whole after a backward pass. In the first window of a model built whole (not
    /// prepared) nothing travels or is gathered before the step, which reduce-scatters as
    /// stage 2 does: every gradient is held after backward. From then on the gathered peak is
    /// as `peak` says, at most the largest layer's and below every parameter's together, the
    /// bytes sent are `sent`'s, and a batch that completes a window leaves the process only its
    /// slice of every gradient (each reduce-scattered in backward), any other batch every one
    /// whole (`no_sync`).
    fn check<O>(&self, report: &Stage3Report<O>, training: &Training, peak: Peak, what: &str) {
        let window = training.grad_accum;
        let largest = self.largest();
        let all: u64 = self.layer_bytes().into_iter().sum();
        let own = self.own();
        assert_eq!(report.sent.len(), training.batches, "{what}");
        for batch in 0..training.batches {
            let what = format!("{what}, batch {batch}");
            let (sent, gathered) = (report.sent[batch], report.gathered_peak[batch]);
            let holds = &report.holds_gradient[batch];
            assert_eq!(report.gathered_after_backward[batch], 0, "{what}");
            let completes = (batch + 1).is_multiple_of(window);
            if batch < window && !training.prepare {
                assert_eq!((sent, gathered), (0, 0), "{what}");
                assert!(holds.iter().all(|&h| h), "{what}: {holds:?}");
                continue;
            }
            match peak {
                Peak::OneLayer => assert!(gathered > 0, "{what}"),
                Peak::Bound => assert_eq!(gathered, self.bound(), "{what}"),
            }
            assert!(gathered <= largest, "{what}: {gathered} > {largest}");
            assert!(gathered < all, "{what}: {gathered} against {all}");
            assert_sent(sent, self.sent(completes), &what);
            if completes {
                assert_eq!(holds, &own, "{what}");
            } else {
                assert!(holds.iter().all(|&h| h), "{what}: {holds:?}");
            }
        }
    }
}

/// How far stage 3's parameters may be from stage 2's (relative) where the sums run in
/// another order: on more than two processes, stage 2 sums each parameter's gradient in the
/// ring order of its owner's block, stage 3 each slice in its own block's (and the global
/// norm sums slices instead of whole parameters): rounding, compounded through the steps.
const STAGE_3_ROUNDING: f32 = 1e-6;

/// Checks stage 3's parameters against stage 2's: bit for bit where the sums cannot differ
/// (`exact`), else within [`STAGE_3_ROUNDING`].
fn assert_like_stage_2(stage3: &[f32], stage2: &[f32], exact: bool, what: &str) {
    if exact {
        assert_eq!(bits(stage3), bits(stage2), "{what}");
    } else {
        let difference = max_relative_difference(stage3, stage2);
        assert!(
            difference <= STAGE_3_ROUNDING,
            "{what}: {difference} from stage 2"
        );
    }
}

/// How stage 3's parameters must agree with stage 2's.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Agreement {
    /// Bit for bit: the CPU backends run the same ops in the same order at both stages (on
    /// two processes; on more, `stage_3_against_stage_2` holds [`STAGE_3_ROUNDING`]: slices
    /// sum in another order).
    Bits,
    /// Within this relative difference (`max_relative_difference`): a backend that picks
    /// its kernels by timing (cubecl's autotuned matmuls) need not sum in the same order in
    /// two runs.
    Within(f32),
}

/// Runs `test`'s workers of `training` on `expected.processes` processes at stages 2 and 3
/// (`args` makes a worker's arguments, which name the case in the messages) and checks stage
/// 3 against stage 2 (the parameters as `agreement` says, on every process the same bits; the
/// step outcomes, the loss scale and the fp8 state; stage 2 sends and gathers nothing in its
/// passes) and against `expected` (`Stage3Expected::check`, the peak as `peak` says); returns
/// the reports, stage 2's then stage 3's, for the test's own checks.
fn stage_3_against_stage_2<R: Serialize + std::fmt::Debug, O: serde::de::DeserializeOwned>(
    test: &str,
    expected: &Stage3Expected,
    training: Training,
    (peak, agreement): (Peak, Agreement),
    args: impl Fn(Training) -> R,
) -> (Vec<Stage3Report<O>>, Vec<Stage3Report<O>>) {
    let processes = expected.processes;
    let case = format!("{processes} processes, {:?}", args(training));
    let run = |zero_stage: u8| -> Vec<Stage3Report<O>> {
        let training = Training {
            zero_stage,
            ..training
        };
        launch(test, processes, &args(training), &[])
            .assert_success()
            .reports(processes)
    };
    let (stage2, stage3) = (run(2), run(3));
    // Stage 2 sums each parameter's gradient in its owner's order of the ring; stage 3 each
    // slice in its own's. A mean of two values is one rounding whatever the order; of more,
    // the orders differ and the parameters agree to rounding (compounded through the steps).
    let agreement = match agreement {
        Agreement::Bits if processes > 2 => Agreement::Within(STAGE_3_ROUNDING),
        agreement => agreement,
    };
    for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
        let what = format!("{case}, rank {rank}");
        assert_eq!(s3.outcomes, s2.outcomes, "{what}");
        assert_eq!(s3.loss_scale, s2.loss_scale, "{what}");
        match agreement {
            Agreement::Bits => assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}"),
            Agreement::Within(within) => {
                let difference = max_relative_difference(&s3.parameters, &s2.parameters);
                assert!(difference <= within, "{what}: {difference} from stage 2");
            }
        }
        assert_eq!(bits(&s3.parameters), bits(&stage3[0].parameters), "{what}");
        // The same amax histories and scales: the weights' amaxes seen in the gathered
        // values, their gradients' (HYBRID) after the same rounding.
        assert_eq!(s3.fp8_state, s2.fp8_state, "{what}");
        assert_eq!(s2.sent.len(), training.batches, "{what}");
        for (batch, (&sent, &gathered)) in s2.sent.iter().zip(&s2.gathered_peak).enumerate() {
            assert_eq!((sent, gathered), (0, 0), "{what}, batch {batch} at stage 2");
        }
        expected.check(s3, &training, peak, &what);
    }
    match training.precision {
        // The loss scaler scaled the f16 losses (and compared its scale above).
        Some(Precision::F16) => assert!(stage3[0].loss_scale > 1.0, "{case}"),
        Some(Precision::Fp8(_)) => {
            // The state read is the training's: its steps, and every layer's weight rounded
            // by its forward op's cast (the op's input 1).
            let state: burn_accelerate::fp8::Fp8State =
                serde_json::from_str(stage3[0].fp8_state.as_deref().unwrap()).unwrap();
            assert_eq!(state.steps(), training.batches as u64, "{case}");
            let forward = burn_accelerate::fp8::Pass::Forward;
            let weights = state.tensors();
            let weights = weights.filter(|(key, _)| key.input == 1 && key.pass == forward);
            assert_eq!(weights.count(), expected.layers.len(), "{case}");
        }
        _ => {}
    }
    (stage2, stage3)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

// ---------------------------------------------------------------------------------------
// A hand-written loop with the Accelerator.

const FEATURES: usize = 8;
const CLASSES: usize = 4;
const ITEMS: usize = 96;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    hidden: Linear<B>,
    out: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Net<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 7);
        Self {
            hidden: LinearConfig::new(FEATURES, 16).init(device),
            out: LinearConfig::new(16, CLASSES).init(device),
            relu: Relu::new(),
        }
    }

    fn loss(&self, batch: Batch<B>) -> Tensor<B, 1> {
        let logits = self
            .out
            .forward(self.relu.forward(self.hidden.forward(batch.x)));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.y)
    }
}

#[derive(Clone, Debug)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
}

/// Sample `i`: smooth features and a class both drawn from `i`.
#[derive(Clone, Copy)]
struct Samples;

impl<B: Backend> Batcher<B, usize, Batch<B>> for Samples {
    fn batch(&self, items: Vec<usize>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|&i| (0..FEATURES).map(move |f| ((i * 7 + f * 3) as f32 * 0.37).sin()))
            .collect();
        let y: Vec<i64> = items.iter().map(|&i| ((i * 5) % CLASSES) as i64).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct HandLoop {
    /// Per process.
    batch_size: usize,
    grad_accum: usize,
    epochs: usize,
    precision: Precision,
    /// A rank whose loss is multiplied by 1e10 at batch `overflow_batch` (f16 overflows).
    overflow_rank: Option<usize>,
    /// The ZeRO stage (DeepSpeed's number).
    #[serde(default)]
    zero_stage: u8,
    /// Adam (with its per-parameter state) instead of SGD.
    #[serde(default)]
    adam: bool,
    /// Clip the gradients to this global norm before each step.
    #[serde(default)]
    clip_norm: Option<f32>,
    overflow_batch: usize,
    /// Where the main process writes a checkpoint at the end (model, whole optimizer state,
    /// accelerator and loader states).
    #[serde(default)]
    save_to: Option<PathBuf>,
    /// The checkpoint to start from.
    #[serde(default)]
    resume_from: Option<PathBuf>,
    /// Save with `CheckpointLayout::Sharded` (each process its own partition's files).
    #[serde(default)]
    sharded_checkpoint: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct HandLoopReport {
    parameters: Vec<f32>,
    outcomes: Vec<String>,
    loss_scale: f32,
    /// After each batch's `optimizer_step`, how many of the model's parameters held a value
    /// (the others are released, to be gathered at their next use: ZeRO stage 3).
    #[serde(default)]
    held_after_step: Vec<usize>,
}

/// How many of `module`'s float parameters hold a value (are not lazy).
fn held_parameters<B: Backend, M: Module<B>>(module: &M) -> usize {
    struct Count(usize);
    impl<B: Backend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 += usize::from(param.is_initialized());
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

fn hand_loop<B: AutodiffBackend>(args: &HandLoop) -> HandLoopReport {
    // The net is tiny: cast all its lower-class ops (PyTorch's rule), so that f16 overflows.
    burn_accelerate::Context::process()
        .with_small_ops(burn_accelerate::autocast::SmallOps::Cast)
        .expect("a valid rule")
        .set_as_default();
    if args.adam {
        hand_loop_with::<B, _>(args, burn::optim::AdamConfig::new().init())
    } else {
        hand_loop_with::<B, _>(args, SgdConfig::new().init())
    }
}

fn hand_loop_with<B, O>(args: &HandLoop, mut optim: O) -> HandLoopReport
where
    B: AutodiffBackend,
    O: burn::optim::Optimizer<Net<B>, B>,
    O::Record: burn_accelerate::zero::ParamStateRecord<B>,
{
    use burn_accelerate::checkpoint::CheckpointDir;
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = Net::<B>::new(&device);
    let loader = ShardLoaderBuilder::new(
        DataLoaderConfig::new(args.batch_size)
            .with_shuffle(true)
            .with_data_seed(Some(3)),
        InMemDataset::new((0..ITEMS).collect()),
        Samples,
    )
    .build_for(&state, device.clone())
    .unwrap();
    let mut accelerator = AccelerateConfig::new()
        .with_mixed_precision(args.precision)
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap())
        .with_checkpoint_layout(if args.sharded_checkpoint {
            burn_accelerate::checkpoint::CheckpointLayout::Sharded
        } else {
            burn_accelerate::checkpoint::CheckpointLayout::Consolidated
        })
        .init::<B>(&Default::default())
        .unwrap();
    if let Some(dir) = &args.resume_from {
        // The accelerator's checkpoint helpers: the model, the whole optimizer state cut to
        // this run's partition, the accelerator's state, and the loader's position beside.
        let resumed = accelerator
            .resume(&CheckpointDir::new(dir), model, optim)
            .unwrap();
        assert_eq!(resumed.from, Some(1));
        (model, optim) = (resumed.model, resumed.optimizer);
        let position = serde_json::from_slice(&resumed.files["loader.json"]).unwrap();
        loader.load_state(position).unwrap();
    }
    let mut outcomes = Vec::new();
    let mut held_after_step = Vec::new();
    let mut batch_index = 0;
    for _ in 0..args.epochs {
        for batch in loader.iter() {
            let _step = accelerator.accumulate(&model);
            let _autocast = accelerator.autocast();
            let mut loss = model.loss(batch);
            if args.overflow_rank == Some(state.process_index())
                && batch_index == args.overflow_batch
            {
                loss = loss * 1e10;
            }
            accelerator.backward(loss, &model);
            if let Some(max_norm) = args.clip_norm {
                accelerator.clip_grad_norm(&model, max_norm).unwrap();
            }
            let (next, outcome) = accelerator
                .optimizer_step(&mut optim, model, &mut 0.5)
                .unwrap();
            model = next;
            outcomes.push(format!("{outcome:?}"));
            held_after_step.push(held_parameters(&model));
            batch_index += 1;
        }
    }
    if let Some(dir) = &args.save_to {
        let position = serde_json::to_vec(&loader.state()).unwrap();
        accelerator
            .save_checkpoint_with(
                &CheckpointDir::new(dir),
                1,
                &model,
                &optim,
                &[("loader.json", &position)],
            )
            .unwrap();
    }
    HandLoopReport {
        parameters: parameters(&model),
        outcomes,
        loss_scale: accelerator.loss_scale().loss_scale(),
        held_after_step,
    }
}

#[test]
fn processes_train_like_one_process_on_the_same_global_batches() {
    const TEST: &str = "processes_train_like_one_process_on_the_same_global_batches";
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Autodiff<Flex>>(&args));
    }
    // A global batch of 16: one process of 16, two of 8, four of 4.
    for grad_accum in [1, 2] {
        let args = |processes: usize| HandLoop {
            batch_size: 16 / processes,
            grad_accum,
            epochs: 2,
            precision: Precision::F32,
            overflow_rank: None,
            overflow_batch: 0,
            zero_stage: 0,
            adam: false,
            clip_norm: None,
            save_to: None,
            resume_from: None,
            sharded_checkpoint: false,
        };
        let single: Vec<HandLoopReport> =
            launch(TEST, 1, &args(1), &[]).assert_success().reports(1);
        let single = &single[0];
        let applied = single
            .outcomes
            .iter()
            .filter(|o| o.starts_with("Applied"))
            .count();
        assert_eq!(applied, 12 / grad_accum, "{:?}", single.outcomes);
        for processes in [2, 4] {
            let reports: Vec<HandLoopReport> = launch(TEST, processes, &args(processes), &[])
                .assert_success()
                .reports(processes);
            for (rank, r) in reports.iter().enumerate() {
                // Every process holds the same model, to the bit.
                assert_eq!(
                    bits(&r.parameters),
                    bits(&reports[0].parameters),
                    "rank {rank}"
                );
                assert_eq!(r.outcomes, single.outcomes);
            }
            let difference = max_relative_difference(&reports[0].parameters, &single.parameters);
            assert!(
                difference < 1e-5,
                "{processes} processes, grad_accum {grad_accum}: {difference:e} from one process"
            );
            // And training moved the parameters far more than that.
            let initial = parameters(&Net::<Flex>::new(&Default::default()));
            assert!(max_relative_difference(&single.parameters, &initial) > 1e-2);
        }
    }
}

#[test]
fn two_machines_of_two_processes_train_like_one_process() {
    const TEST: &str = "two_machines_of_two_processes_train_like_one_process";
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Autodiff<Flex>>(&args));
    }
    if harness::under_mpi() {
        needs::missing(
            "burn-accelerate's launcher rather than mpirun (BURN_ACCELERATE_TEST_ENGINE=mpi is set)",
        );
    }
    let args = |processes: usize| HandLoop {
        batch_size: 16 / processes,
        grad_accum: 1,
        epochs: 1,
        precision: Precision::F32,
        overflow_rank: None,
        overflow_batch: 0,
        zero_stage: 0,
        adam: false,
        clip_norm: None,
        save_to: None,
        resume_from: None,
        sharded_checkpoint: false,
    };
    let single: Vec<HandLoopReport> = launch(TEST, 1, &args(1), &[]).assert_success().reports(1);
    // Two launchers on this host stand for two machines; machine 0 hosts the rendezvous. Both
    // get the secret `burn-accelerate secret` wrote, as two machines would.
    let port = harness::free_port().to_string();
    let secret = harness::scratch_dir("two-machines-secret").join("run.secret");
    let wrote = harness::launcher()
        .arg("secret")
        .arg(&secret)
        .status()
        .unwrap();
    assert!(wrote.success());
    let text = std::fs::read_to_string(&secret).unwrap();
    assert!(text.trim().len() == 64 && text.trim().chars().all(|c| c.is_ascii_hexdigit()));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let machine = |rank: &str| {
        let flags = [
            "--num-machines",
            "2",
            "--machine-rank",
            rank,
            "--main-process-ip",
            "127.0.0.1",
            "--main-process-port",
            &port,
            "--secret-file",
            secret.to_str().unwrap(),
        ];
        harness::launch_command(TEST, 4, &args(4), &flags)
    };
    let (first, dir) = machine("0");
    let (mut second, unused) = machine("1");
    harness::clean(&unused);
    // Both machines report into one directory.
    second.env(harness::WORKER_DIR, &dir);
    let other = {
        let dir = dir.clone();
        std::thread::spawn(move || harness::run(second, dir))
    };
    let launched = harness::run(first, dir);
    let second = other.join().unwrap();
    second.assert_success();
    // Machine 1 ran ranks 2 and 3, machine 0 ranks 0 and 1.
    assert!(second.stdout.contains("[rank 2] ") && second.stdout.contains("[rank 3] "));
    assert!(!second.stdout.contains("[rank 0] "));
    let reports: Vec<HandLoopReport> = launched.assert_success().reports(4);
    for r in &reports {
        assert_eq!(bits(&r.parameters), bits(&reports[0].parameters));
    }
    let difference = max_relative_difference(&reports[0].parameters, &single[0].parameters);
    assert!(difference < 1e-5, "{difference:e}");
}

#[cfg(feature = "ndarray")]
#[test]
fn ndarray_processes_train_like_one_process() {
    const TEST: &str = "ndarray_processes_train_like_one_process";
    type Nd = Autodiff<burn::backend::NdArray>;
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Nd>(&args));
    }
    let args = |processes: usize| HandLoop {
        batch_size: 16 / processes,
        grad_accum: 2,
        epochs: 2,
        precision: Precision::F32,
        overflow_rank: None,
        overflow_batch: 0,
        zero_stage: 0,
        adam: false,
        clip_norm: None,
        save_to: None,
        resume_from: None,
        sharded_checkpoint: false,
    };
    let single: Vec<HandLoopReport> = launch(TEST, 1, &args(1), &[]).assert_success().reports(1);
    let reports: Vec<HandLoopReport> = launch(TEST, 2, &args(2), &[]).assert_success().reports(2);
    assert_eq!(bits(&reports[0].parameters), bits(&reports[1].parameters));
    let difference = max_relative_difference(&reports[0].parameters, &single[0].parameters);
    assert!(difference < 1e-5, "{difference:e}");
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    const TEST: &str = "an_overflow_on_one_rank_skips_the_step_on_every_rank";
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Accelerated<Autodiff<Flex>>>(&args));
    }
    let args = HandLoop {
        batch_size: 8,
        grad_accum: 1,
        epochs: 1,
        precision: Precision::F16,
        overflow_rank: Some(1),
        overflow_batch: 2,
        zero_stage: 0,
        adam: false,
        clip_norm: None,
        save_to: None,
        resume_from: None,
        sharded_checkpoint: false,
    };
    let reports: Vec<HandLoopReport> = launch(TEST, 2, &args, &[]).assert_success().reports(2);
    for r in &reports {
        assert_eq!(r.outcomes[2], "SkippedOverflow", "{:?}", r.outcomes);
        let skipped = r
            .outcomes
            .iter()
            .filter(|o| *o == "SkippedOverflow")
            .count();
        assert_eq!(skipped, 1, "{:?}", r.outcomes);
        // torch's default scale, backed off once.
        assert_eq!(r.loss_scale, 32768.0);
    }
    assert_eq!(bits(&reports[0].parameters), bits(&reports[1].parameters));
    assert!(reports[0].parameters.iter().all(|p| p.is_finite()));
}

#[test]
fn sharded_stages_end_where_stage_0_does() {
    const TEST: &str = "sharded_stages_end_where_stage_0_does";
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Accelerated<Autodiff<Flex>>>(&args));
    }
    for processes in [2, 3] {
        // Adam (state per parameter, kept by each parameter's owner, in slices at stage 3),
        // clipping to a global
        // norm, and f16 with an overflow on one rank: every stage skips the same step.
        let cases = [
            (Precision::F32, Some(0.5)),
            (Precision::F32, None),
            (Precision::F16, Some(0.5)),
            (Precision::Bf16, None),
            // fp8's delayed scaling keeps per-tensor amax histories on every process, as at
            // stage 0; only the optimizer is sharded.
            (Precision::Fp8(Fp8Mode::Hybrid), Some(0.5)),
        ];
        for (precision, clip_norm) in cases {
            let args = |zero_stage: u8| HandLoop {
                batch_size: 4,
                grad_accum: 2,
                epochs: 1,
                precision,
                overflow_rank: (precision == Precision::F16).then_some(1),
                overflow_batch: 3,
                zero_stage,
                adam: true,
                clip_norm,
                save_to: None,
                resume_from: None,
                sharded_checkpoint: false,
            };
            let runs: Vec<Vec<HandLoopReport>> = (0..3)
                .map(|stage| {
                    launch(TEST, processes, &args(stage), &[])
                        .assert_success()
                        .reports(processes)
                })
                .collect();
            let stage0 = &runs[0][0];
            for (stage, reports) in runs.iter().enumerate() {
                for (rank, r) in reports.iter().enumerate() {
                    let what =
                        format!("{processes} processes, {precision:?}, stage {stage}, rank {rank}");
                    assert_eq!(r.outcomes, stage0.outcomes, "{what}");
                    assert_eq!(r.loss_scale, stage0.loss_scale, "{what}");
                    // Every process holds the whole model, the same bits on each.
                    assert_eq!(bits(&r.parameters), bits(&reports[0].parameters), "{what}");
                    // Stage 1 averages as stage 0 does. Stage 2's sums of two values do not
                    // depend on their order, of three they do; its norm for clipping sums
                    // partition by partition.
                    if stage == 1 || (processes == 2 && stage == 2 && clip_norm.is_none()) {
                        assert_eq!(bits(&r.parameters), bits(&stage0.parameters), "{what}");
                    } else {
                        let d = max_relative_difference(&r.parameters, &stage0.parameters);
                        assert!(d < 1e-5, "{what}: {d:e}");
                    }
                }
            }
            if precision == Precision::F16 {
                assert!(stage0.outcomes.iter().any(|o| o == "SkippedOverflow"));
            }
        }
    }
}

#[test]
fn stage_3_keeps_parameters_sharded_between_steps_and_ends_where_stage_0_does() {
    const TEST: &str = "stage_3_keeps_parameters_sharded_between_steps_and_ends_where_stage_0_does";
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Accelerated<Autodiff<Flex>>>(&args));
    }
    // The net's parameters: two weights and two biases.
    const PARAMETERS: usize = 4;
    for processes in [2, 3] {
        // Adam (state per parameter, kept by its owner, in slices at stage 3), with and
        // without clipping to the
        // global norm, a window of 1 and of 2 batches (the parameters stay gathered while the
        // window accumulates), and f16 with an overflow on one rank (a skipped step releases
        // the parameters too).
        let cases = [
            (Precision::F32, None, 1),
            (Precision::F32, None, 2),
            (Precision::F32, Some(0.5), 2),
            // 3 processes: 8 batches an epoch, the last window of 3 is partial.
            (Precision::F32, None, 3),
            (Precision::F16, Some(0.5), 2),
            // Autocast casts the gathered f32 parameter per op, as it casts a held one; fp8's
            // amax histories are per process, as at stage 0.
            (Precision::Bf16, None, 1),
            (Precision::Fp8(Fp8Mode::Hybrid), Some(0.5), 2),
        ];
        for (precision, clip_norm, grad_accum) in cases {
            let args = |zero_stage: u8| HandLoop {
                batch_size: 4,
                grad_accum,
                epochs: 2,
                precision,
                overflow_rank: (precision == Precision::F16).then_some(1),
                overflow_batch: 3,
                zero_stage,
                adam: true,
                clip_norm,
                save_to: None,
                resume_from: None,
                sharded_checkpoint: false,
            };
            let run = |stage: u8| -> Vec<HandLoopReport> {
                launch(TEST, processes, &args(stage), &[])
                    .assert_success()
                    .reports(processes)
            };
            let (stage0, stage2, stage3) = (run(0), run(2), run(3));
            let what = format!(
                "{processes} processes, {precision:?}, clip {clip_norm:?}, window {grad_accum}"
            );
            for (rank, r) in stage3.iter().enumerate() {
                let what = format!("{what}, rank {rank}");
                assert_eq!(r.outcomes, stage0[0].outcomes, "{what}");
                assert_eq!(r.loss_scale, stage0[0].loss_scale, "{what}");
                // Between steps every parameter is released (lazy: each process's slice waits in
                // its shard, the rest is dropped); mid-window they stay gathered.
                for (outcome, held) in r.outcomes.iter().zip(&r.held_after_step) {
                    let expected = if outcome == "Accumulating" {
                        PARAMETERS
                    } else {
                        0
                    };
                    assert_eq!(*held, expected, "{what}: {outcome} {:?}", r.held_after_step);
                }
                // Gathered whole at the end (the report's visit of every parameter), the same
                // bits on every process.
                assert_eq!(bits(&r.parameters), bits(&stage3[0].parameters), "{what}");
                // Stage 3 reduce-scatters slices where stage 2 reduces whole parameters to
                // their owners: the same bits where the sums cannot differ (two processes, no
                // norm summed over what each holds), to rounding elsewhere.
                let exact = processes == 2 && clip_norm.is_none();
                assert_like_stage_2(&r.parameters, &stage2[rank].parameters, exact, &what);
                // Against stage 0's all-reduce: a mean of two values is one rounding whatever
                // the order, so two processes end bit for bit without clipping. Of three, the
                // ring sums in another order than the reduce-scatter, and clipping's norm sums
                // part by part: rounding, compounded through Adam's 24 steps (about
                // 2.5e-7 at most here).
                if processes == 2 && clip_norm.is_none() {
                    assert_eq!(bits(&r.parameters), bits(&stage0[0].parameters), "{what}");
                } else {
                    let d = max_relative_difference(&r.parameters, &stage0[0].parameters);
                    assert!(d < 1e-6, "{what}: {d:e}");
                }
            }
            // Stage 0 holds every parameter after every batch.
            assert!(stage0[0].held_after_step.iter().all(|&h| h == PARAMETERS));
            if precision == Precision::F16 {
                assert!(stage3[0].outcomes.iter().any(|o| o == "SkippedOverflow"));
            }
        }
    }
}

/// A net whose `shared` layer runs twice each forward pass and whose `unused` layer never
/// runs: at stage 3 the first use gathers a parameter, the second reuses it, and the unused
/// one is gathered where the gradients are read (every process reads them in the same order).
#[derive(Module, Debug)]
struct Uneven<B: Backend> {
    input: Linear<B>,
    shared: Linear<B>,
    unused: Linear<B>,
    out: Linear<B>,
}

#[derive(Debug, Serialize, Deserialize)]
struct UnevenRun {
    zero_stage: u8,
    steps: usize,
    /// After the steps, rank 0 reads `input`'s weight and the others `out`'s (a process
    /// that logs a parameter the others do not read).
    #[serde(default)]
    read_different_parameters: bool,
}

fn uneven_worker(args: &UnevenRun) -> HandLoopReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    B::seed(&device, 11);
    let mut model = Uneven::<B> {
        input: LinearConfig::new(FEATURES, 16).init(&device),
        shared: LinearConfig::new(16, 16).init(&device),
        unused: LinearConfig::new(16, 16).init(&device),
        out: LinearConfig::new(16, CLASSES).init(&device),
    };
    let mut accelerator = AccelerateConfig::new()
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap())
        .init::<B>(&device)
        .unwrap();
    let mut optim = burn::optim::AdamConfig::new().init();
    let (mut outcomes, mut held_after_step) = (Vec::new(), Vec::new());
    for step in 0..args.steps {
        let items: Vec<usize> = (0..4)
            .map(|i| step * 16 + state.process_index() * 4 + i)
            .collect();
        let batch: Batch<B> = Samples.batch(items, &device);
        let relu = Relu::new();
        let h = relu.forward(model.input.forward(batch.x));
        let h = relu.forward(model.shared.forward(h));
        let h = relu.forward(model.shared.forward(h));
        let logits = model.out.forward(h);
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, batch.y);
        accelerator.backward(loss, &model);
        let (next, outcome) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        model = next;
        outcomes.push(format!("{outcome:?}"));
        held_after_step.push(held_parameters(&model));
    }
    if args.read_different_parameters {
        let _ = if state.process_index() == 0 {
            model.input.weight.val().sum()
        } else {
            model.out.weight.val().sum()
        };
    }
    HandLoopReport {
        parameters: parameters(&model),
        outcomes,
        loss_scale: accelerator.loss_scale().loss_scale(),
        held_after_step,
    }
}

#[test]
fn stage_3_gathers_a_layer_used_twice_once_and_an_unused_layer_where_gradients_are_read() {
    const TEST: &str =
        "stage_3_gathers_a_layer_used_twice_once_and_an_unused_layer_where_gradients_are_read";
    if let Some(args) = worker::<UnevenRun>() {
        return report(&uneven_worker(&args));
    }
    let run = |zero_stage: u8| -> Vec<HandLoopReport> {
        launch(
            TEST,
            2,
            &UnevenRun {
                zero_stage,
                steps: 4,
                read_different_parameters: false,
            },
            &[],
        )
        .assert_success()
        .reports(2)
    };
    let (stage0, stage3) = (run(0), run(3));
    for (rank, r) in stage3.iter().enumerate() {
        assert_eq!(r.outcomes, stage0[0].outcomes, "rank {rank}");
        assert!(
            r.held_after_step.iter().all(|&h| h == 0),
            "rank {rank}: {:?}",
            r.held_after_step
        );
        // Two processes: every mean is one rounding, as stage 0's. The unused layer has no
        // gradient at either stage: stage 3 gathers it from the slices unchanged.
        assert_eq!(
            bits(&r.parameters),
            bits(&stage0[0].parameters),
            "rank {rank}"
        );
    }
}

#[test]
fn stage_3_processes_that_read_different_parameters_fail_at_once_naming_both() {
    const TEST: &str = "stage_3_processes_that_read_different_parameters_fail_at_once_naming_both";
    if let Some(args) = worker::<UnevenRun>() {
        return report(&uneven_worker(&args));
    }
    let args = UnevenRun {
        zero_stage: 3,
        steps: 2,
        read_different_parameters: true,
    };
    // A timeout far below the default half hour: were the processes to wait on each other's
    // gathers instead of failing at once, the test would end with the timeout's error, which
    // does not name the parameters.
    let launched = launch(TEST, 2, &args, &["--timeout", "120"]);
    assert!(!launched.status.success(), "{}", launched.output());
    let output = launched.output();
    assert!(
        output.contains("it gathers parameter #6 while this process gathers #0")
            || output.contains("it gathers parameter #0 while this process gathers #6"),
        "{output}"
    );
}

/// Layers of unequal sizes, so that the bound (the largest layer's weight and bias) is below
/// what the model's gathered parameters would weigh together.
#[derive(Module, Debug)]
struct Layered<B: Backend> {
    layers: Vec<Linear<B>>,
}

const LAYERED_WIDTHS: [usize; 5] = [FEATURES, 48, 32, 24, CLASSES];

impl<B: Backend> Layered<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 13);
        Self {
            layers: LAYERED_WIDTHS
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
        }
    }

    fn forward<const D: usize>(&self, mut h: Tensor<B, D>) -> Tensor<B, D> {
        for layer in &self.layers {
            h = Relu::new().forward(layer.forward(h));
        }
        h
    }
}

/// `Layered`'s widths as bare matrices, each read by `h.matmul(weight)` (no bias): `[in, out]`
/// matrices on 2-D activations (`Mixed`), or `[1, in, out]` ones on 3-D activations
/// (`Broadcast`: Burn broadcasts the parameter over the batch).
#[derive(Module, Debug)]
struct Matrices<B: Backend, const D: usize> {
    weights: Vec<Param<Tensor<B, D>>>,
}

type Mixed<B> = Matrices<B, 2>;
type Broadcast<B> = Matrices<B, 3>;

impl<B: Backend, const D: usize> Matrices<B, D> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 13);
        let matrix = |w: &[usize]| {
            let mut shape = [1; D];
            shape[D - 2..].copy_from_slice(w);
            kaiming(shape, w[0], device)
        };
        Self {
            weights: LAYERED_WIDTHS.windows(2).map(matrix).collect(),
        }
    }

    fn forward(&self, mut h: Tensor<B, D>) -> Tensor<B, D> {
        for weight in &self.weights {
            h = Relu::new().forward(h.matmul(weight.val()));
        }
        h
    }
}

fn kaiming<B: Backend, const D: usize>(
    shape: [usize; D],
    fan_in: usize,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    burn::nn::Initializer::KaimingUniform {
        gain: 1.0,
        fan_out_only: false,
    }
    .init_with(shape, Some(fan_in), None, device)
}

/// `forward` of `x`'s rows read as two sequences (`[2, rows / 2, features]`), as a
/// transformer's layers read them, back to rows.
fn on_sequences<B: Backend>(
    x: Tensor<B, 2>,
    forward: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
) -> Tensor<B, 2> {
    let [rows, features] = x.dims();
    let y = forward(x.reshape([2, rows / 2, features]));
    let [_, _, outputs] = y.dims();
    y.reshape([rows, outputs])
}

/// The backend stage 2 / stage 3 comparisons train on, and its device.
type TrainingBackend = Accelerated<Autodiff<Flex>>;
type TrainingDevice = <TrainingBackend as burn_backend::BackendTypes>::Device;

/// How a worker of a stage 2 / stage 3 comparison trains (`observed_training`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Training {
    /// The ZeRO stage (DeepSpeed's number).
    zero_stage: u8,
    /// Under autocast in this precision; `None`: no autocast.
    precision: Option<Precision>,
    grad_accum: usize,
    /// How many batches each process trains on.
    batches: usize,
    /// The model goes through `Accelerator::prepare_model` first: at stage 3 it is sharded
    /// from the start, else whole on every process until the first window's step.
    prepare: bool,
}

impl Training {
    /// Stage 3 under `precision`'s autocast, `windows` windows of `grad_accum` batches, the
    /// model sharded from the start (`prepare_model`): every batch gathers.
    fn sharded(precision: Option<Precision>, grad_accum: usize, windows: usize) -> Self {
        Training {
            zero_stage: 3,
            precision,
            grad_accum,
            batches: windows * grad_accum,
            prepare: true,
        }
    }
}

/// What a worker of a stage 2 / stage 3 comparison reports (`observed_training`).
#[derive(Debug, Serialize, Deserialize)]
struct Stage3Report<O = ()> {
    parameters: Vec<f32>,
    outcomes: Vec<String>,
    loss_scale: f32,
    /// The training's fp8 state after the last step (JSON: every tensor's scale and amax
    /// history, bit for bit), under fp8.
    fp8_state: Option<String>,
    /// Per batch: the bytes sent during its forward and backward passes, the most gathered
    /// bytes whole at once then, and those still whole after its backward pass.
    sent: Vec<u64>,
    gathered_peak: Vec<u64>,
    gathered_after_backward: Vec<u64>,
    /// Per batch, per parameter in visiting order: whether the window's gradients hold one
    /// right after the backward pass.
    holds_gradient: Vec<Vec<bool>>,
    /// What the worker's own `Observer` saw.
    observed: O,
}

/// What a worker reads of its training besides `Stage3Report`'s observations: each hook runs
/// at its point of every batch of `observed_training` (of `model`, the model being trained).
trait Observer<M> {
    /// As the batch starts (after `accumulate`).
    fn at_start(&mut self, _batch: usize) {}
    /// Between the batch's forward pass and its backward: what it sends is not counted as
    /// the batch's, what it gathers is.
    fn before_backward(&mut self, _model: &M, _batch: usize) {}
    /// After the batch's backward pass and its observations, before its optimizer step.
    fn after_backward(&mut self, _model: &M, _batch: usize) {}
    /// After the batch's optimizer step.
    fn after_step(&mut self, _model: &M, _batch: usize) {}
    /// After the last batch and the fp8 state, before the parameters are read.
    fn at_end(&mut self, _model: &M) {}
}

impl<M> Observer<M> for () {}

/// Batch `batch` of process `process`: 4 items of `Samples`, each process its own.
fn samples<B: Backend>(
    batch: usize,
    process: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 1, Int>) {
    let items: Vec<usize> = (0..4).map(|i| batch * 16 + process * 4 + i).collect();
    let Batch { x, y } = Samples.batch(items, device);
    (x, y)
}

/// `training.batches` batches of `inputs` (of the batch and the process) through `forward`
/// and the cross-entropy loss with Adam, at ZeRO stage `training.zero_stage` (`config` for
/// the rest); per batch, what stage 3's checks read (the bytes sent, the gathered peak and
/// what is left after backward, which gradients the window holds) and what `observer` reads,
/// and at the end the parameters, the step outcomes, the loss scale and the fp8 state.
fn observed_training<B, M, X, O>(
    training: Training,
    config: AccelerateConfig,
    model: M,
    inputs: impl Fn(usize, usize, &B::Device) -> (X, Tensor<Accelerated<Autodiff<B>>, 1, Int>),
    forward: impl Fn(&M, X) -> Tensor<Accelerated<Autodiff<B>>, 2>,
    observer: O,
) -> Stage3Report<O>
where
    B: Backend,
    M: burn::module::AutodiffModule<Accelerated<Autodiff<B>>>,
    O: Observer<M>,
{
    use burn_accelerate::zero::{ZeroStage, gathered_bytes, reset_gathered_peak, sent_bytes};
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut config = config
        .with_gradient_accumulation_steps(training.grad_accum)
        .with_zero_stage(ZeroStage::from_number(training.zero_stage).unwrap());
    if let Some(precision) = training.precision {
        config = config.with_mixed_precision(precision);
    }
    let mut accelerator = config.init::<Accelerated<Autodiff<B>>>(&device).unwrap();
    let mut model = match training.prepare {
        true => accelerator.prepare_model(model),
        false => model,
    };
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = Stage3Report {
        parameters: Vec::new(),
        outcomes: Vec::new(),
        loss_scale: 0.0,
        fp8_state: None,
        sent: Vec::new(),
        gathered_peak: Vec::new(),
        gathered_after_backward: Vec::new(),
        holds_gradient: Vec::new(),
        observed: observer,
    };
    for batch in 0..training.batches {
        let (x, y) = inputs(batch, state.process_index(), &device);
        let _step = accelerator.accumulate(&model);
        report.observed.at_start(batch);
        reset_gathered_peak();
        let before = sent_bytes();
        let loss = {
            let _autocast = training.precision.map(|_| accelerator.autocast());
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(forward(&model, x), y)
        };
        let observing = sent_bytes();
        report.observed.before_backward(&model, batch);
        let observed = sent_bytes() - observing;
        accelerator.backward(loss, &model);
        report.sent.push(sent_bytes() - before - observed);
        let bytes = gathered_bytes();
        report.gathered_peak.push(bytes.peak);
        report.gathered_after_backward.push(bytes.alive);
        let holds = holds_gradient(&model, accelerator.gradients());
        report.holds_gradient.push(holds);
        report.observed.after_backward(&model, batch);
        let (next, outcome) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        report.outcomes.push(format!("{outcome:?}"));
        model = next;
        report.observed.after_step(&model, batch);
    }
    if matches!(training.precision, Some(Precision::Fp8(_))) {
        // The training's own state (its context's), which its steps advanced.
        let _autocast = accelerator.autocast();
        report.fp8_state = Some(serde_json::to_string(&burn_accelerate::fp8::state()).unwrap());
    }
    report.observed.at_end(&model);
    report.parameters = parameters(&model);
    report.loss_scale = accelerator.loss_scale().loss_scale();
    report
}

/// Which of `layered_worker`'s models trains, and how it reads its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Reads {
    /// `Layered`: a `Linear` per layer (weight and bias) on 2-D activations.
    Linear,
    /// `Layered` on 3-D activations (`on_sequences`), as a transformer's linear layers.
    LinearOnSequences,
    /// `Mixed`: `h.matmul(weight)` on 2-D activations.
    Matmul,
    /// `Broadcast` on 3-D activations (`on_sequences`).
    Broadcast,
}

impl Reads {
    /// The model's parameters, gathered `width` bytes a value: every weight gathered again
    /// in backward but the first layer's, whose input (the data) needs no gradient.
    fn layers(self, width: u64) -> Vec<Vec<Gathered>> {
        let bias = matches!(self, Reads::Linear | Reads::LinearOnSequences);
        LAYERED_WIDTHS
            .windows(2)
            .enumerate()
            .map(|(i, w)| match bias {
                true => weight_and_bias(w[0] * w[1], w[1], width, i > 0),
                false => vec![(w[0] * w[1], width, i > 0)],
            })
            .collect()
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct LayeredRun {
    training: Training,
    reads: Reads,
}

/// The parameters of `Module::valid`'s copy (each read through `inner`), after the steps.
#[derive(Debug, Default, Serialize, Deserialize)]
struct ValidParameters(Vec<f32>);

impl<M: burn::module::AutodiffModule<TrainingBackend>> Observer<M> for ValidParameters {
    fn at_end(&mut self, model: &M) {
        self.0 = parameters(&model.valid());
    }
}

/// `Layered`, `Mixed` or `Broadcast` (`args.reads`) on `Samples`, every op autocast lowers
/// cast (the net is tiny: `SmallOps::Cast`).
fn layered_worker(args: &LayeredRun) -> Stage3Report<ValidParameters> {
    fn train<M: burn::module::AutodiffModule<TrainingBackend>>(
        training: Training,
        model: M,
        forward: impl Fn(&M, Tensor<TrainingBackend, 2>) -> Tensor<TrainingBackend, 2>,
    ) -> Stage3Report<ValidParameters> {
        let config =
            AccelerateConfig::new().with_small_ops(Some(burn_accelerate::autocast::SmallOps::Cast));
        observed_training(
            training,
            config,
            model,
            samples,
            forward,
            ValidParameters::default(),
        )
    }
    let device = Default::default();
    let training = args.training;
    match args.reads {
        Reads::Linear => train(training, Layered::new(&device), |model, x| model.forward(x)),
        Reads::LinearOnSequences => train(training, Layered::new(&device), |model, x| {
            on_sequences(x, |x| model.forward(x))
        }),
        Reads::Matmul => train(training, Mixed::new(&device), |model, x| model.forward(x)),
        Reads::Broadcast => train(training, Broadcast::new(&device), |model, x| {
            on_sequences(x, |x| model.forward(x))
        }),
    }
}

/// `stage_3_against_stage_2` of `layered_worker`'s model read as `reads`, one layer's
/// gathered parameters whole at a time, in halves under bf16 and f16 autocast (every layer is
/// cast) and in f32 otherwise (fp8 rounds f32 where the op reads it); and at the end the copy
/// for evaluation holds the whole parameters, not placeholders.
fn layered_against_stage_2(test: &str, processes: usize, training: Training, reads: Reads) {
    let width = match training.precision {
        Some(Precision::Bf16 | Precision::F16) => 2,
        _ => 4,
    };
    let expected = Stage3Expected::new(reads.layers(width), processes);
    let args = |training| LayeredRun { training, reads };
    let (_, stage3) = stage_3_against_stage_2(
        test,
        &expected,
        training,
        (Peak::OneLayer, Agreement::Bits),
        args,
    );
    for (rank, r) in stage3.iter().enumerate() {
        let ValidParameters(valid) = &r.observed;
        let what = format!("{processes} processes, {reads:?}, {training:?}, rank {rank}");
        assert_eq!(bits(valid), bits(&r.parameters), "{what}");
    }
}

/// `layered_against_stage_2` of `(processes, precision, window, reads)` under autocast, 4
/// windows, sharded from the start.
fn autocast_layered_against_stage_2(
    test: &str,
    (processes, precision, grad_accum, reads): (usize, Precision, usize, Reads),
) {
    let training = Training::sharded(Some(precision), grad_accum, 4);
    layered_against_stage_2(test, processes, training, reads);
}

/// The model is built whole on every process; from the first step on, each process holds a
/// slice of every parameter and gathers each per use: something is gathered, never more than the
/// largest layer's weight and bias at once (its forward op, or its input gradient's backward
/// op), and nothing is left whole once the backward pass is over.
#[test]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_and_ends_where_stage_2_does() {
    const TEST: &str =
        "stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_and_ends_where_stage_2_does";
    if let Some(args) = worker::<LayeredRun>() {
        return report(&layered_worker(&args));
    }
    for processes in [2, 3] {
        for grad_accum in [1, 2] {
            let training = Training {
                zero_stage: 3,
                precision: None,
                grad_accum,
                batches: 6,
                prepare: false,
            };
            layered_against_stage_2(TEST, processes, training, Reads::Linear);
        }
    }
}

/// Under bf16 and f16 autocast (FSDP's `param_dtype`), a linear layer gathers its weight and
/// bias in the half type the op runs in (as does a `matmul` of a parameter, in a second
/// model of bare matrices; and a linear layer of a 3-D input, through its matrix of rows):
/// each process casts its f32 slice and sends halves, for the forward op and again (the
/// weight) for the input's gradient; the gradients, cast back to f32, are reduce-scattered in
/// f32. Stage 3 ends where stage 2 does under the same autocast (bit for bit on 2 processes,
/// to rounding on 3; f16 with the loss scaler: the same outcomes and scale), at most one
/// layer's halves are whole at a time, and each batch sends what the formula says: stage 3's f32
/// formula (`stage_3_reduce_scatters_each_gradient_in_backward_and_sends_what_the_formula_says`)
/// with two bytes a value for the gathers.
#[test]
fn stage_3_under_autocast_gathers_linear_and_matmul_parameters_in_the_half_type_like_stage_2() {
    const TEST: &str =
        "stage_3_under_autocast_gathers_linear_and_matmul_parameters_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<LayeredRun>() {
        return report(&layered_worker(&args));
    }
    for case in [
        (2, Precision::Bf16, 2, Reads::Linear),
        (3, Precision::Bf16, 1, Reads::Linear),
        (2, Precision::F16, 1, Reads::Linear),
        (3, Precision::F16, 2, Reads::Linear),
        (2, Precision::Bf16, 1, Reads::Matmul),
        (3, Precision::F16, 2, Reads::Matmul),
        (2, Precision::Bf16, 2, Reads::LinearOnSequences),
    ] {
        autocast_layered_against_stage_2(TEST, case);
    }
}

/// Stage 3's traffic and gradients, in f32 (the gather dtype without autocast), on the
/// built-in engine's ring of `n` processes, each holding a slice of every parameter
/// (`zero::slice_len` values, padded). Each use of a parameter is a ring all-gather of the
/// slices, in which every process sends `n - 1` slices; each gradient's reduction is a ring
/// reduce-scatter of the padded gradient, in which every process sends `n - 1` slices too.
/// Before each, the processes agree on the parameter: two all-gathers of one `u64` each (the
/// counts, then the places), `n - 1` blocks passed on by every process. A step gathers every
/// parameter in forward, every weight again in backward but the first layer's (its input is
/// the data: no input gradient), and reduce-scatters every gradient once: per process about
/// `(n - 1) / n` times (every parameter twice and the weights above the first once more),
/// against stage 0's all-reduce, `2 (n - 1) / n` times the parameters (FSDP: 3 against DDP's
/// 2). Every process keeps its slice of every gradient.
#[test]
fn stage_3_reduce_scatters_each_gradient_in_backward_and_sends_what_the_formula_says() {
    const TEST: &str =
        "stage_3_reduce_scatters_each_gradient_in_backward_and_sends_what_the_formula_says";
    if let Some(args) = worker::<LayeredRun>() {
        return report(&layered_worker(&args));
    }
    for processes in [2, 3] {
        let expected = Stage3Expected::new(Reads::Linear.layers(4), processes);
        for grad_accum in [1, 2] {
            let training = |prepare: bool| Training {
                zero_stage: 3,
                precision: None,
                grad_accum,
                batches: 4 * grad_accum,
                prepare,
            };
            let run = |prepare: bool| -> Vec<Stage3Report<ValidParameters>> {
                let args = LayeredRun {
                    training: training(prepare),
                    reads: Reads::Linear,
                };
                launch(TEST, processes, &args, &[])
                    .assert_success()
                    .reports(processes)
            };
            let (reports, prepared) = (run(false), run(true));
            for (rank, r) in reports.iter().chain(&prepared).enumerate() {
                let prepare = rank >= processes;
                let rank = rank % processes;
                let what = format!(
                    "{processes} processes, window {grad_accum}, prepared {prepare}, rank {rank}"
                );
                // A prepared model is sharded from the start, and trains as the other: its
                // lazy parameters are initialised in the order a first forward pass would.
                assert_eq!(bits(&r.parameters), bits(&reports[0].parameters), "{what}");
                // The first window of a model built whole sends nothing; from then on each
                // gradient is reduce-scattered during the backward pass of a window's last
                // batch (this process holds its slice of every one), and the
                // window's earlier batches gather but reduce nothing (`no_sync`).
                expected.check(r, &training(prepare), Peak::OneLayer, &what);
            }
        }
    }
}

/// An embedding, a parameter read by `matmul`, and a linear head: at stage 3 each op gathers
/// its parameter for itself alone.
#[derive(Module, Debug)]
struct Lookup<B: Backend> {
    embedding: burn::nn::Embedding<B>,
    mix: Param<Tensor<B, 2>>,
    head: Linear<B>,
}

const VOCABULARY: usize = 24;
const LOOKUP_WIDTH: usize = 16;

impl<B: Backend> Lookup<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 17);
        Self {
            embedding: burn::nn::EmbeddingConfig::new(VOCABULARY, LOOKUP_WIDTH).init(device),
            mix: kaiming([LOOKUP_WIDTH, LOOKUP_WIDTH], LOOKUP_WIDTH, device),
            head: LinearConfig::new(LOOKUP_WIDTH, CLASSES).init(device),
        }
    }

    fn logits(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 2> {
        let [sequences, _] = tokens.dims();
        let h = self
            .embedding
            .forward(tokens)
            .mean_dim(1)
            .reshape([sequences, LOOKUP_WIDTH]);
        let h = Relu::new().forward(h.matmul(self.mix.val()));
        self.head.forward(h)
    }
}

/// Batch `batch` of process `process`: four sequences of three tokens, each process its own,
/// each labelled by its first token.
fn tokens(
    batch: usize,
    process: usize,
    device: &TrainingDevice,
) -> (
    Tensor<TrainingBackend, 2, Int>,
    Tensor<TrainingBackend, 1, Int>,
) {
    let tokens: Vec<i64> = (0..12)
        .map(|i| ((batch * 29 + process * 13 + i * 7) % VOCABULARY) as i64)
        .collect();
    let labels: Vec<i64> = tokens.chunks(3).map(|t| t[0] % CLASSES as i64).collect();
    (
        Tensor::from_data(TensorData::new(tokens, [4, 3]), device),
        Tensor::from_data(TensorData::new(labels, [4]), device),
    )
}

fn lookup_worker(training: Training) -> Stage3Report {
    let model = Lookup::new(&Default::default());
    let config = AccelerateConfig::new();
    observed_training(training, config, model, tokens, Lookup::logits, ())
}

/// Prepared, so that every batch gathers: at most one parameter whole at a time (the largest,
/// the embedding's table; without the bounded paths the gathered embedding and `mix` stay
/// whole until the step: their sum, and more), nothing left whole once the backward pass is
/// over, each batch sending stage 3's f32 formula (the embedding's backward needs only the
/// table's shape: gathered once; `mix` again for its input's gradient), and stage 2's bits.
#[test]
fn stage_3_gathers_an_embedding_and_a_matmul_parameter_for_their_ops_alone() {
    const TEST: &str = "stage_3_gathers_an_embedding_and_a_matmul_parameter_for_their_ops_alone";
    if let Some(training) = worker::<Training>() {
        return report(&lookup_worker(training));
    }
    let layers = vec![
        vec![(VOCABULARY * LOOKUP_WIDTH, 4, false)],
        vec![(LOOKUP_WIDTH * LOOKUP_WIDTH, 4, true)],
        weight_and_bias(LOOKUP_WIDTH * CLASSES, CLASSES, 4, true),
    ];
    for processes in [2, 3] {
        let expected = Stage3Expected::new(layers.clone(), processes);
        let training = Training::sharded(None, 1, 4);
        stage_3_against_stage_2::<_, ()>(
            TEST,
            &expected,
            training,
            (Peak::OneLayer, Agreement::Bits),
            |t| t,
        );
    }
}

impl HandLoop {
    /// `epochs` epochs of Adam (whose state is per parameter, so that each process of stages 1
    /// to 3 holds part of it) in f32 at `zero_stage`, `batch_size` items a batch per process:
    /// no overflow, clipping or checkpoint.
    fn adam(batch_size: usize, zero_stage: u8, epochs: usize) -> Self {
        HandLoop {
            batch_size,
            grad_accum: 1,
            epochs,
            precision: Precision::F32,
            overflow_rank: None,
            overflow_batch: 0,
            zero_stage,
            adam: true,
            clip_norm: None,
            save_to: None,
            resume_from: None,
            sharded_checkpoint: false,
        }
    }
}

/// How many parameters' Adam state the consolidated checkpoint 1 of a `Net` in `dir` holds, as
/// Burn loads it by itself.
fn saved_adam_states(dir: &std::path::Path) -> usize {
    use burn::optim::Optimizer;
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    fn load<O: Optimizer<Net<Autodiff<Flex>>, Autodiff<Flex>>>(_: O, bytes: Vec<u8>) -> O::Record {
        Recorder::<Autodiff<Flex>>::load(
            &NamedMpkBytesRecorder::<FullPrecisionSettings>::new(),
            bytes,
            &Default::default(),
        )
        .unwrap()
    }
    let checkpoint = burn_accelerate::checkpoint::CheckpointDir::new(dir)
        .load(1)
        .unwrap();
    let state = load(
        burn::optim::AdamConfig::new().init(),
        checkpoint.files["optimizer-1.mpk"].clone(),
    );
    state.len()
}

/// The `Net` in a checkpoint's model file, as Burn loads it by itself on a backend without
/// autodiff or this crate's decorator.
fn saved_net(bytes: Vec<u8>) -> Net<Flex> {
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    let record: NetRecord<Flex> = Recorder::<Flex>::load(
        &NamedMpkBytesRecorder::<FullPrecisionSettings>::new(),
        bytes,
        &Default::default(),
    )
    .unwrap();
    Net::<Flex>::new(&Default::default()).load_record(record)
}

#[test]
fn a_sharded_optimizer_state_resumes_on_any_number_of_processes_at_any_stage() {
    const TEST: &str = "a_sharded_optimizer_state_resumes_on_any_number_of_processes_at_any_stage";
    if let Some(run) = worker::<FromCopy<HandLoop>>() {
        return report(&run.train());
    }
    // Saved at stage 2, where each process holds part of Adam's state.
    let checkpoint = HandCheckpoint::new(TEST, false, 2);
    let dir = harness::scratch_dir("sharded-optimizer-state");
    checkpoint.save(2, &dir);
    // The checkpoint holds the state of every parameter: the consolidated one.
    assert_eq!(saved_adam_states(&dir), 4, "two weights and two biases");
    // The same processes and stage: bit for bit.
    let same = checkpoint.resume(2, 2, &dir);
    checkpoint.assert_bit_for_bit(&same, "2 processes at stage 2");
    // Re-partitioned over other numbers of processes, and at other stages: the same training
    // to rounding (sums in another order). Stage 3 starts from the whole loaded model and
    // releases it after its first step.
    for (processes, zero_stage) in [(3, 1), (4, 2), (1, 0), (2, 0), (3, 3)] {
        let resumed = checkpoint.resume(processes, zero_stage, &dir);
        let what = format!("{processes} processes at stage {zero_stage}");
        checkpoint.assert_to_rounding(&resumed, zero_stage, &what);
    }
    // Without its optimizer state the resumed run would differ: the check can fail.
    let fresh = checkpoint.train(2, checkpoint.args(2, 2, 1));
    let whole = &checkpoint.whole[0].parameters;
    assert!(max_relative_difference(&fresh[0].parameters, whole) > 1e-3);
    harness::clean(&dir);
}

#[test]
fn a_stage_3_checkpoint_resumes_on_other_process_counts_and_stages() {
    const TEST: &str = "a_stage_3_checkpoint_resumes_on_other_process_counts_and_stages";
    if let Some(run) = worker::<FromCopy<HandLoop>>() {
        return report(&run.train());
    }
    // Stage 3 on 2 processes, where each process holds half of the parameters and of the
    // optimizer state between steps.
    let checkpoint = HandCheckpoint::new(TEST, false, 3);
    let dir = harness::scratch_dir("stage-3-checkpoint");
    let saved = checkpoint.save(3, &dir);
    // Parameters stay released on both processes (the save gathered clones).
    assert!(
        saved
            .iter()
            .all(|r| r.held_after_step.iter().all(|&h| h == 0))
    );
    // The checkpoint is a whole model Burn loads by itself: the parameters the run ended with,
    // bit for bit; and the whole optimizer state.
    let listed = burn_accelerate::checkpoint::CheckpointDir::new(&dir)
        .load(1)
        .unwrap();
    let loaded = saved_net(listed.files["model-1.mpk"].clone());
    assert_eq!(bits(&parameters(&loaded)), bits(&saved[0].parameters));
    assert_eq!(saved_adam_states(&dir), 4, "two weights and two biases");
    // The same processes and stage, and stage 2 on them (on two processes every mean is one
    // rounding, whatever the order): bit for bit.
    for zero_stage in [3, 2] {
        let same = checkpoint.resume(2, zero_stage, &dir);
        checkpoint.assert_bit_for_bit(&same, &format!("stage {zero_stage}"));
    }
    // Another number of processes, at stage 0 and at stage 3: the same training to rounding
    // (the mean over other parts sums in another order), as the stage-2 checkpoint's resumes.
    for (processes, zero_stage) in [(1, 0), (3, 3)] {
        let resumed = checkpoint.resume(processes, zero_stage, &dir);
        let what = format!("{processes} processes at stage {zero_stage}");
        checkpoint.assert_to_rounding(&resumed, zero_stage, &what);
    }
    harness::clean(&dir);
}

#[test]
fn a_sharded_stage_3_checkpoint_resumes_on_other_process_counts_and_stages() {
    const TEST: &str = "a_sharded_stage_3_checkpoint_resumes_on_other_process_counts_and_stages";
    use burn_accelerate::checkpoint::{CheckpointDir, FileDigest, Manifest};
    if let Some(run) = worker::<FromCopy<HandLoop>>() {
        return report(&run.train());
    }
    // As the consolidated stage 3 checkpoint's test above; the checkpoint written sharded.
    let checkpoint = HandCheckpoint::new(TEST, true, 3);
    let dir = harness::scratch_dir("sharded-stage-3-checkpoint");
    let saved = checkpoint.save(3, &dir);
    let listed = CheckpointDir::new(&dir).load(1).unwrap();
    assert_eq!(
        listed.files.keys().collect::<Vec<_>>(),
        [
            "accelerator-1.json",
            "loader.json",
            "model-1.shard-0-of-2.mpk",
            "model-1.shard-1-of-2.mpk",
            "optimizer-1.shard-0-of-2.mpk",
            "optimizer-1.shard-1-of-2.mpk"
        ]
    );
    // Each process's model file holds its partition alone (Burn reads it by itself: the
    // others' parameters have no elements), and the two hold every parameter between them,
    // the values the run ended with.
    let mut merged = vec![Vec::new(); 4];
    for rank in 0..2 {
        let net = saved_net(listed.files[&format!("model-1.shard-{rank}-of-2.mpk")].clone());
        let held = [
            net.hidden.weight.val().into_data(),
            net.hidden.bias.as_ref().unwrap().val().into_data(),
            net.out.weight.val().into_data(),
            net.out.bias.as_ref().unwrap().val().into_data(),
        ];
        let own = held.iter().filter(|d| d.num_elements() > 0).count();
        assert!((1..4).contains(&own), "rank {rank} holds {own} of 4");
        for (slot, data) in merged.iter_mut().zip(held) {
            slot.extend(data.to_vec::<f32>().unwrap());
        }
    }
    assert_eq!(bits(&merged.concat()), bits(&saved[0].parameters));
    // The same processes and stage: each process reads its own files alone, bit for bit.
    let same = checkpoint.resume(2, 3, &dir);
    checkpoint.assert_bit_for_bit(&same, "2 processes at stage 3");
    // Another number of processes, at stage 0 and at stage 3: re-partitioned from both files,
    // the same training to rounding, as the consolidated checkpoint's resumes.
    for (processes, zero_stage) in [(1, 0), (3, 3)] {
        let resumed = checkpoint.resume(processes, zero_stage, &dir);
        let what = format!("{processes} processes at stage {zero_stage}");
        checkpoint.assert_to_rounding(&resumed, zero_stage, &what);
    }

    // Saved sharded at stage 2 (every process holds the whole model, and writes its own
    // partition's part), resumed at stage 2 and at stage 3 on 2 processes: on two processes
    // every mean is one rounding, whatever the order, so both end where the uninterrupted run
    // does, bit for bit.
    let stage_2 = harness::scratch_dir("sharded-stage-2-checkpoint");
    checkpoint.save(2, &stage_2);
    for zero_stage in [2, 3] {
        let resumed = checkpoint.resume(2, zero_stage, &stage_2);
        let what = format!("saved at stage 2, resumed at stage {zero_stage}");
        checkpoint.assert_bit_for_bit(&resumed, &what);
    }
    harness::clean(&stage_2);

    // A newer checkpoint 2 (checkpoint 1's files under its names) with one process's file
    // damaged, then one whose entry lacks a process's file: each is passed over for checkpoint
    // 1 (the worker asserts it resumes from 1), never loaded in part.
    let manifest = Manifest::read(&dir).unwrap();
    let entry = manifest.entry(1).unwrap().clone();
    let mut second = entry.clone();
    second.epoch = 2;
    second.files = entry
        .files
        .iter()
        .map(|file| {
            let name = file.name.replace("-1.", "-2.");
            let bytes = std::fs::read(dir.join(&file.name)).unwrap();
            std::fs::write(dir.join(&name), &bytes).unwrap();
            FileDigest::of(name, &bytes)
        })
        .collect();
    let damaged = dir.join("model-2.shard-1-of-2.mpk");
    let good = std::fs::read(&damaged).unwrap();
    let mut lacking = second.clone();
    lacking
        .files
        .retain(|file| file.name != "optimizer-2.shard-1-of-2.mpk");
    for (what, listed) in [("damaged", second), ("lacking a file", lacking)] {
        manifest.clone().with(listed).write(&dir).unwrap();
        let mut bytes = good.clone();
        if what == "damaged" {
            let last = bytes.len() - 1;
            bytes[last] ^= 0xff;
        }
        std::fs::write(&damaged, &bytes).unwrap();
        checkpoint.assert_bit_for_bit(&checkpoint.resume(2, 3, &dir), what);
    }

    // A process that cannot write its part: the checkpoint is not listed, and every process
    // fails with the same error.
    let save_to = |dir: &std::path::Path| HandLoop {
        save_to: Some(dir.to_path_buf()),
        ..checkpoint.args(2, 3, 1)
    };
    let blocked = harness::scratch_dir("sharded-stage-3-blocked");
    std::fs::create_dir_all(blocked.join("model-1.shard-1-of-2.mpk")).unwrap();
    let failed = checkpoint.launched(2, save_to(&blocked));
    assert!(!failed.status.success(), "{}", failed.output());
    assert!(
        failed
            .output()
            .contains("not listed, as a process could not write its part (process 1:"),
        "{}",
        failed.output()
    );
    assert_eq!(
        CheckpointDir::new(&blocked).load_newest(None).unwrap(),
        None
    );
    harness::clean(&blocked);

    // A process killed halfway through writing its part (the test hook): the run fails, and
    // the checkpoint is not listed (the main process never heard that the part was written).
    let crashed = harness::scratch_dir("sharded-stage-3-crashed");
    let (mut command, reports) = checkpoint.command(2, save_to(&crashed), false);
    command.env(
        burn_accelerate::checkpoint::CRASH_WRITING,
        "0:model-1.shard-1-of-2.mpk",
    );
    let failed = harness::run(command, reports);
    assert!(!failed.status.success(), "{}", failed.output());
    assert!(
        crashed.join("model-1.shard-1-of-2.mpk.partial").exists(),
        "the hook struck: {}",
        failed.output()
    );
    assert_eq!(
        CheckpointDir::new(&crashed).load_newest(None).unwrap(),
        None
    );
    harness::clean(&crashed);
    harness::clean(&dir);
}

/// What `consolidate_model_record` gave at stage 3: the record's parameters on the main
/// process, how many of the model's parameters held a value after it, and the model's
/// parameters read whole after it; and the most bytes of other processes' parameters this
/// process held at once during it (the decorator's count), and the bytes it sent during it
/// over the built-in engine's collectives (`zero::sent_bytes`).
#[derive(Debug, Serialize, Deserialize)]
struct GatheredRecord {
    record: Option<Vec<f32>>,
    held_after: usize,
    parameters: Vec<f32>,
    gathered_during: u64,
    collective_bytes_during: u64,
}

// Two stage 3 steps of `Net`, whose first weight doubles on save (a Burn save mapper), then
// the model's record gathered on the main process.
fn gathered_record_worker<B: AutodiffBackend>() -> GatheredRecord {
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = Net::<B>::new(&device);
    model.hidden.weight = model.hidden.weight.save_mapper(|w| w * 2);
    let mut accelerator = AccelerateConfig::new()
        .with_zero_stage(burn_accelerate::zero::ZeroStage::Parameters)
        .init::<B>(&device)
        .unwrap();
    let mut optim = burn::optim::AdamConfig::new().init();
    for step in 0..2 {
        let items: Vec<usize> = (0..4)
            .map(|i| step * 16 + state.process_index() * 4 + i)
            .collect();
        let _step = accelerator.accumulate(&model);
        let loss = model.loss(Samples.batch(items, &device));
        accelerator.backward(loss, &model);
        let (next, _) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        model = next;
    }
    burn_accelerate::zero::reset_gathered_peak();
    let sent_before = burn_accelerate::zero::sent_bytes();
    let record = accelerator.consolidate_model_record(&model).unwrap();
    let collective_bytes_during = burn_accelerate::zero::sent_bytes() - sent_before;
    let gathered_during = burn_accelerate::zero::gathered_bytes().peak;
    let held_after = held_parameters(&model);
    let record = record.map(|record| parameters(&Net::<B>::new(&device).load_record(record)));
    GatheredRecord {
        record,
        held_after,
        parameters: parameters(&model),
        gathered_during,
        collective_bytes_during,
    }
}

#[test]
fn a_stage_3_model_record_is_gathered_on_the_main_process_with_its_save_mappers() {
    const TEST: &str =
        "a_stage_3_model_record_is_gathered_on_the_main_process_with_its_save_mappers";
    #[derive(Debug, Serialize, Deserialize)]
    struct Run {
        decorator: bool,
    }
    if let Some(run) = worker::<Run>() {
        return report(&if run.decorator {
            gathered_record_worker::<Accelerated<Autodiff<Flex>>>()
        } else {
            gathered_record_worker::<Autodiff<Flex>>()
        });
    }
    // The decorator reads each released parameter through a placeholder; Burn's autodiff
    // backend alone gathers it at its first read.
    for decorator in [true, false] {
        let reports: Vec<GatheredRecord> = launch(TEST, 3, &Run { decorator }, &[])
            .assert_success()
            .reports(3);
        let whole = &reports[0].parameters;
        // The first parameter is hidden's weight, FEATURES x 16 values, doubled on save.
        let weight = FEATURES * 16;
        let mut expected: Vec<f32> = whole[..weight].iter().map(|w| w * 2.0).collect();
        expected.extend_from_slice(&whole[weight..]);
        let record = reports[0]
            .record
            .as_ref()
            .expect("the main process's record");
        assert_eq!(bits(record), bits(&expected), "decorator {decorator}");
        for (rank, r) in reports.iter().enumerate() {
            let what = format!("decorator {decorator}, rank {rank}");
            assert_eq!(r.record.is_some(), rank == 0, "{what}");
            // The gathering read clones: the model's parameters stay released.
            assert_eq!(r.held_after, 0, "{what}");
            // Each process sends its slices to the main process alone, not through the
            // placeholders' gather (an all-gather, which every process would count, holding
            // each parameter whole).
            assert_eq!(r.gathered_during, 0, "{what}");
            // Point to point, on a stream of its own: no collective carries a parameter (an
            // all-gather sends every slice around the ring; the counter counts the ring's bytes,
            // not a stream's).
            assert_eq!(r.collective_bytes_during, 0, "{what}");
            assert_eq!(bits(&r.parameters), bits(whole), "{what}");
        }
    }
}

#[test]
fn stage_3_pads_a_parameter_smaller_than_the_process_count_on_every_process() {
    const TEST: &str = "stage_3_pads_a_parameter_smaller_than_the_process_count_on_every_process";
    if let Some(args) = worker::<HandLoop>() {
        return report(&hand_loop::<Accelerated<Autodiff<Flex>>>(&args));
    }
    // Net's four parameters (128, 64, 16 and 4 values) over 5 processes: every parameter is
    // sliced in five and padded (the 4-value bias to one value a process), and process 4
    // holds padding only of the 16- and 4-value ones: every process gathers every parameter
    // at its use and steps its slices, padding included.
    let run = |zero_stage: u8| -> Vec<HandLoopReport> {
        launch(TEST, 5, &HandLoop::adam(2, zero_stage, 1), &[])
            .assert_success()
            .reports(5)
    };
    let (stage0, stage2, stage3) = (run(0), run(2), run(3));
    for (rank, r) in stage3.iter().enumerate() {
        assert_eq!(r.outcomes, stage2[rank].outcomes, "rank {rank}");
        assert!(r.held_after_step.iter().all(|&h| h == 0), "rank {rank}");
        // Five processes: each slice summed in its own block's order.
        assert_like_stage_2(
            &r.parameters,
            &stage2[rank].parameters,
            false,
            &format!("rank {rank}"),
        );
        // Stage 0's all-reduce sums five values in another order: to rounding.
        let d = max_relative_difference(&r.parameters, &stage0[0].parameters);
        assert!(d < 1e-5, "rank {rank}: {d:e}");
    }
}

// Rank 1's hidden layer is one unit wider than the others': the processes' models differ.
fn mismatched_worker(zero_stage: u8) {
    let state = ProcessState::from_env().unwrap();
    type B = Accelerated<Autodiff<Flex>>;
    let device = Default::default();
    let width = 16 + state.process_index();
    let mut model = Net::<B> {
        hidden: LinearConfig::new(FEATURES, width).init(&device),
        out: LinearConfig::new(width, CLASSES).init(&device),
        relu: Relu::new(),
    };
    let mut accelerator = AccelerateConfig::new()
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(zero_stage).unwrap())
        .init::<B>(&device)
        .unwrap();
    let mut optim = burn::optim::AdamConfig::new().init();
    for step in 0..2 {
        let items: Vec<usize> = (0..4)
            .map(|i| step * 8 + state.process_index() * 4 + i)
            .collect();
        let _step = accelerator.accumulate(&model);
        let loss = model.loss(Samples.batch(items, &device));
        accelerator.backward(loss, &model);
        match accelerator.optimizer_step(&mut optim, model, &mut 0.01) {
            Ok((next, _)) => model = next,
            Err(err) => panic!("the step failed: {err}"),
        }
    }
}

#[test]
fn processes_whose_models_differ_fail_at_the_first_step_naming_the_difference() {
    const TEST: &str = "processes_whose_models_differ_fail_at_the_first_step_naming_the_difference";
    if let Some(zero_stage) = worker::<u8>() {
        mismatched_worker(zero_stage);
        return report(&());
    }
    // Where each process keeps its part of the gradients (stages 2 and 3): before the first
    // reduce-scatter, by name, on every process.
    for zero_stage in [2, 3] {
        let launched = launch(TEST, 2, &zero_stage, &[]);
        assert!(
            !launched.status.success(),
            "stage {zero_stage}: {}",
            launched.output()
        );
        let output = launched.output();
        for said in [
            // Each process's own line (the launcher prefixes it with its rank; mpirun does not).
            "the step failed: process 1's model differs from this process's: its model's \
             parameter #0 (in visiting order) has shape [8, 17] where this process's has \
             [8, 16]. Every process must build the same model",
            "the step failed: process 0's model differs from this process's: its model's \
             parameter #0 (in visiting order) has shape [8, 16] where this process's has \
             [8, 17]",
        ] {
            assert!(
                output.contains(said),
                "stage {zero_stage}, {said}:\n{output}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Burn's SupervisedTraining with `with_accelerate`.

mod supervised {
    use std::sync::Arc;

    use crate::mlp::{BlobBatch, BlobBatcher, Mlp, MlpComponents, QuietRenderer, Sample, blobs};
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::optim::AdamConfig;
    use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
    use burn::train::metric::LossMetric;
    use burn::train::metric::store::EventStoreClient;
    use burn::train::{EarlyStoppingStrategy, Learner, SupervisedTraining};
    use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
    use burn_accelerate::zero::ZeroStage;

    use super::*;

    type Train = Accelerated<Autodiff<Flex>>;
    type Components = MlpComponents<Train>;

    #[derive(Debug, Clone, Default, Serialize, Deserialize)]
    pub struct Run {
        pub batch_size: usize,
        pub grad_accum: usize,
        pub epochs: usize,
        /// Shared by every process: checkpoints are written there and resumed from.
        pub dir: Option<PathBuf>,
        pub resume_from: Option<usize>,
        /// Stop after epoch 2, as decided on the main process alone.
        #[serde(default)]
        pub early_stopping: bool,
        /// The ZeRO stage (DeepSpeed's number).
        #[serde(default)]
        pub zero_stage: u8,
        /// f16 starts at a loss scale of 2^30, so that its first steps overflow and are
        /// skipped, and grows it every 4 steps.
        #[serde(default)]
        pub f16: bool,
        /// The same training as a hand-written loop on the `Accelerator` (no validation, no
        /// checkpoints), to check that both entry points step alike.
        #[serde(default)]
        pub by_hand: bool,
        /// The strategy's own checkpoints written sharded (`CheckpointLayout::Sharded`).
        #[serde(default)]
        pub sharded_checkpoint: bool,
        /// The training items (256 when 0).
        #[serde(default)]
        pub items: usize,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct RunReport {
        pub parameters: Vec<f32>,
        pub optimizer_steps: usize,
        pub epochs: Vec<usize>,
        /// Burn's logged validation losses, per epoch (none where the process does not write
        /// the logs: only the main process does).
        pub valid_losses: Vec<Vec<f64>>,
        pub skipped_steps: usize,
        pub loss_scale: f32,
        /// The most bytes of other processes' parameters gathered whole at once (ZeRO stage
        /// 3's placeholders; 0 where every process holds every parameter).
        #[serde(default)]
        pub gathered_peak: u64,
    }

    /// Stops after an epoch, on the main process only: a decision made on one process alone is
    /// what the strategy must share (every process follows the main one's).
    #[derive(Clone)]
    struct StopOnMainAfter(usize);

    impl EarlyStoppingStrategy for StopOnMainAfter {
        fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
            epoch >= self.0 && ProcessState::from_env().unwrap().is_main_process()
        }
    }

    /// The strategy's checkpoints written sharded (each process its own partition's files)
    /// where `sharded`, consolidated otherwise.
    pub fn checkpoint_layout(sharded: bool) -> burn_accelerate::checkpoint::CheckpointLayout {
        use burn_accelerate::checkpoint::CheckpointLayout;
        if sharded {
            CheckpointLayout::Sharded
        } else {
            CheckpointLayout::Consolidated
        }
    }

    /// The hidden width of the blobs' `Mlp` that the fits here train.
    pub const HIDDEN: usize = 16;

    /// The learning components of a model `M` trained by Adam at a constant learning rate.
    pub type AdamComponents<M> = burn::train::LearningComponentsMarker<
        Train,
        f64,
        M,
        burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, M, Train>,
    >;

    /// This process's shard of `items` training blobs (seed 1), shuffled (data seed 11), in
    /// batches of `batch_size` per process.
    pub fn blob_loader(batch_size: usize, items: usize) -> BlobLoader {
        let state = ProcessState::from_env().unwrap();
        ShardLoaderBuilder::new(
            DataLoaderConfig::new(batch_size)
                .with_shuffle(true)
                .with_data_seed(Some(11)),
            InMemDataset::new(blobs(items, 1)),
            BlobBatcher,
        )
        .build_for(&state, Default::default())
        .unwrap()
    }

    /// What [`blob_loader`] gives.
    pub type BlobLoader = burn_accelerate::data::ShardLoader<Train, Sample, BlobBatch<Train>>;

    /// Burn's `SupervisedTraining` of `epochs` epochs over `loader` in `dir`, validated on one
    /// batch of `valid_items` other blobs (seed 2) with its loss logged, rendering nothing and
    /// installing no application logger.
    pub fn quiet_training<M>(
        dir: &std::path::Path,
        loader: BlobLoader,
        valid_items: usize,
        epochs: usize,
    ) -> SupervisedTraining<AdamComponents<M>>
    where
        M: burn::train::TrainStep<
                Input = BlobBatch<Train>,
                Output = burn::train::ClassificationOutput<Train>,
            > + burn::module::AutodiffModule<Train>
            + core::fmt::Display
            + 'static,
        M::InnerModule: burn::train::InferenceStep<
                Input = BlobBatch<Accelerated<Flex>>,
                Output = burn::train::ClassificationOutput<Accelerated<Flex>>,
            >,
    {
        let valid = DataLoaderBuilder::<Accelerated<Flex>, _, _>::new(BlobBatcher)
            .batch_size(valid_items)
            .build(InMemDataset::new(blobs(valid_items, 2)));
        SupervisedTraining::new(dir, Arc::new(loader), valid)
            .num_epochs(epochs)
            .metric_valid_numeric(LossMetric::new())
            .renderer(QuietRenderer)
            .with_application_logger(None)
    }

    /// Where a fit writes Burn's metric logs (and the strategy's checkpoints): the directory
    /// given, or one of this process's own, removed when this is dropped.
    pub struct FitDir {
        path: PathBuf,
        own: bool,
    }

    impl FitDir {
        /// `strategy` writing in `dir`, its checkpoints in `dir/checkpoint` (`loader`'s position
        /// among them); or, where `dir` is `None`, in a directory of this process's own named
        /// after `name`, without checkpoints. The main process writes Burn's metric logs (of
        /// every process's validation) there.
        pub fn of<LC>(
            strategy: AccelerateStrategy<LC>,
            dir: Option<&std::path::Path>,
            loader: &BlobLoader,
            name: &str,
        ) -> (AccelerateStrategy<LC>, Self)
        where
            LC: burn::train::LearningComponentsTypes<
                    Backend = Train,
                    TrainingModel: burn::train::TrainStep<Input = BlobBatch<Train>>,
                >,
        {
            let fit = match dir {
                Some(dir) => Self {
                    path: dir.to_path_buf(),
                    own: false,
                },
                None => Self {
                    path: std::env::temp_dir().join(format!(
                        "burn-accelerate-processes-{name}-{}",
                        std::process::id()
                    )),
                    own: true,
                },
            };
            let strategy = if fit.own {
                strategy
            } else {
                strategy
                    .with_checkpoint_dir(fit.path.join("checkpoint"))
                    .with_checkpointed_loader(loader)
            };
            (strategy.with_artifact_dir(&fit.path), fit)
        }

        pub fn path(&self) -> &std::path::Path {
            &self.path
        }
    }

    impl Drop for FitDir {
        fn drop(&mut self) {
            if self.own {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }

    fn loader(args: &Run) -> BlobLoader {
        blob_loader(
            args.batch_size,
            if args.items == 0 { 256 } else { args.items },
        )
    }

    fn config(args: &Run) -> AccelerateConfig {
        let mut config = AccelerateConfig::new()
            .with_gradient_accumulation_steps(args.grad_accum)
            .with_zero_stage(ZeroStage::from_number(args.zero_stage).unwrap())
            .with_checkpoint_layout(checkpoint_layout(args.sharded_checkpoint));
        if args.f16 {
            // The net is tiny: cast all its lower-class ops (PyTorch's rule), so that f16
            // overflows.
            burn_accelerate::Context::process()
                .with_small_ops(burn_accelerate::autocast::SmallOps::Cast)
                .expect("a valid rule")
                .set_as_default();
            config = config
                .with_mixed_precision(Precision::F16)
                .with_grad_scaler(
                    burn_accelerate::scaler::GradScalerConfig::new()
                        .with_init_scale(2f64.powi(30))
                        .with_growth_interval(4),
                );
        }
        config
    }

    // `train`'s model, data, optimizer and settings in a hand-written loop.
    fn by_hand(args: &Run) -> RunReport {
        let device = Default::default();
        let mut accelerator = config(args).init::<Train>(&device).unwrap();
        // The loader tells the accelerator where its epoch ends (Accelerate's `prepare`).
        let observer =
            burn_accelerate::data::GradientStateObserver::new(accelerator.gradient_state().clone());
        let loader = loader(args).with_observer(Arc::new(observer));
        Train::seed(&device, 5);
        let mut model = Mlp::<Train>::new(HIDDEN, &device);
        let mut optim = AdamConfig::new().init::<Train, Mlp<Train>>();
        let (mut optimizer_steps, mut skipped_steps) = (0, 0);
        for _ in 0..args.epochs {
            for batch in loader.iter() {
                let _step = accelerator.accumulate(&model);
                let loss = {
                    let _autocast = accelerator.autocast();
                    model.classify(batch).loss
                };
                accelerator.backward(loss, &model);
                let (next, outcome) = accelerator
                    .optimizer_step(&mut optim, model, &mut 1e-2)
                    .unwrap();
                model = next;
                match outcome {
                    burn_accelerate::StepOutcome::Applied { .. } => optimizer_steps += 1,
                    burn_accelerate::StepOutcome::SkippedOverflow => skipped_steps += 1,
                    burn_accelerate::StepOutcome::Accumulating => {}
                }
            }
        }
        RunReport {
            parameters: parameters(&model),
            optimizer_steps,
            epochs: (1..=args.epochs).collect(),
            valid_losses: Vec::new(),
            skipped_steps,
            loss_scale: accelerator.loss_scale().loss_scale(),
            gathered_peak: burn_accelerate::zero::gathered_bytes().peak,
        }
    }

    pub fn train(args: &Run) -> RunReport {
        if args.by_hand {
            return by_hand(args);
        }
        let device = Default::default();
        let loader = loader(args);
        let strategy = AccelerateStrategy::<Components>::new(config(args), &device).unwrap();
        let (strategy, dir) = FitDir::of(strategy, args.dir.as_deref(), &loader, "supervised");
        let report = strategy.report();
        let mut builder = quiet_training(dir.path(), loader, 64, args.epochs)
            // Full precision: Burn's `CompactRecorder` stores f16, and a resumed run must end
            // bit for bit where the uninterrupted one did.
            .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new());
        if let Some(epoch) = args.resume_from {
            builder = builder.checkpoint(epoch);
        }
        if args.early_stopping {
            builder = builder.early_stopping(StopOnMainAfter(2));
        }
        Train::seed(&device, 5);
        let learner = Learner::new(Mlp::new(HIDDEN, &device), AdamConfig::new().init(), 1e-2);
        let model = builder.with_accelerate(strategy).launch(learner).model;
        let stats = report.stats();
        // One line per batch, the value first.
        let valid_losses = stats
            .epochs
            .iter()
            .map(|e| {
                let log = dir
                    .path()
                    .join("valid")
                    .join(format!("epoch-{}", e.epoch))
                    .join("Loss.log");
                std::fs::read_to_string(log)
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.split(',').next()?.trim().parse().ok())
                    .collect()
            })
            .collect();
        RunReport {
            parameters: parameters(&model),
            optimizer_steps: stats.optimizer_steps(),
            epochs: stats.epochs.iter().map(|e| e.epoch).collect(),
            valid_losses,
            skipped_steps: stats.skipped_steps(),
            loss_scale: stats.loss_scale.loss_scale(),
            gathered_peak: burn_accelerate::zero::gathered_bytes().peak,
        }
    }

    /// The `Mlp` in a model file that Burn's file checkpointer or the strategy wrote, as Burn
    /// loads it by itself on a backend without autodiff or this crate's decorator.
    pub fn saved_mlp(path: &std::path::Path) -> Mlp<Flex> {
        use burn::record::Recorder;
        let record: crate::mlp::MlpRecord<Flex> = Recorder::<Flex>::load(
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
            path.to_path_buf(),
            &Default::default(),
        )
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        Mlp::<Flex>::new(HIDDEN, &Default::default()).load_record(record)
    }
}

#[test]
fn supervised_training_on_processes_matches_one_process() {
    const TEST: &str = "supervised_training_on_processes_matches_one_process";
    if let Some(args) = worker::<supervised::Run>() {
        return report(&supervised::train(&args));
    }
    for grad_accum in [1, 2] {
        let run = |processes: usize| supervised::Run {
            batch_size: 32 / processes,
            grad_accum,
            epochs: 2,
            ..Default::default()
        };
        let single: Vec<supervised::RunReport> =
            launch(TEST, 1, &run(1), &[]).assert_success().reports(1);
        assert_eq!(single[0].optimizer_steps, 2 * 8 / grad_accum);
        let reports: Vec<supervised::RunReport> =
            launch(TEST, 2, &run(2), &[]).assert_success().reports(2);
        assert_eq!(bits(&reports[0].parameters), bits(&reports[1].parameters));
        assert_eq!(reports[0].optimizer_steps, single[0].optimizer_steps);
        let difference = max_relative_difference(&reports[0].parameters, &single[0].parameters);
        assert!(difference < 1e-5, "grad_accum {grad_accum}: {difference:e}");
    }
}

#[test]
fn the_main_process_logs_the_combined_validation_and_its_early_stopping_decides() {
    const TEST: &str =
        "the_main_process_logs_the_combined_validation_and_its_early_stopping_decides";
    if let Some(args) = worker::<supervised::Run>() {
        return report(&supervised::train(&args));
    }
    let run = |processes: usize, zero_stage: u8| supervised::Run {
        batch_size: 32 / processes,
        grad_accum: 1,
        epochs: 4,
        early_stopping: true,
        zero_stage,
        ..Default::default()
    };
    let single: Vec<supervised::RunReport> =
        launch(TEST, 1, &run(1, 0), &[]).assert_success().reports(1);
    assert_eq!(single[0].epochs, [1, 2]);
    // Data parallel, and with the optimizer and gradients sharded.
    for zero_stage in [0, 2] {
        let reports: Vec<supervised::RunReport> = launch(TEST, 2, &run(2, zero_stage), &[])
            .assert_success()
            .reports(2);
        // Every process stops after epoch 2, though only the main one decided so.
        for r in &reports {
            assert_eq!(r.epochs, [1, 2], "stage {zero_stage}");
        }
        // The main process logged what one process logs (the one validation batch is the
        // main process's part; the other has none); the other writes no logs.
        let (main, other) = (&reports[0].valid_losses, &reports[1].valid_losses);
        assert_eq!(main.len(), 2);
        assert!(other.iter().all(Vec::is_empty), "{other:?}");
        for (epoch, (got, want)) in main.iter().zip(&single[0].valid_losses).enumerate() {
            assert!(!want.is_empty());
            assert_eq!(got.len(), want.len(), "epoch {}", epoch + 1);
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs(),
                    "stage {zero_stage}, epoch {}: {g} vs {w}",
                    epoch + 1
                );
            }
        }
    }
}

#[test]
fn a_resumed_run_of_processes_ends_where_the_uninterrupted_one_did() {
    const TEST: &str = "a_resumed_run_of_processes_ends_where_the_uninterrupted_one_did";
    if let Some(run) = worker::<FromCopy<supervised::Run>>() {
        return report(&run.train());
    }
    let checkpoint = StrategyCheckpoint::consolidated(TEST, 0);

    // Two epochs, then the third resumed from epoch 2's checkpoint, on two processes.
    let parts_dir = harness::scratch_dir("resume-parts");
    checkpoint.save(0, &parts_dir);
    let written: Vec<String> = std::fs::read_dir(parts_dir.join("checkpoint"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        written.contains(&"accelerate-2.json".to_string()),
        "{written:?}"
    );
    let resumed = checkpoint.resume(2, 0, &parts_dir);
    checkpoint.assert_bit_for_bit(&resumed, "2 processes");

    // The third epoch on one process with the same global batch: the data is sharded anew
    // from the checkpoint's epoch, and the run ends where the two processes did.
    let one = checkpoint.resume(1, 0, &parts_dir);
    checkpoint.assert_to_rounding(&one, "1 process");

    // A position inside an epoch has no mapping onto another number of processes: refused.
    let checkpoints = parts_dir.join("checkpoint");
    let mut saved = AccelerateCheckpoint::load_epoch(&checkpoints, 2)
        .unwrap()
        .unwrap();
    saved.loaders[0].position = 3;
    saved.save_epoch(&checkpoints, 2).unwrap();
    let refused = checkpoint.launched(1, checkpoint.run(1, 0, 3, &parts_dir, Some(2)), false);
    assert!(!refused.status.success());
    assert!(
        refused.stderr.contains(
            "cannot resume: cannot restore number of processes: the checkpoint was saved with 2 \
             processes, 3 batches into epoch 2, this accelerator has 1 processes"
        ),
        "{}",
        refused.stderr
    );
    harness::clean(&parts_dir);
}

#[test]
fn both_entry_points_step_alike_at_zero_stage_2() {
    const TEST: &str = "both_entry_points_step_alike_at_zero_stage_2";
    if let Some(args) = worker::<supervised::Run>() {
        return report(&supervised::train(&args));
    }
    // The step core under Burn's `SupervisedTraining` and under a hand-written loop: the same
    // parameters, bit for bit, on every rank. Accumulation 3 over 256 items at 2 × 16 a step
    // leaves a partial window of 2 at each epoch's end; f16 skips its first steps.
    for f16 in [false, true] {
        let run = |by_hand: bool| supervised::Run {
            batch_size: 16,
            grad_accum: 3,
            epochs: 2,
            zero_stage: 2,
            f16,
            by_hand,
            ..Default::default()
        };
        let [strategy, hand]: [Vec<supervised::RunReport>; 2] = [false, true].map(|by_hand| {
            launch(TEST, 2, &run(by_hand), &[])
                .assert_success()
                .reports(2)
        });
        for (rank, (s, h)) in strategy.iter().zip(&hand).enumerate() {
            let what = format!("f16 {f16}, rank {rank}");
            assert_eq!(s.optimizer_steps, h.optimizer_steps, "{what}");
            assert_eq!(s.skipped_steps, h.skipped_steps, "{what}");
            assert_eq!(s.loss_scale, h.loss_scale, "{what}");
            assert_eq!(bits(&s.parameters), bits(&h.parameters), "{what}");
        }
        if f16 {
            assert!(strategy[0].skipped_steps > 0, "no step overflowed");
        }
    }
}

#[test]
fn sharded_supervised_training_ends_where_stage_0_does() {
    const TEST: &str = "sharded_supervised_training_ends_where_stage_0_does";
    if let Some(args) = worker::<supervised::Run>() {
        return report(&supervised::train(&args));
    }
    // Adam through Burn's Learner; f16 with steps skipped on overflow and the scale growing.
    for (processes, f16) in [(2, false), (2, true), (4, false)] {
        let run = |zero_stage: u8| supervised::Run {
            batch_size: 32 / processes,
            grad_accum: 2,
            epochs: 2,
            zero_stage,
            f16,
            ..Default::default()
        };
        let runs: Vec<Vec<supervised::RunReport>> = (0..3)
            .map(|stage| {
                launch(TEST, processes, &run(stage), &[])
                    .assert_success()
                    .reports(processes)
            })
            .collect();
        let stage0 = &runs[0][0];
        if f16 {
            assert!(stage0.skipped_steps > 0, "no step overflowed");
        }
        for (stage, reports) in runs.iter().enumerate() {
            for (rank, r) in reports.iter().enumerate() {
                let what = format!("{processes} processes, f16 {f16}, stage {stage}, rank {rank}");
                assert_eq!(r.optimizer_steps, stage0.optimizer_steps, "{what}");
                assert_eq!(r.skipped_steps, stage0.skipped_steps, "{what}");
                assert_eq!(r.loss_scale, stage0.loss_scale, "{what}");
                assert_eq!(bits(&r.parameters), bits(&reports[0].parameters), "{what}");
                // Sums of two values do not depend on their order; stage 2 sums four in
                // another order than stage 0's all-reduce.
                if stage == 1 || processes == 2 {
                    assert_eq!(bits(&r.parameters), bits(&stage0.parameters), "{what}");
                } else {
                    let d = max_relative_difference(&r.parameters, &stage0.parameters);
                    assert!(d < 1e-5, "{what}: {d:e}");
                }
            }
        }
    }
}

#[test]
fn a_sharded_supervised_run_resumes_on_other_process_counts_and_stages() {
    const TEST: &str = "a_sharded_supervised_run_resumes_on_other_process_counts_and_stages";
    if let Some(run) = worker::<FromCopy<supervised::Run>>() {
        return report(&run.train());
    }
    let checkpoint = StrategyCheckpoint::consolidated(TEST, 2);
    let parts_dir = harness::scratch_dir("sharded-resume-parts");
    checkpoint.save(2, &parts_dir);
    // The same processes and stage: bit for bit.
    let same = checkpoint.resume(2, 2, &parts_dir);
    checkpoint.assert_bit_for_bit(&same, "2 processes at stage 2");
    // Re-partitioned: the whole optimizer state was saved, whatever each process held.
    for (processes, zero_stage) in [(4, 1), (1, 0), (4, 2)] {
        let resumed = checkpoint.resume(processes, zero_stage, &parts_dir);
        let what = format!("{processes} processes at stage {zero_stage}");
        checkpoint.assert_to_rounding(&resumed, &what);
    }
    harness::clean(&parts_dir);
}

#[test]
fn stage_3_with_accelerate_ends_where_stage_2_and_the_hand_written_loop_do() {
    const TEST: &str = "stage_3_with_accelerate_ends_where_stage_2_and_the_hand_written_loop_do";
    if let Some(args) = worker::<supervised::Run>() {
        return report(&supervised::train(&args));
    }
    // Adam through Burn's Learner, which reloads the stepped model (placeholders, on the
    // decorator); accumulation 3 over 256 items leaves a partial window at each epoch's end;
    // f16 skips its first steps. Stage 3 steps the slices by hand and under Burn's learner the
    // same bits, and stage 2's on 2 processes (to rounding on 3: `assert_like_stage_2`).
    for (processes, f16) in [(2, false), (2, true), (3, false)] {
        let run = |zero_stage: u8, by_hand: bool| supervised::Run {
            batch_size: 48 / processes,
            grad_accum: 3,
            epochs: 2,
            zero_stage,
            f16,
            by_hand,
            ..Default::default()
        };
        let go = |zero_stage: u8, by_hand: bool| -> Vec<supervised::RunReport> {
            launch(TEST, processes, &run(zero_stage, by_hand), &[])
                .assert_success()
                .reports(processes)
        };
        let (stage2, stage3, hand3) = (go(2, false), go(3, false), go(3, true));
        if f16 {
            assert!(stage2[0].skipped_steps > 0, "no step overflowed");
        }
        for rank in 0..processes {
            let what = format!("{processes} processes, f16 {f16}, rank {rank}");
            // Under Burn's learner too, stage 3's parameters were gathered from the slices at
            // their uses (placeholders), not held whole by every process.
            assert!(stage3[rank].gathered_peak > 0, "{what}");
            assert_eq!(stage2[rank].gathered_peak, 0, "{what}");
            for (other, name) in [(&stage2[rank], "stage 2"), (&hand3[rank], "by hand")] {
                let s = &stage3[rank];
                assert_eq!(s.optimizer_steps, other.optimizer_steps, "{what}, {name}");
                assert_eq!(s.skipped_steps, other.skipped_steps, "{what}, {name}");
                assert_eq!(s.loss_scale, other.loss_scale, "{what}, {name}");
                let exact = processes == 2 || name == "by hand";
                assert_like_stage_2(&s.parameters, &other.parameters, exact, &what);
            }
        }
    }
}

#[test]
fn a_stage_3_supervised_run_resumes_on_other_process_counts_and_stages() {
    const TEST: &str = "a_stage_3_supervised_run_resumes_on_other_process_counts_and_stages";
    if let Some(run) = worker::<FromCopy<supervised::Run>>() {
        return report(&run.train());
    }
    // Burn's file checkpointer and the strategy's own checkpoints, each written on the main
    // process from the model's record gathered there (the strategy's are resumed from).
    let checkpoint = StrategyCheckpoint::consolidated(TEST, 3);
    // Stage 3 and stage 2 on 2 processes step alike: each one's checkpoint of epoch 2.
    for saved_at in [3, 2] {
        let parts_dir = harness::scratch_dir(&format!("stage-3-resume-from-{saved_at}"));
        let saved = checkpoint.save(saved_at, &parts_dir);
        // Both files of epoch 2 hold the whole model the run ended with, and Burn loads them
        // by itself.
        for file in ["model-2.mpk", "accelerate-2-model.mpk"] {
            let loaded = supervised::saved_mlp(&parts_dir.join("checkpoint").join(file));
            assert_eq!(
                bits(&parameters(&loaded)),
                bits(&saved[0].parameters),
                "saved at stage {saved_at}, {file}"
            );
        }
        // The same processes at stage 3: bit for bit.
        let same = checkpoint.resume(2, 3, &parts_dir);
        checkpoint.assert_bit_for_bit(&same, &format!("saved at stage {saved_at}"));
        // Re-partitioned: to rounding (the means sum other parts), as stage 2's resumes.
        for (processes, zero_stage) in [(1, 0), (4, 3)] {
            let resumed = checkpoint.resume(processes, zero_stage, &parts_dir);
            let what =
                format!("saved at stage {saved_at}, {processes} processes at stage {zero_stage}");
            checkpoint.assert_to_rounding(&resumed, &what);
        }
        harness::clean(&parts_dir);
    }
}

#[test]
fn a_sharded_stage_3_supervised_checkpoint_resumes_on_other_process_counts_and_stages() {
    const TEST: &str =
        "a_sharded_stage_3_supervised_checkpoint_resumes_on_other_process_counts_and_stages";
    use burn_accelerate::checkpoint::CheckpointDir;
    if let Some(run) = worker::<FromCopy<supervised::Run>>() {
        return report(&run.train());
    }
    // Stage 3 on 2 processes; the strategy's own checkpoints written sharded, beside Burn's own
    // files.
    let checkpoint = StrategyCheckpoint::sharded(TEST, 1, 3);
    let parts_dir = harness::scratch_dir("sharded-stage-3-supervised-parts");
    let saved = checkpoint.save(3, &parts_dir);
    let checkpoints = parts_dir.join("checkpoint");
    // The strategy's checkpoint of epoch 2: each process's files and the main process's
    // state and scheduler, no consolidated record.
    let listed = CheckpointDir::new(&checkpoints).load(2).unwrap();
    assert_eq!(
        listed.files.keys().collect::<Vec<_>>(),
        [
            "accelerate-2-scheduler.mpk",
            "accelerate-2.json",
            "model-2.shard-0-of-2.mpk",
            "model-2.shard-1-of-2.mpk",
            "optimizer-2.shard-0-of-2.mpk",
            "optimizer-2.shard-1-of-2.mpk"
        ]
    );
    assert!(!checkpoints.join("accelerate-2-model.mpk").exists());
    // Burn's own file of epoch 2 stays whole, gathered on the main process: Burn loads it by
    // itself.
    let loaded = supervised::saved_mlp(&checkpoints.join("model-2.mpk"));
    assert_eq!(bits(&parameters(&loaded)), bits(&saved[0].parameters));
    // The same processes at stage 3: bit for bit.
    let same = checkpoint.resume(2, 3, &parts_dir);
    checkpoint.assert_bit_for_bit(&same, "2 processes at stage 3");
    // Re-partitioned, at stage 0 and at stage 3: the same training to rounding (the mean of
    // the gradients over other processes' parts sums in another order), as the consolidated
    // checkpoint's resumes.
    for (processes, zero_stage) in [(1, 0), (3, 3)] {
        let resumed = checkpoint.resume(processes, zero_stage, &parts_dir);
        let what = format!("{processes} processes at stage {zero_stage}");
        checkpoint.assert_to_rounding(&resumed, &what);
    }
    harness::clean(&parts_dir);
}

// ---------------------------------------------------------------------------------------
// The shard loaders, built from each process's state, against accelerate's own processes.

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Golden {
    file: String,
    processes: usize,
    /// Through the stream loader (the iterable suite always is).
    #[serde(default)]
    stream: bool,
}

fn golden_cases(file: &str, processes: usize) -> Vec<Value> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "golden", file]
        .iter()
        .collect();
    let mut golden: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let Value::Array(cases) = golden["cases"].take() else {
        panic!("{file} has no cases")
    };
    let num = |case: &Value, key: &str| case[key].as_u64().unwrap() as usize;
    cases
        .into_iter()
        // Errors, and split_batches with batch size 1 (refused by the crate's contract), are
        // checked in one process by the golden suites.
        .filter(|c| {
            num(c, "num_processes") == processes
                && c.get("error").is_none()
                && !(c["split_batches"] == true && num(c, "batch_size") == 1)
        })
        .collect()
}

#[derive(Clone)]
struct Ids;

impl<B: Backend> Batcher<B, usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &B::Device) -> Vec<usize> {
        items
    }
}

/// `0..len`, counting the items read.
struct Counted {
    len: usize,
    reads: Arc<AtomicUsize>,
}

impl burn::data::dataset::Dataset<usize> for Counted {
    fn get(&self, index: usize) -> Option<usize> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        (index < self.len).then_some(index)
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct GoldenReport {
    /// Per case: this process's batches (or, for the iterable suite, items).
    got: BTreeMap<String, Value>,
    /// Items this process read from the dataset, over all cases.
    reads: usize,
}

fn golden_worker(args: &Golden) -> GoldenReport {
    let state = ProcessState::from_env().unwrap();
    assert_eq!(state.num_processes(), args.processes);
    let reads = Arc::new(AtomicUsize::new(0));
    let dispatch = args.file.starts_with("dispatch");
    let got = golden_cases(&args.file, args.processes)
        .iter()
        .map(|case| {
            let flag = |key: &str, default: bool| case[key].as_bool().unwrap_or(default);
            let len = case["dataset_len"].as_u64().unwrap() as usize;
            let config = DataLoaderConfig::new(case["batch_size"].as_u64().unwrap() as usize)
                .with_split_batches(flag("split_batches", false))
                .with_even_batches(flag("even_batches", true))
                .with_drop_last(flag("drop_last", false))
                .with_dispatch_batches(dispatch);
            let got = if args.file.starts_with("iterable") || args.stream {
                let counter = reads.clone();
                let builder = StreamLoaderBuilder::<Flex, usize, Vec<usize>>::new(
                    config,
                    move |_epoch: u64| {
                        let counter = counter.clone();
                        (0..len).inspect(move |_| {
                            counter.fetch_add(1, Ordering::SeqCst);
                        })
                    },
                    Ids,
                );
                let loader = if dispatch {
                    builder.build_dispatching(&state, Default::default())
                } else {
                    builder.build_for(&state, Default::default())
                }
                .unwrap();
                let batches = loader.iter().collect::<Vec<_>>();
                if dispatch {
                    serde_json::json!(batches)
                } else {
                    // The iterable suite lists each process's items, not its batches.
                    serde_json::json!(batches.concat())
                }
            } else {
                let dataset = Counted {
                    len,
                    reads: reads.clone(),
                };
                let builder =
                    ShardLoaderBuilder::<Flex, usize, Vec<usize>>::new(config, dataset, Ids);
                let loader = if dispatch {
                    builder.build_dispatching(&state, Default::default())
                } else {
                    builder.build_for(&state, Default::default())
                }
                .unwrap();
                serde_json::json!(loader.iter().collect::<Vec<_>>())
            };
            (case["id"].as_str().unwrap().to_string(), got)
        })
        .collect();
    GoldenReport {
        got,
        reads: reads.load(Ordering::SeqCst),
    }
}

#[test]
fn shard_loaders_from_the_process_state_give_every_process_its_golden_batches() {
    const TEST: &str = "shard_loaders_from_the_process_state_give_every_process_its_golden_batches";
    if let Some(args) = worker::<Golden>() {
        return report(&golden_worker(&args));
    }
    for (file, stream) in [
        ("batch_sampler_shards.json", false),
        ("iterable_dataset_shards.json", true),
        ("dispatch_batches.json", false),
        ("dispatch_batches.json", true),
    ] {
        for processes in [2, 3, 4] {
            let args = Golden {
                file: file.into(),
                processes,
                stream,
            };
            let reports: Vec<GoldenReport> = launch(TEST, processes, &args, &[])
                .assert_success()
                .reports(processes);
            let cases = golden_cases(file, processes);
            assert!(cases.len() > 100, "{file}: {} cases", cases.len());
            for case in &cases {
                let id = case["id"].as_str().unwrap();
                for (rank, report) in reports.iter().enumerate() {
                    assert_eq!(
                        report.got[id], case["per_process"][rank],
                        "{file} (stream: {stream}) {id}: process {rank} of {processes}"
                    );
                }
            }
            if file.starts_with("dispatch") {
                // Only process 0 read the data; the others were sent their slices.
                assert!(reports[0].reads > 0);
                assert!(
                    reports[1..].iter().all(|r| r.reads == 0),
                    "{file} {processes}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Seeds, guards and collectives seen from the processes.

#[derive(Debug, Serialize, Deserialize)]
struct Seeds {
    device_specific: u64,
    shared: u64,
    device_specific_draw: Vec<f32>,
    shared_draw: Vec<f32>,
    order: Vec<String>,
}

fn seeds_worker() -> Seeds {
    let device = Default::default();
    let draw = || {
        Tensor::<Flex, 1>::random([4], burn::tensor::Distribution::Default, &device)
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let device_specific = set_seed::<Flex>(42, true, &device).unwrap();
    let device_specific_draw = draw();
    let shared = set_seed::<Flex>(42, false, &device).unwrap();
    let shared_draw = draw();
    // The main process writes a marker first; the others must find it once past the guard.
    let state = ProcessState::from_env().unwrap();
    let marker = harness::worker_dir().join("main-was-first");
    let mut order = Vec::new();
    {
        let _first = state.main_process_first().unwrap();
        if state.is_main_process() {
            std::thread::sleep(Duration::from_millis(300));
            std::fs::write(&marker, b"").unwrap();
        }
        order.push(format!("marker seen: {}", marker.exists()));
    }
    state.wait_for_everyone().unwrap();
    Seeds {
        device_specific,
        shared,
        device_specific_draw,
        shared_draw,
        order,
    }
}

#[test]
fn seeds_and_the_main_process_first_guard_work_across_processes() {
    const TEST: &str = "seeds_and_the_main_process_first_guard_work_across_processes";
    if worker::<()>().is_some() {
        return report(&seeds_worker());
    }
    let reports: Vec<Seeds> = launch(TEST, 3, &(), &[]).assert_success().reports(3);
    for (rank, r) in reports.iter().enumerate() {
        assert_eq!(r.device_specific, 42 + rank as u64);
        assert_eq!(r.shared, 42);
        assert_eq!(bits(&r.shared_draw), bits(&reports[0].shared_draw));
        if rank > 0 {
            assert_ne!(
                bits(&r.device_specific_draw),
                bits(&reports[0].device_specific_draw)
            );
        }
        assert_eq!(r.order, ["marker seen: true"], "rank {rank}");
    }
    assert_eq!(seed_for(7, true, &ProcessState::single()), 7);
}

// ---------------------------------------------------------------------------------------
// Failures: a rank that dies, a peer that never comes, bad launches.

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Death {
    /// Rank 1 panics after joining, while the others wait for it in a collective.
    PanicInCollective,
    /// Rank 1 exits with status 3 before joining, while the others wait at the rendezvous.
    ExitBeforeJoining,
}

fn dying_worker(death: Death) {
    let state = ProcessState::from_env().unwrap();
    let rank = state.process_index();
    match death {
        Death::PanicInCollective => {
            state.wait_for_everyone().unwrap();
            if rank == 1 {
                panic!("rank 1 fails on purpose");
            }
            // The others wait in a collective that rank 1 never reaches.
            state.wait_for_everyone().unwrap();
        }
        Death::ExitBeforeJoining => {
            if rank == 1 {
                std::process::exit(3);
            }
            state.wait_for_everyone().unwrap();
        }
    }
}

#[test]
fn a_rank_that_panics_or_exits_ends_the_launch_within_seconds() {
    const TEST: &str = "a_rank_that_panics_or_exits_ends_the_launch_within_seconds";
    if let Some(death) = worker::<Death>() {
        return dying_worker(death);
    }
    if harness::under_mpi() {
        needs::missing(
            "burn-accelerate's launcher rather than mpirun (BURN_ACCELERATE_TEST_ENGINE=mpi is set)",
        );
    }
    for (death, status) in [
        (
            Death::PanicInCollective,
            "exited with status 101 (a Rust panic)",
        ),
        (Death::ExitBeforeJoining, "exited with status 3"),
    ] {
        // The timeout is far away: only the launcher can end these runs quickly.
        let run = launch(TEST, 3, &death, &["--timeout", "600", "--grace", "2"]);
        assert!(!run.status.success(), "{death:?}: {}", run.stderr);
        assert!(
            run.stderr.contains(&format!(
                "process 1 {status}; the other processes were stopped"
            )),
            "{death:?}:\n{}",
            run.stderr
        );
        assert!(
            run.elapsed < Duration::from_secs(20),
            "{death:?}: {:?}",
            run.elapsed
        );
    }
}

#[test]
fn a_peer_that_never_comes_fails_the_wait_with_the_missing_ranks() {
    // Rank 0 of 2, hosting the rendezvous itself (no launcher); rank 1 is never started.
    let port = harness::free_port().to_string();
    let vars = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
        ("BURN_ACCELERATE_TIMEOUT", "1.5"),
        ("BURN_ACCELERATE_SECRET", "a test's secret"),
    ];
    let state = ProcessState::from_vars(|name| {
        vars.iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.to_string())
    })
    .unwrap();
    let start = std::time::Instant::now();
    let err = state.wait_for_everyone().unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(&err, DistributedError::Rendezvous { reason, .. } if reason.contains("ranks [1] of 2 never came")),
        "{err}"
    );
}

#[test]
fn bad_launches_are_refused_with_what_to_change() {
    let refused = |args: &[&str]| {
        let out = harness::launcher().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8(out.stderr).unwrap()
    };
    let msg = refused(&[
        "launch",
        "--num-processes",
        "3",
        "--num-machines",
        "2",
        "--",
        "true",
    ]);
    assert!(msg.contains("not a multiple of --num-machines 2"), "{msg}");
    let msg = refused(&[
        "launch",
        "--num-machines",
        "2",
        "--num-processes",
        "2",
        "--",
        "true",
    ]);
    assert!(msg.contains("--main-process-ip is required"), "{msg}");
    let msg = refused(&["launch", "--machine-rank", "1", "--", "true"]);
    assert!(
        msg.contains("--machine-rank 1 is not below --num-machines 1"),
        "{msg}"
    );
    let msg = refused(&["launch", "--num-processes", "0", "--", "true"]);
    assert!(msg.contains("--num-processes"), "{msg}");
    let msg = refused(&["launch", "--timeout", "0", "--", "true"]);
    assert!(msg.contains("--timeout 0"), "{msg}");
    let msg = refused(&["launch", "--liveness-timeout", "-1", "--", "true"]);
    assert!(msg.contains("--liveness-timeout -1"), "{msg}");
    // Several machines need one secret, given to every launcher.
    let machines = [
        "launch",
        "--num-machines",
        "2",
        "--num-processes",
        "2",
        "--main-process-ip",
        "127.0.0.1",
    ];
    let msg = refused(&[&machines[..], &["--", "true"]].concat());
    assert!(
        msg.contains("needs the same secret on every machine")
            && msg.contains("burn-accelerate secret"),
        "{msg}"
    );
    let msg = refused(
        &[
            &machines[..],
            &["--secret-file", "/nonexistent", "--", "true"],
        ]
        .concat(),
    );
    assert!(
        msg.contains("reading the secret file /nonexistent"),
        "{msg}"
    );
    let empty = harness::scratch_dir("empty-secret").join("run.secret");
    std::fs::write(&empty, "\n").unwrap();
    let empty = empty.to_str().unwrap();
    let msg = refused(&[&machines[..], &["--secret-file", empty, "--", "true"]].concat());
    assert!(msg.contains("is empty"), "{msg}");
    let msg = refused(&["launch"]);
    assert!(msg.contains("<PROGRAM>"), "{msg}");
    let msg = refused(&["launch", "--", "/nonexistent/program"]);
    assert!(
        msg.contains("cannot start \"/nonexistent/program\""),
        "{msg}"
    );
    // A port in use for the rendezvous.
    let taken = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let msg = refused(&[
        "launch",
        "--num-processes",
        "2",
        "--main-process-port",
        &port,
        "--",
        "true",
    ]);
    assert!(
        msg.contains(&format!("cannot listen on port {port}")),
        "{msg}"
    );

    let ok = harness::launcher()
        .args(["launch", "--", "true"])
        .output()
        .unwrap();
    assert!(ok.status.success());
}

#[test]
fn a_bad_environment_is_an_error_naming_the_variable() {
    // What a program sees when started by hand with an inconsistent layout.
    let env = harness::launcher()
        .arg("env")
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let out = String::from_utf8(env.stdout).unwrap();
    assert!(
        out.contains("environment variable RANK=\"2\" is invalid: below WORLD_SIZE=2"),
        "{out}"
    );
}

fn sleeping_worker() {
    let state = ProcessState::from_env().unwrap();
    state.wait_for_everyone().unwrap();
    let ready = harness::worker_dir().join(format!("ready-{}", state.process_index()));
    std::fs::write(ready, b"").unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

#[cfg(unix)]
#[test]
fn ctrl_c_on_the_launcher_reaches_every_process() {
    const TEST: &str = "ctrl_c_on_the_launcher_reaches_every_process";
    if worker::<()>().is_some() {
        return sleeping_worker();
    }
    if harness::under_mpi() {
        needs::missing(
            "burn-accelerate's launcher rather than mpirun (BURN_ACCELERATE_TEST_ENGINE=mpi is set)",
        );
    }
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    // A grace far longer than the test waits: the processes must end from the forwarded
    // SIGINT itself, not from the launcher killing them afterwards.
    let (command, dir) = harness::launch_command(TEST, 2, &(), &["--grace", "60"]);
    let mut command = command;
    let mut launcher = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !(dir.join("ready-0").exists() && dir.join("ready-1").exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the workers never got ready"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let interrupted = std::time::Instant::now();
    kill(Pid::from_raw(launcher.id() as i32), Signal::SIGINT).unwrap();
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        assert!(
            interrupted.elapsed() < Duration::from_secs(20),
            "the launcher did not stop on Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by signal 2"), "{stderr}");
    assert!(
        interrupted.elapsed() < Duration::from_secs(10),
        "{:?}",
        interrupted.elapsed()
    );
    harness::clean(&dir);
}

// ---------------------------------------------------------------------------------------
// Accelerate's collectives on tensors, and gather_for_metrics over a sharded epoch.

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Collected {
    gathered_floats: Vec<f32>,
    gathered_shape: Vec<usize>,
    gathered_labels: Vec<i64>,
    gathered_mask: Vec<bool>,
    sum: Vec<f32>,
    mean: Vec<f32>,
    int_sum: Vec<i64>,
    broadcast: Vec<f32>,
    broadcast_object: String,
    padded: Vec<f32>,
    errors: Vec<String>,
}

fn collectives_worker() -> Collected {
    use burn::tensor::Bool;
    use burn_accelerate::distributed::ReduceOp;
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    let r = state.process_index();
    let device = Default::default();
    // Rank r contributes r + 1 rows of the value r.
    let floats = Tensor::<Flex, 2>::full([r + 1, 2], r as f32, &device);
    let gathered = group.gather(floats).unwrap();
    // Labels beyond f32's exact integers (2^24), and a mask: they must arrive bit for bit.
    let labels = Tensor::<Flex, 1, Int>::from_data(
        TensorData::new(vec![(1i64 << 30) + r as i64, -(r as i64)], [2]),
        &device,
    );
    let mask = Tensor::<Flex, 1, Bool>::from_data(
        TensorData::new(vec![r.is_multiple_of(2), true], [2]),
        &device,
    );
    let pair = Tensor::<Flex, 1>::from_floats([r as f32, 1.0], &device);
    let int = Tensor::<Flex, 1, Int>::from_ints([r as i64 * 10], &device);
    let own = Tensor::<Flex, 1>::from_floats([r as f32 * 100.0], &device);
    let ones = Tensor::<Flex, 1>::ones([r + 1], &device);
    // Calls that cannot be served: every process finds the same error, and the group stays
    // usable (the last call below still works).
    let ragged = || Tensor::<Flex, 2>::zeros([1, r + 1], &device);
    let errors = vec![
        group.gather(ragged()).unwrap_err().to_string(),
        group
            .reduce(ragged(), ReduceOp::Sum)
            .unwrap_err()
            .to_string(),
        group.broadcast(ragged(), 5).unwrap_err().to_string(),
        // Process 0 sends text where the others expect a number.
        if r == 0 {
            group.broadcast_object(&"text".to_string(), 0).unwrap();
            "process 0 sent it".into()
        } else {
            group.broadcast_object(&0u64, 0).unwrap_err().to_string()
        },
    ];
    Collected {
        errors,
        gathered_shape: gathered.dims().to_vec(),
        gathered_floats: gathered.into_data().to_vec().unwrap(),
        gathered_labels: ints(group.gather(labels).unwrap()),
        gathered_mask: group.gather(mask).unwrap().into_data().to_vec().unwrap(),
        sum: group
            .reduce(pair.clone(), ReduceOp::Sum)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap(),
        mean: group
            .reduce(pair, ReduceOp::Mean)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap(),
        int_sum: ints(group.reduce(int, ReduceOp::Sum).unwrap()),
        broadcast: group
            .broadcast(own, 1)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap(),
        broadcast_object: group.broadcast_object(&format!("seed-{r}"), 2).unwrap(),
        padded: group
            .pad_across_processes(ones, 0, 0.0, false)
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap(),
    }
}

#[test]
fn tensor_collectives_give_every_process_the_same_exact_answer() {
    const TEST: &str = "tensor_collectives_give_every_process_the_same_exact_answer";
    if worker::<()>().is_some() {
        return report(&collectives_worker());
    }
    let reports: Vec<Collected> = launch(TEST, 3, &(), &[]).assert_success().reports(3);
    for (rank, r) in reports.iter().enumerate() {
        assert_eq!(r.gathered_shape, [6, 2]);
        assert_eq!(
            r.gathered_floats,
            [0., 0., 1., 1., 1., 1., 2., 2., 2., 2., 2., 2.]
        );
        let big = 1i64 << 30;
        assert_eq!(r.gathered_labels, [big, 0, big + 1, -1, big + 2, -2]);
        assert_eq!(r.gathered_mask, [true, true, false, true, true, true]);
        assert_eq!(r.sum, [3.0, 3.0]);
        assert_eq!(r.mean, [1.0, 1.0]);
        assert_eq!(r.int_sum, [30]);
        assert_eq!(r.broadcast, [100.0]);
        assert_eq!(r.broadcast_object, "seed-2");
        let mut padded = vec![1.0; rank + 1];
        padded.resize(3, 0.0);
        assert_eq!(r.padded, padded, "rank {rank}");
        let expected = [
            "same shape beyond the first dimension",
            "reduce needs the same shape everywhere",
            "broadcast from process 5, but there are 3",
            if rank == 0 {
                "process 0 sent it"
            } else {
                "not of the type this process expects"
            },
        ];
        assert_eq!(r.errors.len(), expected.len());
        for (error, expected) in r.errors.iter().zip(expected) {
            assert!(error.contains(expected), "rank {rank}: {error}");
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Metrics {
    len: usize,
    batch_size: usize,
    split_batches: bool,
}

// The items one epoch gathers for metrics, as every process sees them.
fn gather_for_metrics_worker(args: &Metrics) -> Vec<i64> {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    let device: burn::backend::flex::FlexDevice = Default::default();
    let loader = ShardLoaderBuilder::<Flex, usize, Vec<usize>>::new(
        DataLoaderConfig::new(args.batch_size).with_split_batches(args.split_batches),
        InMemDataset::new((0..args.len).collect()),
        Ids,
    )
    .build_for(&state, device)
    .unwrap();
    let mut seen = Vec::new();
    let mut iter = loader.shard_iter();
    while let Some(batch) = iter.next() {
        let ids: Vec<i64> = batch.iter().map(|&i| i as i64).collect();
        let n = ids.len();
        let ids = Tensor::<Flex, 1, Int>::from_data(TensorData::new(ids, [n]), &device);
        let gathered = group
            .gather_for_metrics(ids, iter.metrics_padding())
            .unwrap();
        seen.extend(ints(gathered));
    }
    seen
}

#[test]
fn gather_for_metrics_sees_the_dataset_once_in_order() {
    const TEST: &str = "gather_for_metrics_sees_the_dataset_once_in_order";
    if let Some(args) = worker::<Metrics>() {
        return report(&gather_for_metrics_worker(&args));
    }
    for (processes, len, batch_size, split_batches) in [
        (2, 12, 3, false),
        (2, 13, 3, false),
        (3, 10, 2, false),
        (3, 11, 6, true),
    ] {
        let args = Metrics {
            len,
            batch_size,
            split_batches,
        };
        let reports: Vec<Vec<i64>> = launch(TEST, processes, &args, &[])
            .assert_success()
            .reports(processes);
        let dataset: Vec<i64> = (0..len as i64).collect();
        for seen in &reports {
            assert_eq!(seen, &dataset, "{processes} processes, {args:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// dispatch_batches across processes: process 0 reads, the others receive.

/// An item with the kinds of fields a batch carries besides floats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Row {
    features: Vec<f32>,
    label: i64,
    mask: bool,
}

fn rows(len: usize) -> Vec<Row> {
    (0..len)
        .map(|i| Row {
            features: vec![i as f32 * 0.5, -(i as f32)],
            label: (1 << 30) + i as i64,
            mask: i % 3 == 0,
        })
        .collect()
}

/// A batch's tensors, read back: features, labels (an int tensor), masks (a bool tensor).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct RowBatch {
    features: Vec<f32>,
    labels: Vec<i64>,
    masks: Vec<bool>,
}

#[derive(Clone)]
struct RowBatcher;

impl Batcher<Flex, Row, RowBatch> for RowBatcher {
    fn batch(&self, items: Vec<Row>, device: &burn::backend::flex::FlexDevice) -> RowBatch {
        use burn::tensor::Bool;
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|r| r.features.clone()).collect();
        let labels: Vec<i64> = items.iter().map(|r| r.label).collect();
        let masks: Vec<bool> = items.iter().map(|r| r.mask).collect();
        let features = Tensor::<Flex, 2>::from_data(TensorData::new(features, [n, 2]), device);
        let labels = Tensor::<Flex, 1, Int>::from_data(TensorData::new(labels, [n]), device);
        let masks = Tensor::<Flex, 1, Bool>::from_data(TensorData::new(masks, [n]), device);
        RowBatch {
            features: features.into_data().to_vec().unwrap(),
            labels: ints(labels),
            masks: masks.into_data().to_vec().unwrap(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Dispatched {
    /// For the in-process reference only.
    #[serde(default)]
    processes: usize,
    len: usize,
    batch_size: usize,
    split_batches: bool,
    even_batches: bool,
    num_workers: usize,
    epochs: usize,
    /// Process 0 exits after this many batches.
    main_exits_after: Option<usize>,
    /// Through the stream loader (unshuffled: a stream cannot be).
    #[serde(default)]
    stream: bool,
}

impl Dispatched {
    fn config(&self) -> DataLoaderConfig {
        DataLoaderConfig::new(self.batch_size)
            .with_dispatch_batches(true)
            .with_split_batches(self.split_batches)
            .with_even_batches(self.even_batches)
            .with_shuffle(!self.stream)
            .with_data_seed(Some(5))
            .with_num_workers(self.num_workers)
    }

    // Every process's loader, built in this one process (`None`), or this process's alone.
    fn loaders(&self, state: Option<&ProcessState>) -> Vec<Box<dyn DataLoader<Flex, RowBatch>>> {
        fn boxed<L: DataLoader<Flex, RowBatch> + 'static>(
            loaders: Vec<L>,
        ) -> Vec<Box<dyn DataLoader<Flex, RowBatch>>> {
            loaders
                .into_iter()
                .map(|l| Box::new(l) as Box<dyn DataLoader<Flex, RowBatch>>)
                .collect()
        }
        let len = self.len;
        let devices = vec![Default::default(); self.processes_in(state)];
        if self.stream {
            let builder =
                StreamLoaderBuilder::new(self.config(), move |_: u64| rows(len), RowBatcher);
            boxed(match state {
                Some(state) => vec![builder.build_dispatching(state, devices[0]).unwrap()],
                None => builder.build(&devices).unwrap(),
            })
        } else {
            let builder =
                ShardLoaderBuilder::new(self.config(), InMemDataset::new(rows(len)), RowBatcher);
            boxed(match state {
                Some(state) => vec![builder.build_dispatching(state, devices[0]).unwrap()],
                None => builder.build(&devices).unwrap(),
            })
        }
    }

    fn processes_in(&self, state: Option<&ProcessState>) -> usize {
        state.map_or(self.processes, |_| 1)
    }
}

// Every epoch's batches on this process. A failure of the dispatch (the loader cannot say it
// itself) is the next collective's error: the process says it and exits 1, as a training
// script would.
fn dispatched_worker(args: &Dispatched) -> Vec<Vec<RowBatch>> {
    let state = ProcessState::from_env().unwrap();
    let loader = args.loaders(Some(&state)).remove(0);
    let mut taken = 0;
    let epochs = (0..args.epochs)
        .map(|_| {
            loader
                .iter()
                .inspect(|_| {
                    taken += 1;
                    if state.is_main_process() && Some(taken) == args.main_exits_after {
                        std::process::exit(7);
                    }
                })
                .collect()
        })
        .collect();
    if let Err(err) = state.group().unwrap().barrier() {
        eprintln!("{err}");
        std::process::exit(1);
    }
    epochs
}

#[test]
fn dispatched_batches_across_processes_are_the_in_process_dispatchers_exactly() {
    const TEST: &str = "dispatched_batches_across_processes_are_the_in_process_dispatchers_exactly";
    if let Some(args) = worker::<Dispatched>() {
        return report(&dispatched_worker(&args));
    }
    for (processes, len, batch_size, split_batches, even_batches, num_workers, stream) in [
        (2, 37, 4, false, true, 0, false),
        (2, 37, 4, false, false, 2, false),
        (3, 41, 6, true, true, 2, false),
        (4, 30, 2, false, true, 1, false),
        (2, 37, 4, false, true, 2, true),
        (3, 41, 6, true, false, 0, true),
    ] {
        let args = Dispatched {
            processes,
            len,
            batch_size,
            split_batches,
            even_batches,
            num_workers,
            epochs: 2,
            main_exits_after: None,
            stream,
        };
        // The reference: every process's shard built in this one process, sharing one reader.
        let shards = args.loaders(None);
        let expected: Vec<Vec<Vec<RowBatch>>> = {
            let mut per_process = vec![Vec::new(); processes];
            for _ in 0..2 {
                let mut iters: Vec<_> = shards.iter().map(|s| s.iter()).collect();
                let mut epochs = vec![Vec::new(); processes];
                loop {
                    let mut any = false;
                    for (p, it) in iters.iter_mut().enumerate() {
                        if let Some(batch) = it.next() {
                            epochs[p].push(batch);
                            any = true;
                        }
                    }
                    if !any {
                        break;
                    }
                }
                for (p, epoch) in epochs.into_iter().enumerate() {
                    per_process[p].push(epoch);
                }
            }
            per_process
        };
        let reports: Vec<Vec<Vec<RowBatch>>> = launch(TEST, processes, &args, &[])
            .assert_success()
            .reports(processes);
        for (rank, got) in reports.iter().enumerate() {
            assert_eq!(
                got, &expected[rank],
                "process {rank} of {processes}, {args:?}"
            );
            assert!(!got[0].is_empty());
        }
        if !stream {
            // The two epochs are shuffled differently.
            assert_ne!(reports[0][0], reports[0][1]);
        }
    }
}

#[test]
fn a_reader_that_dies_mid_dispatch_ends_the_others_with_the_reason() {
    const TEST: &str = "a_reader_that_dies_mid_dispatch_ends_the_others_with_the_reason";
    if let Some(args) = worker::<Dispatched>() {
        return report(&dispatched_worker(&args));
    }
    let args = Dispatched {
        processes: 2,
        stream: false,
        len: 64,
        batch_size: 4,
        split_batches: false,
        even_batches: true,
        num_workers: 0,
        epochs: 1,
        main_exits_after: Some(3),
    };
    // Without the launcher (which would stop the others itself).
    let runs = harness::launch_direct(TEST, 2, &args, &[("BURN_ACCELERATE_TIMEOUT", "600")]);
    let (main, other) = (&runs[0], &runs[1]);
    assert_eq!(main.status.code(), Some(7), "{}", main.output());
    assert!(!other.status.success());
    // Rank 0 is on this machine: its exit is told as such, not guessed from a closed socket.
    let said = other.output();
    assert!(
        said.contains("dispatch_batches across processes: process 0 (pid ")
            && said.contains("on this machine) exited during stream"),
        "{said}"
    );
    assert!(
        other.elapsed < Duration::from_secs(30),
        "{:?}",
        other.elapsed
    );
}

// ---------------------------------------------------------------------------------------
// A script written for one process, run unchanged under the launcher.

#[derive(Debug, Serialize, Deserialize)]
struct Unchanged {
    /// `build(&[device])`'s batches are `build_for(state)`'s.
    same_batches: bool,
    batches: usize,
    /// What asking for two devices' loaders says.
    two_devices: String,
}

fn unchanged_worker() -> Unchanged {
    let state = ProcessState::from_env().unwrap();
    let builder = ShardLoaderBuilder::<Flex, usize, Vec<usize>>::new(
        DataLoaderConfig::new(4),
        InMemDataset::new((0..40).collect()),
        Ids,
    );
    let device = Default::default();
    let plain: Vec<Vec<usize>> = builder.build(&[device]).unwrap()[0].iter().collect();
    let explicit: Vec<Vec<usize>> = builder.build_for(&state, device).unwrap().iter().collect();
    Unchanged {
        same_batches: plain == explicit,
        batches: plain.len(),
        two_devices: builder
            .build(&[device, device])
            .map(|_| ())
            .unwrap_err()
            .to_string(),
    }
}

#[test]
fn loaders_built_for_one_process_shard_themselves_under_the_launcher() {
    const TEST: &str = "loaders_built_for_one_process_shard_themselves_under_the_launcher";
    if worker::<()>().is_some() {
        return report(&unchanged_worker());
    }
    let reports: Vec<Unchanged> = launch(TEST, 2, &(), &[]).assert_success().reports(2);
    for r in &reports {
        assert!(r.same_batches);
        // 40 items in batches of 4 over 2 processes: 5 each, not the whole 10.
        assert_eq!(r.batches, 5);
        assert!(
            r.two_devices
                .contains("it gets one loader, for one device, not 2"),
            "{}",
            r.two_devices
        );
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct MlpRun {
    loss: f32,
    accuracy: f32,
}

#[test]
fn train_mlp_on_two_processes_ends_with_one_process_accuracy() {
    const TEST: &str = "train_mlp_on_two_processes_ends_with_one_process_accuracy";
    type Train = Accelerated<Autodiff<Flex>>;
    if let Some(batch_size) = worker::<usize>() {
        let config = crate::mlp::DemoConfig::new()
            .with_epochs(2)
            .with_train_items(1024)
            .with_valid_items(256)
            .with_batch_size(batch_size);
        let outcome = crate::mlp::run::<Train>(&config, &Default::default()).unwrap();
        return report(&MlpRun {
            loss: outcome.loss,
            accuracy: outcome.accuracy,
        });
    }
    let single: Vec<MlpRun> = launch(TEST, 1, &64usize, &[]).assert_success().reports(1);
    let two: Vec<MlpRun> = launch(TEST, 2, &32usize, &[]).assert_success().reports(2);
    assert!(single[0].accuracy > 0.5, "{:?}", single[0]);
    for r in &two {
        assert_eq!(r.accuracy, single[0].accuracy, "{r:?} vs {:?}", single[0]);
        assert!(
            (r.loss - single[0].loss).abs() <= 1e-5 * single[0].loss,
            "{r:?} vs {:?}",
            single[0]
        );
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct PinnedRun {
    /// The CPUs `install` pinned the pool's threads to.
    cpus: Vec<usize>,
    /// The CPUs each pool thread's kernel mask allows, read back on that thread.
    masks: Vec<Vec<usize>>,
    /// The CPUs the process could run on before it pinned anything.
    allowed: Vec<usize>,
}

#[cfg(target_os = "linux")]
#[path = "../cpu_mask/mod.rs"]
mod cpu_mask;
#[cfg(target_os = "linux")]
use cpu_mask::thread_mask;

// Two processes on one machine, each pinning its step threads (`StepThreadsConfig::pin`) from
// the variables its launcher set (ours: LOCAL_RANK and LOCAL_WORLD_SIZE; mpirun: Open MPI's
// local rank and size): every thread runs on the CPU it was given, and the two processes' CPUs
// do not overlap. With one CPU there is nothing to split, and both processes say so.
#[cfg(target_os = "linux")]
#[test]
fn processes_on_one_machine_pin_their_threads_to_disjoint_cpus() {
    const TEST: &str = "processes_on_one_machine_pin_their_threads_to_disjoint_cpus";
    if worker::<()>().is_some() {
        let allowed = thread_mask();
        // One thread each, whatever RAYON_NUM_THREADS the test was run with (tests/threads_pinned
        // checks the pool's other threads, and the share's default size).
        let pool = burn_accelerate::threads::StepThreadsConfig::new()
            .with_threads(Some(1))
            .with_pin(true)
            .install();
        let run = match pool {
            Ok(pool) => PinnedRun {
                cpus: pool.cpus().expect("pinned").to_vec(),
                masks: rayon::broadcast(|_| thread_mask()),
                allowed,
            },
            Err(error) => {
                eprintln!("{error}");
                std::process::exit(3);
            }
        };
        return report(&run);
    }
    let launched = launch(TEST, 2, &(), &[]);
    let allowed = thread_mask();
    if allowed.len() < 2 {
        assert!(
            !launched.status.success() && launched.stderr.contains("2 processes on this machine"),
            "{}",
            launched.output()
        );
        return;
    }
    let runs: Vec<PinnedRun> = launched.assert_success().reports(2);
    for (rank, run) in runs.iter().enumerate() {
        assert!(!run.cpus.is_empty(), "rank {rank}: {run:?}");
        let one_each = run.cpus.iter().map(|&cpu| vec![cpu]).collect::<Vec<_>>();
        assert_eq!(run.masks, one_each, "rank {rank}: each thread on its CPU");
        assert!(
            run.cpus.iter().all(|cpu| run.allowed.contains(cpu)),
            "rank {rank}: {run:?}"
        );
    }
    assert!(
        runs[0].cpus.iter().all(|cpu| !runs[1].cpus.contains(cpu)),
        "{runs:?}"
    );
}

/// The transformer language model of `examples/train_lm.rs` (`examples/common/lm.rs`), small,
/// on processes.
mod lm_run {
    use super::*;
    use crate::lm::{self, LmConfig};
    use burn_accelerate::autocast::SmallOps;

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Run {
        pub precision: String,
        pub batch_size: usize,
        pub dropout: f64,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct RunReport {
        pub processes: usize,
        pub steps: usize,
        pub initial_loss: f64,
        pub train_loss: f64,
        /// The main process's alone (JSON has no NaN).
        pub valid_loss: Option<f64>,
        pub half_ops: u64,
    }

    pub fn train(args: &Run) -> RunReport {
        let precision: Precision = args.precision.parse().unwrap();
        // The model is tiny: cast every lower-class op (PyTorch's rule), so that the half
        // precisions are what runs.
        burn_accelerate::Context::process()
            .with_small_ops(SmallOps::Cast)
            .expect("a valid rule")
            .set_as_default();
        let config = LmConfig::new()
            .with_precision(precision)
            .with_d_model(32)
            .with_layers(2)
            .with_heads(4)
            .with_d_ff(64)
            .with_seq_len(32)
            .with_batch_size(args.batch_size)
            .with_dropout(args.dropout)
            .with_steps(Some(30))
            .with_lr(3e-3)
            .with_warmup(5)
            .with_allow_fallback(false)
            .with_progress_every(0);
        // Text that does not change from one commit to the next.
        let text = include_bytes!("../../LICENSE-APACHE");
        let outcome =
            lm::run::<Accelerated<Autodiff<Flex>>>(&config, text, &Default::default()).unwrap();
        RunReport {
            processes: outcome.processes,
            steps: outcome.steps,
            initial_loss: outcome.initial_loss,
            train_loss: outcome.train_loss,
            valid_loss: Some(outcome.valid_loss).filter(|v| !v.is_nan()),
            half_ops: outcome.stats.lower_ops.half_ops,
        }
    }
}

#[test]
fn the_transformer_lm_trains_on_two_processes_as_on_one_in_every_precision() {
    const TEST: &str = "the_transformer_lm_trains_on_two_processes_as_on_one_in_every_precision";
    if let Some(args) = worker::<lm_run::Run>() {
        return report(&lm_run::train(&args));
    }
    let run = |precision: &str, processes: usize, dropout: f64| lm_run::Run {
        precision: precision.into(),
        batch_size: 8 / processes,
        dropout,
    };
    // Without dropout, two processes of 4 sequences take one process's steps of 8: the same
    // losses but for the order of the gradient sums.
    let single: Vec<lm_run::RunReport> = launch(TEST, 1, &run("f32", 1, 0.0), &[])
        .assert_success()
        .reports(1);
    let pair: Vec<lm_run::RunReport> = launch(TEST, 2, &run("f32", 2, 0.0), &[])
        .assert_success()
        .reports(2);
    assert_eq!((pair[0].processes, pair[0].steps), (2, 30), "{pair:?}");
    let valid = |report: &lm_run::RunReport| report.valid_loss.expect("a finite validation loss");
    let rel = (valid(&pair[0]) - valid(&single[0])).abs() / valid(&single[0]);
    assert!(rel < 1e-4, "{pair:?} vs {single:?}");
    // Each process evaluated its own windows, and every process has the combined loss.
    assert_eq!(
        pair[0].valid_loss, pair[1].valid_loss,
        "the same on every process"
    );
    assert_eq!(
        pair[0].train_loss, pair[1].train_loss,
        "averaged over the processes"
    );
    // With dropout, in each precision: the loss falls, and the half precisions end within 3%
    // of f32 (other dropout draws under autocast, and half-precision products).
    let reference: Vec<lm_run::RunReport> = launch(TEST, 2, &run("f32", 2, 0.1), &[])
        .assert_success()
        .reports(2);
    for precision in ["bf16", "f16"] {
        let half: Vec<lm_run::RunReport> = launch(TEST, 2, &run(precision, 2, 0.1), &[])
            .assert_success()
            .reports(2);
        let main = &half[0];
        assert!(main.half_ops > 0, "{precision}: {main:?}");
        assert!(
            main.train_loss < main.initial_loss - 1.0,
            "{precision}: {main:?}"
        );
        let rel = (valid(main) - valid(&reference[0])).abs() / valid(&reference[0]);
        assert!(
            rel < 0.03,
            "{precision}: {main:?} vs f32 {:?}",
            reference[0]
        );
    }
}

// ---------------------------------------------------------------------------------------
// Validation on several processes: each validates its own batches, and every process's Burn
// metrics hold the combined values.

mod validation {
    use std::sync::{Arc, Mutex};

    use crate::mlp::{BlobBatcher, Mlp, MlpComponents, QuietRenderer, blobs};
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::optim::AdamConfig;
    use burn::train::checkpoint::MetricCheckpointingStrategy;
    use burn::train::metric::store::{Aggregate, Direction, EventStoreClient, Split};
    use burn::train::metric::{AccuracyMetric, LossMetric, PerplexityMetric};
    use burn::train::{
        EarlyStoppingStrategy, Learner, MetricEarlyStoppingStrategy, StoppingCondition,
        SupervisedTraining, TrainingStrategy,
    };
    use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};

    use super::*;

    type Train = Accelerated<Autodiff<Flex>>;
    type Components = MlpComponents<Train>;

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Run {
        /// Items of the validation set (batches of 4).
        pub valid_items: usize,
        pub epochs: usize,
        /// Adam's learning rate: 0 keeps the model of every epoch the initial one, the same
        /// on any number of processes, so that the validation alone is compared.
        pub lr: f64,
        /// Early stopping on the validation loss: stop when it has not risen for this many
        /// epochs (it never rises at learning rate 0, so the run stops after epoch n + 1).
        pub stop_after: Option<usize>,
        /// How the strategy is installed.
        #[serde(default)]
        pub install: Install,
        /// Keep Burn's checkpoint of the epoch with the highest validation loss (Burn's
        /// `MetricCheckpointingStrategy`, which the main process runs on its event store).
        #[serde(default)]
        pub best_checkpoint: bool,
        /// Also Burn's `PerplexityMetric`, whose entries carry state across batches.
        #[serde(default)]
        pub perplexity: bool,
    }

    #[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
    pub enum Install {
        /// `with_accelerate`, the strategy told the artifact directory.
        #[default]
        WithArtifactDir,
        /// `with_accelerate` without the directory: the logs stay in memory.
        NoArtifactDir,
        /// Burn's `with_training_strategy`, without `with_accelerate`'s combining logger.
        TrainingStrategy,
    }

    /// What one epoch's validation came to in this process's Burn event store.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct Epoch {
        pub epoch: usize,
        pub loss: Option<f64>,
        pub accuracy: Option<f64>,
        #[serde(default)]
        pub perplexity: Option<f64>,
        /// What this process's own early stopping strategy answered.
        pub stop: bool,
    }

    #[derive(Debug, Serialize, Deserialize)]
    pub struct Report {
        pub epochs: Vec<Epoch>,
        /// The epochs trained.
        pub trained: Vec<usize>,
        /// This process's and all processes' validation batches, per epoch.
        pub own_batches: Vec<usize>,
        pub combined_batches: Vec<usize>,
        /// The validation loss of each epoch as the main process's log files hold it (the
        /// mean of the logged batches weighted by their counts; empty elsewhere).
        pub logged_losses: Vec<f64>,
        /// The learner summary's validation loss of the last epoch (main process).
        pub summary_loss: Option<f64>,
        /// The epochs whose model checkpoints Burn kept (main process).
        pub checkpoints: Vec<usize>,
        /// The validation metrics shown per process (`TrainingStats`).
        #[serde(default)]
        pub per_process_metrics: Vec<String>,
    }

    /// Reads the validation metrics of each epoch from Burn's event store (where early stopping
    /// and the checkpointing strategies read them), then asks Burn's own metric-based early
    /// stopping.
    #[derive(Clone)]
    struct Recording {
        inner: Option<MetricEarlyStoppingStrategy>,
        epochs: Arc<Mutex<Vec<Epoch>>>,
    }

    impl EarlyStoppingStrategy for Recording {
        fn should_stop(&mut self, epoch: usize, store: &EventStoreClient) -> bool {
            let read = |name: &str| store.find_metric(name, epoch, Aggregate::Mean, &Split::Valid);
            let (loss, accuracy, perplexity) = (read("Loss"), read("Accuracy"), read("Perplexity"));
            let stop = self
                .inner
                .as_mut()
                .is_some_and(|inner| inner.should_stop(epoch, store));
            self.epochs.lock().unwrap().push(Epoch {
                epoch,
                loss,
                accuracy,
                perplexity,
                stop,
            });
            stop
        }
    }

    fn logged_mean(file: &std::path::Path) -> Option<f64> {
        let text = std::fs::read_to_string(file).ok()?;
        let (sum, count) = text
            .lines()
            .filter_map(|line| {
                let mut parts = line.split(',');
                let value: f64 = parts.next()?.parse().ok()?;
                let count: f64 = parts.next().map_or(Some(1.0), |c| c.parse().ok())?;
                Some((value * count, count))
            })
            .fold((0.0, 0.0), |(s, n), (v, c)| (s + v, n + c));
        (count > 0.0).then(|| sum / count)
    }

    pub fn train(args: &Run) -> Report {
        let device = Default::default();
        let state = ProcessState::from_env().unwrap();
        let train = ShardLoaderBuilder::new(
            DataLoaderConfig::new(32 / state.num_processes())
                .with_shuffle(true)
                .with_data_seed(Some(11)),
            InMemDataset::new(blobs(128, 1)),
            BlobBatcher,
        )
        .build_for(&state, device)
        .unwrap();
        let valid = DataLoaderBuilder::<Accelerated<Flex>, _, _>::new(BlobBatcher)
            .batch_size(4)
            .build(InMemDataset::new(blobs(args.valid_items, 2)));
        // One directory for all processes, as a user's run has; except where the strategy is
        // installed with Burn's own hook: there nothing keeps the other processes from writing
        // Burn's metric logs, and Burn reads its epoch's numbers back from those files, so
        // processes sharing them read each other's lines (a wrong loss, or a parse panic
        // while a line is half written).
        let own_dir = if args.install == Install::TrainingStrategy {
            format!("-rank{}", state.process_index())
        } else {
            String::new()
        };
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-validation-{}-{}{own_dir}",
            std::env::var("MASTER_PORT").unwrap_or_default(),
            args.valid_items
        ));
        let mut strategy =
            AccelerateStrategy::<Components>::new(AccelerateConfig::new(), &device).unwrap();
        if args.install == Install::WithArtifactDir {
            strategy = strategy.with_artifact_dir(&dir);
        }
        let report = strategy.report();
        let epochs = Arc::new(Mutex::new(Vec::new()));
        let stopping = Recording {
            inner: args.stop_after.map(|n| {
                MetricEarlyStoppingStrategy::new(
                    &LossMetric::<Accelerated<Flex>>::new(),
                    Aggregate::Mean,
                    Direction::Highest,
                    Split::Valid,
                    StoppingCondition::NoImprovementSince { n_epochs: n },
                )
            }),
            epochs: epochs.clone(),
        };
        Train::seed(&device, 5);
        let learner = Learner::new(Mlp::new(16, &device), AdamConfig::new().init(), args.lr);
        let builder = SupervisedTraining::new(&dir, Arc::new(train), valid)
            .num_epochs(args.epochs)
            .metric_valid_numeric(LossMetric::new())
            .metric_valid_numeric(AccuracyMetric::new())
            .renderer(QuietRenderer)
            .with_application_logger(None)
            .early_stopping(stopping)
            .summary();
        let builder = if args.perplexity {
            builder.metric_valid_numeric(PerplexityMetric::new())
        } else {
            builder
        };
        let builder = if args.best_checkpoint {
            builder
                .with_file_checkpointer(burn::record::CompactRecorder::new())
                .with_checkpointing_strategy(MetricCheckpointingStrategy::new(
                    &LossMetric::<Accelerated<Flex>>::new(),
                    Aggregate::Mean,
                    Direction::Highest,
                    Split::Valid,
                ))
        } else {
            builder
        };
        let builder = match args.install {
            Install::TrainingStrategy => {
                builder.with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
            }
            _ => builder.with_accelerate(strategy),
        };
        let _ = builder.launch(learner);
        let stats = report.stats();
        let main = state.is_main_process();
        let logged_losses = stats
            .epochs
            .iter()
            .filter(|_| main)
            .filter_map(|e| {
                logged_mean(
                    &dir.join("valid")
                        .join(format!("epoch-{}", e.epoch))
                        .join("Loss.log"),
                )
            })
            .collect();
        let summary_loss = main
            .then(|| burn::train::LearnerSummary::new(&dir, &["Loss"]).ok())
            .flatten()
            .and_then(|summary| {
                let text = summary.to_string();
                // The summary's table: `| Valid | Loss | min | epoch | max | epoch |`.
                text.lines()
                    .find(|l| l.contains("Valid") && l.contains("Loss"))
                    .map(|l| {
                        l.split('|')
                            .filter_map(|c| c.trim().parse::<f64>().ok())
                            .next()
                            .unwrap_or(f64::NAN)
                    })
            });
        let mut checkpoints: Vec<usize> = std::fs::read_dir(dir.join("checkpoint"))
            .into_iter()
            .flatten()
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("model-")?
                    .strip_suffix(".mpk")?
                    .parse()
                    .ok()
            })
            .collect();
        checkpoints.sort_unstable();
        // Every process is done reading before the main process clears the directory.
        state.group().unwrap().barrier().unwrap();
        if main {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let epochs = epochs.lock().unwrap().clone();
        Report {
            epochs,
            trained: stats.epochs.iter().map(|e| e.epoch).collect(),
            own_batches: stats.epochs.iter().map(|e| e.valid_batches).collect(),
            combined_batches: stats
                .epochs
                .iter()
                .map(|e| e.valid_batches_combined)
                .collect(),
            logged_losses,
            summary_loss,
            checkpoints: if main { checkpoints } else { Vec::new() },
            per_process_metrics: stats.valid_metrics_per_process,
        }
    }
}

fn relative(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

#[test]
fn every_process_validates_its_batches_and_reports_the_one_process_metrics() {
    const TEST: &str = "every_process_validates_its_batches_and_reports_the_one_process_metrics";
    if let Some(args) = worker::<validation::Run>() {
        return report(&validation::train(&args));
    }
    // 12 and 13 items in batches of 4 (13: a short last batch), and 2: fewer batches than
    // processes, so some process validates nothing.
    for valid_items in [12, 13, 2] {
        let run = validation::Run {
            valid_items,
            epochs: 2,
            lr: 0.0,
            stop_after: None,
            install: validation::Install::WithArtifactDir,
            best_checkpoint: false,
            perplexity: false,
        };
        let single: validation::Report = launch(TEST, 1, &run, &[]).assert_success().report(0);
        let batches = valid_items.div_ceil(4);
        assert_eq!(single.combined_batches, [batches, batches]);
        let want = |epoch: &validation::Epoch| (epoch.loss.unwrap(), epoch.accuracy.unwrap());
        for processes in [2, 3] {
            let reports: Vec<validation::Report> = launch(TEST, processes, &run, &[])
                .assert_success()
                .reports(processes);
            for (rank, r) in reports.iter().enumerate() {
                let case = format!("{valid_items} items, rank {rank} of {processes}");
                // Each process its own whole batches; together, one process's.
                assert_eq!(r.combined_batches, [batches, batches], "{case}");
                let own = batches / processes + usize::from(rank < batches % processes);
                assert_eq!(r.own_batches, [own, own], "{case}");
                assert_eq!(r.epochs.len(), 2, "{case}: {r:?}");
                for (got, single) in r.epochs.iter().zip(&single.epochs) {
                    let (loss, accuracy) = want(single);
                    let (got_loss, got_accuracy) = (
                        got.loss.unwrap_or_else(|| panic!("{case}: no loss: {r:?}")),
                        got.accuracy
                            .unwrap_or_else(|| panic!("{case}: no accuracy")),
                    );
                    assert!(
                        relative(got_loss, loss) <= 1e-6,
                        "{case}, epoch {}: loss {got_loss} vs {loss}",
                        got.epoch
                    );
                    assert!(
                        relative(got_accuracy, accuracy) <= 1e-6,
                        "{case}, epoch {}: accuracy {got_accuracy} vs {accuracy}",
                        got.epoch
                    );
                }
            }
            // The main process writes the logs (all processes' entries) and the summary.
            let main = &reports[0];
            assert_eq!(main.logged_losses.len(), 2, "{main:?}");
            for (logged, single) in main.logged_losses.iter().zip(&single.logged_losses) {
                assert!(relative(*logged, *single) <= 1e-6, "{logged} vs {single}");
            }
            let summary = main.summary_loss.expect("the main process's summary");
            let single_summary = single.summary_loss.unwrap();
            assert!(
                relative(summary, single_summary) <= 1e-6,
                "{summary} vs {single_summary}"
            );
            assert!(reports[1..].iter().all(|r| r.logged_losses.is_empty()));
        }
    }
}

#[test]
fn early_stopping_on_the_combined_metric_stops_every_process_at_the_same_epoch() {
    const TEST: &str =
        "early_stopping_on_the_combined_metric_stops_every_process_at_the_same_epoch";
    if let Some(args) = worker::<validation::Run>() {
        return report(&validation::train(&args));
    }
    // Training moves the model; the loss on the validation set falls, so "no rise since
    // one epoch" stops after epoch 2, decided by every process's own strategy from the
    // combined metric.
    let run = validation::Run {
        valid_items: 13,
        epochs: 5,
        lr: 1e-2,
        stop_after: Some(1),
        install: validation::Install::WithArtifactDir,
        best_checkpoint: true,
        perplexity: false,
    };
    let single: validation::Report = launch(TEST, 1, &run, &[]).assert_success().report(0);
    let stopped = single.trained.len();
    assert!(stopped < 5, "{single:?}");
    // Burn's best-checkpoint choice, made from the same metric.
    assert!(!single.checkpoints.is_empty(), "{single:?}");
    for processes in [2, 3] {
        let reports: Vec<validation::Report> = launch(TEST, processes, &run, &[])
            .assert_success()
            .reports(processes);
        for (rank, r) in reports.iter().enumerate() {
            assert_eq!(
                r.trained.len(),
                stopped,
                "rank {rank} of {processes}: {r:?}"
            );
            let decisions: Vec<bool> = r.epochs.iter().map(|e| e.stop).collect();
            let want: Vec<bool> = single.epochs.iter().map(|e| e.stop).collect();
            assert_eq!(
                decisions, want,
                "rank {rank} of {processes}: its own answers"
            );
            assert!(
                r.epochs.iter().all(|e| e.loss.is_some_and(f64::is_finite)),
                "rank {rank}: {r:?}"
            );
            // Every process read the same values.
            for (a, b) in r.epochs.iter().zip(&reports[0].epochs) {
                assert_eq!(a.loss, b.loss, "rank {rank}");
            }
        }
        assert_eq!(
            reports[0].checkpoints, single.checkpoints,
            "{processes} processes"
        );
    }
}

#[test]
fn without_the_artifact_directory_or_with_accelerate_the_metrics_are_still_the_whole_sets() {
    const TEST: &str =
        "without_the_artifact_directory_or_with_accelerate_the_metrics_are_still_the_whole_sets";
    if let Some(args) = worker::<validation::Run>() {
        return report(&validation::train(&args));
    }
    let run = |install| validation::Run {
        valid_items: 13,
        epochs: 2,
        lr: 0.0,
        stop_after: None,
        install,
        best_checkpoint: false,
        perplexity: false,
    };
    let single: validation::Report =
        launch(TEST, 1, &run(validation::Install::WithArtifactDir), &[])
            .assert_success()
            .report(0);
    // Without the directory the processes still validate their parts and combine them, and
    // the main process writes no log files (a warning says what to add); installed with
    // Burn's `with_training_strategy` the metrics cannot be combined, so every process
    // validates all 4 batches itself.
    for (install, own) in [
        (validation::Install::NoArtifactDir, [2, 2]),
        (validation::Install::TrainingStrategy, [4, 4]),
    ] {
        let reports: Vec<validation::Report> = launch(TEST, 2, &run(install), &[])
            .assert_success()
            .reports(2);
        for (rank, r) in reports.iter().enumerate() {
            assert_eq!(r.own_batches, own, "{install:?}, rank {rank}");
            assert_eq!(r.epochs.len(), 2, "{install:?}, rank {rank}: {r:?}");
            for (got, want) in r.epochs.iter().zip(&single.epochs) {
                let (got, want) = (got.loss.unwrap(), want.loss.unwrap());
                assert!(
                    relative(got, want) <= 1e-6,
                    "{install:?}, rank {rank}: {got} vs {want}"
                );
            }
        }
        if install == validation::Install::NoArtifactDir {
            assert!(reports[0].logged_losses.is_empty(), "{:?}", reports[0]);
        }
    }
}

#[test]
fn burns_perplexity_whose_entries_carry_state_is_rebuilt_across_processes() {
    const TEST: &str = "burns_perplexity_whose_entries_carry_state_is_rebuilt_across_processes";
    if let Some(args) = worker::<validation::Run>() {
        return report(&validation::train(&args));
    }
    // Burn's perplexity logs the epoch's perplexity so far with the tokens so far: no mean
    // of the processes' entries is the one-process value, so they are rebuilt from each
    // process's sums. 13 items (4 batches, the last of 1) and 2 (one batch on some
    // processes, none on the others).
    for valid_items in [13, 2] {
        let run = validation::Run {
            valid_items,
            epochs: 2,
            lr: 0.0,
            stop_after: None,
            install: validation::Install::WithArtifactDir,
            best_checkpoint: false,
            perplexity: true,
        };
        let single: validation::Report = launch(TEST, 1, &run, &[]).assert_success().report(0);
        for processes in [2, 3] {
            let reports: Vec<validation::Report> = launch(TEST, processes, &run, &[])
                .assert_success()
                .reports(processes);
            for (rank, r) in reports.iter().enumerate() {
                let case = format!("{valid_items} items, rank {rank} of {processes}");
                assert!(r.per_process_metrics.is_empty(), "{case}: {r:?}");
                assert_eq!(r.epochs.len(), 2, "{case}: {r:?}");
                for (got, want) in r.epochs.iter().zip(&single.epochs) {
                    for (name, got, want) in [
                        ("loss", got.loss, want.loss),
                        ("accuracy", got.accuracy, want.accuracy),
                        ("perplexity", got.perplexity, want.perplexity),
                    ] {
                        let (got, want) = (got.unwrap(), want.unwrap());
                        assert!(
                            relative(got, want) <= 1e-6,
                            "{case}: {name} {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
