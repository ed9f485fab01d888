//! Training-step time of a transformer block on a GPU, in f32, bf16 autocast and f16 autocast,
//! through `Accelerated<Autodiff<B>>` (plus raw `Autodiff<B>` in f32, the decorator's cost).
//!
//! The model is one Burn `TransformerEncoder` layer: d_model 1024, 8 heads, d_ff 4096, GELU,
//! post-norm, no dropout, on inputs of batch × sequence 16 × 512. The step is forward, the
//! mean square of the output reduced in f32, backward, and the gradients gathered per
//! parameter, then a device sync. `benches/torch_amp.py` times the same step in PyTorch
//! (f32 against `torch.autocast`); `benches/gpu.sh` runs both on the same GPU.
//!
//!     cargo bench --features cuda --bench gpu_step
//!
//! `GPU_BENCH_SIZE=small` shrinks model and inputs for a smoke run, e.g. on wgpu over
//! lavapipe: `GPU_BENCH_SIZE=small cargo bench --features wgpu --bench gpu_step`.

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod common;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod gpu {
    use super::common::loss_grads;
    use burn::nn::transformer::{
        TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
    };
    use burn::optim::GradientsParams;
    use burn::tensor::backend::{AutodiffBackend, Backend};
    use burn::tensor::{Distribution, Tensor};
    use burn_accelerate::{Accelerated, Precision, autocast, capability};
    use criterion::Criterion;
    use std::hint::black_box;

    #[cfg(feature = "cuda")]
    pub type Gpu = burn::backend::Cuda;
    #[cfg(feature = "cuda")]
    fn device() -> burn::backend::cuda::CudaDevice {
        Default::default()
    }
    #[cfg(not(feature = "cuda"))]
    pub type Gpu = burn::backend::Wgpu;
    #[cfg(not(feature = "cuda"))]
    fn device() -> burn::backend::wgpu::WgpuDevice {
        burn::backend::wgpu::WgpuDevice::DefaultDevice
    }

    type Ad = burn::backend::Autodiff<Gpu>;

    /// The model and input sizes: the transformer block, or a small one for smoke runs.
    struct Shape {
        d_model: usize,
        heads: usize,
        d_ff: usize,
        batch: usize,
        seq: usize,
    }

    fn shape() -> Shape {
        match std::env::var("GPU_BENCH_SIZE").as_deref() {
            Ok("small") => Shape {
                d_model: 64,
                heads: 8,
                d_ff: 256,
                batch: 2,
                seq: 16,
            },
            _ => Shape {
                d_model: 1024,
                heads: 8,
                d_ff: 4096,
                batch: 16,
                seq: 512,
            },
        }
    }

    fn step<B: AutodiffBackend>(model: &TransformerEncoder<B>, x: Tensor<B, 3>) -> GradientsParams {
        let out = model.forward(TransformerEncoderInput::new(x));
        loss_grads(out, model)
    }

    fn bench<B: AutodiffBackend>(c: &mut Criterion, name: &str, device: &B::Device) {
        let s = shape();
        B::seed(device, 7);
        let model = TransformerEncoderConfig::new(s.d_model, s.d_ff, s.heads, 1)
            .with_dropout(0.0)
            .init::<B>(device);
        let x = Tensor::<B, 3>::random(
            [s.batch, s.seq, s.d_model],
            Distribution::Normal(0., 1.),
            device,
        );
        c.benchmark_group("transformer_block")
            .bench_function(name, |b| {
                b.iter(|| {
                    let grads = step(&model, x.clone());
                    B::sync(device).expect("device sync");
                    black_box(grads)
                })
            });
    }

    pub fn transformer_block(c: &mut Criterion) {
        let device = device();
        if capability::device_count::<Gpu>(&device) == 0 {
            eprintln!(
                "skipped: no device for {} (no driver or no GPU)",
                std::any::type_name::<Gpu>()
            );
            return;
        }
        let caps = capability::probe::<Gpu>(&device);
        println!("capability probe, {}: {caps}", Gpu::name(&device));
        {
            let _off = autocast::disable();
            bench::<Ad>(c, "f32/autodiff", &device);
            bench::<Accelerated<Ad>>(c, "f32/accelerated_off", &device);
        }
        for (name, precision) in [
            ("bf16/autocast", Precision::Bf16),
            ("f16/autocast", Precision::F16),
        ] {
            if !caps.runs_fast(precision) {
                println!("{name}: skipped, the device runs {caps}");
                continue;
            }
            let _on = autocast::enable(precision);
            bench::<Accelerated<Ad>>(c, name, &device);
        }
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
criterion::criterion_group! {
    name = benches;
    config = criterion::Criterion::default()
        .sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(3))
        .measurement_time(std::time::Duration::from_secs(10));
    targets = gpu::transformer_block
}
#[cfg(any(feature = "cuda", feature = "wgpu"))]
criterion::criterion_main!(benches);

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn main() {
    eprintln!("gpu_step needs a GPU backend: cargo bench --features cuda --bench gpu_step");
}
