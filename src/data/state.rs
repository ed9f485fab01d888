//! Where a loader is in its epochs: the checkpointable state, and its live tracking.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use super::error::DataLoaderError;
use super::shard::{epoch_seed, splitmix_next};

/// What to save with a checkpoint so a restarted run sees exactly the batches an
/// uninterrupted one would: the epoch, how many of its batches are behind, and the seeds.
///
/// Get it with [`ShardLoader::state`](super::ShardLoader::state), restore it with
/// [`ShardLoader::load_state`](super::ShardLoader::load_state). Each process saves its own
/// (they agree on everything but the position under `even_batches = false`).
///
/// ```
/// use burn_accelerate::data::LoaderState;
///
/// let json = r#"{"epoch": 3, "position": 17, "seed": 42}"#;
/// let state: LoaderState = serde_json::from_str(json)?;
/// assert_eq!((state.epoch, state.position, state.seed), (3, 17, 42));
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LoaderState {
    /// The epoch in progress (or about to start when `position` is 0).
    pub epoch: u64,
    /// Batches of `epoch` already handed out on this process; the next iterator starts after
    /// them. Returns to 0 as soon as the last batch of an epoch is handed out.
    pub position: usize,
    /// The base seed of the shuffled order (`data_seed`, or the one drawn for it).
    pub seed: u64,
    /// The generator of the non-seedable sampler, which advances once per epoch.
    #[serde(default)]
    sampler_rng: u64,
    /// The seed of the order of the epoch in progress, once drawn.
    #[serde(default)]
    order_seed: Option<u64>,
}

impl LoaderState {
    fn fresh(seed: u64) -> Self {
        Self {
            epoch: 0,
            position: 0,
            seed,
            sampler_rng: seed,
            order_seed: None,
        }
    }

    fn advance(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        self.position = 0;
        self.order_seed = None;
    }
}

/// What an iterator starting an epoch needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EpochStart {
    /// Identifies the iterator; a stale one cannot move the state.
    pub(crate) generation: u64,
    pub(crate) epoch: u64,
    /// The first batch to yield (a pending resume or skip).
    pub(crate) start: usize,
    /// Seed of the epoch's permutation, `None` for the sequential order.
    pub(crate) order_seed: Option<u64>,
}

#[derive(Debug)]
struct Tracked {
    state: LoaderState,
    /// Batches the next iterator skips (a restored position or `skip_first_batches`).
    pending_skip: Option<usize>,
    generation: u64,
}

/// The live state of one loader, shared by its `to_device` copies so that the handle a user
/// keeps sees what the copy a trainer iterates does.
#[derive(Debug, Clone)]
pub(crate) struct Tracker(Arc<Mutex<Tracked>>);

