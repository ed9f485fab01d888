//! Why a sharded data loader could not be built or restored.

use thiserror::Error;

use super::shard::ShardError;

/// Why a [`DataLoaderConfig`](super::DataLoaderConfig) was refused at build time, or a
/// [`LoaderState`](super::LoaderState) could not be restored.
///
/// Each message names the setting to change: these errors usually surface far from where the
/// configuration was written (a launcher, a config file, a checkpoint).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DataLoaderError {
    /// The sharding settings themselves are invalid (zero batch size, zero processes, a
    /// process index out of range, `split_batches` with an indivisible batch size).
    #[error(transparent)]
    Shard(#[from] ShardError),

    /// A loader that needs the other processes (`dispatch_batches` across processes) could
    /// not reach them.
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistributedError),

    /// Background preparation was asked for with no room to prepare anything in.
    #[error(
        "prefetch is 0 while batches are prepared in the background (num_workers = \
         {num_workers}, non_blocking = {non_blocking}): use a prefetch depth of at least 1, \
         or set num_workers = 0 and non_blocking = false"
    )]
    ZeroPrefetch {
        /// The configured number of workers.
        num_workers: usize,
        /// The configured `non_blocking`.
        non_blocking: bool,
    },

    /// A shuffled order must be the same on every process, and processes built separately
    /// (one per rank) cannot agree on a seed drawn at random.
    #[error(
        "shuffle over {num_processes} processes built one at a time needs data_seed: set the \
         same data_seed on every process (or build all shards with one builder)"
    )]
    MissingDataSeed {
        /// The number of processes sharing the data.
        num_processes: usize,
    },

    /// A stream has no indices to permute, so the loader cannot shuffle it.
    #[error(
        "shuffle is on, but a stream has no indices to shuffle: set shuffle = false and \
         shuffle inside the stream (for example with a shuffle buffer seeded from the epoch \
         the stream factory is called with), or load an indexable Dataset instead"
    )]
    ShuffledStream,

    /// Several devices' loaders asked of one process of a run of several processes.
    #[error(
        "this is process {process} of a run of {num_processes} (burn-accelerate launch): it \
         gets one loader, for one device, not {devices}; run one process per device"
    )]
    DevicesPerProcess {
        /// The devices asked for.
        devices: usize,
        /// This process's index.
        process: usize,
        /// The processes of the run.
        num_processes: usize,
    },

    /// A restored position lies beyond the end of the epoch, so the state cannot belong to
    /// this loader.
    #[error(
        "the loader state is at batch {position} of an epoch that has only {num_batches} \
         batches on this process: restore a state saved with the same dataset, batch size, \
         number of processes and sharding flags"
    )]
    ResumePastEnd {
        /// The batch the state would resume at.
        position: usize,
        /// The number of batches one epoch of this loader has.
        num_batches: usize,
    },
}
