//! One training step (forward, mean square, backward) on `Accelerated<Autodiff<Flex>>`: f32
//! (autocast off) against bf16 and f16 autocast, interleaved round by round so the machine's
//! noise falls on every variant alike. Two models: issue 16's MLP, 256×512 → 2048 → 512 with
//! ReLU, and a small conv net (two 3×3 convolutions with ReLU on 32×32 RGB images, a spatial
//! mean, a linear head).
//!
//! ```text
//! cargo run --release --example autocast_ab -- --rounds 15
//! cargo run --release --example autocast_ab -- --rounds 15 --model conv
//! ```
//!
//! Printed: each variant's median and fastest step time and their ratios to f32's (below 1.0
//! is faster).

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::capability::{self, HalfPath};
use burn_accelerate::{Accelerated, Precision, autocast};
use clap::Parser;

type Acc = Accelerated<Autodiff<Flex>>;

/// Time a training step in f32 against bf16 and f16 autocast on Flex.
#[derive(Parser)]
struct Args {
    /// Steps per variant, interleaved.
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// The model to time.
    #[arg(long, value_enum, default_value_t = Model::Mlp)]
    model: Model,
    /// Rows (MLP) or images (conv net) per batch; by default 256 and 32.
    #[arg(long)]
    batch: Option<usize>,
    /// Time only these precisions (ratios need f32 among them): for profiling or counting
    /// instructions of one, e.g. `valgrind --tool=callgrind --toggle-collect='*Bench*step*'`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<Precision>,
    /// Run the half precisions on the widened path (`HalfPath::Widened`: Flex's f32 GEMM and
    /// convolution over operands widened to f32), to compare with the default (bf16 dot
    /// products where the CPU has them, convolutions as im2col GEMMs).
    #[arg(long)]
    widened: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Model {
    Mlp,
    Conv,
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

#[derive(Module, Debug)]
struct ConvNet<B: Backend> {
    conv1: Conv2d<B>,
    conv2: Conv2d<B>,
    head: Linear<B>,
    relu: Relu,
}

impl<B: Backend> ConvNet<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            conv1: Conv2dConfig::new([3, 32], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            conv2: Conv2dConfig::new([32, 64], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            head: LinearConfig::new(64, 10).init(device),
            relu: Relu::new(),
        }
    }

    fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = self.relu.forward(self.conv1.forward(images));
        let x = self.relu.forward(self.conv2.forward(x));
        let [batch, channels, _, _] = x.dims();
        let pooled = x
            .reshape([batch, channels, 256])
            .mean_dim(2)
            .reshape([batch, channels]);
        self.head.forward(pooled)
    }
}

// A model and a batch it is timed on.
enum Bench {
    Mlp(Box<Mlp<Acc>>, Tensor<Acc, 2>, Tensor<Acc, 2>),
    Conv(Box<ConvNet<Acc>>, Tensor<Acc, 4>, Tensor<Acc, 2>),
}

impl Bench {
    fn new(model: Model, batch: Option<usize>) -> Self {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        match model {
            Model::Mlp => {
                let rows = batch.unwrap_or(256);
                Bench::Mlp(
                    Box::new(Mlp::new(&device)),
                    Tensor::random([rows, 512], normal, &device),
                    Tensor::random([rows, 512], normal, &device),
                )
            }
            Model::Conv => {
                let images = batch.unwrap_or(32);
                Bench::Conv(
                    Box::new(ConvNet::new(&device)),
                    Tensor::random([images, 3, 32, 32], normal, &device),
                    Tensor::random([images, 10], normal, &device),
                )
            }
        }
    }

    // One step: its wall time.
    fn step(&self, precision: Precision) -> Duration {
        let start = Instant::now();
        let (grads, bias) = {
            let _autocast = autocast::enable(precision);
            let (out, y, bias) = match self {
                Bench::Mlp(model, x, y) => (model.forward(x.clone()), y, &model.up.bias),
                Bench::Conv(model, x, y) => (model.forward(x.clone()), y, &model.conv1.bias),
            };
            let loss = (out - y.clone()).powi_scalar(2).mean();
            (
                loss.backward(),
                bias.as_ref().expect("layers have biases").val(),
            )
        };
        // Flex computes eagerly: the gradient exists once backward returns.
        assert!(
            bias.grad(&grads).is_some(),
            "the first layer has a gradient"
        );
        start.elapsed()
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let args = Args::parse();
    if args.widened {
        capability::set_half_path(HalfPath::Widened);
    }
    let bench = Bench::new(args.model, args.batch);
    let variants: Vec<Precision> = [Precision::F32, Precision::Bf16, Precision::F16]
        .into_iter()
        .filter(|p| args.only.is_empty() || args.only.contains(p))
        .collect();
    // Warm-up: allocators and lazily built state.
    for &precision in &variants {
        bench.step(precision);
    }
    let mut times = vec![Vec::new(); variants.len()];
    for _ in 0..args.rounds {
        for (i, &precision) in variants.iter().enumerate() {
            times[i].push(bench.step(precision));
        }
    }
    // The fastest round too: on a shared machine, the one least disturbed by others.
    let fastest: Vec<Duration> = times
        .iter()
        .map(|t| *t.iter().min().expect("rounds"))
        .collect();
    let medians: Vec<Duration> = times.into_iter().map(median).collect();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    let reference = variants.iter().position(|p| *p == Precision::F32);
    let ratio = |times: &[Duration], i: usize| match reference {
        Some(r) => format!("({:.2}× f32's)", ms(&times[i]) / ms(&times[r])),
        None => String::new(),
    };
    for (i, precision) in variants.iter().enumerate() {
        println!(
            "{:<5} median {:>7.2} ms {}   fastest {:>7.2} ms {}",
            precision.to_string(),
            ms(&medians[i]),
            ratio(&medians, i),
            ms(&fastest[i]),
            ratio(&fastest, i),
        );
    }
}
