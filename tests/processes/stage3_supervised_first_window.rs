//! ZeRO stage 3 under `with_accelerate` from the first window on (issue 48): the strategy's fit
//! releases the learner's model before its first forward pass, as the `Accelerator`'s
//! `prepare_model` does, so that the first window's passes gather one layer at a time and
//! reduce-scatter each gradient in the user's own `loss.backward()`, as every later window's
//! do; and a sharded stage 3 checkpoint is resumed with each process reading only the model
//! files of its partition (each parameter it reads goes to every process, which keeps its
//! slice: the model comes back released).
//!
//! That a process reads no other file is shown as in `sharded_resume.rs`: each process is given
//! a copy of the checkpoint directory from which the files it does not need are deleted.

use std::sync::Mutex;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::{ClassificationOutput, InferenceStep, Learner, TrainOutput, TrainStep};
use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{AccelerateConfig, Accelerated};
use serde::{Deserialize, Serialize};

use crate::harness::{self, launch, report, worker};
use crate::mlp::{BlobBatch, CLASSES, FEATURES, Mlp};
use crate::resume::{Copies, StrategyCheckpoint};
use crate::sharded_resume::{FromCopy, overlapping, sizes, strategy_copies_for_each_process};
use crate::supervised::{FitDir, HIDDEN};
use crate::{
    Gathered, Stage3Expected, assert_like_stage_2, assert_sent, parameters, supervised,
    weight_and_bias,
};

type Train = Accelerated<Autodiff<Flex>>;

/// The `Mlp` with a training step that notes what its forward and backward passes did on this
/// process: the bytes sent, the gathered bytes, and which parameters the step's gradients hold
/// right after the user's own `loss.backward()`.
#[derive(Module, Debug)]
struct Observed<B: Backend> {
    mlp: Mlp<B>,
}

/// One training step of this process.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Pass {
    /// Bytes sent during the forward and backward passes.
    sent: u64,
    /// Per parameter in visiting order: whether the step's gradients hold one.
    holds_gradient: Vec<bool>,
    /// The gathered bytes whole when the step began (a validation's reads are counted until
    /// the next optimizer step), and the most whole at once during its passes.
    alive_before: u64,
    peak: u64,
}

/// This process's steps, in order (one fit per process).
static PASSES: Mutex<Vec<Pass>> = Mutex::new(Vec::new());

impl<B: AutodiffBackend> TrainStep for Observed<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> TrainOutput<Self::Output> {
        let alive_before = burn_accelerate::zero::gathered_bytes().alive;
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let item = self.mlp.classify(batch);
        let grads = GradientsParams::from_grads(item.loss.backward(), self);
        let sent = burn_accelerate::zero::sent_bytes() - before;
        let peak = burn_accelerate::zero::gathered_bytes().peak;
        let holds = super::holds_gradient(self, &grads);
        PASSES.lock().unwrap().push(Pass {
            sent,
            holds_gradient: holds,
            alive_before,
            peak,
        });
        TrainOutput { grads, item }
    }
}

impl<B: Backend> InferenceStep for Observed<B> {
    type Input = BlobBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: BlobBatch<B>) -> Self::Output {
        self.mlp.classify(batch)
    }
}

