//! What low precision a device can really run, found by running it.
//!
//! Backends' own flags are not enough: Candle reports bf16 as supported and its bf16 matmul
//! panics, while NdArray reports no half types and panics on the cast. So the probe runs a tiny
//! cast → matmul → add → cast-back program per dtype and checks the answer, once per backend
//! type and device, with the panic (if any) caught and kept quiet.
//!
//! Running is not enough either: LibTorch on a CPU runs f16 correctly but has no f16 matmul
//! kernel there, so f16 is about 50× slower than f32. The probe therefore also times a
//! square matmul in f32 and in each low dtype that runs, on the backend's own kernels, and
//! flags a dtype [`SLOW_FACTOR`] times slower or worse, so that autocast never picks it
//! silently. Where the crate runs a backend's half-precision ops on a path of its own (Flex),
//! nothing is flagged: autocast does not run the backend's kernels the timing measured (a
//! busy machine once timed Flex's own f16 matmul past the factor and refused f16 autocast,
//! which runs on the crate's path). Where the slow case is known, a rule decides instead of the timing
//! ([`KNOWN_HALF_KERNELS`]: LibTorch's CPU f16 is slow exactly where the CPU has no f16
//! arithmetic), because a timing taken beside other work can land on either side of the
//! factor: LibTorch's f32 matmul spreads over every core and slows most when one is busy
//! (measured at 7.4× instead of 50× on a 2-core Zen 4 with a compiler on the other core).
//! For devices no rule covers (accelerators), the timing remains the only decision one
//! takes, and its margin is wide: dtypes with real kernels measure 0.4–1.3× f32's time,
//! those without 12× and more.
//!
//! **Nothing else depends on a timing.** Which path a half-precision op takes, whether a small
//! op stays in f32 and which precision [`Capabilities::fastest`] picks are rules over the
//! backend, the device's kind, the CPU's instruction set and the op's shapes, so that the same
//! program on the same machine makes the same cast decisions and ends with the same bits
//! however busy the machine was when it started:
//! - where the crate has an f32 path for a backend's half-precision ops (Flex's: f32 sums over
//!   operands rounded to the half type, rounded once after; bf16 on the CPU's dot-product
//!   instructions where it has them, see [`HalfPath`]), autocast takes it;
//! - on the host's CPU a lower-class op below
//!   [`HOST_CPU_MIN_HALF_FLOPS`] stays in f32
//!   ([`SmallOps`](crate::autocast::SmallOps)); on an accelerator every one is cast;
//! - [`Capabilities::fastest`] picks bf16 on a CPU only where the crate runs it on bf16
//!   dot-product instructions, and on an accelerator the first half type that runs at speed.
//!
//! The times measured are kept ([`Capabilities::time_ratio`]) for `burn-accelerate env` to
//! print.

use std::any::TypeId;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{LazyLock, Mutex, Once, RwLock};
use std::time::{Duration, Instant};

use burn::tensor::{Tensor, TensorData};
use burn_backend::{Backend, DeviceId, DeviceOps, FloatDType};
use core::cell::Cell;
use core::fmt;
use serde::{Deserialize, Serialize};

use crate::context::{self, Context, ContextGuard, Setting, Slot};
use crate::cpu::table::{self as kernels, Route};
use crate::op_table::Op;
use crate::warnings;
use crate::{AccelerateError, Precision};

/// The flops ([`estimated_flops`](crate::autocast::estimated_flops)) from which a lower-class op runs in the half type on the
/// host's CPU under [`SmallOps::KeepF32`](crate::autocast::SmallOps::KeepF32): 2^24, about 16.8 MFLOP.
///
/// Chosen from step times on Flex (BENCHMARKS.md, issues 28 and 37): an LSTM at batch 32 trains
/// 1.8–4.3× slower in bf16 than in f32 when its gates are cast, up to hidden 256 at least,
/// whose largest product (`[32, 512] × [512, 256]`) is 8.4 MFLOP; a conv net's first
/// convolution (57 MFLOP) and an MLP's `[8, 512] × [512, 2048]` linear (16.8 MFLOP) and larger
/// gain from bf16 (0.49× and 0.52× f32's step). The threshold sits at twice the LSTM's product.
/// (Ops with large weights gain below it too: the MLP at 4 rows, 8.4 MFLOP, took 0.41× f32's
/// step. Flops alone cannot tell the two apart; a lower threshold would slow the LSTM, and
/// keeping an op in f32 is never slower than f32.) It is a constant, not a timing: until issue
/// 37 it was the probe's measured f32 rate times 200 µs, which moved with the load (15–41
/// MFLOP on the same machine) and could change a run's numbers from one start to the next.
pub const HOST_CPU_MIN_HALF_FLOPS: u64 = 1 << 24;

