//! What low precision a device can really run, found by running it.
//!
//! Backends' own flags are not enough: Candle reports bf16 as supported and its bf16 matmul
//! panics, while NdArray reports no half types and panics on the cast. So the probe runs a tiny
//! cast → matmul → add → cast-back program per dtype and checks the answer, once per backend
//! type and device, with the panic (if any) caught and kept quiet.
//!
//! Running is not enough either: LibTorch on a CPU runs f16 correctly but has no f16 matmul
//! kernel there, so f16 is about 50× slower than f32. The probe therefore also times a
//! square matmul in f32 and in each low dtype that runs, and flags a dtype
//! [`SLOW_FACTOR`] times slower or worse, so that autocast never picks it silently.

use std::any::TypeId;
use std::collections::{HashMap, HashSet};
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Mutex, Once, OnceLock, RwLock};
use std::time::{Duration, Instant};

use burn::tensor::{Tensor, TensorData};
use burn_backend::{Backend, DeviceId, DeviceOps, FloatDType};
use core::cell::Cell;
use core::fmt;

use crate::autocast::Op;
use crate::{AccelerateError, Precision};

/// How many times slower than f32 a low dtype's matmul must be for the probe to flag it.
///
/// Far above what a dtype with real kernels costs (Flex's half matmuls, lavapipe's f16) and
/// far below a dtype with none (LibTorch CPU f16, about 50×): the probe's timing runs on a
/// busy machine and must not flip between the two.
pub const SLOW_FACTOR: f32 = 8.0;

// The probe's timed matmul: N×N by N×N, big enough that kernel launch and read-back costs
// do not hide a missing fast path (at 256, LibTorch CPU's slow half types were within 2× of
// f32), small enough to cost milliseconds where one exists.
const TIMED_MATMUL_SIZE: usize = 512;

/// Whether a device ran a low-precision dtype in the probe, and how fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// f16 ran and gave the right answer.
    pub f16: bool,
    /// bf16 ran and gave the right answer.
    pub bf16: bool,
    /// f16 ran, but its matmul took this many times (rounded down) as long as f32's, at least
    /// [`SLOW_FACTOR`].
    pub f16_slowdown: Option<u32>,
    /// bf16 ran, but its matmul took this many times (rounded down) as long as f32's, at least
    /// [`SLOW_FACTOR`].
    pub bf16_slowdown: Option<u32>,
}

impl Capabilities {
    /// Whether `precision`'s low dtype runs correctly (full precision always does), fast or
    /// not.
    pub fn runs(&self, precision: Precision) -> bool {
        match precision.low_dtype() {
            None => true,
            Some(FloatDType::F16) => self.f16,
            Some(FloatDType::BF16) => self.bf16,
            Some(_) => false,
        }
    }

    /// How many times slower than f32 `precision` runs, where the probe flagged it slow.
    pub fn slowdown(&self, precision: Precision) -> Option<u32> {
        match precision.low_dtype() {
            Some(FloatDType::F16) => self.f16_slowdown,
            Some(FloatDType::BF16) => self.bf16_slowdown,
            _ => None,
        }
    }

    /// Whether `precision` runs and is not flagged slow: what autocast may pick unasked.
    pub fn runs_fast(&self, precision: Precision) -> bool {
        self.runs(precision) && self.slowdown(precision).is_none()
    }

