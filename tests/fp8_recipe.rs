//! Transformer Engine's delayed-scaling recipe, against trajectories computed by hand.
//!
//! E4M3's max is 448, E5M2's 57344; with margin m an amax maps to 448 / 2^m. Every amax below
//! is a power of two or a small multiple, so every expected scale is exact.

use burn_accelerate::AccelerateError;
use burn_accelerate::autocast::Op;
use burn_accelerate::fp8::{
    AmaxComputeAlgo, DelayedScaling, Fp8Format, Fp8State, Pass, ScalingState, TensorKey,
};

fn recipe(len: usize, algo: AmaxComputeAlgo) -> DelayedScaling {
    DelayedScaling::default()
        .with_amax_history_len(len)
        .with_amax_compute_algo(algo)
}

/// The scale after each step, one amax observed per step.
fn trajectory(recipe: DelayedScaling, format: Fp8Format, amaxes: &[f32]) -> Vec<f32> {
    let mut state = ScalingState::new();
    amaxes
        .iter()
        .map(|amax| {
            state.observe(*amax);
            state.update(&recipe, format)
        })
        .collect()
}

#[test]
fn defaults_are_transformer_engines() {
    let r = DelayedScaling::default();
    assert_eq!(r.margin, 0);
    assert_eq!(r.interval, 1);
    assert_eq!(r.amax_history_len, 1024);
    assert_eq!(r.amax_compute_algo, AmaxComputeAlgo::Max);
    assert_eq!(
        ScalingState::new().scale(),
        1.0,
        "a new tensor starts at scale 1"
    );
}

#[test]
fn max_takes_the_window_maximum_and_forgets_it_on_rollover() {
    // Window of 3 steps: 8 (step 2) rules steps 2-4, then leaves.
    let got = trajectory(
        recipe(3, AmaxComputeAlgo::Max),
        Fp8Format::E4M3,
        &[2.0, 8.0, 4.0, 1.0, 1.0, 0.5],
    );
    // windows: [2] [2,8] [2,8,4] [8,4,1] [4,1,1] [1,1,.5]
    assert_eq!(got, [224.0, 56.0, 56.0, 56.0, 112.0, 448.0]);
}

#[test]
fn most_recent_follows_the_last_step() {
    let got = trajectory(
        recipe(3, AmaxComputeAlgo::MostRecent),
        Fp8Format::E4M3,
        &[2.0, 8.0, 4.0, 1.0, 1.0, 0.5],
    );
    assert_eq!(got, [224.0, 56.0, 112.0, 448.0, 448.0, 896.0]);
}

#[test]
fn history_keeps_at_most_len_minus_one_finished_steps() {
    let r = recipe(3, AmaxComputeAlgo::Max);
    let mut state = ScalingState::new();
    for amax in [1.0, 2.0, 3.0, 4.0] {
        state.observe(amax);
        state.update(&r, Fp8Format::E4M3);
    }
    // The step in progress is the window's third entry.
    assert_eq!(state.history().collect::<Vec<_>>(), [3.0, 4.0]);
    assert_eq!(state.current_amax(), 0.0);
    assert_eq!(state.steps(), 4);

    // A window of one is the step just ended, whatever the algorithm.
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        let got = trajectory(recipe(1, algo), Fp8Format::E4M3, &[8.0, 2.0, 4.0]);
        assert_eq!(got, [56.0, 224.0, 112.0], "{algo:?}");
    }
}

#[test]
fn several_observations_in_a_step_keep_the_largest() {
    let mut state = ScalingState::new();
    for amax in [3.0, -7.0, 5.0] {
        state.observe(amax);
    }
    assert_eq!(state.current_amax(), 7.0);
    assert_eq!(
        state.update(&DelayedScaling::default(), Fp8Format::E4M3),
        64.0
    );
}

#[test]
fn margin_leaves_headroom_in_powers_of_two() {
    let r = recipe(1, AmaxComputeAlgo::MostRecent).with_margin(2);
    assert_eq!(r.scaled_max(Fp8Format::E4M3), 112.0);
    assert_eq!(trajectory(r, Fp8Format::E4M3, &[2.0, 8.0]), [56.0, 14.0]);
    assert_eq!(
        trajectory(r, Fp8Format::E5M2, &[2.0, 8.0]),
        [7168.0, 1792.0]
    );
}

#[test]
fn e5m2_maps_amax_to_57344() {
    let got = trajectory(
        recipe(4, AmaxComputeAlgo::Max),
        Fp8Format::E5M2,
        &[7.0, 0.25],
    );
    assert_eq!(got, [8192.0, 8192.0]);
}

#[test]
fn zero_amax_keeps_the_previous_scale() {
    let most_recent = recipe(4, AmaxComputeAlgo::MostRecent);
    assert_eq!(
        trajectory(most_recent, Fp8Format::E4M3, &[4.0, 0.0, 2.0]),
        [112.0, 112.0, 224.0]
    );
    // A tensor never observed (all zeros) keeps its initial scale of 1.
    assert_eq!(
        trajectory(most_recent, Fp8Format::E4M3, &[0.0, 0.0]),
        [1.0, 1.0]
    );
    let max1 = recipe(1, AmaxComputeAlgo::Max);
    assert_eq!(
        trajectory(max1, Fp8Format::E4M3, &[4.0, 0.0]),
        [112.0, 112.0]
    );
}