/// Which path autocast takes for a half-precision op where the crate has an f32 one for the
/// backend (see the [module docs](self)).
///
/// The crate's path sums in f32 over half operands. Its bf16 matmuls and convolutions run on
/// the CPU's AVX512-BF16 dot-product instructions where it has them (x86-64, e.g. AMD Zen 4,
/// Intel Cooper Lake and later): about twice as fast as the f32 GEMM, the sums in another
/// order. Elsewhere they widen the operands and run Flex's f32 kernels, which give Flex's own
/// bf16 bits. For f16 neither matches the backend's own kernels (Flex's f16 kernels sum in f16).
/// The choice is a rule, never a timing: a run that must give the same numbers on every
/// machine, or a test of one path, fixes it: for a training with `AccelerateConfig::half_path`
/// (or `AutocastConfig::half_path`: the threads that enter its autocast take it), for a thread
/// with [`scope_half_path`], for the process with [`Context::with_half_path`] and
/// [`Context::set_as_default`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum HalfPath {
    /// The crate's path wherever it has one, bf16 dot products included (the default).
    #[default]
    ViaF32,
    /// Always the crate's path with operands widened to f32 and Flex's f32 kernels (its GEMM,
    /// its convolution): the same bits on every CPU (for bf16, Flex's own), and slower.
    Widened,
    /// Always the backend's own kernels.
    Own,
}

impl Setting for HalfPath {
    const SLOT: Slot = Slot::HalfPath;
    fn unset() -> Self {
        HalfPath::ViaF32
    }
}

impl Context {
    /// This context with half-precision ops taking `path` where the crate has an f32 one.
    pub fn with_half_path(self, path: HalfPath) -> Context {
        self.with(path)
    }
}

/// The path half-precision ops take on this thread: its context's ([`scope_half_path`], an
/// entered autocast that sets one, or [`Context::with_half_path`]; [`HalfPath::ViaF32`]
/// unless set).
pub fn half_path() -> HalfPath {
    context::get::<HalfPath>()
}

/// Gives this thread `path` until the guard drops, whatever the process's is.
///
/// ```
/// use burn_accelerate::capability::{self, HalfPath};
///
/// let process = capability::half_path();
/// {
///     let _widened = capability::scope_half_path(HalfPath::Widened);
///     assert_eq!(capability::half_path(), HalfPath::Widened);
///     assert_eq!(std::thread::spawn(capability::half_path).join().unwrap(), process);
/// }
/// assert_eq!(capability::half_path(), process);
/// ```
pub fn scope_half_path(path: HalfPath) -> HalfPathGuard {
    context::scope(path)
}

/// Restores this thread's previous half path when dropped ([`scope_half_path`]); tied to its
/// thread.
pub type HalfPathGuard = ContextGuard;

// The route the crate's kernels take under the path set: only `Widened` fixes theirs.
pub(crate) fn route() -> Route {
    match half_path() {
        HalfPath::Widened => Route::Widened,
        HalfPath::ViaF32 | HalfPath::Own => Route::Fastest,
    }
}

/// Whether the crate's path runs bf16 matmuls and convolutions on this CPU's own bf16
/// instructions, AMX tiles or AVX512-BF16 dot products (see [`HalfPath`]): the CPU has them,
/// Flex is built in, and the process did not fix [`HalfPath::Widened`].
pub fn bf16_dot_products() -> bool {
    route() == Route::Fastest && kernels::has_bf16_dot_products()
}

/// The instructions the crate's path runs bf16 matmuls and convolutions on, on this thread
/// ([`bf16_dot_products`]): `"AMX tiles (tdpbf16ps)"` on an Intel Xeon with AMX whose tiles
/// Linux granted, `"AVX512-BF16 dot products (vdpbf16ps)"` on other CPUs with AVX512-BF16,
/// `None` elsewhere (the operands widened to f32).
///
/// ```
/// let kernel = burn_accelerate::capability::bf16_gemm_instructions();
/// assert_eq!(kernel.is_some(), burn_accelerate::capability::bf16_dot_products());
/// ```
pub fn bf16_gemm_instructions() -> Option<&'static str> {
    kernels::bf16_gemm_instructions().filter(|_| route() == Route::Fastest)
}

