//! The `Accelerator` end to end on Flex: overflow handling, host synchronisations, clipping,
//! partial windows, configuration errors, checkpoints, and f16 training that only works with
//! dynamic loss scaling.
//!
//! Every accelerator here owns its `GradientState`, so the tests can run in parallel.
#![cfg(feature = "flex")]

mod fixed;
mod param_bits;

use burn::backend::{Autodiff, Flex};
use burn::lr_scheduler::LrScheduler;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{Optimizer, SgdConfig};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Device, Distribution, ElementConversion, Tensor, TensorData};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::{
    AccelerateConfig, AccelerateError, Accelerated, Accelerator, AcceleratorState,
    GradScalerConfig, GradientState, LossScale, Precision, StepOutcome, grads,
};
use fixed::{fixed, fixed_linear};
use param_bits::param_bits;

type B = Autodiff<Flex>;

/// Counts its steps, so a test can see whether the scheduler was stepped.
#[derive(Clone, Debug)]
struct CountingLr {
    lr: f64,
    steps: usize,
}

impl CountingLr {
    fn new(lr: f64) -> Self {
        Self { lr, steps: 0 }
    }
}

impl LrScheduler for CountingLr {
    type Record<Bk: Backend> = usize;

    fn step(&mut self) -> f64 {
        self.steps += 1;
        self.lr
    }

    fn to_record<Bk: Backend>(&self) -> usize {
        self.steps
    }

    fn load_record<Bk: Backend>(self, steps: usize) -> Self {
        Self { steps, ..self }
    }
}

fn accelerator(config: AccelerateConfig) -> Accelerator<B> {
    config
        .init_with_state::<B>(&Default::default(), GradientState::new())
        .expect("a valid config")
}

/// `Linear(1, 1)` with weight 1 and bias 0: d sum(model(x)) / d (w, b) = (sum x, len x).
fn unit_linear<Bk: Backend>(device: &Bk::Device) -> Linear<Bk> {
    Linear {
        weight: Param::from_tensor(Tensor::ones([1, 1], device)),
        bias: Some(Param::from_tensor(Tensor::zeros([1], device))),
    }
}

fn column<Bk: Backend>(values: &[f32], device: &Bk::Device) -> Tensor<Bk, 2> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len(), 1]), device)
}

fn scalar<const D: usize>(t: Tensor<B, D>) -> f32 {
    t.into_scalar().elem()
}

fn dynamic(init_scale: f64) -> GradScalerConfig {
    GradScalerConfig::new()
        .with_enabled(Some(true))
        .with_init_scale(init_scale)
}

#[test]
fn overflow_skips_optimizer_and_scheduler_and_leaves_params_bit_identical() {
    let device = Default::default();
    let mut acc = accelerator(AccelerateConfig::new().with_grad_scaler(dynamic(1024.0)));
    let mut model = unit_linear::<B>(&device);
    let momentum = SgdConfig::new().with_momentum(Some(MomentumConfig::new()));
    let mut optim = momentum.init::<B, Linear<B>>();
    let mut sched = CountingLr::new(0.1);

    // One clean step, so the optimizer has momentum state to (not) disturb.
    acc.backward(model.forward(column(&[2.0], &device)).sum(), &model);
    let (m, outcome) = acc.optimizer_step(&mut optim, model, &mut sched).unwrap();
    model = m;
    assert_eq!(outcome, StepOutcome::Applied { lr: 0.1 });
    let before = param_bits::<B, _>(&model);

    // A loss that overflows f32 once scaled.
    acc.backward(model.forward(column(&[1e38], &device)).sum() * 1e3, &model);
    let (model, outcome) = acc.optimizer_step(&mut optim, model, &mut sched).unwrap();
    assert_eq!(outcome, StepOutcome::SkippedOverflow);
    assert_eq!(
        param_bits::<B, _>(&model),
        before,
        "parameters moved on overflow"
    );
    assert_eq!(sched.steps, 1, "the scheduler stepped on overflow");
    assert_eq!(acc.loss_scale().loss_scale(), 512.0, "the scale backs off");
    assert!(
        acc.gradients().is_empty(),
        "the overflowing window is dropped"
    );
}

