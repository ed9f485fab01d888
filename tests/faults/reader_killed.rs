//! `dispatch_batches` across processes, where process 0 (the one that reads the data and
//! sends the others their batches) is killed (`SIGKILL`) mid-epoch (issue 49): through the
//! indexed loader with and without prefetch threads, and the stream loader. The receiver's
//! epoch ends without a panic, and its next call that can fail (`wait_for_everyone`) returns
//! a typed error naming process 0 and what happened to it; the receiver exits on its own,
//! long before the run's timeout (600 s here: only seeing process 0 exit can end it). And the
//! other way round: a receiver killed mid-epoch ends process 0's run the same way.

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder, StreamLoaderBuilder};
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::{AccelerateConfig, Accelerator};
use serde::{Deserialize, Serialize};

use super::harness::{launch_direct, report, worker};

/// Items per epoch, and per batch: 128 steps of 2 batches (one per process), far more than
/// the prefetch threads read ahead.
const ITEMS: u64 = 1024;
const BATCH: usize = 4;
const STEPS: usize = 128;
/// Process 0 is killed after taking this many of its own batches.
const KILLED_AFTER: usize = 3;

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Loader {
    stream: bool,
    num_workers: usize,
    /// The process killed mid-epoch.
    killed: usize,
    /// Each item's size.
    item_bytes: usize,
}

/// What a process saw.
#[derive(Debug, Serialize, Deserialize)]
enum Seen {
    /// The process killed, about to be.
    Killed { pid: u32 },
    /// The other, after its epoch.
    Survivor {
        batches: usize,
        /// `wait_for_everyone`'s error after the epoch (empty: none).
        error: String,
    },
}

/// A batch: each item's size.
#[derive(Clone)]
struct Sizes;

impl Batcher<Flex, Vec<u8>, Vec<usize>> for Sizes {
    fn batch(&self, items: Vec<Vec<u8>>, _: &burn::backend::flex::FlexDevice) -> Vec<usize> {
        items.iter().map(Vec::len).collect()
    }
}

// The items of an epoch, of `size` bytes each.
fn items(size: usize) -> Vec<Vec<u8>> {
    (0..ITEMS).map(|i| vec![i as u8; size]).collect()
}

fn reader_killed_worker(loader: Loader) {
    let device = Default::default();
    let state = ProcessState::from_env().unwrap();
    let accelerator = Accelerator::<Autodiff<Flex>>::new(AccelerateConfig::new(), &device).unwrap();
    let config = DataLoaderConfig::new(BATCH)
        .with_dispatch_batches(true)
        .with_shuffle(false)
        .with_num_workers(loader.num_workers);
    let size = loader.item_bytes;
    let batches: Box<dyn DataLoader<Flex, Vec<usize>>> = if loader.stream {
        Box::new(
            StreamLoaderBuilder::new(config, move |_: u64| items(size), Sizes)
                .build_dispatching(&state, device)
                .unwrap(),
        )
    } else {
        Box::new(
            ShardLoaderBuilder::new(config, InMemDataset::new(items(size)), Sizes)
                .build_dispatching(&state, device)
                .unwrap(),
        )
    };
    let mut taken = 0;
    for _ in batches.iter() {
        taken += 1;
        if state.process_index() == loader.killed && taken == KILLED_AFTER {
            report(&Seen::Killed {
                pid: std::process::id(),
            });
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
        }
    }
    let error = accelerator
        .wait_for_everyone()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    report(&Seen::Survivor {
        batches: taken,
        error,
    });
}

// Runs 2 processes of `test` over `loader`: the survivor's report, the pid of the one killed,
// and what both printed.
fn run_killing(test: &str, loader: Loader) -> (usize, String, u32, String) {
    let started = Instant::now();
    // Without the launcher (which would stop the survivor itself), and a run timeout far away.
    let runs = launch_direct(test, 2, &loader, &[("BURN_ACCELERATE_TIMEOUT", "600")]);
    let (killed, survivor) = (&runs[loader.killed], &runs[1 - loader.killed]);
    let context = format!(
        "{loader:?}\n--- killed\n{}\n--- survivor\n{}",
        killed.output(),
        survivor.output()
    );
    assert!(!killed.status.success(), "{context}");
    // The survivor ended on its own: it reported, without a panic, and soon.
    assert!(survivor.status.success(), "{context}");
    assert!(!survivor.output().contains("panicked"), "{context}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}\n{context}",
        started.elapsed()
    );
    let Seen::Killed { pid } = killed.report(loader.killed) else {
        panic!("the killed process's report: {context}")
    };
    let Seen::Survivor { batches, error } = survivor.report(1 - loader.killed) else {
        panic!("the survivor's report: {context}")
    };
    (batches, error, pid, context)
}

#[test]
fn process_0_killed_mid_epoch_is_a_typed_error_on_the_receiver_not_a_panic_or_a_hang() {
    const TEST: &str = "reader_killed::process_0_killed_mid_epoch_is_a_typed_error_on_the_receiver_not_a_panic_or_a_hang";
    if let Some(loader) = worker::<Loader>() {
        return reader_killed_worker(loader);
    }
    for (stream, num_workers) in [(false, 0), (false, 2), (true, 0)] {
        let loader = Loader {
            stream,
            num_workers,
            killed: 0,
            item_bytes: 8,
        };
        let (batches, error, pid, context) = run_killing(TEST, loader);
        // Fewer than half of its epoch's batches: the epoch ended where process 0 stopped.
        assert!(batches < STEPS / 2, "{batches} batches\n{context}");
        // Its next collective says why, naming process 0, what happened, and where.
        let said = format!(
            "dispatch_batches across processes: process 0 (pid {pid}, on this machine) \
             exited during stream"
        );
        assert!(
            error.contains(&said) && error.contains("ended its epoch there"),
            "{error}\n{context}"
        );
    }
}

// Process 0's side: a send to a receiver that is gone ends its epoch. The items are large
// (64 KiB, 32 MiB for the receiver's half of the epoch), so that process 0's sends after
// the kill find it gone rather than fit in the socket's buffers.
#[test]
fn a_receiver_killed_mid_epoch_is_a_typed_error_on_process_0_not_a_panic_or_a_hang() {
    const TEST: &str = "reader_killed::a_receiver_killed_mid_epoch_is_a_typed_error_on_process_0_not_a_panic_or_a_hang";
    if let Some(loader) = worker::<Loader>() {
        return reader_killed_worker(loader);
    }
    for (stream, num_workers) in [(false, 0), (true, 0)] {
        let loader = Loader {
            stream,
            num_workers,
            killed: 1,
            item_bytes: 64 << 10,
        };
        let (batches, error, pid, context) = run_killing(TEST, loader);
        assert!(batches < STEPS / 2, "{batches} batches\n{context}");
        assert!(
            error.contains(&format!(
                "dispatch_batches across processes: process 1 (pid {pid}, on this machine) \
                 exited during stream"
            )) && error.contains("ended its epoch there"),
            "{error}\n{context}"
        );
    }
}
