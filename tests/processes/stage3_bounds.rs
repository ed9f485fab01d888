//! ZeRO stage 3's per-layer bound for the ops that autocast leaves reading a parameter in f32:
//! `nn::RmsNorm`'s product (`normalized * gamma.unsqueeze()`, a promote-class `mul`: under
//! bf16/f16 autocast the half `normalized` is cast up to f32 and gamma read in f32), a
//! `Linear` that the small-op rule keeps in f32, a `matmul` of the fp32 class, and the
//! convolutions under fp8 autocast (f32 operands, the weight rounded by its fp8 cast). Each
//! gathers its parameters in f32 for the op alone (again in backward where the other
//! operand's gradient reads them), and stage 3 ends bit for bit where stage 2 does under the
//! same autocast (f16 with the loss scaler: the same outcomes and scale; fp8: the same amax
//! histories and scales), with at most one layer's gathered parameters whole at a time and
//! each batch sending stage 3's formula in the dtype each parameter is gathered in.

use super::*;

use burn::nn::conv::{
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, ConvTranspose2d, ConvTranspose2dConfig,
};
use burn::nn::{PaddingConfig1d, PaddingConfig2d, RmsNorm, RmsNormConfig};
use burn_accelerate::autocast::{Op, OpClass, OpClasses, SmallOps};
use burn_accelerate::fp8;

const HIDDEN: usize = 24;

/// linear → RmsNorm → linear → RmsNorm → linear head.
#[derive(Module, Debug)]
struct RmsNormed<B: Backend> {
    first: Linear<B>,
    norm: RmsNorm<B>,
    second: Linear<B>,
    second_norm: RmsNorm<B>,
    head: Linear<B>,
}

impl<B: Backend> RmsNormed<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 13);
        RmsNormed {
            first: LinearConfig::new(FEATURES, HIDDEN).init(device),
            norm: RmsNormConfig::new(HIDDEN).init(device),
            second: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            second_norm: RmsNormConfig::new(HIDDEN).init(device),
            head: LinearConfig::new(HIDDEN, CLASSES).init(device),
        }
    }

    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let relu = Relu::new();
        let h = relu.forward(self.norm.forward(self.first.forward(x)));
        let h = relu.forward(self.second_norm.forward(self.second.forward(h)));
        self.head.forward(h)
    }
}

/// A `Conv2d`, a `ConvTranspose2d`, a `Conv1d` and a linear head, on each sample's features
/// read as a `[2, 2, 2]` image.
#[derive(Module, Debug)]
struct ConvNet<B: Backend> {
    // [4, 2, 2, 2] -> [4, 6, 2, 2] (padded)
    conv: Conv2d<B>,
    // -> [4, 4, 4, 4] (stride 2), read as [4, 4, 16]
    up: ConvTranspose2d<B>,
    // -> [4, 5, 16] (padded), read as [4, 80]
    line: Conv1d<B>,
    head: Linear<B>,
}

impl<B: Backend> ConvNet<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 19);
        ConvNet {
            conv: Conv2dConfig::new([2, 6], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            up: ConvTranspose2dConfig::new([6, 4], [2, 2])
                .with_stride([2, 2])
                .init(device),
            line: Conv1dConfig::new(4, 5, 3)
                .with_padding(PaddingConfig1d::Explicit(1, 1))
                .init(device),
            head: LinearConfig::new(80, CLASSES).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let relu = Relu::new();
        let h = relu.forward(self.conv.forward(x.reshape([4, 2, 2, 2])));
        let h = relu.forward(self.up.forward(h));
        let h = relu.forward(self.line.forward(h.reshape([4, 4, 16])));
        self.head.forward(h.reshape([4, 80]))
    }
}

/// What each test trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Model {
    /// `RmsNormed` on `[2, 2, features]` inputs (two sequences of two: gamma's gradient sums
    /// over two broadcast dimensions); `cast_linears`: every `Linear` in the half type
    /// (`SmallOps::Cast`), else the small-op rule's default, which keeps these tiny ones in
    /// f32 (`SmallOps::KeepF32`).
    RmsNormed { cast_linears: bool },
    /// `Mixed` (a bare matrix per layer, read by `matmul`), with the matmul overridden to the
    /// fp32 class.
    Fp32Matmul,
    /// `ConvNet` (under fp8).
    ConvNet,
}

