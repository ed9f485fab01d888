//! ZeRO stage 3's per-layer bound under the autocasts that
//! `stage_3_under_autocast_gathers_linear_and_matmul_parameters_in_the_half_type_like_stage_2` does
//! not cover: fp8 (a `Linear`, a bare matrix read by `matmul`, and a broadcast one), and a
//! broadcast `matmul` under bf16 and f16. Each ends where stage 2 does under the same autocast (bit
//! for bit on 2 processes, to rounding on 3), with at most one layer's gathered parameters whole at
//! a time and the bytes each batch sends given by the formula.

use super::*;

/// Under fp8 autocast a `Linear` gathers its weight and bias in f32 for its forward op alone and
/// rounds the weight there with the op's own fp8 cast (its key, scale and amax record), and gathers
/// and rounds the weight again for the input's gradient; a bare matrix read by `matmul` (broadcast
/// over a batch, or not) does the same. Stage 3 ends where stage 2 does under the same recipe: the
/// parameters (bit for bit on 2 processes, to rounding on 3), and every tensor's scale and amax
/// history (HYBRID's gradients' too); at most one layer's f32 parameters are whole at a time, and
/// each batch sends stage 3's f32 formula.
#[test]
fn stage_3_under_fp8_gathers_each_layers_parameters_for_its_op_alone_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_autocast_more::stage_3_under_fp8_gathers_each_layers_parameters_for_its_op_alone_like_stage_2";
    if let Some(args) = worker::<LayeredRun>() {
        return report(&layered_worker(&args));
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
        autocast_layered_against_stage_2(TEST, case);
    }
}

/// Under bf16 and f16 autocast a bare `[1, in, out]` matrix that Burn's `matmul` broadcasts over a
/// batch of activations is gathered in the half type for the product alone (expanded as a view, as
/// stage 2's kernel path expands it), and again for the activations' gradient; its gradient is
/// summed over the batch in the half type and cast to f32, as stage 2's expand and cast nodes do
/// it. Stage 3 ends where stage 2 does (bit for bit on 2 processes, to rounding on 3; f16 with the
/// loss scaler: the same outcomes and scale), with at most one layer's halves whole at a time, and
/// each batch sends the formula with two bytes a gathered value.
#[test]
fn stage_3_under_autocast_gathers_a_broadcast_matmul_parameter_in_the_half_type_like_stage_2() {
    // The launcher runs the test by its path (`--exact`).
    const TEST: &str = "stage3_autocast_more::stage_3_under_autocast_gathers_a_broadcast_matmul_parameter_in_the_half_type_like_stage_2";
    if let Some(args) = worker::<LayeredRun>() {
        return report(&layered_worker(&args));
    }
    for case in [
        (2, Precision::Bf16, 1, Reads::Broadcast),
        (3, Precision::Bf16, 2, Reads::Broadcast),
        (2, Precision::F16, 2, Reads::Broadcast),
        (3, Precision::F16, 1, Reads::Broadcast),
    ] {
        autocast_layered_against_stage_2(TEST, case);
    }
}
