//! `dispatch_batches`: one reader pulls each global batch and hands every shard its slice.
//!
//! Accelerate's `DataLoaderDispatcher` has process 0 read each global batch and broadcast
//! the slices; here the shards of one builder share one [`Dispatcher`], which reads every
//! global step once, under one lock, and keeps each shard's slice until that shard asks for
//! it. Only this reader touches the dataset, which is the point for storage that tolerates
//! one sequential reader better than many (a network mount, a decoder with a cache).
//!
//! Slices are the [`Sharding::Dispatch`](super::shard::Sharding::Dispatch) batches of
//! [`ShardPlan`]; the dispatcher only decides who reads, not what. Shards consume at their
//! own pace: a shard that runs ahead makes the reader read ahead, and the slices of the
//! others wait for them (so iterate all shards of a builder, in lockstep or not).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::data::dataset::Dataset;

use super::epoch::{Epoch, EpochKey, get};
use super::shard::ShardPlan;

/// Epochs kept at once. Shards drift apart by at most one epoch in normal use; the cap bounds
/// what a shard that is never iterated can hold up.
const MAX_SESSIONS: usize = 3;

/// The shared reader of one builder's shards.
pub(crate) struct Dispatcher<I> {
    dataset: Arc<dyn Dataset<I>>,
    /// Every process's plan (same dataset and flags, its own index).
    plans: Vec<ShardPlan>,
    /// Processes that have a loader here; only they get slices.
    registered: Vec<bool>,
    sessions: Mutex<VecDeque<Session<I>>>,
}

/// The reading of one epoch.
struct Session<I> {
    key: EpochKey,
    /// The first step not read yet.
    next_step: usize,
    /// Per process: step -> its slice, read but not taken.
    slots: Vec<BTreeMap<usize, Vec<I>>>,
    /// Per process: its iterator is gone, so nothing more is kept for it.
    left: Vec<bool>,
}

impl<I: Clone + Send> Dispatcher<I> {
    pub(crate) fn new(
        dataset: Arc<dyn Dataset<I>>,
        plans: Vec<ShardPlan>,
        registered: Vec<bool>,
    ) -> Self {
        Self {
            dataset,
            plans,
            registered,
            sessions: Mutex::new(VecDeque::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Session<I>>> {
        // A panic while reading leaves at worst a step unread; it is read again on demand.
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Process `process`'s batch `step` of `epoch`, reading the global steps up to it if no
    /// shard has yet.
    pub(crate) fn take(&self, process: usize, epoch: &Epoch, step: usize) -> Vec<I> {
        let mut sessions = self.lock();
        let key = epoch.key();
        let index = match sessions.iter().position(|s| s.key == key) {
            Some(index) => index,
            None => {
                if sessions.len() == MAX_SESSIONS {
                    sessions.pop_front();
                }
                let np = self.plans.len();
                sessions.push_back(Session {
                    key,
                    next_step: step,
                    slots: (0..np).map(|_| BTreeMap::new()).collect(),
                    left: vec![false; np],
                });
                sessions.len() - 1
            }
        };
        let session = &mut sessions[index];
        if let Some(left) = session.left.get_mut(process) {
            *left = false;
        }
        if let Some(items) = session.slots.get_mut(process).and_then(|s| s.remove(&step)) {
            return items;
        }
        if step >= session.next_step {
            for k in session.next_step..=step {
                self.read_step(session, epoch, k);
            }
            session.next_step = step + 1;
            return session
                .slots
                .get_mut(process)
                .and_then(|s| s.remove(&step))
                .unwrap_or_default();
        }
        // A step read before this shard (re)joined the epoch: read its slice alone.
        drop(sessions);
        self.plans
            .get(process)
            .and_then(|plan| plan.batch(step))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|position| get(self.dataset.as_ref(), epoch.index(position)))
            .collect()
    }

    /// Reads global step `step` once and files every waiting shard's slice.
    fn read_step(&self, session: &mut Session<I>, epoch: &Epoch, step: usize) {
        let wanted: Vec<(usize, Vec<usize>)> = (0..self.plans.len())
            .filter(|&q| self.registered[q] && !session.left[q])
            .map(|q| (q, self.plans[q].batch(step).unwrap_or_default()))
            .collect();
        // Positions are read once each, in order; only the padded tail repeats one. Each
        // item is cloned only for its repeats and moved into its last slice.
        let mut read: BTreeMap<usize, (Option<I>, usize)> = BTreeMap::new();
        for (_, positions) in &wanted {
            for &position in positions {
                read.entry(position).or_insert((None, 0)).1 += 1;
            }
        }
        for (position, (item, _)) in &mut read {
            *item = get(self.dataset.as_ref(), epoch.index(*position));
        }
        for (q, positions) in wanted {
            let slice = positions
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
                .collect();
            session.slots[q].insert(step, slice);
        }
    }

    /// Process `process` is done with `key`'s epoch (finished or dropped its iterator).
    pub(crate) fn leave(&self, process: usize, key: EpochKey) {
        let mut sessions = self.lock();
        let Some(index) = sessions.iter().position(|s| s.key == key) else {
            return;
        };
        let session = &mut sessions[index];
        if let (Some(left), Some(slots)) = (
            session.left.get_mut(process),
            session.slots.get_mut(process),
        ) {
            *left = true;
            slots.clear();
        }
        let done = (0..self.plans.len()).all(|q| !self.registered[q] || session.left[q]);
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

    fn setup(n: usize, np: usize, bs: usize) -> (Arc<Counting>, Dispatcher<usize>, Vec<Epoch>) {
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
        let hub = Dispatcher::new(data.clone(), plans, vec![true; np]);
        (data, hub, epochs)
    }

    #[test]
    fn every_item_is_read_once_and_slices_match_the_plan() {
        // 5 items, batch 2, 2 processes: [[0,1],[4]] and [[2,3],[0]]; item 0 is the padding.
        let (data, hub, epochs) = setup(5, 2, 2);
        let mut got = vec![vec![], vec![]];
        for step in 0..2 {
            for p in [1, 0] {
                got[p].push(hub.take(p, &epochs[p], step));
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

    #[test]
    fn a_shard_that_left_gets_nothing_kept_and_can_rejoin() {
        let (data, hub, epochs) = setup(12, 3, 2);
        assert_eq!(hub.take(0, &epochs[0], 0), vec![0, 1]);
        hub.leave(2, (0, None));
        assert_eq!(hub.take(0, &epochs[0], 1), vec![6, 7]);
        // Process 1 still has two slices waiting; process 2 none.
        assert_eq!(hub.buffered(), 2);
        // Process 2 comes back for a step already read: read alone.
        assert_eq!(hub.take(2, &epochs[2], 0), vec![4, 5]);
        // Step 0 whole (6), step 1 without process 2's part (4), its step 0 again (2).
        assert_eq!(data.reads.load(Ordering::Relaxed), 6 + 4 + 2);
    }

    #[test]
    fn sessions_are_capped() {
        let (_, hub, epochs) = setup(8, 2, 2);
        for e in 0..10 {
            let epoch = Epoch::new(*epochs[0].plan(), None, None, (e, None));
            hub.take(0, &epoch, 0);
        }
        assert_eq!(hub.lock().len(), MAX_SESSIONS);
        assert_eq!(
            hub.buffered(),
            MAX_SESSIONS,
            "one waiting slice of process 1 per epoch"
        );
    }
}
