//! Autocast's bf16 matmul on Flex, the GEMM alone, on the MLP's shapes (`examples/autocast_ab`):
//! - `f32`: Flex's f32 matmul, what autocast saves against;
//! - `bf16_flex`: Flex's own bf16 matmul (autocast off);
//! - `bf16_widened`: autocast's path with operands widened to f32 (`HalfPath::Widened`);
//! - `bf16_dot`: autocast's path on AVX512-BF16 dot products, where the CPU has them
//!   (`HalfPath::ViaF32`; elsewhere the same as `bf16_widened`).
//!
//! The forward product `[256, 512] @ [512, 2048]`, the weight gradient's
//! `[512, 256]ᵀ-view @ [256, 2048]`, and attention's scores (a batch of 32 products of
//! `[128, 64]` by a transposed `[128, 64]`), operands already bf16 (casts are timed elsewhere).
//!
//!     cargo bench --bench half_matmul

use burn::backend::Flex;
use burn::tensor::{Distribution, FloatDType, Tensor};
use burn_accelerate::capability::{self, HalfPath};
use burn_accelerate::{Accelerated, Precision, autocast};
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;

type Acc = Accelerated<Flex>;

fn operands(m: usize, k: usize, n: usize, transposed_a: bool) -> (Tensor<Acc, 2>, Tensor<Acc, 2>) {
    let device = Default::default();
    let random =
        |shape: [usize; 2]| Tensor::<Acc, 2>::random(shape, Distribution::Normal(0., 1.), &device);
    let a = match transposed_a {
        true => random([k, m]).transpose(),
        false => random([m, k]),
    };
    (a, random([k, n]))
}

// The four variants of `a @ b` (f32 operands given, cast to bf16 once, their layouts kept).
fn variants<const D: usize>(c: &mut Criterion, name: &str, a: Tensor<Acc, D>, b: Tensor<Acc, D>) {
    let (al, bl) = (
        a.clone().cast(FloatDType::BF16),
        b.clone().cast(FloatDType::BF16),
    );
    let mut group = c.benchmark_group(name);
    let _off = autocast::disable();
    group.bench_function("f32", |bench| {
        bench.iter(|| black_box(a.clone().matmul(b.clone())).into_data())
    });
    group.bench_function("bf16_flex", |bench| {
        bench.iter(|| black_box(al.clone().matmul(bl.clone())).into_data())
    });
    let _bf16 = autocast::enable(Precision::Bf16);
    for (path, label) in [
        (HalfPath::Widened, "bf16_widened"),
        (HalfPath::ViaF32, "bf16_dot"),
    ] {
        let _path = capability::scope_half_path(path);
        group.bench_function(label, |bench| {
            bench.iter(|| black_box(al.clone().matmul(bl.clone())).into_data())
        });
    }
}

fn matmuls(c: &mut Criterion, name: &str, [m, k, n]: [usize; 3], transposed_a: bool) {
    let (a, b) = operands(m, k, n, transposed_a);
    variants(c, name, a, b);
}

// Attention's scores: queries `[32, 128, 64]` by transposed keys, a batch of 32 products.
fn attention(c: &mut Criterion) {
    let device = Default::default();
    let random =
        |shape: [usize; 3]| Tensor::<Acc, 3>::random(shape, Distribution::Normal(0., 1.), &device);
    let (q, k) = (random([32, 128, 64]), random([32, 128, 64]));
    variants(c, "matmul_attention_32x128x64", q, k.swap_dims(1, 2));
}

fn forward(c: &mut Criterion) {
    matmuls(c, "matmul_256x512x2048", [256, 512, 2048], false);
}

fn weight_gradient(c: &mut Criterion) {
    matmuls(c, "matmul_512x256x2048_at", [512, 256, 2048], true);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = forward, weight_gradient, attention
}
criterion_main!(benches);
