//! The loader's settings, with Accelerate's names.

use burn::config::Config;

use super::error::DataLoaderError;
use super::shard::{ShardOptions, ShardSpec, Sharding};

/// How to load and shard data over several processes (or devices), in the terms of
/// Accelerate's `DataLoaderConfiguration` and `prepare_data_loader`.
///
/// Build the loaders with [`ShardLoaderBuilder`](super::ShardLoaderBuilder); invalid settings
/// are refused there with a [`DataLoaderError`] that says what to change.
///
/// Defaults are Accelerate's, except that `dispatch_batches` is off (Accelerate turns it on
/// only for iterable datasets, and a Burn [`Dataset`](burn::data::dataset::Dataset) is always
/// indexable).
///
/// ```
/// use burn_accelerate::data::DataLoaderConfig;
///
/// let config = DataLoaderConfig::new(32)
///     .with_shuffle(true)
///     .with_use_seedable_sampler(true)
///     .with_data_seed(Some(1234))
///     .with_num_workers(2);
/// assert!(config.even_batches);
/// assert_eq!(config.prefetch, 16);
/// ```
#[derive(Config, Debug, PartialEq, Eq)]
pub struct DataLoaderConfig {
    /// The batch size of the wrapped loader: per process, or, with `split_batches`, the global
    /// batch cut into `num_processes` equal parts.
    pub batch_size: usize,
    /// Cut each batch into per-process parts instead of giving each process whole batches
    /// (the batch size must then be a multiple of the number of processes).
    #[config(default = false)]
    pub split_batches: bool,
    /// One reader pulls each global batch and hands every shard its slice, with the tail of
    /// Accelerate's `DataLoaderDispatcher` (see [`Sharding::Dispatch`]). The last batches
    /// are then shorter, and empty on some processes when there are fewer items than
    /// processes, so the batcher is called with an empty `Vec` there. Across processes
    /// (`burn-accelerate launch`), build each process's loader with
    /// [`ShardLoaderBuilder::build_dispatching`](super::ShardLoaderBuilder::build_dispatching)
    /// for process 0 alone to read and send the others their slices.
    #[config(default = false)]
    pub dispatch_batches: bool,
    /// Pad the tail by cycling from the start of the data so every process gets the same
    /// number of equally sized batches. No effect under `dispatch_batches` or `drop_last`.
    #[config(default = true)]
    pub even_batches: bool,
    /// With `shuffle`, draw each epoch's order from `data_seed + epoch` alone (Accelerate's
    /// `SeedableRandomSampler`), so [`set_epoch`](super::ShardLoader::set_epoch) and a
    /// restart reproduce it. Without it each new epoch draws its seed from a generator that
    /// advances once per epoch, like a `RandomSampler` with a synchronised generator; that
    /// generator is part of the [`LoaderState`](super::LoaderState), so a restored run still
    /// agrees.
    #[config(default = false)]
    pub use_seedable_sampler: bool,
    /// Prepare batches (and create them on the target device) on a background thread,
    /// `prefetch` steps ahead, instead of in the thread that iterates. On cubecl's backends
    /// (wgpu, CUDA), whose per-thread streams cannot hand device buffers between threads
    /// safely, the background threads read the items and the iterating thread makes the
    /// batches.
    #[config(default = false)]
    pub non_blocking: bool,
    /// Drop the incomplete tail instead of padding it.
    #[config(default = false)]
    pub drop_last: bool,
    /// Visit the data in a seeded random order, the same on every process.
    #[config(default = false)]
    pub shuffle: bool,
    /// The seed of the shuffled order. `None` draws one from the OS once per builder (shared
    /// by its shards); it is recorded in the [`LoaderState`](super::LoaderState).
    pub data_seed: Option<u64>,
    /// Background threads that read items from the dataset, each `prefetch` batches ahead.
    /// With `non_blocking` they also batch on the device; without it the iterating thread
    /// does, so device transfers stay where they are issued.
    #[config(default = 0)]
    pub num_workers: usize,
    /// How many batches each background thread may have ready ahead of the consumer (torch's
    /// `prefetch_factor`). Must be at least 1 when any background thread is used. The
    /// default is 16, not torch's 2: a full worker is woken again once its queue has drained
    /// to half, so at depth 2 it is woken after every batch taken, and that wake-up per batch
    /// made the loader up to 2x slower than Burn's on cheap batches; at 8 one wake per 4
    /// batches still left it 10–15% behind Burn's with 2 workers in some runs, at 16 it was
    /// ahead in every run (BENCHMARKS.md, "Sharded data loader vs Burn's
    /// `DataLoaderBuilder`"). Up to 6 workers that holds fewer batches than Burn's own loader
    /// (100). Lower it for very large batches to bound memory.
    #[config(default = 16)]
    pub prefetch: usize,
}

