//! The start-up check (`try_with_checkpoint_dir`) of a sharded ZeRO stage 3 checkpoint holds
//! no process's files but the ones the process surely loads (issue 48): on as many processes
//! as saved it, its own shard files; on another number, none. The resume reads what else it
//! needs then, checked against the checksum the check verified: the run ends as the other
//! resume tests say, and a file changed between the check and the training is refused by
//! name, never loaded.
//!
//! Each process resumes from a copy of the checkpoint directory of its own (`rank-R`, as in
//! `sharded_resume.rs`), so that a process can change a file of its copy after its own check
//! without racing the others' checks.

use std::path::{Path, PathBuf};

use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn::train::Learner;
use burn_accelerate::AccelerateConfig;
use burn_accelerate::checkpoint::CheckpointLayout;
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
use burn_accelerate::zero::ZeroStage;
use serde::{Deserialize, Serialize};

use crate::harness::{self, launch, report, worker};
use crate::mlp::{Mlp, MlpComponents};
use crate::sharded_resume::{copy_tree, own_copy, process_copy, sizes};
use crate::{parameters, resume, supervised};

type Train = burn_accelerate::Accelerated<burn::backend::Autodiff<burn::backend::Flex>>;

#[derive(Debug, Serialize, Deserialize)]
struct Run {
    processes: usize,
    epochs: usize,
    /// The run's directory (its strategy checkpoints in `checkpoint`); where `per_process`,
    /// this process's copy `rank-R` of it.
    dir: PathBuf,
    per_process: bool,
    /// A process and a file of its copy of the checkpoint directory that it alters (one byte,
    /// at its length) after its start-up check and before the training.
    alter: Option<(usize, String)>,
}

#[derive(Debug, Serialize, Deserialize)]
struct RunReport {
    parameters: Vec<f32>,
    epochs: Vec<usize>,
    /// The files the start-up check held, by name with their length, after
    /// `try_with_checkpoint_dir` and again after `check_checkpoint_fits`.
    held: Vec<(String, usize)>,
    held_after_fits: Vec<(String, usize)>,
}

impl resume::Trained for RunReport {
    fn parameters(&self) -> &[f32] {
        &self.parameters
    }
}

// A global batch of 48 over 192 items (the same batches on 2 and 3 processes), Adam through
// Burn's Learner at ZeRO stage 3, the strategy's checkpoints written sharded: the setting of
// main.rs's sharded stage 3 resume test, checked with `try_with_checkpoint_dir`.
fn train(args: &Run) -> RunReport {
    let state = ProcessState::from_env().unwrap();
    let rank = state.process_index();
    let dir = own_copy(&args.dir, args.per_process);
    let device = Default::default();
    let loader = supervised::blob_loader(48 / args.processes, 192);
    let config = AccelerateConfig::new()
        .with_zero_stage(ZeroStage::from_number(3).unwrap())
        .with_checkpoint_layout(CheckpointLayout::Sharded);
    let checkpoints = dir.join("checkpoint");
    let strategy = AccelerateStrategy::<MlpComponents<Train>>::new(config, &device)
        .unwrap()
        .try_with_checkpoint_dir(&checkpoints)
        .unwrap()
        .with_checkpointed_loader(&loader)
        .with_artifact_dir(&dir);
    let held = strategy.start_up_check_held_files();
    Train::seed(&device, 5);
    let model = Mlp::new(supervised::HIDDEN, &device);
    strategy.check_checkpoint_fits(&model).unwrap();
    let held_after_fits = strategy.start_up_check_held_files();
    if let Some((_, name)) = args.alter.as_ref().filter(|(at, _)| *at == rank) {
        let path = checkpoints.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
    }
    let report = strategy.report();
    let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
    let model = supervised::quiet_training(&dir, loader, 64, args.epochs)
        .with_accelerate(strategy)
        .launch(learner)
        .model;
    RunReport {
        parameters: parameters(&model),
        epochs: report.stats().epochs.iter().map(|e| e.epoch).collect(),
        held,
        held_after_fits,
    }
}

