//! One MLP training step on LibTorch's CPU device, where low precision pays on a CPU with
//! bf16 kernels: does the decorator keep the speed-up that casting by hand gives?
//! - `f32/autodiff`: `Autodiff<LibTorch>`, no casts;
//! - `bf16/hand_cast`: `Autodiff<LibTorch>`, inputs and weights cast to bf16 by hand;
//! - `bf16/autocast`: `Accelerated<Autodiff<LibTorch>>` under bf16 autocast, model unchanged.
//!
//! f16 is left out: LibTorch has no CPU f16 matmul (about 50× slower than f32), which the
//! capability probe flags and `AutocastConfig::init` refuses; the run prints what the probe
//! found. Model 512 → 2048 → 512, batch 256.
//!
//!     scripts/bench-tch.sh

mod common;

use burn::backend::libtorch::LibTorchDevice;
use burn::backend::{Autodiff, LibTorch};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast, capability};
use common::{Mlp, mlp_step};
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

const BATCH: usize = 256;
const DIMS: [usize; 3] = [512, 2048, 512];

fn bench_step<B: AutodiffBackend<Device = LibTorchDevice>>(
    c: &mut Criterion,
    group: &str,
    name: &str,
    hand_cast: Option<FloatDType>,
) {
    let device = LibTorchDevice::Cpu;
    let model = Mlp::<B>::new(DIMS, &device);
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device);
    c.benchmark_group(group).bench_function(name, |b| {
        b.iter(|| black_box(mlp_step(&model, x.clone(), hand_cast)))
    });
}

fn libtorch_cpu(c: &mut Criterion) {
    let caps = capability::probe::<LibTorch>(&LibTorchDevice::Cpu);
    println!("capability probe, libtorch<cpu>: {caps}");
    {
        let _off = autocast::disable();
        bench_step::<Autodiff<LibTorch>>(c, "f32", "autodiff", None);
        bench_step::<Autodiff<LibTorch>>(c, "bf16", "hand_cast", Some(FloatDType::BF16));
    }
    let _bf16 = autocast::enable(Precision::Bf16);
    bench_step::<Accelerated<Autodiff<LibTorch>>>(c, "bf16", "autocast", None);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(3))
        .measurement_time(Duration::from_secs(10));
    targets = libtorch_cpu
}
criterion_main!(benches);