/// Whether the crate's bf16 GEMMs use this CPU's AMX tiles, and why not where they do not
/// (no AMX-BF16, a kernel before Linux 5.16, `arch_prctl` refused): what
/// `burn-accelerate env` prints.
pub fn amx_status() -> String {
    kernels::amx_status()
}

/// How many times slower than f32 a low dtype's matmul must be for the probe to flag it.
///
/// Far above what a dtype with real kernels costs (Flex's half matmuls, lavapipe's f16) and
/// far below a dtype with none (LibTorch CPU f16, about 50×): the probe's timing runs on a
/// busy machine and must not flip between the two.
pub const SLOW_FACTOR: f32 = 8.0;

/// A backend's half type whose speed on the host's CPU is known from the CPU's instructions:
/// it has a matmul kernel exactly where the CPU has `fast_with`, and is [`SLOW_FACTOR`] times
/// slower than f32 or worse elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownHalfKernel {
    /// The backend and device, as `Backend::name` reports them.
    pub backend: &'static str,
    /// The half type.
    pub dtype: FloatDType,
    /// The CPU feature (as `is_x86_feature_detected!` names it) its kernel needs.
    pub fast_with: &'static str,
}

/// The half types whose speed the probe reads from the CPU instead of its timing.
///
/// LibTorch 2.9 on a CPU multiplies f16 with f16 arithmetic (AVX512-FP16: Intel Sapphire
/// Rapids and later) or, lacking it, element by element: 50–60× f32's time on a quiet Zen 4.
/// Its bf16 has kernels on every x86 CPU (oneDNN's, AVX512-BF16 or converted), so it is not
/// listed, and is timed.
pub const KNOWN_HALF_KERNELS: [KnownHalfKernel; 1] = [KnownHalfKernel {
    backend: "libtorch<cpu>",
    dtype: FloatDType::F16,
    fast_with: "avx512fp16",
}];

