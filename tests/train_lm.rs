//! The transformer language model of `examples/train_lm.rs` (`examples/common/lm.rs`), small:
//! it trains through `with_accelerate` in f32, bf16 and f16, its loss falls, the half
//! precisions end near f32, and autocast reports which lower-class ops ran in half precision.
//! Its run on two processes is in `tests/processes`.
//!
//! Each training's autocast and small-op rule are its own (`LmConfig::small_ops`). The
//! trainings still take turns ([`ONE_TRAINING`]) for one reason: they seed the backend's
//! generator, which is the process's (Burn's `Backend::seed`), before drawing the model's
//! weights: two at once would draw each other's.

#![cfg(feature = "flex")]

#[path = "../examples/common/lm.rs"]
mod lm;

use std::sync::Mutex;

use burn::backend::{Autodiff, Flex};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::{AccelerateError, Accelerated, Precision};
use lm::{LmConfig, LmOutcome};

type Train = Accelerated<Autodiff<Flex>>;

// Held for Burn's process-wide seed only (`Backend::seed`, see the module docs).
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
        let said = format!("valid_precision={}", precision.short_name());
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

// The pieces of `examples/common/lm.rs` that need no training.
mod pieces {
    use std::time::Instant;

    use burn::lr_scheduler::LrScheduler;
    use burn_accelerate::AccelerateError;

    use crate::lm::{LmConfig, WarmupLr, median, split_windows, step_times};

    #[test]
    fn windows_overlap_by_one_byte_and_the_last_tenth_validates() {
        let text: Vec<u8> = (0..=100u8).collect();
        let (train, valid) = split_windows(&text, 4).unwrap();
        // (101 - 1) / 4 = 25 windows; 2 validate.
        assert_eq!((train.len(), valid.len()), (23, 2));
        assert_eq!(train[0].0, [0, 1, 2, 3, 4]);
        assert_eq!(train[1].0, [4, 5, 6, 7, 8]);
        assert_eq!(valid[1].0, [96, 97, 98, 99, 100]);
        let err = split_windows(&text[..8], 4).unwrap_err();
        assert!(matches!(
            err,
            AccelerateError::InvalidConfig {
                field: "seq_len",
                ..
            }
        ));
    }

    #[test]
    fn bad_settings_name_themselves() {
        let field = |config: LmConfig| match config.validate() {
            Err(AccelerateError::InvalidConfig { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(LmConfig::new().with_heads(5)), "heads");
        assert_eq!(field(LmConfig::new().with_layers(0)), "layers");
        assert_eq!(field(LmConfig::new().with_dropout(1.0)), "dropout");
        assert_eq!(field(LmConfig::new().with_lr(0.0)), "lr");
        assert_eq!(field(LmConfig::new().with_steps(Some(0))), "steps");
        assert!(LmConfig::new().validate().is_ok());
    }

    #[test]
    fn steps_are_timed_from_window_ends_past_the_warm_up_and_epoch_starts() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        // Accumulation 2: steps end at items 1, 3, 5, ...; epoch 2 starts at item 12.
        let items: Vec<(usize, Instant, f64)> = (0..16)
            .map(|i| {
                (
                    1 + usize::from(i >= 12),
                    at(10 * i as u64 * (i as u64)),
                    0.0,
                )
            })
            .collect();
        let times = step_times(&items, 2);
        // Step ends (ms): 10, 90, 250, 490, 810, 1210 | 1690, 2250. Steps 0..=2 warm up;
        // 6 opens epoch 2.
        let ms: Vec<u64> = times.iter().map(|t| (t * 1e3).round() as u64).collect();
        assert_eq!(ms, [240, 320, 400, 560]);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn the_warm_up_rises_linearly_to_the_peak_then_holds() {
        let mut lr = WarmupLr::new(1e-3, 4);
        let rates: Vec<f64> = (0..6).map(|_| lr.step()).collect();
        assert_eq!(rates, [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]);
    }
}
