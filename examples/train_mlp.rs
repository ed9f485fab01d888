//! Trains an MLP classifier through Burn's `SupervisedTraining` + `with_accelerate`, on
//! Gaussian blobs this crate makes (nothing is downloaded).
//!
//! ```text
//! cargo run --example train_mlp -- --precision bf16 --grad-accum 2 --epochs 8 --seed 42
//! ```
//!
//! Flags: `--precision f32|bf16|f16|fp8`, `--grad-accum K`, `--epochs N`, `--seed S`,
//! `--backend flex|ndarray` (those compiled in; flex by default). The last line printed is
//! `final loss=<f> accuracy=<f> skipped_steps=<n> precision=<p>`, where `precision` is the one
//! the ops really ran in (f32 after a fallback, which is also reported on stderr).

use std::process::ExitCode;

use burn::backend::Autodiff;
use burn_accelerate::Accelerated;
use burn_accelerate::train::demo::{self, DemoConfig, DemoOutcome};

const USAGE: &str = "usage: train_mlp [--precision f32|bf16|f16|fp8] [--grad-accum K] \
                     [--epochs N] [--seed S] [--backend flex|ndarray]";

fn parse() -> Result<(DemoConfig, String), String> {
    let mut config = DemoConfig::new();
    let mut backend = String::from("flex");
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}\n{USAGE}");
        match flag.as_str() {
            "--precision" => config.precision = value.parse().map_err(|e| bad(&e))?,
            "--grad-accum" => config.grad_accum = value.parse().map_err(|e| bad(&e))?,
            "--epochs" => config.epochs = value.parse().map_err(|e| bad(&e))?,
            "--seed" => config.seed = value.parse().map_err(|e| bad(&e))?,
            "--backend" => backend = value,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    Ok((config, backend))
}

fn train(config: &DemoConfig, backend: &str) -> Result<DemoOutcome, String> {
    let outcome = match backend {
        "flex" => {
            demo::run::<Accelerated<Autodiff<burn::backend::Flex>>>(config, &Default::default())
        }
        #[cfg(feature = "ndarray")]
        "ndarray" => {
            demo::run::<Accelerated<Autodiff<burn::backend::NdArray>>>(config, &Default::default())
        }
        other => {
            return Err(format!(
                "backend {other} is not compiled in (enable its cargo feature)\n{USAGE}"
            ));
        }
    };
    outcome.map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let result = parse().and_then(|(config, backend)| {
        let outcome = train(&config, &backend)?;
        if outcome.stats.fell_back {
            eprintln!(
                "{backend} cannot run {}: trained in {} instead",
                demo::flag_name(outcome.stats.requested),
                demo::flag_name(outcome.stats.precision)
            );
        }
        for epoch in &outcome.stats.epochs {
            println!(
                "epoch {}: batches={} optimizer_steps={} skipped_steps={}",
                epoch.epoch, epoch.batches, epoch.optimizer_steps, epoch.skipped_steps
            );
        }
        Ok(outcome)
    });
    match result {
        Ok(outcome) => {
            println!("{}", outcome.summary_line());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}
