//! Generic test bodies for the decorator, instantiated per backend by `backend_suite!`.
//!
//! Tolerances are relative errors in the 2-norm against the same model run in f32:
//! bf16 ≤ 2e-2, f16 ≤ 5e-3 (inputs and weights of unit scale), as the crate promises.

#![allow(dead_code)]

pub mod models;

use burn::module::{AutodiffModule, Module};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Distribution, ElementConversion, Tensor, TensorData};
use burn_accelerate::{Accelerated, Precision, autocast};
use models::{ConvNet, Mlp};

/// Seeds `B` and holds a lock until the guard drops.
///
/// Backends' random generators are process-wide and tests run in parallel: without the lock
/// another test's draws interleave with this one's and its data changes from run to run.
///
/// The suite checks PyTorch's autocast classes on tiny models, so every lower-class op is cast
/// whatever its size (`SmallOps::Cast`, on this thread while the guard lives; the default
/// keeps small ones in f32).
pub fn seeded<B: Backend>(device: &B::Device, seed: u64) -> Seeded {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let rng = RNG.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, seed);
    Seeded {
        _small_ops: autocast::scope_small_ops(autocast::SmallOps::Cast).expect("a valid rule"),
        _rng: rng,
    }
}

/// The seeded test's hold on the generators and its small-op rule ([`seeded`]).
pub struct Seeded {
    _small_ops: autocast::SmallOpsGuard,
    _rng: std::sync::MutexGuard<'static, ()>,
}

/// The relative error allowed for `precision`, in the 2-norm.
pub fn tolerance(precision: Precision) -> f32 {
    match precision {
        Precision::Bf16 => 2e-2,
        Precision::F16 => 5e-3,
        _ => 0.0,
    }
}

