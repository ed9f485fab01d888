//! A run that survives losing a process: `burn-accelerate launch --max-restarts` stops the
//! group, starts it again, and `train_mlp`'s training (`run` of `examples/common/mlp.rs`, with
//! a checkpoint directory) resumes from its newest complete checkpoint, ending with the
//! uninterrupted run's loss, bit for bit. Real processes, killed by real signals: where and
//! when is chosen by the test hooks (`BURN_ACCELERATE_TEST_FAIL_AT`,
//! `BURN_ACCELERATE_TEST_CRASH_WRITING`) at a training step or a file, never by timing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{self, Launched, report, worker};
use super::mlp::{self, DemoConfig};
use super::needs;

/// 1024 samples, 32 per process and step on 2 processes: 16 steps an epoch.
pub(super) const STEPS_PER_EPOCH: usize = 16;
/// Rank 1 dies at this step of the first attempt: the 5th of epoch 2, after epoch 1's
/// checkpoint (written before the main process takes its first step of epoch 2, which rank
/// 1's steps wait for).
pub(super) const MID_EPOCH_2: usize = STEPS_PER_EPOCH + 5;

/// What the worker trains.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Run {
    pub(super) f16: bool,
    pub(super) zero_stage: u8,
    pub(super) checkpoint_dir: PathBuf,
    /// Rank 1 of the first attempt leaves a process behind that tries to join the restarted
    /// run as it (see `a_process_of_an_earlier_attempt_cannot_join_a_later_one`).
    pub(super) stale: bool,
}

/// What a worker's training ended with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Ended {
    pub(super) loss: f32,
    pub(super) loss_bits: u32,
    pub(super) resumed_from: Option<usize>,
    /// The epochs this attempt trained, and the optimizer steps each skipped on overflow.
    pub(super) epochs: Vec<usize>,
    pub(super) skipped: Vec<usize>,
    pub(super) restart: u64,
    /// The processes of the attempt that trained it.
    #[serde(default)]
    pub(super) processes: usize,
}

pub(super) fn train(run: &Run) -> Ended {
    type Train = Accelerated<Autodiff<Flex>>;
    let mut config = DemoConfig::new()
        .with_epochs(3)
        .with_train_items(1024)
        .with_valid_items(256)
        .with_batch_size(32)
        .with_zero_stage(ZeroStage::from_number(run.zero_stage).unwrap())
        .with_checkpoint_dir(Some(run.checkpoint_dir.display().to_string()));
    if run.f16 {
        // Every linear in f16 (the MLP's are all below the small-op threshold), from a scale
        // that overflows at first: epoch 1 backs it off, and a resumed run that did not
        // restore it would skip steps again and end elsewhere.
        config = config
            .with_precision(Precision::F16)
            .with_small_ops(Some(SmallOps::Cast))
            .with_init_scale(Some(2f64.powi(22)));
    }
    let outcome = mlp::run::<Train>(&config, &Default::default()).unwrap();
    Ended {
        loss: outcome.loss,
        loss_bits: outcome.loss.to_bits(),
        resumed_from: outcome.stats.resumed_from,
        epochs: outcome.stats.epochs.iter().map(|e| e.epoch).collect(),
        skipped: outcome
            .stats
            .epochs
            .iter()
            .map(|e| e.skipped_steps)
            .collect(),
        restart: burn_accelerate::distributed::restart_count().unwrap(),
        processes: ProcessState::from_env().unwrap().num_processes(),
    }
}

/// The worker body of every test here.
fn work(test: &str, run: &Run) {
    if std::env::var(STALE).is_ok() {
        return stale_joiner();
    }
    let restart = burn_accelerate::distributed::restart_count().unwrap();
    let rank = ProcessState::from_env().unwrap().process_index();
    if run.stale && restart == 0 && rank == 1 {
        leave_a_stale_process(test);
    }
    if run.stale && restart == 1 && rank == 0 {
        std::fs::write(harness::worker_dir().join(RESTARTED), b"").unwrap();
    }
    report(&train(run));
}

pub(super) fn refuse_under_mpi() {
    if harness::under_mpi() {
        needs::missing(
            "burn-accelerate's launcher rather than mpirun (BURN_ACCELERATE_TEST_ENGINE=mpi is set)",
        );
    }
}

