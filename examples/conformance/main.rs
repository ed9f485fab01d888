//! Runs golden conformance cases through the crate's public API and prints one JSON result per
//! line, in the format `../shared/golden/check.py` reads:
//!
//!     cargo run --release --example conformance -- SUITE CASES.json > results.jsonl
//!     python3 ../shared/golden/check.py SUITE CASES.json results.jsonl

#[cfg(any(feature = "flex", feature = "ndarray"))]
mod accumulation;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod case;
#[cfg(feature = "flex")]
mod fp8;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod scaler;
mod shards;

use std::io::{BufWriter, Write};
use std::process::ExitCode;

use serde_json::Value;

type Runner = fn(&str, &Value) -> Value;

/// Every suite module: the suites it answers and its runner. The tensor suites need a
/// backend feature: `flex` (the default) for fp8, `flex` or `ndarray` for the others.
const MODULES: &[(&[&str], Runner)] = &[
    (&shards::SUITES, shards::run_case),
    #[cfg(feature = "flex")]
    (&fp8::SUITES, fp8::run_case),
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    (&scaler::SUITES, scaler::run_case),
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    (&accumulation::SUITES, accumulation::run_case),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [suite, path] = args.as_slice() else {
        eprintln!("usage: conformance SUITE CASES.json");
        return ExitCode::from(2);
    };
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) => {
            eprintln!("cannot read {path}: {err}");
            return ExitCode::from(2);
        }
    };
    let golden: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(err) => {
            eprintln!("{path} is not JSON: {err}");
            return ExitCode::from(2);
        }
    };
    let Some(&(_, run)) = MODULES
        .iter()
        .find(|(suites, _)| suites.contains(&suite.as_str()))
    else {
        let known: Vec<&str> = MODULES
            .iter()
            .flat_map(|(s, _)| s.iter().copied())
            .collect();
        eprintln!("unknown suite {suite:?}; known: {}", known.join(", "));
        return ExitCode::from(2);
    };
    let mut out = BufWriter::new(std::io::stdout().lock());
    for case in golden["cases"].as_array().into_iter().flatten() {
        if writeln!(out, "{}", run(suite, case)).is_err() {
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