pub fn rel_err(got: TensorData, want: TensorData) -> f32 {
    let got = got.convert::<f32>().to_vec::<f32>().unwrap();
    let want = want.convert::<f32>().to_vec::<f32>().unwrap();
    assert_eq!(got.len(), want.len());
    let num: f32 = got.iter().zip(&want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f32 = want.iter().map(|w| w * w).sum();
    (num / den.max(f32::MIN_POSITIVE)).sqrt()
}

/// Gives two modules on two backends the same weights, through Burn's recorder.
///
/// Both are reloaded: parameters initialise lazily, and each clone of an uninitialised module
/// would otherwise draw its own values.
pub fn twins<B: Backend, C: Backend<Device = B::Device>, M: Module<B>, N: Module<C>>(
    first: M,
    second: N,
    device: &B::Device,
) -> (M, N) {
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(first.clone().into_record(), ()).unwrap();
    let first = first.load_record(recorder.load(bytes.clone(), device).unwrap());
    let second = second.load_record(recorder.load(bytes, device).unwrap());
    (first, second)
}

pub fn normal_input<B: Backend, const D: usize>(
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// The expected low dtype under `precision` on a device that may fall back to f32.
pub fn lowered(precision: Precision, runs: bool) -> DType {
    match (precision.low_dtype(), runs) {
        (Some(d), true) => d.into(),
        _ => DType::F32,
    }
}

/// MLP forward: op-class dtypes as the table says, values close to f32.
pub fn mlp_forward<B: Backend>(device: &B::Device, precision: Precision) {
    let _seeded = seeded::<B>(device, 1);
    let runs = burn_accelerate::capability::probe::<B>(device).runs(precision);
    let (reference, model) = twins(
        Mlp::<B>::new(16, 32, 4, device),
        Mlp::<Accelerated<B>>::new(16, 32, 4, device),
        device,
    );
    let x = normal_input::<B, 2>([8, 16], device);
    let want = reference.forward(x.clone());

    let _guard = autocast::enable(precision);
    let xa = Tensor::<Accelerated<B>, 2>::from_data(x.to_data(), device);
    let hidden = model.hidden(xa.clone());
    assert_eq!(
        hidden.dtype(),
        lowered(precision, runs),
        "linear is lower-class"
    );
    let got = model.forward(xa);
    assert_eq!(
        got.dtype(),
        lowered(precision, runs),
        "logits come from a linear"
    );
    let probs = burn::tensor::activation::softmax(got.clone(), 1);
    assert_eq!(probs.dtype(), DType::F32, "softmax is fp32-class");
    assert_eq!(got.clone().exp().dtype(), DType::F32, "exp is fp32-class");
    assert_eq!(got.clone().sum().dtype(), DType::F32, "sum is fp32-class");
    let err = rel_err(got.into_data(), want.into_data());
    let tol = if runs { tolerance(precision) } else { 1e-6 };
    assert!(err <= tol, "{precision}: relative error {err} > {tol}");
}

/// Conv net forward: conv2d is lower-class, the pooled features and the head follow.
pub fn conv_forward<B: Backend>(device: &B::Device, precision: Precision) {
    let _seeded = seeded::<B>(device, 2);
    let runs = burn_accelerate::capability::probe::<B>(device).runs(precision);
    let (reference, model) = twins(
        ConvNet::<B>::new(device),
        ConvNet::<Accelerated<B>>::new(device),
        device,
    );
    let x = normal_input::<B, 4>([2, 3, 8, 8], device);
    let want = reference.forward(x.clone());

    let _guard = autocast::enable(precision);
    let xa = Tensor::<Accelerated<B>, 4>::from_data(x.to_data(), device);
    assert_eq!(
        model.features(xa.clone()).dtype(),
        lowered(precision, runs),
        "conv2d is lower-class"
    );
    let got = model.forward(xa);
    let err = rel_err(got.into_data(), want.into_data());
    let tol = if runs { tolerance(precision) } else { 1e-6 };
    assert!(err <= tol, "{precision}: relative error {err} > {tol}");
}

/// Under `Accelerated<Autodiff<B>>` every parameter gets an f32 gradient close to f32's.
pub fn mlp_gradients<B: AutodiffBackend>(device: &B::Device, precision: Precision) {
    const BATCH: usize = 64;
    let _seeded = seeded::<B>(device, 3);
    let runs = burn_accelerate::capability::probe::<B>(device).runs(precision);
    let (reference, model) = twins(
        Mlp::<B>::new(16, 32, 4, device),
        Mlp::<Accelerated<B>>::new(16, 32, 4, device),
        device,
    );
    let x = normal_input::<B, 2>([BATCH, 16], device);
    let targets = normal_input::<B, 2>([BATCH, 4], device);

    let want = {
        let out = reference.forward(x.clone());
        let grads = (out - targets.clone()).powf_scalar(2.0).mean().backward();
        reference.param_grads(&grads)
    };
    let got = {
        let _guard = autocast::enable(precision);
        let xa = Tensor::<Accelerated<B>, 2>::from_data(x.to_data(), device);
        let ta = Tensor::<Accelerated<B>, 2>::from_data(targets.to_data(), device);
        let loss = (model.forward(xa) - ta).powf_scalar(2.0).mean();
        assert_eq!(loss.dtype(), DType::F32, "the loss is reduced in f32");
        let grads = loss.backward();
        model.param_grads(&grads)
    };
    assert_eq!(got.len(), want.len(), "every parameter gets a gradient");
    // Gradients go through two low-precision matmuls (forward and backward): allow twice.
    let tol = if runs {
        2.0 * tolerance(precision)
    } else {
        1e-6
    };
    for ((name, g), (_, w)) in got.into_iter().zip(want) {
        assert_eq!(
            g.dtype,
            DType::F32,
            "{name}: gradient in the parameter's dtype"
        );
        let err = rel_err(g, w);
        assert!(
            err <= tol,
            "{precision}: {name} gradient relative error {err} > {tol}"
        );
    }
}

/// With autocast off the decorator is invisible: bit-identical results, forward and backward.
pub fn off_is_bit_identical<B: AutodiffBackend>(device: &B::Device) {
    let _seeded = seeded::<B>(device, 4);
    let (reference, model) = twins(
        Mlp::<B>::new(16, 32, 4, device),
        Mlp::<Accelerated<B>>::new(16, 32, 4, device),
        device,
    );
    let x = normal_input::<B, 2>([8, 16], device);
    let _off = autocast::disable();
    let want = reference.forward(x.clone());
    let got = model.forward(Tensor::from_data(x.to_data(), device));
    assert_eq!(got.to_data(), want.to_data());
    let want_grads = reference.param_grads(&want.exp().sum().backward());
    let got_grads = model.param_grads(&got.exp().sum().backward());
    for ((name, g), (_, w)) in got_grads.into_iter().zip(want_grads) {
        assert_eq!(g, w, "{name}");
    }
    // And the valid() copy (inference backend) too.
    let want = reference
        .valid()
        .forward(Tensor::from_data(x.to_data(), device));
    let got = model
        .valid()
        .forward(Tensor::from_data(x.to_data(), device));
    assert_eq!(got.into_data(), want.into_data());
}

/// Binary ops on mixed dtypes promote instead of panicking in the backend.
///
/// `other` is the second dtype; the result is the wider of it and f32.
pub fn mixed_dtypes_promote<B: Backend>(device: &B::Device, other: DType) {
    let wide = if other == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let low = other;
    let _off = autocast::disable();
    let a = Tensor::<Accelerated<B>, 2>::ones([2, 3], device);
    let b = Tensor::<Accelerated<B>, 2>::ones([2, 3], device).cast(low);
    let sum = a.clone() + b.clone();
    assert_eq!(sum.dtype(), wide);
    assert_eq!(
        sum.into_data().convert::<f32>().to_vec::<f32>().unwrap(),
        vec![2.0; 6]
    );
    assert_eq!((b.clone() * a.clone()).dtype(), wide);
    assert_eq!((b.clone() - a.clone()).dtype(), wide);
    assert_eq!((b.clone() / a.clone()).dtype(), wide);
    assert_eq!(Tensor::cat(vec![a.clone(), b.clone()], 0).dtype(), wide);
    let mask = a.clone().greater(b.clone());
    assert_eq!(a.clone().mask_where(mask, b.clone()).dtype(), wide);
    // Counted through ints: backends store bools differently (wgpu as u32).
    let equal = b
        .clone()
        .equal(a.clone())
        .int()
        .sum()
        .into_scalar()
        .elem::<i64>();
    assert_eq!(equal, 6);
    let _bf = autocast::enable(Precision::Bf16);
    assert_eq!((b.clone() + b).dtype(), low, "same dtypes are left alone");
}

/// A gradient reaches the parameter of the model, as the parameters' `param_grads` list them.
pub trait ParamGrads<B: AutodiffBackend> {
    fn param_grads(&self, grads: &B::Gradients) -> Vec<(String, TensorData)>;
}

/// Instantiates the generic bodies for one backend.
///
/// `$ad` is the autodiff backend, `$device` an expression for the device, `$low` the dtype the
/// mixed-dtype test casts to, then the precisions to run the numerics under. An optional
/// `needs = ("what", "reason", <bool expr>)` is for a device not every machine has (CUDA):
/// every test is `#[ignore = "reason"]`, and run with `--ignored` where the expression is false,
/// it fails saying it needs "what" (`tests/needs/mod.rs`; the caller declares `mod needs;`).
#[macro_export]
macro_rules! backend_suite {
    ($ad:ty, $device:expr, $low:expr, [$($precision:ident),*] $(, needs = ($what:literal, $need:literal, $present:expr))?) => {
        type Ad = $ad;
        type Inner = <Ad as burn::tensor::backend::AutodiffBackend>::InnerBackend;

        /// Fails the test, naming what it needs, where the device is not here.
        fn require_device() {
            $(if !$present {
                needs::missing($what);
            })?
        }

        /// A test, `#[ignore]`d with the reason where the suite has a need.
        macro_rules! suite_test {
            ($test:item) => {
                #[test]
                $(#[ignore = $need])?
                $test
            };
        }

        suite_test! {
            fn autocast_off_is_bit_identical() {
                require_device();
                suite::off_is_bit_identical::<Ad>(&$device);
            }
        }

        suite_test! {
            fn mixed_dtypes_promote() {
                require_device();
                suite::mixed_dtypes_promote::<Inner>(&$device, $low);
            }
        }

        $(
            #[allow(non_snake_case)]
            mod $precision {
                use super::*;
                use burn_accelerate::Precision;

                suite_test! {
                    fn mlp_forward() {
                        require_device();
                        suite::mlp_forward::<Inner>(&$device, Precision::$precision);
                    }
                }

                suite_test! {
                    fn conv_forward() {
                        require_device();
                        suite::conv_forward::<Inner>(&$device, Precision::$precision);
                    }
                }

                suite_test! {
                    fn mlp_gradients() {
                        require_device();
                        suite::mlp_gradients::<Ad>(&$device, Precision::$precision);
                    }
                }
            }
        )*
    };
}
