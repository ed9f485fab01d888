//! How this binary's checkpoint tests train, checkpoint and resume, through both entry points
//! (the hand-written loop on the `Accelerator`, [`HandCheckpoint`]; Burn's `SupervisedTraining`
//! with `with_accelerate`, [`StrategyCheckpoint`]), and what a resumed run is compared with: the
//! uninterrupted run, bit for bit where the resume steps on the processes and in the order of the
//! run that saved the checkpoint ([`assert_bit_for_bit`]), to rounding where it is re-partitioned
//! ([`assert_to_rounding`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::{self, Launched, max_relative_difference};
use crate::sharded_resume::FromCopy;
use crate::{HandLoop, HandLoopReport, ITEMS, bits, supervised};

/// How far a re-partitioned resume (on another number of processes, or at a stage that sums in
/// another order) may end from the uninterrupted run, relative to its largest parameter: the
/// mean of the gradients over other parts sums in another order.
pub const TO_ROUNDING: f32 = 1e-5;

/// A process's report of a run: the parameters it ended with.
pub trait Trained {
    /// Every float parameter of the model the process ended with, in visiting order.
    fn parameters(&self) -> &[f32];
}

impl Trained for HandLoopReport {
    fn parameters(&self) -> &[f32] {
        &self.parameters
    }
}

impl Trained for supervised::RunReport {
    fn parameters(&self) -> &[f32] {
        &self.parameters
    }
}

/// A resume on as many processes as saved the checkpoint, at a stage that steps in the same
/// order: every process ends where the uninterrupted run `whole` did, bit for bit.
pub fn assert_bit_for_bit<R: Trained>(resumed: &[R], whole: &[R], what: &str) {
    assert_every_process_ends_with(resumed, whole[0].parameters(), what);
}

/// A re-partitioned resume: every process ends alike, within [`TO_ROUNDING`] of the
/// uninterrupted run `whole`.
pub fn assert_to_rounding<R: Trained>(resumed: &[R], whole: &[R], what: &str) {
    assert_every_process_ends_with(resumed, resumed[0].parameters(), what);
    let d = max_relative_difference(resumed[0].parameters(), whole[0].parameters());
    assert!(d < TO_ROUNDING, "{what}: {d:e}");
}

/// Where the processes of a resume read its checkpoint: a directory (`&Path`, `&PathBuf`), or
/// each its own copy under one ([`Copies`]).
pub struct Source {
    dir: PathBuf,
    per_process: bool,
}

/// A directory of a copy for each process (`sharded_resume::copies_for_each_process`): each
/// process resumes from its own (`sharded_resume::own_copy`).
pub struct Copies<'a>(pub &'a Path);

impl From<&Path> for Source {
    fn from(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            per_process: false,
        }
    }
}

impl From<&PathBuf> for Source {
    fn from(dir: &PathBuf) -> Self {
        dir.as_path().into()
    }
}

impl From<Copies<'_>> for Source {
    fn from(Copies(dir): Copies<'_>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            per_process: true,
        }
    }
}

/// Every process of `run` ended with `parameters`, bit for bit.
fn assert_every_process_ends_with<R: Trained>(run: &[R], parameters: &[f32], what: &str) {
    for (rank, r) in run.iter().enumerate() {
        assert_eq!(
            bits(r.parameters()),
            bits(parameters),
            "{what}, rank {rank}"
        );
    }
}

/// The hand-written loop's global batch, whatever the number of processes.
const HAND_GLOBAL_BATCH: usize = 12;

/// The hand-written loop's checkpoint runs (`hand_loop`, launched as [`FromCopy`]): a global
/// batch of 12 whatever the number of processes, Adam (whose state is per parameter, so that
/// each process of stages 1 to 3 holds part of it), f32. The uninterrupted run trains 2 epochs
/// on 2 processes; a checkpoint is written after the first epoch, and a resume trains the second.
pub struct HandCheckpoint {
    test: &'static str,
    sharded: bool,
    /// The uninterrupted run's reports, in rank order.
    pub whole: Vec<HandLoopReport>,
}

