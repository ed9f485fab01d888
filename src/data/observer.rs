//! The hook through which a loader tells the rest of training where an epoch stands.

/// Receives the events of every epoch a [`ShardLoader`](super::ShardLoader) iterates, in the
/// order Accelerate's `DataLoaderShard` drives its `GradientState`:
///
/// 1. [`begin`](LoaderObserver::begin) when an iterator is created (Accelerate's
///    `gradient_state._add_dataloader`);
/// 2. [`end_of_dataloader`](LoaderObserver::end_of_dataloader) just before the last batch of
///    the epoch is handed out, so whoever processes that batch already sees the flag (the
///    forced gradient sync of `sync_with_dataloader`, the truncation of
///    `gather_for_metrics`);
/// 3. [`end`](LoaderObserver::end) once the iterator is exhausted *or dropped early*
///    (Accelerate's `_remove_dataloader`, which it skips when a loop breaks out early).
///
/// An empty epoch calls `begin` and `end` only. All methods are called from the thread that
/// iterates, never from a prefetch thread, and must not block for long.
///
/// Set one with [`ShardLoaderBuilder::observer`](super::ShardLoaderBuilder::observer) or
/// [`ShardLoader::with_observer`](super::ShardLoader::with_observer). Slices made with
/// [`DataLoader::slice`](burn::data::dataloader::DataLoader::slice) do not report: they are
/// not the epoch the gradient state tracks.
///
/// ```
/// use std::sync::Mutex;
/// use burn_accelerate::data::LoaderObserver;
///
/// #[derive(Default)]
/// struct Log(Mutex<Vec<String>>);
///
/// impl LoaderObserver for Log {
///     fn begin(&self) {
///         self.0.lock().unwrap().push("begin".into());
///     }
///     fn end_of_dataloader(&self, remainder: Option<usize>) {
///         self.0.lock().unwrap().push(format!("last batch, remainder {remainder:?}"));
///     }
///     fn end(&self) {
///         self.0.lock().unwrap().push("end".into());
///     }
/// }
/// ```
pub trait LoaderObserver: Send + Sync {
    /// An epoch starts: this loader is now the active one.
    fn begin(&self);

    /// The batch about to be handed out is the last of the epoch on this process.
    ///
    /// `remainder` is Accelerate's `GradientState.remainder`: the number of real items in the
    /// last global step when the data does not divide evenly, `Some(0)` when it does, `None`
    /// (Accelerate's `-1`) when nothing is padded because of `drop_last`. See
    /// [`ShardPlan::remainder`](super::shard::ShardPlan::remainder).
    fn end_of_dataloader(&self, remainder: Option<usize>);

    /// The epoch's iterator is finished or gone: this loader is no longer active.
    fn end(&self);
}

/// Reports a loader's epochs to a [`GradientState`](crate::GradientState), as Accelerate's
/// `DataLoaderShard` does: the loader is active while its epoch runs, and the state's
/// `end_of_dataloader` and `remainder` are set just before the last batch is handed out, so
/// the accumulation decision for that batch already forces the sync.
///
/// ```
/// use std::sync::Arc;
/// use burn_accelerate::GradientState;
/// use burn_accelerate::data::{GradientStateObserver, LoaderObserver};
///
/// let state = GradientState::new();
/// let observer = GradientStateObserver::new(state.clone());
/// observer.begin();
/// assert!(state.in_dataloader() && !state.end_of_dataloader());
/// observer.end_of_dataloader(Some(3));
/// assert!(state.end_of_dataloader());
/// assert_eq!(state.remainder(), Some(3));
/// observer.end();
/// assert!(!state.in_dataloader());
/// ```
pub struct GradientStateObserver {
    state: crate::GradientState,
    // One entry per epoch in flight (an evaluation loop may run inside a training epoch):
    // each holds the loader's registration and ends it when popped.
    active: std::sync::Mutex<Vec<crate::ActiveDataLoader>>,
}

impl GradientStateObserver {
    /// An observer reporting to `state` (usually [`GradientState::global`](crate::GradientState::global)).
    pub fn new(state: crate::GradientState) -> Self {
        Self {
            state,
            active: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn active(&self) -> std::sync::MutexGuard<'_, Vec<crate::ActiveDataLoader>> {
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl LoaderObserver for GradientStateObserver {
    fn begin(&self) {
        let loader = self.state.begin_dataloader();
        self.active().push(loader);
    }

    fn end_of_dataloader(&self, remainder: Option<usize>) {
        if let Some(loader) = self.active().last() {
            loader.set_end_of_dataloader(remainder);
        }
    }

    fn end(&self) {
        self.active().pop();
    }
}
