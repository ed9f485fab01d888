//! ZeRO stage 3 with evaluation passes on the training model: a hand-written loop that also
//! runs a forward pass of the autodiff model on an evaluation batch and reads its loss without
//! a backward (the graph is dropped), as hand-written loops commonly do, and once evaluates
//! through `model.valid()`. The dropped passes leave nothing behind: the next training pass
//! makes its own anchors, its backward sends what stage 3's formula says for it alone,
//! nothing gathered stays whole, the registry does not grow, and the parameters (and the
//! evaluation losses) are stage 2's, bit for bit.

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};
use burn_accelerate::zero::{RegistryEntries, registry_entries};
use burn_accelerate::{AccelerateConfig, Accelerated};
use serde::{Deserialize, Serialize};

use super::harness::{launch, report, worker};
use super::{Batch, CLASSES, FEATURES, Samples, assert_sent, bits, parameters, stage_3_sent};

const HIDDEN: usize = 24;

/// Three linear layers: the two above the first read their weights again in backward.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
    head: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 29);
        Mlp {
            first: LinearConfig::new(FEATURES, HIDDEN).init(device),
            second: LinearConfig::new(HIDDEN, HIDDEN).init(device),
            head: LinearConfig::new(HIDDEN, CLASSES).init(device),
        }
    }

    fn loss(&self, batch: Batch<B>) -> Tensor<B, 1> {
        let relu = Relu::new();
        let h = relu.forward(self.first.forward(batch.x));
        let h = relu.forward(self.second.forward(h));
        let logits = self.head.forward(h);
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.y)
    }
}

/// Where an evaluation runs in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Place {
    /// On the training model, between the batch's forward pass and its backward: it reads
    /// the parameters through the training pass's anchors, and the backward does not reach
    /// its nodes.
    BeforeBackward,
    /// On the training model, after the batch's backward and before its optimizer step.
    AfterBackward,
    /// Through `model.valid()`, after the batch's backward and before its optimizer step.
    ValidAfterBackward,
    /// On the training model, after the batch's optimizer step.
    AfterStep,
}

