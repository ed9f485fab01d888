//! The decorator's armed loss scale: an unmodified `loss.backward()` on
//! `Accelerated<Autodiff<Flex>>` is scaled while a scale is armed, from any thread, and the
//! crate's unscale brings the gradients back.
//!
//! The armed scale is process-wide, so this binary holds one test: nothing else may run a
//! backward pass while it arms.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::scaler::{self, ArmedLossScale};
use burn_accelerate::{Accelerated, grads};

type B = Accelerated<Autodiff<Flex>>;

/// What a user's `TrainStep` does: forward, an unmodified `loss.backward()`, and Burn's own
/// gradient extraction.
fn train_step(model: &Linear<B>, x: Tensor<B, 2>) -> GradientsParams {
    let loss = model.forward(x).powi_scalar(2).mean();
    GradientsParams::from_grads(loss.backward(), model)
}

fn flat(grads: &GradientsParams, model: &Linear<B>) -> Vec<f32> {
    let w = grads.get::<Accelerated<Flex>, 2>(model.weight.id).unwrap();
    let b = grads
        .get::<Accelerated<Flex>, 1>(model.bias.as_ref().unwrap().id)
        .unwrap();
    let mut out = w.into_data().to_vec::<f32>().unwrap();
    out.extend(b.into_data().to_vec::<f32>().unwrap());
    out
}

#[test]
fn armed_scale_multiplies_an_unmodified_backward_and_unscale_undoes_it() {
    let device = Default::default();
    B::seed(&device, 9);
    let model = LinearConfig::new(6, 3).init::<B>(&device);
    let x = Tensor::<B, 2>::random([5, 6], Distribution::Normal(0.0, 1.0), &device);

    assert_eq!(scaler::armed(), None);
    let plain = flat(&train_step(&model, x.clone()), &model);

    let armed = ArmedLossScale::arm(1024.0);
    let mut scaled_grads = train_step(&model, x.clone());
    let scaled = flat(&scaled_grads, &model);
    // A power of two scales every value exactly.
    let expected: Vec<f32> = plain.iter().map(|g| g * 1024.0).collect();
    assert_eq!(scaled, expected, "armed: gradients x1024 exactly");

    // The training strategy's side: the same unscale-and-check the Accelerator uses.
    let check = grads::unscale_and_check::<B, _>(&model, &mut scaled_grads, 1.0 / 1024.0);
    assert!(!check.found_inf());
    assert_eq!(
        flat(&scaled_grads, &model),
        plain,
        "unscaled: back to the plain gradients"
    );

    // Process-wide: a worker thread's backward (Burn's multi-device loop) is scaled too.
    armed.set(2.0);
    let (worker_model, worker_x) = (model.clone(), x.clone());
    let from_worker = std::thread::spawn(move || {
        flat(&train_step(&worker_model, worker_x.clone()), &worker_model)
    })
    .join()
    .unwrap();
    let doubled: Vec<f32> = plain.iter().map(|g| g * 2.0).collect();
    assert_eq!(from_worker, doubled);

    // Overflow shows up in the check: a scale that pushes the gradients past f32.
    armed.set(f32::MAX);
    let mut huge = train_step(&model, x.clone().mul_scalar(1e10));
    let check = grads::unscale_and_check::<B, _>(&model, &mut huge, 1.0 / f32::MAX);
    assert!(check.found_inf());

    drop(armed);
    assert_eq!(scaler::armed(), None);
    assert_eq!(
        flat(&train_step(&model, x), &model),
        plain,
        "disarmed: plain again"
    );
    let _ = model.num_params();
}
