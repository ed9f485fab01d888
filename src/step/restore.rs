//! Restoring a checkpoint's loss scale and gradient-state position, for both entry points: one
//! rule for which saved loss scale a run may go on with.

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
