//! The whole migration is one type alias.
//!
//! Trains the same small MLP on the same synthetic regression data for a few steps, once on
//! `Autodiff<Flex>` and once on `Accelerated<Autodiff<Flex>>` with bf16 autocast, and prints
//! both loss curves.
//!
//!     cargo run --release --example swap_backend

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, ElementConversion, Tensor};
use burn_accelerate::{Accelerated, AutocastConfig, Precision};

type Plain = Autodiff<Flex>;
type Mixed = Accelerated<Autodiff<Flex>>;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    fc3: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(32, 128).init(device),
            fc2: LinearConfig::new(128, 128).init(device),
            fc3: LinearConfig::new(128, 1).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.act.forward(self.fc1.forward(x));
        let x = self.act.forward(self.fc2.forward(x));
        self.fc3.forward(x)
    }
}

/// A fixed target function: y = sin(x · a), x ~ N(0, 1).
fn batch<B: Backend>(step: usize, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
    B::seed(device, 1000 + step as u64);
    let x = Tensor::<B, 2>::random([64, 32], Distribution::Normal(0.0, 1.0), device);
    let a = Tensor::<B, 2>::ones([32, 1], device).div_scalar(32f32.sqrt());
    let y = x.clone().matmul(a).sin();
    (x, y)
}

fn train<B: AutodiffBackend>(steps: usize) -> Vec<f32> {
    let device = B::Device::default();
    B::seed(&device, 42);
    let mut model = Mlp::<B>::new(&device);
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::with_capacity(steps);
    for step in 0..steps {
        let (x, y) = batch::<B>(step, &device);
        let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
        losses.push(loss.clone().into_scalar().elem::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
    }
    losses
}

fn main() -> Result<(), burn_accelerate::AccelerateError> {
    let steps = 30;
    let plain = train::<Plain>(steps);

    let autocast = AutocastConfig::new(Precision::Bf16).init::<Mixed>(&Default::default())?;
    autocast.set_default();
    let mixed = train::<Mixed>(steps);

    println!(
        "step  Autodiff<Flex>  Accelerated<Autodiff<Flex>> ({})",
        autocast.precision()
    );
    for (step, (p, m)) in plain.iter().zip(&mixed).enumerate() {
        if step % 5 == 0 || step + 1 == steps {
            println!("{step:>4}  {p:>14.6}  {m:>14.6}");
        }
    }
    println!(
        "final loss: f32 {:.6}, {} {:.6}",
        plain[steps - 1],
        autocast.precision(),
        mixed[steps - 1]
    );
    Ok(())
}
