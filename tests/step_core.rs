//! One step core under both entry points (issue 37): the same model, data and settings
//! through a hand-written loop on the `Accelerator` and through Burn's `SupervisedTraining`
//! with `with_accelerate` end with bit-identical parameters: in f32, in f16 with forced
//! overflows, with accumulation 3 and a partial last window (Accelerate's divisor and
//! `divide_partial_window_by_length`), and with clipping. ZeRO stage 2 on two processes is in
//! `tests/processes` (`both_entry_points_step_alike_at_zero_stage_2`).
//!
//! Each training's autocast, small-op rule and armed loss transform are its threads': the
//! tests run at once. Only seeding takes a lock ([`seeded_model`]): the backend's generator
//! is the process's (Burn's `Backend::seed`), so two tests seeding at once would draw each
//! other's initial weights.
#![cfg(feature = "flex")]

#[path = "../examples/common/mlp.rs"]
mod mlp;
mod param_bits;

use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::AutodiffModule;
use burn::optim::AdamConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::{Learner, SupervisedTraining};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
use burn_accelerate::{
    AccelerateConfig, Accelerated, GradScalerConfig, GradientState, Precision, StepOutcome,
};
use mlp::{BlobBatch, BlobBatcher, Mlp, QuietRenderer, blobs};
use param_bits::param_bits;

type B = Accelerated<Autodiff<Flex>>;

const SEED: u64 = 11;
const HIDDEN: usize = 16;
const BATCH: usize = 4;
// 7 batches an epoch: windows of 3, 3 and 1 at accumulation 3.
const ITEMS: usize = 28;
const EPOCHS: usize = 2;
const LR: f64 = 3e-2;

fn loader<Bk: Backend>() -> Arc<dyn DataLoader<Bk, BlobBatch<Bk>>> {
    DataLoaderBuilder::<Bk, _, _>::new(BlobBatcher)
        .batch_size(BATCH)
        .build(InMemDataset::new(blobs(ITEMS, 3)))
}

// The model both entry points start from, its parameters drawn (Burn draws them lazily, at
// first use) under a lock: the backend's generator is the process's.
fn seeded_model(device: &burn::tensor::Device<B>) -> Mlp<B> {
    static SEEDING: Mutex<()> = Mutex::new(());
    let _seeding = SEEDING.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, SEED);
    let model = Mlp::<B>::new(HIDDEN, device);
    param_bits(&model);
    model
}

// Burn's `SupervisedTraining` with `with_accelerate`.
fn through_the_strategy(config: &AccelerateConfig) -> Vec<u32> {
    let device = Default::default();
    let strategy = AccelerateStrategy::new(config.clone(), &device).expect("a valid config");
    let model = seeded_model(&device);
    let learner = Learner::new(model, AdamConfig::new().init(), LR);
    let dir =
        std::env::temp_dir().join(format!("burn-accelerate-step-core-{}", std::process::id()));
    let result = SupervisedTraining::new(
        &dir,
        loader::<B>(),
        loader::<<B as AutodiffBackend>::InnerBackend>(),
    )
    .num_epochs(EPOCHS)
    .renderer(QuietRenderer)
    .with_application_logger(None)
    .with_accelerate(strategy)
    .launch(learner);
    let _ = std::fs::remove_dir_all(&dir);
    param_bits(&result.model)
}

// A hand-written loop on the `Accelerator`, over the same batches.
fn through_the_accelerator(config: &AccelerateConfig) -> (Vec<u32>, Vec<StepOutcome>) {
    let device = Default::default();
    let mut accelerator = config
        .init_with_state::<B>(&device, GradientState::new())
        .expect("a valid config");
    let mut model = seeded_model(&device);
    let mut optimizer = AdamConfig::new().init::<B, Mlp<B>>();
    let mut lr = LR;
    let mut outcomes = Vec::new();
    let loader = loader::<B>();
    for _ in 0..EPOCHS {
        let active = accelerator.gradient_state().begin_dataloader();
        let batches: Vec<_> = loader.iter().collect();
        let last = batches.len() - 1;
        for (i, batch) in batches.into_iter().enumerate() {
            if i == last {
                active.set_end_of_dataloader(None);
            }
            let _step = accelerator.accumulate(&model);
            let loss = {
                let _autocast = accelerator.autocast();
                model.classify(batch).loss
            };
            accelerator.backward(loss, &model);
            let (stepped, outcome) = accelerator
                .optimizer_step(&mut optimizer, model, &mut lr)
                .expect("one process");
            model = stepped;
            outcomes.push(outcome);
        }
    }
    (param_bits(&model.valid()), outcomes)
}

