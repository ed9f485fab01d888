//! Sharded checkpoints (`CheckpointLayout::Sharded`) resumed on another number of processes
//! read only the files that hold each process's partition (issue 48), through both entry
//! points; and `check_checkpoint_fits` checks a sharded checkpoint's files against the model.
//!
//! That a process reads no other file is shown by giving each process a copy of the checkpoint
//! directory of its own, from which the files it does not need are deleted: a process that
//! read every file would fail on them (the main process keeps the whole directory: it verifies
//! every file of the checkpoint it picks).

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_accelerate::checkpoint::{FileDigest, Manifest};
use burn_accelerate::distributed::ProcessState;
use serde::{Deserialize, Serialize};

use crate::harness::{self, report, worker};
use crate::resume::{Copies, HandCheckpoint, StrategyCheckpoint};
use crate::{HandLoop, HandLoopReport, Net, hand_loop, supervised};

/// Every float parameter's number of values, in visiting order: what the partition is of.
pub(super) fn sizes<B: Backend, M: Module<B>>(module: &M) -> Vec<usize> {
    struct Sizes(Vec<usize>);
    impl<B: Backend> ModuleVisitor<B> for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.lazy_shape().num_elements());
        }
    }
    let mut sizes = Sizes(Vec::new());
    module.visit(&mut sizes);
    sizes.0
}

/// The processes of `saved` whose partitions hold a parameter of process `rank`'s of `world`
/// (of every parameter where `whole`).
pub(super) fn overlapping(
    sizes: &[usize],
    saved: usize,
    rank: usize,
    world: usize,
    whole: bool,
) -> Vec<usize> {
    let old = burn_accelerate::zero::partition(sizes, saved);
    let new = burn_accelerate::zero::partition(sizes, world);
    let mut ranks: Vec<usize> = old
        .iter()
        .zip(&new)
        .filter(|(_, owner)| whole || **owner == rank)
        .map(|(saved_rank, _)| *saved_rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// A copy of checkpoint directory `from` for each process of `world` (`rank-R/sub` under
/// `to`), process 0's whole, each other's without the shard files of checkpoint `number` (saved by
/// `saved` processes) that `needs` does not give it: `needs(rank, part)` the saved processes
/// whose `part` file (`"model"`, `"optimizer"`) it reads. Returns how many files were deleted.
pub(super) fn copies_for_each_process(
    from: &Path,
    to: &Path,
    sub: &str,
    world: usize,
    number: usize,
    saved: usize,
    needs: impl Fn(usize, &str) -> Vec<usize>,
) -> usize {
    let mut deleted = 0;
    for rank in 0..world {
        let copy = process_copy(to, rank).join(sub);
        std::fs::create_dir_all(&copy).unwrap();
        for file in std::fs::read_dir(from).unwrap() {
            let file = file.unwrap();
            if file.file_type().unwrap().is_file() {
                std::fs::copy(file.path(), copy.join(file.file_name())).unwrap();
            }
        }
        if rank == 0 {
            continue;
        }
        for part in ["model", "optimizer"] {
            let needed = needs(rank, part);
            for saved_rank in (0..saved).filter(|r| !needed.contains(r)) {
                let name = format!("{part}-{number}.shard-{saved_rank}-of-{saved}.mpk");
                std::fs::remove_file(copy.join(&name)).unwrap();
                deleted += 1;
            }
        }
    }
    deleted
}

/// [`copies_for_each_process`] of a strategy run's directory `saved` (its checkpoints in
/// `checkpoint`), with Burn's metric logs of the epochs before in the main process's copy: it
/// reads them back.
pub(super) fn strategy_copies_for_each_process(
    saved: &Path,
    to: &Path,
    world: usize,
    number: usize,
    saved_by: usize,
    needs: impl Fn(usize, &str) -> Vec<usize>,
) -> usize {
    let deleted = copies_for_each_process(
        &saved.join("checkpoint"),
        to,
        "checkpoint",
        world,
        number,
        saved_by,
        needs,
    );
    for entry in std::fs::read_dir(saved).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() && entry.file_name() != "checkpoint" {
            copy_tree(&entry.path(), &process_copy(to, 0).join(entry.file_name()));
        }
    }
    deleted
}

/// Process `rank`'s copy (`rank-R`) among the copies for each process under `dir`.
pub(super) fn process_copy(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}"))
}

/// This process's copy of `dir` where `per_process`; `dir` itself otherwise.
pub(super) fn own_copy(dir: &Path, per_process: bool) -> PathBuf {
    if per_process {
        process_copy(dir, ProcessState::from_env().unwrap().process_index())
    } else {
        dir.to_path_buf()
    }
}

