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

/// Two linear layers kept together: the unit `no_split` names.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
    pub act: Relu,
}

impl<B: Backend> Block<B> {
    pub fn new(width: usize, device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(width, width).init(device),
            fc2: LinearConfig::new(width, width).init(device),
            act: Relu::new(),
        }
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.act
            .forward(self.fc2.forward(self.act.forward(self.fc1.forward(x))))
    }
}

/// A small multi-layer model to place over devices: `embed`, `blocks.{i}`, `head`.
///
/// With `input` 4, `width` 8, `output` 2 (f32): embed 160 bytes, each block 576, head 72.
#[derive(Module, Debug)]
pub struct Stack<B: Backend> {
    pub embed: Linear<B>,
    pub blocks: Vec<Block<B>>,
    pub head: Linear<B>,
}

impl<B: Backend> Stack<B> {
    pub fn new(
        input: usize,
        width: usize,
        output: usize,
        depth: usize,
        device: &B::Device,
    ) -> Self {
        Self {
            embed: LinearConfig::new(input, width).init(device),
            blocks: (0..depth).map(|_| Block::new(width, device)).collect(),
            head: LinearConfig::new(width, output).init(device),
        }
    }

    /// The plain forward pass: runs placed only under `Accelerated<B>`'s co-locate rule.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self.embed.forward(x);
        let h = self.blocks.iter().fold(h, |h, block| block.forward(h));
        self.head.forward(h)
    }

    /// The forward pass of a placed model: each submodule's input brought to its device.
    pub fn forward_placed(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        use burn_accelerate::placement::to_device_of;
        let h = self.embed.forward(to_device_of(x, &self.embed));
        let h = self
            .blocks
            .iter()
            .fold(h, |h, block| block.forward(to_device_of(h, block)));
        self.head.forward(to_device_of(h, &self.head))
    }
}
