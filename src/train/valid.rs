//! Validation on several processes: each process evaluates its own whole batches of the
//! validation loader, in the training's precision, and the metrics are combined
//! ([`valid_metrics`](super::valid_metrics)).

use super::*;
use crate::data::BatchSplit;
use burn::data::dataloader::DataLoader;

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    /// Accelerate's `prepare(dataloader)` for a validation loader: the loader this process
    /// validates on, moved to the main device. The fit does this itself with the loader given
    /// to `SupervisedTraining::new`.
    ///
    /// - On one process, and in a [`data_parallel`](Self::data_parallel) training (which
    ///   validates on its main device), the loader is only moved.
    /// - On several processes, a loader of the whole validation set (Burn's
    ///   `DataLoaderBuilder`'s) is divided into whole batches of its own batch size: each
    ///   process takes a contiguous run of them, in process order, the first
    ///   `num_batches % num_processes` processes one batch more ([`DataLoader::slice`] at batch
    ///   boundaries). No item is read twice or left out, and the batches are the ones one
    ///   process would make, so Burn's per-batch metric entries of all processes together are
    ///   one process's (the combination is exact, not only for means). A process may get no
    ///   batch at all (fewer batches than processes). The batch size is read from the
    ///   loader's first batch (its progress after it); a loader with workers
    ///   (`num_workers`) batches each worker's part apart, so its batches, though not its
    ///   items, then differ from one process's.
    /// - One of the crate's per-process loaders ([`ShardLoader`] or `StreamLoader` built for
    ///   this process) is this process's already and is only moved; with `even_batches` its
    ///   last batches repeat items of the start of the data set, which Burn's metrics then
    ///   count (build it with `even_batches(false)` to count every item once).
    ///
    /// [`DataLoader::slice`]: burn::data::dataloader::DataLoader::slice
    pub fn prepare_valid_loader(&self, loader: &ValidLoader<LC>) -> ValidLoader<LC> {
        use burn::tensor::backend::DeviceOps;

        self.valid_part(loader, self.device.inner())
    }

    pub(super) fn valid_part(
        &self,
        loader: &ValidLoader<LC>,
        device: &Device<
            <TrainingBackend<LC> as burn::tensor::backend::AutodiffBackend>::InnerBackend,
        >,
    ) -> ValidLoader<LC> {
        let (moved, share) = move_and_identify(loader, device);
        let processes = self.process.num_processes();
        let rank = self.process.process_index();
        if processes == 1 || self.shards.is_some() {
            return moved;
        }
        if let Some(share) = share {
            log::info!(
                "burn-accelerate: the validation loader holds process {}'s share: it is \
                 validated as it is (with `even_batches` its last items repeat others', and \
                 Burn's metrics count them)",
                share.process_index
            );
            return moved;
        }
        let items = moved.num_items();
        let batch_size = first_batch_items(&moved).max(1);
        let part = BatchSplit::of(items, batch_size, processes, rank)
            .expect("a batch size of at least 1 and a process of the run");
        log::info!(
            "burn-accelerate: process {rank} of {processes} validates items {}..{} of {items} \
             ({} batches of {batch_size}); the metrics of all processes are combined",
            part.start,
            part.end,
            part.batches,
        );
        let share = ProcessShare {
            num_processes: Some(processes),
            process_index: rank,
        };
        Arc::new(ProcessSlice::new(moved.slice(part.start, part.end), share))
    }
}

// The items of `loader`'s first batch (its batch size, unless the data set is shorter): what
// its progress says after the first batch. 0 for an empty loader.
fn first_batch_items<B: Backend, O>(loader: &Arc<dyn DataLoader<B, O>>) -> usize {
    let mut iterator = loader.iter();
    match iterator.next() {
        Some(_) => iterator.progress().items_processed,
        None => 0,
    }
}
