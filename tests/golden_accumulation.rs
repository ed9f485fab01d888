//! Conformance of gradient accumulation with accelerate 1.16
//! (`tests/golden/accumulation.json`).
//!
//! Every case runs through the conformance example's own runner
//! (`examples/conformance/accumulation.rs`: the same tiny model, SGD and LambdaLR driven
//! through `GradientState` and the `Accelerator`) and is compared the way `check.py` compares
//! it: flags exactly, numbers within its tolerances.
#![cfg(any(feature = "flex", feature = "ndarray"))]

#[allow(dead_code)]
#[path = "../examples/conformance/accumulation.rs"]
mod accumulation;

#[allow(dead_code)] // the accumulation runner reads no plain numbers
#[path = "../examples/conformance/case.rs"]
mod case;

mod golden_harness;

use serde_json::Value;

/// `check.py`'s `close`: relative to `max(1, |want|)`, NaN only equal to NaN.
fn close(got: &Value, want: &Value, tol: f64) -> bool {
    match (got.as_f64(), want.as_f64()) {
        (Some(g), Some(w)) => (g - w).abs() <= tol * w.abs().max(1.0),
        _ => got.is_null() && want.is_null(),
    }
}

const EXACT: [&str; 3] = ["sync_gradients", "end_of_dataloader", "optimizer_stepped"];
const CLOSE: [(&str, f64); 4] = [
    ("observed_loss_divisor", 1e-6),
    ("weight_after", 1e-5),
    ("bias_after", 1e-5),
    ("lr_after", 1e-9),
];

/// `check.py`'s `check_accumulation`.
fn check(want: &Value, got: &Value) -> Option<String> {
    let (Some(g), Some(w)) = (got["batches"].as_array(), want["batches"].as_array()) else {
        return Some(format!("no batches in {got}"));
    };
    if g.len() != w.len() {
        return Some(format!("batches: got {}, expected {}", g.len(), w.len()));
    }
    for (i, (g, w)) in g.iter().zip(w).enumerate() {
        for key in EXACT {
            if g[key] != w[key] {
                return Some(format!(
                    "batch {i}: {key} got {}, expected {}",
                    g[key], w[key]
                ));
            }
        }
        for (key, tol) in CLOSE {
            if !close(&g[key], &w[key], tol) {
                return Some(format!(
                    "batch {i}: {key} got {}, expected {}",
                    g[key], w[key]
                ));
            }
        }
    }
    None
}

#[test]
fn accumulation_matches_accelerate() {
    golden_harness::assert_every_case("accumulation", 335, accumulation::run_case, check);
}
