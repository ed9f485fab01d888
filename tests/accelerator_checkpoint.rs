//! A hand-written loop's checkpoints through the `Accelerator`: a run stopped after a
//! checkpoint and started again with `resume` ends with the uninterrupted run's parameters, bit
//! for bit; a damaged newest checkpoint is passed over for the one before; a checkpoint saved
//! with other settings is refused, naming the setting.
#![cfg(feature = "flex")]

mod param_bits;

use burn::backend::{Autodiff, Flex};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig};
use burn::tensor::Tensor;
use burn_accelerate::checkpoint::CheckpointDir;
use burn_accelerate::{AccelerateConfig, AccelerateError, Accelerator, GradientState};
use param_bits::param_bits;

type B = Autodiff<Flex>;
type Optim = OptimizerAdaptor<Adam, Linear<B>, B>;

const STEPS: usize = 6;

fn config() -> AccelerateConfig {
    AccelerateConfig::new().with_gradient_accumulation_steps(2)
}

fn fresh() -> (Linear<B>, Optim) {
    let device = Default::default();
    // Fixed weights: no draw from the backend's generator, which other tests share.
    let model = LinearConfig::new(4, 3)
        .with_initializer(Initializer::Constant { value: 0.1 })
        .init(&device);
    (model, AdamConfig::new().init())
}

fn batch(i: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let device = Default::default();
    let x: Vec<f32> = (0..8).map(|j| ((i * 8 + j) as f32 * 0.37).sin()).collect();
    let y: Vec<f32> = (0..6).map(|j| ((i * 6 + j) as f32 * 0.71).cos()).collect();
    (
        Tensor::<B, 1>::from_floats(x.as_slice(), &device).reshape([2, 4]),
        Tensor::<B, 1>::from_floats(y.as_slice(), &device).reshape([2, 3]),
    )
}

fn accelerator() -> Accelerator<B> {
    config()
        .init_with_state::<B>(&Default::default(), GradientState::new())
        .unwrap()
}

// Trains optimizer steps `from..to` (two batches each), saving checkpoint `step` after each
// when `dir` is given.
fn train(
    acc: &mut Accelerator<B>,
    mut model: Linear<B>,
    mut optim: Optim,
    from: usize,
    to: usize,
    dir: Option<&CheckpointDir>,
) -> (Linear<B>, Optim) {
    let mut lr = 0.05;
    for step in from..to {
        for half in 0..2 {
            let _window = acc.accumulate(&model);
            let (x, y) = batch(step * 2 + half);
            let loss = (model.forward(x) - y).powi_scalar(2).mean();
            acc.backward(loss, &model);
            let (m, _) = acc.optimizer_step(&mut optim, model, &mut lr).unwrap();
            model = m;
        }
        if let Some(dir) = dir {
            acc.save_checkpoint(dir, step + 1, &model, &optim).unwrap();
        }
    }
    (model, optim)
}

fn scratch(name: &str) -> CheckpointDir {
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-acc-ckpt-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    CheckpointDir::new(dir).with_keep_last(3)
}

#[test]
fn a_restarted_loop_resumes_and_ends_bit_for_bit_where_the_uninterrupted_one_did() {
    let (model, optim) = fresh();
    let (whole, _) = train(&mut accelerator(), model, optim, 0, STEPS, None);

    let dir = scratch("resume");
    let (model, optim) = fresh();
    // The first start stops after 3 steps (the process dies: everything in memory is lost).
    let _ = train(&mut accelerator(), model, optim, 0, 3, Some(&dir));
    // The second start resumes, with nothing but a fresh model, optimizer and accelerator.
    let mut acc = accelerator();
    let (model, optim) = fresh();
    let resumed = acc.resume(&dir, model, optim).unwrap();
    assert_eq!(resumed.from, Some(3));
    let (resumed_model, _) = train(
        &mut acc,
        resumed.model,
        resumed.optimizer,
        3,
        STEPS,
        Some(&dir),
    );
    assert_eq!(param_bits(&resumed_model), param_bits(&whole));
    // Adam's moments came back too: the same resume with a fresh optimizer ends elsewhere.
    let mut acc = accelerator();
    let resumed = acc
        .resume(&scratch_at_three(), fresh().0, AdamConfig::new().init())
        .unwrap();
    let (model_only, _) = train(
        &mut acc,
        resumed.model,
        AdamConfig::new().init(),
        3,
        STEPS,
        None,
    );
    assert_ne!(param_bits(&model_only), param_bits(&whole));
}

// A directory whose newest checkpoint is that of step 3.
fn scratch_at_three() -> CheckpointDir {
    let dir = scratch("at-three");
    let (model, optim) = fresh();
    let _ = train(&mut accelerator(), model, optim, 0, 3, Some(&dir));
    dir
}

#[test]
fn an_empty_directory_starts_afresh_and_a_damaged_newest_checkpoint_falls_back() {
    let dir = scratch("damaged");
    let (model, optim) = fresh();
    let start = param_bits(&model);
    let resumed = accelerator().resume(&dir, model, optim).unwrap();
    assert_eq!(resumed.from, None);
    assert_eq!(param_bits(&resumed.model), start);

    let _ = train(
        &mut accelerator(),
        resumed.model,
        resumed.optimizer,
        0,
        3,
        Some(&dir),
    );
    // Half of the newest model record is lost (a disk that filled, a copy cut short).
    let newest = dir.path().join("model-3.mpk");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    let (model, optim) = fresh();
    let resumed = accelerator().resume(&dir, model, optim).unwrap();
    assert_eq!(resumed.from, Some(2));
}

