//! What happens to a loss before it is differentiated: divided by the window's length, then
//! multiplied by the loss scale. A plain value below the step's divisor rule
//! ([`step::divisor`](crate::step)), which computes it, and the loss scale's arming
//! ([`ArmedLossScale`](crate::ArmedLossScale)), which carries it to the decorator's `backward`.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::tensor::FloatTensor;

/// What happens to a loss before it is differentiated: divided by the window's length, then
/// multiplied by the loss scale, each only where it is not 1 (so that without accumulation or
/// scaling the loss is differentiated as it is).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossTransform {
    /// What the loss is divided by (1: not divided).
    pub divisor: u32,
    /// What it is then multiplied by (`None`: no loss scaling).
    pub scale: Option<f32>,
}

impl LossTransform {
    /// Whether it leaves the loss as it is.
    pub fn is_identity(&self) -> bool {
        self.divisor <= 1 && self.scale.is_none()
    }

    /// The transform applied to a backend's tensor: the decorator's `backward` calls this on
    /// the armed transform.
    pub fn apply_primitive<B: Backend>(&self, loss: FloatTensor<B>) -> FloatTensor<B> {
        let loss = match self.divisor {
            0 | 1 => loss,
            k => B::float_div_scalar(loss, (k as f32).into()),
        };
        match self.scale {
            Some(scale) => B::float_mul_scalar(loss, scale.into()),
            None => loss,
        }
    }

    /// The same on a tensor: the `Accelerator`'s `backward` calls this on the loss it is given.
    pub fn apply<B: Backend, const D: usize>(&self, loss: Tensor<B, D>) -> Tensor<B, D> {
        if self.is_identity() {
            return loss;
        }
        let primitive = self.apply_primitive::<B>(loss.into_primitive().tensor());
        Tensor::from_primitive(TensorPrimitive::Float(primitive))
    }
}
