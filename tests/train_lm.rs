//! The transformer language model of `examples/train_lm.rs` (`train::lm`), small: it trains
//! through `with_accelerate` in f32, bf16 and f16, its loss falls, the half precisions end
//! near f32, and autocast reports which lower-class ops ran in half precision. Its run on two
//! processes is in `tests/processes`.
//!
//! Each training's autocast and small-op rule are its own (`LmConfig::small_ops`). The
//! trainings still take turns ([`ONE_TRAINING`]) for one reason: they seed the backend's
//! generator, which is the process's (Burn's `Backend::seed`), before drawing the model's
//! weights: two at once would draw each other's.

#![cfg(feature = "flex")]

use std::sync::Mutex;

use burn::backend::{Autodiff, Flex};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::train::lm::{self, LmConfig, LmOutcome};
use burn_accelerate::{AccelerateError, Accelerated, Precision};

type Train = Accelerated<Autodiff<Flex>>;

static ONE_TRAINING: Mutex<()> = Mutex::new(());

/// Text that does not change from one commit to the next (the README does), so that the
/// losses below stay where they were measured: 354 windows of 33 bytes, 319 for training.
fn text() -> Vec<u8> {
    include_bytes!("../LICENSE-APACHE").to_vec()
}

/// A few thousand parameters, tens of steps.
fn small(precision: Precision) -> LmConfig {
    LmConfig::new()
        .with_precision(precision)
        .with_d_model(32)
        .with_layers(2)
        .with_heads(4)
        .with_d_ff(64)
        .with_seq_len(32)
        .with_batch_size(8)
        .with_steps(Some(36))
        .with_lr(3e-3)
        .with_warmup(5)
        .with_allow_fallback(false)
        .with_progress_every(0)
}

fn train(config: &LmConfig, small_ops: SmallOps) -> Result<LmOutcome, AccelerateError> {
    let config = config.clone().with_small_ops(Some(small_ops));
    let _one = ONE_TRAINING.lock().unwrap_or_else(|e| e.into_inner());
    lm::run::<Train>(&config, &text(), &Default::default())
}

#[test]
fn the_lm_learns_in_f32_and_the_half_precisions_end_near_it() {
    let f32_run = train(&small(Precision::F32), SmallOps::KeepF32).unwrap();
    let line = f32_run.summary_line();
    assert_eq!(f32_run.steps, 36, "{line}");
    assert_eq!(f32_run.processes, 1);
    // Bytes from a uniform guess cost ln 256 = 5.55 nats; English text, learned for 36 steps,
    // far less.
    assert!(f32_run.initial_loss > 4.0, "{line}");
    assert!(f32_run.valid_loss < 3.6, "{line}");
    assert!(f32_run.train_loss < f32_run.initial_loss - 1.0, "{line}");
    assert!(
        f32_run.step_ms > 0.0 && f32_run.tokens_per_s > 0.0,
        "{line}"
    );
    // Without autocast nothing is lowered, so nothing is counted.
    assert_eq!(f32_run.stats.lower_ops.ops(), 0, "{line}");
    assert_eq!(f32_run.final_valid_ops.ops(), 0, "{line}");
    assert!(line.contains("valid_precision=f32"), "{line}");

    for precision in [Precision::Bf16, Precision::F16] {
        // Every lower-class op cast, as PyTorch does: the model is too small for the default
        // rule, which would keep them all in f32.
        let run = train(&small(precision), SmallOps::Cast).unwrap();
        let line = run.summary_line();
        assert_eq!(run.stats.precision, precision, "{line}");
        let ops = run.stats.lower_ops;
        assert!(ops.half_ops > 0 && ops.small_ops == 0, "{line}");
        assert_eq!(ops.half_flops, ops.flops(), "{line}");
        // Validation runs in the training's precision, as Accelerate's prepared model
        // evaluates under autocast: Burn's validation in the fit, and the final loss.
        for valid in [run.stats.valid_lower_ops, run.final_valid_ops] {
            assert!(
                valid.half_ops > 0 && valid.half_ops == valid.ops(),
                "{valid:?}: {line}"
            );
        }
        let said = format!(
            "valid_precision={}",
            burn_accelerate::train::demo::flag_name(precision)
        );
        assert!(line.contains(&said), "{line}");
        // Stated tolerance: 3% of f32's validation loss after the same 36 steps (the same
        // data order, other dropout draws under autocast, and half-precision products).
        let rel = (run.valid_loss - f32_run.valid_loss).abs() / f32_run.valid_loss;
        assert!(
            rel < 0.03,
            "{precision:?}: {line} vs f32 {}",
            f32_run.summary_line()
        );
        assert!(run.train_loss < run.initial_loss - 1.0, "{line}");
    }
}

#[test]
fn the_default_rule_keeps_a_tiny_models_ops_in_f32_and_says_so() {
    let run = train(
        &small(Precision::Bf16),
        SmallOps::KeepF32Below { flops: 1 << 40 },
    )
    .unwrap();
    let ops = run.stats.lower_ops;
    let line = run.summary_line();
    // Linears and the output projection are kept; attention's bare matmuls are cast whatever
    // their size, as PyTorch does.
    assert!(ops.small_ops > 0, "{line}");
    assert!(ops.half_ops > 0, "{line}");
    assert!(
        line.contains(&format!("kept_f32={} small", ops.small_ops)),
        "{line}"
    );
}

#[test]
fn a_run_too_long_for_its_text_or_a_bad_model_is_refused_with_the_setting_to_change() {
    let err = train(
        &small(Precision::F32).with_steps(Some(10_000)),
        SmallOps::KeepF32,
    )
    .unwrap_err();
    assert!(
        matches!(err, AccelerateError::InvalidConfig { field: "steps", .. }),
        "{err}"
    );
    let err = train(&small(Precision::F32).with_heads(3), SmallOps::KeepF32).unwrap_err();
    assert!(
        matches!(err, AccelerateError::InvalidConfig { field: "heads", .. }),
        "{err}"
    );
    let err =
        lm::run::<Train>(&small(Precision::F32), &text()[..40], &Default::default()).unwrap_err();
    assert!(
        matches!(
            err,
            AccelerateError::InvalidConfig {
                field: "seq_len",
                ..
            }
        ),
        "{err}"
    );
}
