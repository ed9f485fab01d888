//! Elastic machine counts: `burn-accelerate launch --num-machines 1:2` on two "machines"
//! (network namespaces, see [`TwoMachines`](super::TwoMachines)) of one process each, training
//! `train_mlp`'s model with a checkpoint directory. When machine 1 is lost (its launcher and
//! its process killed, or its link cut), machine 0's launcher restarts the run alone, and the
//! restarted run resumes from epoch 1's checkpoint on one process: the data re-shards from the
//! checkpoint's epoch, the optimizer state is whole in the checkpoint. It ends bit for bit where
//! a one-process run resumed from the same checkpoint ends (not where the uninterrupted
//! two-process run does: each step of the resumed epochs sees one process's batch, half the
//! effective batch, see the README's "When a machine is lost").
//!
//! Where machine 1 fails is chosen by the test hook (its process freezes as step 21 begins, in
//! epoch 2), not by timing: epoch 1's checkpoint is the newest when the machine is lost.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::harness::{self, Launched, report, worker};
use super::mlp;
use super::needs;
use super::restarts::{Ended, MID_EPOCH_2, Run, refuse_under_mpi, train};

fn run_of(zero_stage: u8, checkpoint_dir: PathBuf) -> Run {
    Run {
        f16: false,
        zero_stage,
        checkpoint_dir,
        stale: false,
    }
}

/// A one-machine launch of `processes` processes of `test`'s worker on `run`, with the test
/// hook's `fail_at` (none: empty).
fn launch_here(test: &str, processes: usize, run: &Run, fail_at: &str) -> Launched {
    let (mut command, dir) =
        harness::launch_command(test, processes, run, &["--grace", "2", "--timeout", "120"]);
    if !fail_at.is_empty() {
        command.env(mlp::FAIL_AT, fail_at);
    }
    harness::run(command, dir)
}

/// A checkpoint of epoch 1 written by two processes (whose run then lost rank 1 in epoch 2,
/// without restarts), resumed by one: what an elastic run that lost one of its two machines
/// there must end with. One per ZeRO stage for the whole binary.
fn resumed_on_one(test: &str, zero_stage: u8) -> Ended {
    static DONE: Mutex<Option<HashMap<u8, Ended>>> = Mutex::new(None);
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ended) = done.get_or_insert_default().get(&zero_stage) {
        return ended.clone();
    }
    let checkpoints = harness::scratch_dir(&format!("{test}-reference-checkpoints"));
    let run = run_of(zero_stage, checkpoints.clone());
    let killed = launch_here(test, 2, &run, &format!("0:1:{MID_EPOCH_2}"));
    assert!(!killed.status.success(), "{}", killed.output());
    assert!(
        killed
            .stderr
            .contains("process 1 was killed by signal SIGKILL"),
        "{}",
        killed.output()
    );
    let resumed = launch_here(test, 1, &run, "");
    resumed.assert_success();
    let ended: Ended = resumed.report(0);
    assert_eq!(
        (ended.resumed_from, ended.processes),
        (Some(1), 1),
        "{}",
        resumed.output()
    );
    assert_eq!(ended.epochs, [2, 3]);
    assert!(ended.loss.is_finite(), "{ended:?}");
    harness::clean(killed.dir());
    harness::clean(resumed.dir());
    harness::clean(&checkpoints);
    done.get_or_insert_default()
        .insert(zero_stage, ended.clone());
    ended
}

