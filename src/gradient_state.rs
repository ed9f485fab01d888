//! Accelerate's `GradientState`: whether this batch's gradients complete an accumulation
//! window (`sync_gradients`), where the data loader is, and the accumulation counter.
//!
//! Accelerate keeps this in a process-wide singleton so that its data loaders and its
//! `Accelerator` can talk without being wired together. Here it is a cheap cloneable handle
//! ([`GradientState`]) on shared, mutex-guarded state: [`GradientState::global`] is the
//! process-wide one (what an [`Accelerator`](crate::Accelerator) and the crate's data loaders
//! use unless given another), [`GradientState::new`] an independent one (two unrelated
//! training loops in one process, or tests).
//!
//! The two sides of the conversation:
//! - a data loader calls [`begin_dataloader`](GradientState::begin_dataloader) when it starts
//!   an epoch and keeps the returned [`ActiveDataLoader`] while it iterates; before yielding
//!   its last batch it calls [`set_end_of_dataloader`](ActiveDataLoader::set_end_of_dataloader);
//!   dropping the guard ends the epoch;
//! - the training loop enters [`accumulate`](GradientState::accumulate) once per batch (the
//!   Rust form of `with accelerator.accumulate(model):`), which decides whether this batch
//!   syncs.
//!
//! ```
//! use burn_accelerate::GradientState;
//!
//! let state = GradientState::new();
//! state.configure(2, true)?; // accumulate over 2 batches, always sync at the loader's end
//! let loader = state.begin_dataloader();
//! let mut syncs = Vec::new();
//! for batch in 0..3 {
//!     if batch == 2 {
//!         loader.set_end_of_dataloader(None);
//!     }
//!     let step = state.accumulate();
//!     syncs.push(step.sync_gradients());
//! }
//! assert_eq!(syncs, [false, true, true]); // the short last window still syncs
//! # Ok::<(), burn_accelerate::AccelerateError>(())
//! ```

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use serde::{Deserialize, Serialize};

use crate::AccelerateError;

/// A handle on gradient-synchronisation state; clones share it, across threads.
#[derive(Debug, Clone, Default)]
pub struct GradientState {
    shared: Arc<Mutex<Shared>>,
}

#[derive(Debug)]
struct Shared {
    num_steps: usize,
    sync_with_dataloader: bool,
    sync_gradients: bool,
    step: usize,
    window_batches: usize,
    loaders: Vec<LoaderSlot>,
    next_loader_id: u64,
    open_accumulates: usize,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            num_steps: 1,
            sync_with_dataloader: true,
            sync_gradients: true,
            step: 0,
            window_batches: 0,
            loaders: Vec::new(),
            next_loader_id: 0,
            open_accumulates: 0,
        }
    }
}

#[derive(Debug)]
struct LoaderSlot {
    id: u64,
    end_of_dataloader: bool,
    remainder: Option<usize>,
}

impl Shared {
    fn active(&self) -> Option<&LoaderSlot> {
        self.loaders.last()
    }
}

impl GradientState {
    /// An independent state with Accelerate's defaults: no accumulation (1 step), sync at
    /// the end of each data loader, `sync_gradients` true.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide state (Accelerate's singleton).
    pub fn global() -> Self {
        static GLOBAL: OnceLock<GradientState> = OnceLock::new();
        GLOBAL.get_or_init(GradientState::new).clone()
    }

    /// Whether `self` and `other` are handles on the same state.
    pub fn same_as(&self, other: &GradientState) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // The state is a few integers updated in one go: a panic elsewhere cannot leave it
        // half-written, so a poisoned lock is still good.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the accumulation window (`num_steps` batches per optimizer step) and whether the
    /// last batch of a data loader always closes a window. The counter and flags are kept.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for zero steps.
    pub fn configure(
        &self,
        num_steps: usize,
        sync_with_dataloader: bool,
    ) -> Result<(), AccelerateError> {
        check_num_steps(num_steps)?;
        let mut s = self.lock();
        s.num_steps = num_steps;
        s.sync_with_dataloader = sync_with_dataloader;
        Ok(())
    }

    /// Whether the current batch completes a window: the optimizer steps and the gradients
    /// are cleared after it. The latest decision made by [`accumulate`](Self::accumulate)
    /// on any thread; true before the first one.
    pub fn sync_gradients(&self) -> bool {
        self.lock().sync_gradients
    }

    /// Batches per accumulation window.
    pub fn num_steps(&self) -> usize {
        self.lock().num_steps
    }

