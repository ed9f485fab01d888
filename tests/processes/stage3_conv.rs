//! ZeRO stage 3's per-layer bound on convolutions: a small CNN (two `Conv2d`, a
//! `ConvTranspose2d`, a `Conv1d` and a linear head) gathers each convolution's weight and
//! bias for its forward op alone, and its weight again for its input's gradient, and ends
//! where stage 2 does, bit for bit; under bf16/f16 autocast a CNN of `Conv2d` layers does the
//! same in the half type, and so does a net of a `ConvTranspose2d`, a `Conv1d` and a `Conv3d`.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::conv::{
    Conv1d, Conv1dConfig, Conv2d, Conv2dConfig, Conv3d, Conv3dConfig, ConvTranspose2d,
    ConvTranspose2dConfig,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, PaddingConfig1d, PaddingConfig2d, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{launch, report, worker};
use super::{CLASSES, assert_sent, bits, parameters, stage_3_sent};

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

/// Every parameter of `ConvNet` in visiting order (each layer's weight, then its bias): its
/// values, and whether it is a weight read again in backward (every layer's but the first,
/// whose input is the data).
fn conv_net_parameters() -> Vec<(usize, bool)> {
    vec![
        (6 * IN_CHANNELS * 9, false),
        (6, false),
        (8 * 6 * 9, true),
        (8, false),
        (8 * 4 * 2 * 2, true),
        (4, false),
        (5 * 4 * 3, true),
        (5, false),
        (80 * CLASSES, true),
        (CLASSES, false),
    ]
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

#[derive(Debug, Serialize, Deserialize)]
struct ConvRun {
    zero_stage: u8,
    grad_accum: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct ConvReport {
    parameters: Vec<f32>,
    /// Per batch: the bytes sent during its forward and backward passes, the most gathered
    /// bytes whole at once then, and those still whole after its backward pass.
    sent: Vec<u64>,
    gathered_peak: Vec<u64>,
    gathered_after_backward: Vec<u64>,
}

fn conv_worker(args: &ConvRun) -> ConvReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = ConvNet::<B>::new(&device);
    let mut accelerator = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap())
        .init::<B>(&device)
        .unwrap();
    // Sharded from the start: every batch gathers.
    model = accelerator.prepare_model(model);
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = ConvReport {
        parameters: Vec::new(),
        sent: Vec::new(),
        gathered_peak: Vec::new(),
        gathered_after_backward: Vec::new(),
    };
    for step in 0..3 * args.grad_accum {
        let (x, y) = images::<B>(step, state.process_index(), &device);
        let _step = accelerator.accumulate(&model);
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(model.logits(x), y);
        accelerator.backward(loss, &model);
        report
            .sent
            .push(burn_accelerate::zero::sent_bytes() - before);
        let bytes = burn_accelerate::zero::gathered_bytes();
        report.gathered_peak.push(bytes.peak);
        report.gathered_after_backward.push(bytes.alive);
        let (next, _) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        model = next;
    }
    report.parameters = parameters(&model);
    report
}

