//! `dispatch_batches`: one reader pulls each global batch and hands every shard its slice.
//!
//! Accelerate's `DataLoaderDispatcher` has process 0 read each global batch and broadcast
//! the slices; here the shards of one builder share one [`Dispatcher`], which reads every
//! global step once, under one lock, and keeps each shard's slice until that shard asks for
//! it. Only this reader touches the dataset, which is the point for storage that tolerates
//! one sequential reader better than many (a network mount, a decoder with a cache).
//!
//! Slices are the [`Sharding::Dispatch`](super::shard::Sharding::Dispatch) batches of
//! [`ShardPlan`]; the dispatcher only decides who reads, not what: a [`StepSource`] reads a
//! step, from an indexed dataset ([`IndexedSource`]) or from a stream
//! ([`StreamSource`](super::stream::StreamSource), which also serves a stream's
//! non-dispatch shards, one dispatcher per shard). Shards consume at their own pace: a shard
//! that runs ahead makes the reader read ahead, and the slices of the others wait for them
//! (so iterate all shards of a builder, in lockstep or not). A shard that comes back for a
//! step the reader has passed reads on its own from there.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::data::dataset::Dataset;

use super::epoch::{Epoch, EpochKey, get};
use super::shard::ShardPlan;

/// Epochs kept at once. Shards drift apart by at most one epoch in normal use; the cap bounds
/// what a shard that is never iterated can hold up.
const MAX_SESSIONS: usize = 3;

/// Where a [`Dispatcher`] reads global steps from: an indexed dataset ([`IndexedSource`]) or
/// a stream ([`StreamSource`](super::stream::StreamSource)). The dispatcher decides who reads
/// and keeps the slices; the source decides what a step holds.
pub(crate) trait StepSource: Send + Sync {
    /// What one process gets of one step.
    type Slice: Send;
    /// The epoch being read, as the shards see it.
    type Epoch;
    /// A reading position in one epoch.
    type Cursor: Send;

    /// Which epoch `epoch` is (shards asking with the same key share a reading).
    fn key(epoch: &Self::Epoch) -> EpochKey;

    /// A cursor whose next step is `first_step`.
    fn open(&self, epoch: &Self::Epoch, first_step: usize) -> Self::Cursor;

    /// Reads `step` (the cursor's next step, or later: steps in between are passed over)
    /// once, and returns the slice of each process in `processes`, in that order.
    fn read_step(
        &self,
        cursor: &mut Self::Cursor,
        epoch: &Self::Epoch,
        step: usize,
        processes: &[usize],
    ) -> Vec<Self::Slice>;

    /// Whether `cursor` can still reach `step` (it is not past it).
    fn can_reach(cursor: &Self::Cursor, step: usize) -> bool;

    /// The last step to read when process 0 asks for `step`: further than `step` where other
    /// processes have steps after process 0's last (so that, when process 0 reads for
    /// everyone, no process waits for a step nobody reads).
    fn read_to(&self, _epoch: &Self::Epoch, step: usize) -> usize {
        step
    }
}

/// The shared reader of one builder's shards, reading from `S` with cursors `C` into slices
/// `T` (`S`'s [`StepSource`] types, spelled out so that holding a dispatcher needs no bounds).
pub(crate) struct Dispatcher<S, C, T> {
    source: S,
    /// Processes that have a loader here; only they get slices.
    registered: Vec<bool>,
    sessions: Mutex<VecDeque<Session<C, T>>>,
}

/// The dispatcher of an indexed dataset.
#[cfg(test)]
pub(crate) type IndexedDispatcher<I> = Dispatcher<IndexedSource<I>, (), Vec<I>>;

/// The reading of one epoch.
struct Session<C, T> {
    key: EpochKey,
    /// The shared cursor.
    cursor: C,
    /// The first step the shared cursor has not read.
    next_step: usize,
    /// Per process: step -> its slice, read but not taken.
    slots: Vec<BTreeMap<usize, T>>,
    /// Per process: its iterator is gone, so nothing more is kept for it.
    left: Vec<bool>,
    /// Per process: its own cursor, once it asked for a step the shared one had passed; the
    /// shared reading then keeps nothing for it.
    alone: Vec<Option<C>>,
}

