//! What ends a run, and what must not: a frozen process (`SIGSTOP`), long work between
//! collectives, a panic inside `main_process_first`, and how many sockets 16 processes hold.
//! Real processes of this machine (see `../processes/harness.rs`).
#![cfg(feature = "flex")]

// Shared with the processes suite, which uses all of it.
#[allow(dead_code)]
#[path = "../processes/harness.rs"]
mod harness;

use std::time::{Duration, Instant};

use burn_accelerate::distributed::{ProcessState, ReduceOp};
use harness::{launch, launch_direct, report, worker};
use serde::{Deserialize, Serialize};

/// A worker's error (empty: none) and how long its call took.
#[derive(Debug, Serialize, Deserialize)]
struct Seen {
    error: String,
    seconds: f64,
}

// ---------------------------------------------------------------------------------------
// A frozen process.

fn frozen_worker() {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    group.barrier().unwrap();
    if group.rank() == 1 {
        // Frozen as `kill -STOP` freezes it: its network thread stops too.
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP).unwrap();
    }
    let start = Instant::now();
    let outcome = group.all_reduce(&mut [1.0f32; 1000], ReduceOp::Sum);
    report(&Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    });
    // As a training script would: the error ends the process, and the launcher the run.
    std::process::exit(1);
}

#[test]
fn a_frozen_process_ends_the_run_within_the_liveness_timeout() {
    const TEST: &str = "a_frozen_process_ends_the_run_within_the_liveness_timeout";
    if worker::<()>().is_some() {
        return frozen_worker();
    }
    // The collective timeout is far away: only the liveness check can end this run soon.
    let args = [
        "--timeout",
        "600",
        "--liveness-timeout",
        "2",
        "--grace",
        "2",
    ];
    let run = launch(TEST, 3, &(), &args);
    assert!(!run.status.success(), "{}", run.output());
    assert!(run.elapsed < Duration::from_secs(20), "{:?}", run.elapsed);
    for rank in [0, 2] {
        let seen: Seen = run.report(rank);
        // Each of its neighbours finds it silent itself, or hears it from the other.
        assert!(
            seen.error.contains("process 1 at 127.0.0.1:")
                && seen.error.contains("has sent nothing for 2s"),
            "rank {rank}: {}",
            seen.error
        );
        assert!(seen.seconds < 10.0, "rank {rank}: {}", seen.seconds);
    }
}

// ---------------------------------------------------------------------------------------
// Long work between collectives.

fn busy_worker() -> Seen {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    group.barrier().unwrap();
    let start = Instant::now();
    if group.rank() == 0 {
        // A validation on the main process alone, four times the liveness timeout, on both
        // cores' worth of busy threads.
        let spin = || {
            let until = Instant::now() + Duration::from_secs(4);
            let mut x = 0u64;
            while Instant::now() < until {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            x
        };
        let other = std::thread::spawn(spin);
        std::hint::black_box(spin());
        std::hint::black_box(other.join().unwrap());
    }
    let outcome = group.all_reduce(&mut [1.0f32; 10], ReduceOp::Sum);
    Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[test]
fn long_work_between_collectives_does_not_trip_the_liveness_check() {
    const TEST: &str = "long_work_between_collectives_does_not_trip_the_liveness_check";
    if worker::<()>().is_some() {
        return report(&busy_worker());
    }
    let run = launch(TEST, 2, &(), &["--liveness-timeout", "1"]);
    let seen: Vec<Seen> = run.assert_success().reports(2);
    for (rank, seen) in seen.iter().enumerate() {
        assert!(seen.error.is_empty(), "rank {rank}: {}", seen.error);
        // Rank 1 waited in the all-reduce all along (its barrier may end a moment later).
        assert!(seen.seconds >= 3.5, "rank {rank}: {}", seen.seconds);
    }
}

// ---------------------------------------------------------------------------------------
// A panic inside main_process_first.

fn first_worker() -> Seen {
    let state = ProcessState::from_env().unwrap();
    state.wait_for_everyone().unwrap();
    let start = Instant::now();
    let outcome = state.main_process_first().map(|guard| {
        if state.is_main_process() {
            panic!("preparing the dataset failed");
        }
        drop(guard);
    });
    Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[test]
fn a_panic_inside_main_process_first_fails_the_waiting_processes() {
    const TEST: &str = "a_panic_inside_main_process_first_fails_the_waiting_processes";
    if worker::<()>().is_some() {
        return report(&first_worker());
    }
    let runs = launch_direct(TEST, 3, &(), &[("BURN_ACCELERATE_TIMEOUT", "600")]);
    assert_eq!(runs[0].status.code(), Some(101), "{}", runs[0].output());
    for rank in [1, 2] {
        let seen: Seen = runs[0].report(rank);
        assert!(
            seen.error.contains("process 0 ended the run's collectives")
                && seen.error.contains("panicked inside main_process_first"),
            "rank {rank}: {}",
            seen.error
        );
        assert!(seen.seconds < 10.0, "rank {rank}: {}", seen.seconds);
    }
}

// ---------------------------------------------------------------------------------------
// Sockets per process.

/// The TCP sockets this process holds (Linux): its descriptors that are sockets listed in
/// `/proc/self/net/tcp{,6}` (the runtime's own signal socket pair is a Unix one).
fn sockets() -> usize {
    let tables = ["tcp", "tcp6"]
        .map(|t| std::fs::read_to_string(format!("/proc/self/net/{t}")).unwrap_or_default());
    let tcp_inodes: std::collections::HashSet<String> = tables
        .iter()
        .flat_map(|table| table.lines().skip(1))
        .filter_map(|line| line.split_whitespace().nth(9).map(str::to_string))
        .collect();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .filter(|inode| tcp_inodes.contains(inode))
        .count()
}

fn sockets_worker() -> (usize, usize) {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    let mut values = vec![1.0f32; 1 << 16];
    group.all_reduce(&mut values, ReduceOp::Sum).unwrap();
    group.barrier().unwrap();
    let gathered: Vec<u32> = group.all_gather(&[group.rank() as u32]).unwrap();
    assert_eq!(gathered, (0..16).collect::<Vec<u32>>());
    let _ = group.broadcast_object(&0u8, 5).unwrap();
    let count = sockets();
    // No process ends (and closes its connections) before every one has counted.
    group.barrier().unwrap();
    (group.rank(), count)
}

#[test]
fn sixteen_processes_hold_five_sockets_each() {
    const TEST: &str = "sixteen_processes_hold_five_sockets_each";
    if worker::<()>().is_some() {
        return report(&sockets_worker());
    }
    let counts: Vec<(usize, usize)> = launch(TEST, 16, &(), &[]).assert_success().reports(16);
    for (rank, count) in counts {
        // Its listener, its ring connections (data to the next process and from the previous
        // one) and its control connections with both: whatever the number of processes.
        assert_eq!(count, 5, "rank {rank}");
    }
}
