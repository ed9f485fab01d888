//! fp8 autocast end to end on Flex: which inputs are rounded, how scales follow the recipe
//! from step to step, the straight-through and HYBRID backward, checkpoints, and training.
#![cfg(feature = "flex")]

mod suite;

use std::sync::{Mutex, MutexGuard};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::nn::loss::{MseLoss, Reduction};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, FloatDType, Tensor, TensorData};
use burn_accelerate::autocast::{self, Op};
use burn_accelerate::fp8::{
    self, DelayedScaling, Fp8Format, Fp8Mode, Pass, TensorKey, quantize_dequantize_tensor,
};
use burn_accelerate::{
    AccelerateError, Accelerated, AutocastConfig, Context, ContextGuard, Precision,
};
use suite::models::Mlp;

type Ad = Autodiff<Flex>;
type B = Accelerated<Ad>;

const E4M3: Precision = Precision::Fp8(Fp8Mode::E4M3);
const HYBRID: Precision = Precision::Fp8(Fp8Mode::Hybrid);

// Each test runs in a context with an fp8 state of its own: tests that run at once never
// share amax histories, recipes or call numbers.
fn own_fp8_state() -> ContextGuard {
    Context::current().with_new_fp8_state().enter()
}

// The tests that draw random tensors also take turns, for one reason: they seed Burn's
// generator, which is the process's (`Backend::seed`), so two at once would draw each other's.
fn exclusive() -> (MutexGuard<'static, ()>, ContextGuard) {
    static SEEDING: Mutex<()> = Mutex::new(());
    let guard = SEEDING.lock().unwrap_or_else(|e| e.into_inner());
    (guard, own_fp8_state())
}

fn key(op: Op, call: u32, input: u32, pass: Pass) -> TensorKey {
    TensorKey {
        op,
        call,
        input,
        pass,
    }
}

