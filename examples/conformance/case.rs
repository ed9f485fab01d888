//! Reading a golden case's inputs. A missing or mistyped field is a bug in the golden file or
//! the runner, so it panics with the case's id.

use serde_json::Value;

pub fn number(case: &Value, key: &str) -> f64 {
    case[key]
        .as_f64()
        .unwrap_or_else(|| panic!("case {} has no number `{key}`", case["id"]))
}

pub fn count(case: &Value, key: &str) -> usize {
    case[key]
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or_else(|| panic!("case {} has no non-negative integer `{key}`", case["id"]))
}

pub fn flag(case: &Value, key: &str) -> bool {
    case[key]
        .as_bool()
        .unwrap_or_else(|| panic!("case {} has no boolean `{key}`", case["id"]))
}