#[test]
fn a_checkpoint_of_two_processes_resumes_on_one_with_or_without_zero() {
    const TEST: &str = "elastic::a_checkpoint_of_two_processes_resumes_on_one_with_or_without_zero";
    if let Some(run) = worker::<Run>() {
        return report(&train(&run));
    }
    refuse_under_mpi();
    let plain = resumed_on_one(TEST, 0);
    // ZeRO 2's checkpoint holds the whole optimizer state (gathered from both owners), which
    // one process then owns entirely: the same numbers as data parallelism's, so the same loss.
    let sharded = resumed_on_one(TEST, 2);
    eprintln!(
        "resumed on 1 process from 2 processes' epoch 1: ZeRO 0 loss {} ({:#010x}), ZeRO 2 loss \
         {} ({:#010x})",
        plain.loss, plain.loss_bits, sharded.loss, sharded.loss_bits
    );
    assert_eq!(
        sharded.loss_bits, plain.loss_bits,
        "{sharded:?} vs {plain:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Two machines, one lost.

/// How machine 1 is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loss {
    /// Its launcher and its process are killed (`SIGKILL`), as a machine that dies.
    Killed,
    /// The link between the machines goes down; machine 1 lives on, cut off.
    Cut,
}

fn pids_in(namespace: &str) -> Vec<i32> {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", namespace])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
        .unwrap_or(false)
}

/// Two machines and what their launchers share: an elastic run of `test`'s worker.
struct Elastic {
    test: &'static str,
    machines: super::TwoMachines,
    dir: PathBuf,
    checkpoints: PathBuf,
    secret: PathBuf,
    port: String,
    run: String,
}

impl Elastic {
    fn make(test: &'static str) -> Self {
        let machines = super::TwoMachines::make().unwrap_or_else(|why| {
            needs::missing(&format!(
                "two network namespaces (root and iproute2's `ip`), which cannot be made: {why}"
            ))
        });
        let dir = harness::scratch_dir(test);
        let checkpoints = harness::scratch_dir(&format!("{test}-checkpoints"));
        let secret = dir.join("run.secret");
        std::fs::write(&secret, "the elastic test's secret").unwrap();
        let run = serde_json::to_string(&run_of(0, checkpoints.clone())).unwrap();
        Self {
            test,
            machines,
            dir,
            checkpoints,
            secret,
            port: harness::free_port().to_string(),
            run,
        }
    }

    /// Starts machine `machine`'s launcher (`--num-machines 1:2`, one process per machine),
    /// with the test hook's `fail_at`.
    fn launcher(
        &self,
        machine: usize,
        restarts: u32,
        fail_at: &str,
    ) -> std::thread::JoinHandle<Launched> {
        let mut command = std::process::Command::new("ip");
        command
            .args(["netns", "exec", &self.machines.names[machine]])
            .arg(env!("CARGO_BIN_EXE_burn-accelerate"))
            .args(["launch", "--num-machines", "1:2", "--num-processes", "2"])
            .args(["--machine-rank", &machine.to_string()])
            .args(["--main-process-ip", self.machines.addresses[0]])
            .args(["--main-process-port", &self.port])
            .arg("--secret-file")
            .arg(&self.secret)
            .args([
                "--max-restarts",
                &restarts.to_string(),
                "--join-window",
                "5",
            ])
            .args(["--liveness-timeout", "3", "--grace", "2"])
            .args(["--timeout", "60"])
            .arg("--")
            .arg(std::env::current_exe().unwrap())
            .arg(self.test)
            .args(harness::WORKER_FLAGS)
            .env(harness::WORKER_DIR, &self.dir)
            .env("BURN_ACCELERATE_TEST_WORKER_ARGS", &self.run)
            .env(mlp::FAIL_AT, fail_at);
        let dir = self.dir.clone();
        std::thread::spawn(move || harness::run(command, dir))
    }

    /// The process of machine `machine` that the test hook froze in attempt `restart + 1`,
    /// once it is frozen.
    fn frozen(
        &self,
        machine: usize,
        restart: u64,
        launchers: &[&std::thread::JoinHandle<Launched>],
    ) -> i32 {
        let start = Instant::now();
        let attempt = format!("BURN_ACCELERATE_RESTART_COUNT={restart}");
        loop {
            let frozen = pids_in(&self.machines.names[machine])
                .into_iter()
                .find(|&pid| {
                    stopped(pid)
                        && std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                            env.split(|&b| b == 0).any(|v| v == attempt.as_bytes())
                        })
                });
            if let Some(pid) = frozen {
                return pid;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120)
                    && !launchers.iter().any(|l| l.is_finished()),
                "machine {machine}'s process of attempt {} was never frozen",
                restart + 1
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills every process of machine `machine` (its launcher, its processes), as a machine
    /// that dies.
    fn kill(&self, machine: usize) {
        for pid in pids_in(&self.machines.names[machine]) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }

    fn clean(&self) {
        harness::clean(&self.dir);
        harness::clean(&self.checkpoints);
    }
}

fn gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

fn machine_lost(test: &'static str, loss: Loss) {
    let reference = resumed_on_one(test, 0);
    let elastic = Elastic::make(test);
    // Machine 1's process (rank 1 of the first attempt) freezes as step 21 begins.
    let fail_at = format!("0:1:{MID_EPOCH_2}:stop");
    let (first, second) = (
        elastic.launcher(0, 1, &fail_at),
        elastic.launcher(1, 1, &fail_at),
    );
    // Machine 1's process, frozen in epoch 2 (after epoch 1's checkpoint)...
    let frozen = elastic.frozen(1, 0, &[&first, &second]);
    // ...and then the machine is lost, well within the liveness timeout (3 s) that would have
    // ended the attempt otherwise (and restarted it on both machines).
    match loss {
        Loss::Killed => elastic.kill(1),
        Loss::Cut => elastic.machines.cut(),
    }
    let main = first.join().unwrap();
    main.assert_success();
    let other = match loss {
        Loss::Killed => second.join().unwrap(),
        Loss::Cut => {
            // Cut off, machine 1's launcher stopped its process and waits to reach machine
            // 0's again (until --timeout): stopped here, it ends at once.
            let start = Instant::now();
            while !gone(frozen) {
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "machine 1's launcher never stopped its frozen process"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            for pid in pids_in(&elastic.machines.names[1]) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            second.join().unwrap()
        }
    };
    assert!(!other.status.success(), "{}", other.output());
    for said in [
        "[attempt 1/2]: 2 of at most 2 machines take part",
        "[attempt 1/2]: restarting the run with the machines that are ready",
        "[attempt 2/2]: 1 of at most 2 machines take part (by --machine-rank: [0]), 1 processes",
        "[attempt 2/2]: every process succeeded, on every machine",
    ] {
        assert!(main.stderr.contains(said), "{said}:\n{}", main.output());
    }
    if loss == Loss::Killed {
        let said = "lost machine 1's launcher";
        assert!(main.stderr.contains(said), "{said}:\n{}", main.output());
    } else {
        let said = "lost machine 0's launcher";
        assert!(other.stderr.contains(said), "{said}:\n{}", other.output());
    }
    // For the record (`--nocapture`): what the launchers said.
    let launchers_lines = |run: &Launched| {
        run.stderr
            .lines()
            .filter(|l| l.starts_with("burn-accelerate"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    eprintln!(
        "--- machine 0\n{}\n--- machine 1\n{}",
        launchers_lines(&main),
        launchers_lines(&other)
    );
    let ended: Ended = main.report(0);
    assert_eq!(
        (ended.restart, ended.resumed_from, ended.processes),
        (1, Some(1), 1),
        "{}",
        main.output()
    );
    assert_eq!(ended.epochs, [2, 3]);
    eprintln!(
        "{loss:?}: machine 0 alone from epoch 1's checkpoint: loss {} ({:#010x}); one process \
         resumed from a two-process epoch 1 checkpoint: {} ({:#010x})",
        ended.loss, ended.loss_bits, reference.loss, reference.loss_bits
    );
    assert_eq!(
        ended.loss_bits, reference.loss_bits,
        "{} vs {}",
        ended.loss, reference.loss
    );
    elastic.clean();
}

#[test]
#[ignore = "needs root and iproute2's `ip` to make network namespaces: .ci/run runs it with --ignored"]
fn when_machine_1_dies_machine_0_goes_on_alone_from_the_last_checkpoint() {
    const TEST: &str =
        "elastic::when_machine_1_dies_machine_0_goes_on_alone_from_the_last_checkpoint";
    if let Some(run) = worker::<Run>() {
        return report(&train(&run));
    }
    refuse_under_mpi();
    machine_lost(TEST, Loss::Killed);
}

#[test]
#[ignore = "needs root and iproute2's `ip` to make network namespaces: .ci/run runs it with --ignored"]
fn when_the_link_is_cut_machine_0_goes_on_alone_from_the_last_checkpoint() {
    const TEST: &str =
        "elastic::when_the_link_is_cut_machine_0_goes_on_alone_from_the_last_checkpoint";
    if let Some(run) = worker::<Run>() {
        return report(&train(&run));
    }
    refuse_under_mpi();
    machine_lost(TEST, Loss::Cut);
}

/// The uninterrupted two-process run's ending.
fn uninterrupted_two(test: &str) -> Ended {
    let checkpoints = harness::scratch_dir(&format!("{test}-uninterrupted-checkpoints"));
    let run = launch_here(test, 2, &run_of(0, checkpoints.clone()), "");
    run.assert_success();
    let ended: Ended = run.report(0);
    assert_eq!((ended.resumed_from, ended.processes), (None, 2));
    harness::clean(run.dir());
    harness::clean(&checkpoints);
    ended
}

#[test]
#[ignore = "needs root and iproute2's `ip` to make network namespaces: .ci/run runs it with --ignored"]
fn a_machine_that_comes_back_joins_at_the_next_restart() {
    const TEST: &str = "elastic::a_machine_that_comes_back_joins_at_the_next_restart";
    if let Some(run) = worker::<Run>() {
        return report(&train(&run));
    }
    refuse_under_mpi();
    let whole = uninterrupted_two(TEST);
    let elastic = Elastic::make(TEST);
    // Machine 1's process freezes in epoch 2 of attempt 1, and machine 1 dies; machine 0's
    // process freezes in epoch 2 of attempt 2, which it runs alone.
    let fail_at = format!("0:1:{MID_EPOCH_2}:stop,1:0:5:stop");
    let (first, second) = (
        elastic.launcher(0, 2, &fail_at),
        elastic.launcher(1, 2, &fail_at),
    );
    elastic.frozen(1, 0, &[&first, &second]);
    elastic.kill(1);
    let lost = second.join().unwrap();
    assert!(!lost.status.success(), "{}", lost.output());
    let alone = elastic.frozen(0, 1, &[&first]);
    // Machine 1's launcher is started again while attempt 2 runs: it waits for the next.
    let back = elastic.launcher(1, 2, &fail_at);
    // Attempt 2 fails (its process killed); attempt 3 has both machines again.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(alone),
        nix::sys::signal::Signal::SIGKILL,
    );
    let main = first.join().unwrap();
    let back = back.join().unwrap();
    main.assert_success();
    back.assert_success();
    for said in [
        "[attempt 1/3]: 2 of at most 2 machines take part",
        "lost machine 1's launcher",
        "[attempt 2/3]: 1 of at most 2 machines take part",
        "machine 1's launcher joined the run",
        "[attempt 2/3]: process 0 was killed by signal SIGKILL",
        "[attempt 3/3]: 2 of at most 2 machines take part (by --machine-rank: [0, 1]), 2 processes",
        "[attempt 3/3]: every process succeeded, on every machine",
    ] {
        assert!(main.stderr.contains(said), "{said}:\n{}", main.output());
    }
    assert!(
        back.stderr
            .contains("the run is over: every process succeeded"),
        "{}",
        back.output()
    );
    // Attempt 2 wrote no checkpoint (it stopped in epoch 2): attempt 3 resumes from the first
    // attempt's epoch 1 on two processes again, and ends where the uninterrupted run does.
    let ended: Ended = main.report(0);
    assert_eq!(main.report::<Ended>(1), ended);
    assert_eq!(
        (ended.restart, ended.resumed_from, ended.processes),
        (2, Some(1), 2),
        "{}",
        main.output()
    );
    eprintln!(
        "machine 1 lost and back: loss {} ({:#010x}); uninterrupted: {} ({:#010x})",
        ended.loss, ended.loss_bits, whole.loss, whole.loss_bits
    );
    assert_eq!(
        ended.loss_bits, whole.loss_bits,
        "{} vs {}",
        ended.loss, whole.loss
    );
    elastic.clean();
}
