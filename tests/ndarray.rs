//! The generic suite on NdArray, which has no half types: every autocast request must train
//! in f32 and report the fallback.
#![cfg(feature = "ndarray")]

mod suite;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::DType;
use burn_accelerate::{AccelerateError, AutocastConfig, Precision, capability};

backend_suite!(
    Autodiff<NdArray>,
    Default::default(),
    DType::F64,
    [Bf16, F16]
);

#[test]
fn probe_finds_no_half_types() {
    let caps = capability::probe::<NdArray>(&Default::default());
    assert!(!caps.f16 && !caps.bf16, "{caps:?}");
    assert_eq!(caps.usable(), vec![Precision::F32]);
}

#[test]
fn strict_request_is_a_typed_error_naming_device_and_dtype() {
    let device = Default::default();
    let err = AutocastConfig::new(Precision::Bf16)
        .init::<NdArray>(&device)
        .unwrap_err();
    match &err {
        AccelerateError::UnsupportedPrecision {
            precision,
            backend,
            device,
            supported,
        } => {
            assert_eq!(*precision, Precision::Bf16);
            assert!(backend.contains("ndarray"), "{backend}");
            assert!(device.contains("Cpu"), "{device}");
            assert_eq!(supported, "f32");
        }
        other => panic!("unexpected {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains("bf16") && message.contains("allow_fallback"),
        "{message}"
    );
}

#[test]
fn lenient_request_runs_f32_and_reports_the_fallback() {
    let device = Default::default();
    let autocast = AutocastConfig::new(Precision::F16)
        .with_allow_fallback(true)
        .init::<NdArray>(&device)
        .unwrap();
    assert!(autocast.fell_back());
    assert_eq!(autocast.precision(), Precision::F32);
    assert_eq!(autocast.requested(), Precision::F16);
}

#[test]
fn lower_ops_under_a_guard_fall_back_once_and_say_so() {
    use burn::tensor::Tensor;
    use burn::tensor::backend::Backend;
    use burn_accelerate::{Accelerated, autocast};
    type B = Accelerated<NdArray>;
    let device = Default::default();
    let _g = autocast::enable(Precision::Bf16);
    let x = Tensor::<B, 2>::ones([2, 2], &device);
    let y = x.clone().matmul(x.clone()).matmul(x);
    assert_eq!(y.dtype(), DType::F32);
    let fallbacks = capability::fallbacks();
    let ours: Vec<_> = fallbacks
        .iter()
        .filter(|f| {
            f.requested == Precision::Bf16 && f.backend == <NdArray as Backend>::name(&device)
        })
        .collect();
    assert_eq!(
        ours.len(),
        1,
        "reported once per backend, device and precision: {fallbacks:?}"
    );
    assert!(ours[0].to_string().contains("run in f32"), "{}", ours[0]);
}

#[test]
fn training_under_an_autocast_request_matches_f32_training() {
    use burn::backend::Autodiff;
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    use burn::tensor::backend::Backend;
    use burn::tensor::{ElementConversion, Tensor};
    use burn_accelerate::{Accelerated, autocast};
    use suite::models::Mlp;

    fn train<B: burn::tensor::backend::AutodiffBackend>(model: Mlp<B>) -> Vec<f32> {
        let device = Default::default();
        let mut model = model;
        let mut optim = SgdConfig::new().init();
        (0..5)
            .map(|step| {
                let x = Tensor::<B, 2>::ones([4, 16], &device).mul_scalar(step as f32 * 0.1);
                let loss = model.forward(x).powf_scalar(2.0).mean();
                let value = loss.clone().into_scalar().elem::<f32>();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = optim.step(0.1, model.clone(), grads);
                value
            })
            .collect()
    }

    let device = Default::default();
    <Autodiff<NdArray> as Backend>::seed(&device, 5);
    let (plain, accelerated) = suite::twins(
        Mlp::<Autodiff<NdArray>>::new(16, 8, 2, &device),
        Mlp::<Accelerated<Autodiff<NdArray>>>::new(16, 8, 2, &device),
        &device,
    );
    let want = train(plain);
    let _bf16 = autocast::enable(Precision::Bf16);
    let got = train(accelerated);
    assert_eq!(
        got, want,
        "NdArray runs the bf16 request in f32: the same losses"
    );
}
