//! The state file of a checkpoint, one type for both entry points, and the order in which a
//! resumed run restores it: the number of processes, then the gradient-state position and the
//! loss scale, then the loaders' positions.

use burn::config::Config;
use burn::tensor::backend::Backend;

use super::records::record_error;
use crate::data::{DataLoaderError, LoaderState, ShardLoader};
use crate::gradient_state::GradientStateSnapshot;
use crate::scaler::LossScale;
use crate::{AccelerateError, AcceleratorState};

/// The loss scale, gradient-state position and loader positions saved with a checkpoint
/// (`accelerator-N.json` of [`Accelerator::save_checkpoint`](crate::Accelerator::save_checkpoint),
/// `accelerate-N.json` of `with_accelerate`), so that a resumed run goes on with the scale the
/// interrupted run had reached (instead of overflowing again from the initial one) and with the
/// shuffled order it would have seen.
///
/// An `Accelerator`'s checkpoints written before this type held only the [`AcceleratorState`]:
/// a resumed run reads them as a state with no loader position.
#[derive(Config, Debug)]
pub struct CheckpointState {
    /// The saved state.
    pub state: AcceleratorState,
    /// Where each checkpointed loader was (epoch, position, seeds), in device order; empty
    /// when the run tracked none (a hand-written loop saves its loaders' positions as files of
    /// its own), or in a file written before loaders were saved. With several processes, the
    /// main process's (the others are at the same epoch and position).
    #[config(default = "Vec::new()")]
    pub loaders: Vec<LoaderState>,
    /// The number of processes of the run that wrote it.
    #[config(default = 1)]
    pub num_processes: usize,
}

/// A loader whose epoch and position a checkpoint holds, whatever its item types. Copies of a
/// `ShardLoader` share its position, so the strategy's copy sees what Burn's copy iterates.
pub(crate) trait LoaderPosition: Send + Sync {
    fn state(&self) -> LoaderState;
    fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError>;
}

impl<B, I, O> LoaderPosition for ShardLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn state(&self) -> LoaderState {
        ShardLoader::state(self)
    }

    fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError> {
        ShardLoader::load_state(self, state)
    }
}

