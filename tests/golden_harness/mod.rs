//! Runs every case of a golden suite and fails with the first few differences.

use serde_json::Value;

/// The `cases` of `tests/golden/<suite>.json`.
pub fn load(suite: &str) -> Vec<Value> {
    let path = format!("{}/tests/golden/{suite}.json", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let mut file: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    match file.get_mut("cases").map(Value::take) {
        Some(Value::Array(cases)) => cases,
        _ => panic!("{path} has no `cases` array"),
    }
}

/// Runs each of the suite's `expected_count` cases through `run` and compares it with `check`
/// (which returns why a result differs), asserting that every case agrees.
pub fn assert_every_case(
    suite: &str,
    expected_count: usize,
    run: fn(&str, &Value) -> Value,
    check: fn(&Value, &Value) -> Option<String>,
) {
    let cases = load(suite);
    assert_eq!(
        cases.len(),
        expected_count,
        "{suite}: the golden file changed"
    );
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| {
            check(case, &run(suite, case)).map(|why| format!("{}: {why}", case["id"]))
        })
        .collect();
    for failure in failures.iter().take(10) {
        eprintln!("FAIL {failure}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} {suite} cases failed",
        failures.len(),
        cases.len()
    );
}