#[test]
fn one_host_read_per_optimizer_step_and_none_while_accumulating() {
    let device = Default::default();
    let config = AccelerateConfig::new()
        .with_gradient_accumulation_steps(2)
        .with_grad_scaler(dynamic(65536.0));
    let mut acc = accelerator(config);
    let mut model = LinearConfig::new(8, 4).init::<B>(&device);
    let mut optim = SgdConfig::new().init::<B, Linear<B>>();
    let mut lr = 1e-3;
    for batch in 0..6 {
        let _step = acc.accumulate(&model);
        let before = grads::host_reads();
        let x = Tensor::<B, 2>::random([4, 8], Distribution::Default, &device);
        acc.backward(model.forward(x).mean(), &model);
        if acc.sync_gradients() {
            // Clipping unscales and checks, but reads nothing itself.
            let _norm = acc.clip_grad_norm(&model, 1.0).unwrap();
        }
        let (m, outcome) = acc.optimizer_step(&mut optim, model, &mut lr).unwrap();
        model = m;
        let reads = grads::host_reads() - before;
        if batch % 2 == 1 {
            assert!(outcome.applied(), "batch {batch}: {outcome:?}");
            assert_eq!(reads, 1, "batch {batch}: one read per optimizer step");
        } else {
            assert_eq!(outcome, StepOutcome::Accumulating);
            assert_eq!(reads, 0, "batch {batch}: no read while accumulating");
        }
    }
}

#[test]
fn without_loss_scaling_nothing_is_read() {
    let device = Default::default();
    let mut acc = accelerator(AccelerateConfig::new());
    assert_eq!(*acc.loss_scale(), LossScale::None);
    let model = LinearConfig::new(2, 1).init::<B>(&device);
    let mut optim = SgdConfig::new().init::<B, Linear<B>>();
    let before = grads::host_reads();
    let x = Tensor::<B, 2>::ones([1, 2], &device);
    acc.backward(model.forward(x).sum(), &model);
    let (_model, outcome) = acc.optimizer_step(&mut optim, model, &mut 0.1).unwrap();
    assert!(outcome.applied());
    assert_eq!(grads::host_reads(), before);
}

/// With a scale of 1024, a clip must see unscaled gradients, and the step must not unscale
/// them again: the update is exactly what clipping the true gradients gives.
#[test]
fn clipping_unscales_first_and_only_once() {
    let device = Default::default();
    for (clip, expected_w, expected_b) in [
        ("value", 1.0 - 0.1 * 2.0, -0.1 * 1.0),
        (
            "norm",
            1.0 - 0.1 * 3.0 / 10f32.sqrt(),
            -0.1 * 1.0 / 10f32.sqrt(),
        ),
    ] {
        let mut acc = accelerator(AccelerateConfig::new().with_grad_scaler(dynamic(1024.0)));
        let model = unit_linear::<B>(&device);
        let mut optim = SgdConfig::new().init::<B, Linear<B>>();
        // d/dw = 3, d/db = 1; scaled: 3072 and 1024.
        acc.backward(model.forward(column(&[3.0], &device)).sum(), &model);
        match clip {
            "value" => acc.clip_grad_value(&model, 2.0).unwrap(),
            _ => {
                let norm = acc.clip_grad_norm(&model, 1.0).unwrap().unwrap();
                let norm: f32 = norm.into_scalar().elem();
                assert!((norm - 10f32.sqrt()).abs() < 1e-5, "unscaled norm {norm}");
            }
        }
        acc.unscale_gradients(&model).unwrap(); // a second unscale is a no-op
        let (model, outcome) = acc.optimizer_step(&mut optim, model, &mut 0.1).unwrap();
        assert!(outcome.applied());
        let w = scalar(model.weight.val());
        let b = scalar(model.bias.unwrap().val());
        assert!(
            (w - expected_w).abs() < 1e-6,
            "{clip}: w {w} != {expected_w}"
        );
        assert!(
            (b - expected_b).abs() < 1e-6,
            "{clip}: b {b} != {expected_b}"
        );
    }
}

#[test]
fn clipping_on_an_accumulating_batch_does_nothing() {
    let device = Default::default();
    let config = AccelerateConfig::new().with_gradient_accumulation_steps(2);
    let mut acc = accelerator(config);
    let model = unit_linear::<B>(&device);
    let _step = acc.accumulate(&model);
    assert!(!acc.sync_gradients());
    acc.backward(model.forward(column(&[3.0], &device)).sum(), &model);
    assert!(acc.clip_grad_norm(&model, 1e-3).unwrap().is_none());
    acc.clip_grad_value(&model, 1e-3).unwrap();
    let bias = model.bias.as_ref().unwrap().id;
    let grad: f32 = acc
        .gradients()
        .get::<Flex, 1>(bias)
        .unwrap()
        .into_scalar()
        .elem();
    assert_eq!(grad, 0.5, "1 / 2 accumulation steps, unclipped");
}