/// A run whose processes each read their own copy of its directory ([`own_copy`]) where
/// `per_process`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct FromCopy<T> {
    pub run: T,
    pub per_process: bool,
}

impl FromCopy<HandLoop> {
    /// [`hand_loop`], resumed from this process's copy of `run.resume_from`.
    pub fn train(mut self) -> HandLoopReport {
        self.run.resume_from = self
            .run
            .resume_from
            .map(|dir| own_copy(&dir, self.per_process));
        hand_loop::<burn::backend::Autodiff<burn::backend::Flex>>(&self.run)
    }
}

impl FromCopy<supervised::Run> {
    /// [`supervised::train`] in this process's copy of `run.dir`.
    pub fn train(mut self) -> supervised::RunReport {
        self.run.dir = self.run.dir.map(|dir| own_copy(&dir, self.per_process));
        supervised::train(&self.run)
    }
}

#[test]
fn sharded_resume_by_hand_reads_only_the_files_of_its_partition() {
    const TEST: &str =
        "sharded_resume::sharded_resume_by_hand_reads_only_the_files_of_its_partition";
    if let Some(run) = worker::<FromCopy<HandLoop>>() {
        return report(&run.train());
    }
    // ZeRO stage 3 on 2 processes, the checkpoint written sharded (as the stage 3 checkpoint
    // tests of main.rs).
    let checkpoint = HandCheckpoint::new(TEST, true, 3);
    let dir = harness::scratch_dir("sharded-resume-by-hand");
    let saved_dir = dir.join("saved");
    checkpoint.save(3, &saved_dir);
    let sizes = sizes(&Net::<burn::backend::Flex>::new(&Default::default()));

    // On 3 processes at stage 3, each process's copy lacks the model files it does not need
    // (it loads its partition's parameters and sends each to every process to slice; it
    // keeps a slice of every parameter's optimizer state, so it reads every optimizer file):
    // the same training to rounding, as main.rs's re-partitioned resumes.
    let copies = dir.join("three");
    let deleted = copies_for_each_process(&saved_dir, &copies, "", 3, 1, 2, |rank, part| {
        overlapping(&sizes, 2, rank, 3, part == "optimizer")
    });
    assert!(
        deleted > 0,
        "some process of 3 needs fewer files than saved"
    );
    let resumed = checkpoint.resume(3, 3, Copies(&copies));
    checkpoint.assert_to_rounding(&resumed, 3, "3 processes at stage 3");

    // At stage 1 on 3 processes the parameters are whole: every model file, and the optimizer
    // files of its partition.
    let stage_1 = dir.join("three-stage-1");
    let deleted = copies_for_each_process(&saved_dir, &stage_1, "", 3, 1, 2, |rank, part| {
        overlapping(&sizes, 2, rank, 3, part == "model")
    });
    assert!(
        deleted > 0,
        "some process of 3 needs fewer optimizer files than saved"
    );
    let resumed = checkpoint.resume(3, 1, Copies(&stage_1));
    checkpoint.assert_to_rounding(&resumed, 1, "3 processes at stage 1");

    // On one process: both files of each part, the same training to rounding.
    let one = checkpoint.resume(1, 0, &saved_dir);
    checkpoint.assert_to_rounding(&one, 0, "1 process");
    harness::clean(&dir);
}

#[test]
fn sharded_resume_with_accelerate_reads_only_the_optimizer_files_of_its_partition() {
    const TEST: &str = "sharded_resume::sharded_resume_with_accelerate_reads_only_the_optimizer_files_of_its_partition";
    if let Some(run) = worker::<FromCopy<supervised::Run>>() {
        return report(&run.train());
    }
    // ZeRO stage 2 on 2 processes, the strategy's own checkpoints written sharded.
    let checkpoint = StrategyCheckpoint::sharded(TEST, 1, 2);
    let dir = harness::scratch_dir("sharded-resume-strategy");
    let saved_dir = dir.join("saved");
    checkpoint.save(2, &saved_dir);
    let sizes = sizes(&crate::mlp::Mlp::<burn::backend::Flex>::new(
        supervised::HIDDEN,
        &Default::default(),
    ));

    // On 3 processes at stage 2 and at stage 3: every process reads every model file (the
    // learner's model is whole until the first step) and, at stage 2, the optimizer files
    // holding its partition's state alone (at stage 3 every one: it keeps a slice of every
    // parameter's state).
    for zero_stage in [2, 3] {
        let copies = dir.join(format!("three-stage-{zero_stage}"));
        let deleted =
            strategy_copies_for_each_process(&saved_dir, &copies, 3, 2, 2, |rank, part| {
                overlapping(&sizes, 2, rank, 3, part == "model" || zero_stage == 3)
            });
        if zero_stage == 2 {
            assert!(deleted > 0, "some process of 3 needs fewer optimizer files");
        }
        let resumed = checkpoint.resume(3, zero_stage, Copies(&copies));
        checkpoint.assert_to_rounding(&resumed, &format!("3 processes at stage {zero_stage}"));
    }
    // On one process: every file, the same training to rounding (in a copy: the checks below
    // read the checkpoints as saved).
    let one_dir = dir.join("one");
    copy_tree(&saved_dir, &one_dir);
    let one = checkpoint.resume(1, 0, &one_dir);
    checkpoint.assert_to_rounding(&one, "1 process");

    check_checkpoint_fits_on_sharded_files(&saved_dir.join("checkpoint"), &dir.join("fits"));
    harness::clean(&dir);
}

