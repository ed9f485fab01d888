//! What sharded training saves: a few Adam steps of an MLP of about `--params` parameters
//! through the `Accelerator` at a ZeRO stage, under the launcher; the main process prints the
//! largest peak resident memory over the processes.
//!
//! ```text
//! cargo build --release --example zero_memory --bin burn-accelerate
//! target/release/burn-accelerate launch --num-processes 4 -- \
//!     target/release/examples/zero_memory --params 100000000 --zero-stage 2
//! ```
//!
//! Printed: `zero_stage=S processes=P params=N peak_rss_mib=M rest_rss_mib=R step_s=T
//! sent_mib_per_step=X sent_per_param_byte=F final_loss=L`, where `rest_rss_mib` is the
//! largest resident memory over the processes right after the last step (between steps: what
//! a process keeps of the training state), `step_s` the slowest process's mean step time
//! (forward, backward, optimizer step) over the steps after the first, and
//! `sent_mib_per_step` the bytes a process sent per step over the built-in engine's ring
//! (`zero::sent_bytes`, the mean over the processes and those steps), also per byte of f32
//! parameters (`sent_per_param_byte`: about `2 (n - 1) / n` for stages 0 to 2, `3 (n - 1) / n`
//! at stage 3). With
//! `--checkpoint DIR`, the `Accelerator` then saves a checkpoint into `DIR`
//! (`save_checkpoint`): consolidated (the whole optimizer state gathered on the main process,
//! and at stage 3 the model, every process sending its slice of each parameter to it alone),
//! or with `--sharded-checkpoint` each process's partition in files of its own. A second line says
//! what that cost: `checkpoint_s=T main_peak_rss_mib=M main_save_peak_rss_mib=S
//! others_save_peak_rss_mib=O` (the main process's peak over the whole run; the main
//! process's and the other processes' largest peaks during the save alone).
//!
//! `--precision bf16` (or `f16`, with the loss scaler) trains under autocast, every layer
//! cast (`SmallOps::Cast`); at stage 3 each layer is then gathered in the half type (FSDP's
//! `param_dtype`: `sent_per_param_byte` about `2 (n - 1) / n`).
//!
//! The model trains on `Accelerated<Autodiff<Flex>>` (f32, autocast off, by default) at every
//! stage. At stage 3 each process holds a 1/N slice of every parameter (FSDP's flat slice); a
//! layer's weight and bias are gathered from the slices for its forward op and again for its
//! input gradient's, and dropped after each (`burn_accelerate::zero::release_parameters`):
//! besides its slices, a process holds one layer's parameters at a time. Each gradient is
//! reduce-scattered as soon as the backward pass has computed it: every process keeps its
//! slice's mean, and the optimizer steps the slices.

#[path = "common/memory.rs"]
mod memory;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::checkpoint::CheckpointDir;
use burn_accelerate::zero::{self, CheckpointLayout, ZeroStage};
use burn_accelerate::{AccelerateConfig, Accelerated, Accelerator, Precision};
use clap::Parser;
use memory::{peak_memory_mib, reset_peak_memory};
use std::time::Instant;

type Train = Accelerated<Autodiff<Flex>>;

/// A few Adam steps of an MLP at a ZeRO stage, with the peak memory of every process.
#[derive(Parser)]
struct Args {
    /// About how many parameters: square layers of width 2048 (4.2M parameters each), as many
    /// as it takes.
    #[arg(long, default_value_t = 20_000_000)]
    params: usize,
    /// The ZeRO stage: 0 (data parallel), 1 (optimizer state sharded), 2 (and gradients), 3
    /// (and parameters, between steps).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero_stage: u8,
    /// Optimizer steps.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Samples per process and step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// After the steps, save a checkpoint into this directory (consolidated: the model and
    /// the whole optimizer state, gathered on the main process).
    #[arg(long)]
    checkpoint: Option<std::path::PathBuf>,
    /// Save the checkpoint sharded (`CheckpointLayout::Sharded`): each process its own
    /// partition's parameters and optimizer state.
    #[arg(long)]
    sharded_checkpoint: bool,
    /// Autocast precision: f32 (no autocast), bf16 or f16 (with the loss scaler).
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    precision: Precision,
}

fn parse_precision(value: &str) -> Result<Precision, String> {
    value
        .parse()
        .map_err(|e: burn_accelerate::UnknownPrecision| e.to_string())
}

const WIDTH: usize = 2048;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    layers: Vec<Linear<B>>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = self.act.forward(layer.forward(x));
        }
        x
    }
}

