//! Accelerate-compatible data loading for Burn.
//!
//! - [`shard`]: the pure index arithmetic (which items each process sees, in which batches),
//!   conformant with accelerate 1.16's `BatchSamplerShard`, `IterableDatasetShard` and
//!   `DataLoaderDispatcher`, and tested on its own against golden vectors from the real
//!   library.
//! - [`DataLoaderConfig`] and [`ShardLoaderBuilder`]: Accelerate's `DataLoaderConfiguration`
//!   (`split_batches`, `dispatch_batches`, `even_batches`, `use_seedable_sampler`,
//!   `non_blocking`) as one Burn [`DataLoader`](burn::data::dataloader::DataLoader) per
//!   process, a [`ShardLoader`], usable wherever Burn takes a loader (e.g. as the training
//!   loader of `SupervisedTraining`).
//! - [`StreamLoaderBuilder`] and [`StreamLoader`]: the same for a stream that cannot be
//!   indexed, made anew each epoch by a [`StreamFactory`] (accelerate's `IterableDataset`
//!   path: `IterableDatasetShard`, or `DataLoaderDispatcher` under `dispatch_batches`).
//! - [`LoaderState`]: the epoch and position to checkpoint and resume from.
//! - [`LoaderObserver`]: the hook through which a loader reports `end_of_dataloader` and the
//!   `remainder` (for gradient accumulation and evaluation).
//! - [`gather_for_metrics`]: dropping the padded duplicates of the last gathered step.

mod config;
mod dispatch;
mod epoch;
mod error;
mod loader;
mod metrics;
mod observer;
mod prefetch;
mod process_dispatch;
mod processes;
mod run;
pub mod shard;
pub(crate) mod state;
mod stream;
mod stream_loader;
mod valid_split;

pub use config::DataLoaderConfig;
pub use error::DataLoaderError;
pub(crate) use loader::{EvenSplit, ProcessShare, ProcessSlice, move_and_identify};
pub use loader::{ShardIter, ShardLoader, ShardLoaderBuilder};
pub use metrics::{drop_padding, drop_padding_tensor, gather_for_metrics};
pub use observer::{GradientStateObserver, LoaderObserver};
pub use state::LoaderState;
pub use stream::StreamFactory;
pub use stream_loader::{StreamIter, StreamLoader, StreamLoaderBuilder};
pub use valid_split::BatchSplit;
