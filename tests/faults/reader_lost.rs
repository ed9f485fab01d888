//! `dispatch_batches` across processes, where process 0 (the one that reads the data and
//! sends the other its batches) is lost without exiting (issue 49): on another machine (a
//! network namespace, see [`TwoMachines`](super::TwoMachines)) behind a link cut mid-epoch,
//! or frozen (`SIGSTOP`) mid-epoch on this one. Nothing closes a connection here: a wait on
//! process 0 ends by the liveness check (`BURN_ACCELERATE_LIVENESS_TIMEOUT`) or the run's
//! timeout (`BURN_ACCELERATE_TIMEOUT`), whichever is shorter: one is 2 s in these runs, the
//! other 600 s. The receiver's epoch ends within the short one, without a panic, and its next
//! call that can fail (`wait_for_everyone`) returns a typed error naming process 0 and saying
//! it fell silent (or that its message did not come in time). Process 0 does not wait forever
//! either: behind the cut link its next send fails the same way, naming the receiver; frozen,
//! then continued (`SIGCONT`), it finds the run ended and says so, and by whom (not that the
//! receiver, whose frames waited unread while process 0 was frozen, fell silent).
//!
//! Both processes take one batch every [`PACE`], so that process 0 is mid-epoch, far from its
//! end, when it is lost: it cannot have sent the receiver the rest of the epoch ahead.

use std::path::Path;
use std::process::Command;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder, StreamLoaderBuilder};
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::{AccelerateConfig, Accelerator};
use nix::sys::signal::{Signal, kill, raise};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::harness::{self, Launched, report, worker};
use super::needs;

/// Items per batch, and steps per epoch (one batch per process each): 512 steps of [`PACE`]
/// are 10 s, far more than the test lets a process run after it is lost.
const BATCH: usize = 4;
const STEPS: usize = 512;
/// How long each process takes over each of its batches.
const PACE: Duration = Duration::from_millis(20);
/// Each process says it is running after this many batches; process 0, frozen, freezes there.
const LOST_AFTER: usize = 10;
/// The short timeout of these runs, in seconds: the liveness timeout, or the run's.
const SHORT: u64 = 2;
/// The other one, far away.
const LONG: u64 = 600;
/// The room a busy 2-core machine gets past the liveness timeout.
const SLACK: Duration = Duration::from_secs(6);

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Case {
    stream: bool,
    num_workers: usize,
    /// Process 0 freezes itself (`SIGSTOP`) after [`LOST_AFTER`] batches; else the test cuts
    /// the link once both have taken that many.
    frozen: bool,
    /// The liveness timeout is [`SHORT`] and the run's [`LONG`]; else the other way round.
    by_liveness: bool,
}

impl Case {
    /// `BURN_ACCELERATE_LIVENESS_TIMEOUT` and `BURN_ACCELERATE_TIMEOUT`.
    fn timeouts(&self) -> [u64; 2] {
        if self.by_liveness {
            [SHORT, LONG]
        } else {
            [LONG, SHORT]
        }
    }

    /// What ends a wait for `who` (`process 0 at <address> (host <name>)`): the parts of
    /// the error, in order.
    fn said(&self, who: &str) -> Vec<String> {
        if self.by_liveness {
            vec![format!(
                "{who} has sent nothing for {SHORT}s, not even a heartbeat: it is frozen \
                 (stopped, swapping, stuck in the kernel) or its machine cannot be reached"
            )]
        } else {
            let rank = &who[..who.find(" at ").unwrap_or(who.len())];
            vec![
                format!("timed out after {SHORT}s waiting for stream "),
                format!("'s next message from {rank}: "),
            ]
        }
    }
}

/// What a process saw of its epoch.
#[derive(Debug, Serialize, Deserialize)]
struct Seen {
    batches: usize,
    /// `wait_for_everyone`'s error after the epoch (empty: none).
    error: String,
    /// Seconds from its last batch to its epoch's end.
    waited: f64,
}

/// A batch: each item's first byte.
#[derive(Clone)]
struct Firsts;

impl Batcher<Flex, Vec<u8>, Vec<u8>> for Firsts {
    fn batch(&self, items: Vec<Vec<u8>>, _: &burn::backend::flex::FlexDevice) -> Vec<u8> {
        items.iter().map(|item| item[0]).collect()
    }
}

fn items() -> Vec<Vec<u8>> {
    (0..2 * STEPS * BATCH).map(|i| vec![i as u8; 8]).collect()
}