/// Each layer's parameters are gathered for its ops alone: the most whole at once on a
/// process is one layer's weight and bias that it does not own (the largest such layer),
/// where a convolution that kept its gathered parameters in the graph until the step would
/// hold several layers' at once, and still hold them after the backward pass. Each batch
/// sends what stage 3's f32 formula says (see
/// `stage_3_reduces_each_gradient_to_its_owner_in_backward_and_sends_what_the_formula_says`):
/// every parameter gathered in forward, every weight above the first layer again for its
/// input's gradient, every gradient reduced to its owner on the batch that completes a window.
#[test]
fn stage_3_gathers_each_convolutions_parameters_for_its_ops_alone_and_ends_where_stage_2_does() {
    // The launcher runs the test by its whole path (`--exact`), this module's included.
    const TEST: &str = "stage3_conv::\
        stage_3_gathers_each_convolutions_parameters_for_its_ops_alone_and_ends_where_stage_2_does";
    if let Some(args) = worker::<ConvRun>() {
        return report(&conv_worker(&args));
    }
    let params = conv_net_parameters();
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    for processes in [2, 3] {
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        let expected_sent = |rank: usize, reduces: bool| -> u64 {
            stage_3_sent(
                params
                    .iter()
                    .map(|&(values, again)| (4 * values as u64, 4 * values as u64, again)),
                &owners,
                processes,
                rank,
                reduces,
            )
        };
        // The bound: the largest of the layers' (weight and bias) bytes this process does
        // not own. Without it, every parameter it does not own would be whole at once.
        let bound = |rank: usize| -> u64 {
            let gathered: Vec<u64> = sizes
                .iter()
                .zip(&owners)
                .map(|(&values, &owner)| if owner == rank { 0 } else { 4 * values as u64 })
                .collect();
            gathered
                .chunks(2)
                .map(|layer| layer.iter().sum())
                .max()
                .unwrap()
        };
        for grad_accum in [1, 2] {
            let run = |zero_stage: u8| -> Vec<ConvReport> {
                launch(
                    TEST,
                    processes,
                    &ConvRun {
                        zero_stage,
                        grad_accum,
                    },
                    &[],
                )
                .assert_success()
                .reports(processes)
            };
            let (stage2, stage3) = (run(2), run(3));
            for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
                let what = format!("{processes} processes, window {grad_accum}, rank {rank}");
                // Burn's conv ops and backward ops in Burn's order: stage 2's bits.
                assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
                for (batch, &sent) in s3.sent.iter().enumerate() {
                    let what = format!("{what}, batch {batch}");
                    let completes = (batch + 1).is_multiple_of(grad_accum);
                    assert_sent(sent, expected_sent(rank, completes), &what);
                    assert_eq!(s3.gathered_peak[batch], bound(rank), "{what}");
                    assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
                    // Stage 2 gathers and sends nothing in its passes.
                    assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
                }
            }
        }
    }
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

#[derive(Debug, Serialize, Deserialize)]
struct HalfConvRun {
    zero_stage: u8,
    /// bf16, or f16 with the loss scaler.
    precision: Precision,
    grad_accum: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct HalfConvReport {
    run: ConvReport,
    outcomes: Vec<String>,
    loss_scale: f32,
}

fn half_conv_worker(args: &HalfConvRun) -> HalfConvReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = HalfConvNet::<B>::new(&device);
    let mut accelerator = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_mixed_precision(args.precision)
        // The net is tiny: every op autocast lowers is cast.
        .with_small_ops(Some(burn_accelerate::autocast::SmallOps::Cast))
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap())
        .init::<B>(&device)
        .unwrap();
    model = accelerator.prepare_model(model);
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = HalfConvReport {
        run: ConvReport {
            parameters: Vec::new(),
            sent: Vec::new(),
            gathered_peak: Vec::new(),
            gathered_after_backward: Vec::new(),
        },
        outcomes: Vec::new(),
        loss_scale: 0.0,
    };
    for step in 0..3 * args.grad_accum {
        let (x, y) = images::<B>(step, state.process_index(), &device);
        let _step = accelerator.accumulate(&model);
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let loss = {
            let _autocast = accelerator.autocast();
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(model.logits(x), y)
        };
        accelerator.backward(loss, &model);
        let run = &mut report.run;
        run.sent.push(burn_accelerate::zero::sent_bytes() - before);
        let bytes = burn_accelerate::zero::gathered_bytes();
        run.gathered_peak.push(bytes.peak);
        run.gathered_after_backward.push(bytes.alive);
        let (next, outcome) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        report.outcomes.push(format!("{outcome:?}"));
        model = next;
    }
    report.run.parameters = parameters(&model);
    report.loss_scale = accelerator.loss_scale().loss_scale();
    report
}

