//! The golden cases of accelerate 1.16.0 (`tests/golden/`) run through the loader itself, end
//! to end: the batches its shards hand out are the ones accelerate's processes got.

use std::path::PathBuf;

use burn_accelerate::data::shard::ShardError;
use burn_accelerate::data::{DataLoaderConfig, DataLoaderError};
use serde_json::Value;

use crate::common::{builder, epoch};

fn cases(name: &str) -> Vec<Value> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "golden", name]
        .iter()
        .collect();
    let text = std::fs::read_to_string(&path).expect("golden file");
    let mut file: Value = serde_json::from_str(&text).expect("golden JSON");
    match file["cases"].take() {
        Value::Array(cases) => cases,
        _ => panic!("{name} has no cases"),
    }
}

fn num(case: &Value, key: &str) -> usize {
    case[key]
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .expect(key)
}

fn config(case: &Value, dispatch: bool) -> DataLoaderConfig {
    let flag = |key: &str, default: bool| case[key].as_bool().unwrap_or(default);
    DataLoaderConfig::new(num(case, "batch_size"))
        .with_split_batches(flag("split_batches", false))
        .with_even_batches(flag("even_batches", true))
        .with_drop_last(flag("drop_last", false))
        .with_dispatch_batches(dispatch)
}

/// Why the loader disagrees with `expected` (per-process batches, or an error), if it does.
fn check(case: &Value, dispatch: bool, expected: &Value, error: Option<&Value>) -> Option<String> {
    let np = num(case, "num_processes");
    let built = builder(config(case, dispatch), num(case, "dataset_len"))
        .build(&vec![Default::default(); np]);
    let refused = matches!(
        built,
        Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. }))
    );
    // An empty dataset with `split_batches` and batch size 1: the index functions yield
    // nothing there (the golden contract), but the loader refuses the configuration itself
    // at build time, whatever the data, as the README's contract for batch size 1 says.
    if refused && num(case, "dataset_len") == 0 && case["split_batches"] == true {
        return None;
    }
    match (built, error) {
        (Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. })), Some(_)) => None,
        (Err(e), _) => Some(format!("unexpected error {e}")),
        (Ok(_), Some(error)) => Some(format!("accelerate raised {error}; the loader did not")),
        (Ok(loaders), None) => {
            let got: Vec<Vec<Vec<usize>>> = loaders.iter().map(epoch).collect();
            (serde_json::json!(got) != *expected)
                .then(|| format!("got {}, expected {expected}", serde_json::json!(got)))
        }
    }
}

fn run(file: &str, dispatch: bool, expected_key: &str, error_key: &str) {
    let cases = cases(file);
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in &cases {
        let error = case.get(error_key);
        let expected = &case[expected_key];
        if error.is_none() && expected.is_null() {
            continue;
        }
        checked += 1;
        if let Some(why) = check(case, dispatch, expected, error) {
            failures.push(format!("{}: {why}", case["id"]));
        }
    }
    assert!(checked > 0, "{file}: nothing checked");
    assert!(
        failures.is_empty(),
        "{file} ({expected_key}): {} of {checked} cases differ, e.g.\n{}",
        failures.len(),
        failures[..failures.len().min(5)].join("\n")
    );
}

#[test]
fn batch_sampler_golden_cases_through_the_loader() {
    run("batch_sampler_shards.json", false, "per_process", "error");
}

#[test]
fn dispatch_golden_cases_through_the_loader() {
    run("dispatch_batches.json", true, "per_process", "error");
    run(
        "dispatch_batches.json",
        false,
        "non_dispatch_per_process",
        "non_dispatch_error",
    );
}
