//! Transformer Engine's delayed-scaling recipe, as plain values.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::format::{Fp8Format, pow2};
use crate::AccelerateError;

/// Which amax of the history window sets the next scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum AmaxComputeAlgo {
    /// The largest amax in the window: robust to a step with small values, slow to shrink.
    #[default]
    #[serde(rename = "max")]
    Max,
    /// The amax of the step that just ended.
    #[serde(rename = "most_recent")]
    MostRecent,
}

/// Transformer Engine's `DelayedScaling` recipe: how each fp8 tensor's scale follows the
/// amaxes (largest absolute values) it had in previous steps.
///
/// After each step the scale of a tensor becomes `2^-margin × max_finite / amax`, where `amax`
/// is chosen by `amax_compute_algo` from the last `amax_history_len` steps (the step that just
/// ended included), so that the amax maps to `2^-margin × max_finite`. A zero or non-finite
/// amax keeps the previous scale. Every tensor starts with scale 1.
///
/// The defaults are Transformer Engine's: margin 0, interval 1, a 1024-step history, `max`.
/// (Accelerate's `TERecipeKwargs` defaults to `most_recent`.)
///
/// ```
/// use burn_accelerate::fp8::{AmaxComputeAlgo, DelayedScaling};
///
/// let recipe = DelayedScaling::default()
///     .with_margin(1)
///     .with_amax_history_len(16)
///     .with_amax_compute_algo(AmaxComputeAlgo::MostRecent);
/// assert!(recipe.validate().is_ok());
/// assert!(DelayedScaling::default().with_amax_history_len(0).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DelayedScaling {
    /// Headroom in powers of two: amax maps to `2^-margin × max_finite`. `0..=64`.
    pub margin: i32,
    /// Recompute the scale every `interval` steps (the history is recorded every step).
    /// At least 1. Transformer Engine ≥ 1.8 ignores it; here it keeps its documented meaning.
    pub interval: u32,
    /// How many steps of amaxes the window holds, the step that just ended included. At least 1.
    pub amax_history_len: usize,
    /// Which amax of the window sets the scale.
    pub amax_compute_algo: AmaxComputeAlgo,
}

impl Default for DelayedScaling {
    fn default() -> Self {
        DelayedScaling {
            margin: 0,
            interval: 1,
            amax_history_len: 1024,
            amax_compute_algo: AmaxComputeAlgo::Max,
        }
    }
}

impl DelayedScaling {
    /// The largest margin accepted: beyond it `2^-margin × 448` is no longer a normal f32.
    pub const MAX_MARGIN: i32 = 64;

    /// Sets [`margin`](Self::margin).
    pub fn with_margin(self, margin: i32) -> Self {
        DelayedScaling { margin, ..self }
    }

    /// Sets [`interval`](Self::interval).
    pub fn with_interval(self, interval: u32) -> Self {
        DelayedScaling { interval, ..self }
    }

    /// Sets [`amax_history_len`](Self::amax_history_len).
    pub fn with_amax_history_len(self, amax_history_len: usize) -> Self {
        DelayedScaling {
            amax_history_len,
            ..self
        }
    }

    /// Sets [`amax_compute_algo`](Self::amax_compute_algo).
    pub fn with_amax_compute_algo(self, amax_compute_algo: AmaxComputeAlgo) -> Self {
        DelayedScaling {
            amax_compute_algo,
            ..self
        }
    }

    /// Checks every parameter.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidFp8Recipe`] naming the first parameter out of range.
    pub fn validate(&self) -> Result<(), AccelerateError> {
        let invalid = |parameter: &'static str, value: i64, expected: &'static str| {
            Err(AccelerateError::InvalidFp8Recipe {
                parameter,
                value,
                expected,
            })
        };
        if !(0..=Self::MAX_MARGIN).contains(&self.margin) {
            return invalid("margin", self.margin.into(), "0..=64");
        }
        if self.interval == 0 {
            return invalid("interval", 0, "at least 1");
        }
        if self.amax_history_len == 0 {
            return invalid("amax_history_len", 0, "at least 1");
        }
        Ok(())
    }

    /// The value a tensor's amax is mapped to: `2^-margin × max_finite` of `format`.
    pub fn scaled_max(&self, format: Fp8Format) -> f32 {
        format.max_finite() * pow2(-self.margin)
    }
}

/// One tensor's delayed-scaling state: its scale and its amax history.
///
/// A step records amaxes with [`observe`](Self::observe) (several observations in one step
/// keep the largest) and ends with [`update`](Self::update), which picks the window's amax,
/// sets the scale the next step uses and rolls the history.
///
/// ```
/// use burn_accelerate::fp8::{DelayedScaling, Fp8Format, ScalingState};
///
/// let recipe = DelayedScaling::default();
/// let mut state = ScalingState::new();
/// assert_eq!(state.scale(), 1.0);
/// state.observe(7.0);
/// state.update(&recipe, Fp8Format::E4M3);
/// assert_eq!(state.scale(), 64.0); // 448 / 7
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalingState {
    scale: f32,
    // The amax of the step in progress: the largest observed, 0 before any.
    current: f32,
    // Amaxes of finished steps, oldest first; at most `amax_history_len - 1` of them.
    history: VecDeque<f32>,
    // Steps ended with `update`, for the recipe's interval.
    steps: u64,
}

impl Default for ScalingState {
    fn default() -> Self {
        Self::new()
    }
}

impl ScalingState {
    /// A tensor never seen: scale 1, empty history.
    pub fn new() -> Self {
        ScalingState {
            scale: 1.0,
            current: 0.0,
            history: VecDeque::new(),
            steps: 0,
        }
    }

    /// The scale the current step quantizes with.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The amax recorded so far in the current step.
    pub fn current_amax(&self) -> f32 {
        self.current
    }

    /// Amaxes of finished steps still in the window, oldest first.
    pub fn history(&self) -> impl ExactSizeIterator<Item = f32> + '_ {
        self.history.iter().copied()
    }

    /// Steps ended so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Records an amax seen in the current step.
    ///
    /// NaN is ignored, as Transformer Engine's `fmaxf`-based reductions ignore it; +∞ is
    /// kept, and then holds the scale where it is while it stays in the window.
    pub fn observe(&mut self, amax: f32) {
        self.current = self.current.max(amax.abs());
    }

    /// Ends the step: chooses the window's amax, recomputes the scale (on every
    /// `interval`-th step) unless that amax is zero or non-finite, and rolls the history
    /// (the oldest amax leaves once the window is full). Returns the new scale.
    pub fn update(&mut self, recipe: &DelayedScaling, format: Fp8Format) -> f32 {
        let window = self.history.iter().copied().chain([self.current]);
        let amax = match recipe.amax_compute_algo {
            AmaxComputeAlgo::Max => window.fold(0.0, f32::max),
            AmaxComputeAlgo::MostRecent => self.current,
        };
        self.steps += 1;
        let due = self.steps.is_multiple_of(u64::from(recipe.interval.max(1)));
        if due && amax.is_finite() && amax > 0.0 {
            // An amax so small that the scale overflows f32 keeps it too: an infinite scale
            // would turn every zero into NaN.
            let scale = recipe.scaled_max(format) / amax;
            if scale.is_finite() {
                self.scale = scale;
            }
        }
        let keep = recipe.amax_history_len.max(1) - 1;
        self.history.push_back(self.current);
        while self.history.len() > keep {
            self.history.pop_front();
        }
        self.current = 0.0;
        self.scale
    }
}
