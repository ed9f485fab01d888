//! One training step (forward, mean square, backward) on `Accelerated<Autodiff<Flex>>`: f32
//! (autocast off) against bf16 and f16 autocast, interleaved round by round so the machine's
//! noise falls on every variant alike. The models: issue 16's MLP, 256×512 → 2048 → 512 with
//! ReLU; a small conv net (two 3×3 convolutions with ReLU on 32×32 RGB images, a spatial
//! mean, a linear head); issue 28's deep MLP (8 linear layers of 1024 with ReLU, batch 4096);
//! and an LSTM like Burn's `modern-lstm` example (two bidirectional layers of Burn's
//! `BiLstm`, hidden 32 by default, 32 sequences of 10 steps of one feature, a linear head on
//! the last step).
//!
//! ```text
//! cargo run --release --example autocast_ab -- --rounds 15
//! cargo run --release --example autocast_ab -- --rounds 15 --model conv
//! cargo run --release --example autocast_ab -- --rounds 31 --model lstm --hidden 64
//! cargo run --release --example autocast_ab -- --rounds 15 --use-current-thread
//! cargo run --release --example autocast_ab -- --rounds 15 --model conv --pin-threads
//! ```
//!
//! Printed: each variant's median and fastest step time and their ratios to f32's (below 1.0
//! is faster).
//!
//! With `--serve` it times one step per line read from stdin (`f32`, `bf16`, `f16`) and
//! prints its milliseconds: `benches/torch_cpu_step.py` drives it, interleaving its steps with
//! PyTorch's.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BiLstm, BiLstmConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::Context;
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::capability::{self, HalfPath};
use burn_accelerate::{Accelerated, Precision, autocast, threads};
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
    /// Rows (MLP), images (conv net) or sequences (LSTM) per batch; by default 256, 32, 4096
    /// (deep MLP) and 32.
    #[arg(long)]
    batch: Option<usize>,
    /// The LSTM's hidden size.
    #[arg(long, default_value_t = 32)]
    hidden: usize,
    /// Time one step per precision named on each line of stdin, printing its milliseconds.
    #[arg(long)]
    serve: bool,
    /// Time only these precisions (ratios need f32 among them): for profiling or counting
    /// instructions of one, e.g. `valgrind --tool=callgrind --toggle-collect='*Bench*step*'`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<Precision>,
    /// Run the half precisions on the widened path (`HalfPath::Widened`: Flex's f32 GEMM and
    /// convolution over operands widened to f32), to compare with the default (bf16 dot
    /// products where the CPU has them, convolutions as im2col GEMMs).
    #[arg(long)]
    widened: bool,
    /// Cast every lower-class op to the half type, as PyTorch does (`SmallOps::Cast`), instead
    /// of keeping those too small to gain in f32 (the default, `SmallOps::KeepF32`).
    #[arg(long)]
    cast_small: bool,
    /// Compute on the thread that runs the steps too, as the first thread of rayon's pool
    /// (`threads::use_current_thread`), instead of handing every parallel op to the pool's
    /// threads and waiting.
    #[arg(long)]
    use_current_thread: bool,
    /// As `--use-current-thread`, with each of the pool's threads pinned to a CPU of its own
    /// (`threads::StepThreadsConfig::pin`).
    #[arg(long)]
    pin_threads: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Model {
    Mlp,
    Conv,
    Deep,
    Lstm,
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

#[derive(Module, Debug)]
struct DeepMlp<B: Backend> {
    layers: Vec<Linear<B>>,
    relu: Relu,
}

impl<B: Backend> DeepMlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..8)
                .map(|_| LinearConfig::new(1024, 1024).init(device))
                .collect(),
            relu: Relu::new(),
        }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i + 1 < self.layers.len() {
                x = self.relu.forward(x);
            }
        }
        x
    }
}

// Burn's `modern-lstm` example's shape: two bidirectional LSTM layers, a head on the last step.
#[derive(Module, Debug)]
struct LstmNet<B: Backend> {
    first: BiLstm<B>,
    second: BiLstm<B>,
    head: Linear<B>,
}

