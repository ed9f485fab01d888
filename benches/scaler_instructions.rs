//! A fixed number of MLP training steps through the `Accelerator`, with and without the dynamic
//! loss scaler, for instruction counting under callgrind (repeatable on a shared machine, where
//! the wall clock of `benches/scaler.rs` is not):
//!
//!     cargo bench --bench scaler_instructions --no-run
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!         target/release/deps/scaler_instructions-* unscaled|scaled [STEPS]
//!
//! The marginal count per step is (count at 60 steps − count at 20) / 40; the scaled variant's
//! excess over the unscaled one is what scaling the loss, unscaling, checking, reading the
//! check and updating the scale cost.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::optim::SgdConfig;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::{AccelerateConfig, GradScalerConfig, GradientState};
use common::Mlp;

type B = Autodiff<Flex>;

fn steps(scaled: bool, count: usize) {
    let device = Default::default();
    let mut model = Mlp::<B>::new([256, 512, 256], &device);
    let x = Tensor::<B, 2>::random([64, 256], Distribution::Normal(0., 1.), &device);
    let mut acc = AccelerateConfig::new()
        .with_grad_scaler(GradScalerConfig::new().with_enabled(Some(scaled)))
        .init_with_state::<B>(&device, GradientState::new())
        .expect("valid config");
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    let mut lr = 1e-3;
    for _ in 0..count {
        acc.backward(model.forward(x.clone()).powi_scalar(2).mean(), &model);
        let (next, outcome) = acc
            .optimizer_step(&mut optim, model, &mut lr)
            .expect("one process: no collective to fail");
        assert!(outcome.applied());
        model = next;
    }
    std::hint::black_box(model);
}

fn main() {
    // `cargo bench` passes `--bench`; the variant and the step count are the other arguments.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let count = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(20);
    match args.first().map(String::as_str) {
        Some("unscaled") => steps(false, count),
        Some("scaled") => steps(true, count),
        _ => eprintln!("usage: scaler_instructions unscaled|scaled [STEPS, default 20]"),
    }
}
