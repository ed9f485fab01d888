//! Runs golden conformance cases through the crate's public API and prints one JSON result per
//! line, in the format `../shared/golden/check.py` reads:
//!
//!     cargo run --release --example conformance -- SUITE CASES.json > results.jsonl
//!     python3 ../shared/golden/check.py SUITE CASES.json results.jsonl

#[cfg(feature = "flex")]
mod fp8;
mod shards;

use std::io::{BufWriter, Write};
use std::process::ExitCode;

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
    let golden: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(err) => {
            eprintln!("{path} is not JSON: {err}");
            return ExitCode::from(2);
        }
    };
    let run: fn(&str, &serde_json::Value) -> serde_json::Value =
        if shards::SUITES.contains(&suite.as_str()) {
            shards::run_case
        } else if let Some(run) = fp8_suite(suite) {
            run
        } else {
            let mut known = shards::SUITES.to_vec();
            #[cfg(feature = "flex")]
            known.extend(fp8::SUITES);
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

// fp8 runs on the default backend, Flex: without it the suite is unknown.
fn fp8_suite(suite: &str) -> Option<fn(&str, &serde_json::Value) -> serde_json::Value> {
    #[cfg(feature = "flex")]
    if fp8::SUITES.contains(&suite) {
        return Some(fp8::run_case);
    }
    let _ = suite;
    None
}
