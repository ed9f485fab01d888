//! One MLP training step (forward, backward, gradient extraction) on Flex:
//! - `f32/autodiff` vs `f32/accelerated_off`: what the decorator costs with autocast off;
//! - `bf16/autocast` vs `bf16/hand_cast`: autocast against the same casts written by hand
//!   (f32 master weights, inputs and weights cast to bf16 in the forward pass);
//! - `cast/weight` vs `cast/matmul`: what one weight cast costs next to the matmul it feeds,
//!   which says whether a weight-cast cache would pay.
//!
//!     cargo bench --bench train_step

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, FloatDType, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast};
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

const BATCH: usize = 64;
const DIMS: [usize; 3] = [256, 512, 256];

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 7);
        Self {
            fc1: LinearConfig::new(DIMS[0], DIMS[1]).init(device),
            fc2: LinearConfig::new(DIMS[1], DIMS[2]).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }

    /// The forward pass with bf16 casts written out by hand, as a user would without autocast.
    fn forward_hand_cast(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let low = FloatDType::BF16;
        let linear = |l: &Linear<B>, x: Tensor<B, 2>| {
            let w = l.weight.val().cast(low);
            let b = l.bias.as_ref().map(|b| b.val().cast(low));
            burn::tensor::module::linear(x.cast(low), w, b)
        };
        let h = self.act.forward(linear(&self.fc1, x));
        linear(&self.fc2, h)
    }
}

fn step<B: AutodiffBackend>(model: &Mlp<B>, x: Tensor<B, 2>, hand_cast: bool) -> GradientsParams {
    let out = if hand_cast {
        model.forward_hand_cast(x)
    } else {
        model.forward(x)
    };
    let loss = out.cast(FloatDType::F32).powf_scalar(2.0).mean();
    GradientsParams::from_grads(loss.backward(), model)
}

fn bench_step<B: AutodiffBackend>(c: &mut Criterion, group: &str, name: &str, hand_cast: bool) {
    let device = B::Device::default();
    let model = Mlp::<B>::new(&device);
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device);
    c.benchmark_group(group).bench_function(name, |b| {
        b.iter(|| black_box(step(&model, x.clone(), hand_cast)))
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
