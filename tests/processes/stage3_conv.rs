//! ZeRO stage 3's per-layer bound on convolutions: a small CNN (two `Conv2d`, a `ConvTranspose2d`,
//! a `Conv1d` and a linear head) gathers each convolution's weight and bias for its forward op
//! alone, and its weight again for its input's gradient, and ends where stage 2 does (bit for bit
//! on 2 processes, to rounding on 3); under bf16/f16 autocast a CNN of `Conv2d` layers does the
//! same in the half type, and so does a net of a `ConvTranspose2d`, a `Conv1d` and a `Conv3d`.

use super::*;

use burn::nn::conv::{
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, Conv3d, Conv3dConfig, ConvTranspose2d,
    ConvTranspose2dConfig,
};
use burn::nn::{PaddingConfig1d, PaddingConfig2d};
use burn_accelerate::autocast::{Op, OpClass, OpClasses, SmallOps, scope_op_classes};

#[derive(Module, Debug)]
struct ConvNet<B: Backend> {
    // [4, 2, 6, 6] -> [4, 6, 6, 6] (padded)
    first: Conv2d<B>,
    // -> [4, 8, 2, 2] (stride 2)
    second: Conv2d<B>,
    // -> [4, 4, 4, 4] (stride 2), read as [4, 4, 16]
    up: ConvTranspose2d<B>,
    // -> [4, 5, 16] (padded), read as [4, 80]
    third: Conv1d<B>,
    head: Linear<B>,
}

const BATCH: usize = 4;
const IN_CHANNELS: usize = 2;
const SIDE: usize = 6;

impl<B: Backend> ConvNet<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 19);
        Self {
            first: Conv2dConfig::new([IN_CHANNELS, 6], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            second: Conv2dConfig::new([6, 8], [3, 3])
                .with_stride([2, 2])
                .init(device),
            up: ConvTranspose2dConfig::new([8, 4], [2, 2])
                .with_stride([2, 2])
                .init(device),
            third: Conv1dConfig::new(4, 5, 3)
                .with_padding(PaddingConfig1d::Explicit(1, 1))
                .init(device),
            head: LinearConfig::new(80, CLASSES).init(device),
        }
    }

    fn logits(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let relu = Relu::new();
        let h = relu.forward(self.first.forward(x));
        let h = relu.forward(self.second.forward(h));
        let h = relu.forward(self.up.forward(h));
        let h = relu.forward(self.third.forward(h.reshape([BATCH, 4, 16])));
        self.head.forward(h.reshape([BATCH, 80]))
    }
}

/// Batch `step`'s images on process `process`: smooth values drawn from the step, the
/// process and the position, and a class per image from the same.
fn images<B: Backend>(
    step: usize,
    process: usize,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 1, Int>) {
    let seed = (step * 7 + process * 3) as f32;
    let x: Vec<f32> = (0..BATCH * IN_CHANNELS * SIDE * SIDE)
        .map(|i| ((i as f32 * 0.37 + seed).sin() + (i as f32 * 0.11).cos()) * 0.5)
        .collect();
    let y: Vec<i64> = (0..BATCH)
        .map(|i| ((step + process + i) % CLASSES) as i64)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [BATCH, IN_CHANNELS, SIDE, SIDE]), device),
        Tensor::from_data(TensorData::new(y, [BATCH]), device),
    )
}

/// Two `Conv2d` layers and a linear head: the layers whose parameters bf16/f16 autocast
/// gathers in the half type at stage 3.
#[derive(Module, Debug)]
struct HalfConvNet<B: Backend> {
    // [4, 2, 6, 6] -> [4, 6, 6, 6] (padded)
    first: Conv2d<B>,
    // -> [4, 8, 2, 2] (stride 2), read as [4, 32]
    second: Conv2d<B>,
    head: Linear<B>,
}

impl<B: Backend> HalfConvNet<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 23);
        Self {
            first: Conv2dConfig::new([IN_CHANNELS, 6], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            second: Conv2dConfig::new([6, 8], [3, 3])
                .with_stride([2, 2])
                .init(device),
            head: LinearConfig::new(32, CLASSES).init(device),
        }
    }

    fn logits(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let relu = Relu::new();
        let h = relu.forward(self.first.forward(x));
        let h = relu.forward(self.second.forward(h));
        self.head.forward(h.reshape([BATCH, 32]))
    }
}

/// A `ConvTranspose2d`, a `Conv1d` and a `Conv3d` and a linear head: under bf16/f16 autocast
/// the `Conv1d` runs on the crate's half convolution as a 2-D one (its weight reshaped), the
/// others on Burn's half convolutions.
#[derive(Module, Debug)]
struct OtherConvNet<B: Backend> {
    // [4, 2, 6, 6] -> [4, 3, 7, 7], read as [4, 3, 49]
    up: ConvTranspose2d<B>,
    // -> [4, 4, 49] (padded), read as [4, 1, 4, 7, 7]
    line: Conv1d<B>,
    // -> [4, 2, 3, 5, 5], read as [4, 150]
    volume: Conv3d<B>,
    head: Linear<B>,
}

