//! What synchronising gradients costs: the benchmark MLP's training step (256 → 512 → 256,
//! batch 64 per process, f32, SGD) on one process, or on several under the launcher with the
//! gradients averaged every step, timed step by step. The PyTorch DDP (gloo) counterpart is
//! `benches/ddp_gloo.py`; the figures are in BENCHMARKS.md.
//!
//! ```text
//! cargo build --release --example ddp_step --bin burn-accelerate
//! RAYON_NUM_THREADS=1 target/release/examples/ddp_step
//! target/release/burn-accelerate launch --num-processes 2 -- target/release/examples/ddp_step
//! ```
//!
//! Printed by the main process: the median step time, the median time of the gradient
//! all-reduce within it and its share, and the median all-reduce of a flat buffer as large as
//! the model (the collective alone, without packing).

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::distributed::{ProcessState, ReduceOp, all_reduce_gradients};
use clap::Parser;

type Train = Autodiff<Flex>;

/// Time the benchmark MLP's step with and without gradient synchronisation.
#[derive(Parser)]
struct Args {
    /// Timed steps (after as many warm-up steps as a tenth of them, at least 10).
    #[arg(long, default_value_t = 300)]
    steps: usize,
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e3
}

fn main() {
    let args = Args::parse();
    let state = ProcessState::from_env().expect("a valid launch environment");
    let group = state.group().expect("the process group");
    let device = Default::default();
    Train::seed(&device, 7);
    let mut model = Mlp::<Train> {
        fc1: LinearConfig::new(256, 512).init(&device),
        fc2: LinearConfig::new(512, 256).init(&device),
        act: Relu::new(),
    };
    let mut optim = SgdConfig::new().init();
    let x = Tensor::<Train, 2>::random([64, 256], Distribution::Normal(0., 1.), &device);
    let warmup = (args.steps / 10).max(10);
    let (mut steps, mut syncs) = (Vec::new(), Vec::new());
    for step in 0..warmup + args.steps {
        let start = Instant::now();
        let out = model
            .fc2
            .forward(model.act.forward(model.fc1.forward(x.clone())));
        let loss = out.powf_scalar(2.0).mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let sync = Instant::now();
        all_reduce_gradients::<Train, _>(&group, &model, &mut grads).expect("all-reduce");
        let synced = sync.elapsed();
        model = optim.step(1e-3, model, grads);
        if step >= warmup {
            steps.push(start.elapsed());
            syncs.push(synced);
        }
    }
    let mut buffer = vec![0.5f32; model.num_params()];
    let mut flat = Vec::new();
    for step in 0..warmup + args.steps {
        let start = Instant::now();
        group
            .all_reduce(&mut buffer, ReduceOp::Mean)
            .expect("all-reduce");
        if step >= warmup {
            flat.push(start.elapsed());
        }
    }
    if state.is_main_process() {
        let (step, sync) = (median(steps), median(syncs));
        println!(
            "processes={} threads={} params={} step_ms={step:.3} sync_ms={sync:.3} \
             sync_share={:.1}% flat_all_reduce_ms={:.3}",
            state.num_processes(),
            std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into()),
            model.num_params(),
            100.0 * sync / step,
            median(flat)
        );
    }
}