fn reader_lost_worker(case: Case) {
    let device = Default::default();
    let state = ProcessState::from_env().unwrap();
    let accelerator = Accelerator::<Autodiff<Flex>>::new(AccelerateConfig::new(), &device).unwrap();
    let config = DataLoaderConfig::new(BATCH)
        .with_dispatch_batches(true)
        .with_shuffle(false)
        .with_num_workers(case.num_workers);
    let batches: Box<dyn DataLoader<Flex, Vec<u8>>> = if case.stream {
        Box::new(
            StreamLoaderBuilder::new(config, |_: u64| items(), Firsts)
                .build_dispatching(&state, device)
                .unwrap(),
        )
    } else {
        Box::new(
            ShardLoaderBuilder::new(config, InMemDataset::new(items()), Firsts)
                .build_dispatching(&state, device)
                .unwrap(),
        )
    };
    let rank = state.process_index();
    let dir = harness::worker_dir();
    let mut taken = 0;
    let mut last = Instant::now();
    for _ in batches.iter() {
        taken += 1;
        last = Instant::now();
        if taken == LOST_AFTER {
            std::fs::write(dir.join(format!("running-{rank}")), b"").unwrap();
            if case.frozen && rank == 0 {
                std::fs::write(dir.join("frozen"), std::process::id().to_string()).unwrap();
                // As `kill -STOP` freezes it: its network threads stop too.
                raise(Signal::SIGSTOP).unwrap();
            }
        }
        std::thread::sleep(PACE);
    }
    let waited = last.elapsed().as_secs_f64();
    let error = accelerator
        .wait_for_everyone()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    report(&Seen {
        batches: taken,
        error,
        waited,
    });
}

/// Starts process `rank` of a 2-process run of `test` on `case`, without a launcher (which
/// would stop the other itself): in network namespace `namespace` if there is one, with the
/// rendezvous at `main` and its peers reaching it at its `data` port.
fn start(
    test: &str,
    case: Case,
    dir: &Path,
    rank: usize,
    namespace: Option<&str>,
    main: (&str, u16),
    data: u16,
) -> JoinHandle<Launched> {
    let mut command = match namespace {
        Some(namespace) => {
            let mut command = Command::new("ip");
            command
                .args(["netns", "exec", namespace])
                .arg(std::env::current_exe().unwrap());
            command
        }
        None => Command::new(std::env::current_exe().unwrap()),
    };
    command
        .arg(test)
        .args(harness::WORKER_FLAGS)
        .env(harness::WORKER_DIR, dir)
        .env(
            "BURN_ACCELERATE_TEST_WORKER_ARGS",
            serde_json::to_string(&case).unwrap(),
        )
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", main.0)
        .env("MASTER_PORT", main.1.to_string())
        .env("BURN_ACCELERATE_DATA_PORT", data.to_string())
        .env("BURN_ACCELERATE_SECRET", "the reader-lost tests' secret")
        .env(
            "BURN_ACCELERATE_LIVENESS_TIMEOUT",
            case.timeouts()[0].to_string(),
        )
        .env("BURN_ACCELERATE_TIMEOUT", case.timeouts()[1].to_string());
    let dir = dir.to_path_buf();
    std::thread::spawn(move || harness::run(command, dir))
}

/// Waits for `path` to appear while `processes` run, for at most 60 s.
fn wait_for(path: &Path, processes: &[&JoinHandle<Launched>]) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60) && !processes.iter().any(|p| p.is_finished()),
            "{} never appeared: the run never got going",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Joins a process started by [`start`]; it ended on its own, reported, and did not panic.
fn ended(process: JoinHandle<Launched>, rank: usize, context: &str) -> (Seen, String) {
    let run = process.join().unwrap();
    let output = run.output();
    assert!(run.status.success(), "rank {rank}: {context}\n{output}");
    assert!(
        !output.contains("panicked"),
        "rank {rank}: {context}\n{output}"
    );
    (run.report(rank), output)
}

/// Its epoch ended early, soon after its last batch, and its error (which the run's next
/// collective returns) says why: `said` (the parts of [`Case::said`]).
fn assert_lost(seen: &Seen, rank: usize, said: &[String], context: &str) {
    let why = format!("rank {rank}: {seen:?}\n{context}");
    assert!(seen.batches < STEPS / 2, "{why}");
    assert!(
        seen.waited < (Duration::from_secs(SHORT) + SLACK).as_secs_f64(),
        "{why}"
    );
    let first = format!("dispatch_batches across processes: {}", said[0]);
    assert!(
        seen.error.contains(&first)
            && said.iter().all(|part| seen.error.contains(part))
            && seen.error.contains("ended its epoch there"),
        "expected {said:?} in\n{why}"
    );
}