#[test]
fn infinite_amax_keeps_the_scale_while_it_is_in_the_window() {
    let most_recent = recipe(2, AmaxComputeAlgo::MostRecent);
    assert_eq!(
        trajectory(most_recent, Fp8Format::E4M3, &[4.0, f32::INFINITY, 2.0]),
        [112.0, 112.0, 224.0]
    );
    // With max, inf is the window's amax for as long as the window holds it (2 steps here).
    let max2 = recipe(2, AmaxComputeAlgo::Max);
    assert_eq!(
        trajectory(max2, Fp8Format::E4M3, &[4.0, f32::INFINITY, 2.0, 2.0]),
        [112.0, 112.0, 112.0, 224.0]
    );
}

#[test]
fn nan_amax_is_ignored_like_transformer_engines_fmaxf() {
    let most_recent = recipe(2, AmaxComputeAlgo::MostRecent);
    assert_eq!(
        trajectory(most_recent, Fp8Format::E4M3, &[4.0, f32::NAN, 2.0]),
        [112.0, 112.0, 224.0]
    );
    let max2 = recipe(2, AmaxComputeAlgo::Max);
    assert_eq!(
        trajectory(max2, Fp8Format::E4M3, &[4.0, f32::NAN, 2.0]),
        [112.0, 112.0, 224.0]
    );
}

#[test]
fn an_amax_whose_scale_overflows_keeps_the_previous_scale() {
    let r = recipe(1, AmaxComputeAlgo::MostRecent);
    let tiny = 448.0 / 1e-35; // finite: 4.48e37
    assert_eq!(
        trajectory(r, Fp8Format::E4M3, &[4.0, 1e-35, 1e-38, f32::from_bits(1)]),
        [112.0, tiny, tiny, tiny]
    );
}

#[test]
fn interval_recomputes_every_nth_step_and_records_every_step() {
    let r = recipe(1, AmaxComputeAlgo::MostRecent).with_interval(2);
    // Steps 2 and 4 recompute, from their own amax.
    assert_eq!(
        trajectory(r, Fp8Format::E4M3, &[2.0, 8.0, 4.0, 1.0]),
        [1.0, 56.0, 56.0, 448.0]
    );
    // The history is recorded in between: max over 4 steps sees step 2's 8 at step 4.
    let r = recipe(4, AmaxComputeAlgo::Max).with_interval(2);
    assert_eq!(
        trajectory(r, Fp8Format::E4M3, &[2.0, 8.0, 4.0, 1.0, 1.0, 1.0]),
        [1.0, 56.0, 56.0, 56.0, 56.0, 112.0]
    );
}

#[test]
fn invalid_parameters_are_typed_errors_naming_them() {
    let cases = [
        (DelayedScaling::default().with_margin(-1), "margin", -1),
        (DelayedScaling::default().with_margin(65), "margin", 65),
        (DelayedScaling::default().with_interval(0), "interval", 0),
        (
            DelayedScaling::default().with_amax_history_len(0),
            "amax_history_len",
            0,
        ),
    ];
    for (recipe, name, given) in cases {
        let err = recipe.validate().unwrap_err();
        assert_eq!(
            err,
            AccelerateError::InvalidFp8Recipe {
                parameter: name,
                value: given,
                expected: match name {
                    "margin" => "0..=64",
                    _ => "at least 1",
                },
            }
        );
        assert!(err.to_string().contains(name), "{err}");
        assert!(Fp8State::new(recipe).is_err());
    }
    assert!(DelayedScaling::default().with_margin(64).validate().is_ok());
}

#[test]
fn the_state_scales_forward_in_e4m3_and_backward_in_e5m2_and_round_trips_through_json() {
    let mut state = Fp8State::new(recipe(2, AmaxComputeAlgo::Max)).unwrap();
    let fwd = TensorKey {
        op: Op::Linear,
        call: 0,
        input: 1,
        pass: Pass::Forward,
    };
    let bwd = TensorKey {
        pass: Pass::Backward,
        ..fwd
    };
    state.observe(fwd, 7.0);
    state.observe(bwd, 7.0);
    state.step();
    assert_eq!(state.scale(&fwd), 64.0);
    assert_eq!(state.scale(&bwd), 8192.0);
    state.observe(fwd, 3.5); // mid-step: the current amax is saved too

    let json = serde_json::to_string(&state).unwrap();
    assert!(json.contains("\"Linear\""), "{json}");
    let back: Fp8State = serde_json::from_str(&json).unwrap();
    assert_eq!(back, state);
    let mut back = back;
    back.step();
    state.step();
    assert_eq!(back.scale(&fwd), state.scale(&fwd));
    assert_eq!(back.scale(&fwd), 64.0, "7 is still in the 2-step window");
    assert_eq!(back.steps(), 2);
}