/// Launches `test`'s worker on 2 processes with `--max-restarts restarts`, the test hooks'
/// variables `vars`, and a fresh checkpoint directory; returns the launch and its directory.
fn launch(
    test: &str,
    f16: bool,
    zero_stage: u8,
    stale: bool,
    restarts: u32,
    vars: &[(&str, String)],
    extra: &[&str],
) -> (Launched, PathBuf) {
    let checkpoint_dir = harness::scratch_dir(&format!("{test}-checkpoints"));
    let run = Run {
        f16,
        zero_stage,
        checkpoint_dir: checkpoint_dir.clone(),
        stale,
    };
    let restarts = restarts.to_string();
    // The timeouts are far away: only the launcher and the liveness check end these runs.
    let args = [
        "--max-restarts",
        &restarts,
        "--timeout",
        "120",
        "--grace",
        "2",
    ];
    let args: Vec<&str> = args.iter().chain(extra).copied().collect();
    let (mut command, dir) = harness::launch_command(test, 2, &run, &args);
    command.envs(vars.iter().map(|(k, v)| (*k, v.as_str())));
    (harness::run(command, dir), checkpoint_dir)
}

/// The uninterrupted run's ending, one launch per setting for the whole binary.
fn uninterrupted(test: &str, f16: bool, zero_stage: u8) -> Ended {
    static DONE: Mutex<Option<HashMap<(bool, u8), Ended>>> = Mutex::new(None);
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ended) = done.get_or_insert_default().get(&(f16, zero_stage)) {
        return ended.clone();
    }
    let (run, checkpoints) = launch(test, f16, zero_stage, false, 1, &[], &[]);
    run.assert_success();
    let ended: Ended = run.report(0);
    assert_eq!(run.report::<Ended>(1), ended);
    assert_eq!((ended.resumed_from, ended.restart), (None, 0), "{ended:?}");
    assert_eq!(ended.epochs, [1, 2, 3]);
    assert!(!run.stderr.contains("[attempt 2/2]"), "{}", run.output());
    harness::clean(run.dir());
    harness::clean(&checkpoints);
    done.get_or_insert_default()
        .insert((f16, zero_stage), ended.clone());
    ended
}

/// Every line the launcher wrote itself names its attempt.
fn assert_lines_name_their_attempt(run: &Launched) {
    for line in run.stderr.lines() {
        if line.starts_with("burn-accelerate launch") && !line.contains("the run failed") {
            assert!(line.contains("[attempt "), "{line}\n{}", run.output());
        }
    }
}

/// A rank killed in the middle of epoch 2 of the first attempt; the restart resumes from
/// epoch 1's checkpoint and ends bit for bit where the uninterrupted run does.
fn killed_and_resumed(test: &str, f16: bool, zero_stage: u8) {
    let whole = uninterrupted(test, f16, zero_stage);
    let fail_at = [(mlp::FAIL_AT, format!("0:1:{MID_EPOCH_2}"))];
    let (run, checkpoints) = launch(test, f16, zero_stage, false, 1, &fail_at, &[]);
    run.assert_success();
    for said in [
        "[attempt 1/2]: process 1 was killed by signal SIGKILL; the other processes were stopped",
        "[attempt 1/2]: restarting the run",
        "[attempt 2/2]: every process succeeded",
    ] {
        assert!(run.stderr.contains(said), "{said}:\n{}", run.output());
    }
    assert_lines_name_their_attempt(&run);
    let resumed: Ended = run.report(0);
    assert_eq!(run.report::<Ended>(1), resumed);
    assert_eq!(resumed.restart, 1);
    assert_eq!(resumed.resumed_from, Some(1), "{}", run.output());
    assert_eq!(resumed.epochs, [2, 3]);
    assert_eq!(resumed.skipped[..], whole.skipped[1..]);
    // For the record (`--nocapture`): the two endings side by side.
    eprintln!(
        "f16 {f16}, ZeRO stage {zero_stage}: uninterrupted loss {} ({:#010x}, skipped {:?}), \
         killed and resumed {} ({:#010x}, skipped {:?} after the restart)",
        whole.loss,
        whole.loss_bits,
        whole.skipped,
        resumed.loss,
        resumed.loss_bits,
        resumed.skipped
    );
    assert_eq!(
        resumed.loss_bits, whole.loss_bits,
        "f16 {f16}, stage {zero_stage}: resumed {} vs uninterrupted {}",
        resumed.loss, whole.loss
    );
    harness::clean(run.dir());
    harness::clean(&checkpoints);
}