impl CheckpointState {
    /// The file's bytes (pretty JSON, as both entry points have always written it).
    pub(crate) fn to_json(&self) -> Vec<u8> {
        // A struct of numbers, flags and lists of them: serde_json cannot fail on it.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// The state of a file's bytes, `name` naming it in the error: this type's JSON, or an
    /// [`AcceleratorState`] alone (an `Accelerator`'s checkpoint written before the two entry
    /// points shared one state file), which has no loader position.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] naming `name` when the bytes are neither.
    pub(crate) fn from_json(bytes: &[u8], name: &str) -> Result<Self, AccelerateError> {
        let error = |e: serde_json::Error| record_error(name, e);
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(error)?;
        if value.get("state").is_some() {
            return serde_json::from_value(value).map_err(error);
        }
        let state: AcceleratorState = serde_json::from_value(value).map_err(error)?;
        Ok(Self {
            state,
            loaders: Vec::new(),
            num_processes: 1,
        })
    }

    /// Restores it, in the order both entry points resume: the number of processes (a run
    /// may resume on another number only at an epoch's start, where the loaders shard the
    /// data anew), then the gradient-state position and the loss scale (`position`: the entry
    /// point's, which checks the scale's kind with `step::restore_position`), then the
    /// `loaders`' positions. Returns the loss scale to go on with.
    ///
    /// # Errors
    /// [`AccelerateError::StateMismatch`] for a loader position inside an epoch saved by
    /// another number of processes than `processes`, or another number of loaders; what
    /// `position` and a loader's `load_state` return. Nothing is restored when the processes
    /// do not fit.
    pub(crate) fn restore(
        &self,
        processes: usize,
        position: impl FnOnce(&GradientStateSnapshot, LossScale) -> Result<(), AccelerateError>,
        loaders: &[&dyn LoaderPosition],
    ) -> Result<LossScale, AccelerateError> {
        if self.num_processes != processes {
            // A checkpoint at the end of an epoch has every shard's position at 0: the next
            // epoch's order depends on the seed and the epoch only, and the loaders built for
            // this run shard it anew. A position inside an epoch has no such mapping.
            if let Some(inside) = self.loaders.iter().find(|l| l.position != 0) {
                return Err(AccelerateError::StateMismatch {
                    what: "number of processes",
                    saved: format!(
                        "{} processes, {} batches into epoch {}",
                        self.num_processes, inside.position, inside.epoch
                    ),
                    current: format!("{processes} processes"),
                });
            }
            if !self.loaders.is_empty() {
                log::info!(
                    "burn-accelerate: resuming a run of {} processes on {processes}: the data \
                     is sharded anew from the next epoch",
                    self.num_processes
                );
            }
        }
        position(&self.state.gradient_state, self.state.loss_scale)?;
        restore_loaders(&self.loaders, loaders)?;
        Ok(self.state.loss_scale)
    }
}

// The saved loaders' positions restored into the tracked ones.
fn restore_loaders(
    saved: &[LoaderState],
    loaders: &[&dyn LoaderPosition],
) -> Result<(), AccelerateError> {
    if loaders.is_empty() {
        if !saved.is_empty() {
            log::warn!(
                "burn-accelerate: the checkpoint holds {} loader positions but the strategy \
                 tracks no loader: the training loader starts its own first epoch's order \
                 (pass it to `with_checkpointed_loader` to resume where it was)",
                saved.len()
            );
        }
        return Ok(());
    }
    if saved.is_empty() {
        log::warn!(
            "burn-accelerate: the checkpoint holds no loader position: the loaders restart at \
             their first epoch's order"
        );
        return Ok(());
    }
    if saved.len() != loaders.len() {
        return Err(AccelerateError::StateMismatch {
            what: "checkpointed loaders",
            saved: format!("{} loader positions", saved.len()),
            current: format!("{} loaders", loaders.len()),
        });
    }
    for (loader, state) in loaders.iter().zip(saved) {
        loader.load_state(*state)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradient_state::GradientState;

    fn saved(num_processes: usize, position: usize) -> CheckpointState {
        CheckpointState {
            state: AcceleratorState {
                loss_scale: LossScale::Static { scale: 8.0 },
                gradient_state: GradientStateSnapshot {
                    num_steps: 2,
                    sync_with_dataloader: true,
                    sync_gradients: true,
                    step: 4,
                    window_batches: 0,
                },
            },
            loaders: vec![
                serde_json::from_str(&format!(
                    r#"{{"epoch": 2, "position": {position}, "seed": 5}}"#
                ))
                .unwrap(),
            ],
            num_processes,
        }
    }

    // Both entry points' files read back as one type: the current one whole, an
    // `Accelerator`'s older one (its state alone) with no loader position.
    #[test]
    fn both_formats_read_back_as_one_state() {
        let current = saved(2, 0);
        let read = CheckpointState::from_json(&current.to_json(), "accelerate-1.json").unwrap();
        assert_eq!(read.state, current.state);
        assert_eq!(read.loaders, current.loaders);
        assert_eq!(read.num_processes, 2);

        let older = serde_json::to_vec_pretty(&current.state).unwrap();
        let read = CheckpointState::from_json(&older, "accelerator-1.json").unwrap();
        assert_eq!(read.state, current.state);
        assert!(read.loaders.is_empty());

        let err = CheckpointState::from_json(b"{\"state\": 3}", "accelerator-1.json").unwrap_err();
        assert!(
            matches!(&err, AccelerateError::Checkpoint { path, .. } if path == "accelerator-1.json"),
            "{err}"
        );
    }

    // A position inside an epoch cannot move to another number of processes; at an epoch's
    // start it can, and the position and loss scale are restored.
    #[test]
    fn a_position_inside_an_epoch_stays_on_its_number_of_processes() {
        let state = GradientState::new();
        state.configure(2, true).unwrap();
        let scale = LossScale::Static { scale: 1.0 };
        let position = |current: LossScale| {
            let state = state.clone();
            move |saved: &GradientStateSnapshot, saved_scale: LossScale| {
                crate::step::restore_position(&state, &current, saved, &saved_scale)
            }
        };
        let err = saved(2, 3).restore(1, position(scale), &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("2 processes, 3 batches into epoch 2"),
            "{err}"
        );
        let restored = saved(2, 0).restore(1, position(scale), &[]).unwrap();
        assert_eq!(restored, LossScale::Static { scale: 8.0 });
        assert_eq!(state.snapshot().step, 4);
        let err = saved(1, 0)
            .restore(1, position(LossScale::None), &[])
            .unwrap_err();
        assert!(
            matches!(
                err,
                AccelerateError::StateMismatch {
                    what: "loss scaling",
                    ..
                }
            ),
            "{err}"
        );
    }
}
