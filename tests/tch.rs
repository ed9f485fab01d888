//! The generic suite on LibTorch's CPU device (feature `tch`), where low precision pays on a
//! CPU with bf16 kernels. f16 depends on the CPU: without f16 arithmetic (Zen 4, say) LibTorch's
//! f16 matmul runs correctly but tens of times slower than f32, so the probe must flag it and a
//! checked autocast set-up must refuse it unless told otherwise; with it (AVX512-FP16, AMX:
//! Sapphire Rapids) f16 is fast, and must be neither flagged nor refused.
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

/// Whether this CPU does f16 arithmetic (AVX512-FP16, or AMX's f16 tiles), read from the
/// kernel's CPU flags: the probe's own rule for LibTorch's CPU f16
/// (`capability::KNOWN_HALF_KERNELS`), read here independently of the crate, so that the
/// tests below never depend on how close a timing came to the probe's limit. Without it LibTorch's f16 matmul runs tens of times slower than
/// f32 (measured on Zen 4), far past the 8× flag; with it, faster than f32.
fn cpu_lacks_f16_arithmetic() -> bool {
    let flags = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo is readable");
    let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
    !(has("avx512_fp16") || has("amx_fp16"))
}

/// Whether the probe must flag f16 here ([`cpu_lacks_f16_arithmetic`]); prints what it
/// measured, so that a failure shows how far that was from the limit.
fn f16_slow_here() -> bool {
    let caps = capability::probe::<LibTorch>(&LibTorchDevice::Cpu);
    let pct = caps.f16_time_pct.expect("f16 timed") as f32;
    let limit = capability::SLOW_FACTOR * 100.0;
    eprintln!("LibTorch's f16 matmul: {pct}% of f32's time (flagged from {limit}%)");
    cpu_lacks_f16_arithmetic()
}

#[test]
fn libtorch_cpu_runs_both_half_types_and_flags_f16_when_slow() {
    let caps = capability::probe::<LibTorch>(&LibTorchDevice::Cpu);
    assert!(caps.f16 && caps.bf16, "{caps:?}");
    if f16_slow_here() {
        let slowdown = caps.f16_slowdown.expect("f16 flagged slow");
        assert!(slowdown as f32 >= capability::SLOW_FACTOR, "{caps:?}");
        assert!(
            caps.to_string()
                .contains(&format!("f16 ({slowdown}× slower)")),
            "{caps}"
        );
    } else {
        assert_eq!(caps.f16_slowdown, None, "{caps:?}");
    }
}

#[test]
fn checked_f16_autocast_is_refused_allowed_or_falls_back_as_asked() {
    let device = LibTorchDevice::Cpu;
    let slow = f16_slow_here();
    let checked = AutocastConfig::new(Precision::F16).init::<LibTorch>(&device);
    if !slow {
        // Fast f16 (AVX512-FP16 or AMX here): accepted as asked, nothing to fall back from.
        assert_eq!(checked.unwrap().precision(), Precision::F16);
        let fallback = AutocastConfig::new(Precision::F16)
            .with_allow_fallback(true)
            .init::<LibTorch>(&device)
            .unwrap();
        assert_eq!(fallback.precision(), Precision::F16);
        assert!(!fallback.fell_back());
        return;
    }
    let err = checked.unwrap_err();
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
