//! Conformance of `burn_accelerate::data::shard` with accelerate 1.16.0.
//!
//! The golden files in `tests/golden/` were produced by running accelerate's
//! `BatchSamplerShard`, `IterableDatasetShard` and `DataLoaderDispatcher` for real (see
//! `tests/golden/README.md`). Every case must agree exactly: the same batches on every
//! process, a reported length equal to what is yielded, and an error wherever the golden case
//! has one. Cases marked `contract_note` already hold the crate's contract, not accelerate's
//! defect.

use std::path::PathBuf;

use burn_accelerate::data::shard::{
    ShardError, ShardOptions, ShardPlan, ShardSpec, Sharding, batch_sampler_shard,
    dispatch_batches, iterable_dataset_shard, iterable_item, iterable_shard_len, num_batches,
};
use serde_json::Value;

/// Failures printed before the test fails; the rest are only counted.
const SHOWN_FAILURES: usize = 10;

fn load(name: &str) -> Vec<Value> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "golden", name]
        .iter()
        .collect();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read golden file {}: {e}", path.display()));
    let mut file: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("golden file {} is not JSON: {e}", path.display()));
    match file.get_mut("cases").map(Value::take) {
        Some(Value::Array(cases)) => cases,
        _ => panic!("golden file {} has no `cases` array", path.display()),
    }
}

fn field_usize(case: &Value, key: &str) -> usize {
    case[key]
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or_else(|| panic!("case {} has no non-negative integer `{key}`", case["id"]))
}

/// Accelerate's iterable shard has no `even_batches`; absent flags take accelerate's defaults.
fn options(case: &Value) -> ShardOptions {
    let flag = |key: &str, default: bool| case[key].as_bool().unwrap_or(default);
    ShardOptions {
        num_processes: field_usize(case, "num_processes"),
        process_index: 0,
        batch_size: field_usize(case, "batch_size"),
        split_batches: flag("split_batches", false),
        even_batches: flag("even_batches", true),
        drop_last: flag("drop_last", false),
    }
}

fn expected_batches(value: &Value) -> Option<Vec<Vec<Vec<usize>>>> {
    serde_json::from_value(value.clone()).ok()
}

/// What one process yields in a suite, with the length the API reports for it.
struct Shard {
    batches: Vec<Vec<usize>>,
    reported_len: usize,
}

/// Runs one process of a case. Accelerate's batch sampler checks `split_batches` strictly;
/// its iterable shard and dispatcher only check batch sizes above 1, hence the lenient spec.
fn run_process(
    suite: &str,
    dataset_len: usize,
    options: ShardOptions,
) -> Result<Shard, ShardError> {
    match suite {
        "batch_sampler_shards" => {
            let spec = ShardSpec::new(options)?;
            let batches = batch_sampler_shard(dataset_len, &spec)?;
            let reported_len = num_batches(dataset_len, &spec, Sharding::BatchSampler)?;
            check_streaming(dataset_len, &spec, Sharding::BatchSampler, &batches);
            Ok(Shard {
                batches,
                reported_len,
            })
        }
        "iterable_dataset_shards" => {
            let spec = ShardSpec::new_lenient(options)?;
            let items = iterable_dataset_shard(dataset_len, &spec);
            let streamed: Vec<usize> = (0..)
                .map_while(|i| iterable_item(dataset_len, &spec, i))
                .collect();
            assert_eq!(
                streamed, items,
                "iterable_item disagrees with iterable_dataset_shard"
            );
            Ok(Shard {
                reported_len: iterable_shard_len(dataset_len, &spec),
                batches: vec![items],
            })
        }
        "dispatch_batches" => {
            let spec = ShardSpec::new_lenient(options)?;
            let batches = dispatch_batches(dataset_len, &spec)?;
            let reported_len = num_batches(dataset_len, &spec, Sharding::Dispatch)?;
            check_streaming(dataset_len, &spec, Sharding::Dispatch, &batches);
            Ok(Shard {
                batches,
                reported_len,
            })
        }
        _ => unreachable!("unknown suite {suite}"),
    }
}

/// The streaming core must agree with the materialised batches, from any starting batch.
fn check_streaming(
    dataset_len: usize,
    spec: &ShardSpec,
    sharding: Sharding,
    batches: &[Vec<usize>],
) {
    let plan = ShardPlan::new(dataset_len, spec, sharding).expect("plan for a valid case");
    for (i, batch) in batches.iter().enumerate() {
        assert_eq!(plan.batch(i).as_ref(), Some(batch), "ShardPlan::batch({i})");
    }
    assert_eq!(plan.batch(batches.len()), None);
    let skip = batches.len() / 2;
    assert_eq!(
        plan.skip_first_batches(skip).collect::<Vec<_>>(),
        batches[skip..]
    );
}

