//! A fixed number of MLP training steps on one backend, for instruction counting under
//! callgrind, which is repeatable on a shared machine where wall-clock timings are not:
//!
//!     cargo bench --bench step_instructions --no-run
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         target/release/deps/step_instructions-* autodiff|accelerated_off|hand_cast|autocast [STEPS]
//!
//! `Collected` in callgrind's summary is the instruction count; compare the variants' counts.

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, FloatDType, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast};

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

fn steps<B: AutodiffBackend>(hand_cast: bool, count: usize) {
    let device = B::Device::default();
    B::seed(&device, 7);
    let model = Mlp::<B> {
        fc1: LinearConfig::new(64, 128).init(&device),
        fc2: LinearConfig::new(128, 64).init(&device),
        act: Relu::new(),
    };
    let x = Tensor::<B, 2>::random([32, 64], Distribution::Normal(0., 1.), &device);
    let linear = |l: &Linear<B>, x: Tensor<B, 2>| {
        if hand_cast {
            let low = FloatDType::BF16;
            let b = l.bias.as_ref().map(|b| b.val().cast(low));
            burn::tensor::module::linear(x.cast(low), l.weight.val().cast(low), b)
        } else {
            l.forward(x)
        }
    };
    for _ in 0..count {
        let out = linear(&model.fc2, model.act.forward(linear(&model.fc1, x.clone())));
        let loss = out.cast(FloatDType::F32).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        std::hint::black_box(grads);
    }
}

fn main() {
    // `cargo bench` passes `--bench`; the variant and the step count are the other arguments.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let count = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(20);
    match args.first().map(String::as_str) {
        Some("autodiff") => steps::<Autodiff<Flex>>(false, count),
        Some("accelerated_off") => steps::<Accelerated<Autodiff<Flex>>>(false, count),
        Some("hand_cast") => steps::<Autodiff<Flex>>(true, count),
        Some("autocast") => {
            let _bf16 = autocast::enable(Precision::Bf16);
            steps::<Accelerated<Autodiff<Flex>>>(false, count)
        }
        _ => eprintln!(
            "usage: step_instructions autodiff|accelerated_off|hand_cast|autocast [STEPS, default 20]"
        ),
    }
}
