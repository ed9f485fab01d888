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

#[path = "../examples/conformance/case.rs"]
mod case;

mod golden_harness;

use serde_json::Value;

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
    golden_harness::assert_every_case("grad_scaler", 32, scaler::run_case, check);
}
