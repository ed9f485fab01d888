//! ZeRO stage 3's per-layer bound through layer norms: `nn::LayerNorm` (with and without
//! beta) between linear layers gathers gamma and beta for its op alone, and gamma again for
//! its input's gradient, and ends where stage 2 does, bit for bit.

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig, Relu};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{launch, report, worker};
use super::{Batch, CLASSES, FEATURES, Samples, assert_sent, bits, parameters, stage_3_sent};

const HIDDEN: usize = 24;

/// linear → LayerNorm → linear → LayerNorm without beta → linear head.
#[derive(Module, Debug)]
struct Normed<B: Backend> {
    first: Linear<B>,
    norm: LayerNorm<B>,
    second: Linear<B>,
    plain_norm: LayerNorm<B>,
    head: Linear<B>,
}

impl<B: Backend> Normed<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 13);
        Normed {
            first: LinearConfig::new(FEATURES, HIDDEN).init(device),
            norm: LayerNormConfig::new(HIDDEN).init(device),
            second: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            plain_norm: LayerNormConfig::new(HIDDEN).with_bias(false).init(device),
            head: LinearConfig::new(HIDDEN, CLASSES).init(device),
        }
    }

    fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let relu = Relu::new();
        let h = relu.forward(self.norm.forward(self.first.forward(x)));
        let h = relu.forward(self.plain_norm.forward(self.second.forward(h)));
        self.head.forward(h)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct NormRun {
    zero_stage: u8,
    grad_accum: usize,
    /// The layers read a 3-D input (`[2, 2, features]`: two sequences of two), so that the
    /// parameters' gradients sum over two broadcast dimensions.
    sequences: bool,
    /// Under autocast (every linear layer cast: the net is tiny: `SmallOps::Cast`).
    precision: Option<Precision>,
}

#[derive(Debug, Serialize, Deserialize)]
struct NormReport {
    parameters: Vec<f32>,
    /// Per batch: the bytes sent during its forward and backward passes, the most gathered
    /// bytes whole at once then, and those still whole after its backward pass.
    sent: Vec<u64>,
    gathered_peak: Vec<u64>,
    gathered_after_backward: Vec<u64>,
}

fn norm_worker(args: &NormRun) -> NormReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = burn_accelerate::distributed::ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = Normed::<B>::new(&device);
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
    let mut report = NormReport {
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

/// Stage 3 through layer norms: from the first step on, at most one layer's gathered
/// parameters are whole at a time (a linear layer's weight and bias, or a layer norm's gamma
/// and beta), nothing gathered is left whole after the backward pass, each batch sends what
/// stage 3's formula says (`stage_3_reduces_each_gradient_to_its_owner_in_backward_and_sends_what_the_formula_says`,
/// with a layer norm's gamma gathered again in backward for its input's gradient, as a
/// linear layer's weight above the first is), and the parameters end where stage 2's do, bit
/// for bit. Under bf16 autocast the linear layers gather halves and the layer norms, which
/// autocast runs in f32, gather f32.
#[test]
fn stage_3_holds_one_layer_norms_gathered_parameters_at_a_time_and_ends_where_stage_2_does() {
    const TEST: &str = "stage3_norm::stage_3_holds_one_layer_norms_gathered_parameters_at_a_time_and_ends_where_stage_2_does";
    if let Some(args) = worker::<NormRun>() {
        return report(&norm_worker(&args));
    }
    // Every parameter in visiting order: its values, whether it is read again in backward (a
    // weight whose input is not the data; a gamma: its input is a linear layer's output),
    // and whether it is a layer norm's.
    let params: [(usize, bool, bool); 9] = [
        (FEATURES * HIDDEN, false, false),
        (HIDDEN, false, false),
        (HIDDEN, true, true),
        (HIDDEN, false, true),
        (HIDDEN * HIDDEN, true, false),
        (HIDDEN, false, false),
        (HIDDEN, true, true),
        (HIDDEN * CLASSES, true, false),
        (CLASSES, false, false),
    ];
    // Each layer's parameters (values, whether a layer norm's): the bound.
    let layers = [
        (FEATURES * HIDDEN + HIDDEN, false),
        (2 * HIDDEN, true),
        (HIDDEN * HIDDEN + HIDDEN, false),
        (HIDDEN, true),
        (HIDDEN * CLASSES + CLASSES, false),
    ];
    let sizes: Vec<usize> = params.iter().map(|&(values, _, _)| values).collect();
    for (processes, grad_accum, sequences, precision) in [
        (2, 1, false, None),
        (2, 2, false, None),
        (3, 1, false, None),
        (3, 2, false, None),
        (2, 2, true, None),
        (2, 1, false, Some(Precision::Bf16)),
        (3, 2, true, Some(Precision::Bf16)),
    ] {
        // The bytes of one gathered value: halves for the linear layers under autocast, f32
        // for the layer norms (and everything without autocast).
        let width = |norm: bool| -> u64 { if precision.is_some() && !norm { 2 } else { 4 } };
        let largest = layers
            .iter()
            .map(|&(values, norm)| values as u64 * width(norm))
            .max()
            .unwrap();
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        // Gathers in the width above, reductions in f32.
        let expected = |rank: usize, reduces: bool| -> u64 {
            stage_3_sent(
                params.iter().map(|&(values, again, norm)| {
                    (width(norm) * values as u64, 4 * values as u64, again)
                }),
                &owners,
                processes,
                rank,
                reduces,
            )
        };
        let run = |zero_stage: u8| -> Vec<NormReport> {
            launch(
                TEST,
                processes,
                &NormRun {
                    zero_stage,
                    grad_accum,
                    sequences,
                    precision,
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what = format!(
                "{processes} processes, window {grad_accum}, 3-D {sequences}, {precision:?}, rank {rank}"
            );
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
