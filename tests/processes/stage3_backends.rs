//! ZeRO stage 3's per-layer bound on the backends besides Flex and NdArray: wgpu (Mesa's
//! lavapipe in `.ci/run`'s wgpu tier), LibTorch (its CPU device, in the LibTorch tier) and
//! CUDA (where `nvidia-smi` lists a GPU), one instance per backend feature. On each, a stack
//! of `Linear` layers on 2 and 3 real processes, windows of 1 and 2, in f32 and under the
//! half autocast the backend runs (f16 on lavapipe, bf16 on LibTorch's CPU, both on CUDA),
//! holds one layer's gathered parameters at a time (the peak equals the largest layer a
//! process does not own, in the gather dtype, on every batch), leaves nothing gathered after
//! its backward pass, sends what stage 3's formula says (halves for the gathers under
//! autocast), and ends where stage 2 does, with the same step outcomes and loss scale.
//!
//! Where stage 2 ends is checked within 1e-5 relative, not bit for bit as on the CPU
//! backends: cubecl picks its matmul kernels by timing (autotune), so two runs of the same
//! product need not sum in the same order.

use burn::backend::Autodiff;
use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{AccelerateConfig, Accelerated, Precision};
use serde::{Deserialize, Serialize};

use super::harness::{launch, max_relative_difference, report, worker};
use super::{Batch, CLASSES, FEATURES, Samples, assert_sent, parameters, stage_3_sent};

/// The layers' widths: three `Linear` layers of different sizes, so that the largest layer a
/// process does not own differs between processes.
const WIDTHS: [usize; 4] = [FEATURES, 24, 16, CLASSES];

