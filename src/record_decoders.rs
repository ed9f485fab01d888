//! Property tests of the decoders of this crate's own records and messages (issue 49,
//! SECURITY.md): the accelerator's and strategy's state (loss scale, gradient-state position),
//! a loader's position, the model's and optimizer's records of a checkpoint (Burn's `NamedMpk`),
//! the optimizer state a ZeRO process sends the main process (Burn's `BinBytes`), and the
//! MessagePack of a dispatched batch. Inputs are mutated valid encodings and random bytes from
//! the kit the comm and checkpoint crates' tests use (`crates/comm/src/fuzz.rs`); each decoder
//! must answer a typed error or a value that restoring accepts and then uses without a panic,
//! and allocate no more than a bound of its input's size.

use std::collections::BTreeMap;

use hashbrown::HashMap;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, Optimizer};
use burn::prelude::Backend;
use burn::record::Recorder;
use proptest::prelude::*;

use crate::checkpoint::{CheckpointState, LoadedCheckpoint, records};
use crate::data::LoaderState;
use crate::fuzz;
use crate::gradient_state::{GradientState, GradientStateSnapshot};
use crate::scaler::{DynamicLossScale, LossScale};
use crate::step::restore::restore_position;
use crate::{AccelerateError, AcceleratorState};

type B = Autodiff<Flex>;
// The model records are tried on the inner backend: the autodiff graph's own bookkeeping,
// which grows with the parameters built over thousands of cases, is not the decoder's
// allocation (a long run saw a 1.1 MB table of Burn's grow in one case).
type Inner = Flex;

/// CI's cases per decoder: a few seconds in a debug build.
const CASES: u32 = 1_000;
/// For the records, each case of which builds tensors: fewer.
const RECORD_CASES: u32 = 300;

// What a decoder may allocate for an input of `len` bytes: a small constant (serde's and the
// formats' own buffers) and a few times the input. A claimed length (2^32 in MessagePack,
// 2^40 elements in a shape) must not be what decides it.
fn bound(len: usize) -> usize {
    (1 << 20) + 8 * len
}

// JSON records with one number set to an edge value (as it is, negated, or as a float too
// large for f32): what random bytes and mutations rarely make, a record that parses with a
// number no run writes.
fn json_edges(valid: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    // Sets the `at`-th number of `value` (in document order) to `number`; counts them.
    fn set_number(value: &mut serde_json::Value, at: &mut usize, number: &serde_json::Value) {
        match value {
            serde_json::Value::Number(_) => {
                if *at == 0 {
                    *value = number.clone();
                }
                *at = at.wrapping_sub(1);
            }
            serde_json::Value::Array(items) => {
                items.iter_mut().for_each(|v| set_number(v, at, number))
            }
            serde_json::Value::Object(map) => {
                map.values_mut().for_each(|v| set_number(v, at, number))
            }
            _ => {}
        }
    }
    let edited = (
        prop::sample::select(valid.clone()),
        any::<prop::sample::Index>(),
        prop::sample::select(fuzz::EDGES.to_vec()),
        0..4u8,
    )
        .prop_map(|(bytes, at, edge, form)| {
            let mut value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let mut count = usize::MAX;
            set_number(&mut value, &mut count, &serde_json::Value::Null);
            let count = usize::MAX - count;
            let number = match form {
                0 => serde_json::json!(edge),
                1 => serde_json::json!(-(edge.min(i64::MAX as u64) as i64)),
                2 => serde_json::json!(edge as f64 * 1e30),
                _ => serde_json::json!(-(edge as f64)),
            };
            if count > 0 {
                set_number(&mut value, &mut at.index(count), &number);
            }
            serde_json::to_vec(&value).unwrap()
        });
    prop_oneof![1 => edited, 1 => fuzz::inputs(valid, 256)]
}