#[test]
fn the_start_up_check_of_a_sharded_stage_3_checkpoint_holds_only_what_each_process_loads() {
    const TEST: &str = "precheck_memory::the_start_up_check_of_a_sharded_stage_3_checkpoint_holds_only_what_each_process_loads";
    if let Some(args) = worker::<Run>() {
        return report(&train(&args));
    }
    let run = |processes: usize, epochs: usize, dir: &Path, per_process: bool| Run {
        processes,
        epochs,
        dir: dir.to_path_buf(),
        per_process,
        alter: None,
    };
    let whole_dir = harness::scratch_dir("precheck-memory-whole");
    let whole: Vec<RunReport> = launch(TEST, 2, &run(2, 3, &whole_dir, false), &[])
        .assert_success()
        .reports(2);
    let dir = harness::scratch_dir("precheck-memory");
    let saved = dir.join("saved");
    launch(TEST, 2, &run(2, 2, &saved, false), &[]).assert_success();
    // Each process's copy of the run's directory (Burn's metric logs and the checkpoints).
    let copies = |name: &str, world: usize| {
        let to = dir.join(name);
        for rank in 0..world {
            copy_tree(&saved, &process_copy(&to, rank));
        }
        to
    };
    let shard = |part: &str, rank: usize| format!("{part}-2.shard-{rank}-of-2.mpk");
    let len = |name: &str| {
        std::fs::metadata(saved.join("checkpoint").join(name))
            .unwrap()
            .len() as usize
    };
    let small = ["accelerate-2-scheduler.mpk", "accelerate-2.json"];

    // On 2 processes: each holds its own two shard files and no other process's, from the
    // check until the resume (`check_checkpoint_fits` reads the other's model file and keeps
    // none of it); the run ends as the uninterrupted one, bit for bit.
    let same: Vec<RunReport> = launch(TEST, 2, &run(2, 3, &copies("two", 2), true), &[])
        .assert_success()
        .reports(2);
    for (rank, r) in same.iter().enumerate() {
        let mut expected: Vec<String> = small.iter().map(|s| s.to_string()).collect();
        expected.extend([shard("model", rank), shard("optimizer", rank)]);
        expected.sort();
        let expected: Vec<(String, usize)> = expected
            .into_iter()
            .map(|name| {
                let bytes = len(&name);
                (name, bytes)
            })
            .collect();
        assert_eq!(r.held, expected, "process {rank} of 2");
        assert_eq!(r.held_after_fits, expected, "process {rank} of 2");
        assert_eq!(r.epochs, [3]);
    }
    resume::assert_bit_for_bit(&same, &whole, "2 processes");

    // On 3 processes: no shard file held (which each reads depends on the model, unknown at
    // the check); the run ends within the 1e-5 of the other re-partitioned resumes.
    let three: Vec<RunReport> = launch(TEST, 3, &run(3, 3, &copies("three", 3), true), &[])
        .assert_success()
        .reports(3);
    for (rank, r) in three.iter().enumerate() {
        let names: Vec<&str> = r.held.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, small, "process {rank} of 3");
        assert_eq!(r.held_after_fits, r.held, "process {rank} of 3");
        assert_eq!(r.epochs, [3]);
    }
    resume::assert_to_rounding(&three, &whole, "3 processes");

    // On 3 processes, process 1's copy with an optimizer file it reads (of the saved process
    // that owned its first parameter) altered after its check, which did not keep it: refused
    // by name at the resume, as changed after the check, and not loaded.
    let sizes = sizes(&Mlp::<burn::backend::Flex>::new(
        supervised::HIDDEN,
        &Default::default(),
    ));
    let old = burn_accelerate::zero::partition(&sizes, 2);
    let new = burn_accelerate::zero::partition(&sizes, 3);
    let place = new.iter().position(|&owner| owner == 1).unwrap();
    let name = shard("optimizer", old[place]);
    let altered = Run {
        alter: Some((1, name.clone())),
        ..run(3, 3, &copies("altered", 3), true)
    };
    let refused = launch(TEST, 3, &altered, &[]);
    let output = refused.output();
    assert!(!refused.status.success(), "{output}");
    let path = dir.join("altered/rank-1/checkpoint").join(&name);
    assert!(
        output.contains(&format!(
            "{}: process 1: verified by the start-up check (`try_with_checkpoint_dir`), {name} \
             does not hold what was written",
            path.display()
        )),
        "{output}"
    );
    assert!(
        output.contains("it changed after the checkpoint was verified, and is not loaded"),
        "{output}"
    );

    // `check_checkpoint_fits` in this test's own process (one process: no shard file held)
    // reads the model files the check did not keep as they verified: one changed since is
    // refused naming it.
    let fits = dir.join("fits");
    copy_tree(&saved, &fits);
    let device = Default::default();
    let strategy =
        AccelerateStrategy::<MlpComponents<Train>>::new(AccelerateConfig::new(), &device)
            .unwrap()
            .try_with_checkpoint_dir(fits.join("checkpoint"))
            .unwrap();
    let names: Vec<String> = strategy
        .start_up_check_held_files()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    assert_eq!(names, small);
    let model = Mlp::new(supervised::HIDDEN, &device);
    strategy.check_checkpoint_fits(&model).unwrap();
    let changed = fits.join("checkpoint").join(shard("model", 1));
    let mut bytes = std::fs::read(&changed).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&changed, bytes).unwrap();
    match strategy.check_checkpoint_fits(&model) {
        Err(burn_accelerate::AccelerateError::Checkpoint { path, reason }) => {
            assert_eq!(Path::new(&path), changed, "{reason}");
            assert!(
                reason.starts_with("verified by the start-up check")
                    && reason.contains("it changed after the checkpoint was verified"),
                "{reason}"
            );
        }
        other => panic!(
            "expected a checkpoint error naming {}, got {other:?}",
            changed.display()
        ),
    }
    harness::clean(&whole_dir);
    harness::clean(&dir);
}
