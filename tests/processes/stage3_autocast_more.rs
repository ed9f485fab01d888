//! ZeRO stage 3's per-layer bound under the autocasts that
//! `stage_3_under_autocast_gathers_linear_and_matmul_parameters_in_the_half_type_like_stage_2`
//! does not cover: fp8 (a `Linear`, a bare matrix read by `matmul`, and a broadcast one), and
//! a broadcast `matmul` under bf16 and f16. Each ends bit for bit where stage 2 does under the
//! same autocast, with at most one layer's gathered parameters whole at a time and the bytes
//! each batch sends given by the formula.

use super::*;

use burn_accelerate::fp8;

/// How each layer reads its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Reads {
    /// `Layered`: a `Linear` per layer (weight and bias).
    Linear,
    /// `Mixed`: a bare `[in, out]` matrix per layer, `h.matmul(weight)` on 2-D activations.
    Matmul,
    /// `Broadcast`: a bare `[1, in, out]` matrix per layer, `h.matmul(weight)` on `[2, 2, in]`
    /// activations (two sequences of two): Burn broadcasts the parameter over the batch.
    Broadcast,
}

/// `Mixed`'s matrices with a leading batch dimension of 1.
#[derive(Module, Debug)]
struct Broadcast<B: Backend> {
    weights: Vec<Param<Tensor<B, 3>>>,
}

#[derive(Debug, Serialize, Deserialize)]
struct MoreRun {
    zero_stage: u8,
    precision: Precision,
    grad_accum: usize,
    reads: Reads,
}

fn kaiming<B: Backend, const D: usize>(
    shape: [usize; D],
    fan_in: usize,
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    burn::nn::Initializer::KaimingUniform {
        gain: 1.0,
        fan_out_only: false,
    }
    .init_with(shape, Some(fan_in), None, device)
}

fn more_worker(args: &MoreRun) -> Stage3Report {
    type B = Accelerated<Autodiff<Flex>>;
    let device = Default::default();
    B::seed(&device, 13);
    let widths = LAYERED_WIDTHS.windows(2);
    match args.reads {
        Reads::Linear => {
            let model = Layered::<B> {
                layers: widths
                    .map(|w| LinearConfig::new(w[0], w[1]).init(&device))
                    .collect(),
            };
            more_training(args, model, |model, mut h| {
                for layer in &model.layers {
                    h = Relu::new().forward(layer.forward(h));
                }
                h
            })
        }
        Reads::Matmul => {
            let model = Mixed::<B> {
                weights: widths
                    .map(|w| kaiming([w[0], w[1]], w[0], &device))
                    .collect(),
            };
            more_training(args, model, |model, mut h| {
                for weight in &model.weights {
                    h = Relu::new().forward(h.matmul(weight.val()));
                }
                h
            })
        }
        Reads::Broadcast => {
            let model = Broadcast::<B> {
                weights: widths
                    .map(|w| kaiming([1, w[0], w[1]], w[0], &device))
                    .collect(),
            };
            more_training(args, model, |model, h| {
                let mut h: Tensor<B, 3> = h.reshape([2, 2, FEATURES]);
                for weight in &model.weights {
                    h = Relu::new().forward(h.matmul(weight.val()));
                }
                h.reshape([4, CLASSES])
            })
        }
    }
}

// `half_worker`'s loop (sharded from the start at stage 3 by `prepare_model`, every
// lower-class op lowered: `SmallOps::Cast`), with the fp8 state read at the end.
fn more_training<M: burn::module::AutodiffModule<Accelerated<Autodiff<Flex>>>>(
    args: &MoreRun,
    model: M,
    forward: impl Fn(
        &M,
        Tensor<Accelerated<Autodiff<Flex>>, 2>,
    ) -> Tensor<Accelerated<Autodiff<Flex>>, 2>,
) -> Stage3Report {
    let config =
        AccelerateConfig::new().with_small_ops(Some(burn_accelerate::autocast::SmallOps::Cast));
    let run = (args.zero_stage, args.precision, args.grad_accum);
    observed_training(run, config, 4 * args.grad_accum, model, forward)
}