    /// Whether the last batch of a data loader always closes a window.
    pub fn sync_with_dataloader(&self) -> bool {
        self.lock().sync_with_dataloader
    }

    /// Accelerate's `Accelerator.step`: batches counted towards the current window, reset to 0
    /// by a data loader's last batch when [`sync_with_dataloader`](Self::sync_with_dataloader).
    pub fn step(&self) -> usize {
        self.lock().step
    }

    /// Batches in the current window so far, the current one included (0 before the first
    /// [`accumulate`](Self::accumulate)). Shorter than [`num_steps`](Self::num_steps) at a sync
    /// only for a data loader's last, partial window.
    pub fn window_batches(&self) -> usize {
        self.lock().window_batches
    }

    /// Whether the active data loader is about to yield, or has yielded, its last batch
    /// (false outside a data loader).
    pub fn end_of_dataloader(&self) -> bool {
        self.lock().active().is_some_and(|l| l.end_of_dataloader)
    }

    /// The active data loader's remainder: how many samples its last global batch holds when
    /// the dataset does not divide evenly (what `gather_for_metrics` uses to drop padding).
    /// `None` outside a data loader or where the loader did not say (Accelerate's -1).
    pub fn remainder(&self) -> Option<usize> {
        self.lock().active().and_then(|l| l.remainder)
    }

    /// Whether some data loader is iterating.
    pub fn in_dataloader(&self) -> bool {
        !self.lock().loaders.is_empty()
    }

    /// How many data loaders are iterating (nested ones, e.g. an evaluation loop inside a
    /// training epoch, count each; the innermost is the active one).
    pub fn active_dataloaders(&self) -> usize {
        self.lock().loaders.len()
    }

    /// How many [`Accumulate`] guards are alive, on all threads.
    pub fn open_accumulates(&self) -> usize {
        self.lock().open_accumulates
    }

    /// Registers a data loader that starts iterating; it becomes the active one until its
    /// guard drops (Accelerate's `_add_dataloader` / `_remove_dataloader`).
    #[must_use = "the data loader is only active while the guard lives"]
    pub fn begin_dataloader(&self) -> ActiveDataLoader {
        let mut s = self.lock();
        let id = s.next_loader_id;
        s.next_loader_id += 1;
        s.loaders.push(LoaderSlot {
            id,
            end_of_dataloader: false,
            remainder: None,
        });
        ActiveDataLoader {
            state: self.clone(),
            id,
        }
    }

    /// Decides whether this batch syncs (Accelerate's `_do_sync`) and returns the guard for
    /// the batch, the Rust form of `with accelerator.accumulate(model):`.
    ///
    /// With [`sync_with_dataloader`](Self::sync_with_dataloader) the active loader's last
    /// batch always syncs and resets the counter; otherwise a batch syncs when the counter
    /// reaches a multiple of [`num_steps`](Self::num_steps), and windows run on across
    /// epochs.
    ///
    /// Each call takes the next counter value atomically: from several threads at once,
    /// every guard gets its own decision ([`Accumulate::sync_gradients`]) and exactly one in
    /// `num_steps` syncs.
    #[must_use = "the accumulate guard marks the batch; keep it for the batch's backward and step"]
    pub fn accumulate(&self) -> Accumulate {
        let mut s = self.lock();
        let window_closed = s.sync_gradients;
        let sync = if s.sync_with_dataloader && s.active().is_some_and(|l| l.end_of_dataloader) {
            s.step = 0;
            true
        } else {
            s.step += 1;
            s.step.is_multiple_of(s.num_steps)
        };
        s.sync_gradients = sync;
        s.window_batches = if window_closed {
            1
        } else {
            s.window_batches + 1
        };
        s.open_accumulates += 1;
        Accumulate {
            state: self.clone(),
            sync_gradients: sync,
            window_batches: s.window_batches,
        }
    }

    /// What a checkpoint needs to resume the accumulation pattern exactly.
    pub fn snapshot(&self) -> GradientStateSnapshot {
        let s = self.lock();
        GradientStateSnapshot {
            num_steps: s.num_steps,
            sync_with_dataloader: s.sync_with_dataloader,
            sync_gradients: s.sync_gradients,
            step: s.step,
            window_batches: s.window_batches,
        }
    }