#[derive(Debug, Serialize, Deserialize)]
struct EvalRun {
    zero_stage: u8,
    grad_accum: usize,
    /// An evaluation on the training model after the step of every `eval_every`-th batch.
    eval_every: usize,
    /// Evaluations within a batch (before or after its backward, before its step).
    within: Vec<(usize, Place)>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Eval {
    batch: usize,
    place: Place,
    /// The loss's bits.
    loss: u32,
    /// The bytes it sent, and the most gathered bytes whole at once during it.
    sent: u64,
    peak: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Entries {
    shards: usize,
    anchors: usize,
    views: usize,
    window: usize,
}

impl From<RegistryEntries> for Entries {
    fn from(e: RegistryEntries) -> Self {
        Entries {
            shards: e.shards,
            anchors: e.anchors,
            views: e.views,
            window: e.window,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct EvalReport {
    parameters: Vec<f32>,
    /// Per batch: the bytes its training forward and backward sent, the most gathered bytes
    /// whole at once then, those whole after its backward and after its step, and the
    /// registry's entries as its training pass starts, after its backward and after its step.
    sent: Vec<u64>,
    gathered_peak: Vec<u64>,
    alive_after_backward: Vec<u64>,
    alive_after_step: Vec<u64>,
    at_start: Vec<Entries>,
    after_backward: Vec<Entries>,
    after_step: Vec<Entries>,
    evals: Vec<Eval>,
}

const BATCHES_PER_WINDOW: usize = 4;

fn eval_worker(args: &EvalRun) -> EvalReport {
    type B = Accelerated<Autodiff<Flex>>;
    let state = burn_accelerate::distributed::ProcessState::from_env().unwrap();
    let device = Default::default();
    let mut model = Mlp::<B>::new(&device);
    let mut accelerator = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_zero_stage(burn_accelerate::zero::ZeroStage::from_number(args.zero_stage).unwrap())
        .init::<B>(&device)
        .unwrap();
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = EvalReport {
        parameters: Vec::new(),
        sent: Vec::new(),
        gathered_peak: Vec::new(),
        alive_after_backward: Vec::new(),
        alive_after_step: Vec::new(),
        at_start: Vec::new(),
        after_backward: Vec::new(),
        after_step: Vec::new(),
        evals: Vec::new(),
    };
    // Six evaluation items per process (the training batches hold four), the same every time.
    let eval_items: Vec<usize> = (0..6)
        .map(|i| 1000 + state.process_index() * 6 + i)
        .collect();
    let evaluate = |model: &Mlp<B>, batch: usize, place: Place, evals: &mut Vec<Eval>| {
        // Between a training pass's forward and backward, the peak goes on being the batch's.
        if place != Place::BeforeBackward {
            burn_accelerate::zero::reset_gathered_peak();
        }
        let before = burn_accelerate::zero::sent_bytes();
        let loss: f32 = if place == Place::ValidAfterBackward {
            let valid = model.valid();
            valid
                .loss(Samples.batch(eval_items.clone(), &device))
                .into_scalar()
                .elem()
        } else {
            // The training model's forward pass, its graph dropped without a backward.
            let eval: Batch<B> = Samples.batch(eval_items.clone(), &device);
            model.loss(eval).into_scalar().elem()
        };
        evals.push(Eval {
            batch,
            place,
            loss: loss.to_bits(),
            sent: burn_accelerate::zero::sent_bytes() - before,
            peak: burn_accelerate::zero::gathered_bytes().peak,
        });
    };
    for batch in 0..BATCHES_PER_WINDOW * args.grad_accum {
        let items: Vec<usize> = (0..4)
            .map(|i| batch * 16 + state.process_index() * 4 + i)
            .collect();
        let train: Batch<B> = Samples.batch(items, &device);
        let _step = accelerator.accumulate(&model);
        report.at_start.push(registry_entries().into());
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let loss = model.loss(train);
        let mut evaluated = 0;
        for &(at, place) in &args.within {
            if at == batch && place == Place::BeforeBackward {
                evaluate(&model, batch, place, &mut report.evals);
                evaluated += report.evals.last().map_or(0, |e| e.sent);
            }
        }
        accelerator.backward(loss, &model);
        report
            .sent
            .push(burn_accelerate::zero::sent_bytes() - before - evaluated);
        let bytes = burn_accelerate::zero::gathered_bytes();
        report.gathered_peak.push(bytes.peak);
        report.alive_after_backward.push(bytes.alive);
        report.after_backward.push(registry_entries().into());
        for &(at, place) in &args.within {
            if at == batch && place != Place::BeforeBackward {
                evaluate(&model, batch, place, &mut report.evals);
            }
        }
        let (next, _) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        model = next;
        report
            .alive_after_step
            .push(burn_accelerate::zero::gathered_bytes().alive);
        report.after_step.push(registry_entries().into());
        if batch.is_multiple_of(args.eval_every) {
            evaluate(&model, batch, Place::AfterStep, &mut report.evals);
        }
    }
    report.parameters = parameters(&model);
    report
}

/// Stage 3 with forward passes of the training model whose graphs are dropped without a
/// backward (after every step, or every other one; once in the middle of a window, after a
/// backward whose step does not apply; once between a training pass's forward and its
/// backward) and one evaluation through `model.valid()`, on 2 and
/// 3 processes with windows of 1 and 2: each training pass makes its own anchors (none is
/// left when it starts), its forward and backward send exactly stage 3's formula for it
/// (no dropped pass's node runs in its backward), each evaluation sends one gather per
/// parameter once the model is released (none before), at most one layer's gathered
/// parameters are whole at a time, nothing gathered is left whole after a backward or a
/// step, the registry ends each step as it ended the one before, and the parameters and
/// the evaluation losses are stage 2's (which runs the same evaluations), bit for bit.
#[test]
fn stage_3_forward_passes_dropped_without_backward_leave_nothing_and_end_where_stage_2_does() {
    const TEST: &str = "stage3_eval_forward::stage_3_forward_passes_dropped_without_backward_leave_nothing_and_end_where_stage_2_does";
    if let Some(args) = worker::<EvalRun>() {
        return report(&eval_worker(&args));
    }
    // Every parameter in visiting order: its values and whether backward gathers it again.
    let params: [(usize, bool); 6] = [
        (FEATURES * HIDDEN, false),
        (HIDDEN, false),
        (HIDDEN * HIDDEN, true),
        (HIDDEN, false),
        (HIDDEN * CLASSES, true),
        (CLASSES, false),
    ];
    let largest = 4 * (HIDDEN * HIDDEN + HIDDEN) as u64;
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    for (processes, grad_accum, eval_every, within) in [
        (2, 1, 1, vec![(2, Place::ValidAfterBackward)]),
        (
            2,
            2,
            2,
            vec![
                (2, Place::AfterBackward),
                (5, Place::ValidAfterBackward),
                (6, Place::BeforeBackward),
            ],
        ),
        (
            3,
            1,
            2,
            vec![(1, Place::AfterBackward), (2, Place::BeforeBackward)],
        ),
        (
            3,
            2,
            1,
            vec![(4, Place::AfterBackward), (3, Place::ValidAfterBackward)],
        ),
    ] {
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        // A training pass: forward and backward gathers, and the reductions where it
        // completes a window.
        let training = |rank: usize, reduces: bool| -> u64 {
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
        // An evaluation: one gather per parameter, nothing again, no reduction.
        let evaluation = |rank: usize| -> u64 {
            stage_3_sent(
                params
                    .iter()
                    .map(|&(values, _)| (4 * values as u64, 4 * values as u64, false)),
                &owners,
                processes,
                rank,
                false,
            )
        };
        let run = |zero_stage: u8| -> Vec<EvalReport> {
            launch(
                TEST,
                processes,
                &EvalRun {
                    zero_stage,
                    grad_accum,
                    eval_every,
                    within: within.clone(),
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what = format!(
                "{processes} processes, window {grad_accum}, eval every {eval_every}, rank {rank}"
            );
            assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
            // Training moved the parameters.
            let initial = parameters(&Mlp::<Flex>::new(&Default::default()));
            assert_ne!(bits(&s3.parameters), bits(&initial), "{what}");
            let batches = BATCHES_PER_WINDOW * grad_accum;
            assert_eq!(s3.sent.len(), batches, "{what}");
            for batch in 0..batches {
                let what = format!("{what}, batch {batch}");
                assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
                // Nothing gathered is left whole after a backward or a step.
                assert_eq!(s3.alive_after_backward[batch], 0, "{what}");
                assert_eq!(s3.alive_after_step[batch], 0, "{what}");
                // No pass finds another's anchors, and none is left after a backward.
                let (start, backward, step) = (
                    &s3.at_start[batch],
                    &s3.after_backward[batch],
                    &s3.after_step[batch],
                );
                assert_eq!(start.anchors, 0, "{what}: {start:?}");
                assert_eq!(
                    (backward.anchors, backward.window),
                    (0, 0),
                    "{what}: {backward:?}"
                );
                for entries in [start, backward, step] {
                    assert_eq!(
                        (entries.views, entries.window),
                        (0, 0),
                        "{what}: {entries:?}"
                    );
                    assert!(entries.shards <= params.len(), "{what}: {entries:?}");
                }
                let completes = (batch + 1).is_multiple_of(grad_accum);
                if completes {
                    // The step released the parameters: the registry starts afresh.
                    assert_eq!(
                        (step.shards, step.anchors, step.views, step.window),
                        (0, 0, 0, 0),
                        "{what}: {step:?}"
                    );
                }
                if batch < grad_accum {
                    // The first window: the model is whole everywhere.
                    assert_eq!((s3.sent[batch], s3.gathered_peak[batch]), (0, 0), "{what}");
                    continue;
                }
                let peak = s3.gathered_peak[batch];
                assert!(peak > 0 && peak <= largest, "{what}: {peak} > {largest}");
                assert_sent(s3.sent[batch], training(rank, completes), &what);
            }
            // Every evaluation ran, at both stages, and read the same losses.
            let expected_evals = batches.div_ceil(eval_every) + within.len();
            assert_eq!(s3.evals.len(), expected_evals, "{what}");
            assert_eq!(s2.evals.len(), expected_evals, "{what}");
            for (e3, e2) in s3.evals.iter().zip(&s2.evals) {
                let what = format!("{what}, evaluation {:?} at batch {}", e3.place, e3.batch);
                assert_eq!((e3.batch, e3.place), (e2.batch, e2.place), "{what}");
                assert_eq!(e3.loss, e2.loss, "{what}");
                assert_eq!((e2.sent, e2.peak), (0, 0), "{what}");
                // The parameters are released from the first window's step on.
                let released = match e3.place {
                    Place::AfterStep => e3.batch + 1 >= grad_accum,
                    Place::BeforeBackward | Place::AfterBackward | Place::ValidAfterBackward => {
                        e3.batch >= grad_accum
                    }
                };
                if !released {
                    assert_eq!((e3.sent, e3.peak), (0, 0), "{what}");
                    continue;
                }
                assert_sent(e3.sent, evaluation(rank), &what);
                if e3.place != Place::ValidAfterBackward {
                    // The training model's layers gather for their ops alone; `valid()`'s
                    // copy is the whole model, counted until the step.
                    assert!(
                        e3.peak > 0 && e3.peak <= largest,
                        "{what}: {} > {largest}",
                        e3.peak
                    );
                }
            }
        }
    }
}