fn both(config: AccelerateConfig) -> Vec<StepOutcome> {
    both_under(config, SmallOps::KeepF32)
}

// Under a small-op rule (the training's): the model is tiny, and `SmallOps::Cast` is what makes
// its layers run in the half type.
fn both_under(config: AccelerateConfig, rule: SmallOps) -> Vec<StepOutcome> {
    let config = config.with_small_ops(Some(rule));
    let ours = through_the_accelerator(&config);
    let strategy = through_the_strategy(&config);
    assert!(!strategy.is_empty());
    assert!(
        ours.0 == strategy,
        "{config:?}: the two entry points ended with different parameters ({} of {} differ)",
        ours.0.iter().zip(&strategy).filter(|(a, b)| a != b).count(),
        strategy.len()
    );
    ours.1
}

#[test]
fn f32_steps_alike() {
    let outcomes = both(AccelerateConfig::new());
    assert_eq!(outcomes.len(), 2 * 7);
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, StepOutcome::Applied { .. }))
    );
}

#[test]
fn f16_with_forced_overflows_steps_alike() {
    // 2^22 times the loss overflows f16: the first steps are skipped on both sides while
    // the scale backs off.
    let config = AccelerateConfig::new()
        .with_mixed_precision(Precision::F16)
        .with_grad_scaler(GradScalerConfig::new().with_init_scale(2f64.powi(22)));
    let outcomes = both_under(config, SmallOps::Cast);
    let skipped = outcomes
        .iter()
        .filter(|o| **o == StepOutcome::SkippedOverflow)
        .count();
    assert!(skipped > 0 && skipped < outcomes.len(), "{outcomes:?}");
}

#[test]
fn accumulation_of_3_with_a_partial_last_window_steps_alike() {
    for divide_partial in [false, true] {
        let config = AccelerateConfig::new()
            .with_gradient_accumulation_steps(3)
            .with_divide_partial_window_by_length(divide_partial);
        let outcomes = both(config);
        let applied = outcomes
            .iter()
            .filter(|o| matches!(o, StepOutcome::Applied { .. }))
            .count();
        // Windows of 3, 3 and 1 each epoch.
        assert_eq!(applied, 2 * 3, "{outcomes:?}");
    }
}

#[test]
fn clipping_steps_alike_in_bf16_with_accumulation() {
    let config = AccelerateConfig::new()
        .with_mixed_precision(Precision::Bf16)
        .with_gradient_accumulation_steps(3)
        .with_max_grad_norm(Some(0.05));
    both_under(config, SmallOps::Cast);
}

#[test]
fn a_bad_clipping_norm_is_a_typed_error() {
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let config = AccelerateConfig::new().with_max_grad_norm(Some(bad));
        let err = config
            .init_with_state::<B>(&Default::default(), GradientState::new())
            .unwrap_err();
        assert!(
            matches!(
                err,
                burn_accelerate::AccelerateError::InvalidConfig {
                    field: "max_grad_norm",
                    ..
                }
            ),
            "{bad}: {err:?}"
        );
    }
}

// The clipping test would pass with clipping off on both sides: check that 0.05 clips.
#[test]
fn the_clipping_norm_changes_the_result() {
    let clipped = AccelerateConfig::new().with_max_grad_norm(Some(0.05));
    let (with, _) = through_the_accelerator(&clipped);
    let (without, _) = through_the_accelerator(&AccelerateConfig::new());
    assert_ne!(with, without);
}
