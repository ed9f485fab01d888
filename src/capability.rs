//! What low precision a device can really run, found by running it.
//!
//! Backends' own flags are not enough: Candle reports bf16 as supported and its bf16 matmul
//! panics, while NdArray reports no half types and panics on the cast. So the probe runs a tiny
//! cast → matmul → add → cast-back program per dtype and checks the answer, once per backend
//! type and device, with the panic (if any) caught and kept quiet.

use std::any::TypeId;
use std::collections::{HashMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Mutex, Once, OnceLock, RwLock};

use burn::tensor::{Tensor, TensorData};
use burn_backend::{Backend, DeviceId, DeviceOps, FloatDType};
use core::cell::Cell;
use core::fmt;

use crate::autocast::Op;
use crate::{AccelerateError, Precision};

/// Whether a device ran a low-precision dtype in the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// f16 ran and gave the right answer.
    pub f16: bool,
    /// bf16 ran and gave the right answer.
    pub bf16: bool,
}

impl Capabilities {
    /// Whether `precision`'s low dtype is usable (full precision always is).
    pub fn runs(&self, precision: Precision) -> bool {
        match precision.low_dtype() {
            None => true,
            Some(FloatDType::F16) => self.f16,
            Some(FloatDType::BF16) => self.bf16,
            Some(_) => false,
        }
    }

    /// The precisions this device runs, full precision first.
    pub fn usable(&self) -> Vec<Precision> {
        Precision::ALL
            .into_iter()
            .filter(|p| self.runs(*p))
            .collect()
    }
}

impl fmt::Display for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.usable().iter().map(|p| p.to_string()).collect();
        f.write_str(&names.join(", "))
    }
}

type Key = (TypeId, DeviceId);

fn cache() -> &'static RwLock<HashMap<Key, Capabilities>> {
    static CACHE: OnceLock<RwLock<HashMap<Key, Capabilities>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

thread_local! {
    // The last lookup: a training step asks about the same device over and over.
    static LAST: Cell<Option<(Key, Capabilities)>> = const { Cell::new(None) };
    static PROBING: Cell<bool> = const { Cell::new(false) };
}

/// Probes (once, then from cache) which low dtypes `device` runs on backend `B`.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn_accelerate::capability;
/// type B = burn::backend::Flex;
///
/// let caps = capability::probe::<B>(&Default::default());
/// assert!(caps.bf16 && caps.f16);
/// # }
/// ```
pub fn probe<B: Backend>(device: &B::Device) -> Capabilities {
    let key = (TypeId::of::<B>(), device.id());
    if let Some((k, caps)) = LAST.with(Cell::get)
        && k == key
    {
        return caps;
    }
    let cached = cache()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .copied();
    let caps = cached.unwrap_or_else(|| {
        let caps = Capabilities {
            f16: runs_dtype::<B>(device, FloatDType::F16),
            bf16: runs_dtype::<B>(device, FloatDType::BF16),
        };
        cache()
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, caps);
        caps
    });
    LAST.with(|l| l.set(Some((key, caps))));
    caps
}

/// Fails with a typed error unless `device` runs `precision`.
pub fn ensure<B: Backend>(device: &B::Device, precision: Precision) -> Result<(), AccelerateError> {
    let caps = probe::<B>(device);
    if caps.runs(precision) {
        Ok(())
    } else {
        Err(AccelerateError::UnsupportedPrecision {
            precision,
            backend: B::name(device),
            device: format!("{device:?}"),
            supported: caps.to_string(),
        })
    }
}

fn runs_dtype<B: Backend>(device: &B::Device, dtype: FloatDType) -> bool {
    // A backend that says no is believed: running a kernel it disowns may leave a GPU queue
    // in a bad state. A yes is checked.
    if !B::supports_dtype(device, dtype.into()) {
        return false;
    }
    silence_probe_panics();
    PROBING.with(|p| p.set(true));
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let x =
            Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32, 2., 3., 4.], [2, 2]), device)
                .cast(dtype);
        let y = x.clone().matmul(x.clone().transpose()) + x;
        y.cast(FloatDType::F32)
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
    }));
    PROBING.with(|p| p.set(false));
    // [[1,2],[3,4]] · its transpose + itself, exact in every half type.
    matches!(result, Ok(Ok(v)) if v == [6.0, 13.0, 14.0, 29.0])
}

// Installs, once, a panic hook that stays quiet for panics raised inside a probe on the
// probing thread and defers to the previous hook for everything else.
fn silence_probe_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !PROBING.with(Cell::get) {
                previous(info)
            }
        }));
    });
}

/// A lower-class op that ran in f32 because its device cannot run the requested dtype.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fallback {
    /// The backend's name.
    pub backend: String,
    /// The device, as Burn prints it.
    pub device: String,
    /// What autocast asked for.
    pub requested: Precision,
    /// The op that fell back (the first one seen; the rest of its class follows it).
    pub op: Op,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} on {} cannot run {}: lower-precision ops (first: {}) run in f32 instead",
            self.backend,
            self.device,
            self.requested,
            self.op.method()
        )
    }
}

// The fallbacks taken so far: which (backend, device, precision) have been reported, and the
// reports in the order they happened.
#[derive(Default)]
struct FallbackLog {
    seen: HashSet<(Key, Precision)>,
    reports: Vec<Fallback>,
}

fn fallback_log() -> &'static Mutex<FallbackLog> {
    static LOG: OnceLock<Mutex<FallbackLog>> = OnceLock::new();
    LOG.get_or_init(Default::default)
}

/// Every f32 fallback autocast has taken in this process, once per backend, device and precision.
pub fn fallbacks() -> Vec<Fallback> {
    fallback_log()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .reports
        .clone()
}

/// The dtype a lower-class `op` runs in on `device` under `precision`: the low dtype, or f32
/// (logged once) where the device cannot run it.
pub(crate) fn lower_dtype<B: Backend>(
    device: &B::Device,
    precision: Precision,
    op: Op,
) -> FloatDType {
    let Some(low) = precision.low_dtype() else {
        return FloatDType::F32;
    };
    if probe::<B>(device).runs(precision) {
        return low;
    }
    let key = ((TypeId::of::<B>(), device.id()), precision);
    let mut log = fallback_log().lock().unwrap_or_else(|e| e.into_inner());
    if log.seen.insert(key) {
        let fallback = Fallback {
            backend: B::name(device),
            device: format!("{device:?}"),
            requested: precision,
            op,
        };
        log::warn!("burn-accelerate autocast: {fallback}");
        log.reports.push(fallback);
    }
    FloatDType::F32
}

/// How many devices of `device`'s kind backend `B` sees, 0 where asking panics.
///
/// `Backend::device_count` for CUDA panics on a machine without a driver; this asks with the
/// panic caught (and kept quiet), so a program or test can skip instead of crashing.
pub fn device_count<B: Backend>(device: &B::Device) -> usize {
    let type_id = device.id().type_id;
    silence_probe_panics();
    PROBING.with(|p| p.set(true));
    let count = panic::catch_unwind(|| B::device_count(type_id)).unwrap_or(0);
    PROBING.with(|p| p.set(false));
    count
}
