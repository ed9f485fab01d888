//! One training step (forward, mean square, backward) of issue 16's MLP, 256×512 → 2048 → 512
//! with ReLU, on `Accelerated<Autodiff<Flex>>`: f32 (autocast off) against bf16 and f16
//! autocast, interleaved round by round so the machine's noise falls on every variant alike.
//!
//! ```text
//! cargo run --release --example autocast_ab -- --rounds 15
//! ```
//!
//! Printed: each variant's median step time and its ratio to f32's (below 1.0 is faster).

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast};
use clap::Parser;

type Acc = Accelerated<Autodiff<Flex>>;

/// Time a training step in f32 against bf16 and f16 autocast on Flex.
#[derive(Parser)]
struct Args {
    /// Steps per variant, interleaved.
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// Rows per batch.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Time only these precisions (f32 is always timed, as the reference); for profiling one.
    #[arg(long, value_delimiter = ',')]
    only: Vec<Precision>,
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    up: Linear<B>,
    down: Linear<B>,
    relu: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            up: LinearConfig::new(512, 2048).init(device),
            down: LinearConfig::new(2048, 512).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.down.forward(self.relu.forward(self.up.forward(x)))
    }
}

// One step: its wall time.
fn step(
    model: &Mlp<Acc>,
    x: &Tensor<Acc, 2>,
    y: &Tensor<Acc, 2>,
    precision: Precision,
) -> Duration {
    let start = Instant::now();
    let grads = {
        let _autocast = autocast::enable(precision);
        let out = model.forward(x.clone());
        let loss = (out - y.clone()).powi_scalar(2).mean();
        loss.backward()
    };
    let weight = model.up.weight.val();
    // Flex computes eagerly: the gradient exists once backward returns.
    assert!(weight.grad(&grads).is_some(), "the weight has a gradient");
    start.elapsed()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let args = Args::parse();
    let device = Default::default();
    let model = Mlp::<Acc>::new(&device);
    let x = Tensor::<Acc, 2>::random([args.batch, 512], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<Acc, 2>::random([args.batch, 512], Distribution::Normal(0.0, 1.0), &device);
    let variants: Vec<Precision> = [Precision::F32, Precision::Bf16, Precision::F16]
        .into_iter()
        .filter(|p| *p == Precision::F32 || args.only.is_empty() || args.only.contains(p))
        .collect();
    // Warm-up: allocators and lazily built state.
    for &precision in &variants {
        step(&model, &x, &y, precision);
    }
    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..args.rounds {
        for (i, &precision) in variants.iter().enumerate() {
            times[i].push(step(&model, &x, &y, precision));
        }
    }
    let medians: Vec<Duration> = times.into_iter().map(median).collect();
    for (precision, time) in variants.iter().zip(&medians) {
        println!(
            "{:<5} {:>8.2} ms  {:.2}× f32's time",
            format!("{precision:?}"),
            time.as_secs_f64() * 1e3,
            time.as_secs_f64() / medians[0].as_secs_f64()
        );
    }
}