    /// The precisions this device runs without a slowdown, full precision first.
    pub fn fast(&self) -> Vec<Precision> {
        Precision::ALL
            .into_iter()
            .filter(|p| self.runs_fast(*p))
            .collect()
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
    /// The usable precisions, each slow one with its slowdown: `f32, bf16, f16 (50× slower)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self
            .usable()
            .iter()
            .map(|p| match self.slowdown(*p) {
                Some(x) => format!("{p} ({x}× slower)"),
                None => p.to_string(),
            })
            .collect();
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
        let f16 = runs_dtype::<B>(device, FloatDType::F16);
        let bf16 = runs_dtype::<B>(device, FloatDType::BF16);
        let (f16_slowdown, bf16_slowdown) = slowdowns::<B>(device, f16, bf16);
        let caps = Capabilities {
            f16,
            bf16,
            f16_slowdown,
            bf16_slowdown,
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

/// Fails with a typed error unless `device` runs `precision` at a usable speed.
///
/// # Errors
/// - [`AccelerateError::UnsupportedPrecision`] when the device cannot run it;
/// - [`AccelerateError::SlowPrecision`] when it runs, but [`SLOW_FACTOR`] times slower than
///   f32 or worse.
pub fn ensure<B: Backend>(device: &B::Device, precision: Precision) -> Result<(), AccelerateError> {
    check(
        &probe::<B>(device),
        precision,
        || B::name(device),
        || format!("{device:?}"),
    )
}

// `ensure` on what a probe found; the names are only built for an error.
fn check(
    caps: &Capabilities,
    precision: Precision,
    backend: impl FnOnce() -> String,
    device: impl FnOnce() -> String,
) -> Result<(), AccelerateError> {
    if !caps.runs(precision) {
        return Err(AccelerateError::UnsupportedPrecision {
            precision,
            backend: backend(),
            device: device(),
            supported: caps.to_string(),
        });
    }
    match caps.slowdown(precision) {
        None => Ok(()),
        Some(slowdown) => Err(AccelerateError::SlowPrecision {
            precision,
            backend: backend(),
            device: device(),
            slowdown,
            fast: names(&caps.fast()),
        }),
    }
}

fn names(precisions: &[Precision]) -> String {
    let names: Vec<String> = precisions.iter().map(|p| p.to_string()).collect();
    names.join(", ")
}

/// The slowdown of a low dtype's matmul against f32's, where it reaches [`SLOW_FACTOR`].
pub fn slowdown(f32_time: Duration, low_time: Duration) -> Option<u32> {
    let ratio = low_time.as_secs_f32() / f32_time.as_secs_f32().max(f32::MIN_POSITIVE);
    (ratio >= SLOW_FACTOR).then_some(ratio as u32)
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

// The slowdowns of f16 and bf16 against f32, for those that run and reach SLOW_FACTOR.
fn slowdowns<B: Backend>(device: &B::Device, f16: bool, bf16: bool) -> (Option<u32>, Option<u32>) {
    let mut dtypes = vec![FloatDType::F32];
    dtypes.extend(f16.then_some(FloatDType::F16));
    dtypes.extend(bf16.then_some(FloatDType::BF16));
    if dtypes.len() == 1 {
        return (None, None);
    }
    let Some(times) = matmul_times::<B>(device, &dtypes) else {
        return (None, None);
    };
    let of = |dtype| {
        let i = dtypes.iter().position(|d| *d == dtype)?;
        slowdown(times[0], times[i])
    };
    (of(FloatDType::F16), of(FloatDType::BF16))
}

// The best of four timed N×N matmuls per dtype, each read back to the host (which waits for
// lazy and asynchronous backends). The dtypes take turns, so that a burst of load elsewhere
// on the machine slows them alike; an untimed first round pays for kernel compilation and
// allocation. `None` if any panicked.
fn matmul_times<B: Backend>(device: &B::Device, dtypes: &[FloatDType]) -> Option<Vec<Duration>> {
    silence_probe_panics();
    PROBING.with(|p| p.set(true));
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let n = TIMED_MATMUL_SIZE;
        let inputs: Vec<Tensor<B, 2>> = dtypes
            .iter()
            .map(|dtype| Tensor::<B, 2>::ones([n, n], device).cast(*dtype))
            .collect();
        let run = |x: &Tensor<B, 2>| x.clone().matmul(x.clone()).into_data();
        let mut best = vec![Duration::MAX; dtypes.len()];
        for round in 0..5 {
            for (x, best) in inputs.iter().zip(&mut best) {
                let start = Instant::now();
                run(x);
                if round > 0 {
                    *best = (*best).min(start.elapsed());
                }
            }
        }
        best
    }));
    PROBING.with(|p| p.set(false));
    result.ok()
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
    slow_warned: HashSet<(Key, Precision)>,
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
    let caps = probe::<B>(device);
    let key = ((TypeId::of::<B>(), device.id()), precision);
    if caps.runs(precision) {
        if let Some(slowdown) = caps.slowdown(precision) {
            warn_slow_once::<B>(device, key, precision, slowdown);
        }
        return low;
    }
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

// A bare guard is an explicit request, so a slow dtype runs; but not silently.
fn warn_slow_once<B: Backend>(
    device: &B::Device,
    key: (Key, Precision),
    precision: Precision,
    slowdown: u32,
) {
    let mut log = fallback_log().lock().unwrap_or_else(|e| e.into_inner());
    if log.slow_warned.insert(key) {
        log::warn!(
            "burn-accelerate autocast: {precision} on {} ({device:?}) runs about {slowdown}× \
             slower than f32; `AutocastConfig::init` would have refused it",
            B::name(device)
        );
    }
}

/// How many devices of `device`'s kind backend `B` sees, 0 where asking panics.
///
/// `Backend::device_count` for CUDA panics on a machine without a driver; this asks with the
/// panic caught, so a program or test can skip instead of crashing. The answer is kept for
/// the process: CUDA's runtime panics on its own server thread, where the panic cannot be
/// kept quiet, so asking once prints its message once.
pub fn device_count<B: Backend>(device: &B::Device) -> usize {
    static COUNTS: Mutex<Vec<(TypeId, u16, usize)>> = Mutex::new(Vec::new());
    let type_id = device.id().type_id;
    let key = (TypeId::of::<B>(), type_id);
    let mut counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, _, count)) = counts.iter().find(|(b, t, _)| (*b, *t) == key) {
        return count;
    }
    silence_probe_panics();
    PROBING.with(|p| p.set(true));
    let count = panic::catch_unwind(|| B::device_count(type_id)).unwrap_or(0);
    PROBING.with(|p| p.set(false));
    counts.push((key.0, key.1, count));
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    // What LibTorch's CPU device looks like on a machine without bf16 kernels.
    const SLOW_HALVES: Capabilities = Capabilities {
        f16: true,
        bf16: true,
        f16_slowdown: Some(50),
        bf16_slowdown: Some(12),
    };

