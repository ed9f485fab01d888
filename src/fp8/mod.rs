//! fp8 autocast, emulated: Transformer Engine's E4M3/HYBRID formats and delayed scaling on any
//! Burn backend.
//!
//! NVIDIA's Transformer Engine runs fp8 on Hopper GPUs only. Here the inputs of the
//! lower-class ops (matmul, linear, conv, attention, ...) are rounded to fp8 by
//! [`quantize_dequantize`], tensor ops on their own device, and the op then runs in f32: the
//! numerics of fp8, on every backend, so a model's fp8 behaviour can be studied and tested
//! anywhere.
//!
//! - [`Fp8Format`] (E4M3, E5M2) and [`Fp8Mode`] (E4M3, or HYBRID: E4M3 forward, E5M2 for the
//!   gradients of the same inputs backward); autocast turns it on with
//!   [`Precision::Fp8`](crate::Precision::Fp8).
//! - [`DelayedScaling`]: the recipe, with Transformer Engine's parameters and defaults, and
//!   [`ScalingState`], one tensor's scale and amax history, as plain values.
//! - [`Fp8State`]: every tensor's state, keyed by [`TensorKey`] (which op call and input a
//!   tensor is: Burn's tensors have no identity), serde-checkpointable; the process-wide one
//!   lives beside autocast's precision and is read with [`state`], restored with
//!   [`load_state`], and advanced once per training step with [`step`].
//! - [`Fp8Differentiable`] and [`register`]: the custom autodiff node that passes gradients
//!   straight through the rounding (E4M3) or rounds them to E5M2 (HYBRID).
//!
//! ```
//! # #[cfg(feature = "flex")] {
//! use burn::backend::{Autodiff, Flex};
//! use burn::tensor::Tensor;
//! use burn_accelerate::fp8::{self, Fp8Mode};
//! use burn_accelerate::{Accelerated, AutocastConfig, Precision};
//!
//! type B = Accelerated<Autodiff<Flex>>;
//! let device = Default::default();
//! let autocast = AutocastConfig::new(Precision::Fp8(Fp8Mode::Hybrid)).init::<B>(&device)?;
//! let _guard = autocast.enter();
//!
//! let x = Tensor::<B, 2>::from_floats([[0.3, 1.0]], &device);
//! let w = Tensor::<B, 2>::from_floats([[1.0], [1.0]], &device).require_grad();
//! let y = x.matmul(w.clone()); // x is rounded to E4M3 first: 0.3 becomes 0.3125
//! assert_eq!(y.clone().into_scalar(), 1.3125);
//! let grads = y.sum().backward(); // w's gradient is rounded to E5M2
//! fp8::step(); // once per training step: new scales from the amaxes just seen
//! # }
//! # Ok::<(), burn_accelerate::AccelerateError>(())
//! ```

mod autodiff;
mod cast;
mod format;
mod qdq;
mod recipe;
mod site;
mod state;

pub use autodiff::{Fp8Differentiable, is_registered, needs_registration, register};
pub use cast::{Fp8Cast, Quantizer};
pub use format::{Fp8Format, Fp8Mode};
pub use qdq::{quantize_dequantize, quantize_dequantize_tensor};
pub use recipe::{AmaxComputeAlgo, DelayedScaling, ScalingState};
pub(crate) use site::Fp8Site;
pub use state::{Fp8State, Pass, TensorKey, load_state, recipe, reset, scope_recipe, state, step};
