//! What each compiled-in backend runs, found by running it (`burn-accelerate env`).

use burn::tensor::backend::Backend;
use burn_accelerate::{Precision, capability};

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
    for precision in [Precision::Bf16, Precision::F16] {
        let Some(ratio) = caps.time_ratio(precision) else {
            continue;
        };
        let own = match precision {
            Precision::Bf16 => capability::bf16_gemm_instructions(),
            _ => None,
        };
        let path = match (caps.via_f32(precision), own) {
            (true, Some(own)) => format!("; autocast runs it on the CPU's {own}, summed in f32"),
            (true, None) => "; autocast runs it as f32 GEMMs over rounded operands".into(),
            (false, _) => String::new(),
        };
        println!("    {precision}: the backend's matmul in {ratio:.2}× f32's time{path}");
        if precision == Precision::Bf16 && caps.host_cpu && caps.via_f32(precision) {
            println!("    AMX: {}", capability::amx_status());
        }
    }
    println!(
        "    fastest precision (Autocast::fastest, by rule): {}",
        caps.fastest()
    );
    match caps.min_half_flops {
        Some(flops) => println!(
            "    lower-class ops under {:.1} MFLOP stay in f32 (SmallOps::KeepF32)",
            flops as f64 / 1e6
        ),
        None => println!("    every lower-class op is cast (an accelerator)"),
    }
}

pub(super) fn report_all() {
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