#[test]
fn a_killed_process_restarts_and_the_run_ends_at_the_uninterrupted_loss() {
    const TEST: &str =
        "restarts::a_killed_process_restarts_and_the_run_ends_at_the_uninterrupted_loss";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    killed_and_resumed(TEST, false, 0);
    // f16 with dynamic loss scaling: the scale epoch 1 backed off to is restored.
    let whole = uninterrupted(TEST, true, 0);
    assert!(whole.skipped[0] > 0, "{whole:?}");
    killed_and_resumed(TEST, true, 0);
}

#[test]
fn a_killed_process_restarts_a_zero_stage_2_run_at_the_uninterrupted_loss() {
    const TEST: &str =
        "restarts::a_killed_process_restarts_a_zero_stage_2_run_at_the_uninterrupted_loss";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    killed_and_resumed(TEST, false, 2);
}

#[test]
fn a_killed_process_restarts_a_zero_stage_3_run_at_the_uninterrupted_loss() {
    const TEST: &str =
        "restarts::a_killed_process_restarts_a_zero_stage_3_run_at_the_uninterrupted_loss";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    // Each process holds half of the parameters between steps; the checkpoint's model record
    // is gathered on the main process.
    killed_and_resumed(TEST, false, 3);
}

#[test]
fn a_frozen_process_fails_the_run_by_liveness_and_the_restart_ends_at_the_same_loss() {
    const TEST: &str = "restarts::a_frozen_process_fails_the_run_by_liveness_and_the_restart_ends_at_the_same_loss";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    let whole = uninterrupted(TEST, false, 0);
    // Rank 1 freezes (SIGSTOP) in epoch 2: it never exits; rank 0's liveness check fails
    // the run, and the launcher stops both and restarts them.
    let freeze = [(mlp::FAIL_AT, format!("0:1:{MID_EPOCH_2}:stop"))];
    let (run, checkpoints) = launch(
        TEST,
        false,
        0,
        false,
        1,
        &freeze,
        &["--liveness-timeout", "2"],
    );
    run.assert_success();
    for said in [
        "has sent nothing for 2s",
        "[attempt 1/2]: process 0 exited with status 101 (a Rust panic); the other processes \
         were stopped",
        "[attempt 2/2]: every process succeeded",
    ] {
        assert!(run.stderr.contains(said), "{said}:\n{}", run.output());
    }
    let resumed: Ended = run.report(0);
    assert_eq!((resumed.restart, resumed.resumed_from), (1, Some(1)));
    assert_eq!(resumed.loss_bits, whole.loss_bits);
    harness::clean(run.dir());
    harness::clean(&checkpoints);
}

