//! `StepThreadsConfig { pin: true }`: each of the pool's threads runs on the one CPU it was
//! given (read back from the kernel), processes a launcher starts on one machine get disjoint
//! CPUs, and the counts that do not fit are refused with the number that would.
//!
//! Rayon's global pool is built once per process: the pinned pool is built by one test, and
//! the launcher's processes are this binary run again, one per local rank.
#![cfg(all(feature = "flex", target_os = "linux"))]

use std::collections::BTreeSet;
use std::process::Command;

use burn_accelerate::AccelerateError;
use burn_accelerate::threads::StepThreadsConfig;
use cpu_mask::thread_mask;

mod cpu_mask;

/// Set in the processes `launched_processes_split_the_machine` starts.
const CHILD: &str = "BURN_ACCELERATE_PINNED_CHILD";

#[test]
fn each_thread_runs_on_its_own_cpu() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let allowed = thread_mask();
    let refused = StepThreadsConfig::new()
        .with_threads(Some(allowed.len() + 1))
        .with_pin(true)
        .install()
        .unwrap_err();
    let message = refused.to_string();
    assert!(
        matches!(refused, AccelerateError::ThreadPinning { .. })
            && message.contains(&format!("ask for at most {} threads", allowed.len())),
        "{message}"
    );
    assert_eq!(thread_mask(), allowed, "a refused config pins nothing");

    let wanted = allowed.len().min(2);
    let threads = StepThreadsConfig::new()
        .with_threads(Some(wanted))
        .with_pin(true)
        .install()
        .expect("the pinned pool");
    let cpus = threads.cpus().expect("pinned").to_vec();
    assert_eq!((threads.count(), cpus.len()), (wanted, wanted));
    assert_eq!(rayon::current_thread_index(), Some(0));
    assert_eq!(rayon::current_num_threads(), wanted);
    assert_eq!(
        cpus.iter().collect::<BTreeSet<_>>().len(),
        wanted,
        "one CPU per thread: {cpus:?}"
    );
    assert!(cpus.iter().all(|cpu| allowed.contains(cpu)), "{cpus:?}");
    // Every thread of the pool reports the mask the kernel holds for it.
    let masks = rayon::broadcast(|context| (context.index(), thread_mask()));
    for (index, mask) in masks {
        assert_eq!(mask, [cpus[index]], "thread {index}");
    }
    // Work runs on those threads, on those CPUs: a parallel sum over them gives its value.
    let sum: u64 = rayon::iter::ParallelIterator::sum(
        rayon::iter::IntoParallelIterator::into_par_iter(0..100_000u64),
    );
    assert_eq!(sum, 99_999 * 100_000 / 2);

    let again = StepThreadsConfig::new()
        .with_threads(Some(1))
        .with_pin(true)
        .install()
        .unwrap_err();
    assert!(
        matches!(again, AccelerateError::ThreadPool { .. }),
        "{again}"
    );
    assert_eq!(
        thread_mask(),
        [cpus[0]],
        "the refused call left the thread where it was"
    );
}

// Two processes under a launcher on this machine (torchrun's variables): their CPUs do not
// overlap, and together they are the CPUs the parent may use; with one CPU, the second
// process has none and both say so.
#[test]
fn launched_processes_split_the_machine() {
    if let Some(rank) = std::env::var_os(CHILD) {
        let threads = StepThreadsConfig::new().with_pin(true).install();
        match threads {
            Ok(threads) => println!("rank {rank:?} cpus {:?}", threads.cpus().unwrap()),
            Err(error) => println!("rank {rank:?} error {error}"),
        }
        return;
    }
    let allowed = thread_mask();
    let exe = std::env::current_exe().expect("this test binary");
    let shares = (0..2)
        .map(|rank| {
            let output = Command::new(&exe)
                .args([
                    "--exact",
                    "launched_processes_split_the_machine",
                    "--nocapture",
                ])
                .args(["--test-threads", "1"])
                .env(CHILD, rank.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", "29500")
                .env_remove("RAYON_NUM_THREADS")
                .output()
                .expect("the child process");
            let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
            assert!(output.status.success(), "{stdout}");
            // The harness prints the test's name on the line the report starts.
            let tag = format!("rank \"{rank}\"");
            stdout
                .lines()
                .find_map(|line| line.find(&tag).map(|at| line[at..].to_owned()))
                .unwrap_or_else(|| panic!("no report from rank {rank}: {stdout}"))
        })
        .collect::<Vec<_>>();
    if allowed.len() < 2 {
        for line in &shares {
            assert!(
                line.contains("2 processes on this machine share the 1 CPUs"),
                "{line}"
            );
        }
        return;
    }
    let cpus = shares
        .iter()
        .map(|line| {
            let list = line
                .split("cpus ")
                .nth(1)
                .unwrap_or_else(|| panic!("{line}"));
            list.trim_matches(|c| c == '[' || c == ']')
                .split(", ")
                .map(|cpu| cpu.parse::<usize>().expect("a CPU number"))
                .collect::<BTreeSet<_>>()
        })
        .collect::<Vec<_>>();
    assert!(cpus[0].is_disjoint(&cpus[1]), "{shares:?}");
    assert!(!cpus[0].is_empty() && !cpus[1].is_empty(), "{shares:?}");
    let union = cpus[0].union(&cpus[1]).copied().collect::<Vec<_>>();
    assert_eq!(union, allowed, "{shares:?}");
}
