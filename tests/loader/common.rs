//! Shared fixtures: an identity batcher over `0..n`, so batches are the dataset indices.

use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::backend::Backend;
use burn_accelerate::data::{DataLoaderConfig, ShardLoader, ShardLoaderBuilder};

#[cfg(feature = "flex")]
pub type B = burn::backend::Flex;
#[cfg(not(feature = "flex"))]
pub type B = burn::backend::NdArray;

pub type Loader = ShardLoader<B, usize, Vec<usize>>;

/// Hands the items through, so a batch is the list of dataset indices it holds.
#[derive(Clone)]
pub struct Ids;

impl<Bk: Backend> Batcher<Bk, usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &Bk::Device) -> Vec<usize> {
        items
    }
}

pub fn builder(config: DataLoaderConfig, n: usize) -> ShardLoaderBuilder<B, usize, Vec<usize>> {
    ShardLoaderBuilder::new(config, InMemDataset::new((0..n).collect()), Ids)
}

pub fn shards(config: DataLoaderConfig, n: usize, np: usize) -> Vec<Loader> {
    builder(config, n)
        .build(&vec![Default::default(); np])
        .expect("valid configuration")
}

/// One whole epoch.
pub fn epoch(loader: &Loader) -> Vec<Vec<usize>> {
    loader.iter().collect()
}