impl HandCheckpoint {
    /// Trains test `test`'s uninterrupted run at `zero_stage`; its checkpoints are written with
    /// `CheckpointLayout::Sharded` where `sharded`, consolidated otherwise.
    pub fn new(test: &'static str, sharded: bool, zero_stage: u8) -> Self {
        let mut checkpoint = Self {
            test,
            sharded,
            whole: Vec::new(),
        };
        checkpoint.whole = checkpoint.train(2, checkpoint.args(2, zero_stage, 2));
        checkpoint
    }

    /// `epochs` epochs on `processes` at `zero_stage`, neither saved nor resumed.
    pub fn args(&self, processes: usize, zero_stage: u8, epochs: usize) -> HandLoop {
        HandLoop {
            sharded_checkpoint: self.sharded,
            ..HandLoop::adam(HAND_GLOBAL_BATCH / processes, zero_stage, epochs)
        }
    }

    /// The launcher's command for `run` on `processes` ([`harness::launch_command`]), each
    /// process resuming from its own copy of `run.resume_from` where `per_process`.
    pub fn command(
        &self,
        processes: usize,
        run: HandLoop,
        per_process: bool,
    ) -> (Command, PathBuf) {
        harness::launch_command(self.test, processes, &FromCopy { run, per_process }, &[])
    }

    /// `run` on `processes`, to its end.
    pub fn launched(&self, processes: usize, run: HandLoop) -> Launched {
        let (command, reports) = self.command(processes, run, false);
        harness::run(command, reports)
    }

    /// `run` on `processes`, which succeeds: each process's report.
    pub fn train(&self, processes: usize, run: HandLoop) -> Vec<HandLoopReport> {
        self.launched(processes, run)
            .assert_success()
            .reports(processes)
    }

    /// The first epoch on 2 processes at `zero_stage`, checkpointed in `dir`.
    pub fn save(&self, zero_stage: u8, dir: &Path) -> Vec<HandLoopReport> {
        let run = HandLoop {
            save_to: Some(dir.to_path_buf()),
            ..self.args(2, zero_stage, 1)
        };
        self.train(2, run)
    }

    /// The second epoch on `processes` at `zero_stage`, resumed from the checkpoint in `from`.
    pub fn resume(
        &self,
        processes: usize,
        zero_stage: u8,
        from: impl Into<Source>,
    ) -> Vec<HandLoopReport> {
        let from = from.into();
        let run = HandLoop {
            resume_from: Some(from.dir),
            ..self.args(processes, zero_stage, 1)
        };
        let (command, reports) = self.command(processes, run, from.per_process);
        harness::run(command, reports)
            .assert_success()
            .reports(processes)
    }

    /// [`assert_bit_for_bit`], and every process stepped as the uninterrupted run's second
    /// epoch did (the same outcomes).
    pub fn assert_bit_for_bit(&self, resumed: &[HandLoopReport], what: &str) {
        assert_bit_for_bit(resumed, &self.whole, what);
        let second_epoch = &self.whole[0].outcomes[ITEMS / HAND_GLOBAL_BATCH..];
        for (rank, r) in resumed.iter().enumerate() {
            assert_eq!(r.outcomes, second_epoch, "{what}, rank {rank}");
        }
    }

    /// [`assert_to_rounding`] of a resume at `zero_stage`; at stage 3, which starts from the
    /// whole loaded model, every process released every parameter after each step.
    pub fn assert_to_rounding(&self, resumed: &[HandLoopReport], zero_stage: u8, what: &str) {
        assert_to_rounding(resumed, &self.whole, what);
        if zero_stage == 3 {
            for (rank, r) in resumed.iter().enumerate() {
                assert!(
                    r.held_after_step.iter().all(|&h| h == 0),
                    "{what}, rank {rank}: {:?}",
                    r.held_after_step
                );
            }
        }
    }
}

/// The strategy's checkpoint runs (`supervised::train`, launched as [`FromCopy`]): Burn's
/// `SupervisedTraining` with `with_accelerate`, Adam through Burn's learner, one batch a step.
/// The uninterrupted run trains 3 epochs on 2 processes; the strategy's checkpoint of epoch 2 is
/// resumed for the third.
pub struct StrategyCheckpoint {
    test: &'static str,
    /// Every run's settings but its stage, epochs, directory and resume; `batch_size` the
    /// global batch, split between the processes.
    settings: supervised::Run,
    /// The uninterrupted run's reports, in rank order.
    pub whole: Vec<supervised::RunReport>,
}