#[test]
fn a_crash_while_writing_a_checkpoint_resumes_from_the_one_before() {
    const TEST: &str = "restarts::a_crash_while_writing_a_checkpoint_resumes_from_the_one_before";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    let whole = uninterrupted(TEST, false, 0);
    // The main process dies with half of epoch 2's optimizer state on the disk (its model is
    // whole already): epoch 2's checkpoint is not listed, and the restart resumes from 1.
    let crash = [(
        burn_accelerate::checkpoint::CRASH_WRITING,
        "0:accelerate-2-optim.mpk".to_string(),
    )];
    let (run, checkpoints) = launch(TEST, false, 0, false, 1, &crash, &[]);
    run.assert_success();
    assert!(
        run.stderr
            .contains("[attempt 1/2]: process 0 was killed by signal SIGKILL"),
        "{}",
        run.output()
    );
    let resumed: Ended = run.report(0);
    assert_eq!(
        (resumed.restart, resumed.resumed_from),
        (1, Some(1)),
        "{}",
        run.output()
    );
    assert_eq!(resumed.epochs, [2, 3]);
    eprintln!(
        "uninterrupted loss {} ({:#010x}), main process killed writing epoch 2's checkpoint \
         and resumed from epoch 1: {} ({:#010x})",
        whole.loss, whole.loss_bits, resumed.loss, resumed.loss_bits
    );
    assert_eq!(
        resumed.loss_bits, whole.loss_bits,
        "{} vs {}",
        resumed.loss, whole.loss
    );
    // What the restart wrote is listed and whole; nothing half-written is left.
    let listed = burn_accelerate::checkpoint::Manifest::read(&checkpoints).unwrap();
    let epochs: Vec<usize> = listed.checkpoints.iter().map(|c| c.epoch).collect();
    assert_eq!(epochs, [2, 3]);
    let newest = burn_accelerate::checkpoint::CheckpointDir::new(&checkpoints)
        .load_newest(None)
        .unwrap()
        .unwrap();
    assert_eq!((newest.epoch, newest.skipped.len()), (3, 0));
    let partial: Vec<_> = std::fs::read_dir(&checkpoints)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(burn_accelerate::checkpoint::PARTIAL))
        .collect();
    assert!(partial.is_empty(), "{partial:?}");
    harness::clean(run.dir());
    harness::clean(&checkpoints);
}

#[test]
fn a_spent_restart_budget_ends_the_run_naming_every_attempts_failure() {
    const TEST: &str =
        "restarts::a_spent_restart_budget_ends_the_run_naming_every_attempts_failure";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    // Rank 1 is killed in the first attempt; rank 0 gives up in the second.
    let fail_at = [(mlp::FAIL_AT, format!("0:1:{MID_EPOCH_2},1:0:3:exit=7"))];
    let (run, checkpoints) = launch(TEST, false, 0, false, 1, &fail_at, &[]);
    assert_eq!(run.status.code(), Some(1), "{}", run.output());
    assert_lines_name_their_attempt(&run);
    for said in [
        "[attempt 2/2]: process 0 exited with status 7; the other processes were stopped",
        "the run failed 2 times and --max-restarts 1 allows no more restarts (attempt 1: \
         process 1 was killed by signal SIGKILL; attempt 2: process 0 exited with status 7)",
    ] {
        assert!(run.stderr.contains(said), "{said}:\n{}", run.output());
    }
    // No third attempt.
    assert!(!run.stderr.contains("[attempt 3/"), "{}", run.output());
    harness::clean(run.dir());
    harness::clean(&checkpoints);
}

// ---------------------------------------------------------------------------------------
// A process of an earlier attempt, still alive, trying to join the restarted run.

/// Set in the process left behind.
const STALE: &str = "BURN_ACCELERATE_TEST_STALE_JOINER";
/// Written by the restarted attempt's rank 0 when it starts.
const RESTARTED: &str = "restarted";

/// What the stale process found.
#[derive(Debug, Serialize, Deserialize)]
struct Stale {
    error: String,
    seconds: f64,
}

// Rank 1 of the first attempt starts a copy of itself, with its environment (its rank, its
// attempt, the run's secret and rendezvous), in a process group of its own, out of reach of
// the launcher's stop: a process that outlived its attempt.
fn leave_a_stale_process(test: &str) {
    let dir = harness::worker_dir();
    let log = std::fs::File::create(dir.join("stale.log")).unwrap();
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .arg(test)
        .args(harness::WORKER_FLAGS)
        .env(STALE, "1")
        // Its own port for peers, one the system picks: the restarted rank 1 may be given
        // this attempt's.
        .env("BURN_ACCELERATE_DATA_PORT", "0")
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    // Never waited for: it is to outlive this process (the test kills it if it hangs).
    #[allow(clippy::zombie_processes)]
    let child = command.spawn().unwrap();
    std::fs::write(dir.join("stale.pid"), child.id().to_string()).unwrap();
}

