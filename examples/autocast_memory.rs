//! Peak memory of one training step of an activation-heavy model on
//! `Accelerated<Autodiff<Flex>>`: 8 linear layers of 1024 with ReLU, batch 4096, in f32 against
//! bf16 and f16 autocast. Each precision runs in a process of its own (this program, started
//! again with `--precision`), so that one variant's freed memory cannot hide another's peak.
//!
//! ```text
//! cargo run --release --example autocast_memory
//! ```
//!
//! Printed: each variant's peak resident set (`VmHWM`) and its ratio to f32's. Linux only.

use std::process::Command;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast};
use clap::Parser;

type Acc = Accelerated<Autodiff<Flex>>;

/// Peak resident memory of one training step, f32 against bf16 and f16 autocast.
#[derive(Parser)]
struct Args {
    /// Run one step in this precision and print its peak (what the driver starts).
    #[arg(long)]
    precision: Option<Precision>,
    /// Rows per batch.
    #[arg(long, default_value_t = 4096)]
    batch: usize,
    /// Linear layers (each `width → width`, with ReLU).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Features per layer.
    #[arg(long, default_value_t = 1024)]
    width: usize,
}

#[derive(Module, Debug)]
struct Deep<B: Backend> {
    layers: Vec<Linear<B>>,
    relu: Relu,
}

impl<B: Backend> Deep<B> {
    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = self.relu.forward(layer.forward(x));
        }
        x
    }
}

// This process's peak resident set, in KiB.
fn peak_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux's /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("a VmHWM line");
    line.split_whitespace()
        .nth(1)
        .and_then(|kib| kib.parse().ok())
        .expect("VmHWM in kB")
}

fn one_step(args: &Args, precision: Precision) {
    let device = Default::default();
    let model = Deep::<Acc> {
        layers: (0..args.layers)
            .map(|_| LinearConfig::new(args.width, args.width).init(&device))
            .collect(),
        relu: Relu::new(),
    };
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<Acc, 2>::random([args.batch, args.width], normal, &device);
    let before = peak_kib();
    let grads = {
        let _autocast = autocast::enable(precision);
        model.forward(x).powi_scalar(2).mean().backward()
    };
    let bias = model.layers[0]
        .bias
        .as_ref()
        .expect("layers have biases")
        .val();
    assert!(
        bias.grad(&grads).is_some(),
        "the first layer has a gradient"
    );
    println!("{} {}", before, peak_kib());
}

fn main() {
    let args = Args::parse();
    if let Some(precision) = args.precision {
        one_step(&args, precision);
        return;
    }
    let me = std::env::current_exe().expect("the path of this program");
    let mut peaks = Vec::new();
    for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
        let out = Command::new(&me)
            .args(["--precision", &precision.to_string()])
            .args([
                "--batch",
                &args.batch.to_string(),
                "--layers",
                &args.layers.to_string(),
            ])
            .args(["--width", &args.width.to_string()])
            .output()
            .expect("this program, started again");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let kib: Vec<u64> = text
            .split_whitespace()
            .map(|v| v.parse().expect("KiB"))
            .collect();
        peaks.push((precision, kib[0], kib[1]));
    }
    let f32_peak = peaks[0].2 as f64;
    for (precision, before, peak) in peaks {
        println!(
            "{:<5} peak {:>5} MiB (model and batch: {:>4} MiB)  {:.2}× f32's peak",
            precision.to_string(),
            peak / 1024,
            before / 1024,
            peak as f64 / f32_peak
        );
    }
}
