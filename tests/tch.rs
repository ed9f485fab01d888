//! The generic suite on LibTorch's CPU device (feature `tch`), where low precision pays on a
//! CPU with bf16 kernels and f16 has none: f16 runs correctly but far slower than f32, so the
//! probe must flag it and a checked autocast set-up must refuse it unless told otherwise.
//!
//!     scripts/test-tch.sh
#![cfg(feature = "tch")]

mod suite;

use burn::backend::libtorch::LibTorchDevice;
use burn::backend::{Autodiff, LibTorch};
use burn::tensor::DType;
use burn_accelerate::{AccelerateError, AutocastConfig, Precision, capability};

backend_suite!(
    Autodiff<LibTorch>,
    LibTorchDevice::Cpu,
    DType::BF16,
    [Bf16, F16]
);

#[test]
fn libtorch_cpu_runs_both_half_types_and_flags_f16_slow() {
    let caps = capability::probe::<LibTorch>(&LibTorchDevice::Cpu);
    assert!(caps.f16 && caps.bf16, "{caps:?}");
    // LibTorch has no CPU f16 matmul kernel: about 50× slower than f32 where it was measured.
    let slowdown = caps.f16_slowdown.expect("f16 flagged slow");
    assert!(slowdown as f32 >= capability::SLOW_FACTOR, "{caps:?}");
    assert!(
        caps.to_string()
            .contains(&format!("f16 ({slowdown}× slower)")),
        "{caps}"
    );
}

#[test]
fn checked_f16_autocast_is_refused_allowed_or_falls_back_as_asked() {
    let device = LibTorchDevice::Cpu;
    let err = AutocastConfig::new(Precision::F16)
        .init::<LibTorch>(&device)
        .unwrap_err();
    match &err {
        AccelerateError::SlowPrecision {
            precision: Precision::F16,
            slowdown,
            fast,
            ..
        } => {
            assert!(*slowdown as f32 >= capability::SLOW_FACTOR);
            assert!(!fast.split(", ").any(|p| p == "f16"), "{fast}");
        }
        other => panic!("expected SlowPrecision, got {other:?}"),
    }
    assert!(err.to_string().contains("with_allow_slow(true)"), "{err}");

    let slow = AutocastConfig::new(Precision::F16)
        .with_allow_slow(true)
        .init::<LibTorch>(&device)
        .unwrap();
    assert_eq!(slow.precision(), Precision::F16);
    assert!(!slow.fell_back());

    let fallback = AutocastConfig::new(Precision::F16)
        .with_allow_fallback(true)
        .init::<LibTorch>(&device)
        .unwrap();
    assert_eq!(fallback.precision(), Precision::F32);
    assert!(fallback.fell_back());
}
