//! Interleaved A/B timing of the sharded loader against Burn's `DataLoaderBuilder`: the same
//! epochs as `benches/loader.rs`, but alternating one Burn epoch and one shard epoch, so that
//! both see the same load on a shared machine, and reporting the median of each. The ratio
//! (Burn's epoch time over the shard loader's) is the figure that survives a noisy machine.
//!
//!     cargo run --release --example loader_ab [EPOCHS [PREFETCH ...]]
//!
//! Without a list of prefetch depths it compares Burn's buffering (`100 / workers` batches
//! per worker) and the default depth.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};

const ITEMS: usize = 8192;
const FEATURES: usize = 64;
const BATCH: usize = 32;
const BURN_QUEUE: usize = 100;

#[derive(Clone)]
struct Rows;

impl Batcher<Flex, Vec<f32>, Tensor<Flex, 2>> for Rows {
    fn batch(&self, items: Vec<Vec<f32>>, device: &FlexDevice) -> Tensor<Flex, 2> {
        let n = items.len();
        Tensor::from_data(TensorData::new(items.concat(), [n, FEATURES]), device)
    }
}

type Loader = dyn DataLoader<Flex, Tensor<Flex, 2>>;

/// What the consumer does with each batch.
type Step<'a> = &'a dyn Fn(Tensor<Flex, 2>) -> f32;

/// Milliseconds for one epoch, `step` applied to every batch.
fn epoch(loader: &Loader, step: Step<'_>) -> f64 {
    let start = Instant::now();
    for batch in loader.iter() {
        black_box(step(batch));
    }
    start.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let epochs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100);
    #[allow(clippy::cast_precision_loss)] // small integers
    let items = (0..ITEMS)
        .map(|i| (0..FEATURES).map(|j| (i * FEATURES + j) as f32).collect())
        .collect();
    let data = Arc::new(InMemDataset::new(items));
    let device = FlexDevice;
    let w1 = Tensor::<Flex, 2>::ones([FEATURES, 256], &device);
    let w2 = Tensor::<Flex, 2>::ones([256, FEATURES], &device);
    let none = |batch: Tensor<Flex, 2>| -> f32 { black_box(batch).dims()[0] as f32 };
    let model = |batch: Tensor<Flex, 2>| -> f32 {
        batch
            .matmul(w1.clone())
            .matmul(w2.clone())
            .sum()
            .into_scalar()
    };
    let depths: Vec<usize> = std::env::args()
        .skip(2)
        .filter_map(|a| a.parse().ok())
        .collect();
    println!(
        "{epochs} interleaved epochs of {} batches; median ms per epoch",
        ITEMS / BATCH
    );
    println!("| consumer | workers | Burn | shard, prefetch | shard | ratio |");
    println!("|---|---|---|---|---|---|");
    let steps: [(&str, Step<'_>); 2] = [("none", &none), ("model step", &model)];
    for (consumer, step) in steps {
        for workers in [1, 2] {
            let burn = DataLoaderBuilder::new(Rows)
                .batch_size(BATCH)
                .num_workers(workers)
                .set_device(device)
                .build(Arc::clone(&data));
            let default = DataLoaderConfig::new(BATCH).prefetch;
            let scan = if depths.is_empty() {
                vec![BURN_QUEUE / workers, default]
            } else {
                depths.clone()
            };
            for prefetch in scan {
                let config = DataLoaderConfig::new(BATCH)
                    .with_num_workers(workers)
                    .with_non_blocking(true)
                    .with_prefetch(prefetch);
                let shard = ShardLoaderBuilder::new(config, Arc::clone(&data), Rows)
                    .build(&[device])
                    .expect("valid configuration")
                    .remove(0);
                let (mut a, mut b) = (Vec::new(), Vec::new());
                for _ in 0..epochs {
                    a.push(epoch(burn.as_ref(), step));
                    b.push(epoch(&shard, step));
                }
                let (a, b) = (median(a), median(b));
                println!(
                    "| {consumer} | {workers} | {a:.3} | {prefetch} | {b:.3} | **{:.2}** |",
                    a / b
                );
            }
        }
    }
}
