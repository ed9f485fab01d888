//! Trains a GPT-style byte-level language model (Burn's own `TransformerEncoder`, pre-norm,
//! causal) through Burn's `SupervisedTraining` + `with_accelerate`, on text this crate ships
//! (its README, BENCHMARKS and a few sources: nothing is downloaded) or on `--text PATH`.
//!
//! ```text
//! cargo run --release --example train_lm -- --precision bf16
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_lm --precision bf16
//! python benches/accelerate_lm.py --precision bf16     # the same run in PyTorch + Accelerate
//! ```
//!
//! Progress goes to stderr every 10 steps. The main process prints `initial loss=<f>`, then as
//! its last line `final steps=… step_ms=… tokens_per_s=… train_loss=… valid_loss=…
//! peak_rss_mib=… precision=… processes=… skipped_steps=… half_ops=…/… half_flops=…% …`:
//! the median step, the throughput, the losses, the peak memory of the largest process, and
//! how many of the lower-class ops (and of their flops) autocast ran in half precision.

#[path = "common/lm.rs"]
mod lm;

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::{Autodiff, Flex};
use burn_accelerate::distributed::ProcessState;
use burn_accelerate::zero::ZeroStage;
use burn_accelerate::{Accelerated, Precision};
use clap::Parser;
use lm::LmConfig;

/// The text trained on by default: files of this crate, in this order (the twin,
/// `benches/accelerate_lm.py`, reads the same ones).
const DEFAULT_TEXT: [&[u8]; 6] = [
    include_bytes!("../README.md"),
    include_bytes!("../BENCHMARKS.md"),
    include_bytes!("../src/train/mod.rs"),
    include_bytes!("../src/accelerator.rs"),
    include_bytes!("../src/scaler.rs"),
    include_bytes!("../src/data/shard.rs"),
];

/// Train a byte-level transformer language model with Burn's SupervisedTraining and
/// `with_accelerate`.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Autocast precision: f32 (no autocast), bf16, f16 (with dynamic loss scaling) or fp8.
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    precision: Precision,
    /// Optimizer steps (per epoch): the training windows are cut to as many as they take.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Epochs.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Sequences per batch on each process.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens (bytes) per sequence.
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    /// Width of the model.
    #[arg(long, default_value_t = 384)]
    d_model: usize,
    /// Transformer layers.
    #[arg(long, default_value_t = 6)]
    layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// Width of the feed-forward layers.
    #[arg(long, default_value_t = 1536)]
    d_ff: usize,
    /// Dropout probability.
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
    /// Adam's learning rate after the warm-up.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Optimizer steps of linear learning-rate warm-up.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Seeds the initialisation, dropout and the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Batches whose gradients are summed before each optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Shards the training state across processes as DeepSpeed's ZeRO stage does: 0 data
    /// parallel, 1 the optimizer state, 2 also the gradients, 3 also the parameters (FSDP's
    /// `FULL_SHARD`: each process keeps a flat slice of every parameter).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero_stage: u8,
    /// A text file to train on instead of the crate's own files.
    #[arg(long)]
    text: Option<PathBuf>,
}

fn parse_precision(value: &str) -> Result<Precision, String> {
    value
        .parse()
        .map_err(|e: burn_accelerate::UnknownPrecision| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let text = match &args.text {
        Some(path) => match std::fs::read(path) {
            Ok(text) => text,
            Err(err) => {
                eprintln!("cannot read --text {}: {err}", path.display());
                return ExitCode::FAILURE;
            }
        },
        None => DEFAULT_TEXT.concat(),
    };
    let config = LmConfig::new()
        .with_precision(args.precision)
        .with_steps(Some(args.steps))
        .with_epochs(args.epochs)
        .with_batch_size(args.batch_size)
        .with_seq_len(args.seq_len)
        .with_d_model(args.d_model)
        .with_layers(args.layers)
        .with_heads(args.heads)
        .with_d_ff(args.d_ff)
        .with_dropout(args.dropout)
        .with_lr(args.lr)
        .with_warmup(args.warmup)
        .with_seed(args.seed)
        .with_grad_accum(args.grad_accum)
        .with_zero_stage(ZeroStage::from_number(args.zero_stage).expect("0 to 3 by clap"));
    let main_process = match ProcessState::from_env() {
        Ok(state) => state.is_main_process(),
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::FAILURE;
        }
    };
    match lm::run::<Accelerated<Autodiff<Flex>>>(&config, &text, &Default::default()) {
        Ok(outcome) if main_process => {
            if outcome.stats.fell_back {
                eprintln!(
                    "Flex cannot run {}: trained in {} instead",
                    outcome.stats.requested.short_name(),
                    outcome.stats.precision.short_name()
                );
            }
            println!(
                "model parameters={} text_bytes={}",
                outcome.parameters,
                text.len()
            );
            println!("initial loss={:.6}", outcome.initial_loss);
            println!("{}", outcome.summary_line());
            ExitCode::SUCCESS
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("{err}");
            ExitCode::FAILURE
        }
    }
}
