//! fp8, emulated: Transformer Engine's E4M3/E5M2 formats and delayed scaling on any Burn
//! backend.
//!
//! NVIDIA's Transformer Engine runs fp8 on Hopper GPUs only. Here values stay in f32 tensors
//! and [`quantize_dequantize`] rounds them to the fp8 grid with tensor ops on their own device:
//! the numerics of fp8, on every backend.
//!
//! - [`Fp8Format`] (E4M3, E5M2) and [`Fp8Mode`] (E4M3, or HYBRID: E4M3 forward, E5M2 for
//!   gradients).
//! - [`DelayedScaling`]: the recipe, with Transformer Engine's parameters and defaults, and
//!   [`ScalingState`], one tensor's scale and amax history, as plain values.
//! - [`Fp8State`]: every tensor's state, keyed by [`TensorKey`], serde-checkpointable; the
//!   process-wide one is read with [`state`], restored with [`load_state`], and advanced once
//!   per training step with [`step`].

mod format;
mod qdq;
mod recipe;
mod state;

pub use format::{Fp8Format, Fp8Mode};
pub use qdq::{quantize_dequantize, quantize_dequantize_tensor};
pub use recipe::{AmaxComputeAlgo, DelayedScaling, ScalingState};
pub use state::{Fp8State, Pass, TensorKey, load_state, recipe, reset, set_recipe, state, step};