#[test]
fn invalid_clip_arguments_are_typed_errors() {
    let device = Default::default();
    let mut acc = accelerator(AccelerateConfig::new());
    let model = unit_linear::<B>(&device);
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            acc.clip_grad_norm(&model, bad),
            Err(AccelerateError::InvalidConfig {
                field: "max_norm",
                ..
            })
        ));
        assert!(matches!(
            acc.clip_grad_value(&model, bad),
            Err(AccelerateError::InvalidConfig {
                field: "clip_value",
                ..
            })
        ));
    }
}

/// k = 3 over a loader of 4 batches: the last window holds one batch. Accelerate divides its
/// loss by 3; the opt-in divides it by 1.
#[test]
fn partial_last_window_is_divided_by_its_length_only_when_asked() {
    let device = Default::default();
    for (opt_in, expected_bias_step) in [(false, 1.0 / 3.0), (true, 1.0)] {
        let config = AccelerateConfig::new()
            .with_gradient_accumulation_steps(3)
            .with_divide_partial_window_by_length(opt_in);
        let mut acc = accelerator(config);
        let state = acc.gradient_state().clone();
        let mut model = unit_linear::<B>(&device);
        let mut optim = SgdConfig::new().init::<B, Linear<B>>();
        let mut bias_before_last = 0.0;
        let loader = state.begin_dataloader();
        for batch in 0..4 {
            if batch == 3 {
                loader.set_end_of_dataloader(None);
                bias_before_last = scalar(model.bias.as_ref().unwrap().val());
            }
            let _step = acc.accumulate(&model);
            acc.backward(model.forward(column(&[1.0], &device)).sum(), &model);
            let (m, outcome) = acc.optimizer_step(&mut optim, model, &mut 1.0).unwrap();
            model = m;
            assert_eq!(outcome.applied(), batch >= 2, "batch {batch}");
        }
        assert_eq!(state.window_batches(), 1);
        let step = bias_before_last - scalar(model.bias.unwrap().val());
        assert!(
            (step - expected_bias_step).abs() < 1e-6,
            "opt-in {opt_in}: last step moved the bias by {step}"
        );
    }
}

#[test]
fn invalid_configs_are_typed_errors_from_the_constructor() {
    let device = Default::default();
    let cases = [
        (
            AccelerateConfig::new().with_gradient_accumulation_steps(0),
            "gradient_accumulation_steps",
        ),
        (
            AccelerateConfig::new()
                .with_grad_scaler(GradScalerConfig::new().with_backoff_factor(1.0)),
            "grad_scaler.backoff_factor",
        ),
        (
            AccelerateConfig::new()
                .with_grad_scaler(GradScalerConfig::new().with_backoff_factor(-0.5)),
            "grad_scaler.backoff_factor",
        ),
        (
            AccelerateConfig::new()
                .with_grad_scaler(GradScalerConfig::new().with_growth_factor(1.0)),
            "grad_scaler.growth_factor",
        ),
        (
            AccelerateConfig::new()
                .with_grad_scaler(GradScalerConfig::new().with_growth_factor(0.0)),
            "grad_scaler.growth_factor",
        ),
        (
            AccelerateConfig::new()
                .with_grad_scaler(GradScalerConfig::new().with_growth_interval(0)),
            "grad_scaler.growth_interval",
        ),
        (
            AccelerateConfig::new().with_grad_scaler(GradScalerConfig::new().with_init_scale(-1.0)),
            "grad_scaler.init_scale",
        ),
    ];
    for (config, expected) in cases {
        let state = GradientState::new();
        let err = config
            .init_with_state::<B>(&device, state.clone())
            .unwrap_err();
        match &err {
            AccelerateError::InvalidConfig { field, fix, .. } => {
                assert_eq!(*field, expected);
                assert!(!fix.is_empty());
            }
            other => panic!("{expected}: unexpected {other:?}"),
        }
        assert!(err.to_string().contains(expected), "{err}");
        assert_eq!(state.num_steps(), 1, "a refused config changes nothing");
    }
}

