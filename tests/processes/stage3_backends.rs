//! ZeRO stage 3's per-layer bound on the backends besides Flex and NdArray, and on Flex's own
//! half-precision ops: wgpu (Mesa's lavapipe in `.ci/run`'s wgpu tier), LibTorch (its CPU
//! device, in the LibTorch tier), CUDA (where `nvidia-smi` lists a GPU), one instance per
//! backend feature, and Flex under `HalfPath::Own` (where autocast runs Flex's own half
//! `linear` and `matmul`, not the crate's kernels). On each,
//! `Layered`'s `Linear` layers and the same widths as bare matrices read by `matmul`, on 2
//! and 3 real processes, windows of 1 and 2, in f32 and under the half autocast the backend
//! runs (f16 on lavapipe, bf16 on LibTorch's CPU and on CUDA), hold one layer's gathered
//! parameters at a time (the peak equals the largest layer
//! a process does not own, in the gather dtype, on every batch), leave nothing gathered after
//! the backward pass, send what stage 3's formula says (halves for the gathers under
//! autocast) and end where stage 2 does, with the same step outcomes and loss scale
//! (`stage_3_against_stage_2`).
//!
//! Where stage 2 ends is checked bit for bit on Flex and within 1e-5 relative elsewhere:
//! cubecl picks its matmul kernels by timing (autotune), so two runs of the same product need
//! not sum in the same order.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::capability::HalfPath;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{report, worker};
use super::{
    Agreement, Layered, Mixed, Peak, Reads, Stage3Expected, Stage3Report, Training,
    observed_training, samples, stage_3_against_stage_2,
};

#[derive(Debug, Serialize, Deserialize)]
struct BackendRun {
    training: Training,
    /// `Layered` (`Reads::Linear`) or its widths as bare matrices (`Reads::Matmul`).
    reads: Reads,
    /// The path of half-precision ops (`None`: the default).
    half_path: Option<HalfPath>,
}

// The model `args.reads` names trained on `Accelerated<Autodiff<B>>`, every layer cast under
// autocast (the net is tiny: `SmallOps::Cast`).
fn train<B: Backend>(args: &BackendRun) -> Stage3Report {
    let (training, reads) = (args.training, args.reads);
    let device = Default::default();
    let config = AccelerateConfig::new()
        .with_small_ops(Some(SmallOps::Cast))
        .with_half_path(args.half_path);
    match reads {
        Reads::Matmul => observed_training(
            training,
            config,
            Mixed::<Accelerated<Autodiff<B>>>::new(&device),
            samples,
            |model, x| model.forward(x),
            (),
        ),
        _ => observed_training(
            training,
            config,
            Layered::<Accelerated<Autodiff<B>>>::new(&device),
            samples,
            |model, x| model.forward(x),
            (),
        ),
    }
}

// Stage 3 against stage 2 on backend `B`, whose test `test` is, in f32 and under `half`
// autocast on `half_path`, the parameters agreeing with stage 2's as `agreement` says.
fn on_backend<B: Backend>(
    test: &str,
    half: Precision,
    half_path: Option<HalfPath>,
    agreement: Agreement,
) {
    if let Some(args) = worker::<BackendRun>() {
        return report(&train::<B>(&args));
    }
    for (reads, processes, grad_accum, precision) in [
        (Reads::Linear, 2, 1, None),
        (Reads::Linear, 2, 2, None),
        (Reads::Linear, 3, 1, None),
        (Reads::Linear, 2, 1, Some(half)),
        (Reads::Linear, 3, 2, Some(half)),
        (Reads::Matmul, 2, 1, None),
        (Reads::Matmul, 2, 2, Some(half)),
        (Reads::Matmul, 3, 1, Some(half)),
    ] {
        // Halves under autocast (the reductions stay f32).
        let width = if precision.is_some() { 2 } else { 4 };
        let expected = Stage3Expected::new(reads.layers(width), processes);
        let training = Training::sharded(precision, grad_accum, 3);
        let checks = (Peak::Bound, agreement);
        stage_3_against_stage_2::<_, ()>(test, &expected, training, checks, |training| {
            BackendRun {
                training,
                reads,
                half_path,
            }
        });
    }
}

#[test]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_flex_s_own_half_ops() {
    on_backend::<burn::backend::Flex>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_flex_s_own_half_ops",
        Precision::Bf16,
        Some(HalfPath::Own),
        Agreement::Bits,
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_wgpu() {
    on_backend::<burn::backend::Wgpu>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_wgpu",
        Precision::F16,
        None,
        Agreement::Within(1e-5),
    );
}

#[cfg(feature = "tch")]
#[test]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_libtorch() {
    on_backend::<burn::backend::LibTorch>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_libtorch",
        Precision::Bf16,
        None,
        Agreement::Within(1e-5),
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device: run with --ignored where `nvidia-smi` lists one"]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_cuda() {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    if burn_accelerate::capability::device_count::<Cuda>(&CudaDevice::default()) == 0 {
        super::needs::missing("a CUDA device (no NVIDIA driver or no GPU on this machine)");
    }
    on_backend::<Cuda>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_cuda",
        Precision::Bf16,
        None,
        Agreement::Within(1e-5),
    );
}
