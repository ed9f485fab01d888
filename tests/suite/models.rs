//! The small models the generic tests run.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{Linear, LinearConfig, Relu, Tanh};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use super::ParamGrads;

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    // Smooth, so a value rounding across zero in low precision cannot flip a gradient
    // on or off (a relu would, and the gradient tests would measure that, not autocast).
    pub act: Tanh,
}

impl<B: Backend> Mlp<B> {
    pub fn new(input: usize, hidden: usize, output: usize, device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(input, hidden).init(device),
            fc2: LinearConfig::new(hidden, output).init(device),
            act: Tanh::new(),
        }
    }

    pub fn hidden(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.act.forward(self.fc1.forward(x))
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.hidden(x))
    }
}

impl<B: AutodiffBackend> ParamGrads<B> for Mlp<B> {
    fn param_grads(&self, grads: &B::Gradients) -> Vec<(String, TensorData)> {
        let grad = |name: &str, t: Option<Tensor<B::InnerBackend, 2>>| {
            (
                name.to_string(),
                t.unwrap_or_else(|| panic!("{name} has no gradient"))
                    .into_data(),
            )
        };
        let grad1 = |name: &str, t: Option<Tensor<B::InnerBackend, 1>>| {
            (
                name.to_string(),
                t.unwrap_or_else(|| panic!("{name} has no gradient"))
                    .into_data(),
            )
        };
        vec![
            grad("fc1.weight", self.fc1.weight.grad(grads)),
            grad1("fc1.bias", self.fc1.bias.as_ref().unwrap().grad(grads)),
            grad("fc2.weight", self.fc2.weight.grad(grads)),
            grad1("fc2.bias", self.fc2.bias.as_ref().unwrap().grad(grads)),
        ]
    }
}

#[derive(Module, Debug)]
pub struct ConvNet<B: Backend> {
    pub conv: Conv2d<B>,
    pub pool: AdaptiveAvgPool2d,
    pub head: Linear<B>,
    pub act: Relu,
}

impl<B: Backend> ConvNet<B> {
    pub fn new(device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([3, 8], [3, 3]).init(device),
            pool: AdaptiveAvgPool2dConfig::new([2, 2]).init(),
            head: LinearConfig::new(8 * 4, 5).init(device),
            act: Relu::new(),
        }
    }

    pub fn features(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.act.forward(self.conv.forward(x))
    }

    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let pooled = self.pool.forward(self.features(x));
        self.head.forward(pooled.flatten(1, 3))
    }
}
