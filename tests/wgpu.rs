//! The generic suite on wgpu over lavapipe (Mesa's CPU Vulkan driver): the real GPU code path,
//! run on a CPU. lavapipe runs f16 and reports no bf16, so bf16 requests fall back to f32.
#![cfg(feature = "wgpu")]

mod suite;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use burn::tensor::DType;
use burn_accelerate::{AccelerateError, AutocastConfig, Precision, capability};

backend_suite!(
    Autodiff<Wgpu>,
    WgpuDevice::DefaultDevice,
    DType::F16,
    [F16, Bf16]
);

#[test]
fn lavapipe_runs_f16_and_not_bf16() {
    let caps = capability::probe::<Wgpu>(&WgpuDevice::DefaultDevice);
    assert!(caps.f16, "{caps:?}");
    assert!(!caps.bf16, "{caps:?}");
}

#[test]
fn strict_bf16_request_is_a_typed_error() {
    let err = AutocastConfig::new(Precision::Bf16)
        .init::<Wgpu>(&WgpuDevice::DefaultDevice)
        .unwrap_err();
    assert!(
        matches!(
            err,
            AccelerateError::UnsupportedPrecision {
                precision: Precision::Bf16,
                ..
            }
        ),
        "{err:?}"
    );
}
