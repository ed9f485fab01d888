//! Reading a stream (data that can only be read front to back) in global steps.
//!
//! Accelerate shards an `IterableDataset` in global batches of `total_batch_size` items: with
//! `IterableDatasetShard` every process reads the whole stream and keeps its slice of each
//! global batch; with `DataLoaderDispatcher` one reader pulls each global batch and sends the
//! slices. Either way the tail can only be decided once the stream ends, so a
//! [`StepReader`] reads one global step ahead: when step `k` is handed out it is known
//! whether it is the last, and then the stream's length `n` is known too.
//!
//! What a process gets of a step is not computed here: it is the step's batch in the
//! [`ShardPlan`] of a dataset of `n` items (the real `n` for the last step, any longer one
//! before it), so a stream and an indexed dataset of the same items are sharded by the same
//! arithmetic. Positions before the step (the padding of a short last step, which accelerate
//! takes from the start of the data) come from the first step, kept for that purpose.

use std::collections::BTreeMap;
use std::iter::Fuse;
use std::sync::Arc;

use super::dispatch::StepSource;
use super::epoch::EpochKey;
use super::shard::{ShardPlan, ShardSpec, Sharding};

/// Makes the stream of one epoch; called again at the start of every epoch (and by every
/// process, or by the one reader under `dispatch_batches`).
///
/// It must yield the same items in the same order each time it is called with the same
/// epoch, on every process: the processes agree on which items they share only through that
/// (accelerate's `IterableDatasetShard` asks the same of its dataset). To shuffle, shuffle
/// inside the stream from a seed that depends on the epoch.
///
/// Implemented for every `Fn(u64) -> impl IntoIterator` that can be shared between threads:
///
/// ```
/// use burn_accelerate::data::StreamFactory;
///
/// let lines = |epoch: u64| (0..3u64).map(move |i| format!("epoch {epoch}, line {i}"));
/// assert_eq!(lines.open(1).last(), Some("epoch 1, line 2".to_string()));
/// ```
pub trait StreamFactory<I>: Send + Sync {
    /// The stream of epoch `epoch`.
    fn open(&self, epoch: u64) -> Box<dyn Iterator<Item = I> + Send>;
}

impl<I, F, S> StreamFactory<I> for F
where
    F: Fn(u64) -> S + Send + Sync,
    S: IntoIterator<Item = I>,
    S::IntoIter: Send + 'static,
{
    fn open(&self, epoch: u64) -> Box<dyn Iterator<Item = I> + Send> {
        Box::new(self(epoch).into_iter())
    }
}

/// One global step of a stream: up to `total_batch_size` consecutive items.
pub(crate) struct Step<I> {
    index: usize,
    items: Vec<I>,
    /// `Some(n)` when this is the last step, `n` being the number of items in the stream
    /// (a tail dropped under `drop_last` included).
    stream_len: Option<usize>,
}

/// Reads a stream one global step at a time, one step ahead.
pub(crate) struct StepReader<I> {
    stream: Fuse<Box<dyn Iterator<Item = I> + Send>>,
    total: usize,
    drop_last: bool,
    /// Items of the first step to keep for padding the last one.
    keep_first: usize,
    first: Vec<I>,
    /// The index of the step `next` returns.
    next_step: usize,
    /// The items of step `next_step`, once read ahead.
    ahead: Option<Vec<I>>,
    /// Items pulled from the stream so far.
    pulled: usize,
}

impl<I: Clone> StepReader<I> {
    /// Reads `stream` in steps of `total` items. Without `drop_last`, the first `keep_first`
    /// items are kept to pad a short last step.
    pub(crate) fn new(
        stream: Box<dyn Iterator<Item = I> + Send>,
        total: usize,
        drop_last: bool,
        keep_first: usize,
    ) -> Self {
        Self {
            stream: stream.fuse(),
            total,
            drop_last,
            keep_first: if drop_last { 0 } else { keep_first },
            first: Vec::new(),
            next_step: 0,
            ahead: None,
            pulled: 0,
        }
    }

    /// The index of the step [`next`](Self::next) returns.
    pub(crate) fn position(&self) -> usize {
        self.next_step
    }

    fn pull(&mut self) -> Vec<I> {
        let mut items = Vec::with_capacity(self.total);
        items.extend(self.stream.by_ref().take(self.total));
        self.pulled += items.len();
        items
    }

    /// Whether `items` make a step (`drop_last` drops a short one).
    fn is_step(&self, items: &[I]) -> bool {
        !items.is_empty() && (!self.drop_last || items.len() == self.total)
    }

    /// The next step, or `None` once the stream has no more.
    pub(crate) fn next(&mut self) -> Option<Step<I>> {
        let items = match self.ahead.take() {
            Some(items) => items,
            None => self.pull(),
        };
        if !self.is_step(&items) {
            self.ahead = Some(Vec::new());
            return None;
        }
        // A full step may be the last: only reading the next one tells (accelerate's
        // dispatcher and `DataLoaderShard` also fetch one batch ahead).
        let after = if items.len() < self.total {
            Vec::new()
        } else {
            self.pull()
        };
        let last = !self.is_step(&after);
        self.ahead = Some(after);
        let index = self.next_step;
        self.next_step += 1;
        if index == 0 && !last {
            self.first = items[..self.keep_first.min(items.len())].to_vec();
        }
        Some(Step {
            index,
            items,
            stream_len: last.then_some(self.pulled),
        })
    }
}