fn values<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn qdq<const D: usize>(t: Tensor<Flex, D>, format: Fp8Format, scale: f32) -> Tensor<Flex, D> {
    quantize_dequantize_tensor(t, format, scale)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Flex, D> {
    let device = Default::default();
    Flex::seed(&device, seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &device)
}

fn lift<Bk: Backend, const D: usize>(t: &Tensor<Flex, D>) -> Tensor<Bk, D> {
    Tensor::from_data(t.to_data(), &Default::default())
}

#[test]
fn lower_ops_see_e4m3_inputs_and_run_in_f32() {
    let _lock = exclusive();
    let x = random([4, 8], 1) * 3.0;
    let w = random([8, 5], 2);
    let want = qdq(x.clone(), Fp8Format::E4M3, 1.0).matmul(qdq(w.clone(), Fp8Format::E4M3, 1.0));

    let _fp8 = autocast::enable(E4M3);
    let got = lift::<Accelerated<Flex>, 2>(&x).matmul(lift(&w));
    assert_eq!(got.dtype(), DType::F32, "fp8 is emulated in f32");
    assert_eq!(bits(&values(got)), bits(&values(want)));

    // Not lower-class: untouched.
    let sum = lift::<Accelerated<Flex>, 2>(&x) + lift(&x);
    assert_eq!(bits(&values(sum)), bits(&values(x.clone() + x.clone())));
}

#[test]
fn half_inputs_are_widened_then_rounded() {
    let _lock = exclusive();
    let x = random([3, 4], 3);
    let w = random([4, 2], 4);
    let x16 = x.clone().cast(FloatDType::BF16);
    let widened = x16.clone().cast(FloatDType::F32);
    let want = qdq(widened, Fp8Format::E4M3, 1.0).matmul(qdq(w.clone(), Fp8Format::E4M3, 1.0));

    let _fp8 = autocast::enable(E4M3);
    let got = lift::<Accelerated<Flex>, 2>(&x16).matmul(lift(&w));
    assert_eq!(got.dtype(), DType::F32);
    assert_eq!(bits(&values(got)), bits(&values(want)));
}

#[test]
fn linear_rounds_input_and_weight_but_not_bias() {
    let _state = own_fp8_state();
    let device = Default::default();
    let x = Tensor::<Flex, 2>::from_floats([[0.3, 1.0]], &device);
    let w = Tensor::<Flex, 2>::from_floats([[1.0], [0.3]], &device);
    let b = Tensor::<Flex, 1>::from_floats([0.3], &device);

    let _fp8 = autocast::enable(E4M3);
    let y =
        burn::tensor::module::linear(lift::<Accelerated<Flex>, 2>(&x), lift(&w), Some(lift(&b)));
    // 0.3125 × 1 + 1 × 0.3125 + 0.3 (the bias, unrounded).
    assert_eq!(values(y), [0.3125f32 + 0.3125 + 0.3]);
}

#[test]
fn an_fp8_autocast_brings_its_recipe_to_its_thread_only() {
    let _state = own_fp8_state();
    let short = DelayedScaling::default().with_amax_history_len(3);
    let autocast = AutocastConfig::new(E4M3)
        .with_fp8_recipe(short)
        .init::<Ad>(&Default::default())
        .unwrap();
    // Building it changes nothing of the process's.
    assert_eq!(fp8::recipe(), DelayedScaling::default());
    let _scope = autocast.enter();
    assert_eq!(fp8::recipe(), short);
    let other = std::thread::spawn(fp8::recipe).join().unwrap();
    assert_eq!(other, DelayedScaling::default());
    fp8::step();
    assert_eq!(
        fp8::state().recipe(),
        short,
        "the step follows its thread's recipe"
    );
}

#[test]
fn scales_follow_the_recipe_from_step_to_step() {
    let _state = own_fp8_state();
    let _recipe = fp8::scope_recipe(DelayedScaling::default().with_amax_history_len(2)).unwrap();
    let device = Default::default();
    let x_key = key(Op::Matmul, 0, 0, Pass::Forward);
    let w_key = key(Op::Matmul, 0, 1, Pass::Forward);
    let second = key(Op::Matmul, 1, 0, Pass::Forward);
    let run = |scale_x: f32| {
        let x = Tensor::<Flex, 2>::from_floats([[0.3, -7.0]], &device) * scale_x;
        let w = Tensor::<Flex, 2>::from_floats([[2.0], [0.5]], &device);
        let _fp8 = autocast::enable(E4M3);
        let xa = lift::<Accelerated<Flex>, 2>(&x);
        let y = xa.clone().matmul(lift(&w));
        let _ = xa.matmul(lift(&w)); // a second call: another tensor
        values(y)
    };

    // Step 1: every scale starts at 1.
    assert_eq!(run(1.0), [0.3125 * 2.0 + -7.0 * 0.5]);
    let state = fp8::state();
    assert_eq!(state.tensor(&x_key).unwrap().current_amax(), 7.0);
    assert_eq!(state.tensor(&second).unwrap().current_amax(), 7.0);
    fp8::step();
    let state = fp8::state();
    assert_eq!(state.scale(&x_key), 64.0); // 448 / 7
    assert_eq!(state.scale(&w_key), 224.0); // 448 / 2

    // Step 2 quantizes with those scales: x × 64 = [19.2, -448] → [20, -448] → /64.
    assert_eq!(run(1.0), [20.0 / 64.0 * 2.0 + -7.0 * 0.5]);
    fp8::step();
    // Step 3: a smaller x; the window (2 steps) still holds 7, so max keeps 64 ...
    run(0.5);
    fp8::step();
    assert_eq!(fp8::state().scale(&x_key), 64.0);
    // ... until 7 leaves the window: then 448 / 3.5.
    run(0.5);
    fp8::step();
    assert_eq!(fp8::state().scale(&x_key), 128.0);
}

#[test]
fn e4m3_gradients_pass_straight_through() {
    let _lock = exclusive();
    let x = random([6, 5], 5);
    let w = random([5, 3], 6);
    let (xq, wq) = (
        qdq(x.clone(), Fp8Format::E4M3, 1.0),
        qdq(w.clone(), Fp8Format::E4M3, 1.0),
    );
    // d(sum(x·w))/dw = xᵀ·1 with the rounded x the matmul saw; the rounding passes it as is.
    let want_w = xq
        .clone()
        .transpose()
        .matmul(Tensor::ones([6, 3], &Default::default()));
    let want_x = Tensor::<Flex, 2>::ones([6, 3], &Default::default()).matmul(wq.transpose());

    let _fp8 = autocast::enable(E4M3);
    let xa = lift::<B, 2>(&x).require_grad();
    let wa = lift::<B, 2>(&w).require_grad();
    let grads = xa.clone().matmul(wa.clone()).sum().backward();
    assert_eq!(
        bits(&values(wa.grad(&grads).unwrap())),
        bits(&values(want_w))
    );
    assert_eq!(
        bits(&values(xa.grad(&grads).unwrap())),
        bits(&values(want_x))
    );
}

// Gradients of one matmul's inputs and of an MLP's last layer under `precision`.
fn matmul_and_mlp_grads(precision: Precision) -> Vec<Vec<f32>> {
    let device = Default::default();
    let x = random([8, 6], 7) * 4.0;
    let w = random([6, 3], 8);
    let _guard = autocast::enable(precision);
    let xa = lift::<B, 2>(&x).require_grad();
    let wa = lift::<B, 2>(&w).require_grad();
    let y = xa.clone().matmul(wa.clone());
    let grads = (y.clone() * y).sum().backward();
    let mut out = vec![
        values(xa.grad(&grads).unwrap()),
        values(wa.grad(&grads).unwrap()),
    ];

    B::seed(&device, 9);
    let mlp = Mlp::<B>::new(6, 16, 2, &device);
    let loss = mlp.forward(lift(&x)).powf_scalar(2.0).mean();
    let grads = loss.backward();
    out.push(values(mlp.fc2.weight.grad(&grads).unwrap()));
    out
}

#[test]
fn hybrid_gradients_are_the_e4m3_gradients_rounded_to_e5m2() {
    let _lock = exclusive();
    // Two rounds: with every scale 1, and after a step, with the delayed scales the first
    // round's gradient amaxes set.
    for round in 0..2 {
        let start = fp8::state();
        let e4m3 = matmul_and_mlp_grads(E4M3);
        fp8::load_state(start.clone()); // same forward scales for both runs
        let hybrid = matmul_and_mlp_grads(HYBRID);
        let state = fp8::state();

        // Backward keys: the matmul is Matmul call 0; the MLP's second linear is Linear call 1,
        // its weight input 1.
        let scales = [
            start.scale(&key(Op::Matmul, 0, 0, Pass::Backward)),
            start.scale(&key(Op::Matmul, 0, 1, Pass::Backward)),
            start.scale(&key(Op::Linear, 1, 1, Pass::Backward)),
        ];
        if round == 1 {
            assert!(
                scales.iter().all(|s| *s != 1.0),
                "delayed scales in use: {scales:?}"
            );
        }
        for ((g4, g8), scale) in e4m3.iter().zip(&hybrid).zip(scales) {
            let want = values(qdq(
                Tensor::<Flex, 1>::from_data(
                    TensorData::new(g4.clone(), [g4.len()]),
                    &Default::default(),
                ),
                Fp8Format::E5M2,
                scale,
            ));
            assert_eq!(bits(g8), bits(&want), "round {round}, scale {scale}");
            assert_ne!(bits(g8), bits(g4), "E5M2 rounding changed something");
        }
        // The gradients' amaxes were recorded for the next step's scales.
        assert!(
            state
                .tensor(&key(Op::Matmul, 0, 1, Pass::Backward))
                .unwrap()
                .current_amax()
                > 0.0
        );
        fp8::step();
    }
}

#[test]
fn checkpointed_state_restores_every_scale_and_history() {
    let _lock = exclusive();
    let x = random([4, 4], 10);
    for _ in 0..3 {
        let _fp8 = autocast::enable(HYBRID);
        let xa = lift::<B, 2>(&x).require_grad();
        let _ = xa.clone().matmul(xa).sum().backward();
        drop(_fp8);
        fp8::step();
    }
    let saved = fp8::state();
    assert_eq!(
        saved.tensors().count(),
        4,
        "two forward and two backward tensors"
    );
    let json = serde_json::to_string(&saved).unwrap();

    fp8::load_state(Default::default());
    assert_eq!(fp8::state().tensors().count(), 0);
    fp8::load_state(serde_json::from_str(&json).unwrap());
    assert_eq!(fp8::state(), saved);
}

#[test]
fn init_checks_the_recipe_and_enter_installs_it() {
    let _state = own_fp8_state();
    let device = Default::default();
    let recipe = DelayedScaling::default()
        .with_margin(2)
        .with_amax_history_len(8);
    let autocast = AutocastConfig::new(HYBRID)
        .with_fp8_recipe(recipe)
        .init::<B>(&device)
        .unwrap();
    assert_eq!(autocast.precision(), HYBRID);
    assert!(!autocast.fell_back(), "fp8 is emulated everywhere");
    assert_eq!(fp8::recipe(), DelayedScaling::default());
    {
        let _scope = autocast.enter();
        assert_eq!(fp8::recipe(), recipe);
    }
    assert_eq!(fp8::recipe(), DelayedScaling::default());

    for (bad, parameter) in [
        (DelayedScaling::default().with_margin(-1), "margin"),
        (DelayedScaling::default().with_margin(65), "margin"),
        (DelayedScaling::default().with_interval(0), "interval"),
        (
            DelayedScaling::default().with_amax_history_len(0),
            "amax_history_len",
        ),
    ] {
        let err = AutocastConfig::new(E4M3)
            .with_fp8_recipe(bad)
            .init::<B>(&device)
            .unwrap_err();
        assert!(
            matches!(err, AccelerateError::InvalidFp8Recipe { parameter: p, .. } if p == parameter),
            "{err}"
        );
        assert!(err.to_string().contains(parameter), "{err}");
        assert_eq!(
            fp8::recipe(),
            DelayedScaling::default(),
            "a refused recipe changes nothing"
        );
    }
    // Not fp8: the recipe is not looked at.
    AutocastConfig::new(Precision::Bf16)
        .with_fp8_recipe(DelayedScaling::default().with_interval(0))
        .init::<B>(&device)
        .unwrap();
}

#[test]
fn unregistered_autodiff_is_refused_by_init_and_estimated_by_ops() {
    let _lock = exclusive();
    type Balanced = Accelerated<Autodiff<Flex, BalancedCheckpointing>>;
    let device = Default::default();
    let err = AutocastConfig::new(HYBRID)
        .init::<Balanced>(&device)
        .unwrap_err();
    assert!(
        matches!(err, AccelerateError::Fp8NotRegistered { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("fp8::register"), "{err}");

    // A guard set anyway: the forward value is still exact, gradients pass straight through
    // (unrounded, even under HYBRID).
    let x = random([3, 4], 11) * 100.0;
    let w = random([4, 2], 12);
    let want = qdq(x.clone(), Fp8Format::E4M3, 1.0).matmul(qdq(w.clone(), Fp8Format::E4M3, 1.0));
    let want_w = qdq(x.clone(), Fp8Format::E4M3, 1.0)
        .transpose()
        .matmul(Tensor::ones([3, 2], &device));
    {
        let _fp8 = autocast::enable(HYBRID);
        let wa = lift::<Balanced, 2>(&w).require_grad();
        let y = lift::<Balanced, 2>(&x).matmul(wa.clone());
        assert_eq!(bits(&values(y.clone())), bits(&values(want)));
        let grads = y.sum().backward();
        assert_eq!(
            bits(&values(wa.grad(&grads).unwrap())),
            bits(&values(want_w))
        );
    }

    fp8::register::<Balanced>();
    assert!(fp8::is_registered::<Balanced>());
    AutocastConfig::new(HYBRID)
        .init::<Balanced>(&device)
        .unwrap();
}

// A teacher-student regression: a fixed random MLP labels the data, a fresh one learns it.
fn train(precision: Option<Precision>, steps: usize) -> f32 {
    fp8::load_state(Default::default());
    let device = Default::default();
    let (inputs, outputs) = (16, 4);
    let x = random([128, inputs], 20);
    let teacher = {
        B::seed(&device, 21);
        Mlp::<Accelerated<Flex>>::new(inputs, 32, outputs, &device)
    };
    let y = values(teacher.forward(lift(&x)));
    let y = Tensor::<B, 2>::from_data(TensorData::new(y, [128, outputs]), &device);

    B::seed(&device, 22);
    let mut model = Mlp::<B>::new(inputs, 32, outputs, &device);
    let mut optim = SgdConfig::new().init();
    let mut loss_value = f32::NAN;
    for _ in 0..steps {
        let _guard = precision.map(autocast::enable);
        let loss = MseLoss::new().forward(model.forward(lift(&x)), y.clone(), Reduction::Mean);
        loss_value = loss.clone().into_scalar();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.2, model, grads);
        fp8::step();
    }
    loss_value
}

#[test]
fn a_small_mlp_trains_in_fp8_to_within_5_percent_of_f32() {
    let _lock = exclusive();
    const STEPS: usize = 40;
    let f32_loss = train(None, STEPS);
    let start = train(None, 1);
    assert!(
        f32_loss < 0.5 * start,
        "the task is learnt: {start} -> {f32_loss}"
    );
    for precision in [E4M3, HYBRID] {
        let loss = train(Some(precision), STEPS);
        let gap = (loss - f32_loss).abs() / f32_loss;
        assert!(
            gap <= 0.05,
            "{precision}: loss {loss} vs f32 {f32_loss} ({:.1}%)",
            gap * 100.0
        );
    }
}
