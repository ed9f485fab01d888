//! One epoch of one shard: which dataset indices each batch holds.
//!
//! The sharding itself is [`ShardPlan`]'s; this layer adds the epoch's sampling order and the
//! item window a [`DataLoader::slice`](burn::data::dataloader::DataLoader::slice) restricts a
//! loader to.

use std::ops::Range;
use std::sync::Arc;

use burn::data::dataset::Dataset;

use super::shard::ShardPlan;

/// Which epoch a set of batches belongs to, as every shard of one builder sees it: the epoch
/// number and the seed of its order (`None` when not shuffled).
pub(crate) type EpochKey = (u64, Option<u64>);

/// The batches one shard yields in one epoch, computed on demand.
#[derive(Debug, Clone)]
pub(crate) struct Epoch {
    plan: ShardPlan,
    /// Position -> dataset index; `None` for the sequential order.
    order: Option<Arc<[usize]>>,
    /// `None`: the plan's own batches. `Some`: a range of the flattened item stream, batched
    /// again by the process batch size (what a slice sees).
    window: Option<Range<usize>>,
    key: EpochKey,
}

impl Epoch {
    pub(crate) fn new(
        plan: ShardPlan,
        order: Option<Arc<[usize]>>,
        window: Option<Range<usize>>,
        key: EpochKey,
    ) -> Self {
        Self {
            plan,
            order,
            window,
            key,
        }
    }

    pub(crate) fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    pub(crate) fn key(&self) -> EpochKey {
        self.key
    }

    /// Whether the batches are the plan's (not a slice's).
    pub(crate) fn is_full(&self) -> bool {
        self.window.is_none()
    }

    /// Number of batches this epoch yields.
    pub(crate) fn num_batches(&self) -> usize {
        match &self.window {
            None => self.plan.num_batches(),
            Some(window) => window.len().div_ceil(self.plan.spec().process_batch_size()),
        }
    }

    /// Number of items this epoch yields, padding included.
    pub(crate) fn num_items(&self) -> usize {
        match &self.window {
            None => stream_len(&self.plan),
            Some(window) => window.len(),
        }
    }

    /// Items in the first `batches` batches: every batch but the last is full, so this is
    /// exact without visiting them (what progress reports after a skip).
    pub(crate) fn items_before(&self, batches: usize) -> usize {
        batches
            .saturating_mul(self.plan.spec().process_batch_size())
            .min(self.num_items())
    }

    /// The sampler positions of batch `index` (empty past the end).
    pub(crate) fn positions(&self, index: usize) -> Vec<usize> {
        let Some(window) = &self.window else {
            return self.plan.batch(index).unwrap_or_default();
        };
        let part = self.plan.spec().process_batch_size();
        let lo = window
            .start
            .saturating_add(index.saturating_mul(part))
            .min(window.end);
        let hi = lo.saturating_add(part).min(window.end);
        let mut out = Vec::with_capacity(hi - lo);
        let mut k = lo;
        // Every plan batch but the last holds exactly `part` items, so item k of the stream is
        // item k % part of plan batch k / part.
        while k < hi {
            let batch = self.plan.batch(k / part).unwrap_or_default();
            let offset = k % part;
            let take = (hi - k).min(batch.len().saturating_sub(offset));
            if take == 0 {
                break;
            }
            out.extend_from_slice(&batch[offset..offset + take]);
            k += take;
        }
        out
    }

    /// The dataset index at sampler position `position`.
    pub(crate) fn index(&self, position: usize) -> usize {
        match &self.order {
            Some(order) => order.get(position).copied().unwrap_or(position),
            None => position,
        }
    }

    /// Reads batch `index` straight from `dataset`.
    pub(crate) fn read<I>(&self, dataset: &dyn Dataset<I>, index: usize) -> Vec<I> {
        let positions = self.positions(index);
        // Sized up front: `filter_map` would otherwise grow the batch several times.
        let mut items = Vec::with_capacity(positions.len());
        items.extend(
            positions
                .into_iter()
                .filter_map(|position| get(dataset, self.index(position))),
        );
        items
    }
}

/// Items one shard yields over a whole epoch, padding included.
pub(crate) fn stream_len(plan: &ShardPlan) -> usize {
    match plan.num_batches() {
        0 => 0,
        n => (n - 1) * plan.spec().process_batch_size() + plan.batch(n - 1).map_or(0, |b| b.len()),
    }
}

/// `dataset.get`, with a warning instead of a panic when a dataset breaks its own `len`.
pub(crate) fn get<I>(dataset: &dyn Dataset<I>, index: usize) -> Option<I> {
    let item = dataset.get(index);
    if item.is_none() {
        log::warn!(
            "burn-accelerate: the dataset has no item {index} although its len() is {}; the \
             batch is yielded without it",
            dataset.len()
        );
    }
    item
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::{ShardOptions, ShardSpec, Sharding};

    fn plan(n: usize, np: usize, p: usize, bs: usize, even: bool, sharding: Sharding) -> ShardPlan {
        let spec = ShardSpec::new(ShardOptions {
            num_processes: np,
            process_index: p,
            batch_size: bs,
            even_batches: even,
            ..ShardOptions::default()
        })
        .unwrap();
        ShardPlan::new(n, &spec, sharding).unwrap()
    }

    #[test]
    fn windows_rebatch_the_flattened_stream() {
        for (plan, n) in [
            (plan(23, 3, 1, 4, true, Sharding::BatchSampler), 23),
            (plan(23, 3, 2, 4, false, Sharding::BatchSampler), 23),
            (plan(23, 3, 2, 4, true, Sharding::Dispatch), 23),
            (plan(2, 4, 3, 2, true, Sharding::Dispatch), 2),
        ] {
            let full = Epoch::new(plan, None, None, (0, None));
            let stream: Vec<usize> = (0..full.num_batches())
                .flat_map(|b| full.positions(b))
                .collect();
            assert_eq!(stream.len(), full.num_items(), "n={n}");
            for start in 0..=stream.len() {
                for end in start..=stream.len() {
                    let slice = Epoch::new(plan, None, Some(start..end), (0, None));
                    let got: Vec<Vec<usize>> = (0..slice.num_batches())
                        .map(|b| slice.positions(b))
                        .collect();
                    let want: Vec<Vec<usize>> = stream[start..end]
                        .chunks(plan.spec().process_batch_size())
                        .map(<[usize]>::to_vec)
                        .collect();
                    assert_eq!(got, want, "{start}..{end}");
                    assert_eq!(slice.items_before(slice.num_batches()), end - start);
                }
            }
        }
    }

    #[test]
    fn order_maps_positions_to_indices() {
        let plan = plan(4, 1, 0, 2, true, Sharding::BatchSampler);
        let epoch = Epoch::new(plan, Some(vec![3, 1, 0, 2].into()), None, (0, Some(1)));
        let data = burn::data::dataset::InMemDataset::new(vec![10, 11, 12, 13]);
        assert_eq!(epoch.read(&data, 0), vec![13, 11]);
        assert_eq!(epoch.read(&data, 1), vec![10, 12]);
        assert_eq!(epoch.read(&data, 2), Vec::<i32>::new());
    }
}