#[derive(Debug, Serialize, Deserialize)]
struct BoundsRun {
    zero_stage: u8,
    precision: Precision,
    grad_accum: usize,
    model: Model,
}

fn bounds_worker(args: &BoundsRun) -> Stage3Report {
    type B = Accelerated<Autodiff<Flex>>;
    let device = Default::default();
    match args.model {
        Model::RmsNormed { cast_linears } => {
            let small_ops = match cast_linears {
                true => SmallOps::Cast,
                false => SmallOps::KeepF32,
            };
            let config = AccelerateConfig::new().with_small_ops(Some(small_ops));
            bounds_training(args, config, RmsNormed::<B>::new(&device), |model, x| {
                let x: Tensor<B, 3> = x.reshape([2, 2, FEATURES]);
                model.forward(x).reshape([4, CLASSES])
            })
        }
        Model::Fp32Matmul => {
            B::seed(&device, 13);
            let model = Mixed::<B> {
                weights: LAYERED_WIDTHS
                    .windows(2)
                    .map(|w| {
                        burn::nn::Initializer::KaimingUniform {
                            gain: 1.0,
                            fan_out_only: false,
                        }
                        .init_with([w[0], w[1]], Some(w[0]), None, &device)
                    })
                    .collect(),
            };
            let config = AccelerateConfig::new()
                .with_op_classes(OpClasses::new().with(Op::Matmul, OpClass::Fp32));
            bounds_training(args, config, model, |model, mut h| {
                for weight in &model.weights {
                    h = Relu::new().forward(h.matmul(weight.val()));
                }
                h
            })
        }
        Model::ConvNet => {
            let model = ConvNet::<B>::new(&device);
            bounds_training(args, AccelerateConfig::new(), model, |model, x| {
                model.forward(x)
            })
        }
    }
}

// `stage3_autocast_more`'s loop, 3 windows.
fn bounds_training<M: burn::module::AutodiffModule<Accelerated<Autodiff<Flex>>>>(
    args: &BoundsRun,
    config: AccelerateConfig,
    model: M,
    forward: impl Fn(
        &M,
        Tensor<Accelerated<Autodiff<Flex>>, 2>,
    ) -> Tensor<Accelerated<Autodiff<Flex>>, 2>,
) -> Stage3Report {
    let run = (args.zero_stage, args.precision, args.grad_accum);
    observed_training(run, config, 3 * args.grad_accum, model, forward)
}

/// One parameter in visiting order: its values, the bytes a value it gathers takes, and
/// whether backward gathers it again (the other operand's gradient reads it).
type Gathered = (usize, u64, bool);

/// The parameters of `model` under its test's autocast, in visiting order, grouped by layer.
fn layers(model: Model) -> Vec<Vec<Gathered>> {
    match model {
        Model::RmsNormed { cast_linears } => {
            // A cast `Linear` gathers its weight and bias in the half type; gamma is read in
            // f32 by the promote-class product.
            let linear = if cast_linears { 2 } else { 4 };
            let layer = |inputs: usize, outputs: usize, again: bool| {
                vec![(inputs * outputs, linear, again), (outputs, linear, false)]
            };
            vec![
                // The first layer's input is the data: no gradient to compute.
                layer(FEATURES, HIDDEN, false),
                vec![(HIDDEN, 4, true)],
                layer(HIDDEN, HIDDEN, true),
                vec![(HIDDEN, 4, true)],
                layer(HIDDEN, CLASSES, true),
            ]
        }
        Model::Fp32Matmul => LAYERED_WIDTHS
            .windows(2)
            .enumerate()
            .map(|(i, w)| vec![(w[0] * w[1], 4, i > 0)])
            .collect(),
        // fp8 gathers f32 (and rounds it where the op reads it); every weight but the first
        // (whose input is the data) again in backward.
        Model::ConvNet => vec![
            vec![(6 * 2 * 9, 4, false), (6, 4, false)],
            vec![(6 * 4 * 2 * 2, 4, true), (4, 4, false)],
            vec![(5 * 4 * 3, 4, true), (5, 4, false)],
            vec![(80 * CLASSES, 4, true), (CLASSES, 4, false)],
        ],
    }
}