impl Tracker {
    pub(crate) fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(Tracked {
            state: LoaderState::fresh(seed),
            pending_skip: None,
            generation: 0,
        })))
    }

    /// An independent tracker at the same epoch, for a slice.
    pub(crate) fn fork(&self) -> Self {
        let mut state = self.lock().state;
        state.position = 0;
        Self(Arc::new(Mutex::new(Tracked {
            state,
            pending_skip: None,
            generation: 0,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Tracked> {
        // The data is plain numbers, valid whatever panicked while it was held.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts an epoch of `num_batches` batches; the newest iterator owns the state.
    pub(crate) fn begin(&self, shuffle: bool, seedable: bool, num_batches: usize) -> EpochStart {
        let mut tracked = self.lock();
        tracked.generation = tracked.generation.wrapping_add(1);
        let generation = tracked.generation;
        let start = tracked.pending_skip.take().unwrap_or(0).min(num_batches);
        let state = &mut tracked.state;
        state.position = start;
        state.order_seed = if !shuffle {
            None
        } else if seedable {
            Some(epoch_seed(state.seed, state.epoch))
        } else {
            // Drawn once per epoch and kept until it completes, so restarting an interrupted
            // epoch (or restoring it) sees the same order.
            Some(match state.order_seed {
                Some(seed) => seed,
                None => splitmix_next(&mut state.sampler_rng),
            })
        };
        EpochStart {
            generation,
            epoch: state.epoch,
            start,
            order_seed: state.order_seed,
        }
    }

    /// `position` batches of the epoch are behind.
    pub(crate) fn yielded(&self, generation: u64, position: usize) {
        let mut tracked = self.lock();
        if tracked.generation == generation {
            tracked.state.position = position;
        }
    }

    /// The epoch is complete: the next one starts from its first batch.
    pub(crate) fn complete(&self, generation: u64) {
        let mut tracked = self.lock();
        if tracked.generation == generation {
            tracked.state.advance();
        }
    }

    pub(crate) fn state(&self) -> LoaderState {
        self.lock().state
    }

    pub(crate) fn load(
        &self,
        state: LoaderState,
        num_batches: usize,
    ) -> Result<(), DataLoaderError> {
        if state.position > num_batches {
            return Err(DataLoaderError::ResumePastEnd {
                position: state.position,
                num_batches,
            });
        }
        let mut tracked = self.lock();
        tracked.state = state;
        tracked.pending_skip = (state.position > 0).then_some(state.position);
        // Iterators still running belong to the abandoned timeline.
        tracked.generation = tracked.generation.wrapping_add(1);
        Ok(())
    }

    pub(crate) fn set_epoch(&self, epoch: u64) {
        let mut tracked = self.lock();
        // Like Accelerate, only a change of epoch resets anything, so calling it with the
        // epoch just restored keeps the restored position and order.
        if tracked.state.epoch != epoch {
            tracked.state.epoch = epoch;
            tracked.state.position = 0;
            tracked.state.order_seed = None;
        }
    }

    pub(crate) fn skip_first_batches(&self, num_batches: usize) {
        self.lock().pending_skip = Some(num_batches);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_advance_and_stale_iterators_are_ignored() {
        let t = Tracker::new(5);
        let a = t.begin(true, true, 3);
        assert_eq!((a.epoch, a.start, a.order_seed), (0, 0, Some(5)));
        t.yielded(a.generation, 2);
        assert_eq!(t.state().position, 2);
        let b = t.begin(true, true, 3);
        t.yielded(a.generation, 3);
        assert_eq!(t.state().position, 0, "the older iterator no longer counts");
        t.complete(b.generation);
        assert_eq!((t.state().epoch, t.state().position), (1, 0));
        assert_eq!(t.begin(true, true, 3).order_seed, Some(6));
    }

    #[test]
    fn non_seedable_order_is_drawn_once_per_epoch_and_restored() {
        let t = Tracker::new(9);
        let first = t.begin(true, false, 4).order_seed;
        assert_eq!(
            t.begin(true, false, 4).order_seed,
            first,
            "same epoch, same order"
        );
        let g = t.begin(true, false, 4).generation;
        t.yielded(g, 1);
        let saved = t.state();
        t.complete(g);
        let second = t.begin(true, false, 4).order_seed;
        assert_ne!(first, second);
        let restored = Tracker::new(0);
        restored.load(saved, 4).unwrap();
        let again = restored.begin(true, false, 4);
        assert_eq!((again.order_seed, again.start), (first, 1));
        restored.complete(again.generation);
        assert_eq!(restored.begin(true, false, 4).order_seed, second);
    }

    #[test]
    fn restore_checks_the_position() {
        let t = Tracker::new(0);
        let mut state = t.state();
        state.position = 5;
        assert_eq!(
            t.load(state, 4),
            Err(DataLoaderError::ResumePastEnd {
                position: 5,
                num_batches: 4
            })
        );
        t.load(state, 5).unwrap();
        t.set_epoch(0);
        assert_eq!(
            t.begin(false, false, 5).start,
            5,
            "same epoch keeps the resume"
        );
        t.skip_first_batches(2);
        t.set_epoch(1);
        assert_eq!(t.begin(false, false, 5).start, 2);
    }

    #[test]
    fn state_round_trips_through_json() {
        let t = Tracker::new(3);
        let g = t.begin(true, false, 10).generation;
        t.yielded(g, 4);
        let state = t.state();
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(serde_json::from_str::<LoaderState>(&json).unwrap(), state);
    }
}
