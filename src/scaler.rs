//! Loss scaling, as plain values in the spirit of DeepMind's `jmp`: [`LossScale::None`],
//! [`LossScale::Static`] and [`LossScale::Dynamic`], each with `scale` (multiply the loss),
//! `unscale` (divide a gradient) and `adjust` (the update after an optimizer step).
//!
//! The dynamic scale is torch's `GradScaler`, defaults and arithmetic included: the scale is an
//! f32, every update is `f32(scale as f64 * factor)`, a growth that would overflow to infinity
//! is refused (the growth tracker still resets), and a step whose scaled gradients hold an inf
//! or a NaN is skipped. It is on by default only for f16 ([`Precision::wants_loss_scaling`]), as
//! in Accelerate.
//!
//! ```
//! use burn_accelerate::scaler::{DynamicLossScale, LossScale};
//!
//! let mut scale = LossScale::Dynamic(DynamicLossScale::default()); // 2^16, x2 every 2000
//! assert_eq!(scale.loss_scale(), 65536.0);
//! scale = scale.adjust(true); // overflow: back off
//! assert_eq!(scale.loss_scale(), 32768.0);
//! ```
//!
//! The module also holds the process-wide *armed* scale ([`ArmedLossScale`]), which
//! `Accelerated<B>`'s `backward` applies, so that an unmodified `loss.backward()` in a Burn
//! `TrainStep` produces scaled gradients.

use burn::config::Config;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::context::{self, ContextGuard, Setting, Slot};
use crate::loss_transform::LossTransform;
use crate::{AccelerateError, Precision};

/// torch's `GradScaler` defaults.
const INIT_SCALE: f64 = 65536.0;
const GROWTH_FACTOR: f64 = 2.0;
const BACKOFF_FACTOR: f64 = 0.5;
const GROWTH_INTERVAL: u32 = 2000;

/// The loss scale in force: none, a fixed one, or torch's dynamic one.
///
/// A plain value: [`adjust`](LossScale::adjust) returns the next one. Serialises (with serde)
/// for checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LossScale {
    /// No scaling: losses and gradients pass unchanged and nothing is checked, as with torch's
    /// `GradScaler(enabled=False)`.
    #[default]
    None,
    /// A fixed scale. Overflowing steps are still detected and skipped; the scale never
    /// changes.
    Static {
        /// The factor the loss is multiplied by.
        #[serde(deserialize_with = "saved_static_scale")]
        scale: f32,
    },
    /// torch's `GradScaler`: backs off on overflow, grows after a run of clean steps.
    Dynamic(DynamicLossScale),
}

impl LossScale {
    /// The factor the loss is multiplied by (1 for [`LossScale::None`]).
    pub fn loss_scale(&self) -> f32 {
        match self {
            LossScale::None => 1.0,
            LossScale::Static { scale } => *scale,
            LossScale::Dynamic(dynamic) => dynamic.scale(),
        }
    }

    /// Whether gradients are checked for overflow (and steps skipped on it).
    pub fn checks_overflow(&self) -> bool {
        !matches!(self, LossScale::None)
    }

    /// The factor gradients are multiplied by to undo the scale, computed as torch does:
    /// `f32(1 / (scale as f64))` (infinite once the scale has underflowed to 0).
    pub fn inv_scale(&self) -> f32 {
        match self {
            LossScale::None => 1.0,
            _ => (1.0 / f64::from(self.loss_scale())) as f32,
        }
    }

    /// Multiplies `loss` by the scale (nothing for [`LossScale::None`]).
    pub fn scale<B: Backend, const D: usize>(&self, loss: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            LossScale::None => loss,
            _ => loss.mul_scalar(self.loss_scale()),
        }
    }

    /// Multiplies one gradient by [`inv_scale`](LossScale::inv_scale). For all gradients of a
    /// model at once, with the overflow check, see
    /// [`grads::unscale_and_check`](crate::grads::unscale_and_check).
    pub fn unscale<B: Backend, const D: usize>(&self, grad: Tensor<B, D>) -> Tensor<B, D> {
        match self.inv_scale() {
            1.0 => grad,
            inv => grad.mul_scalar(inv),
        }
    }

    /// The scale after an optimizer step whose scaled gradients did (`found_inf`) or did not
    /// overflow. Only the dynamic scale changes.
    #[must_use = "adjust returns the new scale; it does not change this one"]
    pub fn adjust(self, found_inf: bool) -> Self {
        match self {
            LossScale::Dynamic(dynamic) => LossScale::Dynamic(dynamic.adjust(found_inf)),
            other => other,
        }
    }
}