fn main() {
    let args = Args::parse();
    let stage = ZeroStage::from_number(args.zero_stage).expect("checked by clap");
    let device = Default::default();
    let mut accelerator: Accelerator<Train> = AccelerateConfig::new()
        .with_zero_stage(stage)
        .with_checkpoint_layout(if args.sharded_checkpoint {
            CheckpointLayout::Sharded
        } else {
            CheckpointLayout::Consolidated
        })
        .with_mixed_precision(args.precision)
        // Every layer in the half type under autocast: none kept in f32 as too small.
        .with_small_ops(Some(SmallOps::Cast))
        .init(&device)
        .expect("an accelerator");
    Train::seed(&device, 5);
    let layers = (args.params / (WIDTH * WIDTH + WIDTH)).max(1);
    let model = Mlp::<Train> {
        layers: (0..layers)
            .map(|_| LinearConfig::new(WIDTH, WIDTH).init(&device))
            .collect(),
        act: Relu::new(),
    };
    // At stage 3, each process keeps its own partition from here on: the layers, not yet
    // initialised (Burn's lazy parameters), are initialised one at a time and dropped by the
    // processes that do not own them.
    let mut model = accelerator.prepare_model(model);
    // Counted on every process: a released parameter's shape is known without a gather.
    let params = model.num_params();
    let mut optim = AdamConfig::new().init();
    let x = Tensor::<Train, 2>::random([args.batch, WIDTH], Distribution::Normal(0., 1.), &device);
    let mut loss_value = 0.0;
    // Per step: its time on this process, and the bytes this process sent.
    let (mut times, mut sent) = (Vec::new(), Vec::new());
    for _ in 0..args.steps {
        let (start, sent_before) = (Instant::now(), zero::sent_bytes());
        let loss = {
            let _autocast = accelerator.autocast();
            model.forward(x.clone()).powf_scalar(2.0).mean()
        };
        loss_value = loss.clone().into_scalar();
        accelerator.backward(loss, &model);
        let (next, _) = accelerator
            .optimizer_step(&mut optim, model, &mut 1e-4)
            .expect("a step");
        model = next;
        times.push(start.elapsed().as_secs_f64());
        sent.push((zero::sent_bytes() - sent_before) as f64);
    }
    // The steps after the first: at stage 3 the first step runs before any parameter is
    // released (the model is built whole), as at stage 2.
    let later = |v: &[f64]| {
        let later = &v[1.min(v.len() - 1)..];
        later.iter().sum::<f64>() / later.len() as f64
    };
    let (step_s, sent_per_step) = (later(&times), later(&sent));
    let process = accelerator.process().clone();
    let (peak, rest) = (peak_memory_mib(), resident_memory_mib());
    let [peaks, rests, step_times, sents]: [Vec<f64>; 4] = match process.group() {
        Ok(group) => [peak, rest, step_s, sent_per_step]
            .map(|value| group.all_gather(&[value]).expect("all-gather")),
        Err(_) => [peak, rest, step_s, sent_per_step].map(|value| vec![value]),
    };
    if process.is_main_process() {
        let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "precision={:?} zero_stage={} processes={} params={} peak_rss_mib={:.0} rest_rss_mib={:.0} \
             step_s={:.3} sent_mib_per_step={:.1} sent_per_param_byte={:.3} \
             final_loss={loss_value}",
            args.precision,
            args.zero_stage,
            process.num_processes(),
            params,
            max(&peaks),
            max(&rests),
            max(&step_times),
            mean(&sents) / (1024.0 * 1024.0),
            mean(&sents) / (params * 4) as f64,
        );
    }
    if let Some(dir) = &args.checkpoint {
        let run_peak = peak_memory_mib();
        // The save's own peak, from what each process holds now.
        reset_peak_memory();
        let start = Instant::now();
        accelerator
            .save_checkpoint(&CheckpointDir::new(dir), 1, &model, &optim)
            .expect("the checkpoint saved");
        let seconds = start.elapsed().as_secs_f64();
        let save_peak = peak_memory_mib();
        let save_peaks = match process.group() {
            Ok(group) => group.all_gather(&[save_peak]).expect("all-gather"),
            Err(_) => vec![save_peak],
        };
        if process.is_main_process() {
            println!(
                "checkpoint_s={seconds:.2} main_peak_rss_mib={:.0} main_save_peak_rss_mib={:.0} \
                 others_save_peak_rss_mib={:.0}",
                run_peak.max(save_peak),
                save_peak,
                save_peaks[1..].iter().copied().fold(0.0, f64::max),
            );
        }
    }
}

// This process's resident memory now, in MiB (Linux's `VmRSS`; 0 elsewhere).
fn resident_memory_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}
