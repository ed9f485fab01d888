//! Batches per second of one epoch of the sharded loader against Burn's own
//! `DataLoaderBuilder`, on the same in-memory dataset and batcher (rows of f32 features into
//! a `[batch, features]` Flex tensor), with 1 and 2 workers. The shard loader runs one
//! process (the whole dataset, like Burn's) with `non_blocking`, so that, as in Burn, the
//! workers also batch. The consumer does nothing with a batch, so this measures the loader's
//! own cost: reading, batching, and handing batches across threads.
//!
//!     cargo bench --bench loader
//!
//! Criterion reports the throughput in elements per second; an element is one batch.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const ITEMS: usize = 8192;
const FEATURES: usize = 64;
const BATCH: usize = 32;
/// Batches Burn's multi-threaded loader may queue (`MAX_QUEUED_ITEMS` in burn-core 0.21).
const BURN_QUEUE: usize = 100;

#[derive(Clone)]
struct Rows;

impl Batcher<Flex, Vec<f32>, Tensor<Flex, 2>> for Rows {
    fn batch(&self, items: Vec<Vec<f32>>, device: &FlexDevice) -> Tensor<Flex, 2> {
        let n = items.len();
        Tensor::from_data(TensorData::new(items.concat(), [n, FEATURES]), device)
    }
}

fn dataset() -> Arc<InMemDataset<Vec<f32>>> {
    #[allow(clippy::cast_precision_loss)] // small integers
    let items = (0..ITEMS)
        .map(|i| (0..FEATURES).map(|j| (i * FEATURES + j) as f32).collect())
        .collect();
    Arc::new(InMemDataset::new(items))
}

fn epoch(loader: &dyn DataLoader<Flex, Tensor<Flex, 2>>) -> usize {
    let mut batches = 0;
    for batch in loader.iter() {
        black_box(batch);
        batches += 1;
    }
    batches
}

fn bench(c: &mut Criterion) {
    let data = dataset();
    let device = FlexDevice;
    let mut group = c.benchmark_group("loader");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(ITEMS.div_ceil(BATCH) as u64));
    for workers in [1, 2] {
        let burn_loader = DataLoaderBuilder::new(Rows)
            .batch_size(BATCH)
            .num_workers(workers)
            .set_device(device)
            .build(Arc::clone(&data));
        assert_eq!(epoch(burn_loader.as_ref()), ITEMS.div_ceil(BATCH));
        group.bench_function(format!("burn/{workers}_workers"), |b| {
            b.iter(|| epoch(burn_loader.as_ref()));
        });

        // `shard` buffers as much as Burn's loader does (its channel holds 100 batches
        // whatever the number of workers); `shard_default` runs the default depth per worker.
        let default = DataLoaderConfig::new(BATCH).prefetch;
        for (name, prefetch) in [("shard", BURN_QUEUE / workers), ("shard_default", default)] {
            let config = DataLoaderConfig::new(BATCH)
                .with_num_workers(workers)
                .with_non_blocking(true)
                .with_prefetch(prefetch);
            let shard = ShardLoaderBuilder::new(config, Arc::clone(&data), Rows)
                .build(&[device])
                .expect("valid configuration")
                .remove(0);
            assert_eq!(epoch(&shard), ITEMS.div_ceil(BATCH));
            group.bench_function(format!("{name}/{workers}_workers"), |b| {
                b.iter(|| epoch(&shard));
            });
        }
    }
    group.finish();

    // The same epochs with a consumer that works on each batch, a stand-in for a model step
    // (two matmuls through a 256-wide hidden layer): when the step is the slow side, the
    // loader only has to stay ahead, which the default depth does.
    let w1 = Tensor::<Flex, 2>::ones([FEATURES, 256], &device);
    let w2 = Tensor::<Flex, 2>::ones([256, FEATURES], &device);
    let step = |batch: Tensor<Flex, 2>| -> f32 {
        batch
            .matmul(w1.clone())
            .matmul(w2.clone())
            .sum()
            .into_scalar()
    };
    let mut group = c.benchmark_group("loader_with_step");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(ITEMS.div_ceil(BATCH) as u64));
    for workers in [1, 2] {
        let burn_loader = DataLoaderBuilder::new(Rows)
            .batch_size(BATCH)
            .num_workers(workers)
            .set_device(device)
            .build(Arc::clone(&data));
        group.bench_function(format!("burn/{workers}_workers"), |b| {
            b.iter(|| burn_loader.iter().map(step).sum::<f32>());
        });
        let config = DataLoaderConfig::new(BATCH)
            .with_num_workers(workers)
            .with_non_blocking(true);
        let shard = ShardLoaderBuilder::new(config, Arc::clone(&data), Rows)
            .build(&[device])
            .expect("valid configuration")
            .remove(0);
        group.bench_function(format!("shard_default/{workers}_workers"), |b| {
            b.iter(|| shard.iter().map(step).sum::<f32>());
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
