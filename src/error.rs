//! The crate's typed errors. Each message says what to change.

use thiserror::Error;

use crate::Precision;
use crate::data::DataLoaderError;
use crate::distributed::DistributedError;
use crate::precision::UnknownPrecision;

use crate::placement::PlacementError;

/// Everything in this crate that can go wrong because of user input or the device.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum AccelerateError {
    /// A precision name that is none of the known ones.
    #[error(transparent)]
    UnknownPrecision(#[from] UnknownPrecision),

    /// A parameter of the fp8 delayed-scaling recipe out of its range.
    #[error(
        "fp8 recipe: {parameter} = {value} is invalid: it must be {expected} (see \
         `DelayedScaling`; Transformer Engine's defaults are margin 0, interval 1, \
         amax_history_len 1024)"
    )]
    InvalidFp8Recipe {
        /// The parameter's name, as Transformer Engine spells it.
        parameter: &'static str,
        /// The value given.
        value: i64,
        /// The accepted range, in words.
        expected: &'static str,
    },

    /// fp8 autocast on an autodiff backend whose fp8 cast was never registered: gradients
    /// would be estimated, not rounded.
    #[error(
        "fp8 autocast on {backend}: this autodiff backend has no registered fp8 cast, so HYBRID \
         could not round gradients. Call `burn_accelerate::fp8::register::<YourBackend>()` \
         first (Burn's `Autodiff<B>` over this crate's backend features is registered already)"
    )]
    Fp8NotRegistered {
        /// The backend's name.
        backend: String,
    },

    /// The device cannot run the requested low precision at all.
    #[error(
        "{backend} cannot run {precision} on device {device}: the capability probe found no \
         working {precision} matmul there. Use a precision the device supports ({supported}), \
         or allow the f32 fallback (`with_allow_fallback(true)` on the `AutocastConfig` or \
         `AccelerateConfig`)"
    )]
    UnsupportedPrecision {
        /// The requested precision.
        precision: Precision,
        /// The backend's name.
        backend: String,
        /// The device, as Burn prints it.
        device: String,
        /// What the probe found usable, comma-separated.
        supported: String,
    },

    /// The device runs the requested low precision, but so much slower than f32 that
    /// autocast would slow training down (LibTorch's f16 on a CPU, say).
    #[error(
        "{precision} runs on {backend} (device {device}) but about {slowdown}× slower than f32 \
         there, so autocasting to it would slow training down. Use a precision the device runs \
         fast ({fast}), allow the f32 fallback (`with_allow_fallback(true)`), or accept the \
         slowdown (`with_allow_slow(true)`) on the `AutocastConfig` or `AccelerateConfig`"
    )]
    SlowPrecision {
        /// The requested precision.
        precision: Precision,
        /// The backend's name.
        backend: String,
        /// The device, as Burn prints it.
        device: String,
        /// How many times slower than f32 the probe's matmul ran.
        slowdown: u32,
        /// The precisions the device runs without a slowdown, comma-separated.
        fast: String,
    },

    /// A setting outside the range it is meaningful in (a configuration field, or an argument
    /// such as a clipping threshold).
    #[error("invalid {field} = {value}: {fix}")]
    InvalidConfig {
        /// The setting, named as in the config (`gradient_accumulation_steps`,
        /// `grad_scaler.backoff_factor`, ...) or the argument.
        field: &'static str,
        /// The value given, as text.
        value: String,
        /// What to set instead.
        fix: &'static str,
    },

    /// The calling thread could not be made one of rayon's global pool's threads
    /// ([`threads::use_current_thread`](crate::threads::use_current_thread),
    /// [`threads::StepThreadsConfig::install`](crate::threads::StepThreadsConfig::install)).
    #[error(
        "cannot compute on the calling thread: {reason}. Call \
         `burn_accelerate::threads::use_current_thread` (or `StepThreadsConfig::install`) once, \
         first thing in `main`, before any op runs on Flex (the first parallel op builds \
         rayon's global pool)"
    )]
    ThreadPool {
        /// Rayon's reason.
        reason: String,
    },

    /// The step's threads could not each be pinned to a CPU of their own
    /// ([`threads::StepThreadsConfig::pin`](crate::threads::StepThreadsConfig::pin)).
    #[error("cannot pin the step's threads to CPUs: {reason}; {fix}")]
    ThreadPinning {
        /// What stood in the way.
        reason: String,
        /// What to change.
        fix: String,
    },

    /// Saved state that does not fit the object it is loaded into.
    #[error(
        "cannot restore {what}: the checkpoint was saved with {saved}, this accelerator has \
         {current}. Build the accelerator with the checkpoint's settings"
    )]
    StateMismatch {
        /// Which setting differs.
        what: &'static str,
        /// The checkpoint's value.
        saved: String,
        /// The current value.
        current: String,
    },

    /// Mixed precision asked of a training backend that is not wrapped in
    /// [`Accelerated`](crate::Accelerated): its ops would silently run in f32, and a user's
    /// `loss.backward()` would not be loss-scaled.
    #[error(
        "{precision} training on {backend}: autocast and loss scaling need the backend wrapped          as `Accelerated<Autodiff<B>>` (change the training backend's type alias), or train in          f32"
    )]
    NotAccelerated {
        /// The requested precision.
        precision: Precision,
        /// The backend's name.
        backend: String,
    },

    /// The training state saved beside a checkpoint could not be written or read back.
    #[error("accelerate checkpoint state {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },

    /// An optimizer record that ZeRO stage 3 cannot cut into its slices (an optimizer whose
    /// record implements `ParamStateRecord` without `slice` and `join`).
    #[error("ZeRO stage 3 cannot slice the optimizer's state: {reason}")]
    OptimizerState {
        /// What went wrong.
        reason: String,
    },

    /// A data loader configuration that cannot be built, or a loader state that cannot be
    /// restored.
    #[error(transparent)]
    DataLoader(#[from] DataLoaderError),

    /// A bad launch environment, or a collective between the processes that failed.
    #[error(transparent)]
    Distributed(#[from] DistributedError),

    /// A device map or placement that cannot be honoured (see [`PlacementError`]).
    #[error(transparent)]
    Placement(#[from] PlacementError),
}

impl From<burn_accelerate_checkpoint::CheckpointError> for AccelerateError {
    fn from(err: burn_accelerate_checkpoint::CheckpointError) -> Self {
        Self::Checkpoint {
            path: err.path,
            reason: err.reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_errors_convert_into_the_crate_error() {
        let err: AccelerateError = DataLoaderError::ZeroPrefetch {
            num_workers: 1,
            non_blocking: false,
        }
        .into();
        assert!(err.to_string().starts_with("prefetch is 0"));
    }

    #[test]
    fn an_unknown_precision_converts_into_the_crate_error_with_its_message() {
        let unknown = "fp12".parse::<Precision>().unwrap_err();
        let err: AccelerateError = unknown.clone().into();
        assert_eq!(err, AccelerateError::UnknownPrecision(unknown.clone()));
        assert_eq!(err.to_string(), unknown.to_string());
    }
}
