//! Restoring a checkpoint's loss scale and gradient-state position, for both entry points: one
//! rule for which saved accumulation settings and loss scale a run may go on with.

use crate::error::AccelerateError;
use crate::gradient_state::{GradientState, GradientStateSnapshot};
use crate::scaler::LossScale;

// The kind of loss scaling, as a mismatch names it (the saved value's own encoding, serde's,
// is read as it was written).
fn kind(scale: &LossScale) -> &'static str {
    match scale {
        LossScale::None => "no loss scaling",
        LossScale::Static { .. } => "a static loss scale",
        LossScale::Dynamic(_) => "a dynamic loss scale",
    }
}

/// Checks that a checkpoint's accumulation settings (`saved`) are the run's (`num_steps`,
/// `sync_with_dataloader`): with another window length or another end rule the resumed run
/// would step at other batches than the run that saved it, so a run does not change them on
/// resuming (a restored position takes the saved ones).
///
/// # Errors
/// [`AccelerateError::StateMismatch`] (`gradient_accumulation_steps`, `sync_with_dataloader`)
/// naming the saved setting and the run's.
pub(crate) fn check_accumulation(
    saved: &GradientStateSnapshot,
    num_steps: usize,
    sync_with_dataloader: bool,
) -> Result<(), AccelerateError> {
    if saved.num_steps != num_steps {
        return Err(AccelerateError::StateMismatch {
            what: "gradient_accumulation_steps",
            saved: saved.num_steps.to_string(),
            current: num_steps.to_string(),
        });
    }
    if saved.sync_with_dataloader != sync_with_dataloader {
        return Err(AccelerateError::StateMismatch {
            what: "sync_with_dataloader",
            saved: saved.sync_with_dataloader.to_string(),
            current: sync_with_dataloader.to_string(),
        });
    }
    Ok(())
}

/// Puts `state` at a checkpoint's position, after checking that the checkpoint's loss scale
/// (`saved_scale`) is of the kind the run has (`current`): a dynamic scale goes on from where
/// it was, and a run does not change kinds on resuming.
///
/// # Errors
/// [`AccelerateError::StateMismatch`] (`loss scaling`) for another kind of loss scaling; what
/// [`GradientState::restore`] returns.
pub(crate) fn restore_position(
    state: &GradientState,
    current: &LossScale,
    saved: &GradientStateSnapshot,
    saved_scale: &LossScale,
) -> Result<(), AccelerateError> {
    if kind(saved_scale) != kind(current) {
        return Err(AccelerateError::StateMismatch {
            what: "loss scaling",
            saved: kind(saved_scale).into(),
            current: kind(current).into(),
        });
    }
    state.restore(saved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_kind_of_loss_scaling_is_refused_and_the_state_stays() {
        let state = GradientState::new();
        state.configure(2, true).unwrap();
        let mut saved = state.snapshot();
        saved.step = 5;
        let err = restore_position(
            &state,
            &LossScale::None,
            &saved,
            &LossScale::Static { scale: 8.0 },
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                AccelerateError::StateMismatch { what: "loss scaling", saved, current }
                    if saved == "a static loss scale" && current == "no loss scaling"
            ),
            "{err}"
        );
        assert_ne!(state.snapshot().step, 5);
        restore_position(&state, &LossScale::None, &saved, &LossScale::None).unwrap();
        assert_eq!(state.snapshot().step, 5);
    }
}