fn states() -> Vec<Vec<u8>> {
    let dynamic = DynamicLossScale::new(1024.0, 2.0, 0.5, 4).unwrap();
    [
        (LossScale::None, 1, 0, 0),
        (LossScale::Static { scale: 128.0 }, 4, 6, 2),
        (LossScale::Dynamic(dynamic), 4, 7, 3),
        (
            LossScale::Dynamic(dynamic.adjust(false).adjust(false)),
            2,
            1,
            1,
        ),
    ]
    .into_iter()
    .map(|(loss_scale, num_steps, step, window_batches)| {
        let state = AcceleratorState {
            loss_scale,
            gradient_state: GradientStateSnapshot {
                num_steps,
                sync_with_dataloader: true,
                sync_gradients: false,
                step,
                window_batches,
            },
        };
        serde_json::to_vec_pretty(&state).unwrap()
    })
    .collect()
}

// The accelerator's state file, as `Accelerator::resume` reads and restores it: a decoded
// state either restores, and then the next batches run, or is refused with a typed error.
fn state_restores_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let (largest, decoded) =
        fuzz::largest_allocation(|| serde_json::from_slice::<AcceleratorState>(&bytes));
    prop_assert!(largest <= bound(bytes.len()), "{largest} bytes");
    let Ok(saved) = decoded else {
        return Ok(());
    };
    let scale = saved.loss_scale;
    prop_assert!(
        scale.loss_scale().is_finite() && scale.loss_scale() >= 0.0,
        "a restored scale of {}",
        scale.loss_scale()
    );
    let _ = (
        scale.adjust(true).inv_scale(),
        scale.adjust(false).inv_scale(),
    );
    let state = GradientState::new();
    let restored = restore_position(&state, &scale, &saved.gradient_state, &scale);
    match restored {
        Ok(()) => {
            for _ in 0..3 {
                drop(state.accumulate());
            }
        }
        Err(AccelerateError::InvalidConfig { .. } | AccelerateError::StateMismatch { .. }) => {}
        Err(other) => prop_assert!(false, "untyped refusal: {other}"),
    }
    Ok(())
}

#[test]
fn the_accelerator_state_restores_or_is_refused() {
    fuzz::check(CASES, json_edges(states()), state_restores_or_is_refused);
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_accelerator_state() {
    fuzz::long_run(
        "accelerator state",
        json_edges(states()),
        state_restores_or_is_refused,
    );
}

// The state file of a checkpoint of either entry point (`CheckpointState`), in both its forms:
// the one both write now (the state, the loaders' positions, the number of processes), and an
// `Accelerator`'s older one (its state alone).
fn checkpoint_states() -> Vec<Vec<u8>> {
    let loaders: Vec<LoaderState> = loader_states()
        .iter()
        .map(|bytes| serde_json::from_slice(bytes).unwrap())
        .collect();
    let mut all = states();
    for (at, bytes) in states().iter().enumerate() {
        let state = CheckpointState {
            state: serde_json::from_slice(bytes).unwrap(),
            loaders: loaders[..at % 3].to_vec(),
            num_processes: 1 + at % 2,
        };
        all.push(state.to_json());
    }
    all
}

// A loader position a checkpoint's state is restored into (a loader of 20 batches).
struct Position(crate::data::state::Tracker);

impl crate::checkpoint::LoaderPosition for Position {
    fn state(&self) -> LoaderState {
        self.0.state()
    }

    fn load_state(&self, state: LoaderState) -> Result<(), crate::data::DataLoaderError> {
        self.0.load(state, 20)
    }
}

// A checkpoint's state file, as both entry points read and restore it: decoded, then restored
// in the one order of both (processes, position and loss scale, loaders) into a run of one
// process with one loader, whose next batches and epoch then run; or refused with a typed
// error.
fn checkpoint_state_restores_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let (largest, decoded) =
        fuzz::largest_allocation(|| CheckpointState::from_json(&bytes, "accelerate-1.json"));
    prop_assert!(largest <= bound(bytes.len()), "{largest} bytes");
    let saved = match decoded {
        Ok(saved) => saved,
        Err(AccelerateError::Checkpoint { path, .. }) => {
            prop_assert_eq!(path, "accelerate-1.json");
            return Ok(());
        }
        Err(other) => {
            prop_assert!(false, "untyped refusal: {other}");
            return Ok(());
        }
    };
    let state = GradientState::new();
    let scale = saved.state.loss_scale;
    let loader = Position(crate::data::state::Tracker::new(1));
    let restored = saved.restore(
        1,
        |position, saved_scale| restore_position(&state, &scale, position, &saved_scale),
        &[&loader],
    );
    match restored {
        Ok(_) => {
            for _ in 0..3 {
                drop(state.accumulate());
            }
            let start = loader.0.begin(true, true, 20);
            prop_assert!(start.start <= 20);
            loader.0.complete(start.generation);
        }
        Err(
            AccelerateError::InvalidConfig { .. }
            | AccelerateError::StateMismatch { .. }
            | AccelerateError::DataLoader(_),
        ) => {}
        Err(other) => prop_assert!(false, "untyped refusal: {other}"),
    }
    Ok(())
}

