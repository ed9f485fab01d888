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

/// What a loader built from a case hands out, in the golden file's shape (`per_process[p]`
/// is process p's batches, or its items for the iterable suite).
pub type Epochs = Result<Value, DataLoaderError>;

/// Why the loader disagrees with `expected` (per-process batches, or an error), if it does.
fn check(
    case: &Value,
    dispatch: bool,
    expected: &Value,
    error: Option<&Value>,
    load: &impl Fn(DataLoaderConfig, usize, usize) -> Epochs,
) -> Option<String> {
    let np = num(case, "num_processes");
    let built = load(config(case, dispatch), num(case, "dataset_len"), np);
    let refused = matches!(
        built,
        Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. }))
    );
    // `split_batches` with batch size 1: where accelerate yields nothing (an empty dataset,
    // or its iterable shard, which hands every process empty slices), the loader refuses the
    // configuration itself at build time, whatever the data, as the README's contract for
    // batch size 1 says.
    let yields_nothing = expected.as_array().is_some_and(|per_process| {
        per_process
            .iter()
            .all(|p| p.as_array().is_some_and(Vec::is_empty))
    });
    if refused && case["split_batches"] == true && num(case, "batch_size") == 1 && yields_nothing {
        return None;
    }
    match (built, error) {
        (Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. })), Some(_)) => None,
        (Err(e), _) => Some(format!("unexpected error {e}")),
        (Ok(_), Some(error)) => Some(format!("accelerate raised {error}; the loader did not")),
        (Ok(got), None) => (got != *expected).then(|| format!("got {got}, expected {expected}")),
    }
}

/// Runs every case of `file` through `load` and asserts that all agree with accelerate.
pub fn run_with(
    file: &str,
    dispatch: bool,
    expected_key: &str,
    error_key: &str,
    load: impl Fn(DataLoaderConfig, usize, usize) -> Epochs,
) {
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
        if let Some(why) = check(case, dispatch, expected, error, &load) {
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

fn run(file: &str, dispatch: bool, expected_key: &str, error_key: &str) {
    run_with(file, dispatch, expected_key, error_key, |config, n, np| {
        let loaders = builder(config, n).build(&vec![Default::default(); np])?;
        Ok(serde_json::json!(
            loaders.iter().map(epoch).collect::<Vec<_>>()
        ))
    });
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
