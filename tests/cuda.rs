//! The generic suite on CUDA (feature `cuda`). It compiles everywhere; at run time every test
//! returns early, saying why, on a machine without an NVIDIA driver or GPU (asking Burn for
//! the device count there panics, so the crate asks with the panic caught).
//!
//!     cargo test --features cuda --test cuda
#![cfg(feature = "cuda")]

mod suite;

use std::sync::Once;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::DType;
use burn_accelerate::{AutocastConfig, Precision, capability};

fn cuda_present() -> bool {
    static SAID: Once = Once::new();
    let count = capability::device_count::<Cuda>(&CudaDevice::default());
    if count == 0 {
        SAID.call_once(|| {
            eprintln!(
                "burn-accelerate CUDA tier skipped: no CUDA device (no NVIDIA driver or no GPU \
                 on this machine); it runs where `nvidia-smi` lists one"
            )
        });
    }
    count > 0
}

backend_suite!(
    Autodiff<Cuda>,
    CudaDevice::default(),
    DType::BF16,
    [Bf16, F16],
    present = cuda_present()
);

#[test]
fn cuda_runs_both_half_types_fast() {
    if !cuda_present() {
        return;
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