pub(super) fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

// `check_checkpoint_fits` on the strategy's sharded checkpoints of 2 processes (`saved`,
// epochs 1 and 2), in this test's own process: the model that wrote them fits; another width,
// a parameter no file holds, a process's file that is gone are refused naming the parameter
// and the file.
fn check_checkpoint_fits_on_sharded_files(saved: &Path, scratch: &Path) {
    use burn_accelerate::AccelerateError;
    use burn_accelerate::train::AccelerateStrategy;

    use crate::mlp::{Mlp, MlpComponents};

    type Train = burn_accelerate::Accelerated<burn::backend::Autodiff<burn::backend::Flex>>;
    let device = Default::default();
    let check = |dir: &Path, hidden: usize| {
        AccelerateStrategy::<MlpComponents<Train>>::new(
            burn_accelerate::AccelerateConfig::new(),
            &device,
        )
        .unwrap()
        .try_with_checkpoint_dir(dir)?
        .check_checkpoint_fits(&Mlp::new(hidden, &device))
    };
    let refused = |dir: &Path, hidden: usize| match check(dir, hidden) {
        Err(AccelerateError::Checkpoint { path, reason }) => (path, reason),
        other => panic!("expected a checkpoint error, got {other:?}"),
    };
    check(saved, supervised::HIDDEN).expect("the model that wrote it fits");

    // Another width: the largest parameter, `fc1.weight`'s, in the file of its owner.
    let (path, reason) = refused(saved, 2 * supervised::HIDDEN);
    let owner = burn_accelerate::zero::partition(
        &sizes(&Mlp::<burn::backend::Flex>::new(
            2 * supervised::HIDDEN,
            &Default::default(),
        )),
        2,
    )[0];
    assert_eq!(
        Path::new(&path),
        saved.join(format!("model-2.shard-{owner}-of-2.mpk")),
        "{reason}"
    );
    assert!(
        reason.contains("parameter `fc1.weight` has shape") && reason.contains("in the model"),
        "{reason}"
    );

    // A process's file whose record names a module `fc2` otherwise (`fcX`), listed with its
    // checksum: the parameter it lacks, and the file.
    let renamed = scratch.join("renamed");
    copy_tree(saved, &renamed);
    let name = "model-2.shard-1-of-2.mpk";
    let mut bytes = std::fs::read(renamed.join(name)).unwrap();
    let mut found = 0;
    for at in 0..bytes.len().saturating_sub(3) {
        if &bytes[at..at + 3] == b"fc2" {
            bytes[at + 2] = b'X';
            found += 1;
        }
    }
    assert!(found > 0, "the record names fc2");
    std::fs::write(renamed.join(name), &bytes).unwrap();
    Manifest::read(&renamed)
        .unwrap()
        .relisted(2, FileDigest::of(name.to_string(), &bytes))
        .unwrap()
        .write(&renamed)
        .unwrap();
    let (path, reason) = refused(&renamed, supervised::HIDDEN);
    assert_eq!(Path::new(&path), renamed.join(name), "{reason}");
    assert!(
        reason.contains("parameter `fc2.weight`") && reason.contains("is not in the record"),
        "{reason}"
    );

    // Process 1's files gone from both checkpoints: none can be resumed from, and the
    // start-up check says which file is missing.
    let gone = scratch.join("gone");
    copy_tree(saved, &gone);
    for number in [1, 2] {
        std::fs::remove_file(gone.join(format!("model-{number}.shard-1-of-2.mpk"))).unwrap();
    }
    let (_, reason) = refused(&gone, supervised::HIDDEN);
    assert!(reason.contains("model-2.shard-1-of-2.mpk"), "{reason}");
    assert!(reason.contains("model-1.shard-1-of-2.mpk"), "{reason}");
}
