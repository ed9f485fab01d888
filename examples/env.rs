//! Like `accelerate env`: which precisions each compiled-in backend really runs.
//!
//!     cargo run --example env --features ndarray,wgpu

use burn::tensor::backend::Backend;
use burn_accelerate::capability;

fn report<B: Backend>(device: B::Device) {
    let caps = capability::probe::<B>(&device);
    let flags = |dtype: burn::tensor::DType| {
        if B::supports_dtype(&device, dtype) {
            "yes"
        } else {
            "no"
        }
    };
    println!(
        "{:<28} {:<24} usable: {:<40} (backend flags: f16 {}, bf16 {})",
        B::name(&device),
        format!("{device:?}"),
        caps.to_string(),
        flags(burn::tensor::DType::F16),
        flags(burn::tensor::DType::BF16),
    );
}

fn main() {
    println!(
        "burn-accelerate {} on Burn 0.21.0",
        env!("CARGO_PKG_VERSION")
    );
    #[cfg(feature = "flex")]
    report::<burn::backend::Flex>(Default::default());
    #[cfg(feature = "ndarray")]
    report::<burn::backend::NdArray>(Default::default());
    #[cfg(feature = "wgpu")]
    {
        report::<burn::backend::Wgpu>(burn::backend::wgpu::WgpuDevice::DefaultDevice);
        report::<burn::backend::Wgpu>(burn::backend::wgpu::WgpuDevice::Cpu);
    }
    #[cfg(feature = "tch")]
    report::<burn::backend::LibTorch>(Default::default());
    #[cfg(feature = "cuda")]
    match capability::device_count::<burn::backend::Cuda>(&Default::default()) {
        0 => println!("cuda: no CUDA device found (no driver or no GPU); skipped"),
        n => {
            for i in 0..n {
                report::<burn::backend::Cuda>(burn::backend::cuda::CudaDevice::new(i));
            }
        }
    }
}
