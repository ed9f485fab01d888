//! The bookkeeping of one epoch's iteration, the same for the indexed and the stream
//! loaders: the position it reports to the loader's [`Tracker`] (what a checkpoint saves and
//! a resume restores), the [`LoaderObserver`]'s calls, and closing once: prefetch workers
//! first, then leaving the shared reader, then telling the observer.

use std::sync::Arc;

use super::observer::LoaderObserver;
use super::state::{EpochStart, Tracker};

/// Leaves the shared reader of a dispatched shard (so that it keeps nothing more for it).
pub(crate) type Leave = Box<dyn FnOnce() + Send>;

/// Where one epoch's iteration stands, for the loader it came from.
pub(crate) struct EpochRun {
    tracker: Tracker,
    generation: u64,
    observer: Option<Arc<dyn LoaderObserver>>,
    leave: Option<Leave>,
    completed: bool,
    closed: bool,
}

impl EpochRun {
    /// The run of the epoch `start` began, reporting to `observer` (told at once).
    pub(crate) fn begin(
        tracker: Tracker,
        start: &EpochStart,
        observer: Option<Arc<dyn LoaderObserver>>,
        leave: Option<Leave>,
    ) -> Self {
        if let Some(observer) = &observer {
            observer.begin();
        }
        Self {
            tracker,
            generation: start.generation,
            observer,
            leave,
            completed: false,
            closed: false,
        }
    }

    /// `position` batches of the epoch are behind.
    pub(crate) fn yielded(&self, position: usize) {
        self.tracker.yielded(self.generation, position);
    }

    /// The batch just handed out was the epoch's last: the observer learns the end of the
    /// data loader, and the epoch is complete.
    pub(crate) fn last_batch(&mut self, remainder: Option<usize>) {
        if let Some(observer) = &self.observer {
            observer.end_of_dataloader(remainder);
        }
        self.complete();
    }

    /// The epoch is complete (once): the loader's next epoch starts.
    pub(crate) fn complete(&mut self) {
        if !self.completed {
            self.completed = true;
            self.tracker.complete(self.generation);
        }
    }

    /// Whether the epoch is complete.
    pub(crate) fn is_complete(&self) -> bool {
        self.completed
    }

    /// Whether the run is closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// Closes the run once: `stop_workers` first, so that none asks the shared reader for
    /// more after this shard left it.
    pub(crate) fn close(&mut self, stop_workers: impl FnOnce()) {
        if self.closed {
            return;
        }
        self.closed = true;
        stop_workers();
        if let Some(leave) = self.leave.take() {
            leave();
        }
        if let Some(observer) = &self.observer {
            observer.end();
        }
    }
}
