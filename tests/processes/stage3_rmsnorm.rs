//! ZeRO stage 3's per-layer bound through RMS norms: `nn::RmsNorm` between linear layers
//! (`normalized * gamma.unsqueeze()`: a reshape of gamma, then a broadcast product) gathers
//! gamma for its product alone, and again for its input's gradient, and ends where stage 2
//! does, bit for bit; under bf16 autocast it still ends where stage 2 does (its bound there:
//! `stage3_bounds`).

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu, RmsNorm, RmsNormConfig};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{launch, report, worker};
use super::{Batch, CLASSES, FEATURES, Samples, assert_sent, bits, parameters, stage_3_sent};

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

#[derive(Debug, Serialize, Deserialize)]
struct RmsRun {
    zero_stage: u8,
    grad_accum: usize,
    /// The layers read a 3-D input (`[2, 2, features]`: two sequences of two), so that the
    /// parameters' gradients sum over two broadcast dimensions.
    sequences: bool,
    /// Under autocast (every linear layer cast: the net is tiny: `SmallOps::Cast`).
    precision: Option<Precision>,
}

#[derive(Debug, Serialize, Deserialize)]
struct RmsReport {
    parameters: Vec<f32>,
    /// Per batch: the bytes sent during its forward and backward passes, the most gathered
    /// bytes whole at once then, and those still whole after its backward pass.
    sent: Vec<u64>,
    gathered_peak: Vec<u64>,
    gathered_after_backward: Vec<u64>,
}

fn rms_worker(args: &RmsRun) -> RmsReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = burn_accelerate::distributed::ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = RmsNormed::<B>::new(&device);
    let mut config = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap());
    if let Some(precision) = args.precision {
        config = config
            .with_mixed_precision(precision)
            .with_small_ops(Some(burn_accelerate::autocast::SmallOps::Cast));
    }
    let mut accelerator = config.init::<B>(&device).unwrap();
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = RmsReport {
        parameters: Vec::new(),
        sent: Vec::new(),
        gathered_peak: Vec::new(),
        gathered_after_backward: Vec::new(),
    };
    for step in 0..3 * args.grad_accum + 1 {
        let items: Vec<usize> = (0..4)
            .map(|i| step * 16 + state.process_index() * 4 + i)
            .collect();
        let batch: Batch<B> = Samples.batch(items, &device);
        let _step = accelerator.accumulate(&model);
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let loss = {
            let _autocast = args.precision.map(|_| accelerator.autocast());
            let logits = if args.sequences {
                let x: Tensor<B, 3> = batch.x.reshape([2, 2, FEATURES]);
                model.forward(x).reshape([4, CLASSES])
            } else {
                model.forward(batch.x)
            };
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(logits, batch.y)
        };
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

/// Stage 3 through RMS norms: from the first step on, at most one layer's gathered
/// parameters are whole at a time (a linear layer's weight and bias, or an RMS norm's gamma,
/// whose reshape gathers nothing), nothing gathered is left whole after the backward pass,
/// each batch sends what stage 3's formula says (an RMS norm's gamma gathered for its product
/// and again in backward for its input's gradient, as a linear layer's weight above the first
/// is), and the parameters end where stage 2's do, bit for bit.
#[test]
fn stage_3_holds_one_rms_norms_gathered_gamma_at_a_time_and_ends_where_stage_2_does() {
    const TEST: &str = "stage3_rmsnorm::stage_3_holds_one_rms_norms_gathered_gamma_at_a_time_and_ends_where_stage_2_does";
    if let Some(args) = worker::<RmsRun>() {
        return report(&rms_worker(&args));
    }
    // Every parameter in visiting order: its values, and whether it is read again in backward
    // (a weight whose input is not the data; a gamma: its input is a linear layer's output).
    let params: [(usize, bool); 8] = [
        (FEATURES * HIDDEN, false),
        (HIDDEN, false),
        (HIDDEN, true),
        (HIDDEN * HIDDEN, true),
        (HIDDEN, false),
        (HIDDEN, true),
        (HIDDEN * CLASSES, true),
        (CLASSES, false),
    ];
    // Each layer's parameters' values: the bound.
    let layers = [
        FEATURES * HIDDEN + HIDDEN,
        HIDDEN,
        HIDDEN * HIDDEN + HIDDEN,
        HIDDEN,
        HIDDEN * CLASSES + CLASSES,
    ];
    let largest = 4 * *layers.iter().max().unwrap() as u64;
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    for (processes, grad_accum, sequences) in [
        (2, 1, false),
        (2, 2, false),
        (3, 1, false),
        (3, 2, false),
        (2, 2, true),
    ] {
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        // Gathers and reductions in f32.
        let expected = |rank: usize, reduces: bool| -> u64 {
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
        let run = |zero_stage: u8| -> Vec<RmsReport> {
            launch(
                TEST,
                processes,
                &RmsRun {
                    zero_stage,
                    grad_accum,
                    sequences,
                    precision: None,
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what =
                format!("{processes} processes, window {grad_accum}, 3-D {sequences}, rank {rank}");
            assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
            for batch in 0..s3.sent.len() {
                let what = format!("{what}, batch {batch}");
                // Stage 2 gathers and sends nothing in its passes.
                assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
                assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
                if batch < grad_accum {
                    // The first window: the model is whole everywhere.
                    assert_eq!((s3.sent[batch], s3.gathered_peak[batch]), (0, 0), "{what}");
                    continue;
                }
                let peak = s3.gathered_peak[batch];
                assert!(peak > 0 && peak <= largest, "{what}: {peak} > {largest}");
                let completes = (batch + 1).is_multiple_of(grad_accum);
                assert_sent(s3.sent[batch], expected(rank, completes), &what);
            }
        }
    }
}

/// RMS norms under bf16 autocast (each gamma gathered in f32 for its product alone: see
/// `stage3_bounds`, which checks the bound and the bytes): stage 3 still ends where stage 2
/// does, bit for bit.
#[test]
fn stage_3_through_rms_norms_under_autocast_ends_where_stage_2_does() {
    const TEST: &str =
        "stage3_rmsnorm::stage_3_through_rms_norms_under_autocast_ends_where_stage_2_does";
    if let Some(args) = worker::<RmsRun>() {
        return report(&rms_worker(&args));
    }
    for (processes, grad_accum) in [(2, 2), (3, 1)] {
        let run = |zero_stage: u8| -> Vec<RmsReport> {
            launch(
                TEST,
                processes,
                &RmsRun {
                    zero_stage,
                    grad_accum,
                    sequences: true,
                    precision: Some(Precision::Bf16),
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what = format!("{processes} processes, window {grad_accum}, rank {rank}");
            assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
        }
    }
}
