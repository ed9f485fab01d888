//! Checked set-up of autocast for one device.

use burn::config::Config;
use burn_backend::Backend;

use super::{OpClasses, SmallOps};
use crate::capability::{self, Capabilities};
use crate::context::{Context, ContextGuard};
use crate::fp8::{self, DelayedScaling};
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
    /// Run `precision` even where the probe found it [`SLOW_FACTOR`](capability::SLOW_FACTOR)
    /// times slower than f32 or worse (otherwise that is an error, or a fallback to f32 when
    /// `allow_fallback` is on).
    #[config(default = false)]
    pub allow_slow: bool,
    /// How fp8 tensors are scaled, when `precision` is fp8 (Transformer Engine's defaults).
    #[config(default = "DelayedScaling::default()")]
    pub fp8_recipe: DelayedScaling,
    /// Which lower-class ops run in f32 because they are too small for the half type to pay
    /// (see [`SmallOps`]): the rule of the threads that enter the autocast
    /// ([`Autocast::enter`]), or of the process after [`Autocast::set_default`]. `None` (the
    /// default) leaves the rule in force: [`SmallOps::KeepF32`] (those below the device's
    /// threshold) unless the context changed it. PyTorch casts every one: [`SmallOps::Cast`].
    #[config(default = "None")]
    pub small_ops: Option<SmallOps>,
    /// Which path half-precision ops take where the crate has its own
    /// ([`HalfPath`](capability::HalfPath)), for the threads that enter the autocast (or the
    /// process after [`Autocast::set_default`]). `None` (the default) leaves the one in force.
    #[config(default = "None")]
    pub half_path: Option<capability::HalfPath>,
    /// Overrides of the op table's classes for the threads that enter the autocast (or the
    /// process after [`Autocast::set_default`]); empty (the default) leaves the classes in
    /// force.
    #[config(default = "OpClasses::new()")]
    pub op_classes: OpClasses,
}

impl AutocastConfig {
    /// Probes `device` and returns the autocast it can run.
    ///
    /// For fp8 it also checks `fp8_recipe`, which the threads that enter the autocast follow
    /// ([`fp8::scope_recipe`]), and that `B`, if it records gradients, has its fp8 cast
    /// registered (see [`fp8::register`]).
    ///
    /// # Errors
    /// - [`AccelerateError::UnsupportedPrecision`] when the device cannot run the precision
    ///   and `allow_fallback` is off;
    /// - [`AccelerateError::SlowPrecision`] when it runs, but too slowly to be worth it, and
    ///   neither `allow_slow` nor `allow_fallback` is on;
    /// - [`AccelerateError::InvalidFp8Recipe`] for an fp8 precision with an invalid recipe;
    /// - [`AccelerateError::Fp8NotRegistered`] for an fp8 precision on an autodiff backend
    ///   without a registered fp8 cast;
    /// - [`AccelerateError::InvalidConfig`] for an invalid `small_ops` ([`SmallOps::validate`]).
    ///
    /// ```
    /// use burn_accelerate::fp8::{DelayedScaling, Fp8Mode};
    /// use burn_accelerate::{AccelerateError, AutocastConfig, Precision};
    /// # #[cfg(feature = "flex")] {
    /// type B = burn::backend::Flex;
    ///
    /// let bad = DelayedScaling::default().with_amax_history_len(0);
    /// let err = AutocastConfig::new(Precision::Fp8(Fp8Mode::Hybrid))
    ///     .with_fp8_recipe(bad)
    ///     .init::<B>(&Default::default())
    ///     .unwrap_err();
    /// assert!(matches!(err, AccelerateError::InvalidFp8Recipe { parameter: "amax_history_len", .. }));
    /// # }
    /// ```
    pub fn init<B: Backend>(&self, device: &B::Device) -> Result<Autocast, AccelerateError> {
        if let Some(rule) = self.small_ops {
            rule.validate()?;
        }
        if self.precision.fp8_mode().is_some() {
            self.fp8_recipe.validate()?;
            if fp8::needs_registration::<B>(device) {
                return Err(AccelerateError::Fp8NotRegistered {
                    backend: B::name(device),
                });
            }
        }
        let capabilities = capability::probe::<B>(device);
        let effective = match capability::ensure::<B>(device, self.precision) {
            Ok(()) => self.precision,
            Err(AccelerateError::SlowPrecision { .. }) if self.allow_slow => self.precision,
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
            small_ops: self.small_ops,
            half_path: self.half_path,
            op_classes: self.op_classes,
            fp8_recipe: effective.fp8_mode().map(|_| self.fp8_recipe),
        })
    }
}