// Runs `(processes, precision, window, reads)` at stages 2 and 3 and checks stage 3 against
// stage 2 and the bound; `gathered_size` is the bytes a gathered value takes (4 for f32, 2
// for the half types).
fn stage_3_against_stage_2(
    test: &str,
    (processes, precision, grad_accum, reads): (usize, Precision, usize, Reads),
    gathered_size: u64,
) {
    // Every parameter in visiting order (each layer's weight, then its bias, if a
    // `Linear`): its values, and whether it is a weight read again in backward (every layer's
    // but the first, whose input, the data, needs no gradient).
    let linear = reads == Reads::Linear;
    let mut params: Vec<(usize, bool)> = Vec::new();
    for (i, w) in LAYERED_WIDTHS.windows(2).enumerate() {
        params.push((w[0] * w[1], i > 0));
        if linear {
            params.push((w[1], false));
        }
    }
    let sizes: Vec<usize> = params.iter().map(|&(values, _)| values).collect();
    // A layer's weight and bias: at most one layer's are whole at a time.
    let largest = LAYERED_WIDTHS
        .windows(2)
        .map(|w| (w[0] * w[1] + if linear { w[1] } else { 0 }) as u64 * gathered_size)
        .max()
        .unwrap();
    let all: u64 = sizes.iter().map(|&v| v as u64 * gathered_size).sum();
    let owners = burn_accelerate::zero::partition(&sizes, processes);
    // Gathers of `gathered_size` bytes a value, reductions in f32 (4).
    let expected = |rank: usize, reduces: bool| -> u64 {
        stage_3_sent(
            params
                .iter()
                .map(|&(values, again)| (gathered_size * values as u64, 4 * values as u64, again)),
            &owners,
            processes,
            rank,
            reduces,
        )
    };
    let run = |zero_stage: u8| -> Vec<Stage3Report> {
        launch(
            test,
            processes,
            &MoreRun {
                zero_stage,
                precision,
                grad_accum,
                reads,
            },
            &[],
        )
        .assert_success()
        .reports(processes)
    };
    let (stage2, stage3) = (run(2), run(3));
    for (rank, (s3, s2)) in stage3.iter().zip(&stage2).enumerate() {
        let what = format!(
            "{processes} processes, {precision:?}, window {grad_accum}, {reads:?}, rank {rank}"
        );
        assert_eq!(s3.outcomes, s2.outcomes, "{what}");
        assert_eq!(s3.loss_scale, s2.loss_scale, "{what}");
        assert_eq!(bits(&s3.parameters), bits(&s2.parameters), "{what}");
        // The same amax histories and scales: the weights' amaxes seen in the gathered
        // values, their gradients' (HYBRID) after the same rounding.
        assert_eq!(s3.fp8_state, s2.fp8_state, "{what}");
        for (batch, &sent) in s3.sent.iter().enumerate() {
            let what = format!("{what}, batch {batch}");
            let completes = (batch + 1).is_multiple_of(grad_accum);
            assert_sent(sent, expected(rank, completes), &what);
            let peak = s3.gathered_peak[batch];
            assert!(peak > 0 && peak <= largest, "{what}: {peak} > {largest}");
            assert!(peak < all, "{what}");
            assert_eq!(s3.gathered_after_backward[batch], 0, "{what}");
            if completes {
                let own: Vec<bool> = owners.iter().map(|&o| o == rank).collect();
                assert_eq!(s3.holds_gradient[batch], own, "{what}");
            }
            // Stage 2 gathers and sends nothing in its passes.
            assert_eq!((s2.sent[batch], s2.gathered_peak[batch]), (0, 0), "{what}");
        }
    }
    match precision {
        Precision::Fp8(_) => {
            // The state read is the training's: its steps and every layer's tensors.
            let state: fp8::Fp8State =
                serde_json::from_str(stage3[0].fp8_state.as_deref().unwrap()).unwrap();
            assert_eq!(state.steps(), 4 * grad_accum as u64);
            let weights = state
                .tensors()
                .filter(|(key, _)| key.input == 1 && key.pass == fp8::Pass::Forward)
                .count();
            assert_eq!(weights, LAYERED_WIDTHS.len() - 1);
        }
        // The loss scaler scaled the f16 losses (and compared its scale above).
        Precision::F16 => assert!(stage3[0].loss_scale > 1.0, "{:?}", stage3[0].loss_scale),
        _ => {}
    }
}

/// Under fp8 autocast a `Linear` gathers its weight and bias in f32 for its forward op alone
/// and rounds the weight there with the op's own fp8 cast (its key, scale and amax record),
/// and gathers and rounds the weight again for the input's gradient; a bare matrix read by
/// `matmul` (broadcast over a batch, or not) does the same. Stage 3 ends where stage 2 does
/// under the same recipe, bit for bit: the parameters, and every tensor's scale and amax
/// history (HYBRID's gradients' too); at most one layer's f32 parameters are whole at a time,
/// and each batch sends stage 3's f32 formula.
#[test]
fn stage_3_under_fp8_gathers_each_layers_parameters_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_autocast_more::stage_3_under_fp8_gathers_each_layers_parameters_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<MoreRun>() {
        return report(&more_worker(&args));
    }
    let hybrid = Precision::Fp8(Fp8Mode::Hybrid);
    let e4m3 = Precision::Fp8(Fp8Mode::E4M3);
    for case in [
        (2, hybrid, 1, Reads::Linear),
        (3, hybrid, 2, Reads::Linear),
        (2, e4m3, 2, Reads::Linear),
        (3, hybrid, 1, Reads::Matmul),
        (2, hybrid, 2, Reads::Matmul),
        (3, hybrid, 2, Reads::Broadcast),
    ] {
        stage_3_against_stage_2(TEST, case, 4);
    }
}

/// Under bf16 and f16 autocast a bare `[1, in, out]` matrix that Burn's `matmul` broadcasts
/// over a batch of activations is gathered in the half type for the product alone (expanded
/// as a view, as stage 2's kernel path expands it), and again for the activations' gradient;
/// its gradient is summed over the batch in the half type and cast to f32, as stage 2's
/// expand and cast nodes do it. Stage 3 ends where stage 2 does, bit for bit (f16 with the
/// loss scaler: the same outcomes and scale), with at most one layer's halves whole at a
/// time, and each batch sends the formula with two bytes a gathered value.
#[test]
fn stage_3_under_autocast_gathers_a_broadcast_matmul_parameter_in_the_half_type_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_autocast_more::stage_3_under_autocast_gathers_a_broadcast_matmul_parameter_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<MoreRun>() {
        return report(&more_worker(&args));
    }
    for case in [
        (2, Precision::Bf16, 1, Reads::Broadcast),
        (3, Precision::Bf16, 2, Reads::Broadcast),
        (2, Precision::F16, 2, Reads::Broadcast),
        (3, Precision::F16, 1, Reads::Broadcast),
    ] {
        stage_3_against_stage_2(TEST, case, 2);
    }
}