// Whether this CPU has `feature` (one of those `KNOWN_HALF_KERNELS` names).
fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match feature {
            "avx512fp16" => std::is_x86_feature_detected!("avx512fp16"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

// Whether a rule says `dtype` is slow on backend `name` (`Some(true)`), fast (`Some(false)`),
// or no rule covers it (`None`: the timing decides).
fn known_slow(name: &str, dtype: FloatDType, has: impl Fn(&str) -> bool) -> Option<bool> {
    KNOWN_HALF_KERNELS
        .iter()
        .find(|rule| rule.backend == name && rule.dtype == dtype)
        .map(|rule| !has(rule.fast_with))
}

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
    /// f16's matmul time as a percentage of f32's, on the backend's own kernels; `None` where
    /// f16 does not run or could not be timed.
    pub f16_time_pct: Option<u32>,
    /// bf16's matmul time as a percentage of f32's, as `f16_time_pct`.
    pub bf16_time_pct: Option<u32>,
    /// Autocast runs f16's lower-class ops in f32 over operands rounded to f16, rounded once
    /// after: f16 runs and the crate has that path for the backend (Flex).
    pub f16_via_f32: bool,
    /// The same for bf16.
    pub bf16_via_f32: bool,
    /// The flops below which a lower-class op runs in f32 under
    /// [`SmallOps::KeepF32`](crate::autocast::SmallOps::KeepF32):
    /// [`HOST_CPU_MIN_HALF_FLOPS`] on the host's CPU;
    /// `None` on an accelerator, where every lower-class op is cast, as PyTorch does.
    pub min_half_flops: Option<u64>,
    /// The device computes on the host's CPU (Flex, NdArray, LibTorch's and Candle's CPU
    /// devices), by the backend's name.
    pub host_cpu: bool,
    /// The crate's path runs bf16 matmuls and convolutions on this CPU's own bf16
    /// instructions (AMX tiles or AVX512-BF16 dot products): `bf16_via_f32` and the CPU has
    /// them.
    pub bf16_dot_products: bool,
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

    /// `precision`'s matmul time over f32's, as the probe measured it on the backend's own
    /// kernels (1.0 for f32; `None` where it does not run or was not timed). Below 1.0 is
    /// faster. fp8 is emulated in f32, so it is never timed.
    pub fn time_ratio(&self, precision: Precision) -> Option<f32> {
        let pct = match precision {
            Precision::F32 => return Some(1.0),
            _ => match precision.low_dtype() {
                Some(FloatDType::F16) => self.f16_time_pct,
                Some(FloatDType::BF16) => self.bf16_time_pct,
                _ => None,
            },
        };
        pct.map(|pct| pct as f32 / 100.0)
    }

    /// Whether autocast runs `precision`'s lower-class ops in f32 over operands rounded to
    /// its dtype (rounded once after): where it runs and the crate has that path for the
    /// backend.
    pub fn via_f32(&self, precision: Precision) -> bool {
        match precision.low_dtype() {
            Some(FloatDType::F16) => self.f16_via_f32,
            Some(FloatDType::BF16) => self.bf16_via_f32,
            _ => false,
        }
    }

    /// The fastest precision this device runs, by rule (never by a timing, which would let
    /// the machine's load choose a model's precision).
    ///
    /// On an accelerator, the first of bf16 (f32's range, no loss scaling) and f16 that runs
    /// and is not flagged slow; on the host's CPU, bf16 where the crate runs it on the CPU's
    /// bf16 dot-product instructions (about twice f32's GEMM rate), else f32: without them a
    /// half precision runs the f32 GEMM plus its conversions, never faster. fp8 is emulated
    /// in f32 and never picked.
    ///
    /// ```
    /// use burn_accelerate::Precision;
    /// use burn_accelerate::capability::Capabilities;
    ///
    /// let gpu = Capabilities {
    ///     f16: true, bf16: true, f16_slowdown: None, bf16_slowdown: None,
    ///     f16_time_pct: Some(30), bf16_time_pct: Some(31),
    ///     f16_via_f32: false, bf16_via_f32: false, min_half_flops: None,
    ///     host_cpu: false, bf16_dot_products: false,
    /// };
    /// assert_eq!(gpu.fastest(), Precision::Bf16);
    /// let f16_gpu = Capabilities { bf16: false, ..gpu };
    /// assert_eq!(f16_gpu.fastest(), Precision::F16);
    /// let cpu = Capabilities {
    ///     host_cpu: true, f16_via_f32: true, bf16_via_f32: true,
    ///     min_half_flops: Some(16_000_000), ..gpu
    /// };
    /// assert_eq!(cpu.fastest(), Precision::F32);
    /// let zen4 = Capabilities { bf16_dot_products: true, ..cpu };
    /// assert_eq!(zen4.fastest(), Precision::Bf16);
    /// ```
    pub fn fastest(&self) -> Precision {
        if self.host_cpu {
            return if self.bf16_dot_products && self.runs_fast(Precision::Bf16) {
                Precision::Bf16
            } else {
                Precision::F32
            };
        }
        [Precision::Bf16, Precision::F16]
            .into_iter()
            .find(|p| self.runs_fast(*p))
            .unwrap_or(Precision::F32)
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
    /// The usable precisions, each slow one with its slowdown and each other timed one with
    /// its time ratio: `f32, bf16 (0.97× f32's time), f16 (50× slower)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self
            .usable()
            .iter()
            .map(|p| match (self.slowdown(*p), self.time_ratio(*p)) {
                (Some(x), _) => format!("{p} ({x}× slower)"),
                (None, Some(r)) if p.is_mixed() => format!("{p} ({r:.2}× f32's time)"),
                _ => p.to_string(),
            })
            .collect();
        f.write_str(&names.join(", "))
    }
}

type Key = (TypeId, DeviceId);

// What the process has found out about its devices, each fact once: the capabilities of each
// (backend, device), the device counts asked, the f32 fallbacks reported; and the panic hook
// that keeps probes quiet, installed once.
struct Probes {
    capabilities: RwLock<HashMap<Key, Capabilities>>,
    device_counts: Mutex<Vec<(TypeId, u16, usize)>>,
    fallbacks: Mutex<Vec<Fallback>>,
    quiet_panics: Once,
}

static PROBES: LazyLock<Probes> = LazyLock::new(|| Probes {
    capabilities: RwLock::default(),
    device_counts: Mutex::default(),
    fallbacks: Mutex::default(),
    quiet_panics: Once::new(),
});

// A thread's side of the probe.
struct OnThread {
    // The last lookup: a training step asks about the same device over and over.
    last: Cell<Option<(Key, Capabilities)>>,
    // A probe runs on this thread: its panics stay quiet.
    probing: Cell<bool>,
}

thread_local! {
    static ON_THREAD: OnThread = const {
        OnThread {
            last: Cell::new(None),
            probing: Cell::new(false),
        }
    };
}

fn set_probing(probing: bool) {
    ON_THREAD.with(|thread| thread.probing.set(probing));
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
    if let Some((k, caps)) = ON_THREAD.with(|thread| thread.last.get())
        && k == key
    {
        return caps;
    }
    let cached = PROBES
        .capabilities
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&key)
        .copied();
    let caps = cached.unwrap_or_else(|| {
        let f16 = runs_dtype::<B>(device, FloatDType::F16);
        let bf16 = runs_dtype::<B>(device, FloatDType::BF16);
        let own_path = kernels::of::<B>().is_some();
        let timed = timings::<B>(device, f16, bf16);
        let name = B::name(device);
        let host_cpu = on_host_cpu(&name);
        let flag = |dtype, timed: Option<Timed>| flagged(&name, dtype, timed, own_path, cpu_has);
        let caps = Capabilities {
            f16,
            bf16,
            f16_slowdown: flag(FloatDType::F16, timed.f16),
            bf16_slowdown: flag(FloatDType::BF16, timed.bf16),
            f16_time_pct: timed.f16.map(|t| t.time_pct),
            bf16_time_pct: timed.bf16.map(|t| t.time_pct),
            f16_via_f32: f16 && own_path,
            bf16_via_f32: bf16 && own_path,
            // On an accelerator, small ops are cheap to cast and gain from its half units:
            // the rule is the CPU's (issue 28), and PyTorch's there.
            min_half_flops: host_cpu.then_some(HOST_CPU_MIN_HALF_FLOPS),
            host_cpu,
            bf16_dot_products: bf16 && own_path && kernels::has_bf16_dot_products(),
        };
        PROBES
            .capabilities
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, caps);
        caps
    });
    ON_THREAD.with(|thread| thread.last.set(Some((key, caps))));
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

