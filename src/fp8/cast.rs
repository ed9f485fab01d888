//! One fp8 cast as autocast applies it: the quantizer of each pass. Which casts an op call's
//! inputs get is [`site`](super::site)'s business; the node that applies one under autodiff is
//! [`autodiff`](super::autodiff)'s, built from the values here.

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape, TensorMetadata};

use super::format::Fp8Format;
use super::qdq::quantize_dequantize;
use super::state::{self, TensorKey};

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

    pub(super) fn recording(self, key: TensorKey) -> Self {
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
/// [`Fp8Mode::Hybrid`](super::Fp8Mode::Hybrid)) round its gradient in the backward pass;
/// without a backward quantizer the gradient passes straight through.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Cast {
    /// Applied to the tensor.
    pub forward: Quantizer,
    /// Applied to the tensor's gradient; `None` passes it through unchanged.
    pub backward: Option<Quantizer>,
}
