//! What dynamic loss scaling costs per optimizer step, on an MLP training step on Flex (f32):
//! - `step/plain`: forward, backward, `GradientsParams`, SGD step: the baseline;
//! - `step/accelerator_unscaled` and `step/accelerator_scaled`: the same through the
//!   `Accelerator`, without and with the dynamic scaler (scale the loss, unscale and check on
//!   the device, one host read, update the scale);
//! - `overhead/unscale_check_update`: only the unscale, the check, its read and the update, on
//!   gradients prepared outside the timing.
//!
//! Also prints the host synchronisations one scaled step makes (`grads::host_reads`).
//!
//!     cargo bench --bench scaler

mod common;

use burn::backend::{Autodiff, Flex};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::{
    AccelerateConfig, Accelerator, GradScalerConfig, GradientState, LossScale, grads,
};
use common::Mlp;
use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::{Duration, Instant};

type B = Autodiff<Flex>;

const BATCH: usize = 64;
const DIMS: [usize; 3] = [256, 512, 256];
const LR: f64 = 1e-3;

fn loss(model: &Mlp<B>, x: Tensor<B, 2>) -> Tensor<B, 1> {
    model.forward(x).powi_scalar(2).mean()
}

fn accelerator(scaled: bool) -> Accelerator<B> {
    AccelerateConfig::new()
        .with_grad_scaler(GradScalerConfig::new().with_enabled(Some(scaled)))
        .init_with_state::<B>(&Default::default(), GradientState::new())
        .expect("valid config")
}

fn training_steps(c: &mut Criterion) {
    let device = Default::default();
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device);
    let mut group = c.benchmark_group("step");

    let mut model = Some(Mlp::<B>::new(DIMS, &device));
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    group.bench_function("plain", |b| {
        b.iter(|| {
            let m = model.take().unwrap();
            let grads = GradientsParams::from_grads(loss(&m, x.clone()).backward(), &m);
            model = Some(black_box(optim.step(LR, m, grads)));
        })
    });

    for (name, scaled) in [
        ("accelerator_unscaled", false),
        ("accelerator_scaled", true),
    ] {
        let mut acc = accelerator(scaled);
        let mut model = Some(Mlp::<B>::new(DIMS, &device));
        let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
        let mut lr = LR;
        group.bench_function(name, |b| {
            b.iter(|| {
                let m = model.take().unwrap();
                acc.backward(loss(&m, x.clone()), &m);
                let (m, outcome) = acc
                    .optimizer_step(&mut optim, m, &mut lr)
                    .expect("one process: no collective to fail");
                assert!(outcome.applied());
                model = Some(black_box(m));
            })
        });
    }
    group.finish();

    // The host synchronisations of one scaled step, counted where the crate reads.
    let mut acc = accelerator(true);
    let model = Mlp::<B>::new(DIMS, &device);
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    let before = grads::host_reads();
    acc.backward(loss(&model, x.clone()), &model);
    let _ = acc
        .optimizer_step(&mut optim, model, &mut LR.clone())
        .expect("one process: no collective to fail");
    println!(
        "host synchronisations per scaled optimizer step: {}",
        grads::host_reads() - before
    );
}

/// Only the scaler's own work, on gradients fresh from a backward pass (hot in cache, as in a
/// real step): the backward runs outside the timed region.
fn unscale_check_update(c: &mut Criterion) {
    let device = Default::default();
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device);
    let model = Mlp::<B>::new(DIMS, &device);
    let mut scale = GradScalerConfig::new()
        .with_enabled(Some(true))
        .init(Default::default())
        .expect("valid config");
    c.benchmark_group("overhead")
        .bench_function("unscale_check_update", |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let loss = scale.scale(loss(&model, x.clone()));
                    let mut g = GradientsParams::from_grads(loss.backward(), &model);
                    let start = Instant::now();
                    let check = grads::unscale_and_check::<B, _>(&model, &mut g, scale.inv_scale());
                    scale = scale.adjust(check.found_inf());
                    timed += start.elapsed();
                    black_box(g);
                }
                timed
            })
        });
    assert!(matches!(scale, LossScale::Dynamic(_)));
}

/// The fraction the issue asks for, measured robustly on a shared machine: each iteration
/// times a whole scaled training step and, inside it, the scaler's own part (unscale, check,
/// read, update), so both see the same load; medians over many iterations.
fn overhead_fraction(_c: &mut Criterion) {
    const ITERS: usize = 400;
    let device = Default::default();
    let x = Tensor::<B, 2>::random([BATCH, DIMS[0]], Distribution::Normal(0., 1.), &device);
    let mut model = Mlp::<B>::new(DIMS, &device);
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    let mut scale = GradScalerConfig::new()
        .with_enabled(Some(true))
        .init(Default::default())
        .expect("valid config");
    let (mut steps, mut parts) = (Vec::new(), Vec::new());
    for i in 0..ITERS + 20 {
        let start = Instant::now();
        let loss = scale.scale(loss(&model, x.clone()));
        let mut g = GradientsParams::from_grads(loss.backward(), &model);
        let part = Instant::now();
        let check = grads::unscale_and_check::<B, _>(&model, &mut g, scale.inv_scale());
        let found_inf = check.found_inf();
        scale = scale.adjust(found_inf);
        let part = part.elapsed();
        if !found_inf {
            model = optim.step(LR, model, g);
        }
        if i >= 20 {
            steps.push(start.elapsed());
            parts.push(part);
        }
    }
    steps.sort();
    parts.sort();
    let (step, part) = (steps[ITERS / 2], parts[ITERS / 2]);
    println!(
        "interleaved medians over {ITERS} scaled steps: step {:.3} ms, unscale+check+update \
         {:.1} us = {:.2}% of the step",
        step.as_secs_f64() * 1e3,
        part.as_secs_f64() * 1e6,
        100.0 * part.as_secs_f64() / step.as_secs_f64()
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(6));
    targets = training_steps, unscale_check_update, overhead_fraction
}
criterion_main!(benches);
