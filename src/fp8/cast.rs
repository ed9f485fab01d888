//! One fp8 cast as autocast applies it: the quantizer of each pass, and how an op input gets it.

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape, TensorMetadata};

use super::autodiff;
use super::format::{Fp8Format, Fp8Mode};
use super::qdq::quantize_dequantize;
use super::state::{self, Pass, TensorKey};
use crate::autocast::Op;

/// A quantize-dequantize with its scale, and the tensor whose amax history it feeds.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::tensor::{Tensor, TensorPrimitive};
/// use burn_accelerate::fp8::{Fp8Format, Quantizer};
///
/// let q = Quantizer::new(Fp8Format::E4M3, 2.0);
/// let x = Tensor::<Flex, 1>::from_floats([0.3], &Default::default());
/// let y = q.apply::<Flex>(x.into_primitive().tensor());
/// let y = Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(y));
/// assert_eq!(y.into_scalar(), 0.3125); // fp8(0.6) / 2
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantizer {
    /// The format values are rounded to.
    pub format: Fp8Format,
    /// The scale applied before rounding and undone after.
    pub scale: f32,
    record: Option<TensorKey>,
}

impl Quantizer {
    /// A quantizer that records nothing.
    pub fn new(format: Fp8Format, scale: f32) -> Self {
        Quantizer {
            format,
            scale,
            record: None,
        }
    }

    /// The tensor whose amax history this quantizer's inputs feed, if any.
    pub fn records(&self) -> Option<TensorKey> {
        self.record
    }

    fn recording(self, key: TensorKey) -> Self {
        Quantizer {
            record: Some(key),
            ..self
        }
    }

    /// Records `tensor`'s amax (when this quantizer names a tensor) and rounds it.
    ///
    /// The amax stays on the device until [`fp8::step`](super::step) reads it.
    pub fn apply<B: Backend>(&self, tensor: FloatTensor<B>) -> FloatTensor<B> {
        if let Some(key) = self.record
            && tensor.shape().num_elements() > 0
        {
            let amax = B::float_reshape(B::float_max_abs(tensor.clone()), Shape::new([1]));
            state::record(
                key,
                Box::new(move || {
                    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(amax))
                        .into_data()
                        .iter::<f32>()
                        .next()
                        .unwrap_or(f32::NAN)
                }),
            );
        }
        quantize_dequantize::<B>(tensor, self.format, self.scale)
    }
}

/// What an fp8 cast does in each pass: round the input in the forward pass, and (under
/// [`Fp8Mode::Hybrid`]) round its gradient in the backward pass; without a backward quantizer
/// the gradient passes straight through.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Cast {
    /// Applied to the tensor.
    pub forward: Quantizer,
    /// Applied to the tensor's gradient; `None` passes it through unchanged.
    pub backward: Option<Quantizer>,
}

/// Where an autocast fp8 cast happens: the op call it belongs to, decided once per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fp8Site {
    mode: Fp8Mode,
    op: Op,
    call: u32,
}

impl Fp8Site {
    /// Numbers a new call of `op` under `mode`.
    pub(crate) fn new(mode: Fp8Mode, op: Op) -> Self {
        Fp8Site {
            mode,
            op,
            call: state::next_call(op),
        }
    }

    /// The cast of the op's `input`-th required float input, with the current scales.
    pub(crate) fn cast(&self, input: u32) -> Fp8Cast {
        let key = |pass| TensorKey {
            op: self.op,
            call: self.call,
            input,
            pass,
        };
        let quantizer = |pass: Pass| {
            let key = key(pass);
            Quantizer::new(pass.format(), state::scale_of(&key)).recording(key)
        };
        debug_assert_eq!(self.mode.forward_format(), Pass::Forward.format());
        Fp8Cast {
            forward: quantizer(Pass::Forward),
            backward: self.mode.backward_format().map(|format| {
                debug_assert_eq!(format, Pass::Backward.format());
                quantizer(Pass::Backward)
            }),
        }
    }

    /// Applies the cast of input `input` to `tensor`, with its backward where `B` records one.
    pub(crate) fn apply<B: Backend>(&self, input: u32, tensor: FloatTensor<B>) -> FloatTensor<B> {
        autodiff::fp8_cast::<B>(tensor, self.cast(input))
    }
}
