//! ZeRO stage 3 with evaluation passes on the training model: a hand-written loop that also
//! runs a forward pass of the autodiff model on an evaluation batch and reads its loss without
//! a backward (the graph is dropped), as hand-written loops commonly do, and once evaluates
//! through `model.valid()`. The dropped passes leave nothing behind: the next training pass
//! makes its own anchors, its backward sends what stage 3's formula says for it alone,
//! nothing gathered stays whole, the registry does not grow, and the parameters (and the
//! evaluation losses) are stage 2's (bit for bit on 2 processes, to rounding on 3).

use super::*;

use burn::module::AutodiffModule;
use burn::tensor::ElementConversion;
use burn_accelerate::zero::{
    RegistryEntries, gathered_bytes, registry_entries, reset_gathered_peak, sent_bytes,
};

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

    fn logits(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let relu = Relu::new();
        let h = relu.forward(self.first.forward(x));
        let h = relu.forward(self.second.forward(h));
        self.head.forward(h)
    }

    fn loss(&self, batch: Batch<B>) -> Tensor<B, 1> {
        let logits = self.logits(batch.x);
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
    training: Training,
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

/// The evaluations of an `EvalRun` and what the registry holds around each batch's training
/// pass (`Observer`).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Evaluations {
    /// `EvalRun`'s, and this process's evaluation items.
    #[serde(skip)]
    eval_every: usize,
    #[serde(skip)]
    within: Vec<(usize, Place)>,
    #[serde(skip)]
    items: Vec<usize>,
    /// Per batch: the registry's entries as its training pass starts, after its backward and
    /// after its step, and the gathered bytes whole after its step.
    at_start: Vec<Entries>,
    after_backward: Vec<Entries>,
    after_step: Vec<Entries>,
    alive_after_step: Vec<u64>,
    evals: Vec<Eval>,
}

type TrainedMlp = Mlp<TrainingBackend>;

impl Evaluations {
    fn evaluate(&mut self, model: &TrainedMlp, batch: usize, place: Place) {
        let device = Default::default();
        // Between a training pass's forward and backward, the peak goes on being the batch's.
        if place != Place::BeforeBackward {
            reset_gathered_peak();
        }
        let before = sent_bytes();
        let loss: f32 = if place == Place::ValidAfterBackward {
            let valid = model.valid();
            valid
                .loss(Samples.batch(self.items.clone(), &device))
                .into_scalar()
                .elem()
        } else {
            // The training model's forward pass, its graph dropped without a backward.
            let eval: Batch<TrainingBackend> = Samples.batch(self.items.clone(), &device);
            model.loss(eval).into_scalar().elem()
        };
        self.evals.push(Eval {
            batch,
            place,
            loss: loss.to_bits(),
            sent: sent_bytes() - before,
            peak: gathered_bytes().peak,
        });
    }

    /// The evaluations within `batch` before its backward, or after it.
    fn evaluate_within(&mut self, model: &TrainedMlp, batch: usize, before_backward: bool) {
        for (at, place) in self.within.clone() {
            if at == batch && (place == Place::BeforeBackward) == before_backward {
                self.evaluate(model, batch, place);
            }
        }
    }
}

impl Observer<TrainedMlp> for Evaluations {
    fn at_start(&mut self, _batch: usize) {
        self.at_start.push(registry_entries().into());
    }

    fn before_backward(&mut self, model: &TrainedMlp, batch: usize) {
        self.evaluate_within(model, batch, true);
    }

    fn after_backward(&mut self, model: &TrainedMlp, batch: usize) {
        self.after_backward.push(registry_entries().into());
        self.evaluate_within(model, batch, false);
    }

    fn after_step(&mut self, model: &TrainedMlp, batch: usize) {
        self.alive_after_step.push(gathered_bytes().alive);
        self.after_step.push(registry_entries().into());
        if batch.is_multiple_of(self.eval_every) {
            self.evaluate(model, batch, Place::AfterStep);
        }
    }
}

const BATCHES_PER_WINDOW: usize = 4;