// Runs `(processes, precision, window)` of `model` at stages 2 and 3 and checks stage 3
// against stage 2, the bound and the formula.
fn stage_3_against_stage_2(
    test: &str,
    model: Model,
    (processes, precision, grad_accum): (usize, Precision, usize),
) {
    let layers = layers(model);
    let params: Vec<Gathered> = layers.iter().flatten().copied().collect();
    let layer_bytes: Vec<u64> = layers
        .iter()
        .map(|layer| layer.iter().map(|&(v, size, _)| v as u64 * size).sum())
        .collect();
    let largest = *layer_bytes.iter().max().unwrap();
    let all: u64 = layer_bytes.iter().sum();
    let sizes: Vec<usize> = params.iter().map(|&(values, _, _)| values).collect();
    let owners = burn_accelerate::zero::partition(&sizes, processes);
    // The most a process holds gathered at once where each layer's parameters are whole for
    // its ops alone: the largest of the layers' bytes it does not own (a layer's forward op
    // gathers them all; its backward, the weight again, no more). An op that kept its
    // gathered parameters until the step would add them to every later layer's.
    let bound = |rank: usize| -> u64 {
        let mut owner = owners.iter();
        layers
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .filter(|_| *owner.next().unwrap() != rank)
                    .map(|&(values, size, _)| values as u64 * size)
                    .sum::<u64>()
            })
            .max()
            .unwrap()
    };
    // Gathers in each parameter's gathered dtype, reductions in f32 (4).
    let expected = |rank: usize, reduces: bool| -> u64 {
        stage_3_sent(
            params
                .iter()
                .map(|&(values, size, again)| (size * values as u64, 4 * values as u64, again)),
            &owners,
            processes,
            rank,
            reduces,
        )
    };
    let run = |zero_stage: u8| -> Vec<Stage3Report> {
        launch(
            test,
            processes,
            &BoundsRun {
                zero_stage,
                precision,
                grad_accum,
                model,
            },
            &[],
        )
        .assert_success()
        .reports(processes)
    };
    let (stage2, stage3) = (run(2), run(3));
    let case = format!("{model:?}, {processes} processes, {precision:?}, window {grad_accum}");
    // One layer's gathered parameters whole at a time, on every process and batch: the
    // largest such layer at its peak.
    let peaks: Vec<&[u64]> = stage3.iter().map(|r| r.gathered_peak.as_slice()).collect();
    let bounds: Vec<u64> = (0..processes).map(bound).collect();
    for (rank, peaks) in peaks.iter().enumerate() {
        assert!(
            peaks.iter().all(|&peak| peak == bounds[rank]),
            "{case}: the peaks {peaks:?} against the bounds {bounds:?}"
        );
    }
    for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
        let what = format!("{case}, rank {rank}");
        assert_eq!(s3.outcomes, s2.outcomes, "{what}");
        assert_eq!(s3.loss_scale, s2.loss_scale, "{what}");
        assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
        // The same amax histories and scales: the weights' amaxes seen in the gathered
        // values, their gradients' (HYBRID) after the same rounding.
        assert_eq!(s3.fp8_state, s2.fp8_state, "{what}");
        for (batch, &sent) in s3.sent.iter().enumerate() {
            let what = format!("{what}, batch {batch}");
            // Below one layer's parameters; nothing left whole after the backward pass.
            let peak = s3.gathered_peak[batch];
            assert!(peak <= largest && peak < all, "{what}: {peak} > {largest}");
            assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
            let completes = (batch + 1).is_multiple_of(grad_accum);
            assert_sent(sent, expected(rank, completes), &what);
            if completes {
                let own: Vec<bool> = owners.iter().map(|&o| o == rank).collect();
                assert_eq!(s3.holds_gradient[batch], own, "{what}");
            }
            // Stage 2 gathers and sends nothing in its passes.
            assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
        }
    }
    match precision {
        // The loss scaler scaled the f16 losses (and compared its scale above).
        Precision::F16 => assert!(stage3[0].loss_scale > 1.0, "{:?}", stage3[0].loss_scale),
        Precision::Fp8(_) => {
            // The state read is the training's: every weight's forward rounding recorded
            // (the input 1 of each layer's op), once a pass.
            let state: fp8::Fp8State =
                serde_json::from_str(stage3[0].fp8_state.as_deref().unwrap()).unwrap();
            assert_eq!(state.steps(), 3 * grad_accum as u64);
            let weights = state
                .tensors()
                .filter(|(key, _)| key.input == 1 && key.pass == fp8::Pass::Forward)
                .count();
            assert_eq!(weights, 4);
        }
        _ => {}
    }
}