impl DataLoaderConfig {
    /// How batches reach the processes under this configuration.
    pub fn sharding(&self) -> Sharding {
        if self.dispatch_batches {
            Sharding::Dispatch
        } else {
            Sharding::BatchSampler
        }
    }

    /// The validated sharding settings of process `process_index` out of `num_processes`.
    ///
    /// # Errors
    ///
    /// [`DataLoaderError::Shard`] for a zero batch size, zero processes, an out-of-range
    /// process index or an indivisible `split_batches`; [`DataLoaderError::ZeroPrefetch`]
    /// when background threads are asked for with a prefetch depth of 0.
    ///
    /// ```
    /// use burn_accelerate::data::{DataLoaderConfig, DataLoaderError};
    /// use burn_accelerate::data::shard::ShardError;
    ///
    /// let config = DataLoaderConfig::new(6).with_split_batches(true);
    /// assert_eq!(config.shard_spec(3, 0)?.process_batch_size(), 2);
    /// assert!(matches!(
    ///     config.shard_spec(4, 0),
    ///     Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. }))
    /// ));
    /// # Ok::<(), DataLoaderError>(())
    /// ```
    pub fn shard_spec(
        &self,
        num_processes: usize,
        process_index: usize,
    ) -> Result<ShardSpec, DataLoaderError> {
        let spec = ShardSpec::new(ShardOptions {
            num_processes,
            process_index,
            batch_size: self.batch_size,
            split_batches: self.split_batches,
            even_batches: self.even_batches,
            drop_last: self.drop_last,
        })?;
        if self.prefetch == 0 && self.background() {
            return Err(DataLoaderError::ZeroPrefetch {
                num_workers: self.num_workers,
                non_blocking: self.non_blocking,
            });
        }
        Ok(spec)
    }

    /// Whether any batch is prepared off the iterating thread.
    pub(crate) fn background(&self) -> bool {
        self.num_workers > 0 || self.non_blocking
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::ShardError;

    #[test]
    fn every_invalid_setting_is_a_typed_error() {
        let ok = DataLoaderConfig::new(4);
        assert!(ok.shard_spec(2, 1).is_ok());
        assert_eq!(
            DataLoaderConfig::new(0).shard_spec(1, 0),
            Err(DataLoaderError::Shard(ShardError::ZeroBatchSize))
        );
        assert_eq!(
            ok.shard_spec(0, 0),
            Err(DataLoaderError::Shard(ShardError::ZeroProcesses))
        );
        assert_eq!(
            ok.shard_spec(2, 2),
            Err(DataLoaderError::Shard(ShardError::ProcessIndexOutOfRange {
                process_index: 2,
                num_processes: 2
            }))
        );
        let split = DataLoaderConfig::new(5).with_split_batches(true);
        assert!(matches!(
            split.shard_spec(2, 0),
            Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. }))
        ));
        // Batch size 1 split over two processes would give empty batches: refused too.
        assert!(
            DataLoaderConfig::new(1)
                .with_split_batches(true)
                .shard_spec(2, 0)
                .is_err()
        );
        let no_room = DataLoaderConfig::new(4).with_prefetch(0);
        assert!(no_room.shard_spec(1, 0).is_ok(), "no background thread");
        assert!(matches!(
            no_room.clone().with_num_workers(1).shard_spec(1, 0),
            Err(DataLoaderError::ZeroPrefetch { .. })
        ));
        let msg = no_room
            .with_non_blocking(true)
            .shard_spec(1, 0)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("prefetch depth of at least 1"), "{msg}");
    }

    #[test]
    fn defaults_are_accelerates() {
        let c = DataLoaderConfig::new(8);
        assert!(!c.split_batches && !c.dispatch_batches && c.even_batches);
        assert!(!c.use_seedable_sampler && !c.non_blocking && !c.drop_last && !c.shuffle);
        assert_eq!((c.data_seed, c.num_workers, c.prefetch), (None, 0, 16));
        assert_eq!(c.sharding(), Sharding::BatchSampler);
    }

    #[test]
    fn config_round_trips_through_json() {
        let c = DataLoaderConfig::new(8)
            .with_dispatch_batches(true)
            .with_data_seed(Some(7));
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<DataLoaderConfig>(&json).unwrap(), c);
    }
}
