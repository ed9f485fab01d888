//! `dispatch_batches` across processes, where process 0 sends a batch the receiver cannot
//! decode (issue 49): here process 0's items are text and process 1's numbers, so every
//! batch it is sent is bytes it cannot read as its own; through the indexed and the stream
//! loader. The receiver's epoch ends without a panic, and its next call that can fail
//! (`wait_for_everyone`) returns a typed error naming process 0.

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder, StreamLoaderBuilder};
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::{AccelerateConfig, Accelerator};
use serde::{Deserialize, Serialize};

use super::harness::{launch, report, worker};

/// What a process saw.
#[derive(Debug, Serialize, Deserialize)]
struct Seen {
    batches: usize,
    /// `wait_for_everyone`'s error after the epoch (empty: none).
    error: String,
}

/// A batch: each item's size.
#[derive(Clone)]
struct Sizes;

impl Batcher<Flex, String, Vec<usize>> for Sizes {
    fn batch(&self, items: Vec<String>, _: &burn::backend::flex::FlexDevice) -> Vec<usize> {
        items.iter().map(String::len).collect()
    }
}

impl Batcher<Flex, u64, Vec<usize>> for Sizes {
    fn batch(&self, items: Vec<u64>, _: &burn::backend::flex::FlexDevice) -> Vec<usize> {
        items.into_iter().map(|i| i as usize).collect()
    }
}

// `stream`: through the stream loader, else the indexed one.
fn undecodable_worker(stream: bool) -> Seen {
    let device = Default::default();
    let state = ProcessState::from_env().unwrap();
    let accelerator = Accelerator::<Autodiff<Flex>>::new(AccelerateConfig::new(), &device).unwrap();
    let config = DataLoaderConfig::new(2)
        .with_dispatch_batches(true)
        .with_shuffle(false);
    let text = || (0..8).map(|i| format!("item {i}")).collect::<Vec<String>>();
    let numbers = || (0..8).collect::<Vec<u64>>();
    let batches = match (state.is_main_process(), stream) {
        (true, false) => ShardLoaderBuilder::<Flex, String, Vec<usize>>::new(
            config,
            InMemDataset::new(text()),
            Sizes,
        )
        .build_dispatching(&state, device)
        .unwrap()
        .iter()
        .count(),
        (false, false) => ShardLoaderBuilder::<Flex, u64, Vec<usize>>::new(
            config,
            InMemDataset::new(numbers()),
            Sizes,
        )
        .build_dispatching(&state, device)
        .unwrap()
        .iter()
        .count(),
        (true, true) => StreamLoaderBuilder::<Flex, String, Vec<usize>>::new(
            config,
            move |_: u64| text(),
            Sizes,
        )
        .build_dispatching(&state, device)
        .unwrap()
        .iter()
        .count(),
        (false, true) => StreamLoaderBuilder::<Flex, u64, Vec<usize>>::new(
            config,
            move |_: u64| numbers(),
            Sizes,
        )
        .build_dispatching(&state, device)
        .unwrap()
        .iter()
        .count(),
    };
    let error = accelerator
        .wait_for_everyone()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    Seen { batches, error }
}

#[test]
fn a_dispatched_batch_that_does_not_decode_is_a_typed_error_naming_process_0_not_a_panic() {
    const TEST: &str = "undecodable::a_dispatched_batch_that_does_not_decode_is_a_typed_error_naming_process_0_not_a_panic";
    if let Some(stream) = worker::<bool>() {
        return report(&undecodable_worker(stream));
    }
    for stream in [false, true] {
        let run = launch(TEST, 2, &stream, &[]);
        // No process panicked: each ended its epoch and reported.
        run.assert_success();
        assert!(!run.output().contains("panicked"), "{}", run.output());
        let [main, receiver]: [Seen; 2] = run.reports(2).try_into().unwrap();
        // Process 0 read its own 2 steps (and sent process 1 its slices).
        assert_eq!(main.batches, 2, "stream: {stream}\n{}", run.output());
        // Process 1's epoch ended at the first batch it could not decode...
        assert_eq!(receiver.batches, 0, "stream: {stream}\n{}", run.output());
        // ... and its next collective says why, naming process 0 and the batch.
        assert!(
            receiver
                .error
                .contains("process 0 sent a malformed message")
                && receiver
                    .error
                    .contains("the batch it dispatched for epoch 0, step 0")
                && receiver.error.contains("is not this loader's items"),
            "stream: {stream}: {}",
            receiver.error
        );
    }
}