impl StrategyCheckpoint {
    /// Test `test`'s runs of a global batch of 32 over 256 items (8 batches an epoch),
    /// consolidated checkpoints; trains the uninterrupted run at `zero_stage`.
    pub fn consolidated(test: &'static str, zero_stage: u8) -> Self {
        let settings = supervised::Run {
            batch_size: 32,
            grad_accum: 1,
            ..Default::default()
        };
        Self::new(test, settings, zero_stage)
    }

    /// Test `test`'s runs of a global batch of 48 over 192 items (4 whole batches an epoch: the
    /// same batches on 1, 2 and 3 processes) in windows of `grad_accum` batches, the strategy's
    /// checkpoints written sharded beside Burn's own files; trains the uninterrupted run at
    /// `zero_stage`.
    pub fn sharded(test: &'static str, grad_accum: usize, zero_stage: u8) -> Self {
        let settings = supervised::Run {
            batch_size: 48,
            grad_accum,
            sharded_checkpoint: true,
            items: 192,
            ..Default::default()
        };
        Self::new(test, settings, zero_stage)
    }

    fn new(test: &'static str, settings: supervised::Run, zero_stage: u8) -> Self {
        let mut checkpoint = Self {
            test,
            settings,
            whole: Vec::new(),
        };
        let dir = harness::scratch_dir(&format!("{test}-whole"));
        checkpoint.whole = checkpoint.train(2, checkpoint.run(2, zero_stage, 3, &dir, None));
        harness::clean(&dir);
        checkpoint
    }

    /// `epochs` epochs on `processes` at `zero_stage` in `dir` (the strategy's checkpoints in
    /// `dir/checkpoint`), from the checkpoint of epoch `resume_from` where given.
    pub fn run(
        &self,
        processes: usize,
        zero_stage: u8,
        epochs: usize,
        dir: &Path,
        resume_from: Option<usize>,
    ) -> supervised::Run {
        supervised::Run {
            batch_size: self.settings.batch_size / processes,
            epochs,
            dir: Some(dir.to_path_buf()),
            resume_from,
            zero_stage,
            ..self.settings.clone()
        }
    }

    /// `run` on `processes` to its end, each process in its own copy of `run.dir` where
    /// `per_process`.
    pub fn launched(&self, processes: usize, run: supervised::Run, per_process: bool) -> Launched {
        harness::launch(self.test, processes, &FromCopy { run, per_process }, &[])
    }

    /// `run` on `processes`, which succeeds: each process's report.
    pub fn train(&self, processes: usize, run: supervised::Run) -> Vec<supervised::RunReport> {
        self.launched(processes, run, false)
            .assert_success()
            .reports(processes)
    }

    /// Epochs 1 and 2 on 2 processes at `zero_stage` in `dir`.
    pub fn save(&self, zero_stage: u8, dir: &Path) -> Vec<supervised::RunReport> {
        self.train(2, self.run(2, zero_stage, 2, dir, None))
    }

    /// Epoch 3 on `processes` at `zero_stage`, resumed from the checkpoint of epoch 2 in `from`:
    /// every process trains that epoch alone.
    pub fn resume(
        &self,
        processes: usize,
        zero_stage: u8,
        from: impl Into<Source>,
    ) -> Vec<supervised::RunReport> {
        let from = from.into();
        let run = self.run(processes, zero_stage, 3, &from.dir, Some(2));
        let resumed: Vec<supervised::RunReport> = self
            .launched(processes, run, from.per_process)
            .assert_success()
            .reports(processes);
        for (rank, r) in resumed.iter().enumerate() {
            assert_eq!(
                r.epochs,
                [3],
                "{processes} processes at stage {zero_stage}, rank {rank}"
            );
        }
        resumed
    }

    /// [`assert_bit_for_bit`] against this test's uninterrupted run.
    pub fn assert_bit_for_bit(&self, resumed: &[supervised::RunReport], what: &str) {
        assert_bit_for_bit(resumed, &self.whole, what);
    }

    /// [`assert_to_rounding`] against this test's uninterrupted run.
    pub fn assert_to_rounding(&self, resumed: &[supervised::RunReport], what: &str) {
        assert_to_rounding(resumed, &self.whole, what);
    }
}
