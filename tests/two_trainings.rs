//! Two trainings in one process at once, on two threads, in different precisions (one of them
//! fp8, with its delayed-scaling state): each ends bit for bit where it ends alone, because
//! each reads only its own context (precision, small-op rule, fp8 recipe and amax histories).
#![cfg(feature = "flex")]

mod fixed;
mod param_bits;

use std::sync::{Arc, Barrier};
use std::thread;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, Relu};
use burn::optim::SgdConfig;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::fp8::{self, DelayedScaling, Fp8Mode};
use burn_accelerate::{AccelerateConfig, Accelerated, GradientState, Precision, StepOutcome};
use fixed::{fixed, fixed_linear};
use param_bits::param_bits;

// The decorated backend every training here runs on.
type Ab = Accelerated<Autodiff<Flex>>;

const STEPS: usize = 6;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    first: Linear<B>,
    act: Relu,
    second: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.second.forward(self.act.forward(self.first.forward(x)))
    }
}

fn model() -> Mlp<Ab> {
    let device = Default::default();
    Mlp {
        first: fixed_linear(16, 32, 1.0, &device),
        act: Relu,
        second: fixed_linear(32, 4, 3.0, &device),
    }
}

/// What one training ends with: its parameters' bits, and its fp8 state's step count.
#[derive(PartialEq)]
struct Ended {
    params: Vec<u32>,
    fp8_steps: u64,
    fp8_tensors: usize,
}

impl std::fmt::Debug for Ended {
    // The bits are many: a failure shows where they first differ, through a digest.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let digest = self
            .params
            .iter()
            .fold(0u64, |h, &b| h.rotate_left(5) ^ u64::from(b));
        f.debug_struct("Ended")
            .field("params", &self.params.len())
            .field("digest", &format_args!("{digest:016x}"))
            .field("fp8_steps", &self.fp8_steps)
            .field("fp8_tensors", &self.fp8_tensors)
            .finish()
    }
}

/// Trains the MLP for [`STEPS`] steps with an accelerator in `precision`, waiting at
/// `barrier` (if any) before each step so that a training on another thread runs between.
fn train(precision: Precision, barrier: Option<&Barrier>) -> Ended {
    let config = AccelerateConfig::new()
        .with_mixed_precision(precision)
        // The model is tiny: cast every lower-class op (PyTorch's rule), so that the low
        // precision is what runs.
        .with_small_ops(Some(SmallOps::Cast))
        .with_fp8_recipe(DelayedScaling::default().with_amax_history_len(4));
    let mut acc = config
        .init_with_state::<Ab>(&Default::default(), GradientState::new())
        .expect("a valid configuration");
    let device = Default::default();
    let x = fixed([64, 16], 11.0, 1.0, &device);
    let y = fixed([64, 4], 12.0, 1.0, &device);
    let mut model = model();
    let mut optim = SgdConfig::new().init::<Ab, Mlp<Ab>>();
    for _ in 0..STEPS {
        if let Some(barrier) = barrier {
            barrier.wait();
        }
        let loss = {
            let _autocast = acc.autocast();
            MseLoss::new().forward(model.forward(x.clone()), y.clone(), Reduction::Mean)
        };
        acc.backward(loss, &model);
        let (stepped, outcome) = acc
            .optimizer_step(&mut optim, model, &mut 0.1)
            .expect("a step");
        assert!(
            matches!(outcome, StepOutcome::Applied { .. }),
            "{outcome:?}"
        );
        model = stepped;
    }
    let fp8 = {
        let _entered = acc.context().enter();
        fp8::state()
    };
    Ended {
        params: param_bits::<Ab, _>(&model),
        fp8_steps: fp8.steps(),
        fp8_tensors: fp8.tensors().count(),
    }
}

#[test]
fn two_trainings_on_two_threads_each_end_as_they_do_alone() {
    let bf16 = Precision::Bf16;
    let fp8 = Precision::Fp8(Fp8Mode::Hybrid);
    let alone_bf16 = thread::spawn(move || train(bf16, None)).join().unwrap();
    let alone_fp8 = thread::spawn(move || train(fp8, None)).join().unwrap();
    assert_ne!(
        alone_bf16.params, alone_fp8.params,
        "the precisions must train differently for the test to tell them apart"
    );
    assert_eq!(
        alone_bf16.fp8_steps, 0,
        "a bf16 training steps no fp8 state"
    );
    assert_eq!(alone_fp8.fp8_steps, STEPS as u64);
    // Hybrid fp8 scales both linears' inputs and weights, and the gradients of the three of
    // them that need one (not the data's).
    assert_eq!(alone_fp8.fp8_tensors, 7, "{alone_fp8:?}");

    let barrier = Arc::new(Barrier::new(2));
    let together = [bf16, fp8].map(|precision| {
        let barrier = barrier.clone();
        thread::spawn(move || train(precision, Some(&barrier)))
    });
    let [together_bf16, together_fp8] = together.map(|t| t.join().unwrap());
    assert_eq!(
        together_bf16, alone_bf16,
        "the bf16 training, beside an fp8 one"
    );
    assert_eq!(
        together_fp8, alone_fp8,
        "the fp8 training, beside a bf16 one"
    );
    // Neither touched the process's fp8 state, which threads without a training read.
    let process = fp8::state();
    assert_eq!((process.steps(), process.tensors().count()), (0, 0));
}
