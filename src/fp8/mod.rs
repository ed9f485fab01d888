//! fp8, emulated: rounding to Transformer Engine's E4M3 and E5M2 formats on any Burn backend.
//!
//! NVIDIA's Transformer Engine runs fp8 on Hopper GPUs only. Here values stay in f32 tensors
//! and [`quantize_dequantize`] rounds them to the fp8 grid with tensor ops on their own device:
//! the numerics of fp8, on every backend.

mod format;
mod qdq;

pub use format::{Fp8Format, Fp8Mode};
pub use qdq::{quantize_dequantize, quantize_dequantize_tensor};