impl<B: Backend> OtherConvNet<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 29);
        Self {
            up: ConvTranspose2dConfig::new([IN_CHANNELS, 3], [2, 2]).init(device),
            line: Conv1dConfig::new(3, 4, 3)
                .with_padding(PaddingConfig1d::Explicit(1, 1))
                .init(device),
            volume: Conv3dConfig::new([1, 2], [2, 3, 3]).init(device),
            head: LinearConfig::new(150, CLASSES).init(device),
        }
    }

    fn logits(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let relu = Relu::new();
        let h = relu.forward(self.up.forward(x));
        let h = relu.forward(self.line.forward(h.reshape([BATCH, 3, 49])));
        let h = relu.forward(self.volume.forward(h.reshape([BATCH, 1, 4, 7, 7])));
        self.head.forward(h.reshape([BATCH, 150]))
    }
}

/// Which net a test trains, on `images`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Net {
    /// `ConvNet`, without autocast.
    Conv,
    /// `HalfConvNet`, under bf16/f16 autocast.
    HalfConv,
    /// `OtherConvNet`, under bf16/f16 autocast; its convolutions in autocast's f32 class
    /// where `kept_f32`.
    OtherConv { kept_f32: bool },
}

impl Net {
    /// The net's parameters under its test's autocast.
    pub(super) fn layers(self) -> Vec<Vec<Gathered>> {
        match self {
            // Gathered in f32; every weight but the first layer's (whose input is the data)
            // again in backward for its input's gradient.
            Net::Conv => vec![
                weight_and_bias(6 * IN_CHANNELS * 9, 6, 4, false),
                weight_and_bias(8 * 6 * 9, 8, 4, true),
                weight_and_bias(8 * 4 * 2 * 2, 4, 4, true),
                weight_and_bias(5 * 4 * 3, 5, 4, true),
                weight_and_bias(80 * CLASSES, CLASSES, 4, true),
            ],
            // In halves, every weight again in backward: the first convolution's weight
            // gradient reads its weight too.
            Net::HalfConv => vec![
                weight_and_bias(6 * IN_CHANNELS * 9, 6, 2, true),
                weight_and_bias(8 * 6 * 9, 8, 2, true),
                weight_and_bias(32 * CLASSES, CLASSES, 2, true),
            ],
            // In halves, the convolutions' in f32 where they are kept in f32.
            Net::OtherConv { kept_f32 } => {
                let conv = if kept_f32 { 4 } else { 2 };
                vec![
                    weight_and_bias(IN_CHANNELS * 3 * 2 * 2, 3, conv, false),
                    weight_and_bias(4 * 3 * 3, 4, conv, true),
                    weight_and_bias(2 * 2 * 3 * 3, 2, conv, true),
                    weight_and_bias(150 * CLASSES, CLASSES, 2, true),
                ]
            }
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct ConvRun {
    training: Training,
    net: Net,
}

fn conv_worker(args: &ConvRun) -> Stage3Report {
    // The nets are tiny: under autocast every op it lowers is cast.
    let config = AccelerateConfig::new().with_small_ops(Some(SmallOps::Cast));
    conv_training::<Flex>(args.training, args.net, config)
}

/// `net` trained on `Accelerated<Autodiff<B>>` as `training` says (`config` for the rest),
/// observed by `observed_training`.
pub(super) fn conv_training<B: Backend>(
    training: Training,
    net: Net,
    config: AccelerateConfig,
) -> Stage3Report {
    let device = Default::default();
    let inputs = images::<Accelerated<Autodiff<B>>>;
    match net {
        Net::Conv => {
            let forward = |model: &ConvNet<_>, x| model.logits(x);
            observed_training(training, config, ConvNet::new(&device), inputs, forward, ())
        }
        Net::HalfConv => {
            let forward = |model: &HalfConvNet<_>, x| model.logits(x);
            observed_training(
                training,
                config,
                HalfConvNet::new(&device),
                inputs,
                forward,
                (),
            )
        }
        Net::OtherConv { kept_f32 } => {
            let forward = move |model: &OtherConvNet<_>, x| {
                // The convolutions in autocast's f32 class where asked: gathered in f32.
                let _classes = kept_f32.then(|| {
                    scope_op_classes(
                        [Op::ConvTranspose2d, Op::Conv1d, Op::Conv3d]
                            .into_iter()
                            .fold(OpClasses::new(), |c, op| c.with(op, OpClass::Fp32)),
                    )
                });
                model.logits(x)
            };
            observed_training(
                training,
                config,
                OtherConvNet::new(&device),
                inputs,
                forward,
                (),
            )
        }
    }
}

// Runs `(processes, precision, window)` of `net`, sharded from the start (every batch
// gathers), at stages 2 and 3, and checks stage 3 against stage 2, the formula and the
// bound: on every process and batch the largest layer's gathered bytes at the peak.
fn conv_against_stage_2(
    test: &str,
    net: Net,
    (processes, precision, grad_accum): (usize, Option<Precision>, usize),
) {
    let expected = Stage3Expected::new(net.layers(), processes);
    let training = Training::sharded(precision, grad_accum, 3);
    let args = |training| ConvRun { training, net };
    stage_3_against_stage_2::<_, ()>(
        test,
        &expected,
        training,
        (Peak::Bound, Agreement::Bits),
        args,
    );
}

/// Each layer's parameters are gathered for its ops alone: the most whole at once on a
/// process is one layer's weight and bias (the largest layer's),
/// where a convolution that kept its gathered parameters in the graph until the step would
/// hold several layers' at once, and still hold them after the backward pass. Each batch
/// sends what stage 3's f32 formula says (see
/// `stage_3_reduce_scatters_each_gradient_in_backward_and_sends_what_the_formula_says`):
/// every parameter gathered in forward, every weight above the first layer again for its
/// input's gradient, every gradient reduce-scattered on the batch that completes a window.
#[test]
fn stage_3_gathers_each_convolutions_parameters_for_its_ops_alone_and_ends_where_stage_2_does() {
    // The launcher runs the test by its whole path (`--exact`), this module's included.
    const TEST: &str = "stage3_conv::\
        stage_3_gathers_each_convolutions_parameters_for_its_ops_alone_and_ends_where_stage_2_does";
    if let Some(args) = worker::<ConvRun>() {
        return report(&conv_worker(&args));
    }
    for processes in [2, 3] {
        for grad_accum in [1, 2] {
            conv_against_stage_2(TEST, Net::Conv, (processes, None, grad_accum));
        }
    }
}

/// Under bf16 and f16 autocast (FSDP's `param_dtype`), a `Conv2d` gathers its weight and bias in
/// the half type the crate's half convolution runs in, for the forward op, and its weight again for
/// the backward pass (whose GEMMs read it for the input's gradient and the weight's: the first
/// layer's too); the gradients, cast back to f32, are reduce-scattered in f32. Stage 3 ends where
/// stage 2 does under the same autocast (bit for bit on 2 processes, to rounding on 3; f16 with the
/// loss scaler: the same outcomes and scale), one layer's halves are whole at a time, and each
/// batch sends what the formula says with two bytes a gathered value.
#[test]
fn stage_3_under_autocast_gathers_conv2d_parameters_in_the_half_type_like_stage_2() {
    const TEST: &str = "stage3_conv::\
        stage_3_under_autocast_gathers_conv2d_parameters_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<ConvRun>() {
        return report(&conv_worker(&args));
    }
    for (processes, precision, grad_accum) in [
        (2, Precision::Bf16, 2),
        (3, Precision::Bf16, 1),
        (2, Precision::F16, 1),
        (3, Precision::F16, 2),
    ] {
        conv_against_stage_2(
            TEST,
            Net::HalfConv,
            (processes, Some(precision), grad_accum),
        );
    }
}

/// Under bf16 and f16 autocast, a `Conv1d` (which autocast runs on the crate's half
/// convolution as a 2-D one, its weight reshaped inside the bounded node), a
/// `ConvTranspose2d` and a `Conv3d` (on Burn's own convolutions in the half type) gather
/// their weight and bias in the half type for the forward op alone, and their weight again
/// where backward reads it (the `Conv1d`'s GEMMs for both gradients; the others' input
/// gradient, which the first layer, reading the data, does not take). Stage 3 ends where
/// stage 2 does under the same autocast (bit for bit on 2 processes, to rounding on 3; f16:
/// the same outcomes and loss scale),
/// one layer's halves are whole at a time, none after backward, and each batch sends what the
/// formula says with two bytes a gathered value. With the convolutions in autocast's f32
/// class, they gather in f32 for their ops alone, with the same checks.
#[test]
fn stage_3_under_autocast_gathers_conv1d_conv3d_and_transposed_parameters_in_the_half_type_like_stage_2()
 {
    const TEST: &str = "stage3_conv::\
        stage_3_under_autocast_gathers_conv1d_conv3d_and_transposed_parameters_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<ConvRun>() {
        return report(&conv_worker(&args));
    }
    for (processes, precision, grad_accum, kept_f32) in [
        (2, Precision::Bf16, 2, false),
        (3, Precision::Bf16, 1, false),
        (2, Precision::F16, 1, false),
        (3, Precision::F16, 2, false),
        (2, Precision::Bf16, 1, true),
        (3, Precision::F16, 2, true),
    ] {
        let case = (processes, Some(precision), grad_accum);
        conv_against_stage_2(TEST, Net::OtherConv { kept_f32 }, case);
    }
}