    #[test]
    fn slowdown_is_flagged_from_the_factor_up() {
        let ms = Duration::from_millis;
        assert_eq!(slowdown(ms(10), ms(20)), None);
        assert_eq!(slowdown(ms(10), ms(79)), None);
        assert_eq!(slowdown(ms(10), ms(80)), Some(8));
        assert_eq!(slowdown(ms(10), ms(505)), Some(50));
        assert_eq!(slowdown(Duration::ZERO, ms(1)), Some(u32::MAX));
    }

    #[test]
    fn slow_precisions_run_but_are_not_fast() {
        let caps = Capabilities {
            bf16_slowdown: None,
            ..SLOW_HALVES
        };
        assert!(caps.runs(Precision::F16) && !caps.runs_fast(Precision::F16));
        assert!(caps.runs_fast(Precision::Bf16));
        assert_eq!(caps.slowdown(Precision::F16), Some(50));
        assert_eq!(caps.slowdown(Precision::F32), None);
        assert!(!caps.fast().contains(&Precision::F16));
        assert!(caps.fast().contains(&Precision::Bf16));
        assert!(caps.to_string().contains("f16 (50× slower)"), "{caps}");
    }

    #[test]
    fn check_names_the_slowdown_and_the_fast_precisions() {
        let err = check(
            &SLOW_HALVES,
            Precision::Bf16,
            || "libtorch<cpu>".into(),
            || "Cpu".into(),
        )
        .unwrap_err();
        match &err {
            AccelerateError::SlowPrecision {
                precision: Precision::Bf16,
                slowdown: 12,
                fast,
                ..
            } => assert!(!fast.contains("16"), "{fast}"),
            other => panic!("expected SlowPrecision, got {other:?}"),
        }
        let message = err.to_string();
        assert!(
            message.contains("12× slower") && message.contains("with_allow_slow(true)"),
            "{message}"
        );
        assert!(check(&SLOW_HALVES, Precision::F32, String::new, String::new).is_ok());
    }

    #[test]
    fn check_refuses_what_does_not_run_before_what_is_slow() {
        let caps = Capabilities {
            f16: false,
            f16_slowdown: None,
            ..SLOW_HALVES
        };
        let err = check(&caps, Precision::F16, String::new, String::new).unwrap_err();
        assert!(
            matches!(err, AccelerateError::UnsupportedPrecision { .. }),
            "{err:?}"
        );
    }
}