#[test]
#[ignore = "needs root and iproute2's `ip` to make network namespaces: .ci/run runs it with --ignored"]
fn a_cut_link_to_process_0_on_another_machine_ends_the_receivers_epoch_with_a_typed_error() {
    const TEST: &str = "reader_lost::a_cut_link_to_process_0_on_another_machine_ends_the_receivers_epoch_with_a_typed_error";
    if let Some(case) = worker::<Case>() {
        return reader_lost_worker(case);
    }
    for (stream, num_workers) in [(false, 0), (false, 2), (true, 0)] {
        let case = Case {
            stream,
            num_workers,
            frozen: false,
            by_liveness: true,
        };
        let machines = super::TwoMachines::make().unwrap_or_else(|why| {
            needs::missing(&format!(
                "two network namespaces (root and iproute2's `ip`), which cannot be made: {why}"
            ))
        });
        let dir = harness::scratch_dir(TEST);
        let port = harness::free_port();
        let main = (machines.addresses[0], port);
        let processes: Vec<_> = (0..2)
            .map(|rank| {
                let namespace = Some(machines.names[rank].as_str());
                start(TEST, case, &dir, rank, namespace, main, port + 1)
            })
            .collect();
        for rank in 0..2 {
            wait_for(
                &dir.join(format!("running-{rank}")),
                &[&processes[0], &processes[1]],
            );
        }
        machines.cut();
        let cut = Instant::now();
        let mut processes = processes.into_iter();
        let context = format!("{case:?}");
        let (reader, reader_output) = ended(processes.next().unwrap(), 0, &context);
        let (receiver, receiver_output) = ended(processes.next().unwrap(), 1, &context);
        let both_ended = cut.elapsed();
        let context =
            format!("{case:?}\n--- process 0\n{reader_output}\n--- process 1\n{receiver_output}");
        // Process 0 fell silent for the receiver, behind the link...
        let across = format!("process 0 at {}:{} (host ", machines.addresses[0], port + 1);
        let across = format!("{across}{})", host_name());
        assert_lost(&receiver, 1, &case.said(&across), &context);
        // ...and the receiver for process 0, whose next send failed with it.
        let across = format!("process 1 at {}:{} (host ", machines.addresses[1], port + 1);
        let across = format!("{across}{})", host_name());
        assert_lost(&reader, 0, &case.said(&across), &context);
        assert!(
            both_ended < Duration::from_secs(SHORT) + SLACK,
            "{both_ended:?}\n{context}"
        );
        harness::clean(&dir);
    }
}

/// This machine's host name, as the processes' messages name it (network namespaces share it).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

/// Sends `SIGCONT` to a frozen process when dropped, so that a failed test leaves none
/// frozen.
struct Frozen(Pid);

impl Frozen {
    fn cont(&self) {
        kill(self.0, Signal::SIGCONT).unwrap();
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = kill(self.0, Signal::SIGCONT);
    }
}

#[test]
fn process_0_frozen_mid_epoch_ends_the_receivers_epoch_and_its_own_after_sigcont() {
    const TEST: &str = "reader_lost::process_0_frozen_mid_epoch_ends_the_receivers_epoch_and_its_own_after_sigcont";
    if let Some(case) = worker::<Case>() {
        return reader_lost_worker(case);
    }
    for (stream, by_liveness) in [(false, true), (true, true), (false, false)] {
        let case = Case {
            stream,
            num_workers: 0,
            frozen: true,
            by_liveness,
        };
        let dir = harness::scratch_dir(TEST);
        let (main, data) = (harness::free_port(), harness::free_port());
        let reader = start(TEST, case, &dir, 0, None, ("127.0.0.1", main), data);
        let receiver = start(TEST, case, &dir, 1, None, ("127.0.0.1", main), data + 1);
        let frozen_file = dir.join("frozen");
        wait_for(&frozen_file, &[&reader, &receiver]);
        let pid: i32 = std::fs::read_to_string(&frozen_file)
            .unwrap()
            .parse()
            .unwrap();
        let frozen = Frozen(Pid::from_raw(pid));
        let context = format!("{case:?}");
        // The receiver ends on its own while process 0 is still frozen.
        let (receiver, receiver_output) = ended(receiver, 1, &context);
        assert!(!reader.is_finished(), "{context}\n{receiver_output}");
        let said = format!("process 0 at 127.0.0.1:{data} (host {})", host_name());
        assert_lost(
            &receiver,
            1,
            &case.said(&said),
            &format!("{context}\n{receiver_output}"),
        );
        // Continued, process 0 finds the run ended at its next send, and says by whom.
        frozen.cont();
        let continued = Instant::now();
        let (reader, reader_output) = ended(reader, 0, &context);
        let context = format!("{context}\n--- process 0\n{reader_output}");
        assert!(
            continued.elapsed() < Duration::from_secs(SHORT) + SLACK,
            "{:?}\n{context}",
            continued.elapsed()
        );
        assert!(reader.batches < STEPS / 2, "{reader:?}\n{context}");
        // What the receiver told it before it exited (or, where its send came first, that
        // the receiver exited); never that the receiver, whose frames waited unread while
        // process 0 was frozen, fell silent.
        let told = format!(
            "process 1 ended the run's collectives: {}",
            case.said(&said)[0]
        );
        assert!(
            reader.error.contains("dispatch_batches across processes: ")
                && (reader.error.contains(&told) || reader.error.contains("process 1 (pid "))
                && reader.error.contains("ended its epoch there"),
            "{reader:?}\n{context}"
        );
        drop(frozen);
        harness::clean(&dir);
    }
}