/// Under bf16 and f16 autocast (FSDP's `param_dtype`), a `Conv2d` gathers its weight and bias
/// in the half type the crate's half convolution runs in, for the forward op, and its weight
/// again for the backward pass (whose GEMMs read it for the input's gradient and the
/// weight's: the first layer's too); the gradients, cast back to f32, are reduced in f32 to
/// their owners. Stage 3 ends where stage 2 does under the same autocast, bit for bit (f16
/// with the loss scaler: the same outcomes and scale), one layer's halves are whole at a time,
/// and each batch sends what the formula says with two bytes a gathered value.
#[test]
fn stage_3_under_autocast_gathers_conv2d_parameters_in_the_half_type_like_stage_2() {
    const TEST: &str = "stage3_conv::\
        stage_3_under_autocast_gathers_conv2d_parameters_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<HalfConvRun>() {
        return report(&half_conv_worker(&args));
    }
    // Each parameter in visiting order: its values, and whether it is a weight read again in
    // backward (every one: the first convolution's weight gradient reads its weight too).
    let params: Vec<(usize, bool)> = vec![
        (6 * IN_CHANNELS * 9, true),
        (6, false),
        (8 * 6 * 9, true),
        (8, false),
        (32 * CLASSES, true),
        (CLASSES, false),
    ];
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    for (processes, precision, grad_accum) in [
        (2, Precision::Bf16, 2),
        (3, Precision::Bf16, 1),
        (2, Precision::F16, 1),
        (3, Precision::F16, 2),
    ] {
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        // Gathers in halves (2 bytes a value), reductions in f32 (4).
        let expected_sent = |rank: usize, reduces: bool| -> u64 {
            stage_3_sent(
                params
                    .iter()
                    .map(|&(values, again)| (2 * values as u64, 4 * values as u64, again)),
                &owners,
                processes,
                rank,
                reduces,
            )
        };
        let bound = |rank: usize| -> u64 {
            let gathered: Vec<u64> = sizes
                .iter()
                .zip(&owners)
                .map(|(&values, &owner)| if owner == rank { 0 } else { 2 * values as u64 })
                .collect();
            gathered
                .chunks(2)
                .map(|layer| layer.iter().sum())
                .max()
                .unwrap()
        };
        let run = |zero_stage: u8| -> Vec<HalfConvReport> {
            launch(
                TEST,
                processes,
                &HalfConvRun {
                    zero_stage,
                    precision,
                    grad_accum,
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what =
                format!("{processes} processes, {precision:?}, window {grad_accum}, rank {rank}");
            assert_eq!(s3.outcomes, s2.outcomes, "{what}");
            assert_eq!(s3.loss_scale, s2.loss_scale, "{what}");
            let (s3, s2) = (&s3.run, &s2.run);
            assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
            for (batch, &sent) in s3.sent.iter().enumerate() {
                let what = format!("{what}, batch {batch}");
                let completes = (batch + 1).is_multiple_of(grad_accum);
                assert_sent(sent, expected_sent(rank, completes), &what);
                assert_eq!(s3.gathered_peak[batch], bound(rank), "{what}");
                assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
                assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
            }
        }
        if precision == Precision::F16 {
            // The loss scaler scaled the f16 losses (and compared its scale above).
            assert!(stage3[0].loss_scale > 1.0, "{:?}", stage3[0].loss_scale);
        }
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

#[derive(Debug, Serialize, Deserialize)]
struct OtherConvRun {
    zero_stage: u8,
    precision: Precision,
    grad_accum: usize,
    /// The convolutions in autocast's f32 class: gathered in f32.
    kept_f32: bool,
}

fn other_conv_worker(args: &OtherConvRun) -> HalfConvReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = OtherConvNet::<B>::new(&device);
    let mut accelerator = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_mixed_precision(args.precision)
        // The net is tiny: every op autocast lowers is cast.
        .with_small_ops(Some(burn_accelerate::autocast::SmallOps::Cast))
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap())
        .init::<B>(&device)
        .unwrap();
    model = accelerator.prepare_model(model);
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = HalfConvReport {
        run: ConvReport {
            parameters: Vec::new(),
            sent: Vec::new(),
            gathered_peak: Vec::new(),
            gathered_after_backward: Vec::new(),
        },
        outcomes: Vec::new(),
        loss_scale: 0.0,
    };
    for step in 0..3 * args.grad_accum {
        let (x, y) = images::<B>(step, state.process_index(), &device);
        let _step = accelerator.accumulate(&model);
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let loss = {
            let _autocast = accelerator.autocast();
            // The convolutions in autocast's f32 class where asked: gathered in f32.
            let _classes = args.kept_f32.then(|| {
                use burn_accelerate::autocast::{Op, OpClass, OpClasses, scope_op_classes};
                scope_op_classes(
                    [Op::ConvTranspose2d, Op::Conv1d, Op::Conv3d]
                        .into_iter()
                        .fold(OpClasses::new(), |c, op| c.with(op, OpClass::Fp32)),
                )
            });
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(model.logits(x), y)
        };
        accelerator.backward(loss, &model);
        let run = &mut report.run;
        run.sent.push(burn_accelerate::zero::sent_bytes() - before);
        let bytes = burn_accelerate::zero::gathered_bytes();
        run.gathered_peak.push(bytes.peak);
        run.gathered_after_backward.push(bytes.alive);
        let (next, outcome) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        report.outcomes.push(format!("{outcome:?}"));
        model = next;
    }
    report.run.parameters = parameters(&model);
    report.loss_scale = accelerator.loss_scale().loss_scale();
    report
}

/// Under bf16 and f16 autocast, a `Conv1d` (which autocast runs on the crate's half
/// convolution as a 2-D one, its weight reshaped inside the bounded node), a
/// `ConvTranspose2d` and a `Conv3d` (on Burn's own convolutions in the half type) gather
/// their weight and bias in the half type for the forward op alone, and their weight again
/// where backward reads it (the `Conv1d`'s GEMMs for both gradients; the others' input
/// gradient, which the first layer, reading the data, does not take). Stage 3 ends where
/// stage 2 does under the same autocast, bit for bit (f16: the same outcomes and loss scale),
/// one layer's halves are whole at a time, none after backward, and each batch sends what the
/// formula says with two bytes a gathered value. With the convolutions in autocast's f32
/// class, they gather in f32 for their ops alone, with the same checks.
#[test]
fn stage_3_under_autocast_gathers_conv1d_conv3d_and_transposed_parameters_in_the_half_type_like_stage_2()
 {
    const TEST: &str = "stage3_conv::\
        stage_3_under_autocast_gathers_conv1d_conv3d_and_transposed_parameters_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<OtherConvRun>() {
        return report(&other_conv_worker(&args));
    }
    // Each parameter in visiting order: its values, and whether it is a weight read again in
    // backward.
    let params: Vec<(usize, bool)> = vec![
        (IN_CHANNELS * 3 * 2 * 2, false),
        (3, false),
        (4 * 3 * 3, true),
        (4, false),
        (2 * 2 * 3 * 3, true),
        (2, false),
        (150 * CLASSES, true),
        (CLASSES, false),
    ];
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    for (processes, precision, grad_accum, kept_f32) in [
        (2, Precision::Bf16, 2, false),
        (3, Precision::Bf16, 1, false),
        (2, Precision::F16, 1, false),
        (3, Precision::F16, 2, false),
        (2, Precision::Bf16, 1, true),
        (3, Precision::F16, 2, true),
    ] {
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        // Gathers in halves (2 bytes a value), the convolutions' (the first six parameters)
        // in f32 where they are kept in f32; reductions in f32 (4).
        let width = |param: usize| -> u64 { if kept_f32 && param < 6 { 4 } else { 2 } };
        let expected_sent = |rank: usize, reduces: bool| -> u64 {
            stage_3_sent(
                params.iter().enumerate().map(|(param, &(values, again))| {
                    (width(param) * values as u64, 4 * values as u64, again)
                }),
                &owners,
                processes,
                rank,
                reduces,
            )
        };
        let bound = |rank: usize| -> u64 {
            let gathered: Vec<u64> = sizes
                .iter()
                .zip(&owners)
                .enumerate()
                .map(|(param, (&values, &owner))| match owner == rank {
                    true => 0,
                    false => width(param) * values as u64,
                })
                .collect();
            gathered
                .chunks(2)
                .map(|layer| layer.iter().sum())
                .max()
                .unwrap()
        };
        let run = |zero_stage: u8| -> Vec<HalfConvReport> {
            launch(
                TEST,
                processes,
                &OtherConvRun {
                    zero_stage,
                    precision,
                    grad_accum,
                    kept_f32,
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what = format!(
                "{processes} processes, {precision:?}, window {grad_accum}, kept in f32 \
                 {kept_f32}, rank {rank}"
            );
            assert_eq!(s3.outcomes, s2.outcomes, "{what}");
            assert_eq!(s3.loss_scale, s2.loss_scale, "{what}");
            let (s3, s2) = (&s3.run, &s2.run);
            assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
            for (batch, &sent) in s3.sent.iter().enumerate() {
                let what = format!("{what}, batch {batch}");
                let completes = (batch + 1).is_multiple_of(grad_accum);
                assert_sent(sent, expected_sent(rank, completes), &what);
                assert_eq!(s3.gathered_peak[batch], bound(rank), "{what}");
                assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
                assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
            }
        }
        if precision == Precision::F16 {
            assert!(stage3[0].loss_scale > 1.0, "{:?}", stage3[0].loss_scale);
        }
    }
}