/// What one process gets of one step.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct StreamSlice<I> {
    pub(crate) items: Vec<I>,
    /// Set on the process's last batch of the epoch.
    pub(crate) end: Option<StreamEnd>,
}

/// What is known once the stream has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StreamEnd {
    /// Items in the stream.
    pub(crate) stream_len: usize,
    /// Accelerate's `GradientState.remainder` (see [`ShardPlan::remainder`]).
    pub(crate) remainder: Option<usize>,
    /// Padding duplicates in the last gathered step (see [`ShardPlan::last_step_padding`]).
    pub(crate) padding: usize,
}

/// The sharding of a stream over every process: what each gets of each step.
pub(crate) struct StreamSource<I> {
    factory: Arc<dyn StreamFactory<I>>,
    /// Every process's spec (same flags, its own index).
    specs: Vec<ShardSpec>,
    sharding: Sharding,
}

// By hand: a derive would ask `I: Clone`, and only the `Arc` is cloned.
impl<I> Clone for StreamSource<I> {
    fn clone(&self) -> Self {
        Self {
            factory: Arc::clone(&self.factory),
            specs: self.specs.clone(),
            sharding: self.sharding,
        }
    }
}

impl<I: Clone + Send> StreamSource<I> {
    /// `specs` must be built with [`stream_spec`].
    pub(crate) fn new(
        factory: Arc<dyn StreamFactory<I>>,
        specs: Vec<ShardSpec>,
        sharding: Sharding,
    ) -> Self {
        Self {
            factory,
            specs,
            sharding,
        }
    }

    /// A reader of epoch `epoch`'s stream from its start.
    pub(crate) fn reader(&self, epoch: u64) -> StepReader<I> {
        let spec = self.specs.first();
        let total = spec.map_or(1, ShardSpec::total_batch_size);
        let keep_first = match self.sharding {
            // Padding cycles from the start: at most one step's worth.
            Sharding::BatchSampler => total,
            // Accelerate's dispatcher pads with the first `num_processes` items only.
            Sharding::Dispatch => spec.map_or(0, ShardSpec::num_processes),
        };
        let drop_last = spec.is_some_and(ShardSpec::drop_last);
        StepReader::new(self.factory.open(epoch), total, drop_last, keep_first)
    }

    /// Items process `process` yields over a stream of `stream_len` items.
    pub(crate) fn shard_items(&self, process: usize, stream_len: usize) -> usize {
        self.specs
            .get(process)
            .and_then(|spec| ShardPlan::new(stream_len, spec, self.sharding).ok())
            .map_or(0, |plan| super::epoch::stream_len(&plan))
    }

    /// The plan whose batch `step.index` is what each process gets of `step`.
    fn plan(&self, process: usize, step: &Step<I>) -> Option<ShardPlan> {
        let spec = self.specs.get(process)?;
        // Before the last step any length that makes this step full and not last will do.
        let len = step.stream_len.unwrap_or_else(|| {
            step.index
                .saturating_add(2)
                .saturating_mul(spec.total_batch_size())
        });
        ShardPlan::new(len, spec, self.sharding).ok()
    }

    /// Cuts `step` into the slices of `processes`; an item is cloned only for its repeats.
    fn cut(&self, step: Step<I>, first: &[I], processes: &[usize]) -> Vec<StreamSlice<I>> {
        let start = step.index.saturating_mul(self.specs[0].total_batch_size());
        let wanted: Vec<(Vec<usize>, Option<StreamEnd>)> = processes
            .iter()
            .map(|&q| {
                let Some(plan) = self.plan(q, &step) else {
                    return (Vec::new(), None);
                };
                let end = step.stream_len.map(|stream_len| StreamEnd {
                    stream_len,
                    remainder: plan.remainder(),
                    padding: plan.last_step_padding(),
                });
                (plan.batch(step.index).unwrap_or_default(), end)
            })
            .collect();
        let mut uses: BTreeMap<usize, usize> = BTreeMap::new();
        for (positions, _) in &wanted {
            for &p in positions.iter().filter(|&&p| p >= start) {
                *uses.entry(p - start).or_default() += 1;
            }
        }
        let mut items: Vec<Option<I>> = step.items.into_iter().map(Some).collect();
        wanted
            .into_iter()
            .map(|(positions, end)| {
                let items = positions
                    .into_iter()
                    .filter_map(|p| {
                        if p < start {
                            return first.get(p).cloned();
                        }
                        let k = p - start;
                        let left = uses.get_mut(&k)?;
                        *left -= 1;
                        if *left == 0 {
                            items.get_mut(k)?.take()
                        } else {
                            items.get(k)?.clone()
                        }
                    })
                    .collect();
                StreamSlice { items, end }
            })
            .collect()
    }
}

