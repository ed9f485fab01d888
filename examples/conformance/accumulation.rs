//! Conformance runner for the `accumulation` suite: accelerate's
//! `with accelerator.accumulate(model):` loop over 2 epochs, reproduced with the same tiny
//! model (`Linear(1, 1)`, weight 1, bias 0), SGD at lr 0.1 and a `LambdaLR(1 / (step + 1))`
//! scheduler, driven through the crate's API: a [`GradientState`] data-loader registration
//! per epoch, [`Accelerator::accumulate`], [`Accelerator::backward`] on `model(x).sum()` and
//! [`Accelerator::optimizer_step`].
//!
//! The loss divisor is observed the way the golden file measured it, from the gradients:
//! `len(batch) / Δ grad(bias)` across the backward pass (d loss / d bias is 1 per sample).

use burn::backend::Autodiff;
use burn::lr_scheduler::LrScheduler;
use burn::module::Param;
use burn::nn::Linear;
use burn::optim::SgdConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_accelerate::{AccelerateConfig, Accelerator, GradientState};
use serde_json::{Value, json};

use crate::case::{count, flag};

#[cfg(feature = "flex")]
type Inner = burn::backend::Flex;
#[cfg(all(not(feature = "flex"), feature = "ndarray"))]
type Inner = burn::backend::NdArray;
type B = Autodiff<Inner>;

/// The suites this module answers.
pub const SUITES: [&str; 1] = ["accumulation"];

const BASE_LR: f64 = 0.1;

/// torch's `LambdaLR(optimizer, lambda step: 1 / (step + 1))` as a Burn scheduler.
///
/// Burn asks a scheduler for the learning rate of each optimizer step as it happens
/// (`step()` returns the rate to use now), where torch applies the current rate and then
/// advances; so `step()` returns `base * λ(steps taken)` and then counts the step.
#[derive(Clone, Debug)]
pub struct LambdaLr {
    base: f64,
    steps: usize,
}

impl LambdaLr {
    /// The scheduler at its start.
    pub fn new(base: f64) -> Self {
        Self { base, steps: 0 }
    }

    /// The rate the next optimizer step will use (torch's `get_last_lr()` after
    /// `scheduler.step()`).
    pub fn current(&self) -> f64 {
        self.base * (1.0 / (self.steps as f64 + 1.0))
    }
}

impl LrScheduler for LambdaLr {
    type Record<Bk: Backend> = usize;

    fn step(&mut self) -> f64 {
        let lr = self.current();
        self.steps += 1;
        lr
    }

    fn to_record<Bk: Backend>(&self) -> usize {
        self.steps
    }

    fn load_record<Bk: Backend>(self, steps: usize) -> Self {
        Self { steps, ..self }
    }
}

/// Runs `case` and returns `{"id", "batches": [{"sync_gradients", "end_of_dataloader",
/// "optimizer_stepped", "observed_loss_divisor", "weight_after", "bias_after", "lr_after"},
/// ...]}`, or `{"id", "error"}` if the crate refuses the configuration.
///
/// # Panics
/// On a suite not in [`SUITES`] or a case missing its inputs: bugs in the caller or the
/// golden file, not results.
pub fn run_case(suite: &str, case: &Value) -> Value {
    assert!(
        SUITES.contains(&suite),
        "accumulation::run_case does not handle suite {suite:?}"
    );
    let id = case["id"].clone();
    if case["effective_adjust_scheduler"].as_bool() != Some(false) {
        // The crate has no adjust_scheduler (it is effectively off in accelerate 1.16).
        return json!({ "id": id, "error": "adjust_scheduler in effect: not supported" });
    }
    let device = Default::default();
    let config = AccelerateConfig::new()
        .with_gradient_accumulation_steps(count(case, "gradient_accumulation_steps"))
        .with_sync_with_dataloader(flag(case, "effective_sync_with_dataloader"));
    let state = GradientState::new();
    let mut accelerator = match config.init_with_state::<B>(&device, state.clone()) {
        Ok(accelerator) => accelerator,
        Err(e) => return json!({ "id": id, "error": e.to_string() }),
    };

    let mut model = Linear::<B> {
        weight: Param::from_tensor(Tensor::ones([1, 1], &device)),
        bias: Some(Param::from_tensor(Tensor::zeros([1], &device))),
    };
    let bias_id = model
        .bias
        .as_ref()
        .map(|b| b.id)
        .expect("the model has a bias");
    let mut optim = SgdConfig::new().init::<B, Linear<B>>();
    let mut scheduler = LambdaLr::new(BASE_LR);

    let num_samples = count(case, "num_samples");
    let batch_size = count(case, "batch_size");
    let samples: Vec<f32> = (1..=num_samples).map(|s| s as f32).collect();
    let batches: Vec<&[f32]> = samples.chunks(batch_size).collect();

    let mut out = Vec::new();
    for _epoch in 0..count(case, "epochs") {
        let loader = state.begin_dataloader();
        for (i, batch) in batches.iter().enumerate() {
            if i + 1 == batches.len() {
                loader.set_end_of_dataloader(Some(num_samples % batch_size));
            }
            let _step = accelerator.accumulate(&model);
            let sync_gradients = accelerator.sync_gradients();
            let end_of_dataloader = state.end_of_dataloader();

            let x = Tensor::<B, 2>::from_data(
                TensorData::new(batch.to_vec(), [batch.len(), 1]),
                &device,
            );
            let loss = model.forward(x).sum();
            let bias_grad_before = bias_grad(&accelerator, bias_id);
            accelerator.backward(loss, &model);
            let delta = bias_grad(&accelerator, bias_id) - bias_grad_before;
            let observed_loss_divisor = batch.len() as f64 / f64::from(delta);

            let (next, outcome) = accelerator
                .optimizer_step(&mut optim, model, &mut scheduler)
                .expect("one process: no collective to fail");
            model = next;
            out.push(json!({
                "sync_gradients": sync_gradients,
                "end_of_dataloader": end_of_dataloader,
                "optimizer_stepped": outcome.applied(),
                "observed_loss_divisor": observed_loss_divisor,
                "weight_after": scalar(model.weight.val()),
                "bias_after": scalar(model.bias.as_ref().expect("bias").val()),
                "lr_after": scheduler.current(),
            }));
        }
    }
    json!({ "id": id, "batches": out })
}

fn bias_grad(accelerator: &Accelerator<B>, id: burn::module::ParamId) -> f32 {
    accelerator
        .gradients()
        .get::<Inner, 1>(id)
        .map_or(0.0, |g| g.into_scalar().elem())
}

fn scalar<const D: usize>(tensor: Tensor<B, D>) -> f32 {
    tensor.into_scalar().elem()
}