#[derive(Module, Debug)]
struct Stack<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Stack<B> {
    /// The same values on every process and backend, made on the host: a backend's own random
    /// initialisation need not give every process the same draws.
    fn new(device: &B::Device) -> Self {
        let values = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 13 + salt * 7) as f32 * 0.61).sin() * 0.3)
                .collect()
        };
        let layers = WIDTHS
            .windows(2)
            .enumerate()
            .map(|(l, w)| Linear {
                weight: Param::from_data(
                    TensorData::new(values(w[0] * w[1], 2 * l), [w[0], w[1]]),
                    device,
                ),
                bias: Some(Param::from_data(
                    TensorData::new(values(w[1], 2 * l + 1), [w[1]]),
                    device,
                )),
            })
            .collect();
        Stack { layers }
    }

    fn forward(&self, mut h: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            h = Relu::new().forward(layer.forward(h));
        }
        h
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Run {
    zero_stage: u8,
    grad_accum: usize,
    /// Under autocast, every layer cast (the net is tiny: `SmallOps::Cast`).
    precision: Option<Precision>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Report {
    parameters: Vec<f32>,
    outcomes: Vec<String>,
    loss_scale: f32,
    /// Per batch: the bytes sent during its forward and backward passes, the most gathered
    /// bytes whole at once then, and those still whole after its backward pass.
    sent: Vec<u64>,
    gathered_peak: Vec<u64>,
    gathered_after_backward: Vec<u64>,
}

// Three windows of Adam on `Accelerated<Autodiff<B>>`, the model sharded from the start
// (`prepare_model`), each batch observed.
fn train<B: Backend>(args: &Run, device: B::Device) -> Report {
    let state = ProcessState::from_env().unwrap();
    let model = Stack::<Accelerated<Autodiff<B>>>::new(&device);
    let mut config = AccelerateConfig::new()
        .with_gradient_accumulation_steps(args.grad_accum)
        .with_zero_stage(ZeroStage::from_number(args.zero_stage).unwrap());
    if let Some(precision) = args.precision {
        config = config
            .with_mixed_precision(precision)
            .with_small_ops(Some(SmallOps::Cast));
    }
    let mut accelerator = config.init::<Accelerated<Autodiff<B>>>(&device).unwrap();
    let mut model = accelerator.prepare_model(model);
    let mut optim = burn::optim::AdamConfig::new().init();
    let mut report = Report {
        parameters: Vec::new(),
        outcomes: Vec::new(),
        loss_scale: 0.0,
        sent: Vec::new(),
        gathered_peak: Vec::new(),
        gathered_after_backward: Vec::new(),
    };
    for step in 0..3 * args.grad_accum {
        let items: Vec<usize> = (0..4)
            .map(|i| step * 16 + state.process_index() * 4 + i)
            .collect();
        let batch: Batch<Accelerated<Autodiff<B>>> = Samples.batch(items, &device);
        let _step = accelerator.accumulate(&model);
        burn_accelerate::zero::reset_gathered_peak();
        let before = burn_accelerate::zero::sent_bytes();
        let loss = {
            let _autocast = args.precision.map(|_| accelerator.autocast());
            CrossEntropyLossConfig::new()
                .init(&device)
                .forward(model.forward(batch.x), batch.y)
        };
        accelerator.backward(loss, &model);
        report
            .sent
            .push(burn_accelerate::zero::sent_bytes() - before);
        let bytes = burn_accelerate::zero::gathered_bytes();
        report.gathered_peak.push(bytes.peak);
        report.gathered_after_backward.push(bytes.alive);
        let (next, outcome) = accelerator
            .optimizer_step(&mut optim, model, &mut 0.01)
            .unwrap();
        report.outcomes.push(format!("{outcome:?}"));
        model = next;
    }
    report.parameters = parameters(&model);
    report.loss_scale = accelerator.loss_scale().loss_scale();
    report
}

// Stage 3 against stage 2 on the backend whose test `test` is, its workers training on
// `device`, in f32 and under `half` autocast.
fn stage_3_against_stage_2<B: Backend>(
    test: &str,
    device: impl Fn() -> B::Device,
    half: Precision,
) {
    if let Some(args) = worker::<Run>() {
        return report(&train::<B>(&args, device()));
    }
    // Each layer's weight and bias in visiting order: the values, and whether backward
    // gathers it again (a weight whose input is not the data, for the input's gradient).
    let params: Vec<(usize, bool)> = WIDTHS
        .windows(2)
        .enumerate()
        .flat_map(|(l, w)| [(w[0] * w[1], l > 0), (w[1], false)])
        .collect();
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    for (processes, grad_accum, precision) in [
        (2, 1, None),
        (2, 2, None),
        (3, 1, None),
        (2, 1, Some(half)),
        (3, 2, Some(half)),
    ] {
        let owners = burn_accelerate::zero::partition(&sizes, processes);
        // The bytes of one gathered value: halves under autocast (reductions stay f32).
        let width: u64 = if precision.is_some() { 2 } else { 4 };
        // The most a process holds gathered at once: the largest of the layers' bytes it
        // does not own (a layer's forward op gathers its weight and bias; its backward, the
        // weight again, no more).
        let bound = |rank: usize| -> u64 {
            (0..params.len() / 2)
                .map(|layer| {
                    (2 * layer..2 * layer + 2)
                        .filter(|&p| owners[p] != rank)
                        .map(|p| width * sizes[p] as u64)
                        .sum::<u64>()
                })
                .max()
                .unwrap()
        };
        let run = |zero_stage: u8| -> Vec<Report> {
            launch(
                test,
                processes,
                &Run {
                    zero_stage,
                    grad_accum,
                    precision,
                },
                &[],
            )
            .assert_success()
            .reports(processes)
        };
        let (stage2, stage3) = (run(2), run(3));
        for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
            let what =
                format!("{processes} processes, window {grad_accum}, {precision:?}, rank {rank}");
            assert_eq!(s3.outcomes, s2.outcomes, "{what}");
            assert_eq!(s3.loss_scale, s2.loss_scale, "{what}");
            let difference = max_relative_difference(&s3.parameters, &s2.parameters);
            assert!(difference <= 1e-5, "{what}: {difference}");
            for batch in 0..s3.sent.len() {
                let what = format!("{what}, batch {batch}");
                assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
                assert_eq!(s3.gathered_peak[batch], bound(rank), "{what}");
                assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
                let completes = (batch + 1).is_multiple_of(grad_accum);
                let expected = stage_3_sent(
                    params
                        .iter()
                        .map(|&(values, again)| (width * values as u64, 4 * values as u64, again)),
                    &owners,
                    processes,
                    rank,
                    completes,
                );
                assert_sent(s3.sent[batch], expected, &what);
            }
        }
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_wgpu() {
    stage_3_against_stage_2::<burn::backend::Wgpu>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_wgpu",
        burn::backend::wgpu::WgpuDevice::default,
        Precision::F16,
    );
}

#[cfg(feature = "tch")]
#[test]
fn stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_libtorch() {
    stage_3_against_stage_2::<burn::backend::LibTorch>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_libtorch",
        || burn::backend::libtorch::LibTorchDevice::Cpu,
        Precision::Bf16,
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
    stage_3_against_stage_2::<Cuda>(
        "stage3_backends::stage_3_holds_one_linear_layers_gathered_parameters_at_a_time_on_cuda",
        CudaDevice::default,
        Precision::Bf16,
    );
}
