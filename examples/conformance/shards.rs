//! Conformance runner for the sharding suites (`batch_sampler_shards`,
//! `iterable_dataset_shards`, `dispatch_batches`): runs a golden case through
//! `burn_accelerate::data::shard`, the same functions a loader uses, and builds the result
//! object `check.py` compares.

use burn_accelerate::data::shard::{
    ShardError, ShardOptions, ShardSpec, Sharding, batch_sampler_shard, dispatch_batches,
    iterable_dataset_shard, iterable_shard_len, num_batches,
};
use serde_json::{Value, json};

/// The suites this module answers.
pub const SUITES: [&str; 3] = [
    "batch_sampler_shards",
    "iterable_dataset_shards",
    "dispatch_batches",
];

/// Runs `case` of `suite` for every process and returns `{"id", "per_process",
/// "len_per_process"}`, or `{"id", "error"}` when the configuration is refused on some
/// process.
///
/// `len_per_process` is the length the API reports, which the crate guarantees equals what is
/// yielded (batches, or items for the iterable suite).
///
/// # Panics
///
/// On a suite not in [`SUITES`] or a case missing its inputs: both are bugs in the caller or
/// the golden file, not results.
pub fn run_case(suite: &str, case: &Value) -> Value {
    let id = case["id"].clone();
    let dataset_len = input(case, "dataset_len");
    let options = options(case);
    let mut per_process = Vec::with_capacity(options.num_processes);
    let mut len_per_process = Vec::with_capacity(options.num_processes);
    for process_index in 0..options.num_processes {
        let options = ShardOptions {
            process_index,
            ..options
        };
        match run_process(suite, dataset_len, options) {
            Ok((yielded, reported_len)) => {
                per_process.push(yielded);
                len_per_process.push(reported_len);
            }
            Err(e) => return json!({ "id": id, "error": e.to_string() }),
        }
    }
    json!({ "id": id, "per_process": per_process, "len_per_process": len_per_process })
}

/// One process's yield (batches, or items for the iterable suite) and its reported length.
///
/// Accelerate's `BatchSamplerShard` refuses every indivisible `split_batches` batch size;
/// `IterableDatasetShard` and the dispatcher only check batch sizes above 1, so those suites
/// use the lenient spec (the dispatcher then refuses an empty split itself, per the crate's
/// contract).
fn run_process(
    suite: &str,
    dataset_len: usize,
    options: ShardOptions,
) -> Result<(Value, usize), ShardError> {
    match suite {
        "batch_sampler_shards" => {
            let spec = ShardSpec::new(options)?;
            let batches = batch_sampler_shard(dataset_len, &spec)?;
            let len = num_batches(dataset_len, &spec, Sharding::BatchSampler)?;
            Ok((json!(batches), len))
        }
        "iterable_dataset_shards" => {
            let spec = ShardSpec::new_lenient(options)?;
            let items = iterable_dataset_shard(dataset_len, &spec);
            Ok((json!(items), iterable_shard_len(dataset_len, &spec)))
        }
        "dispatch_batches" => {
            let spec = ShardSpec::new_lenient(options)?;
            let batches = dispatch_batches(dataset_len, &spec)?;
            let len = num_batches(dataset_len, &spec, Sharding::Dispatch)?;
            Ok((json!(batches), len))
        }
        other => panic!("shards::run_case does not handle suite {other:?}; it handles {SUITES:?}"),
    }
}

/// The case's settings; flags a suite does not have (the iterable shard has no
/// `even_batches`) take accelerate's defaults.
fn options(case: &Value) -> ShardOptions {
    let flag = |key: &str, default: bool| case[key].as_bool().unwrap_or(default);
    ShardOptions {
        num_processes: input(case, "num_processes"),
        process_index: 0,
        batch_size: input(case, "batch_size"),
        split_batches: flag("split_batches", false),
        even_batches: flag("even_batches", true),
        drop_last: flag("drop_last", false),
    }
}

fn input(case: &Value, key: &str) -> usize {
    case[key]
        .as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or_else(|| panic!("case {} has no non-negative integer `{key}`", case["id"]))
}