/// The spec a stream is sharded with: accelerate's `IterableDatasetShard` always pads the
/// tail (it has no `even_batches`), so the batch-sampler arithmetic runs with
/// `even_batches` on; the dispatcher ignores it anyway.
pub(crate) fn stream_spec(spec: ShardSpec) -> ShardSpec {
    let mut options = spec.options();
    options.even_batches = true;
    // Changing `even_batches` cannot make a valid spec invalid.
    ShardSpec::new(options).unwrap_or(spec)
}

impl<I: Clone + Send> StepSource for StreamSource<I> {
    /// `None` past the end of the stream.
    type Slice = Option<StreamSlice<I>>;
    /// The epoch number: it selects the stream.
    type Epoch = u64;
    type Cursor = StepReader<I>;

    fn key(epoch: &u64) -> EpochKey {
        (*epoch, None)
    }

    fn open(&self, epoch: &u64, _first_step: usize) -> StepReader<I> {
        // A stream cannot seek: the steps before `first_step` are read and passed over.
        self.reader(*epoch)
    }

    fn read_step(
        &self,
        cursor: &mut StepReader<I>,
        _epoch: &u64,
        step: usize,
        processes: &[usize],
    ) -> Vec<Self::Slice> {
        while cursor.position() < step {
            if cursor.next().is_none() {
                break;
            }
        }
        let read = (cursor.position() == step).then(|| cursor.next()).flatten();
        match read {
            Some(step) => {
                let first = std::mem::take(&mut cursor.first);
                let slices = self.cut(step, &first, processes);
                cursor.first = first;
                slices.into_iter().map(Some).collect()
            }
            None => processes.iter().map(|_| None).collect(),
        }
    }

    fn can_reach(cursor: &StepReader<I>, step: usize) -> bool {
        cursor.position() <= step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::ShardOptions;

    fn source(np: usize, bs: usize, drop_last: bool, sharding: Sharding) -> StreamSource<usize> {
        let n = 5;
        let specs = (0..np)
            .map(|p| {
                stream_spec(
                    ShardSpec::new(ShardOptions {
                        num_processes: np,
                        process_index: p,
                        batch_size: bs,
                        drop_last,
                        even_batches: false,
                        ..ShardOptions::default()
                    })
                    .unwrap(),
                )
            })
            .collect();
        StreamSource::new(Arc::new(move |_: u64| 0..n), specs, sharding)
    }

    fn epoch(source: &StreamSource<usize>, np: usize) -> Vec<Vec<(Vec<usize>, bool)>> {
        let mut reader = source.reader(0);
        let all: Vec<usize> = (0..np).collect();
        let mut out = vec![Vec::new(); np];
        for step in 0.. {
            let slices = source.read_step(&mut reader, &0, step, &all);
            if slices[0].is_none() {
                break;
            }
            for (p, slice) in slices.into_iter().enumerate() {
                let slice = slice.unwrap();
                out[p].push((slice.items, slice.end.is_some()));
            }
        }
        out
    }

    #[test]
    fn the_tail_is_accelerates_and_known_on_the_last_step() {
        // 5 items, batch 2, 2 processes (the README's example).
        let iterable = epoch(&source(2, 2, false, Sharding::BatchSampler), 2);
        assert_eq!(
            iterable,
            vec![
                vec![(vec![0, 1], false), (vec![4, 0], true)],
                vec![(vec![2, 3], false), (vec![1, 2], true)],
            ]
        );
        let dispatched = epoch(&source(2, 2, false, Sharding::Dispatch), 2);
        assert_eq!(
            dispatched,
            vec![
                vec![(vec![0, 1], false), (vec![4], true)],
                vec![(vec![2, 3], false), (vec![0], true)],
            ]
        );
        // drop_last: the short tail is read (to learn it is short) and dropped, so the
        // full step before it is the last.
        let dropped = epoch(&source(2, 2, true, Sharding::BatchSampler), 2);
        assert_eq!(
            dropped,
            vec![vec![(vec![0, 1], true)], vec![(vec![2, 3], true)]]
        );
    }

    #[test]
    fn the_end_reports_the_stream_length_remainder_and_padding() {
        let source = source(2, 2, false, Sharding::BatchSampler);
        let mut reader = source.reader(0);
        source.read_step(&mut reader, &0, 0, &[0]);
        let last = source
            .read_step(&mut reader, &0, 1, &[0])
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(
            last.end,
            Some(StreamEnd {
                stream_len: 5,
                remainder: Some(1),
                padding: 3
            })
        );
        assert!(source.read_step(&mut reader, &0, 2, &[0])[0].is_none());
        assert_eq!(source.shard_items(1, 5), 4);
    }

    #[test]
    fn steps_can_be_passed_over_but_not_revisited() {
        let source = source(1, 2, false, Sharding::BatchSampler);
        let mut reader = source.reader(0);
        let third = source
            .read_step(&mut reader, &0, 2, &[0])
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(third.items, vec![4, 0]);
        assert!(!StreamSource::<usize>::can_reach(&reader, 1));
        assert!(StreamSource::<usize>::can_reach(&reader, 3));
    }
}
