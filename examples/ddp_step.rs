//! What synchronising gradients costs: an MLP's training step (by default the benchmark MLP,
//! 256 → 512 → 256, batch 64 per process, f32, SGD) on one process, or on several under the
//! launcher with the gradients averaged every step, timed step by step. The PyTorch DDP (gloo)
//! counterpart is `benches/ddp_gloo.py`; the figures are in BENCHMARKS.md.
//!
//! ```text
//! cargo build --release --example ddp_step --bin burn-accelerate
//! RAYON_NUM_THREADS=1 target/release/examples/ddp_step
//! target/release/burn-accelerate launch --num-processes 2 -- target/release/examples/ddp_step
//! # 100.7M parameters: six 4096 × 4096 layers
//! target/release/burn-accelerate launch --num-processes 2 -- target/release/examples/ddp_step \
//!     --dims 4096,4096,4096,4096,4096,4096,4096 --batch 16 --steps 10
//! # the same, with every gradient flattened first (the path of backends other than Flex)
//! target/release/burn-accelerate launch --num-processes 2 -- target/release/examples/ddp_step \
//!     --dims 4096,4096,4096,4096,4096,4096,4096 --batch 16 --steps 10 --sync-layout contiguous
//! ```
//!
//! Printed by the main process: the median step time, the median time of the gradient
//! all-reduce within it and its share, and the median all-reduce of a flat buffer as large as
//! the model (the collective alone, without packing); then, per timed step (medians), the
//! minor page faults of the whole step and of the sync alone, and the values the sync copied
//! on the host (`distributed::sync_copied_values`). `--sync-layout contiguous` syncs as every
//! backend but Flex does (each gradient flattened in logical order first), for comparison.

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::distributed::{
    ProcessState, ReduceOp, SyncLayout, all_reduce_gradients, scope_sync_layout, sync_copied_values,
};
use clap::{Parser, ValueEnum};

type Train = Autodiff<Flex>;

/// Time the benchmark MLP's step with and without gradient synchronisation.
#[derive(Parser)]
struct Args {
    /// Timed steps (after as many warm-up steps as a tenth of them, at least 2).
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// The layers' widths, input first: a Linear between each two, ReLU between Linears.
    #[arg(long, value_delimiter = ',', default_values_t = [256, 512, 256])]
    dims: Vec<usize>,
    /// Samples per process and step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// How the gradients are read and written: where they lie, or flattened first.
    #[arg(long, value_enum, default_value_t = Layout::AsStored)]
    sync_layout: Layout,
}

#[derive(Clone, Copy, ValueEnum)]
enum Layout {
    AsStored,
    Contiguous,
}

/// This process's minor page faults so far (`/proc/self/stat`'s tenth field; 0 where there is
/// none): each is a page the process touched for the first time, most of them fresh pages the
/// kernel zeroed.
fn minor_faults() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // After the command name, which may hold spaces, in parentheses.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7))
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

/// The CPU time this process (all its threads: the engine's included) has used so far, in
/// milliseconds: utime + stime from /proc/self/stat, in USER_HZ ticks (100 per second on Linux,
/// whatever the kernel's own rate), so 10 ms granular.
fn cpu_ms() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    let ticks: u64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|t| t.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    ticks * 10
}

fn median_of(mut counts: Vec<u64>) -> u64 {
    counts.sort_unstable();
    counts.get(counts.len() / 2).copied().unwrap_or(0)
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    layers: Vec<Linear<B>>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for (i, layer) in self.layers.iter().enumerate() {
            if i > 0 {
                x = self.act.forward(x);
            }
            x = layer.forward(x);
        }
        x
    }
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
        layers: args
            .dims
            .windows(2)
            .map(|d| LinearConfig::new(d[0], d[1]).init(&device))
            .collect(),
        act: Relu::new(),
    };
    let mut optim = SgdConfig::new().init();
    let x = Tensor::<Train, 2>::random(
        [args.batch, args.dims[0]],
        Distribution::Normal(0., 1.),
        &device,
    );
    let _layout = scope_sync_layout(match args.sync_layout {
        Layout::AsStored => SyncLayout::AsStored,
        Layout::Contiguous => SyncLayout::Contiguous,
    });
    let warmup = (args.steps / 10).max(2);
    let (mut steps, mut syncs) = (Vec::new(), Vec::new());
    let (mut step_faults, mut sync_faults, mut copies) = (Vec::new(), Vec::new(), Vec::new());
    let mut sync_cpus = Vec::new();
    for step in 0..warmup + args.steps {
        let (start, faults) = (Instant::now(), minor_faults());
        let loss = model.forward(x.clone()).powf_scalar(2.0).mean();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let (sync, faults_before_sync, copied, cpu) = (
            Instant::now(),
            minor_faults(),
            sync_copied_values(),
            cpu_ms(),
        );
        all_reduce_gradients::<Train, _>(&group, &model, &mut grads).expect("all-reduce");
        let synced = sync.elapsed();
        let (faults_in_sync, copied, sync_cpu) = (
            minor_faults() - faults_before_sync,
            sync_copied_values() - copied,
            cpu_ms() - cpu,
        );
        model = optim.step(1e-3, model, grads);
        if step >= warmup {
            steps.push(start.elapsed());
            syncs.push(synced);
            step_faults.push(minor_faults() - faults);
            sync_faults.push(faults_in_sync);
            copies.push(copied);
            sync_cpus.push(sync_cpu);
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
             sync_share={:.1}% flat_all_reduce_ms={:.3} step_minor_faults={} \
             sync_minor_faults={} sync_copied_values={} sync_cpu_ms={}",
            state.num_processes(),
            std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into()),
            model.num_params(),
            100.0 * sync / step,
            median(flat),
            median_of(step_faults),
            median_of(sync_faults),
            median_of(copies),
            median_of(sync_cpus),
        );
    }
}