    /// Restores a [`snapshot`](Self::snapshot). Active data loaders are not part of it: a
    /// resumed loader registers itself again.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for a snapshot with zero steps, or a counter past
    /// [`MAX_SAVED_COUNT`] (no run counts that far: the snapshot is damaged).
    pub fn restore(&self, snapshot: &GradientStateSnapshot) -> Result<(), AccelerateError> {
        check_num_steps(snapshot.num_steps)?;
        for (field, count) in [
            ("gradient_state.step", snapshot.step),
            ("gradient_state.window_batches", snapshot.window_batches),
        ] {
            if count > MAX_SAVED_COUNT {
                return Err(AccelerateError::InvalidConfig {
                    field,
                    value: count.to_string(),
                    fix: "a saved batch counter is below 2^63 (usize::MAX / 2): the checkpoint \
                          is damaged; resume from another or start afresh",
                });
            }
        }
        let mut s = self.lock();
        s.num_steps = snapshot.num_steps;
        s.sync_with_dataloader = snapshot.sync_with_dataloader;
        s.sync_gradients = snapshot.sync_gradients;
        s.step = snapshot.step;
        s.window_batches = snapshot.window_batches;
        Ok(())
    }
}

/// The largest batch counter ([`GradientStateSnapshot::step`], `window_batches`) a restored
/// snapshot may hold: a run adds one per batch, so one this large is a damaged checkpoint, and
/// the counting would overflow.
pub const MAX_SAVED_COUNT: usize = usize::MAX / 2;

fn check_num_steps(num_steps: usize) -> Result<(), AccelerateError> {
    if num_steps == 0 {
        return Err(AccelerateError::InvalidConfig {
            field: "gradient_accumulation_steps",
            value: "0".into(),
            fix: "set at least 1 (1 means no accumulation: the optimizer steps every batch)",
        });
    }
    Ok(())
}

/// The serialisable part of a [`GradientState`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GradientStateSnapshot {
    /// Batches per accumulation window.
    pub num_steps: usize,
    /// Whether a data loader's last batch always syncs.
    pub sync_with_dataloader: bool,
    /// The last sync decision.
    pub sync_gradients: bool,
    /// The accumulation counter.
    pub step: usize,
    /// Batches in the current window.
    pub window_batches: usize,
}

/// One batch inside `accelerator.accumulate(model)`: holds this batch's sync decision.
///
/// Dropping it ends the batch's scope; the decision stays in force for
/// [`GradientState::sync_gradients`] until the next batch decides, as in Accelerate, where
/// `sync_gradients` outlives the `with` block. It can be sent to another thread.
#[derive(Debug)]
pub struct Accumulate {
    state: GradientState,
    sync_gradients: bool,
    window_batches: usize,
}

impl Accumulate {
    /// Whether this batch completes its window (the optimizer steps after it).
    pub fn sync_gradients(&self) -> bool {
        self.sync_gradients
    }

    /// Batches in this batch's window so far, this one included.
    pub fn window_batches(&self) -> usize {
        self.window_batches
    }

    /// The state this guard belongs to.
    pub fn gradient_state(&self) -> &GradientState {
        &self.state
    }
}

impl Drop for Accumulate {
    fn drop(&mut self) {
        self.state.lock().open_accumulates -= 1;
    }
}

/// A data loader registered with a [`GradientState`] while it iterates; dropping it (or
/// [`end`](ActiveDataLoader::end)) unregisters it.
#[derive(Debug)]
pub struct ActiveDataLoader {
    state: GradientState,
    id: u64,
}

impl ActiveDataLoader {
    /// Marks the batch about to be yielded as this loader's last; `remainder` is how many
    /// samples the last global batch holds if the dataset did not divide evenly.
    ///
    /// Call it before the training loop enters [`GradientState::accumulate`] for that batch
    /// (Accelerate's loader looks one batch ahead for the same reason).
    pub fn set_end_of_dataloader(&self, remainder: Option<usize>) {
        let mut s = self.state.lock();
        if let Some(slot) = s.loaders.iter_mut().find(|l| l.id == self.id) {
            slot.end_of_dataloader = true;
            slot.remainder = remainder;
        }
    }

    /// Sets the remainder before the end is reached (a loader that knows its length).
    pub fn set_remainder(&self, remainder: Option<usize>) {
        let mut s = self.state.lock();
        if let Some(slot) = s.loaders.iter_mut().find(|l| l.id == self.id) {
            slot.remainder = remainder;
        }
    }

    /// Unregisters the loader (the epoch is over); the same as dropping the guard.
    pub fn end(self) {}

    /// The state this loader is registered with.
    pub fn gradient_state(&self) -> &GradientState {
        &self.state
    }
}