#[test]
fn config_uses_accelerates_names_and_round_trips() {
    let config = AccelerateConfig::new()
        .with_mixed_precision(Precision::F16)
        .with_gradient_accumulation_steps(4);
    let json = serde_json::to_value(&config).unwrap();
    assert_eq!(json["mixed_precision"], "fp16");
    assert_eq!(json["gradient_accumulation_steps"], 4);
    assert_eq!(json["grad_scaler"]["init_scale"], 65536.0);
    let back: AccelerateConfig = serde_json::from_value(json).unwrap();
    assert_eq!(back, config);
}

#[test]
fn loss_scaling_defaults_follow_the_precision() {
    let device = Default::default();
    let f16 = AccelerateConfig::new().with_mixed_precision(Precision::F16);
    let acc = f16
        .init_with_state::<B>(&device, GradientState::new())
        .unwrap();
    assert!(matches!(acc.loss_scale(), LossScale::Dynamic(_)));
    let bf16 = AccelerateConfig::new().with_mixed_precision(Precision::Bf16);
    let acc = bf16
        .init_with_state::<B>(&device, GradientState::new())
        .unwrap();
    assert_eq!(*acc.loss_scale(), LossScale::None);
}

#[test]
fn fp8_needs_no_loss_scaling_and_its_recipe_is_checked_by_the_constructor() {
    use burn_accelerate::fp8::{DelayedScaling, Fp8Mode};
    let device = Default::default();
    let fp8 = AccelerateConfig::new().with_mixed_precision(Precision::Fp8(Fp8Mode::Hybrid));
    let bad = fp8
        .clone()
        .with_fp8_recipe(DelayedScaling::default().with_interval(0));
    let err = bad
        .init_with_state::<B>(&device, GradientState::new())
        .unwrap_err();
    assert!(
        matches!(
            err,
            AccelerateError::InvalidFp8Recipe {
                parameter: "interval",
                ..
            }
        ),
        "{err}"
    );
    let acc = fp8
        .init_with_state::<B>(&device, GradientState::new())
        .unwrap();
    assert_eq!(acc.precision(), Precision::Fp8(Fp8Mode::Hybrid));
    assert_eq!(*acc.loss_scale(), LossScale::None);
}

#[test]
fn load_state_refuses_a_checkpoint_from_other_settings() {
    let saved = accelerator(AccelerateConfig::new().with_gradient_accumulation_steps(2)).state();
    let mut other = accelerator(AccelerateConfig::new().with_gradient_accumulation_steps(3));
    assert!(matches!(
        other.load_state(&saved),
        Err(AccelerateError::StateMismatch {
            what: "gradient_accumulation_steps",
            ..
        })
    ));
    let saved = accelerator(AccelerateConfig::new().with_grad_scaler(dynamic(8.0))).state();
    let mut unscaled = accelerator(AccelerateConfig::new());
    assert!(matches!(
        unscaled.load_state(&saved),
        Err(AccelerateError::StateMismatch {
            what: "loss scaling",
            ..
        })
    ));
}

// ---------------------------------------------------------------------------------------------
// Checkpoint and resume.

const BATCHES_PER_EPOCH: usize = 5;
const EPOCHS: usize = 3;

fn resumable_config() -> AccelerateConfig {
    AccelerateConfig::new()
        .with_gradient_accumulation_steps(2)
        .with_divide_partial_window_by_length(true)
        // Near f32's top, so that windows overflow and the scale moves both ways.
        .with_grad_scaler(dynamic(2f64.powi(126)).with_growth_interval(2))
}

/// The batch of (epoch, index), independent of any RNG state a checkpoint does not hold.
fn resumable_batch(epoch: usize, index: usize, device: &Device<B>) -> Tensor<B, 2> {
    fixed(
        [4, 3],
        (epoch * BATCHES_PER_EPOCH + index) as f32,
        3.0,
        device,
    )
}

type Optim = burn::optim::adaptor::OptimizerAdaptor<burn::optim::Sgd<Flex>, Linear<B>, B>;

struct Run {
    acc: Accelerator<B>,
    model: Linear<B>,
    optim: Optim,
    sched: CountingLr,
    outcomes: Vec<StepOutcome>,
}