type Components = supervised::AdamComponents<Observed<Train>>;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct ObservedRun {
    zero_stage: u8,
    grad_accum: usize,
    epochs: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct ObservedReport {
    passes: Vec<Pass>,
    parameters: Vec<f32>,
    optimizer_steps: usize,
}

/// Burn's `SupervisedTraining` with `with_accelerate` of the observed `Mlp` (a model built by
/// Burn's `Config::init`, lazy), Adam through Burn's learner, a batch of 20 per process over
/// 256 items: 7 batches an epoch on 2 processes, 5 on 3.
fn observed(args: &ObservedRun) -> ObservedReport {
    let device = Default::default();
    let loader = supervised::blob_loader(20, 256);
    let config = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_zero_stage(ZeroStage::from_number(args.zero_stage).unwrap());
    let strategy = AccelerateStrategy::<Components>::new(config, &device).unwrap();
    let (strategy, dir) = FitDir::of(strategy, None, &loader, "first-window");
    let stats = strategy.report();
    let builder = supervised::quiet_training(dir.path(), loader, 64, args.epochs);
    Train::seed(&device, 5);
    let model = Observed {
        mlp: Mlp::new(HIDDEN, &device),
    };
    let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
    let model = builder.with_accelerate(strategy).launch(learner).model;
    ObservedReport {
        passes: PASSES.lock().unwrap().drain(..).collect(),
        parameters: parameters(&model),
        optimizer_steps: stats.stats().optimizer_steps(),
    }
}

/// The strategy's training step at stage 3 reduce-scatters each gradient inside the user's own
/// `loss.backward()`, as the `Accelerator`'s `backward` does, and from the first
/// batch on holds what it holds from the second window on: each pass gathers at most one linear
/// layer's weight and bias at a time, the backward pass that completes a window
/// reduce-scatters each gradient (this process keeps its slice of every one, and sent what
/// `Stage3Expected::sent` says: every parameter gathered in forward, every weight but the first
/// layer's again in backward, every gradient reduced once), the window's earlier passes gather
/// but reduce nothing; and the parameters still end where stage 2's do (bit for bit on 2
/// processes, to rounding on 3). On 2 and
/// 3 processes, windows of 1 (every batch completes one, the first before any step) and 3 (a
/// partial window at each epoch's end).
#[test]
fn stage_3_with_accelerate_gathers_per_layer_and_reduces_in_backward_from_the_first_window() {
    const TEST: &str = "stage3_supervised_first_window::\
        stage_3_with_accelerate_gathers_per_layer_and_reduces_in_backward_from_the_first_window";
    if let Some(args) = worker::<ObservedRun>() {
        return report(&observed(&args));
    }
    // Each linear layer's weight (read again in backward but the first layer's) and bias, in
    // f32.
    let layers: Vec<Vec<Gathered>> = [FEATURES, HIDDEN, HIDDEN, CLASSES]
        .windows(2)
        .enumerate()
        .map(|(i, w)| weight_and_bias(w[0] * w[1], w[1], 4, i > 0))
        .collect();
    let epochs = 2;
    for (processes, grad_accum) in [(2, 1), (2, 3), (3, 1), (3, 3)] {
        let expected = Stage3Expected::new(layers.clone(), processes);
        // One layer's weight and bias: the most gathered whole at once.
        let largest_layer = expected.largest();
        let go = |zero_stage: u8| -> Vec<ObservedReport> {
            let run = ObservedRun {
                zero_stage,
                grad_accum,
                epochs,
            };
            launch(TEST, processes, &run, &[])
                .assert_success()
                .reports(processes)
        };
        let (stage2, stage3) = (go(2), go(3));
        for rank in 0..processes {
            let what = format!("{processes} processes, window {grad_accum}, rank {rank}");
            let (s2, s3) = (&stage2[rank], &stage3[rank]);
            // (i) The same training as stage 2's (`assert_like_stage_2`).
            assert_eq!(s3.optimizer_steps, s2.optimizer_steps, "{what}");
            assert_like_stage_2(&s3.parameters, &s2.parameters, processes == 2, &what);
            let steps = s3.passes.len();
            assert_eq!(steps, s2.passes.len(), "{what}");
            assert_eq!(steps % epochs, 0, "{what}");
            let per_epoch = steps / epochs;
            if grad_accum > 1 {
                assert_ne!(per_epoch % grad_accum, 0, "{what}: no partial window");
            }
            let completes = |batch: usize| {
                let j = batch % per_epoch;
                (j + 1).is_multiple_of(grad_accum) || j + 1 == per_epoch
            };
            assert_eq!(
                (0..steps).filter(|&b| completes(b)).count(),
                s3.optimizer_steps,
                "{what}"
            );
            let own = expected.own();
            for batch in 0..steps {
                let what = format!("{what}, batch {batch}");
                // Stage 2 gathers and sends nothing in backward, and keeps every gradient
                // until the step.
                let p2 = &s2.passes[batch];
                assert_eq!((p2.sent, p2.peak), (0, 0), "{what}");
                assert!(p2.holds_gradient.iter().all(|&h| h), "{what}");
                // (ii) Stage 3, the first window included.
                let p3 = &s3.passes[batch];
                let gathered = p3.peak - p3.alive_before;
                assert!(
                    gathered > 0 && gathered <= largest_layer,
                    "{what}: {gathered} bytes gathered at once, one layer is {largest_layer}"
                );
                if completes(batch) {
                    assert_sent(p3.sent, expected.sent(true), &what);
                    assert_eq!(p3.holds_gradient, own, "{what}");
                } else {
                    assert_sent(p3.sent, expected.sent(false), &what);
                    assert!(p3.holds_gradient.iter().all(|&h| h), "{what}");
                }
            }
        }
    }
}

/// A sharded stage 3 checkpoint of `with_accelerate` (2 processes) resumed at stage 3 on 2 and
/// on 3 processes, each process other than the main one given a copy of the checkpoint
/// directory without the model files of the processes whose partitions do not overlap its
/// own (and with every optimizer file: it keeps a slice of every parameter's state): it
/// reads only those of its partition, and the run ends where the
/// uninterrupted one does (bit for bit on as many processes; within the 1e-5 of the other
/// re-partitioned resumes on 3). Windows of 1 and of 3 (a partial one at each epoch's end).
#[test]
fn a_sharded_stage_3_supervised_checkpoint_is_resumed_from_the_files_of_each_partition() {
    const TEST: &str = "stage3_supervised_first_window::\
        a_sharded_stage_3_supervised_checkpoint_is_resumed_from_the_files_of_each_partition";
    if let Some(run) = worker::<FromCopy<supervised::Run>>() {
        return report(&run.train());
    }
    let sizes = sizes(&Mlp::<Flex>::new(HIDDEN, &Default::default()));
    for grad_accum in [1, 3] {
        let checkpoint = StrategyCheckpoint::sharded(TEST, grad_accum, 3);
        let dir = harness::scratch_dir(&format!("first-window-resume-{grad_accum}"));
        let saved_dir = dir.join("saved");
        checkpoint.save(3, &saved_dir);
        for processes in [2, 3] {
            let what = format!("window {grad_accum}, {processes} processes");
            let copies = dir.join(format!("on-{processes}"));
            let deleted = strategy_copies_for_each_process(
                &saved_dir,
                &copies,
                processes,
                2,
                2,
                |rank, part| overlapping(&sizes, 2, rank, processes, part == "optimizer"),
            );
            assert!(deleted > 0, "{what}: some process needs fewer model files");
            let resumed = checkpoint.resume(processes, 3, Copies(&copies));
            if processes == 2 {
                checkpoint.assert_bit_for_bit(&resumed, &what);
            } else {
                checkpoint.assert_to_rounding(&resumed, &what);
            }
        }
        harness::clean(&dir);
    }
}
