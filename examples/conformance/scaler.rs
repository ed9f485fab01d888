//! Conformance runner for the `grad_scaler` suite: torch's `GradScaler` driving SGD on a
//! `Linear(3, 1)`, reproduced with real tensors through the crate's [`Accelerator`]: the loss
//! is scaled by `Accelerator::backward`, the case's bad value is written into a real
//! gradient tensor, and `Accelerator::optimizer_step` unscales, checks, steps (or skips) and
//! updates the scale.
//!
//! What is not reproduced is torch's random initialisation and data: the fields `check.py`
//! compares (scale, growth tracker, skipped steps, final state) do not depend on them, with
//! one exception. Where torch's scaled gradients overflowed on their own (`loss_mult` 1e34,
//! recorded per step as `natural_nonfinite_grad`), this runner feeds a batch whose target is
//! 1e30, so that the crate's gradients overflow on their own at those steps too; nothing is
//! injected there. The other batches are small (inputs, targets and initial weights in
//! ±0.1), so that they do not overflow where torch's did not.

use burn::backend::Autodiff;
use burn::module::ParamId;
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use burn_accelerate::{
    AccelerateConfig, Accelerator, GradScalerConfig, GradientState, LossScale, StepOutcome,
};
use serde_json::{Value, json};

use crate::case::{count, flag, number};

#[cfg(feature = "flex")]
type Inner = burn::backend::Flex;
#[cfg(all(not(feature = "flex"), feature = "ndarray"))]
type Inner = burn::backend::NdArray;
type B = Autodiff<Inner>;

/// The suites this module answers.
pub const SUITES: [&str; 1] = ["grad_scaler"];

const BATCH: usize = 4;
/// A target this far from any prediction makes the scaled gradients overflow f32.
const OVERFLOWING_TARGET: f32 = 1e30;

/// Runs `case` and returns `{"id", "scale_after", "growth_tracker_after", "step_skipped",
/// "final_state"}`, or `{"id", "error"}` if the crate refuses the configuration.
///
/// # Panics
/// On a suite not in [`SUITES`] or a case missing its inputs: bugs in the caller or the
/// golden file, not results.
pub fn run_case(suite: &str, case: &Value) -> Value {
    assert!(
        SUITES.contains(&suite),
        "scaler::run_case does not handle suite {suite:?}"
    );
    let id = case["id"].clone();
    let device = Default::default();
    let scaler = GradScalerConfig::new()
        .with_enabled(Some(flag(case, "enabled")))
        .with_init_scale(number(case, "init_scale"))
        .with_growth_factor(number(case, "growth_factor"))
        .with_backoff_factor(number(case, "backoff_factor"))
        .with_growth_interval(count(case, "growth_interval") as u32);
    // torch's `GradScaler("cpu")` on an f32 model: scaling without autocast.
    let config = AccelerateConfig::new().with_grad_scaler(scaler);
    let mut accelerator = match config.init_with_state::<B>(&device, GradientState::new()) {
        Ok(accelerator) => accelerator,
        Err(e) => return json!({ "id": id, "error": e.to_string() }),
    };

    B::seed(&device, count(case, "seed") as u64);
    let mut model: Linear<B> = LinearConfig::new(3, 1)
        .with_initializer(Initializer::Uniform {
            min: -0.1,
            max: 0.1,
        })
        .init(&device);
    let mut optim = SgdConfig::new().init::<B, Linear<B>>();
    let mut lr = number(case, "lr");
    let loss_mult = number(case, "loss_mult") as f32;
    let unscale_first = flag(case, "unscale_before_step");

    let steps = count(case, "steps");
    let (mut scale_after, mut tracker_after, mut skipped) = (vec![], vec![], vec![]);
    for i in 0..steps {
        let natural_overflow = case["natural_nonfinite_grad"][i].as_bool() == Some(true);
        let (x, y) = batch(&device, natural_overflow);
        let _step = accelerator.accumulate(&model);
        let loss = (model.forward(x) - y)
            .powi_scalar(2)
            .mean()
            .mul_scalar(loss_mult);
        accelerator.backward(loss, &model);
        if let Some(bad) = bad_value(&case["bad_value"][i]) {
            inject(accelerator.gradients_mut(), model.weight.id, i % 3, bad);
        }
        if unscale_first {
            accelerator
                .unscale_gradients(&model)
                .expect("one process: no collective to fail");
        }
        let (next, outcome) = accelerator
            .optimizer_step(&mut optim, model, &mut lr)
            .expect("one process: no collective to fail");
        model = next;
        let (scale, tracker) = scale_and_tracker(&accelerator);
        scale_after.push(scale);
        tracker_after.push(tracker);
        skipped.push(outcome == StepOutcome::SkippedOverflow);
    }
    let final_state = match accelerator.state().loss_scale {
        // torch's `state_dict()` of a disabled scaler is empty.
        LossScale::None => json!({}),
        _ => {
            let (scale, tracker) = scale_and_tracker(&accelerator);
            json!({ "scale": scale, "growth_tracker": tracker })
        }
    };
    json!({
        "id": id,
        "scale_after": scale_after,
        "growth_tracker_after": tracker_after,
        "step_skipped": skipped,
        "final_state": final_state,
    })
}

/// `scaler.get_scale()` and `_growth_tracker`, as torch reports them (1.0 and 0 when off).
fn scale_and_tracker(accelerator: &Accelerator<B>) -> (f32, u32) {
    match accelerator.loss_scale() {
        LossScale::Dynamic(d) => (d.scale(), d.growth_tracker()),
        other => (other.loss_scale(), 0),
    }
}

fn batch(device: &Device<B>, overflow: bool) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let small = Distribution::Uniform(-0.1, 0.1);
    let x = Tensor::random([BATCH, 3], small, device);
    let y = if overflow {
        Tensor::full([BATCH, 1], OVERFLOWING_TARGET, device)
    } else {
        Tensor::random([BATCH, 1], small, device)
    };
    (x, y)
}

/// torch's `weight.grad[0, column] = value`; Burn stores the weight as `[d_in, d_out]`.
fn inject(grads: &mut GradientsParams, id: ParamId, column: usize, value: f32) {
    let grad = grads
        .remove::<Inner, 2>(id)
        .expect("the backward pass gave the weight a gradient");
    let device = grad.device();
    let bad = Tensor::from_data(TensorData::new(vec![value], [1, 1]), &device);
    grads.register(id, grad.slice_assign([column..column + 1, 0..1], bad));
}

fn bad_value(value: &Value) -> Option<f32> {
    match value.as_str()? {
        "inf" => Some(f32::INFINITY),
        "-inf" => Some(f32::NEG_INFINITY),
        "nan" => Some(f32::NAN),
        other => panic!("unknown bad_value {other:?}"),
    }
}