impl Run {
    fn fresh(device: &Device<B>) -> Self {
        Run {
            acc: accelerator(resumable_config()),
            model: fixed_linear(3, 2, 42.0, device),
            optim: SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new()))
                .init(),
            sched: CountingLr::new(1e-2),
            outcomes: Vec::new(),
        }
    }

    /// Runs batches from (epoch, index) on; stops after `stop` batches in all if given.
    fn train(&mut self, from: (usize, usize), stop: Option<usize>, device: &Device<B>) {
        let mut done = 0;
        for epoch in from.0..EPOCHS {
            let state = self.acc.gradient_state().clone();
            let loader = state.begin_dataloader();
            let first = if epoch == from.0 { from.1 } else { 0 };
            for index in first..BATCHES_PER_EPOCH {
                if stop == Some(done) {
                    return;
                }
                if index + 1 == BATCHES_PER_EPOCH {
                    loader.set_end_of_dataloader(None);
                }
                let _step = self.acc.accumulate(&self.model);
                let x = resumable_batch(epoch, index, device);
                let loss = self.model.forward(x).powi_scalar(2).mean();
                self.acc.backward(loss, &self.model);
                let model = self.model.clone();
                let (model, outcome) = self
                    .acc
                    .optimizer_step(&mut self.optim, model, &mut self.sched)
                    .unwrap();
                self.model = model;
                self.outcomes.push(outcome);
                done += 1;
            }
        }
    }
}

#[test]
fn checkpoint_and_resume_reproduce_the_uninterrupted_run_bit_for_bit() {
    let device = Default::default();
    let mut straight = Run::fresh(&device);
    straight.train((0, 0), None, &device);
    let outcomes = &straight.outcomes;
    assert!(
        outcomes.contains(&StepOutcome::SkippedOverflow),
        "{outcomes:?}"
    );
    assert!(outcomes.iter().any(StepOutcome::applied), "{outcomes:?}");

    // Stop after 4 batches: a complete window, mid-epoch, where the scale has grown.
    let mut first = Run::fresh(&device);
    first.train((0, 0), Some(4), &device);
    let saved_state = serde_json::to_string(&first.acc.state()).unwrap();
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let model_bytes = recorder
        .record(first.model.clone().into_record(), ())
        .unwrap();
    let optim_record = first.optim.to_record();
    let sched_steps = first.sched.steps;
    assert_ne!(
        first.acc.loss_scale(),
        Run::fresh(&device).acc.loss_scale(),
        "the checkpoint should hold a scale a fresh accelerator does not have"
    );
    drop(first);

    let resume = |restore_accelerator: bool| {
        let mut run = Run::fresh(&device);
        let state: AcceleratorState = serde_json::from_str(&saved_state).unwrap();
        if restore_accelerator {
            run.acc.load_state(&state).unwrap();
            assert_eq!(run.acc.state(), state);
        }
        run.model = run
            .model
            .load_record(recorder.load(model_bytes.clone(), &device).unwrap());
        run.optim = run.optim.load_record(optim_record.clone());
        run.sched.steps = sched_steps;
        run.train((0, 4), None, &device);
        run
    };
    let resumed = resume(true);
    assert_eq!(
        param_bits::<B, _>(&resumed.model),
        param_bits::<B, _>(&straight.model)
    );
    assert_eq!(resumed.acc.state(), straight.acc.state());
    assert_eq!(resumed.sched.steps, straight.sched.steps);

    // Without the accelerator's state the run diverges: the test has teeth.
    let amnesiac = resume(false);
    assert!(
        amnesiac.acc.state() != straight.acc.state()
            || param_bits::<B, _>(&amnesiac.model) != param_bits::<B, _>(&straight.model)
    );
}

// ---------------------------------------------------------------------------------------------
// f16 training that needs dynamic scaling.

type F16B = Accelerated<Autodiff<Flex>>;

// Burn's `Module` derive expects the backend parameter to be called `B`.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

/// The MSE is multiplied by 1e6: its gradient at the f16 logits is ~1e5, past f16's 65504,
/// so even unscaled (scale 1) the backward pass overflows in f16. The dynamic scaler backs
/// off below 1 until it fits.
const LOSS_MULT: f32 = 1e6;

struct F16Run {
    losses: Vec<f32>,
    outcomes: Vec<StepOutcome>,
    model: Mlp<F16B>,
    accelerator: Accelerator<F16B>,
}