/// Autocast checked against a device: the precision it will really run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autocast {
    requested: Precision,
    effective: Precision,
    capabilities: Capabilities,
    small_ops: Option<SmallOps>,
    half_path: Option<capability::HalfPath>,
    op_classes: OpClasses,
    // Only under fp8; checked by `init`.
    fp8_recipe: Option<DelayedScaling>,
}

impl Autocast {
    /// Probes `device` and returns the autocast of the fastest precision it runs, by the rule
    /// of [`Capabilities::fastest`] (never a timing): on an accelerator bf16 or f16, on a CPU
    /// bf16 where the crate runs it on bf16 dot-product instructions, else f32. For an
    /// `Accelerator` or `with_accelerate`, pass
    /// `capability::probe::<B>(&device).fastest()` as the mixed precision.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn_accelerate::{Autocast, capability};
    /// type B = burn::backend::Flex;
    ///
    /// let device = Default::default();
    /// let autocast = Autocast::fastest::<B>(&device);
    /// assert_eq!(autocast.precision(), capability::probe::<B>(&device).fastest());
    /// let _guard = autocast.enter();
    /// # }
    /// ```
    pub fn fastest<B: Backend>(device: &B::Device) -> Autocast {
        let capabilities = capability::probe::<B>(device);
        let precision = capabilities.fastest();
        Autocast {
            requested: precision,
            effective: precision,
            capabilities,
            small_ops: None,
            half_path: None,
            op_classes: OpClasses::new(),
            fp8_recipe: None,
        }
    }

    /// The precision ops will run in (f32 when a fallback was taken).
    pub fn precision(&self) -> Precision {
        self.effective
    }

    /// The precision that was asked for.
    pub fn requested(&self) -> Precision {
        self.requested
    }

    /// Whether the device could not run the request (or not fast enough) and f32 is used
    /// instead.
    pub fn fell_back(&self) -> bool {
        self.requested != self.effective
    }

    /// What the probe found the device can run.
    pub fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    /// `base` with this autocast's settings: its precision, and the small-op rule, half path,
    /// op classes and fp8 recipe where the configuration set them.
    pub fn apply_to(&self, base: Context) -> Context {
        let mut context = base
            .with_precision(Some(self.effective))
            .with_op_classes(self.op_classes);
        if let Some(rule) = self.small_ops {
            // Checked by `init`.
            context = context.with(rule);
        }
        if let Some(path) = self.half_path {
            context = context.with_half_path(path);
        }
        if let Some(recipe) = self.fp8_recipe {
            // Checked by `init`.
            context = context.with_checked_fp8_recipe(recipe);
        }
        context
    }

    /// A new training's context: the process's with this autocast's settings and an fp8
    /// state of its own. A training keeps it and enters it on every thread that runs its
    /// steps, so that two trainings in one process never share settings or fp8 histories.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn_accelerate::{autocast, AutocastConfig, Precision};
    /// type B = burn::backend::Flex;
    ///
    /// let bf16 = AutocastConfig::new(Precision::Bf16).init::<B>(&Default::default()).unwrap();
    /// let training = bf16.context();
    /// let worker = std::thread::spawn(move || {
    ///     let _entered = training.enter();
    ///     autocast::current()
    /// });
    /// assert_eq!(worker.join().unwrap(), Some(Precision::Bf16));
    /// assert_eq!(autocast::current(), None);
    /// # }
    /// ```
    pub fn context(&self) -> Context {
        self.apply_to(Context::process()).with_new_fp8_state()
    }

    /// Autocasts on this thread until the scope drops: the thread's current context with this
    /// autocast's settings ([`apply_to`](Self::apply_to)), its fp8 state shared with that
    /// context. A training enters its own [`context`](Self::context) instead.
    #[must_use = "autocast is only on while the scope lives"]
    pub fn enter(&self) -> AutocastScope {
        self.apply_to(Context::current()).enter()
    }

    /// Makes the process's context this autocast's ([`apply_to`](Self::apply_to) on it), for
    /// every thread that entered none of its own.
    ///
    /// Prefer [`enter`](Self::enter) on the threads that run the model: a default outlives the
    /// training that set it. It remains for threads the crate does not start (Burn's backend
    /// ops take no context, so the decorator can only read what the thread or the process
    /// holds).
    pub fn set_default(&self) {
        self.apply_to(Context::process()).set_as_default();
    }

    /// The small-op rule this autocast brings to the threads that enter it (`None`: the one in
    /// force there).
    pub fn small_ops(&self) -> Option<SmallOps> {
        self.small_ops
    }
}

/// This thread's autocast while it lives ([`Autocast::enter`]): the thread's context with the
/// autocast's settings; the one before comes back when the scope drops. Tied to its thread.
pub type AutocastScope = ContextGuard;
