//! The small-op rule: lower-class ops with a parameter too small for the half type to pay run
//! in f32 and return f32, bit for bit the f32 result; `SmallOps::Cast` (PyTorch's rule) casts
//! them; large ones are cast either way; a bare matmul is never kept.
//!
//! Each test scopes its rule to its own thread (`autocast::scope_small_ops`), so they run at
//! once without a lock.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::linear;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_accelerate::autocast::{self, SmallOps};
use burn_accelerate::capability::HalfPath;
use burn_accelerate::{AccelerateError, Accelerated, AutocastConfig, Precision, capability};

fn with_rule<R>(rule: SmallOps, run: impl FnOnce() -> R) -> R {
    let _rule = autocast::scope_small_ops(rule).unwrap();
    run()
}

fn data(shape: [usize; 2], seed: u64) -> TensorData {
    let values = (0..shape[0] * shape[1])
        .map(|i| ((i as f32 + 1.0) * (seed as f32 + 0.37)).sin() * 2.0)
        .collect::<Vec<f32>>();
    TensorData::new(values, shape)
}

fn bits(data: TensorData) -> Vec<u32> {
    let values = data.convert::<f32>().to_vec::<f32>().unwrap();
    values.iter().map(|v| v.to_bits()).collect()
}

// The output of `x [rows, 16] · w [16, 8] + b` under bf16 autocast on the decorator (its dtype
// and bits), and the bits of x's gradient, next to the same linear on `B` itself in f32.
struct Linear {
    dtype: DType,
    out: Vec<u32>,
    grad: Vec<u32>,
    f32_out: Vec<u32>,
    f32_grad: Vec<u32>,
}

fn run_linear<B: AutodiffBackend>(rows: usize) -> Linear {
    fn on<C: AutodiffBackend>(
        rows: usize,
        precision: Option<Precision>,
    ) -> (DType, Vec<u32>, Vec<u32>) {
        let device = Default::default();
        let x = Tensor::<C, 2>::from_data(data([rows, 16], 1), &device).require_grad();
        let w = Tensor::<C, 2>::from_data(data([16, 8], 2), &device).require_grad();
        let b = Tensor::<C, 1>::from_data(TensorData::new(vec![0.25f32; 8], [8]), &device);
        let _autocast = precision.map(autocast::enable);
        let out = linear(x.clone(), w, Some(b));
        let dtype = out.dtype();
        let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
        let grad = x.grad(&grads).expect("x has a gradient").into_data();
        (dtype, bits(out.into_data()), bits(grad))
    }
    let (dtype, out, grad) = on::<Accelerated<B>>(rows, Some(Precision::Bf16));
    let (_, f32_out, f32_grad) = on::<B>(rows, None);
    Linear {
        dtype,
        out,
        grad,
        f32_out,
        f32_grad,
    }
}

fn tiny_linear_runs_in_f32_unless_cast<B: AutodiffBackend>() {
    // 2·4·16·8 = 1024 flops, far below any threshold.
    for rule in [SmallOps::KeepF32, SmallOps::KeepF32Below { flops: 1 << 20 }] {
        let kept = with_rule(rule, || run_linear::<B>(4));
        assert_eq!(kept.dtype, DType::F32, "{rule:?}");
        assert_eq!(
            kept.out, kept.f32_out,
            "{rule:?}: the f32 result, bit for bit"
        );
        assert_eq!(
            kept.grad, kept.f32_grad,
            "{rule:?}: the f32 gradient, bit for bit"
        );
    }
    let cast = with_rule(SmallOps::Cast, || run_linear::<B>(4));
    assert_eq!(cast.dtype, DType::BF16);
    assert_ne!(cast.out, cast.f32_out, "rounded to bf16");
}

fn large_linear_is_cast_either_way<B: AutodiffBackend>() {
    // 2·64·16·8 = 16384 flops, above a threshold of 10000.
    for rule in [SmallOps::Cast, SmallOps::KeepF32Below { flops: 10_000 }] {
        let run = with_rule(rule, || run_linear::<B>(64));
        assert_eq!(run.dtype, DType::BF16, "{rule:?}");
    }
    // One below the threshold stays f32, exactly at it is cast.
    let below = with_rule(SmallOps::KeepF32Below { flops: 16_385 }, || {
        run_linear::<B>(64)
    });
    assert_eq!(below.dtype, DType::F32);
    let at = with_rule(SmallOps::KeepF32Below { flops: 16_384 }, || {
        run_linear::<B>(64)
    });
    assert_eq!(at.dtype, DType::BF16);
}