/// torch's dynamic loss scale (`torch.amp.GradScaler`), as a value.
///
/// ```
/// use burn_accelerate::scaler::DynamicLossScale;
///
/// let scale = DynamicLossScale::new(891.0, 1.1, 0.9, 1).unwrap();
/// // f32(891 * 1.1 in f64), as torch stores it; the f32 product would be 980.10004.
/// assert_eq!(scale.adjust(false).scale(), 980.1f32);
/// assert_eq!(scale.adjust(true).scale(), (891.0f64 * 0.9) as f32);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DynamicLossScaleFields")]
pub struct DynamicLossScale {
    scale: f32,
    growth_tracker: u32,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
}

impl Default for DynamicLossScale {
    /// torch's defaults: scale 2^16, growth 2.0 every 2000 clean steps, backoff 0.5.
    fn default() -> Self {
        Self {
            scale: INIT_SCALE as f32,
            growth_tracker: 0,
            growth_factor: GROWTH_FACTOR,
            backoff_factor: BACKOFF_FACTOR,
            growth_interval: GROWTH_INTERVAL,
        }
    }
}

impl DynamicLossScale {
    /// A dynamic scale starting at `init_scale` (rounded to f32, as torch stores it).
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] when `init_scale` is not a positive finite f32,
    /// `growth_factor` ≤ 1, `backoff_factor` outside (0, 1), or `growth_interval` is 0.
    pub fn new(
        init_scale: f64,
        growth_factor: f64,
        backoff_factor: f64,
        growth_interval: u32,
    ) -> Result<Self, AccelerateError> {
        let scale = init_scale as f32;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(invalid(
                "grad_scaler.init_scale",
                init_scale,
                "set a positive scale that fits an f32, e.g. 65536 (torch's default)",
            ));
        }
        if !(growth_factor.is_finite() && growth_factor > 1.0) {
            return Err(invalid(
                "grad_scaler.growth_factor",
                growth_factor,
                "set a finite factor above 1, e.g. 2.0 (torch's default)",
            ));
        }
        if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
            return Err(invalid(
                "grad_scaler.backoff_factor",
                backoff_factor,
                "set a factor strictly between 0 and 1, e.g. 0.5 (torch's default)",
            ));
        }
        if growth_interval == 0 {
            return Err(invalid(
                "grad_scaler.growth_interval",
                growth_interval,
                "set at least 1 clean step between growths, e.g. 2000 (torch's default)",
            ));
        }
        Ok(Self {
            scale,
            growth_tracker: 0,
            growth_factor,
            backoff_factor,
            growth_interval,
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Clean steps since the last growth or backoff (torch's `_growth_tracker`).
    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// The factor the scale grows by.
    pub fn growth_factor(&self) -> f64 {
        self.growth_factor
    }

    /// The factor the scale backs off by.
    pub fn backoff_factor(&self) -> f64 {
        self.backoff_factor
    }

    /// How many clean steps in a row make the scale grow.
    pub fn growth_interval(&self) -> u32 {
        self.growth_interval
    }

    /// The scale after a step: torch's `_amp_update_scale_`, in the same arithmetic.
    #[must_use = "adjust returns the new scale; it does not change this one"]
    pub fn adjust(self, found_inf: bool) -> Self {
        if found_inf {
            return Self {
                scale: (f64::from(self.scale) * self.backoff_factor) as f32,
                growth_tracker: 0,
                ..self
            };
        }
        let successful = self.growth_tracker + 1;
        if successful < self.growth_interval {
            return Self {
                growth_tracker: successful,
                ..self
            };
        }
        let grown = (f64::from(self.scale) * self.growth_factor) as f32;
        Self {
            // A growth into infinity is refused; the run of clean steps still counts as used.
            scale: if grown.is_finite() { grown } else { self.scale },
            growth_tracker: 0,
            ..self
        }
    }
}

// What a checkpoint holds; checked on the way in, so that a hand-edited or foreign checkpoint
// cannot produce a scale that `DynamicLossScale::new` would refuse.
#[derive(Deserialize)]
struct DynamicLossScaleFields {
    scale: f32,
    growth_tracker: u32,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
}

impl TryFrom<DynamicLossScaleFields> for DynamicLossScale {
    type Error = AccelerateError;

    fn try_from(f: DynamicLossScaleFields) -> Result<Self, Self::Error> {
        // The scale itself may legitimately have backed off to 0 (torch lets it underflow), so
        // only its sign and finiteness are checked; the factors are checked as in `new`.
        let checked = Self::new(1.0, f.growth_factor, f.backoff_factor, f.growth_interval)?;
        if !(f.scale.is_finite() && f.scale >= 0.0) {
            return Err(invalid(
                "grad_scaler.scale",
                f.scale,
                "a saved scale must be finite and not negative",
            ));
        }
        if f.growth_tracker >= f.growth_interval {
            return Err(invalid(
                "grad_scaler.growth_tracker",
                f.growth_tracker,
                "a saved growth tracker must be below the growth interval",
            ));
        }
        Ok(Self {
            scale: f.scale,
            growth_tracker: f.growth_tracker,
            ..checked
        })
    }
}

// A static scale read back (a checkpoint): finite and positive, as the configuration that
// made it required; a damaged or hand-edited file otherwise scales every loss by it.
fn saved_static_scale<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<f32, D::Error> {
    let scale = f32::deserialize(deserializer)?;
    if scale.is_finite() && scale > 0.0 {
        Ok(scale)
    } else {
        Err(serde::de::Error::custom(format!(
            "a saved static loss scale must be finite and positive, not {scale}"
        )))
    }
}

fn invalid(field: &'static str, value: impl ToString, fix: &'static str) -> AccelerateError {
    AccelerateError::InvalidConfig {
        field,
        value: value.to_string(),
        fix,
    }
}

/// Loss-scaler settings, with Accelerate's `GradScalerKwargs` names and torch's defaults.
///
/// ```
/// use burn_accelerate::scaler::{GradScalerConfig, LossScale};
/// use burn_accelerate::Precision;
///
/// // On by default for fp16 only, as in Accelerate.
/// assert!(matches!(GradScalerConfig::new().init(Precision::F16)?, LossScale::Dynamic(_)));
/// assert_eq!(GradScalerConfig::new().init(Precision::Bf16)?, LossScale::None);
/// // Invalid settings are typed errors that say what to change.
/// assert!(GradScalerConfig::new().with_backoff_factor(1.5).init(Precision::F16).is_err());
/// # Ok::<(), burn_accelerate::AccelerateError>(())
/// ```
#[derive(Config, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// Whether to scale at all; `None` follows the precision (on for fp16 only).
    pub enabled: Option<bool>,
    /// The scale to start from (stored as f32).
    #[config(default = 65536.0)]
    pub init_scale: f64,
    /// The factor the scale grows by after `growth_interval` clean steps.
    #[config(default = 2.0)]
    pub growth_factor: f64,
    /// The factor the scale backs off by after an overflowing step.
    #[config(default = 0.5)]
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows.
    #[config(default = 2000)]
    pub growth_interval: u32,
    /// `false` keeps `init_scale` fixed: a static scale (overflowing steps are still skipped).
    #[config(default = true)]
    pub dynamic: bool,
}

impl GradScalerConfig {
    /// The loss scale for a run in `precision`.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for a setting torch's `GradScaler` would misbehave
    /// with (see [`DynamicLossScale::new`]); checked even when scaling is off, so a config
    /// that is wrong fails the first time it is used.
    pub fn init(&self, precision: Precision) -> Result<LossScale, AccelerateError> {
        let dynamic = DynamicLossScale::new(
            self.init_scale,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )?;
        if !self
            .enabled
            .unwrap_or_else(|| precision.wants_loss_scaling())
        {
            return Ok(LossScale::None);
        }
        Ok(if self.dynamic {
            LossScale::Dynamic(dynamic)
        } else {
            LossScale::Static {
                scale: dynamic.scale(),
            }
        })
    }
}

// The process's armed transform ([`ArmedLossScale`], a guard for loops the crate does not
// run, on threads it does not start; kept beside the contexts, not in the process's one, so
// that a context entered while it is armed does not keep it after the guard drops): the scale's f32 bits in the low half, the divisor in bits 32..56,
// then flags. A flag for the scale (rather than 0 meaning "off") keeps a scale that has backed
// off to exactly 0.0 armed, as torch keeps multiplying by it.
static ARMED_SCALE: AtomicU64 = AtomicU64::new(0);
const ARMED: u64 = 1 << 63;
const HAS_SCALE: u64 = 1 << 62;
const DIVISOR_SHIFT: u32 = 32;
const DIVISOR_MASK: u64 = (1 << 24) - 1;

// The armed transform, a context setting (`None`: nothing armed there).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Armed(Option<LossTransform>);

impl Setting for Armed {
    const SLOT: Slot = Slot::LossTransform;
    fn unset() -> Self {
        Armed(None)
    }
}

/// The loss scale `Accelerated<B>`'s `backward` multiplies the loss by on this thread, if
/// armed ([`armed_transform`]).
///
/// Read once per `backward` call, from any thread (Burn's multi-device loop runs steps on
/// worker threads).
#[inline]
pub fn armed() -> Option<f32> {
    armed_transform().and_then(|t| t.scale)
}

/// What `Accelerated<B>`'s `backward` does to the loss on this thread, if armed: divide it by
/// the window's length, then multiply it by the loss scale ([`LossTransform`]). The thread's
/// context's arming (the `with_accelerate` strategy's, on the threads that run its steps)
/// comes first, then the process's ([`ArmedLossScale`]).
#[inline]
pub fn armed_transform() -> Option<LossTransform> {
    context::get::<Armed>()
        .0
        .or_else(|| decode(ARMED_SCALE.load(Ordering::Acquire)))
}

/// Arms a loss transform for `Accelerated<B>`'s `backward` on this thread only, until
/// dropped: how the `with_accelerate` strategy arms the threads that run its steps, so that
/// two trainings on two threads of one process never scale each other's losses. Tied to its
/// thread (not `Send`).
#[derive(Debug)]
#[must_use = "the transform is only armed while the guard lives"]
pub(crate) struct ThreadArmed(ContextGuard);

impl ThreadArmed {
    /// Arms `transform` on this thread (nothing, where it leaves the loss as it is).
    pub(crate) fn arm(transform: LossTransform) -> Self {
        Self(context::scope(armed_on_thread(transform)))
    }

    /// Replaces the armed transform (after the loss scale changed).
    pub(crate) fn set(&self, transform: LossTransform) {
        self.0.set(armed_on_thread(transform));
    }
}

// A transform that leaves the loss as it is arms nothing (the process's then applies).
fn armed_on_thread(transform: LossTransform) -> Armed {
    Armed((!transform.is_identity()).then_some(transform))
}

/// Arms a loss scale for `Accelerated<B>`'s `backward` until dropped, process-wide.
///
/// This is how a training loop that does not call the loss's backward itself (a user's Burn
/// `TrainStep`, where `loss.backward()` is unmodified) gets scaled gradients: while armed,
/// `Accelerated<Autodiff<B>>` multiplies the loss by the scale before differentiating. The
/// loop then unscales the resulting gradients with
/// [`grads::unscale_and_check`](crate::grads::unscale_and_check), as the
/// [`Accelerator`](crate::Accelerator) does, and [`set`](ArmedLossScale::set)s the adjusted scale
/// after each step.
///
/// The [`Accelerator`](crate::Accelerator) never arms: it scales the loss it is given itself,
/// and an armed scale would scale it twice. Arm from one training loop at a time; dropping
/// the guard restores what was armed before it.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::{Autodiff, Flex};
/// use burn::tensor::Tensor;
/// use burn_accelerate::Accelerated;
/// use burn_accelerate::scaler::{self, ArmedLossScale};
///
/// type B = Accelerated<Autodiff<Flex>>;
/// let w = Tensor::<B, 1>::ones([2], &Default::default()).require_grad();
/// let grads = {
///     let _armed = ArmedLossScale::arm(1024.0);
///     assert_eq!(scaler::armed(), Some(1024.0));
///     (w.clone() * 3.0).sum().backward()
/// };
/// assert_eq!(scaler::armed(), None);
/// assert_eq!(w.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(), [3072.0, 3072.0]);
/// # }
/// ```
#[derive(Debug)]
#[must_use = "the scale is only armed while the guard lives"]
pub struct ArmedLossScale {
    previous: u64,
}

impl ArmedLossScale {
    /// Arms `scale` for every thread until the guard drops.
    pub fn arm(scale: f32) -> Self {
        Self::arm_transform(LossTransform {
            divisor: 1,
            scale: Some(scale),
        })
    }

    /// Arms `transform` (the window's divisor, then the scale) for every thread until the
    /// guard drops: what the `with_accelerate` strategy arms, so that a user's unmodified
    /// `loss.backward()` differentiates the loss the `Accelerator`'s `backward` would
    /// (see [`step`](crate::step)). A divisor above 2^24 − 1 is clamped to it.
    pub fn arm_transform(transform: LossTransform) -> Self {
        let previous = ARMED_SCALE.swap(encode(transform), Ordering::AcqRel);
        Self { previous }
    }

    /// Replaces the armed scale (after the scaler adjusted it), keeping the divisor.
    pub fn set(&self, scale: f32) {
        let divisor = decode(ARMED_SCALE.load(Ordering::Acquire)).map_or(1, |t| t.divisor);
        ARMED_SCALE.store(
            encode(LossTransform {
                divisor,
                scale: Some(scale),
            }),
            Ordering::Release,
        );
    }
}

impl Drop for ArmedLossScale {
    fn drop(&mut self) {
        ARMED_SCALE.store(self.previous, Ordering::Release);
    }
}

fn encode(transform: LossTransform) -> u64 {
    let divisor = u64::from(transform.divisor).min(DIVISOR_MASK) << DIVISOR_SHIFT;
    let scale = transform
        .scale
        .map_or(0, |scale| HAS_SCALE | u64::from(scale.to_bits()));
    ARMED | divisor | scale
}

fn decode(bits: u64) -> Option<LossTransform> {
    (bits & ARMED != 0).then(|| LossTransform {
        divisor: ((bits >> DIVISOR_SHIFT) & DIVISOR_MASK) as u32,
        scale: (bits & HAS_SCALE != 0).then(|| f32::from_bits(bits as u32)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_torchs() {
        let d = DynamicLossScale::default();
        assert_eq!(
            (
                d.scale(),
                d.growth_factor(),
                d.backoff_factor(),
                d.growth_interval()
            ),
            (65536.0, 2.0, 0.5, 2000)
        );
        let from_config = GradScalerConfig::new().init(Precision::F16).unwrap();
        assert_eq!(from_config, LossScale::Dynamic(d));
    }

    #[test]
    fn on_by_default_for_f16_only() {
        let config = GradScalerConfig::new();
        assert_eq!(config.init(Precision::F32).unwrap(), LossScale::None);
        assert_eq!(config.init(Precision::Bf16).unwrap(), LossScale::None);
        let forced = config.clone().with_enabled(Some(true));
        assert!(matches!(
            forced.init(Precision::Bf16).unwrap(),
            LossScale::Dynamic(_)
        ));
        let off = config.with_enabled(Some(false));
        assert_eq!(off.init(Precision::F16).unwrap(), LossScale::None);
    }

    #[test]
    fn static_scale_never_moves() {
        let config = GradScalerConfig::new()
            .with_dynamic(false)
            .with_init_scale(128.0);
        let scale = config.init(Precision::F16).unwrap();
        assert_eq!(scale, LossScale::Static { scale: 128.0 });
        assert_eq!(scale.adjust(true).adjust(false), scale);
        assert!(scale.checks_overflow());
        assert_eq!(scale.inv_scale(), 1.0 / 128.0);
    }

    #[test]
    fn backoff_and_growth_follow_torch() {
        let mut s = DynamicLossScale::new(65536.0, 2.0, 0.5, 3).unwrap();
        s = s.adjust(false).adjust(false);
        assert_eq!((s.scale(), s.growth_tracker()), (65536.0, 2));
        s = s.adjust(false);
        assert_eq!((s.scale(), s.growth_tracker()), (131072.0, 0));
        s = s.adjust(false).adjust(true);
        assert_eq!((s.scale(), s.growth_tracker()), (65536.0, 0));
    }

    #[test]
    fn growth_into_infinity_is_refused_but_resets_the_tracker() {
        let s = DynamicLossScale::new(2f64.powi(127), 4.0, 0.5, 1).unwrap();
        let next = s.adjust(false);
        assert_eq!(next.scale(), 2f32.powi(127));
        assert_eq!(next.growth_tracker(), 0);
    }

    #[test]
    fn updates_round_through_f64_like_torch() {
        // f32(0.1) * 0.7 in f64, then rounded: what torch's CPU kernel stores.
        let s = DynamicLossScale::new(0.1, 3.0, 0.7, 1).unwrap();
        // The value torch stored (golden case gs_nonpow2_init0.1_g3_b0.7_gi1).
        assert_eq!(s.adjust(true).scale(), 0.070_000_000_298_023_22_f64 as f32);
        // A pure f32 product differs here (torch stored 980.0999755859375 after 891 in
        // gs_nonpow2_init1000_g1.1_b0.9_gi1), which is why the f64 route matters.
        let s = DynamicLossScale::new(891.0, 1.1, 0.9, 1).unwrap();
        assert_eq!(s.adjust(false).scale(), 980.1); // the f32 nearest 980.1
        assert_ne!(s.adjust(false).scale(), 891.0f32 * 1.1f32);
    }

    #[test]
    fn scale_can_underflow_to_zero_and_unscale_becomes_infinite() {
        let mut s = LossScale::Dynamic(DynamicLossScale::new(1e-44, 2.0, 0.25, 1).unwrap());
        for _ in 0..3 {
            s = s.adjust(true);
        }
        assert_eq!(s.loss_scale(), 0.0);
        assert_eq!(s.inv_scale(), f32::INFINITY);
    }

    #[test]
    fn invalid_settings_are_typed_errors_that_say_what_to_change() {
        let cases: [(GradScalerConfig, &str); 7] = [
            (
                GradScalerConfig::new().with_backoff_factor(0.0),
                "grad_scaler.backoff_factor",
            ),
            (
                GradScalerConfig::new().with_backoff_factor(1.0),
                "grad_scaler.backoff_factor",
            ),
            (
                GradScalerConfig::new().with_growth_factor(1.0),
                "grad_scaler.growth_factor",
            ),
            (
                GradScalerConfig::new().with_growth_factor(-2.0),
                "grad_scaler.growth_factor",
            ),
            (
                GradScalerConfig::new().with_growth_interval(0),
                "grad_scaler.growth_interval",
            ),
            (
                GradScalerConfig::new().with_init_scale(0.0),
                "grad_scaler.init_scale",
            ),
            (
                GradScalerConfig::new().with_init_scale(1e39),
                "grad_scaler.init_scale",
            ),
        ];
        for (config, expected) in cases {
            let err = config.init(Precision::F16).unwrap_err();
            match &err {
                AccelerateError::InvalidConfig { field, .. } => assert_eq!(*field, expected),
                other => panic!("unexpected error {other:?}"),
            }
            assert!(err.to_string().contains("torch's default"), "{err}");
        }
    }

    #[test]
    fn state_round_trips_through_serde_and_is_checked_on_the_way_in() {
        let s = LossScale::Dynamic(
            DynamicLossScale::new(1000.0, 1.1, 0.9, 5)
                .unwrap()
                .adjust(false),
        );
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<LossScale>(&json).unwrap(), s);
        let bad = json.replace("\"backoff_factor\":0.9", "\"backoff_factor\":1.5");
        assert!(serde_json::from_str::<LossScale>(&bad).is_err());
        let fixed = LossScale::Static { scale: 8.0 };
        let json = serde_json::to_string(&fixed).unwrap();
        assert_eq!(serde_json::from_str::<LossScale>(&json).unwrap(), fixed);
    }

    // Found by the accelerator state's property test (src/record_decoders.rs): a static scale
    // of -2147483600 read back, and scaled every loss by it.
    #[test]
    fn a_saved_static_scale_that_no_configuration_makes_is_refused() {
        for bad in ["-2147483600", "0", "-0.0", "1e39"] {
            let json = format!(r#"{{"kind":"static","scale":{bad}}}"#);
            let err = serde_json::from_str::<LossScale>(&json).unwrap_err();
            assert!(
                err.to_string()
                    .contains("a saved static loss scale must be finite and positive"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn arming_restores_what_was_there() {
        // The only test in this binary that arms: the state is process-wide.
        assert_eq!(armed(), None);
        {
            let outer = ArmedLossScale::arm(4.0);
            assert_eq!(armed(), Some(4.0));
            outer.set(0.0);
            assert_eq!(armed(), Some(0.0), "a scale of zero stays armed");
            {
                let _inner = ArmedLossScale::arm(2.0);
                assert_eq!(armed(), Some(2.0));
            }
            assert_eq!(armed(), Some(0.0));
        }
        assert_eq!(armed(), None);
    }
}