/// Why the case fails, or `None` when it agrees with the golden result.
fn check_case(suite: &str, case: &Value) -> Option<String> {
    let dataset_len = field_usize(case, "dataset_len");
    let options = options(case);
    let results: Vec<_> = (0..options.num_processes)
        .map(|process_index| {
            run_process(
                suite,
                dataset_len,
                ShardOptions {
                    process_index,
                    ..options
                },
            )
        })
        .collect();

    if let Some(expected) = case.get("error") {
        return match results.iter().find_map(|r| r.as_ref().err()) {
            Some(ShardError::IndivisibleSplit { .. }) => None,
            Some(other) => Some(format!(
                "expected {expected}, got a different error: {other}"
            )),
            None => Some(format!("accelerate raised {expected}; the crate did not")),
        };
    }
    let Some(expected) = case["per_process"].as_array() else {
        return Some("golden case has neither `error` nor `per_process`".into());
    };
    if expected.len() != results.len() {
        return Some(format!(
            "golden case has {} processes, ran {}",
            expected.len(),
            results.len()
        ));
    }
    for (p, (result, want)) in results.into_iter().zip(expected).enumerate() {
        let shard = match result {
            Ok(shard) => shard,
            Err(e) => return Some(format!("process {p}: unexpected error: {e}")),
        };
        // The iterable suite's `per_process[p]` is a flat list of items, not of batches.
        let (got, yielded) = if suite == "iterable_dataset_shards" {
            (serde_json::json!(shard.batches[0]), shard.batches[0].len())
        } else {
            (serde_json::json!(shard.batches), shard.batches.len())
        };
        if &got != want {
            return Some(format!("process {p}: got {got}, expected {want}"));
        }
        if shard.reported_len != yielded {
            return Some(format!(
                "process {p}: reported length {} but yielded {yielded}",
                shard.reported_len
            ));
        }
    }
    None
}

fn run_suite(suite: &str, file: &str) -> usize {
    let cases = load(file);
    assert!(!cases.is_empty(), "{file} has no cases");
    let mut failures = Vec::new();
    for case in &cases {
        if let Some(why) = check_case(suite, case) {
            failures.push(format!("{}: {why}", case["id"]));
        }
    }
    if !failures.is_empty() {
        for failure in failures.iter().take(SHOWN_FAILURES) {
            eprintln!("FAIL {failure}");
        }
        panic!(
            "{suite}: {} of {} golden cases failed (first {} shown above)",
            failures.len(),
            cases.len(),
            failures.len().min(SHOWN_FAILURES)
        );
    }
    println!("{suite}: {} passed", cases.len());
    cases.len()
}

#[test]
fn batch_sampler_shards_match_accelerate() {
    assert_eq!(
        run_suite("batch_sampler_shards", "batch_sampler_shards.json"),
        8896
    );
}

#[test]
fn iterable_dataset_shards_match_accelerate() {
    assert_eq!(
        run_suite("iterable_dataset_shards", "iterable_dataset_shards.json"),
        4490
    );
}

#[test]
fn dispatch_batches_match_accelerate() {
    assert_eq!(run_suite("dispatch_batches", "dispatch_batches.json"), 2527);
}

/// The dispatch file also records accelerate's non-dispatch (`BatchSamplerShard` via
/// `DataLoaderShard`) result of each configuration: a second, independent check of
/// [`batch_sampler_shard`].
#[test]
fn non_dispatch_results_in_dispatch_file_match_batch_sampler() {
    let cases = load("dispatch_batches.json");
    let mut failures = Vec::new();
    for case in &cases {
        let dataset_len = field_usize(case, "dataset_len");
        let options = options(case);
        let got: Result<Vec<_>, _> = (0..options.num_processes)
            .map(|process_index| {
                let spec = ShardSpec::new(ShardOptions {
                    process_index,
                    ..options
                })?;
                batch_sampler_shard(dataset_len, &spec)
            })
            .collect();
        let why = match (got, case.get("non_dispatch_error")) {
            (Err(_), Some(_)) => None,
            (Ok(_), Some(e)) => Some(format!("accelerate raised {e}; the crate did not")),
            (Err(e), None) => Some(format!("unexpected error: {e}")),
            (Ok(got), None) => {
                let want = expected_batches(&case["non_dispatch_per_process"]);
                (want.as_ref() != Some(&got)).then(|| format!("got {got:?}, expected {want:?}"))
            }
        };
        if let Some(why) = why {
            failures.push(format!("{}: {why}", case["id"]));
        }
    }
    for failure in failures.iter().take(SHOWN_FAILURES) {
        eprintln!("FAIL {failure}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} non-dispatch results failed",
        failures.len(),
        cases.len()
    );
}