#[test]
fn a_checkpoint_saved_with_other_accumulation_is_refused_naming_it() {
    let dir = scratch("mismatch");
    let (model, optim) = fresh();
    let _ = train(&mut accelerator(), model, optim, 0, 1, Some(&dir));
    let mut other = AccelerateConfig::new()
        .with_gradient_accumulation_steps(4)
        .init_with_state::<B>(&Default::default(), GradientState::new())
        .unwrap();
    let (model, optim) = fresh();
    let err = other.resume(&dir, model, optim).unwrap_err();
    assert!(
        matches!(
            err,
            AccelerateError::StateMismatch {
                what: "gradient_accumulation_steps",
                ..
            }
        ),
        "{err}"
    );
}

// ZeRO stage 3's checkpoints are saved and resumed as every stage's are (on one process the
// stage shards nothing: the loop ends bit for bit where stage 0's does). Several processes:
// tests/processes, `a_stage_3_checkpoint_resumes_on_other_process_counts_and_stages`.
#[test]
fn a_checkpoint_at_zero_stage_3_resumes_and_ends_where_stage_0_does() {
    let (model, optim) = fresh();
    let (whole, _) = train(&mut accelerator(), model, optim, 0, STEPS, None);
    let stage_3 = || {
        config()
            .with_zero_stage(burn_accelerate::zero::ZeroStage::Parameters)
            .init_with_state::<B>(&Default::default(), GradientState::new())
            .unwrap()
    };
    let dir = scratch("stage-3");
    let (model, optim) = fresh();
    let _ = train(&mut stage_3(), model, optim, 0, 3, Some(&dir));
    let mut acc = stage_3();
    let (model, optim) = fresh();
    let resumed = acc.resume(&dir, model, optim).unwrap();
    assert_eq!(resumed.from, Some(3));
    let (resumed_model, _) = train(&mut acc, resumed.model, resumed.optimizer, 3, STEPS, None);
    assert_eq!(param_bits(&resumed_model), param_bits(&whole));
    let _ = std::fs::remove_dir_all(dir.path());
}

// Issue 49: a record of another model is refused by name, before anything is loaded.
#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_parameter() {
    let dir = scratch("other-model");
    let (model, optim) = fresh();
    let _ = train(&mut accelerator(), model, optim, 0, 1, Some(&dir));
    let wider = LinearConfig::new(5, 3).init::<B>(&Default::default());
    let err = accelerator()
        .resume(&dir, wider, AdamConfig::new().init())
        .unwrap_err();
    match &err {
        AccelerateError::Checkpoint { path, reason } => {
            assert_eq!(path, "model-1.mpk");
            assert!(
                reason.contains(
                    "parameter `weight` has shape [4, 3] in the record, [5, 3] in the model"
                ),
                "{reason}"
            );
        }
        other => panic!("not a checkpoint error: {other}"),
    }
}

// Issue 49: a record written by another version of Burn is refused naming the versions,
// even where its bytes would decode.
#[test]
fn a_record_of_another_burn_version_is_refused_naming_it() {
    let dir = scratch("other-version");
    let (model, optim) = fresh();
    let _ = train(&mut accelerator(), model, optim, 0, 1, Some(&dir));
    let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    let model = read("model-1.mpk");
    let at = model
        .windows(b"version".len())
        .position(|w| w == b"version")
        .expect("the record's metadata names its Burn version")
        + b"version".len();
    // The version's string: a short-string tag, then its characters ("0.21.0").
    let len = usize::from(model[at] & 0x1f);
    let mut older = model.clone();
    older[at + 1..at + 1 + len].copy_from_slice(&b"0.20.9"[..len]);
    dir.save(
        2,
        &[
            ("accelerator-2.json", &read("accelerator-1.json")),
            ("model-2.mpk", &older),
            ("optimizer-2.mpk", &read("optimizer-1.mpk")),
        ],
    )
    .unwrap();
    let (model, optim) = fresh();
    let err = accelerator().resume(&dir, model, optim).unwrap_err();
    match &err {
        AccelerateError::Checkpoint { path, reason } => {
            assert_eq!(path, "model-2.mpk");
            assert!(
                reason.contains("Burn version \"0.20.9\" where this build has \"0.21.0\""),
                "{reason}"
            );
        }
        other => panic!("not a checkpoint error: {other}"),
    }
}

// Issue 46: both entry points now write one state file (`CheckpointState`). A checkpoint an
// `Accelerator` wrote before, whose `accelerator-N.json` holds its `AcceleratorState` alone,
// still resumes, and the run ends where the uninterrupted one does, bit for bit.
#[test]
fn a_checkpoint_written_before_the_shared_state_file_still_resumes() {
    let (model, optim) = fresh();
    let (whole, _) = train(&mut accelerator(), model, optim, 0, STEPS, None);

    let dir = scratch("older-state");
    let (model, optim) = fresh();
    let _ = train(&mut accelerator(), model, optim, 0, 3, Some(&dir));
    let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    let current: serde_json::Value = serde_json::from_slice(&read("accelerator-3.json")).unwrap();
    let older = serde_json::to_vec_pretty(&current["state"]).unwrap();
    let _: burn_accelerate::AcceleratorState = serde_json::from_slice(&older).unwrap();
    dir.save(
        4,
        &[
            ("accelerator-4.json", &older),
            ("model-4.mpk", &read("model-3.mpk")),
            ("optimizer-4.mpk", &read("optimizer-3.mpk")),
        ],
    )
    .unwrap();
    let mut acc = accelerator();
    let (model, optim) = fresh();
    let resumed = acc.resume(&dir, model, optim).unwrap();
    assert_eq!(resumed.from, Some(4));
    let (resumed_model, _) = train(&mut acc, resumed.model, resumed.optimizer, 3, STEPS, None);
    assert_eq!(param_bits(&resumed_model), param_bits(&whole));
}
