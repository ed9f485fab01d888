//! ZeRO stage 3's per-layer bound for the ops that autocast leaves reading a parameter in f32:
//! `nn::RmsNorm`'s product (`normalized * gamma.unsqueeze()`, a promote-class `mul`: under bf16/f16
//! autocast the half `normalized` is cast up to f32 and gamma read in f32), a `Linear` that the
//! small-op rule keeps in f32, a `matmul` of the fp32 class, and the convolutions under fp8
//! autocast (f32 operands, the weight rounded by its fp8 cast). Each gathers its parameters in f32
//! for the op alone (again in backward where the other operand's gradient reads them), and stage 3
//! ends where stage 2 does under the same autocast (bit for bit on 2 processes, to rounding on 3;
//! f16 with the loss scaler: the same outcomes and scale; fp8: the same amax histories and scales),
//! with at most one layer's gathered parameters whole at a time and each batch sending stage 3's
//! formula in the dtype each parameter is gathered in.

use super::stage3_norm::{NormKind, Normed, normed_layers};
use super::*;

use burn::nn::conv::{
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, ConvTranspose2d, ConvTranspose2dConfig,
};
use burn::nn::{PaddingConfig1d, PaddingConfig2d};
use burn_accelerate::autocast::{Op, OpClass, OpClasses, SmallOps};

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
    /// `stage3_norm`'s `Normed` of RMS norms on `[2, 2, features]` inputs (two sequences of
    /// two: gamma's gradient sums over two broadcast dimensions); `cast_linears`: every
    /// `Linear` in the half type (`SmallOps::Cast`), else the small-op rule's default, which
    /// keeps these tiny ones in f32 (`SmallOps::KeepF32`).
    RmsNormed { cast_linears: bool },
    /// `Mixed` (a bare matrix per layer, read by `matmul`), with the matmul overridden to the
    /// fp32 class.
    Fp32Matmul,
    /// `ConvNet` (under fp8).
    ConvNet,
}

#[derive(Debug, Serialize, Deserialize)]
struct BoundsRun {
    training: Training,
    model: Model,
}

fn bounds_worker(args: &BoundsRun) -> Stage3Report {
    let device: TrainingDevice = Default::default();
    let training = args.training;
    match args.model {
        Model::RmsNormed { cast_linears } => {
            let small_ops = match cast_linears {
                true => SmallOps::Cast,
                false => SmallOps::KeepF32,
            };
            let config = AccelerateConfig::new().with_small_ops(Some(small_ops));
            let model = Normed::<TrainingBackend>::new(NormKind::Rms, &device);
            let forward = |model: &Normed<_>, x| model.logits(x, true);
            observed_training(training, config, model, samples, forward, ())
        }
        Model::Fp32Matmul => {
            let classes = OpClasses::new().with(Op::Matmul, OpClass::Fp32);
            let config = AccelerateConfig::new().with_op_classes(classes);
            let forward = |model: &Mixed<_>, x| model.forward(x);
            observed_training(
                training,
                config,
                Mixed::<TrainingBackend>::new(&device),
                samples,
                forward,
                (),
            )
        }
        Model::ConvNet => {
            let model = ConvNet::<TrainingBackend>::new(&device);
            let forward = |model: &ConvNet<_>, x| model.forward(x);
            observed_training(
                training,
                AccelerateConfig::new(),
                model,
                samples,
                forward,
                (),
            )
        }
    }
}

/// The parameters of `model` under its test's autocast.
fn layers(model: Model) -> Vec<Vec<Gathered>> {
    match model {
        // A cast `Linear` gathers its weight and bias in the half type; gamma is read in f32
        // by the promote-class product.
        Model::RmsNormed { cast_linears } => {
            normed_layers(NormKind::Rms, if cast_linears { 2 } else { 4 })
        }
        Model::Fp32Matmul => Reads::Matmul.layers(4),
        // fp8 gathers f32 (and rounds it where the op reads it); every weight but the first
        // (whose input is the data) again in backward.
        Model::ConvNet => vec![
            weight_and_bias(6 * 2 * 9, 6, 4, false),
            weight_and_bias(6 * 4 * 2 * 2, 4, 4, true),
            weight_and_bias(5 * 4 * 3, 5, 4, true),
            weight_and_bias(80 * CLASSES, CLASSES, 4, true),
        ],
    }
}

// Runs `(processes, precision, window)` of `model`, sharded from the start, at stages 2 and
// 3 and checks stage 3 against stage 2, the formula and the bound: one layer's gathered
// parameters whole at a time, on every process and batch the largest such layer it does not
// own at its peak.
fn bounds_against_stage_2(
    test: &str,
    model: Model,
    (processes, precision, grad_accum): (usize, Precision, usize),
) {
    let expected = Stage3Expected::new(layers(model), processes);
    let training = Training::sharded(Some(precision), grad_accum, 3);
    let args = |training| BoundsRun { training, model };
    stage_3_against_stage_2::<_, ()>(
        test,
        &expected,
        training,
        (Peak::Bound, Agreement::Bits),
        args,
    );
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
/// does.
#[test]
fn stage_3_under_autocast_gathers_rms_norm_gamma_in_f32_for_its_product_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_autocast_gathers_rms_norm_gamma_in_f32_for_its_product_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    for case in CASES {
        bounds_against_stage_2(TEST, Model::RmsNormed { cast_linears: true }, case);
    }
}

/// Under bf16 and f16 autocast with the small-op rule's default, which keeps these tiny
/// `Linear`s in f32, each layer's weight and bias are gathered in f32 for its op alone (the
/// weight again for the input's gradient), as with autocast off, and the RMS norms' gammas as
/// above; stage 3 ends where stage 2 does.
#[test]
fn stage_3_under_autocast_gathers_a_linear_kept_in_f32_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_autocast_gathers_a_linear_kept_in_f32_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    for case in CASES {
        bounds_against_stage_2(
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
/// as with autocast off; stage 3 ends where stage 2 does.
#[test]
fn stage_3_under_autocast_gathers_an_fp32_class_matmul_parameter_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_bounds::stage_3_under_autocast_gathers_an_fp32_class_matmul_parameter_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<BoundsRun>() {
        return report(&bounds_worker(&args));
    }
    for case in CASES {
        bounds_against_stage_2(TEST, Model::Fp32Matmul, case);
    }
}

/// Under fp8 autocast (HYBRID and E4M3) a `Conv2d`, a `ConvTranspose2d` and a `Conv1d` read
/// f32 operands, the weight rounded by its fp8 cast: each gathers its weight and bias in f32
/// for its op alone, rounds the weight there with the op's own cast (its key, scale and amax
/// record), gathers and rounds it again for its input's gradient, and rounds the weight's
/// gradient as the cast node's backward does; stage 3 ends where stage 2 does, the fp8 state
/// bit for bit.
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
        bounds_against_stage_2(TEST, Model::ConvNet, case);
    }
}
