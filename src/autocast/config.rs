//! Checked set-up of autocast for one device.

use burn::config::Config;
use burn_backend::Backend;

use super::{AutocastGuard, set_default};
use crate::capability::{self, Capabilities};
use crate::{AccelerateError, Precision};

/// How to autocast, checked against a device by [`init`](AutocastConfig::init).
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn_accelerate::{AutocastConfig, Precision};
/// type B = burn::backend::Flex;
///
/// let autocast = AutocastConfig::new(Precision::Bf16).init::<B>(&Default::default()).unwrap();
/// assert_eq!(autocast.precision(), Precision::Bf16);
/// let _guard = autocast.enter(); // this thread autocasts until the guard drops
/// # }
/// ```
#[derive(Config, Debug, PartialEq)]
pub struct AutocastConfig {
    /// The precision to lower matmul-like ops to.
    pub precision: Precision,
    /// Run in f32 (and report it) instead of failing when the device cannot run `precision`.
    #[config(default = false)]
    pub allow_fallback: bool,
}

impl AutocastConfig {
    /// Probes `device` and returns the autocast it can run.
    ///
    /// # Errors
    /// [`AccelerateError::UnsupportedPrecision`] when the device cannot run the precision and
    /// `allow_fallback` is off.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<Autocast, AccelerateError> {
        let capabilities = capability::probe::<B>(device);
        let effective = match capability::ensure::<B>(device, self.precision) {
            Ok(()) => self.precision,
            Err(err) if !self.allow_fallback => return Err(err),
            Err(err) => {
                log::warn!("burn-accelerate: {err}; running in f32 as allowed");
                Precision::F32
            }
        };
        Ok(Autocast {
            requested: self.precision,
            effective,
            capabilities,
        })
    }
}

/// Autocast checked against a device: the precision it will really run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autocast {
    requested: Precision,
    effective: Precision,
    capabilities: Capabilities,
}

impl Autocast {
    /// The precision ops will run in (f32 when a fallback was taken).
    pub fn precision(&self) -> Precision {
        self.effective
    }

    /// The precision that was asked for.
    pub fn requested(&self) -> Precision {
        self.requested
    }

    /// Whether the device could not run the request and f32 is used instead.
    pub fn fell_back(&self) -> bool {
        self.requested != self.effective
    }

    /// What the probe found the device can run.
    pub fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    /// Autocasts on this thread until the guard drops.
    #[must_use = "autocast is only on while the guard lives"]
    pub fn enter(&self) -> AutocastGuard {
        super::enable(self.effective)
    }

    /// Makes this the process-wide default, for every thread without a guard of its own.
    pub fn set_default(&self) {
        set_default(Some(self.effective));
    }
}