// The slowdown the probe reports for a timed half type: none where the crate runs the half
// type's ops on a path of its own (`own_path`: Flex's, which autocast takes by rule, so the
// backend's own kernels' speed says nothing of autocast's, and a timing beside other work
// must not refuse it); by the rule where one covers it (the measured figure, raised to the
// factor where the measurement fell short of the rule); by the timing elsewhere.
fn flagged(
    name: &str,
    dtype: FloatDType,
    timed: Option<Timed>,
    own_path: bool,
    has: impl Fn(&str) -> bool,
) -> Option<u32> {
    if own_path {
        return None;
    }
    let timed = timed?;
    match known_slow(name, dtype, has) {
        Some(false) => None,
        Some(true) => Some((timed.time_pct / 100).max(SLOW_FACTOR as u32)),
        None => timed.slowdown,
    }
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
    set_probing(true);
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
    set_probing(false);
    // [[1,2],[3,4]] · its transpose + itself, exact in every half type.
    matches!(result, Ok(Ok(v)) if v == [6.0, 13.0, 14.0, 29.0])
}

// What the probe timed of one half dtype, on the backend's own kernels.
#[derive(Clone, Copy)]
struct Timed {
    time_pct: u32,
    slowdown: Option<u32>,
}

#[derive(Default)]
struct Timings {
    f16: Option<Timed>,
    bf16: Option<Timed>,
}

// Whether a backend named `name` (`Backend::name`, through any decorators) computes on the
// host's CPU: Flex, NdArray, and the `<cpu>` devices of LibTorch, Candle and cubecl.
fn on_host_cpu(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["flex", "ndarray", "<cpu>"]
        .iter()
        .any(|n| name.contains(n))
}

