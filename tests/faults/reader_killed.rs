//! `dispatch_batches` across processes, where process 0 (the one that reads the data and
//! sends the others their batches) is killed (`SIGKILL`) mid-epoch (issue 49): through the
//! indexed loader with and without prefetch threads, and the stream loader. The receiver's
//! epoch ends without a panic, and its next call that can fail (`wait_for_everyone`) returns
//! a typed error naming process 0 and what happened to it; the receiver exits on its own,
//! long before the run's timeout (600 s here: only seeing process 0 exit can end it).

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
}

/// What a process saw.
#[derive(Debug, Serialize, Deserialize)]
enum Seen {
    /// Process 0, about to be killed.
    Reader { pid: u32 },
    /// Process 1, after its epoch.
    Receiver {
        batches: usize,
        /// `wait_for_everyone`'s error after the epoch (empty: none).
        error: String,
    },
}

/// A batch: its items.
#[derive(Clone)]
struct Items;

impl Batcher<Flex, u64, Vec<u64>> for Items {
    fn batch(&self, items: Vec<u64>, _: &burn::backend::flex::FlexDevice) -> Vec<u64> {
        items
    }
}

fn reader_killed_worker(loader: Loader) {
    let device = Default::default();
    let state = ProcessState::from_env().unwrap();
    let accelerator = Accelerator::<Autodiff<Flex>>::new(AccelerateConfig::new(), &device).unwrap();
    let config = DataLoaderConfig::new(BATCH)
        .with_dispatch_batches(true)
        .with_shuffle(false)
        .with_num_workers(loader.num_workers);
    let batches: Box<dyn DataLoader<Flex, Vec<u64>>> = if loader.stream {
        Box::new(
            StreamLoaderBuilder::new(config, |_: u64| (0..ITEMS).collect::<Vec<_>>(), Items)
                .build_dispatching(&state, device)
                .unwrap(),
        )
    } else {
        Box::new(
            ShardLoaderBuilder::new(config, InMemDataset::new((0..ITEMS).collect()), Items)
                .build_dispatching(&state, device)
                .unwrap(),
        )
    };
    let mut taken = 0;
    for _ in batches.iter() {
        taken += 1;
        if state.is_main_process() && taken == KILLED_AFTER {
            report(&Seen::Reader {
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
    report(&Seen::Receiver {
        batches: taken,
        error,
    });
}

#[test]
fn process_0_killed_mid_epoch_is_a_typed_error_on_the_receiver_not_a_panic_or_a_hang() {
    const TEST: &str = "reader_killed::process_0_killed_mid_epoch_is_a_typed_error_on_the_receiver_not_a_panic_or_a_hang";
    if let Some(loader) = worker::<Loader>() {
        return reader_killed_worker(loader);
    }
    for loader in [
        Loader {
            stream: false,
            num_workers: 0,
        },
        Loader {
            stream: false,
            num_workers: 2,
        },
        Loader {
            stream: true,
            num_workers: 0,
        },
    ] {
        let started = Instant::now();
        // Without the launcher (which would stop the receiver itself), and a run timeout
        // far away.
        let runs = launch_direct(TEST, 2, &loader, &[("BURN_ACCELERATE_TIMEOUT", "600")]);
        let (main, receiver) = (&runs[0], &runs[1]);
        let context = format!(
            "{loader:?}\n--- process 0\n{}\n--- process 1\n{}",
            main.output(),
            receiver.output()
        );
        assert!(!main.status.success(), "{context}");
        // The receiver ended on its own: it reported, without a panic, and soon.
        assert!(receiver.status.success(), "{context}");
        assert!(!receiver.output().contains("panicked"), "{context}");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{:?}\n{context}",
            started.elapsed()
        );
        let Seen::Reader { pid } = main.report(0) else {
            panic!("process 0's report is the reader's: {context}")
        };
        let Seen::Receiver { batches, error } = receiver.report(1) else {
            panic!("process 1's report is the receiver's: {context}")
        };
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