// Each process count, window and half type at least once (f16 with the loss scaler). A
// window of 2 first: there a gathered value an op kept until the step would be whole in the
// window's second batch from its start, above any one layer's.
const CASES: [(usize, Precision, usize); 4] = [
    (2, Precision::Bf16, 2),
    (3, Precision::Bf16, 1),
    (2, Precision::F16, 1),
    (3, Precision::F16, 2),
];

/// Under bf16 and f16 autocast, with every `Linear` cast to the half type, an RMS norm's
/// product reads gamma in f32 (autocast casts the half `normalized` up to f32: `mul` is a
/// promote-class op): gamma is gathered in f32 for the product alone and again for
/// `normalized`'s gradient, while the linear layers gather halves; stage 3 ends where stage 2
/// does, bit for bit.
#[test]
fn stage_3_under_autocast_gathers_rms_norm_gamma_in_f32_for_its_product_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_autocast_gathers_rms_norm_gamma_in_f32_for_its_product_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    for case in CASES {
        stage_3_against_stage_2(TEST, Model::RmsNormed { cast_linears: true }, case);
    }
}

/// Under bf16 and f16 autocast with the small-op rule's default, which keeps these tiny
/// `Linear`s in f32, each layer's weight and bias are gathered in f32 for its op alone (the
/// weight again for the input's gradient), as with autocast off, and the RMS norms' gammas as
/// above; stage 3 ends where stage 2 does, bit for bit.
#[test]
fn stage_3_under_autocast_gathers_a_linear_kept_in_f32_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_autocast_gathers_a_linear_kept_in_f32_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    for case in CASES {
        stage_3_against_stage_2(
            TEST,
            Model::RmsNormed {
                cast_linears: false,
            },
            case,
        );
    }
}

/// Under bf16 and f16 autocast with `matmul` in the fp32 class, a bare matrix read by
/// `matmul` is gathered in f32 for the product alone (again for the activations' gradient),
/// as with autocast off; stage 3 ends where stage 2 does, bit for bit.
#[test]
fn stage_3_under_autocast_gathers_an_fp32_class_matmul_parameter_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_autocast_gathers_an_fp32_class_matmul_parameter_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    for case in CASES {
        stage_3_against_stage_2(TEST, Model::Fp32Matmul, case);
    }
}

/// Under fp8 autocast (HYBRID and E4M3) a `Conv2d`, a `ConvTranspose2d` and a `Conv1d` read
/// f32 operands, the weight rounded by its fp8 cast: each gathers its weight and bias in f32
/// for its op alone, rounds the weight there with the op's own cast (its key, scale and amax
/// record), gathers and rounds it again for its input's gradient, and rounds the weight's
/// gradient as the cast node's backward does; stage 3 ends where stage 2 does, bit for bit,
/// the fp8 state included.
#[test]
fn stage_3_under_fp8_gathers_each_convolutions_parameters_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_fp8_gathers_each_convolutions_parameters_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    let hybrid = Precision::Fp8(Fp8Mode::Hybrid);
    let e4m3 = Precision::Fp8(Fp8Mode::E4M3);
    for case in [(2, hybrid, 2), (3, hybrid, 1), (2, e4m3, 1), (3, e4m3, 2)] {
        stage_3_against_stage_2(TEST, Model::ConvNet, case);
    }
}
