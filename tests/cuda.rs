//! The generic suite on CUDA (feature `cuda`). It compiles everywhere; every test is
//! `#[ignore]`d, since it needs a CUDA device (`tests/needs/mod.rs`), so without `--ignored` the
//! run lists them as ignored. Run with `--ignored` on a machine without an NVIDIA driver or GPU,
//! each fails saying so (asking Burn for the device count there panics, so the crate asks with
//! the panic caught).
//!
//!     cargo test --features cuda --test cuda -- --ignored
#![cfg(feature = "cuda")]

mod needs;
mod suite;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::DType;
use burn_accelerate::{AutocastConfig, Precision, capability};

fn cuda_present() -> bool {
    capability::device_count::<Cuda>(&CudaDevice::default()) > 0
}

backend_suite!(
    Autodiff<Cuda>,
    CudaDevice::default(),
    DType::BF16,
    [Bf16, F16],
    needs = (
        "a CUDA device (no NVIDIA driver or no GPU on this machine)",
        "needs a CUDA device: run with --ignored where `nvidia-smi` lists one",
        cuda_present()
    )
);

#[test]
#[ignore = "needs a CUDA device: run with --ignored where `nvidia-smi` lists one"]
fn cuda_runs_both_half_types_fast() {
    if !cuda_present() {
        needs::missing("a CUDA device (no NVIDIA driver or no GPU on this machine)");
    }
    let device = CudaDevice::default();
    let caps = capability::probe::<Cuda>(&device);
    assert!(caps.f16 && caps.bf16, "{caps:?}");
    for precision in [Precision::Bf16, Precision::F16] {
        assert!(caps.runs_fast(precision), "{precision}: {caps:?}");
        let autocast = AutocastConfig::new(precision)
            .init::<Cuda>(&device)
            .unwrap();
        assert_eq!(autocast.precision(), precision);
    }
}