#[test]
fn tiny_linear_runs_in_f32_unless_cast_autodiff_flex() {
    tiny_linear_runs_in_f32_unless_cast::<Autodiff<Flex>>();
}

#[test]
fn large_linear_is_cast_either_way_autodiff_flex() {
    large_linear_is_cast_either_way::<Autodiff<Flex>>();
}

// Half inputs of a kept op are cast up (exactly), as an fp32-class op's are.
fn half_inputs_of_a_kept_op_run_in_f32<B: Backend>() {
    let device = Default::default();
    let x =
        Tensor::<Accelerated<B>, 2>::from_data(data([4, 16], 1), &device).cast(FloatDType::BF16);
    let w = Tensor::<Accelerated<B>, 2>::from_data(data([16, 8], 2), &device);
    let want = bits(
        x.clone()
            .cast(FloatDType::F32)
            .matmul(w.clone())
            .into_data(),
    );
    let got = with_rule(SmallOps::KeepF32, || {
        let _bf16 = autocast::enable(Precision::Bf16);
        linear(x, w, None)
    });
    assert_eq!(got.dtype(), DType::F32);
    assert_eq!(bits(got.into_data()), want);
}

#[test]
fn half_inputs_of_a_kept_op_run_in_f32_flex() {
    half_inputs_of_a_kept_op_run_in_f32::<Flex>();
}

#[test]
fn a_bare_matmul_is_cast_whatever_its_size() {
    type B = Accelerated<Flex>;
    let x = Tensor::<B, 2>::ones([2, 2], &Default::default());
    let dtype = with_rule(SmallOps::KeepF32, || {
        let _bf16 = autocast::enable(Precision::Bf16);
        x.clone().matmul(x).dtype()
    });
    assert_eq!(dtype, DType::BF16);
}

#[test]
fn the_cpu_threshold_is_a_constant_not_a_timing() {
    let caps = capability::probe::<Flex>(&Default::default());
    assert_eq!(
        caps.min_half_flops,
        Some(autocast::HOST_CPU_MIN_HALF_FLOPS),
        "{caps:?}"
    );
}

#[test]
fn bad_rules_are_typed_errors() {
    let bad = SmallOps::KeepF32Below { flops: 0 };
    let process = autocast::small_ops();
    let set = burn_accelerate::Context::process()
        .with_small_ops(bad)
        .unwrap_err();
    assert_eq!(
        autocast::small_ops(),
        process,
        "unchanged by a refused rule"
    );
    let scoped = autocast::scope_small_ops(bad).unwrap_err();
    let configured = AutocastConfig::new(Precision::Bf16)
        .with_small_ops(Some(bad))
        .init::<Flex>(&Default::default())
        .unwrap_err();
    assert!(
        configured.to_string().contains("SmallOps::Cast"),
        "{configured}"
    );
    for err in [set, scoped, configured] {
        assert!(
            matches!(
                err,
                AccelerateError::InvalidConfig {
                    field: "small_ops.flops",
                    ..
                }
            ),
            "{err:?}"
        );
    }
}

#[test]
fn the_config_scopes_the_rule_and_the_half_path_to_the_threads_that_enter_it() {
    let process = (autocast::small_ops(), capability::half_path());
    let autocast = AutocastConfig::new(Precision::Bf16)
        .with_small_ops(Some(SmallOps::Cast))
        .with_half_path(Some(HalfPath::Widened))
        .init::<Flex>(&Default::default())
        .unwrap();
    let now = || (autocast::small_ops(), capability::half_path());
    // `init` sets nothing of the process's.
    assert_eq!(now(), process);
    {
        let _entered = autocast.enter();
        assert_eq!(now(), (SmallOps::Cast, HalfPath::Widened));
        let elsewhere = std::thread::spawn(now).join().unwrap();
        assert_eq!(elsewhere, process, "another thread keeps the process's");
        // `None` brings nothing: the entered ones stay.
        let plain = AutocastConfig::new(Precision::Bf16)
            .init::<Flex>(&Default::default())
            .unwrap();
        let _inner = plain.enter();
        assert_eq!(now(), (SmallOps::Cast, HalfPath::Widened));
    }
    assert_eq!(now(), process);
}