fn train_f16(scaler: GradScalerConfig, steps: usize) -> F16Run {
    let device = Default::default();
    let config = AccelerateConfig::new()
        .with_mixed_precision(Precision::F16)
        .with_grad_scaler(scaler)
        // These products are tiny: cast them all, as PyTorch does, so that the forward runs
        // in f16 (on the threads that enter the accelerator's autocast).
        .with_small_ops(Some(SmallOps::Cast));
    let mut acc = config
        .init_with_state::<F16B>(&device, GradientState::new())
        .unwrap();
    let mut model = Mlp {
        fc1: fixed_linear::<F16B>(8, 32, 1.0, &device),
        fc2: fixed_linear::<F16B>(32, 1, 2.0, &device),
        act: Relu::new(),
    };
    let x = fixed::<F16B, 2>([16, 8], 3.0, 1.7, &device);
    let teacher = fixed::<F16B, 2>([8, 1], 4.0, 1.0, &device);
    let y = x.clone().matmul(teacher).detach();
    let mut optim = SgdConfig::new().init::<F16B, Mlp<F16B>>();
    let mut lr = 2e-8; // an effective 0.02 on the unmultiplied MSE
    let (mut losses, mut outcomes) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let _autocast = acc.autocast();
        let out = model.forward(x.clone());
        assert_eq!(
            out.dtype(),
            burn::tensor::DType::F16,
            "the forward runs in f16"
        );
        let mse = (out - y.clone()).powi_scalar(2).mean();
        losses.push(mse.clone().into_scalar().elem());
        acc.backward(mse * LOSS_MULT, &model);
        let (m, outcome) = acc.optimizer_step(&mut optim, model, &mut lr).unwrap();
        model = m;
        outcomes.push(outcome);
    }
    F16Run {
        losses,
        outcomes,
        model,
        accelerator: acc,
    }
}

fn all_finite(model: &Mlp<F16B>) -> bool {
    [
        model.fc1.weight.val().into_data(),
        model.fc2.weight.val().into_data(),
    ]
    .into_iter()
    .all(|d| {
        d.convert::<f32>()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite())
    })
}

#[test]
fn f16_training_overflows_without_scaling_and_trains_with_the_dynamic_scaler() {
    let unscaled = train_f16(GradScalerConfig::new().with_enabled(Some(false)), 3);
    assert!(
        !all_finite(&unscaled.model),
        "the model is built to overflow f16 without loss scaling"
    );

    let run = train_f16(GradScalerConfig::new().with_growth_interval(20), 150);
    assert!(all_finite(&run.model), "no NaN or inf in the parameters");
    let skipped = run
        .outcomes
        .iter()
        .filter(|o| **o == StepOutcome::SkippedOverflow)
        .count();
    assert!(skipped > 0, "some steps are skipped");
    let scale = run.accelerator.loss_scale().loss_scale();
    assert!(scale < 65536.0, "the scale backs off (now {scale})");
    let first_applied = run.outcomes.iter().position(StepOutcome::applied).unwrap();
    let start = run.losses[first_applied];
    let end = *run.losses.last().unwrap();
    assert!(
        end < 0.2 * start,
        "the loss falls once steps apply: {start} -> {end} ({skipped} skipped, scale {scale})"
    );
}

// ---------------------------------------------------------------------------------------------
// Devices that cannot run the precision.

#[cfg(feature = "ndarray")]
#[test]
fn f16_on_a_device_without_f16_is_a_typed_error() {
    use burn::backend::NdArray;
    type Nd = Autodiff<NdArray>;
    let device = Default::default();
    let config = AccelerateConfig::new().with_mixed_precision(Precision::F16);
    let state = GradientState::new();
    let err = config
        .init_with_state::<Nd>(&device, state.clone())
        .unwrap_err();
    assert!(
        matches!(
            err,
            AccelerateError::UnsupportedPrecision {
                precision: Precision::F16,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("with_allow_fallback"), "{err}");
    assert_eq!(state.num_steps(), 1, "a refused config changes nothing");
    // With the fallback allowed it trains in f32, and without f16 there is no loss scaling.
    let acc = config
        .with_allow_fallback(true)
        .init_with_state::<Nd>(&device, GradientState::new())
        .unwrap();
    assert_eq!(acc.precision(), Precision::F32);
    assert_eq!(*acc.loss_scale(), LossScale::None);
}