#[test]
fn a_checkpoint_state_restores_or_is_refused() {
    fuzz::check(
        CASES,
        json_edges(checkpoint_states()),
        checkpoint_state_restores_or_is_refused,
    );
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_checkpoint_state() {
    fuzz::long_run(
        "checkpoint state",
        json_edges(checkpoint_states()),
        checkpoint_state_restores_or_is_refused,
    );
}

fn loader_states() -> Vec<Vec<u8>> {
    [
        r#"{"epoch": 3, "position": 17, "seed": 42}"#,
        r#"{"epoch":0,"position":0,"seed":7,"sampler_rng":7,"order_seed":null}"#,
        r#"{"epoch":2,"position":4,"seed":1,"sampler_rng":99,"order_seed":12345}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

// A loader's position, as a loop hands it to `load_state`: decoded, then loaded into a loader
// of 20 batches, whose next epoch then starts (or refused by a typed error).
fn loader_state_loads_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let (largest, decoded) =
        fuzz::largest_allocation(|| serde_json::from_slice::<LoaderState>(&bytes));
    prop_assert!(largest <= bound(bytes.len()), "{largest} bytes");
    let Ok(state) = decoded else {
        return Ok(());
    };
    let tracker = crate::data::state::Tracker::new(1);
    if tracker.load(state, 20).is_ok() {
        for (shuffle, seedable) in [(true, true), (true, false), (false, true)] {
            let start = tracker.begin(shuffle, seedable, 20);
            prop_assert!(start.start <= 20);
            tracker.complete(start.generation);
        }
    }
    Ok(())
}

#[test]
fn a_loader_state_loads_or_is_refused() {
    fuzz::check(
        CASES,
        json_edges(loader_states()),
        loader_state_loads_or_is_refused,
    );
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_loader_state() {
    fuzz::long_run(
        "loader state",
        json_edges(loader_states()),
        loader_state_loads_or_is_refused,
    );
}

#[derive(Module, Debug)]
struct Two<B: Backend> {
    first: Linear<B>,
    second: Linear<B>,
}

fn two<K: Backend>() -> Two<K> {
    let device = Default::default();
    Two {
        first: LinearConfig::new(3, 4).init(&device),
        second: LinearConfig::new(4, 2).init(&device),
    }
}

// A record's refusal must come from the checks before Burn builds it: a panic of Burn's, even
// caught, runs the panic hook (megabytes with `RUST_BACKTRACE=1`), so reaching the catch is a
// failure of the checks.
fn burn_did_not_panic(reason: &str) -> Result<(), TestCaseError> {
    prop_assert!(
        !reason.contains(crate::record_bytes::BURN_PANICKED),
        "Burn panicked past the checks: {reason}"
    );
    Ok(())
}

fn checkpoint(name: &str, bytes: Vec<u8>) -> LoadedCheckpoint {
    LoadedCheckpoint {
        epoch: 1,
        files: BTreeMap::from([(name.to_string(), bytes)]),
        skipped: Vec::new(),
        unkept: Vec::new(),
    }
}

fn model_records() -> Vec<Vec<u8>> {
    vec![records::encode::<Inner, _>(two::<Inner>().into_record(), "the model's record").unwrap()]
}

// A checkpoint's model record, as `Accelerator::resume` reads it: decoded and fitted to the
// model, or refused with an error naming the file.
fn model_record_loads_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let len = bytes.len();
    let loaded = checkpoint("model-1.mpk", bytes);
    let device = Default::default();
    let (largest, result) = fuzz::largest_allocation(|| {
        crate::checkpoint::decode_model::<Inner, _>(&loaded, "model-1.mpk", two(), &device)
    });
    prop_assert!(largest <= bound(len), "{largest} bytes for {len}");
    match result {
        Ok(model) => {
            // A model that loaded runs.
            let x = burn::tensor::Tensor::<Inner, 2>::ones([2, 3], &device);
            let y = model.second.forward(model.first.forward(x));
            prop_assert_eq!(y.dims(), [2, 2]);
        }
        Err(AccelerateError::Checkpoint { path, reason }) => {
            prop_assert_eq!(path, "model-1.mpk");
            burn_did_not_panic(&reason)?;
        }
        Err(other) => prop_assert!(false, "untyped refusal: {other}"),
    }
    Ok(())
}

#[test]
fn a_model_record_loads_or_is_refused_naming_the_file() {
    fuzz::check(
        RECORD_CASES,
        fuzz::inputs(model_records(), 512),
        model_record_loads_or_is_refused,
    );
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_model_record() {
    fuzz::long_run(
        "model record",
        fuzz::inputs(model_records(), 512),
        model_record_loads_or_is_refused,
    );
}

type OptimRecord =
    <burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Two<B>, B> as Optimizer<
        Two<B>,
        B,
    >>::Record;

fn optimizer_record() -> OptimRecord {
    let device = Default::default();
    let model = two();
    let mut optimizer = AdamConfig::new().init::<B, Two<B>>();
    let x = burn::tensor::Tensor::<B, 2>::ones([2, 3], &device);
    let loss = model.second.forward(model.first.forward(x)).sum();
    let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
    let _ = optimizer.step(1e-3, model, grads);
    optimizer.to_record()
}

fn optimizer_records() -> Vec<Vec<u8>> {
    vec![records::encode::<B, _>(optimizer_record(), "the optimizer's record").unwrap()]
}

// A checkpoint's optimizer record: decoded (or refused naming the file), then split as a ZeRO
// run's process keeps its part.
fn optimizer_record_loads_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let len = bytes.len();
    let loaded = checkpoint("optimizer-1.mpk", bytes);
    let device = Default::default();
    let (largest, result) = fuzz::largest_allocation(|| {
        records::decode::<B, OptimRecord>(&loaded, "optimizer-1.mpk", &device)
    });
    prop_assert!(largest <= bound(len), "{largest} bytes for {len}");
    match result {
        Ok(record) => {
            let partition = crate::zero::Partition::of::<B, _>(&two(), 2);
            let _ = crate::zero::keep_own_state::<B, _>(record, &partition, 1);
        }
        Err(AccelerateError::Checkpoint { path, reason }) => {
            prop_assert_eq!(path, "optimizer-1.mpk");
            burn_did_not_panic(&reason)?;
        }
        Err(other) => prop_assert!(false, "untyped refusal: {other}"),
    }
    Ok(())
}

#[test]
fn an_optimizer_record_loads_or_is_refused_naming_the_file() {
    fuzz::check(
        RECORD_CASES,
        fuzz::inputs(optimizer_records(), 512),
        optimizer_record_loads_or_is_refused,
    );
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_optimizer_record() {
    fuzz::long_run(
        "optimizer record",
        fuzz::inputs(optimizer_records(), 512),
        optimizer_record_loads_or_is_refused,
    );
}

fn sent_states() -> Vec<Vec<u8>> {
    let record: HashMap<ParamId, _> = optimizer_record()
        .into_iter()
        .zip(0u64..)
        .map(|((_, state), place)| (ParamId::from(place), state))
        .collect();
    vec![Recorder::<B>::record(&records::Bytes::default(), record, ()).unwrap()]
}

// The optimizer state a ZeRO process sends the main process for a checkpoint
// (`zero::consolidate_state`), decoded as the main process does.
fn sent_state_decodes_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let len = bytes.len();
    let device = Default::default();
    let (largest, result) =
        fuzz::largest_allocation(|| records::from_bytes::<B, OptimRecord>(bytes, &device));
    prop_assert!(largest <= bound(len), "{largest} bytes for {len}");
    if let Err(reason) = result {
        burn_did_not_panic(&reason)?;
    }
    Ok(())
}

#[test]
fn a_sent_optimizer_state_decodes_or_is_refused() {
    fuzz::check(
        RECORD_CASES,
        fuzz::inputs(sent_states(), 512),
        sent_state_decodes_or_is_refused,
    );
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_sent_optimizer_state() {
    fuzz::long_run(
        "sent optimizer state",
        fuzz::inputs(sent_states(), 512),
        sent_state_decodes_or_is_refused,
    );
}

type Slice = Vec<(Vec<f32>, u64)>;

fn slices() -> Vec<Vec<u8>> {
    let slice: Slice = vec![(vec![1.0, 2.5, -3.0], 7), (vec![], 0), (vec![0.5; 9], 1)];
    vec![rmp_serde::to_vec(&slice).unwrap()]
}

// A dispatched batch's MessagePack, as `dispatch_batches` receivers decode it.
fn slice_decodes_or_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let (largest, _) = fuzz::largest_allocation(|| rmp_serde::from_slice::<Slice>(&bytes));
    prop_assert!(largest <= bound(bytes.len()), "{largest} bytes");
    Ok(())
}

#[test]
fn a_dispatched_slice_decodes_or_is_refused() {
    fuzz::check(
        CASES,
        fuzz::inputs(slices(), 256),
        slice_decodes_or_is_refused,
    );
}

#[test]
#[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases (SECURITY.md)"]
fn long_run_dispatched_slice() {
    fuzz::long_run(
        "dispatched slice",
        fuzz::inputs(slices(), 256),
        slice_decodes_or_is_refused,
    );
}

// Where `pattern` first occurs in a record's bytes: the place a regression test below damages.
#[track_caller]
fn find(bytes: &[u8], pattern: &[u8], what: &str) -> usize {
    bytes
        .windows(pattern.len())
        .position(|w| w == pattern)
        .unwrap_or_else(|| panic!("{what} not found"))
}

// The first parameter id's string in a model record: where its characters start (after the
// short-string tag at the first byte) and how many there are.
fn first_id(bytes: &[u8]) -> (usize, usize) {
    let at = find(bytes, &[0xa2, b'i', b'd'], "a parameter's id") + 3;
    (at, usize::from(bytes[at] & 0x1f))
}

// The first weight's tensor in a model record, `{"bytes": bin 8 of 48, "shape": [3, 4],
// "dtype": "F32"}`: where its map starts and ends.
fn first_weight(bytes: &[u8]) -> (usize, usize) {
    let start = find(
        bytes,
        &[0x83, 0xa5, b'b', b'y', b't', b'e', b's'],
        "the first weight",
    );
    let end = start
        + 9
        + 48
        + [b"\xa5shape".len(), 3, b"\xa5dtype".len(), 4]
            .iter()
            .sum::<usize>();
    assert_eq!(&bytes[end - 4..end], b"\xa3F32");
    (start, end)
}

// The reason of a decoder's refusal, once `result` is found to be the checkpoint error naming
// `file` with a reason that says `expected`: what each regression test below asks.
#[track_caller]
fn refused<T>(result: Result<T, AccelerateError>, file: &str, expected: &str) -> String {
    match result {
        Err(AccelerateError::Checkpoint { path, reason }) => {
            assert_eq!(path, file, "{reason}");
            assert!(
                reason.contains(expected),
                "{expected:?} is not in: {reason}"
            );
            reason
        }
        Err(other) => panic!("expected a checkpoint error naming {file}, got: {other}"),
        Ok(_) => panic!("expected a checkpoint error naming {file} ({expected}); it decoded"),
    }
}

// A model record whose first weight claims 2^40 rows: refused, naming the file, without
// allocating for the claim.
#[test]
fn a_record_claiming_a_tensor_of_2_40_rows_is_refused_without_allocating_it() {
    let valid = model_records().remove(0);
    let shape = [b"shape".as_slice(), &[0x92, 0x03, 0x04]].concat();
    let at = find(&valid, &shape, "the first weight's shape, [3, 4]") + 6;
    let mut claim = vec![0xcf];
    claim.extend_from_slice(&(1u64 << 40).to_be_bytes());
    let mut bytes = valid.clone();
    bytes.splice(at..at + 1, claim);
    let len = bytes.len();
    let loaded = checkpoint("model-1.mpk", bytes);
    let (largest, result) = fuzz::largest_allocation(|| {
        records::decode::<Inner, TwoRecord<Inner>>(&loaded, "model-1.mpk", &Default::default())
    });
    assert!(largest <= bound(len), "{largest} bytes");
    refused(
        result,
        "model-1.mpk",
        "tensor `item.first.weight.param` has shape [1099511627776, 4]",
    );
}

// Found by the model record's property test: Burn's `from_item` panics ("Invalid id.") on a
// parameter id that does not decode; it is now the file's typed error.
#[test]
fn a_parameter_id_that_is_not_one_is_refused_naming_the_file() {
    let mut bytes = model_records().remove(0);
    // The id's string: a short-string tag, then its characters.
    let (at, len) = first_id(&bytes);
    bytes[at + 1..at + 1 + len].fill(b'!');
    let loaded = checkpoint("model-1.mpk", bytes);
    let result =
        records::decode::<Inner, TwoRecord<Inner>>(&loaded, "model-1.mpk", &Default::default());
    refused(result, "model-1.mpk", "Invalid id");
}

// Found by the sent optimizer state's property test: under Burn's bincode recorder, a part
// whose length field claimed 6e18 bytes aborted the main process (allocation failure). The
// parts now travel as MessagePack, whose claims go no further than the bytes.
#[test]
fn a_sent_state_claiming_4_gib_is_refused_without_allocating_it() {
    let mut bytes = sent_states().remove(0);
    let at = bytes
        .iter()
        .position(|&b| b == 0xc4)
        .expect("a tensor's bytes (bin 8)");
    let mut claim = vec![0xc6];
    claim.extend_from_slice(&u32::MAX.to_be_bytes());
    bytes.splice(at..at + 2, claim);
    let len = bytes.len();
    let (largest, result) = fuzz::largest_allocation(|| {
        records::from_bytes::<B, OptimRecord>(bytes, &Default::default())
    });
    assert!(largest <= bound(len), "{largest} bytes");
    assert!(result.is_err(), "a claim of 4 GiB over {len} bytes decoded");
}

// A checkpoint's record nested a million deep: refused naming the file, no stack overflow
// (the metadata check skips the item recursively, after the depth-limited walk).
#[test]
fn a_model_record_nested_a_million_deep_is_refused_naming_the_file() {
    let mut bytes = vec![0x91u8; 1_000_000];
    bytes.push(0xc0);
    let loaded = checkpoint("model-1.mpk", bytes);
    let result =
        records::decode::<Inner, TwoRecord<Inner>>(&loaded, "model-1.mpk", &Default::default());
    refused(result, "model-1.mpk", "depth limit exceeded");
}

// Found by the sent optimizer state's long run: Burn's `from_item` panics ("Tensor rank: '3',
// given dimensions: '[3, 4]'") on a state whose `RankN` variant says another rank than its
// tensors have; it is now refused before Burn builds it.
#[test]
fn an_optimizer_state_of_another_rank_is_refused_before_burn_builds_it() {
    let mut bytes = optimizer_records().remove(0);
    let at = find(&bytes, b"Rank2", "the state of a weight");
    bytes[at + 4] = b'3';
    let loaded = checkpoint("optimizer-1.mpk", bytes);
    let result = records::decode::<B, OptimRecord>(&loaded, "optimizer-1.mpk", &Default::default());
    let reason = refused(result, "optimizer-1.mpk", "optimizer state of rank 3");
    assert!(
        !reason.contains(crate::record_bytes::BURN_PANICKED),
        "{reason}"
    );
}

// A weight stored as [12] where the model has [3, 4] (the same 48 bytes): Burn's `from_item`
// would panic on the rank; refused naming the parameter and both shapes.
#[test]
fn a_model_record_of_another_rank_is_refused_naming_the_parameter() {
    let mut bytes = model_records().remove(0);
    let shape = [b"shape".as_slice(), &[0x92, 0x03, 0x04]].concat();
    let at = find(&bytes, &shape, "the first weight's shape, [3, 4]") + 5;
    bytes.splice(at..at + 3, [0x91, 0x0c]);
    let loaded = checkpoint("model-1.mpk", bytes);
    let result = crate::checkpoint::decode_model::<Inner, _>(
        &loaded,
        "model-1.mpk",
        two(),
        &Default::default(),
    );
    refused(
        result,
        "model-1.mpk",
        "parameter `first.weight` has shape [12] in the record, [3, 4] in the model",
    );
}

// An id of 20 base32 characters decodes to 12 bytes, which Burn's `ParamId::try_deserialize`
// copies into 8 (a slice-index panic inside it, not its "Invalid id."): refused first.
#[test]
fn a_parameter_id_too_long_for_burn_is_refused_naming_the_file() {
    let mut bytes = model_records().remove(0);
    let (at, len) = first_id(&bytes);
    let mut long = vec![0xa0 | 20];
    long.extend_from_slice(b"0123456789abcdefghij");
    bytes.splice(at..at + 1 + len, long);
    let loaded = checkpoint("model-1.mpk", bytes);
    let result =
        records::decode::<Inner, TwoRecord<Inner>>(&loaded, "model-1.mpk", &Default::default());
    let reason = refused(result, "model-1.mpk", "Invalid id");
    assert!(
        !reason.contains(crate::record_bytes::BURN_PANICKED),
        "{reason}"
    );
}

// Found by a long run (once in several, the models' random weights deciding what a damaged
// length makes of the bytes after it): serde reads a tensor from the list of its fields too,
// `[data, shape, dtype]`, with its data a list of numbers; unchecked, a weight of shape [12]
// where the model has [3, 4] reached Burn's rank panic. Checked as a map is, naming it.
#[test]
fn a_tensor_written_as_a_list_of_its_fields_is_checked_as_a_map_is() {
    let valid = model_records().remove(0);
    let (start, end) = first_weight(&valid);
    let data = &valid[start + 9..start + 9 + 48];
    for (shape, expected) in [
        (
            vec![12u8],
            Some("parameter `first.weight` has shape [12] in the record, [3, 4]"),
        ),
        (vec![3, 4], None),
    ] {
        let mut list = vec![0x93, 0xdc, 0x00, 48];
        for &b in data {
            if b < 0x80 {
                list.push(b);
            } else {
                list.extend([0xcc, b]);
            }
        }
        list.push(0x90 | shape.len() as u8);
        list.extend(&shape);
        list.extend(b"\xa3F32");
        let bytes = [&valid[..start], &list, &valid[end..]].concat();
        let loaded = checkpoint("model-1.mpk", bytes);
        let result = crate::checkpoint::decode_model::<Inner, _>(
            &loaded,
            "model-1.mpk",
            two(),
            &Default::default(),
        );
        match expected {
            None => drop(result.unwrap_or_else(|err| panic!("{err}"))),
            Some(expected) => drop(refused(result, "model-1.mpk", expected)),
        }
    }
}

// Found by a long run: serde reads a tensor's fields in forms Burn never writes (the data as
// text, the shape as bytes, the dtype by its index: `["bytes", bin 48, 5]`, a tensor of 5
// bytes of I64 whose conversion panicked in bytemuck), and a struct's fields by their index
// (`{0: data, 1: shape, 2: dtype}`). Both are refused before Burn decodes them.
#[test]
fn a_tensor_in_a_form_burn_never_writes_is_refused() {
    let valid = model_records().remove(0);
    let (start, end) = first_weight(&valid);
    let data = &valid[start + 7..start + 9 + 48];
    let by_name = [&[0x93, 0xa5][..], b"bytes", data, &[0x05]].concat();
    let by_index = [
        &[0x83, 0x00][..],
        data,
        &[0x01, 0x92, 0x03, 0x04, 0x02, 0xa3],
        b"F32",
    ]
    .concat();
    // The tensor as a list of its fields, then by the indices of its fields.
    for (tensor, expected) in [
        (
            by_name,
            "tensor `item.first.weight.param` has data that are not bytes",
        ),
        (
            by_index,
            "a key that is not a name in `item.first.weight.param`",
        ),
    ] {
        let bytes = [&valid[..start], &tensor, &valid[end..]].concat();
        let loaded = checkpoint("model-1.mpk", bytes);
        let result = crate::checkpoint::decode_model::<Inner, _>(
            &loaded,
            "model-1.mpk",
            two(),
            &Default::default(),
        );
        refused(result, "model-1.mpk", expected);
    }
}