// The times of f16 and bf16 against f32, for those that run, on the backend's own kernels:
// whether the device has half-precision kernels at all. (Where the crate has a path of its
// own, autocast takes it by rule; timing it would say more about the build, an unoptimised
// debug build of this crate running it tens of times slower, than about the device.)
fn timings<B: Backend>(device: &B::Device, f16: bool, bf16: bool) -> Timings {
    let mut dtypes = vec![FloatDType::F32];
    dtypes.extend(
        [(FloatDType::F16, f16), (FloatDType::BF16, bf16)]
            .into_iter()
            .filter_map(|(dtype, runs)| runs.then_some(dtype)),
    );
    if dtypes.len() == 1 {
        return Timings::default();
    }
    let Some(times) = matmul_times::<B>(device, &dtypes) else {
        return Timings::default();
    };
    let of = |dtype: FloatDType| {
        let i = dtypes.iter().position(|d| *d == dtype)?;
        let ratio = times[i].as_secs_f64() / times[0].as_secs_f64().max(f64::MIN_POSITIVE);
        Some(Timed {
            time_pct: (ratio * 100.0).round().min(u32::MAX as f64) as u32,
            slowdown: slowdown(times[0], times[i]),
        })
    };
    Timings {
        f16: of(FloatDType::F16),
        bf16: of(FloatDType::BF16),
    }
}

// The best of six timed N×N matmuls per dtype, each read back to the host (which waits for
// lazy and asynchronous backends). The dtypes take turns, so that a burst of load elsewhere
// on the machine slows them alike; an untimed first round pays for kernel compilation and
// allocation. `None` if any panicked.
fn matmul_times<B: Backend>(device: &B::Device, dtypes: &[FloatDType]) -> Option<Vec<Duration>> {
    silence_probe_panics();
    set_probing(true);
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let n = TIMED_MATMUL_SIZE;
        let inputs: Vec<Tensor<B, 2>> = dtypes
            .iter()
            .map(|dtype| Tensor::<B, 2>::ones([n, n], device).cast(*dtype))
            .collect();
        let mut best = vec![Duration::MAX; dtypes.len()];
        for round in 0..7 {
            for (x, best) in inputs.iter().zip(&mut best) {
                let start = Instant::now();
                x.clone().matmul(x.clone()).into_data();
                if round > 0 {
                    *best = (*best).min(start.elapsed());
                }
            }
        }
        best
    }));
    set_probing(false);
    result.ok()
}