// The stale process: once the restarted attempt has started, it comes to the rendezvous as
// the rank 1 it was.
fn stale_joiner() {
    let dir = harness::worker_dir();
    let start = Instant::now();
    while !dir.join(RESTARTED).exists() {
        if start.elapsed() > Duration::from_secs(120) {
            panic!("the restarted attempt never started");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let began = Instant::now();
    let joined = ProcessState::from_env().unwrap().group();
    let stale = Stale {
        error: joined.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: began.elapsed().as_secs_f64(),
    };
    std::fs::write(dir.join("stale.json"), serde_json::to_vec(&stale).unwrap()).unwrap();
}

#[test]
fn a_process_of_an_earlier_attempt_cannot_join_a_later_one() {
    const TEST: &str = "restarts::a_process_of_an_earlier_attempt_cannot_join_a_later_one";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    let whole = uninterrupted(TEST, false, 0);
    let fail_at = [(mlp::FAIL_AT, format!("0:1:{MID_EPOCH_2}"))];
    let (run, checkpoints) = launch(TEST, false, 0, true, 1, &fail_at, &[]);
    let dir = run.dir().to_path_buf();
    let pid: i32 = std::fs::read_to_string(dir.join("stale.pid"))
        .unwrap_or_else(|_| panic!("no stale process was left: {}", run.output()))
        .parse()
        .unwrap();
    // Its answer, once it has one (it may come after the run ended).
    let start = Instant::now();
    let stale: Stale = loop {
        if let Ok(bytes) = std::fs::read(dir.join("stale.json")) {
            break serde_json::from_slice(&bytes).unwrap();
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!(
                "the stale process never got an answer:\n{}\n--- its log\n{}",
                run.output(),
                std::fs::read_to_string(dir.join("stale.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Refused at once, saying why; and the run it tried to join completed, unharmed.
    assert!(
        stale.error.contains("belongs to attempt 1 of the run")
            && stale.error.contains("is at attempt 2 now")
            && stale.error.contains("stop it"),
        "{stale:?}"
    );
    assert!(stale.seconds < 10.0, "{stale:?}");
    run.assert_success();
    let resumed: Ended = run.report(0);
    assert_eq!(resumed.resumed_from, Some(1));
    assert_eq!(resumed.loss_bits, whole.loss_bits);
    harness::clean(&dir);
    harness::clean(&checkpoints);
}

// ---------------------------------------------------------------------------------------
// torchrun's own restarts.

#[test]
#[ignore = "needs torchrun (the LibTorch tier's venv, or TORCHRUN): .ci/run runs it with --ignored"]
fn torchrun_restarts_resume_as_the_launchers_do() {
    const TEST: &str = "restarts::torchrun_restarts_resume_as_the_launchers_do";
    if let Some(run) = worker::<Run>() {
        return work(TEST, &run);
    }
    refuse_under_mpi();
    let Some(torchrun) = super::torchrun() else {
        needs::missing(
            "torchrun (the LibTorch tier's venv, scripts/tch-env.sh, provides it; or set TORCHRUN)",
        );
    };
    let whole = uninterrupted(TEST, false, 0);
    let dir = harness::scratch_dir(TEST);
    let checkpoints = harness::scratch_dir(&format!("{TEST}-checkpoints"));
    let run = Run {
        f16: false,
        zero_stage: 0,
        checkpoint_dir: checkpoints.clone(),
        stale: false,
    };
    let mut command = std::process::Command::new(torchrun);
    command
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--no-python",
        ])
        .arg(std::env::current_exe().unwrap())
        .arg(TEST)
        .args(harness::WORKER_FLAGS)
        .env(harness::WORKER_DIR, &dir)
        .env(
            "BURN_ACCELERATE_TEST_WORKER_ARGS",
            serde_json::to_string(&run).unwrap(),
        )
        .env(mlp::FAIL_AT, format!("0:1:{MID_EPOCH_2}"))
        // As the launcher gives each of two processes on two cores.
        .env("RAYON_NUM_THREADS", "1");
    let ran = harness::run(command, dir.clone());
    assert!(ran.status.success(), "{}", ran.output());
    let resumed: Ended = ran.report(0);
    assert_eq!(
        (resumed.restart, resumed.resumed_from),
        (1, Some(1)),
        "{}",
        ran.output()
    );
    assert_eq!(resumed.loss_bits, whole.loss_bits);
    harness::clean(&dir);
    harness::clean(&checkpoints);
}