impl Drop for ActiveDataLoader {
    fn drop(&mut self) {
        // Removed by id, not popped: loaders may end out of order (an abandoned inner loop
        // dropped after its outer one), and the innermost remaining one becomes active again.
        self.state.lock().loaders.retain(|l| l.id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decisions(state: &GradientState, batches: usize) -> Vec<bool> {
        let loader = state.begin_dataloader();
        (0..batches)
            .map(|i| {
                if i + 1 == batches {
                    loader.set_end_of_dataloader(Some(1));
                }
                state.accumulate().sync_gradients()
            })
            .collect()
    }

    #[test]
    fn defaults_sync_every_batch() {
        let state = GradientState::new();
        assert!(state.sync_gradients());
        assert_eq!(decisions(&state, 3), [true, true, true]);
    }

    #[test]
    fn last_batch_syncs_and_resets_with_sync_with_dataloader() {
        let state = GradientState::new();
        state.configure(3, true).unwrap();
        assert_eq!(decisions(&state, 4), [false, false, true, true]);
        assert_eq!(state.step(), 0);
        assert_eq!(state.window_batches(), 1, "the last window held one batch");
        assert_eq!(decisions(&state, 4), [false, false, true, true]);
    }

    #[test]
    fn windows_cross_epochs_without_sync_with_dataloader() {
        let state = GradientState::new();
        state.configure(3, false).unwrap();
        assert_eq!(decisions(&state, 4), [false, false, true, false]);
        assert_eq!(decisions(&state, 4), [false, true, false, false]);
        assert_eq!(state.step(), 8);
    }

    #[test]
    fn loader_flags_are_visible_only_while_it_is_active() {
        let state = GradientState::new();
        assert!(!state.in_dataloader());
        assert_eq!(state.remainder(), None);
        let outer = state.begin_dataloader();
        outer.set_remainder(Some(3));
        {
            let inner = state.begin_dataloader();
            inner.set_end_of_dataloader(Some(1));
            assert_eq!(state.active_dataloaders(), 2);
            assert!(state.end_of_dataloader());
            assert_eq!(state.remainder(), Some(1));
        }
        assert!(
            !state.end_of_dataloader(),
            "the outer loader is active again"
        );
        assert_eq!(state.remainder(), Some(3));
        outer.end();
        assert!(!state.in_dataloader());
    }

    #[test]
    fn zero_steps_is_a_typed_error() {
        let err = GradientState::new().configure(0, true).unwrap_err();
        assert!(matches!(
            err,
            AccelerateError::InvalidConfig {
                field: "gradient_accumulation_steps",
                ..
            }
        ));
        assert!(err.to_string().contains("at least 1"), "{err}");
    }

    #[test]
    fn snapshot_round_trips() {
        let state = GradientState::new();
        state.configure(4, false).unwrap();
        let _ = decisions(&state, 6);
        let snapshot = state.snapshot();
        let json = serde_json::to_string(&snapshot).unwrap();
        let other = GradientState::new();
        other
            .restore(&serde_json::from_str(&json).unwrap())
            .unwrap();
        assert_eq!(other.snapshot(), snapshot);
        assert_eq!(decisions(&other, 5), decisions(&state, 5));
    }

    // Found by the accelerator state's property test (src/record_decoders.rs): a snapshot
    // whose step was usize::MAX restored, and the next batch overflowed the counter.
    #[test]
    fn a_counter_no_run_reaches_is_refused_and_the_state_stays() {
        let state = GradientState::new();
        state.configure(4, false).unwrap();
        let before = state.snapshot();
        for (field, snapshot) in [
            (
                "gradient_state.step",
                GradientStateSnapshot {
                    step: usize::MAX,
                    ..before
                },
            ),
            (
                "gradient_state.window_batches",
                GradientStateSnapshot {
                    window_batches: MAX_SAVED_COUNT + 1,
                    ..before
                },
            ),
        ] {
            let err = state.restore(&snapshot).unwrap_err();
            assert!(
                matches!(&err, AccelerateError::InvalidConfig { field: f, .. } if *f == field),
                "{err}"
            );
            assert_eq!(state.snapshot(), before);
        }
        let at_most = GradientStateSnapshot {
            step: MAX_SAVED_COUNT,
            ..before
        };
        state.restore(&at_most).unwrap();
        drop(state.accumulate());
    }

    #[test]
    fn global_is_one_state() {
        assert!(GradientState::global().same_as(&GradientState::global()));
        assert!(!GradientState::new().same_as(&GradientState::new()));
    }
}
