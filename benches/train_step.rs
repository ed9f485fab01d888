//! One MLP training step (forward, backward, gradient extraction) on Flex:
//! - `f32/autodiff` vs `f32/accelerated_off`: what the decorator costs with autocast off;
//! - `bf16/autocast` vs `bf16/hand_cast`: autocast against the same casts written by hand
//!   (f32 master weights, inputs and weights cast to bf16 in the forward pass);
//! - `cast/weight` vs `cast/matmul`: what one weight cast costs next to the matmul it feeds,
//!   which says whether a weight-cast cache would pay.
//!
//!     cargo bench --bench train_step

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast};
use common::{Mlp, mlp_step};
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

const BATCH: usize = 64;
const DIMS: [usize; 3] = [256, 512, 256];

fn bench_step<B: AutodiffBackend>(c: &mut Criterion, group: &str, name: &str, hand_cast: bool) {
    let device = B::Device::default();
    let model = Mlp::<B>::new(DIMS, &device);
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device);
    let hand_cast = hand_cast.then_some(FloatDType::BF16);
    c.benchmark_group(group).bench_function(name, |b| {
        b.iter(|| black_box(mlp_step(&model, x.clone(), hand_cast)))
    });
}

fn decorator_overhead(c: &mut Criterion) {
    let _off = autocast::disable();
    bench_step::<Autodiff<Flex>>(c, "f32", "autodiff", false);
    bench_step::<Accelerated<Autodiff<Flex>>>(c, "f32", "accelerated_off", false);
}

fn autocast_vs_hand_cast(c: &mut Criterion) {
    {
        let _off = autocast::disable();
        bench_step::<Autodiff<Flex>>(c, "bf16", "hand_cast", true);
    }
    let _bf16 = autocast::enable(Precision::Bf16);
    bench_step::<Accelerated<Autodiff<Flex>>>(c, "bf16", "autocast", false);
}

fn weight_cast_cost(c: &mut Criterion) {
    type B = Flex;
    let device = Default::default();
    let w = Param::from_tensor(Tensor::<B, 2>::random(
        [DIMS[0], DIMS[1]],
        Distribution::Normal(0., 1.),
        &device,
    ));
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device)
        .cast(FloatDType::BF16);
    let wl = w.val().cast(FloatDType::BF16);
    let mut group = c.benchmark_group("cast");
    group.bench_function("weight", |b| {
        b.iter(|| black_box(w.val().cast(FloatDType::BF16)).into_data())
    });
    group.bench_function("matmul", |b| {
        b.iter(|| black_box(x.clone().matmul(wl.clone())).into_data())
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(6));
    targets = decorator_overhead, autocast_vs_hand_cast, weight_cast_cost
}
criterion_main!(benches);
