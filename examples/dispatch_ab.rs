//! What `dispatch_batches` across processes costs per batch against every process reading its
//! own shard: the loader benchmark's data (8192 rows of 64 f32 into `[32, 64]` Flex tensors),
//! one epoch per variant, interleaved, timed on every process.
//!
//! ```text
//! cargo build --release --example dispatch_ab --bin burn-accelerate
//! target/release/burn-accelerate launch --num-processes 2 -- target/release/examples/dispatch_ab
//! ```
//!
//! `own shard`: `build_for`, each process reads its items; `dispatched`:
//! `build_dispatching` with `dispatch_batches`, process 0 reads every global batch and sends
//! the other process its half. Printed per process: the median epoch's time per batch.

use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
use burn_accelerate::distributed::ProcessState;
use clap::Parser;

const ITEMS: usize = 8192;
const FEATURES: usize = 64;
const BATCH: usize = 32;

/// Time dispatched loading against each process reading its own shard.
#[derive(Parser)]
struct Args {
    /// Epochs per variant, interleaved.
    #[arg(long, default_value_t = 9)]
    rounds: usize,
}

#[derive(Clone)]
struct Rows;

impl Batcher<Flex, Vec<f32>, Tensor<Flex, 2>> for Rows {
    fn batch(&self, items: Vec<Vec<f32>>, device: &FlexDevice) -> Tensor<Flex, 2> {
        let n = items.len();
        Tensor::from_data(TensorData::new(items.concat(), [n, FEATURES]), device)
    }
}

fn builder(dispatch: bool) -> ShardLoaderBuilder<Flex, Vec<f32>, Tensor<Flex, 2>> {
    #[allow(clippy::cast_precision_loss)] // small integers
    let items = (0..ITEMS)
        .map(|i| (0..FEATURES).map(|j| (i * FEATURES + j) as f32).collect())
        .collect();
    ShardLoaderBuilder::new(
        DataLoaderConfig::new(BATCH).with_dispatch_batches(dispatch),
        InMemDataset::new(items),
        Rows,
    )
}

// One epoch: its time per batch.
fn epoch(loader: &dyn DataLoader<Flex, Tensor<Flex, 2>>) -> Duration {
    let start = Instant::now();
    let mut batches = 0u32;
    for batch in loader.iter() {
        std::hint::black_box(batch);
        batches += 1;
    }
    start.elapsed() / batches.max(1)
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e3
}

fn main() {
    let args = Args::parse();
    let state = ProcessState::from_env().expect("a valid launch environment");
    let device = FlexDevice;
    let own = builder(false).build_for(&state, device).unwrap();
    let dispatched = builder(true).build_dispatching(&state, device).unwrap();
    let (mut own_times, mut dispatched_times) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        own_times.push(epoch(&own));
        // Both processes start each epoch together, so neither waits on the other's last one.
        state.wait_for_everyone().unwrap();
        dispatched_times.push(epoch(&dispatched));
        state.wait_for_everyone().unwrap();
    }
    let (own, dispatched) = (median(own_times), median(dispatched_times));
    println!(
        "process {} of {}: own shard {own:.4} ms/batch, dispatched {dispatched:.4} ms/batch \
         ({:.2}x)",
        state.process_index(),
        state.num_processes(),
        dispatched / own
    );
}
