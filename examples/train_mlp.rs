//! Trains an MLP classifier through Burn's `SupervisedTraining` + `with_accelerate`, on
//! Gaussian blobs this crate makes (nothing is downloaded).
//!
//! ```text
//! cargo run --release --example train_mlp -- --precision bf16 --hidden 512 --grad-accum 2 --epochs 8 --seed 42
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --batch-size 32
//! burn-accelerate launch --num-processes 4 -- target/release/examples/train_mlp --zero-stage 2
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --pin-threads
//! burn-accelerate launch --num-processes 2 --max-restarts 1 -- \
//!     target/release/examples/train_mlp --checkpoint-dir /tmp/mlp-checkpoints
//! ```
//!
//! With `--checkpoint-dir DIR` every epoch ends with a crash-safe checkpoint in `DIR`, and a
//! run started again (by the launcher's `--max-restarts`, or by hand) resumes from the newest
//! complete one, redoing the steps after it, and ends with the loss an uninterrupted run ends
//! with; it then prints `resumed from the checkpoint of epoch <n>` first. For tests only,
//! `BURN_ACCELERATE_TEST_FAIL_AT` makes a process fail at a given step of a given attempt, and
//! `BURN_ACCELERATE_TEST_CRASH_WRITING` kills the main process in the middle of writing a
//! checkpoint (`examples/common/mlp.rs`, `burn_accelerate::checkpoint`).
//!
//! The last line printed (by the main process only, under the launcher) is
//! `final loss=<f> accuracy=<f> skipped_steps=<n> precision=<p> half_ops=<n>/<all> …`, where
//! `precision` is the one the ops really ran in (f32 after a fallback, which is also reported on
//! stderr), and the rest says how many of the linears ran in it and how many autocast kept in
//! f32 as too small to gain from it: at the default width (64) all of them, which the line
//! then says; at `--hidden 512` the hidden layer runs in the half type. It ends with
//! `valid_precision=<p>`: validation runs in the training's precision, as Accelerate's prepared
//! model evaluates under autocast. Each epoch's line says how many validation batches this
//! process evaluated of all processes' (`valid_batches=<own>/<all>`: under the launcher every
//! process validates its own) and the validation phase's wall time (`valid_s`).

#[path = "common/mlp.rs"]
mod mlp;

use std::process::ExitCode;

use burn::backend::Autodiff;
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::threads::StepThreadsConfig;
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{Accelerated, Precision};
use clap::{Parser, ValueEnum};
use mlp::{DemoConfig, DemoOutcome};

/// Train an MLP classifier with Burn's SupervisedTraining and `with_accelerate`.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Autocast precision: f32 (no autocast), bf16, f16 (with dynamic loss scaling) or fp8.
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    precision: Precision,
    /// Batches whose gradients are summed before each optimizer step.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    grad_accum: u32,
    /// Epochs to train.
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Seeds the model's initialisation and the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Width of the two hidden layers. From 256 on, at the default batch, the hidden layer's
    /// product is large enough (2·64·256² = 8.4 MFLOP is not; 2·64·512² = 33.5 is) for
    /// autocast to run it in the half type; smaller ones stay in f32, as the last line says.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    hidden: u32,
    /// Samples per batch on each process (a step over N processes sees N times as many).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,
    /// The backend (among those compiled in).
    #[arg(long, value_enum, default_value_t = BackendName::Flex)]
    backend: BackendName,
    /// Shards the training state across processes as DeepSpeed's ZeRO stage does: 0 data
    /// parallel, 1 the optimizer state, 2 also the gradients, 3 also the parameters (FSDP's
    /// `FULL_SHARD`: each process keeps a flat slice of every parameter).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero_stage: u8,
    /// Pin each CPU thread to a core of its own (Linux; under the launcher, the processes on
    /// a machine split its cores): for a machine the run has to itself.
    #[arg(long)]
    pin_threads: bool,
    /// Checkpoint every epoch into DIR (crash-safe: written aside, renamed, listed with
    /// checksums) and, when started again, resume from the newest complete checkpoint there.
    /// Give every process the same directory.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Training samples.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    train_items: u32,
    /// Validation samples (every process validates its own batches of them each epoch).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    valid_items: u32,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendName {
    Flex,
    Ndarray,
}

fn parse_precision(value: &str) -> Result<Precision, String> {
    value
        .parse()
        .map_err(|e: burn_accelerate::UnknownPrecision| e.to_string())
}

fn train(config: &DemoConfig, backend: BackendName) -> Result<DemoOutcome, String> {
    let outcome = match backend {
        BackendName::Flex => {
            mlp::run::<Accelerated<Autodiff<burn::backend::Flex>>>(config, &Default::default())
        }
        #[cfg(feature = "ndarray")]
        BackendName::Ndarray => {
            mlp::run::<Accelerated<Autodiff<burn::backend::NdArray>>>(config, &Default::default())
        }
        #[cfg(not(feature = "ndarray"))]
        BackendName::Ndarray => {
            return Err(
                "backend ndarray is not compiled in: build with `--features ndarray`".into(),
            );
        }
    };
    outcome.map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    // This thread, which runs the training steps, computes its share of every parallel CPU
    // op instead of handing it to rayon's threads and sleeping (`burn_accelerate::threads`):
    // first thing, before an op builds rayon's pool.
    let pool = StepThreadsConfig::new()
        .with_pin(args.pin_threads)
        .install();
    match pool {
        Ok(pool) => {
            if let Some(cpus) = pool.cpus() {
                eprintln!("{} CPU threads pinned to CPUs {cpus:?}", pool.count());
            }
        }
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::FAILURE;
        }
    }
    let config = DemoConfig::new()
        .with_precision(args.precision)
        .with_grad_accum(args.grad_accum as usize)
        .with_epochs(args.epochs)
        .with_seed(args.seed)
        .with_batch_size(args.batch_size as usize)
        .with_hidden(args.hidden as usize)
        .with_train_items(args.train_items as usize)
        .with_valid_items(args.valid_items as usize)
        .with_zero_stage(ZeroStage::from_number(args.zero_stage).expect("0 to 3 by clap"))
        .with_checkpoint_dir(
            args.checkpoint_dir
                .as_ref()
                .map(|dir| dir.to_string_lossy().into_owned()),
        );
    let main_process = match ProcessState::from_env() {
        Ok(state) => state.is_main_process(),
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::FAILURE;
        }
    };
    match train(&config, args.backend) {
        Ok(outcome) if main_process => {
            if outcome.stats.fell_back {
                eprintln!(
                    "{:?} cannot run {}: trained in {} instead",
                    args.backend,
                    outcome.stats.requested.short_name(),
                    outcome.stats.precision.short_name()
                );
            }
            if let Some(epoch) = outcome.stats.resumed_from {
                println!("resumed from the checkpoint of epoch {epoch}");
            }
            for (i, epoch) in outcome.stats.epochs.iter().enumerate() {
                // None for an epoch an interrupt ended before its validation.
                let valid_seconds = outcome
                    .valid_seconds
                    .get(i)
                    .map_or_else(|| "-".into(), |s| format!("{s:.3}"));
                println!(
                    "epoch {}: batches={} optimizer_steps={} skipped_steps={} \
                     valid_batches={}/{} valid_s={}",
                    epoch.epoch,
                    epoch.batches,
                    epoch.optimizer_steps,
                    epoch.skipped_steps,
                    epoch.valid_batches,
                    epoch.valid_batches_combined,
                    valid_seconds,
                );
            }
            println!("{}", outcome.summary_line());
            ExitCode::SUCCESS
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}
