//! ZeRO stage 3's per-layer bound on the backends besides Flex and NdArray, and on Flex's own
//! half-precision ops: wgpu (Mesa's lavapipe in `.ci/run`'s wgpu tier), LibTorch (its CPU
//! device, in the LibTorch tier), CUDA (where `nvidia-smi` lists a GPU), one instance per
//! backend feature, and Flex under `HalfPath::Own` (where autocast runs Flex's own half
//! `linear` and `matmul`, not the crate's kernels). On each,
//! `Layered`'s `Linear` layers, the same widths as bare matrices read by `matmul`, and
//! `stage3_conv`'s nets of convolutions (`Conv2d`, `ConvTranspose2d`, `Conv1d`, `Conv3d`) and
//! `stage3_norm`'s linear layers with `LayerNorm`s or `RmsNorm`s between them, on 2 and 3
//! real processes, windows of 1 and 2, in f32 and under the half autocast the backend
//! runs (f16 on lavapipe, bf16 on LibTorch's CPU and on CUDA), hold one layer's gathered
//! parameters at a time (the peak equals the largest layer's gathered bytes, in the gather
//! dtype, on every batch and process), leave nothing gathered after
//! the backward pass, send what stage 3's formula says (halves for the gathers under
//! autocast) and end where stage 2 does, with the same step outcomes and loss scale
//! (`stage_3_against_stage_2`).
//!
//! Where stage 2 ends is checked bit for bit on Flex (on 2 processes; to rounding on 3, where
//! slices sum in another order than stage 2's owners) and within 1e-5 relative elsewhere:
//! cubecl picks its matmul kernels by timing (autotune), so two runs of the same product need
//! not sum in the same order.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::capability::HalfPath;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{report, worker};
use super::stage3_conv::{Net, conv_training};
use super::stage3_norm::{NormKind, Normed, normed_layers};
use super::{
    Agreement, Gathered, Layered, Mixed, Peak, Reads, Stage3Expected, Stage3Report, Training,
    observed_training, samples, stage_3_against_stage_2,
};

/// Which model a case trains.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Model {
    /// `Layered` (`Reads::Linear`) or its widths as bare matrices (`Reads::Matmul`).
    Layers(Reads),
    /// One of `stage3_conv`'s nets.
    Convolutions(Net),
    /// `stage3_norm`'s linear layers with norms of this kind between them.
    Norms(NormKind),
}

impl Model {
    // Its parameters, gathered in `width` bytes a value (`Layers`; a net says its own).
    fn layers(self, width: u64) -> Vec<Vec<Gathered>> {
        match self {
            Model::Layers(reads) => reads.layers(width),
            Model::Convolutions(net) => net.layers(),
            Model::Norms(kind) => normed_layers(kind, width),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct BackendRun {
    training: Training,
    model: Model,
    /// The path of half-precision ops (`None`: the default).
    half_path: Option<HalfPath>,
}

// The model `args.model` names trained on `Accelerated<Autodiff<B>>`, every layer cast under
// autocast (the nets are tiny: `SmallOps::Cast`).
fn train<B: Backend>(args: &BackendRun) -> Stage3Report {
    let training = args.training;
    let device = Default::default();
    let config = AccelerateConfig::new()
        .with_small_ops(Some(SmallOps::Cast))
        .with_half_path(args.half_path);
    let reads = match args.model {
        Model::Layers(reads) => reads,
        Model::Convolutions(net) => return conv_training::<B>(training, net, config),
        Model::Norms(kind) => {
            let model = Normed::<Accelerated<Autodiff<B>>>::new(kind, &device);
            let forward = |model: &Normed<_>, x| model.logits(x, false);
            return observed_training(training, config, model, samples, forward, ());
        }
    };
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
    let (linear, matmul) = (Model::Layers(Reads::Linear), Model::Layers(Reads::Matmul));
    // Under autocast the other net's convolutions run on Burn's convolution node on the half
    // operands (on Flex, its `Conv1d` runs on the crate's half convolution, which holds the
    // same bound).
    let (convolutions, half_convolutions) = (
        Model::Convolutions(Net::Conv),
        Model::Convolutions(Net::OtherConv { kept_f32: false }),
    );
    for (model, processes, grad_accum, precision) in [
        (linear, 2, 1, None),
        (linear, 2, 2, None),
        (linear, 3, 1, None),
        (linear, 2, 1, Some(half)),
        (linear, 3, 2, Some(half)),
        (matmul, 2, 1, None),
        (matmul, 2, 2, Some(half)),
        (matmul, 3, 1, Some(half)),
        (convolutions, 2, 2, None),
        (convolutions, 3, 1, None),
        (half_convolutions, 2, 1, Some(half)),
        (half_convolutions, 3, 2, Some(half)),
        (Model::Norms(NormKind::Layer), 2, 2, None),
        (Model::Norms(NormKind::Rms), 3, 1, None),
        (Model::Norms(NormKind::Layer), 3, 1, Some(half)),
        (Model::Norms(NormKind::Rms), 2, 2, Some(half)),
    ] {
        // Halves under autocast (the reductions stay f32).
        let width = if precision.is_some() { 2 } else { 4 };
        let expected = Stage3Expected::new(model.layers(width), processes);
        let training = Training::sharded(precision, grad_accum, 3);
        let checks = (Peak::Bound, agreement);
        stage_3_against_stage_2::<_, ()>(test, &expected, training, checks, |training| {
            BackendRun {
                training,
                model,
                half_path,
            }
        });
    }
}

#[test]
fn stage_3_holds_one_layers_gathered_parameters_at_a_time_on_flex_s_own_half_ops() {
    on_backend::<burn::backend::Flex>(
        "stage3_backends::stage_3_holds_one_layers_gathered_parameters_at_a_time_on_flex_s_own_half_ops",
        Precision::Bf16,
        Some(HalfPath::Own),
        Agreement::Bits,
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn stage_3_holds_one_layers_gathered_parameters_at_a_time_on_wgpu() {
    on_backend::<burn::backend::Wgpu>(
        "stage3_backends::stage_3_holds_one_layers_gathered_parameters_at_a_time_on_wgpu",
        Precision::F16,
        None,
        Agreement::Within(1e-5),
    );
}

#[cfg(feature = "tch")]
#[test]
fn stage_3_holds_one_layers_gathered_parameters_at_a_time_on_libtorch() {
    on_backend::<burn::backend::LibTorch>(
        "stage3_backends::stage_3_holds_one_layers_gathered_parameters_at_a_time_on_libtorch",
        Precision::Bf16,
        None,
        Agreement::Within(1e-5),
    );
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device: run with --ignored where `nvidia-smi` lists one"]
fn stage_3_holds_one_layers_gathered_parameters_at_a_time_on_cuda() {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    if burn_accelerate::capability::device_count::<Cuda>(&CudaDevice::default()) == 0 {
        super::needs::missing("a CUDA device (no NVIDIA driver or no GPU on this machine)");
    }
    on_backend::<Cuda>(
        "stage3_backends::stage_3_holds_one_layers_gathered_parameters_at_a_time_on_cuda",
        Precision::Bf16,
        None,
        Agreement::Within(1e-5),
    );
}
