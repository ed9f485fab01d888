//! Conformance of the loss scaler with torch 2.9's `GradScaler` (`tests/golden/grad_scaler.json`).
//!
//! Every case runs through the conformance example's own runner
//! (`examples/conformance/scaler.rs`: real tensors, the `Accelerator`'s scale, unscale, check,
//! step and update) and is compared the way `check.py` compares it: scales bit for bit as
//! f32, growth trackers and skipped steps exactly.
#![cfg(any(feature = "flex", feature = "ndarray"))]

#[allow(dead_code)]
#[path = "../examples/conformance/scaler.rs"]
mod scaler;

use serde_json::Value;

fn load(name: &str) -> Vec<Value> {
    let path = format!("{}/tests/golden/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let mut file: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    match file.get_mut("cases").map(Value::take) {
        Some(Value::Array(cases)) => cases,
        _ => panic!("{path} has no `cases` array"),
    }
}

/// A golden number (or "inf"/"-inf"/"nan") as f32, the way `check.py` compares scales.
fn as_f32(value: &Value) -> Option<f32> {
    match value {
        Value::Number(n) => n.as_f64().map(|v| v as f32),
        Value::String(s) => s.parse::<f64>().ok().map(|v| v as f32),
        _ => None,
    }
}

fn same_f32(got: &Value, want: &Value) -> bool {
    match (as_f32(got), as_f32(want)) {
        (Some(g), Some(w)) => (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits(),
        _ => false,
    }
}

/// `check.py`'s `check_scaler`.
fn check(want: &Value, got: &Value) -> Option<String> {
    for key in ["step_skipped", "growth_tracker_after"] {
        if got[key] != want[key] {
            return Some(format!("{key}: got {}, expected {}", got[key], want[key]));
        }
    }
    let (g, w) = (&got["scale_after"], &want["scale_after"]);
    let (Some(g_list), Some(w_list)) = (g.as_array(), w.as_array()) else {
        return Some(format!("scale_after: got {g}, expected {w}"));
    };
    if g_list.len() != w_list.len() || !g_list.iter().zip(w_list).all(|(a, b)| same_f32(a, b)) {
        return Some(format!("scale_after: got {g}, expected {w}"));
    }
    let (fs, es) = (&got["final_state"], &want["final_state"]);
    if es.as_object().is_some_and(|o| !o.is_empty())
        && (!same_f32(&fs["scale"], &es["scale"]) || fs["growth_tracker"] != es["_growth_tracker"])
    {
        return Some(format!("final_state: got {fs}, expected {es}"));
    }
    None
}

#[test]
fn grad_scaler_matches_torch() {
    let cases = load("grad_scaler.json");
    assert_eq!(cases.len(), 32);
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            let got = scaler::run_case("grad_scaler", case);
            check(case, &got).map(|why| format!("{}: {why}", case["id"]))
        })
        .collect();
    for failure in failures.iter().take(10) {
        eprintln!("FAIL {failure}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} grad_scaler cases failed",
        failures.len(),
        cases.len()
    );
}