// Installs, once, a panic hook that stays quiet for panics raised inside a probe on the
// probing thread and defers to the previous hook for everything else.
fn silence_probe_panics() {
    PROBES.quiet_panics.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !ON_THREAD.with(|thread| thread.probing.get()) {
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

/// Every f32 fallback autocast has taken in this process, once per backend, device and precision.
pub fn fallbacks() -> Vec<Fallback> {
    PROBES
        .fallbacks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
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
    // Reported in the order they happened, once per backend, device and precision.
    warnings::once("autocast falls back to f32", key, || {
        let fallback = Fallback {
            backend: B::name(device),
            device: format!("{device:?}"),
            requested: precision,
            op,
        };
        log::warn!("burn-accelerate autocast: {fallback}");
        PROBES
            .fallbacks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(fallback);
    });
    FloatDType::F32
}

// A bare guard is an explicit request, so a slow dtype runs; but not silently.
fn warn_slow_once<B: Backend>(
    device: &B::Device,
    key: (Key, Precision),
    precision: Precision,
    slowdown: u32,
) {
    warnings::once("autocast runs a slow precision", key, || {
        log::warn!(
            "burn-accelerate autocast: {precision} on {} ({device:?}) runs about {slowdown}× \
             slower than f32; `AutocastConfig::init` would have refused it",
            B::name(device)
        );
    });
}

/// How many devices of `device`'s kind backend `B` sees, 0 where asking panics.
///
/// `Backend::device_count` for CUDA panics on a machine without a driver; this asks with the
/// panic caught, so a program or test can skip instead of crashing. The answer is kept for
/// the process: CUDA's runtime panics on its own server thread, where the panic cannot be
/// kept quiet, so asking once prints its message once.
pub fn device_count<B: Backend>(device: &B::Device) -> usize {
    let type_id = device.id().type_id;
    let key = (TypeId::of::<B>(), type_id);
    let mut counts = PROBES
        .device_counts
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, _, count)) = counts.iter().find(|(b, t, _)| (*b, *t) == key) {
        return count;
    }
    silence_probe_panics();
    set_probing(true);
    let count = panic::catch_unwind(|| B::device_count(type_id)).unwrap_or(0);
    set_probing(false);
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
        f16_time_pct: Some(5000),
        bf16_time_pct: Some(1200),
        f16_via_f32: false,
        bf16_via_f32: false,
        min_half_flops: None,
        host_cpu: true,
        bf16_dot_products: false,
    };

    #[test]
    fn the_fastest_precision_is_a_rule_not_a_timing() {
        let timed = |f16: Option<u32>, bf16: Option<u32>| Capabilities {
            f16_slowdown: None,
            bf16_slowdown: None,
            f16_time_pct: f16,
            bf16_time_pct: bf16,
            ..SLOW_HALVES
        };
        let gpu = |caps: Capabilities| Capabilities {
            host_cpu: false,
            ..caps
        };
        // Whatever the times say: on an accelerator bf16 first, then f16.
        for (f16, bf16) in [(Some(30), Some(42)), (Some(95), Some(99)), (None, None)] {
            assert_eq!(gpu(timed(f16, bf16)).fastest(), Precision::Bf16);
        }
        let no_bf16 = Capabilities {
            bf16: false,
            ..gpu(timed(Some(90), Some(10)))
        };
        assert_eq!(no_bf16.fastest(), Precision::F16);
        // Slow or not running: never picked.
        assert_eq!(gpu(SLOW_HALVES).fastest(), Precision::F32);
        // On the CPU, bf16 only on its dot-product instructions, however fast it timed.
        assert_eq!(timed(Some(40), Some(40)).fastest(), Precision::F32);
        let dot = Capabilities {
            bf16_dot_products: true,
            ..timed(Some(95), Some(120))
        };
        assert_eq!(dot.fastest(), Precision::Bf16);
        assert_eq!(
            timed(Some(50), Some(97)).time_ratio(Precision::F16),
            Some(0.5)
        );
        assert_eq!(timed(None, None).time_ratio(Precision::F32), Some(1.0));
        let shown = timed(Some(50), Some(97)).to_string();
        assert!(
            shown.starts_with("f32, bf16 (0.97× f32's time), f16 (0.50× f32's time)"),
            "{shown}"
        );
    }

    #[test]
    fn a_known_half_kernel_is_flagged_by_the_cpu_not_the_timing() {
        let timed = |pct: u32| {
            Some(Timed {
                time_pct: pct,
                slowdown: slowdown(
                    Duration::from_millis(100),
                    Duration::from_millis(pct as u64),
                ),
            })
        };
        let lacks = |_: &str| false;
        let has = |f: &str| f == "avx512fp16";
        let f16 = FloatDType::F16;
        // LibTorch's CPU f16 without AVX512-FP16: slow, even where a busy machine timed it
        // under the factor; the figure is the measured one where it reaches the factor.
        assert_eq!(
            flagged("libtorch<cpu>", f16, timed(743), false, lacks),
            Some(8)
        );
        assert_eq!(
            flagged("libtorch<cpu>", f16, timed(5949), false, lacks),
            Some(59)
        );
        // With it: fast, whatever the timing said.
        assert_eq!(flagged("libtorch<cpu>", f16, timed(5949), false, has), None);
        assert_eq!(flagged("libtorch<cpu>", f16, timed(80), false, has), None);
        // Untimed (f16 does not run): nothing to flag.
        assert_eq!(flagged("libtorch<cpu>", f16, None, false, lacks), None);
        // No rule for LibTorch's bf16 or a GPU: the timing decides.
        let bf16 = FloatDType::BF16;
        assert_eq!(
            flagged("libtorch<cpu>", bf16, timed(1200), false, lacks),
            Some(12)
        );
        assert_eq!(
            flagged("libtorch<cpu>", bf16, timed(120), false, lacks),
            None
        );
        assert_eq!(
            flagged("libtorch<cuda>", f16, timed(5000), false, lacks),
            Some(50)
        );
        // Where the crate runs the half type on its own path (Flex's), never, whatever the
        // backend's own kernels measured: autocast does not run them.
        assert_eq!(flagged("flex", f16, timed(5000), true, lacks), None);
        assert_eq!(flagged("flex", bf16, timed(1200), true, lacks), None);
    }

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
    fn the_small_op_rule_is_the_host_cpu_s() {
        for cpu in [
            "flex",
            "autodiff<flex>",
            "ndarray",
            "libtorch<cpu>",
            "candle<cpu>",
        ] {
            assert!(on_host_cpu(cpu), "{cpu}");
        }
        for gpu in [
            "libtorch<cuda>",
            "cubecl<cuda>",
            "cubecl<wgpu<vulkan>>",
            "candle<metal>",
        ] {
            assert!(!on_host_cpu(gpu), "{gpu}");
        }
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