impl<S: StepSource> Dispatcher<S, S::Cursor, S::Slice> {
    pub(crate) fn new(source: S, registered: Vec<bool>) -> Self {
        Self {
            source,
            registered,
            sessions: Mutex::new(VecDeque::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Session<S::Cursor, S::Slice>>> {
        // A panic while reading leaves at worst a step unread; it is read again on demand.
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Process `process`'s slice of step `step` of `epoch`, reading the global steps up to
    /// it if no shard has yet.
    ///
    /// `first_step` is where the asking shard's epoch began (0, or the batches it skipped):
    /// a request that opens the epoch's reading opens it there, not at `step`, because a
    /// shard's prefetch workers ask concurrently and the first to get here may want a later
    /// step than its neighbour does; opened at `step`, the earlier steps would count as
    /// passed and be read a second time, alone.
    pub(crate) fn take(
        &self,
        process: usize,
        epoch: &S::Epoch,
        step: usize,
        first_step: usize,
    ) -> S::Slice {
        let mut sessions = self.lock();
        let key = S::key(epoch);
        let index = match sessions.iter().position(|s| s.key == key) {
            Some(index) => index,
            None => {
                if sessions.len() == MAX_SESSIONS {
                    sessions.pop_front();
                }
                let np = self.registered.len();
                let first_step = first_step.min(step);
                sessions.push_back(Session {
                    key,
                    cursor: self.source.open(epoch, first_step),
                    next_step: first_step,
                    slots: (0..np).map(|_| BTreeMap::new()).collect(),
                    left: vec![false; np],
                    alone: (0..np).map(|_| None).collect(),
                });
                sessions.len() - 1
            }
        };
        let session = &mut sessions[index];
        if let Some(left) = session.left.get_mut(process) {
            *left = false;
        }
        if let Some(slice) = session.slots.get_mut(process).and_then(|s| s.remove(&step)) {
            return slice;
        }
        let shared = session.alone.get(process).is_some_and(Option::is_none);
        if shared && step >= session.next_step {
            let mut wanted: Vec<usize> = (0..self.registered.len())
                .filter(|&q| self.registered[q] && !session.left[q] && session.alone[q].is_none())
                .collect();
            if !wanted.contains(&process) {
                wanted.push(process);
            }
            for k in session.next_step..=step {
                let slices = self
                    .source
                    .read_step(&mut session.cursor, epoch, k, &wanted);
                for (&q, slice) in wanted.iter().zip(slices) {
                    session.slots[q].insert(k, slice);
                }
            }
            session.next_step = step + 1;
            if let Some(slice) = session.slots.get_mut(process).and_then(|s| s.remove(&step)) {
                return slice;
            }
        }
        // A step read before this shard (re)joined the epoch: from now on it reads alone,
        // and nothing more is kept for it in the shared reading.
        if let Some(slots) = session.slots.get_mut(process) {
            slots.clear();
        }
        let own = session
            .alone
            .get_mut(process)
            .and_then(Option::take)
            .filter(|cursor| S::can_reach(cursor, step));
        let mut cursor = own.unwrap_or_else(|| self.source.open(epoch, step));
        let slice = self
            .source
            .read_step(&mut cursor, epoch, step, &[process])
            .pop();
        if let Some(alone) = session.alone.get_mut(process) {
            *alone = Some(cursor);
        }
        slice.unwrap_or_else(|| unreachable!("read_step returns one slice per process asked"))
    }

    /// Process `process` is done with `key`'s epoch (finished or dropped its iterator).
    pub(crate) fn leave(&self, process: usize, key: EpochKey) {
        let mut sessions = self.lock();
        let Some(index) = sessions.iter().position(|s| s.key == key) else {
            return;
        };
        let session = &mut sessions[index];
        if let (Some(left), Some(slots), Some(alone)) = (
            session.left.get_mut(process),
            session.slots.get_mut(process),
            session.alone.get_mut(process),
        ) {
            *left = true;
            slots.clear();
            *alone = None;
        }
        let done = (0..self.registered.len()).all(|q| !self.registered[q] || session.left[q]);
        if done {
            sessions.remove(index);
        }
    }

    /// Slices read but not yet taken, over all epochs (for tests of the memory bound).
    #[cfg(test)]
    pub(crate) fn buffered(&self) -> usize {
        self.lock()
            .iter()
            .flat_map(|s| s.slots.iter())
            .map(BTreeMap::len)
            .sum()
    }
}

/// Where a dispatched shard's slices come from: the shards of one process share a
/// [`Dispatcher`]; across processes, [`ProcessDispatch`](super::process_dispatch::ProcessDispatch)
/// has process 0 read and send. `E` is the epoch as the source sees it, `T` a slice.
pub(crate) trait Dispatch<E, T>: Send + Sync {
    /// Process `process`'s slice of step `step` of `epoch` (see [`Dispatcher::take`]);
    /// `None` when it cannot come (a batch sent by process 0 that does not decode): the
    /// epoch ends there, and the reason is the process group's next error (Burn's batch
    /// iterator has no error channel).
    fn take(&self, process: usize, epoch: &E, step: usize, first_step: usize) -> Option<T>;

    /// Process `process` is done with `key`'s epoch.
    fn leave(&self, process: usize, key: EpochKey);
}

impl<S: StepSource> Dispatch<S::Epoch, S::Slice> for Dispatcher<S, S::Cursor, S::Slice>
where
    S::Cursor: Send,
    S::Slice: Send,
{
    fn take(
        &self,
        process: usize,
        epoch: &S::Epoch,
        step: usize,
        first_step: usize,
    ) -> Option<S::Slice> {
        Some(Dispatcher::take(self, process, epoch, step, first_step))
    }

    fn leave(&self, process: usize, key: EpochKey) {
        Dispatcher::leave(self, process, key);
    }
}

/// Steps of an indexed dataset: any step can be read directly, so a cursor is only a
/// position.
pub(crate) struct IndexedSource<I> {
    dataset: Arc<dyn Dataset<I>>,
    /// Every process's plan (same dataset and flags, its own index).
    plans: Vec<ShardPlan>,
}

impl<I> IndexedSource<I> {
    pub(crate) fn new(dataset: Arc<dyn Dataset<I>>, plans: Vec<ShardPlan>) -> Self {
        Self { dataset, plans }
    }
}

impl<I: Clone + Send> StepSource for IndexedSource<I> {
    type Slice = Vec<I>;
    type Epoch = Epoch;
    type Cursor = ();

    fn key(epoch: &Epoch) -> EpochKey {
        epoch.key()
    }

    fn open(&self, _epoch: &Epoch, _first_step: usize) {}

    fn read_step(
        &self,
        _cursor: &mut (),
        epoch: &Epoch,
        step: usize,
        processes: &[usize],
    ) -> Vec<Vec<I>> {
        let wanted: Vec<Vec<usize>> = processes
            .iter()
            .map(|&q| {
                self.plans
                    .get(q)
                    .and_then(|p| p.batch(step))
                    .unwrap_or_default()
            })
            .collect();
        // Positions are read once each, in order; only the padded tail repeats one. Each
        // item is cloned only for its repeats and moved into its last slice.
        let mut read: BTreeMap<usize, (Option<I>, usize)> = BTreeMap::new();
        for positions in &wanted {
            for &position in positions {
                read.entry(position).or_insert((None, 0)).1 += 1;
            }
        }
        for (position, (item, _)) in &mut read {
            *item = get(self.dataset.as_ref(), epoch.index(*position));
        }
        wanted
            .into_iter()
            .map(|positions| {
                positions
                    .iter()
                    .filter_map(|p| {
                        let (item, uses) = read.get_mut(p)?;
                        *uses -= 1;
                        if *uses == 0 {
                            item.take()
                        } else {
                            item.clone()
                        }
                    })
                    .collect()
            })
            .collect()
    }

    fn can_reach(_cursor: &(), _step: usize) -> bool {
        true
    }

    fn read_to(&self, _epoch: &Epoch, step: usize) -> usize {
        let batches = |p: usize| self.plans.get(p).map_or(0, ShardPlan::num_batches);
        if step + 1 >= batches(0) {
            let most = (0..self.plans.len()).map(batches).max().unwrap_or(0);
            step.max(most.saturating_sub(1))
        } else {
            step
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::data::shard::{ShardOptions, ShardSpec, Sharding};

    struct Counting {
        len: usize,
        reads: AtomicUsize,
    }

    impl Dataset<usize> for Counting {
        fn get(&self, index: usize) -> Option<usize> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            (index < self.len).then_some(index)
        }
        fn len(&self) -> usize {
            self.len
        }
    }

    type Hub = IndexedDispatcher<usize>;

    fn setup(n: usize, np: usize, bs: usize) -> (Arc<Counting>, Hub, Vec<Epoch>) {
        let data = Arc::new(Counting {
            len: n,
            reads: AtomicUsize::new(0),
        });
        let plans: Vec<ShardPlan> = (0..np)
            .map(|p| {
                let spec = ShardSpec::new(ShardOptions {
                    num_processes: np,
                    process_index: p,
                    batch_size: bs,
                    ..ShardOptions::default()
                })
                .unwrap();
                ShardPlan::new(n, &spec, Sharding::Dispatch).unwrap()
            })
            .collect();
        let epochs = plans
            .iter()
            .map(|&plan| Epoch::new(plan, None, None, (0, None)))
            .collect();
        let hub = Dispatcher::new(IndexedSource::new(data.clone(), plans), vec![true; np]);
        (data, hub, epochs)
    }

    #[test]
    fn every_item_is_read_once_and_slices_match_the_plan() {
        // 5 items, batch 2, 2 processes: [[0,1],[4]] and [[2,3],[0]]; item 0 is the padding.
        let (data, hub, epochs) = setup(5, 2, 2);
        let mut got = vec![vec![], vec![]];
        for step in 0..2 {
            for p in [1, 0] {
                got[p].push(hub.take(p, &epochs[p], step, 0));
            }
        }
        assert_eq!(
            got,
            vec![vec![vec![0, 1], vec![4]], vec![vec![2, 3], vec![0]]]
        );
        assert_eq!(data.reads.load(Ordering::Relaxed), 5 + 1);
        assert_eq!(hub.buffered(), 0);
        hub.leave(0, (0, None));
        hub.leave(1, (0, None));
        assert!(hub.lock().is_empty());
    }

    // Two prefetch workers of one shard: the one with step 1 gets the lock first.
    #[test]
    fn steps_asked_out_of_order_from_the_epochs_start_are_read_once() {
        let (data, hub, epochs) = setup(12, 3, 2);
        assert_eq!(hub.take(0, &epochs[0], 1, 0), vec![6, 7]);
        assert_eq!(hub.take(0, &epochs[0], 0, 0), vec![0, 1]);
        for (p, epoch) in epochs.iter().enumerate().skip(1) {
            for step in 0..2 {
                hub.take(p, epoch, step, 0);
            }
        }
        assert_eq!(data.reads.load(Ordering::Relaxed), 12);
        assert_eq!(hub.buffered(), 0);

        // A resumed shard opens the reading where it resumes: nothing before is read.
        let (data, hub, epochs) = setup(12, 3, 2);
        assert_eq!(hub.take(1, &epochs[1], 1, 1), vec![8, 9]);
        assert_eq!(data.reads.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn a_shard_that_left_gets_nothing_kept_and_can_rejoin() {
        let (data, hub, epochs) = setup(12, 3, 2);
        assert_eq!(hub.take(0, &epochs[0], 0, 0), vec![0, 1]);
        hub.leave(2, (0, None));
        assert_eq!(hub.take(0, &epochs[0], 1, 0), vec![6, 7]);
        // Process 1 still has two slices waiting; process 2 none.
        assert_eq!(hub.buffered(), 2);
        // Process 2 comes back for a step already read: read alone.
        assert_eq!(hub.take(2, &epochs[2], 0, 0), vec![4, 5]);
        // Step 0 whole (6), step 1 without process 2's part (4), its step 0 again (2).
        assert_eq!(data.reads.load(Ordering::Relaxed), 6 + 4 + 2);
    }

    #[test]
    fn sessions_are_capped() {
        let (_, hub, epochs) = setup(8, 2, 2);
        for e in 0..10 {
            let epoch = Epoch::new(*epochs[0].plan(), None, None, (e, None));
            hub.take(0, &epoch, 0, 0);
        }
        assert_eq!(hub.lock().len(), MAX_SESSIONS);
        assert_eq!(
            hub.buffered(),
            MAX_SESSIONS,
            "one waiting slice of process 1 per epoch"
        );
    }
}
