//! The crate's typed errors. Each message says what to change.

use thiserror::Error;

use crate::Precision;
use crate::placement::PlacementError;

/// Everything in this crate that can go wrong because of user input or the device.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum AccelerateError {
    /// A precision name that is none of the known ones.
    #[error("unknown precision {0:?}: use one of \"no\"/\"f32\", \"bf16\", \"fp16\"/\"f16\"")]
    UnknownPrecision(String),

    /// The device cannot run the requested low precision at all.
    #[error(
        "{backend} cannot run {precision} on device {device}: the capability probe found no \
         working {precision} matmul there. Use a precision the device supports ({supported}), \
         or allow the f32 fallback (`AutocastConfig::with_allow_fallback(true)`)"
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

    /// A device map or placement that cannot be honoured (see [`PlacementError`]).
    #[error(transparent)]
    Placement(#[from] PlacementError),
}