fn eval_worker(args: &EvalRun) -> Stage3Report<Evaluations> {
    let process = ProcessState::from_env().unwrap().process_index();
    // Six evaluation items per process (the training batches hold four), the same every time.
    let evaluations = Evaluations {
        eval_every: args.eval_every,
        within: args.within.clone(),
        items: (0..6).map(|i| 1000 + process * 6 + i).collect(),
        ..Evaluations::default()
    };
    let model = Mlp::new(&Default::default());
    let (config, forward) = (AccelerateConfig::new(), TrainedMlp::logits);
    observed_training(args.training, config, model, samples, forward, evaluations)
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
/// the evaluation losses are stage 2's (which runs the same evaluations), bit for bit on 2
/// processes and to rounding on 3.
#[test]
fn stage_3_forward_passes_dropped_without_backward_leave_nothing_and_end_where_stage_2_does() {
    const TEST: &str = "stage3_eval_forward::stage_3_forward_passes_dropped_without_backward_leave_nothing_and_end_where_stage_2_does";
    if let Some(args) = worker::<EvalRun>() {
        return report(&eval_worker(&args));
    }
    let layers = vec![
        weight_and_bias(FEATURES * HIDDEN, HIDDEN, 4, false),
        weight_and_bias(HIDDEN * HIDDEN, HIDDEN, 4, true),
        weight_and_bias(HIDDEN * CLASSES, CLASSES, 4, true),
    ];
    let params = layers.iter().flatten().count();
    let initial = parameters(&Mlp::<Flex>::new(&Default::default()));
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
        let expected = Stage3Expected::new(layers.clone(), processes);
        let batches = BATCHES_PER_WINDOW * grad_accum;
        // Built whole: the first window gathers nothing. Each training pass sends exactly
        // stage 3's formula for it (no dropped pass's node runs in its backward).
        let training = Training {
            zero_stage: 3,
            precision: None,
            grad_accum,
            batches,
            prepare: false,
        };
        let case = format!("{processes} processes, window {grad_accum}, eval every {eval_every}");
        let args = |training| EvalRun {
            training,
            eval_every,
            within: within.clone(),
        };
        let (stage2, stage3) = stage_3_against_stage_2(
            TEST,
            &expected,
            training,
            (Peak::OneLayer, Agreement::Bits),
            args,
        );
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what = format!("{case}, rank {rank}");
            // Training moved the parameters.
            assert_ne!(bits(&s3.parameters), bits(&initial), "{what}");
            let (s3, s2): (&Evaluations, &Evaluations) = (&s3.observed, &s2.observed);
            for batch in 0..batches {
                let what = format!("{what}, batch {batch}");
                // Nothing gathered is left whole after a step.
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
                    assert!(entries.shards <= params, "{what}: {entries:?}");
                }
                if (batch + 1).is_multiple_of(grad_accum) {
                    // The step released the parameters: the registry starts afresh.
                    assert_eq!(
                        (step.shards, step.anchors, step.views, step.window),
                        (0, 0, 0, 0),
                        "{what}: {step:?}"
                    );
                }
            }
            // Every evaluation ran, at both stages, and read the same losses.
            let expected_evals = batches.div_ceil(eval_every) + within.len();
            assert_eq!(s3.evals.len(), expected_evals, "{what}");
            assert_eq!(s2.evals.len(), expected_evals, "{what}");
            for (e3, e2) in s3.evals.iter().zip(&s2.evals) {
                let what = format!("{what}, evaluation {:?} at batch {}", e3.place, e3.batch);
                assert_eq!((e3.batch, e3.place), (e2.batch, e2.place), "{what}");
                // The same loss where the parameters are (`assert_like_stage_2`).
                assert_like_stage_2(
                    &[f32::from_bits(e3.loss)],
                    &[f32::from_bits(e2.loss)],
                    processes == 2,
                    &what,
                );
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
                // One gather per parameter, nothing again, no reduction.
                assert_sent(e3.sent, expected.sent_by_forward(), &what);
                if e3.place != Place::ValidAfterBackward {
                    // The training model's layers gather for their ops alone; `valid()`'s
                    // copy is the whole model, counted until the step.
                    let largest = expected.largest();
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