// Steps per sequence and features per step of the LSTM's input.
const LSTM_STEPS: usize = 10;
const LSTM_FEATURES: usize = 1;

impl<B: Backend> LstmNet<B> {
    fn new(hidden: usize, device: &B::Device) -> Self {
        Self {
            first: BiLstmConfig::new(LSTM_FEATURES, hidden, true).init(device),
            second: BiLstmConfig::new(2 * hidden, hidden, true).init(device),
            head: LinearConfig::new(2 * hidden, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 2> {
        let (x, _) = self.first.forward(x, None);
        let (x, _) = self.second.forward(x, None);
        let [batch, steps, features] = x.dims();
        let last = x
            .slice([0..batch, steps - 1..steps])
            .reshape([batch, features]);
        self.head.forward(last)
    }
}

// A model and a batch it is timed on.
enum Bench {
    Mlp(Box<Mlp<Acc>>, Tensor<Acc, 2>, Tensor<Acc, 2>),
    Conv(Box<ConvNet<Acc>>, Tensor<Acc, 4>, Tensor<Acc, 2>),
    Deep(Box<DeepMlp<Acc>>, Tensor<Acc, 2>, Tensor<Acc, 2>),
    Lstm(Box<LstmNet<Acc>>, Tensor<Acc, 3>, Tensor<Acc, 2>),
}

impl Bench {
    fn new(model: Model, batch: Option<usize>, hidden: usize) -> Self {
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
            Model::Deep => {
                let rows = batch.unwrap_or(4096);
                Bench::Deep(
                    Box::new(DeepMlp::new(&device)),
                    Tensor::random([rows, 1024], normal, &device),
                    Tensor::random([rows, 1024], normal, &device),
                )
            }
            Model::Lstm => {
                let sequences = batch.unwrap_or(32);
                Bench::Lstm(
                    Box::new(LstmNet::new(hidden, &device)),
                    Tensor::random([sequences, LSTM_STEPS, LSTM_FEATURES], normal, &device),
                    Tensor::random([sequences, 1], normal, &device),
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
                Bench::Deep(model, x, y) => (model.forward(x.clone()), y, &model.layers[0].bias),
                Bench::Lstm(model, x, y) => (
                    model.forward(x.clone()),
                    y,
                    &model.first.forward.input_gate.input_transform.bias,
                ),
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

// One step per line of stdin, in the precision it names; its milliseconds on stdout.
fn serve(bench: &Bench) {
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let precision: Precision = line.trim().parse().expect("a precision: f32, bf16, f16");
        let time = bench.step(precision);
        writeln!(out, "{:.4}", time.as_secs_f64() * 1e3).expect("stdout");
        out.flush().expect("stdout");
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let args = Args::parse();
    if args.use_current_thread || args.pin_threads {
        let pool = threads::StepThreadsConfig::new()
            .with_pin(args.pin_threads)
            .install();
        match pool {
            Ok(pool) => {
                if let Some(cpus) = pool.cpus() {
                    eprintln!("{} threads pinned to CPUs {cpus:?}", pool.count());
                }
            }
            Err(error) => {
                eprintln!("{error}");
                std::process::exit(2);
            }
        }
    }
    if args.widened {
        Context::process()
            .with_half_path(HalfPath::Widened)
            .set_as_default();
    }
    if args.cast_small {
        Context::process()
            .with_small_ops(SmallOps::Cast)
            .expect("a valid rule")
            .set_as_default();
    }
    let bench = Bench::new(args.model, args.batch, args.hidden);
    if args.serve {
        serve(&bench);
        return;
    }
    let variants: Vec<Precision> = [Precision::F32, Precision::Bf16, Precision::F16]
        .into_iter()
        .filter(|p| args.only.is_empty() || args.only.contains(p))
        .collect();
    let caps = capability::probe::<Acc>(&Default::default());
    println!(
        "small ops: {:?}, the device's threshold {:.1} MFLOP",
        autocast::small_ops(),
        caps.min_half_flops.unwrap_or(0) as f64 / 1e6
    );
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
