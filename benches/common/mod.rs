//! What the benchmarks share: the MLP whose training step they time, with the forward pass
//! autocast would produce written out by hand, and one training step.
#![allow(dead_code)] // each benchmark uses part of it

use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Tensor};

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    /// `dims` = [input, hidden, output]; seeded, so every variant starts from the same weights.
    pub fn new(dims: [usize; 3], device: &B::Device) -> Self {
        B::seed(device, 7);
        Self {
            fc1: LinearConfig::new(dims[0], dims[1]).init(device),
            fc2: LinearConfig::new(dims[1], dims[2]).init(device),
            act: Relu::new(),
        }
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }

    /// The forward pass with `low` casts written out by hand, as a user would without autocast:
    /// f32 master weights, inputs and weights cast to `low` for each linear.
    pub fn forward_hand_cast(&self, x: Tensor<B, 2>, low: FloatDType) -> Tensor<B, 2> {
        let linear = |l: &Linear<B>, x: Tensor<B, 2>| {
            let w = l.weight.val().cast(low);
            let b = l.bias.as_ref().map(|b| b.val().cast(low));
            burn::tensor::module::linear(x.cast(low), w, b)
        };
        let h = self.act.forward(linear(&self.fc1, x));
        linear(&self.fc2, h)
    }
}

/// One training step: forward (autocast or hand-cast to `hand_cast`), an f32 loss, backward,
/// and the gradients gathered per parameter as an optimizer would take them.
pub fn mlp_step<B: AutodiffBackend>(
    model: &Mlp<B>,
    x: Tensor<B, 2>,
    hand_cast: Option<FloatDType>,
) -> GradientsParams {
    let out = match hand_cast {
        Some(low) => model.forward_hand_cast(x, low),
        None => model.forward(x),
    };
    loss_grads(out, model)
}

/// The mean square of `out`, reduced in f32, differentiated, and the gradients of `model`'s
/// parameters.
pub fn loss_grads<B: AutodiffBackend, const D: usize, M: AutodiffModule<B>>(
    out: Tensor<B, D>,
    model: &M,
) -> GradientsParams {
    let loss = out.cast(FloatDType::F32).powf_scalar(2.0).mean();
    GradientsParams::from_grads(loss.backward(), model)
}
