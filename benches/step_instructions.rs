//! A fixed number of MLP training steps on one backend, for instruction counting under
//! callgrind, which is repeatable on a shared machine where wall-clock timings are not:
//!
//!     cargo bench --bench step_instructions --no-run
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         target/release/deps/step_instructions-* autodiff|accelerated_off|hand_cast|autocast [STEPS]
//!
//! `Collected` in callgrind's summary is the instruction count; compare the variants' counts.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, FloatDType, Tensor};
use burn_accelerate::{Accelerated, Precision, autocast};
use common::{Mlp, mlp_step};

fn steps<B: AutodiffBackend>(hand_cast: bool, count: usize) {
    let device = B::Device::default();
    let model = Mlp::<B>::new([64, 128, 64], &device);
    let x = Tensor::<B, 2>::random([32, 64], Distribution::Normal(0., 1.), &device);
    let hand_cast = hand_cast.then_some(FloatDType::BF16);
    for _ in 0..count {
        std::hint::black_box(mlp_step(&model, x.clone(), hand_cast));
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
