//! `with_accelerate` on Burn's `SupervisedTraining`, through the `train_mlp` example's model.
//!
//! Each training's autocast, small-op rule and armed loss transform are scoped to the threads
//! that run its steps. The trainings still take turns ([`ONE_TRAINING`]) for one reason: they
//! seed the backend's generator, which is the process's (Burn's `Backend::seed`), and Burn
//! draws a model's initial weights lazily, during the fit: two at once would draw each other's.

#[path = "../examples/common/mlp.rs"]
mod mlp;

use std::sync::Mutex;

use burn::backend::Autodiff;
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::{AccelerateError, Accelerated, Precision};
use mlp::{DemoConfig, DemoOutcome};

// Held for Burn's process-wide seed only (`Backend::seed`, see the module docs).
static ONE_TRAINING: Mutex<()> = Mutex::new(());

fn train<B: burn::tensor::backend::AutodiffBackend>(
    config: &DemoConfig,
) -> Result<DemoOutcome, AccelerateError> {
    // The demo's model is tiny: cast all its lower-class ops (PyTorch's rule), so that the
    // half precisions and their loss scaling are what is tested.
    train_with_rule::<B>(config, SmallOps::Cast)
}

fn train_with_rule<B: burn::tensor::backend::AutodiffBackend>(
    config: &DemoConfig,
    rule: SmallOps,
) -> Result<DemoOutcome, AccelerateError> {
    let config = config.clone().with_small_ops(Some(rule));
    let _one = ONE_TRAINING.lock().unwrap_or_else(|e| e.into_inner());
    mlp::run::<B>(&config, &Default::default())
}

#[cfg(feature = "flex")]
mod flex {
    use super::*;
    use burn::backend::Flex;

    type Train = Accelerated<Autodiff<Flex>>;

    #[test]
    fn a_damaged_checkpoint_directory_is_a_typed_error_before_training() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-damaged-manifest-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let manifest = dir.join("accelerate-checkpoints.json");
        // Cut short, as a crash mid-write outside the crate would leave it.
        std::fs::write(&manifest, br#"{"checkpoints": [{"epoch": 1, "fi"#).unwrap();
        let config = small(Precision::F32)
            .with_epochs(1)
            .with_checkpoint_dir(Some(dir.to_string_lossy().into_owned()));
        let err = train_with_rule::<Train>(&config, SmallOps::KeepF32).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        match &err {
            AccelerateError::Checkpoint { path, .. } => {
                assert_eq!(std::path::Path::new(path), manifest, "{err}")
            }
            other => panic!("expected a checkpoint error naming the manifest, got {other:?}"),
        }
    }

    // Issue 49: where the directory is given to the strategy, not inside Burn's fit.
    #[test]
    fn try_with_checkpoint_dir_refuses_a_damaged_directory_naming_the_manifest() {
        use crate::mlp::MlpComponents;
        use burn_accelerate::AccelerateConfig;
        use burn_accelerate::train::AccelerateStrategy;

        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-try-checkpoint-dir-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let strategy = || {
            AccelerateStrategy::<MlpComponents<Train>>::new(
                AccelerateConfig::new(),
                &Default::default(),
            )
            .unwrap()
        };
        // No directory yet: a fresh run.
        assert!(strategy().try_with_checkpoint_dir(&dir).is_ok());
        std::fs::create_dir_all(&dir).unwrap();
        let manifest = dir.join("accelerate-checkpoints.json");
        // A size no file has: 10^18 bytes.
        std::fs::write(
            &manifest,
            format!(
                r#"{{"version": 1, "checkpoints": [{{"epoch": 1, "files": [{{"name": "accelerate-1.json", "size": 1000000000000000000, "sha256": "{}"}}]}}]}}"#,
                "0".repeat(64)
            ),
        )
        .unwrap();
        let err = strategy().try_with_checkpoint_dir(&dir).err();
        let _ = std::fs::remove_dir_all(&dir);
        match err {
            Some(AccelerateError::Checkpoint { path, reason }) => {
                assert_eq!(std::path::Path::new(&path), manifest, "{reason}");
                assert!(reason.contains("accelerate-1.json"), "{reason}");
            }
            Some(other) => panic!("expected a checkpoint error naming the manifest, got {other:?}"),
            None => panic!("a manifest listing a file of 10^18 bytes was accepted"),
        }
    }

    // Issue 49: what needs no model is checked where the directory is given (checksums and
    // the state file of the checkpoint a resume would choose), on the files a real training
    // wrote; a damaged newest checkpoint with a whole one before it is passed over, as the
    // resume passes it over.
    #[test]
    fn try_with_checkpoint_dir_verifies_the_checkpoint_a_resume_would_choose() {
        use crate::mlp::MlpComponents;
        use burn_accelerate::AccelerateConfig;
        use burn_accelerate::train::AccelerateStrategy;
        use burn_accelerate_checkpoint::{FileDigest, Manifest};
        use std::path::{Path, PathBuf};

        let root =
            std::env::temp_dir().join(format!("burn-accelerate-precheck-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let written = root.join("written");
        let config = |dir: &Path, epochs: usize| {
            small(Precision::F32)
                .with_epochs(epochs)
                .with_train_items(256)
                .with_valid_items(64)
                .with_checkpoint_dir(Some(dir.to_string_lossy().into_owned()))
        };
        // Epochs 1 and 2, each a whole checkpoint (the strategy keeps the newest 2).
        train_with_rule::<Train>(&config(&written, 2), SmallOps::KeepF32).unwrap();
        let precheck = |dir: &Path| {
            AccelerateStrategy::<MlpComponents<Train>>::new(
                AccelerateConfig::new(),
                &Default::default(),
            )
            .unwrap()
            .try_with_checkpoint_dir(dir)
            .map(drop)
        };
        precheck(&written).unwrap();
        // A copy of what the training wrote, for each damage.
        let mut copies = 0;
        let mut copy = || -> PathBuf {
            copies += 1;
            let dir = root.join(format!("copy-{copies}"));
            std::fs::create_dir_all(&dir).unwrap();
            for file in std::fs::read_dir(&written).unwrap() {
                let file = file.unwrap();
                std::fs::copy(file.path(), dir.join(file.file_name())).unwrap();
            }
            dir
        };
        // Random bytes (a fixed xorshift: the same bytes every run) of the file's length.
        let scramble = |path: &Path| {
            let len = std::fs::metadata(path).unwrap().len() as usize;
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            std::fs::write(path, bytes).unwrap();
        };
        let drop_epoch = |dir: &Path, epoch: usize| {
            let mut manifest = Manifest::read(dir).unwrap();
            manifest.checkpoints.retain(|c| c.epoch != epoch);
            manifest.write(dir).unwrap();
        };
        let checkpoint_error = |dir: &Path| match precheck(dir) {
            Err(AccelerateError::Checkpoint { path, reason }) => (PathBuf::from(path), reason),
            other => panic!(
                "expected a checkpoint error for {}, got {other:?}",
                dir.display()
            ),
        };
        let manifest_of = |dir: &Path| dir.join("accelerate-checkpoints.json");

        // Random bytes over the newest state file: it fails its checksum, and epoch 1 is whole.
        let fallback = copy();
        scramble(&fallback.join("accelerate-2.json"));
        precheck(&fallback).unwrap();
        // The resume passes over it too (it trains epoch 2 again, from epoch 1's checkpoint).
        let resumed = train_with_rule::<Train>(&config(&fallback, 2), SmallOps::KeepF32).unwrap();
        assert_eq!(resumed.stats.resumed_from, Some(1));

        // The same with no checkpoint before it: no usable checkpoint remains.
        let only = copy();
        drop_epoch(&only, 1);
        scramble(&only.join("accelerate-2.json"));
        let (path, reason) = checkpoint_error(&only);
        assert_eq!(path, manifest_of(&only), "{reason}");
        assert!(
            reason.contains("epoch 2: accelerate-2.json does not hold what was written"),
            "{reason}"
        );

        // Random bytes over the state file, listed with their own checksum (as a program that
        // rewrote the manifest would leave it): it verifies, but does not decode, and the resume
        // would stop there, not fall back.
        let relisted = copy();
        let state = relisted.join("accelerate-2.json");
        scramble(&state);
        let digest = FileDigest::of("accelerate-2.json", &std::fs::read(&state).unwrap());
        Manifest::read(&relisted)
            .unwrap()
            .relisted(2, digest)
            .unwrap()
            .write(&relisted)
            .unwrap();
        let (path, reason) = checkpoint_error(&relisted);
        assert_eq!(path, state, "{reason}");
        assert!(reason.contains("is not a checkpoint state"), "{reason}");

        // A record file altered at its length: its checksum says so, naming it.
        let altered = copy();
        drop_epoch(&altered, 1);
        let model = altered.join("accelerate-2-model.mpk");
        let mut bytes = std::fs::read(&model).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&model, bytes).unwrap();
        let (path, reason) = checkpoint_error(&altered);
        assert_eq!(path, manifest_of(&altered), "{reason}");
        assert!(
            reason.contains("accelerate-2-model.mpk does not hold what was written (SHA-256"),
            "{reason}"
        );

        // The manifest cut short.
        let cut = copy();
        let manifest = std::fs::read(manifest_of(&cut)).unwrap();
        std::fs::write(manifest_of(&cut), &manifest[..manifest.len() / 2]).unwrap();
        let (path, reason) = checkpoint_error(&cut);
        assert_eq!(path, manifest_of(&cut), "{reason}");
        assert!(reason.contains("cannot be parsed"), "{reason}");

        // A damaged directory given to the example's run: the same error, before training.
        let err = train_with_rule::<Train>(&config(&only, 3), SmallOps::KeepF32).unwrap_err();
        assert!(
            matches!(&err, AccelerateError::Checkpoint { path, .. } if Path::new(path) == manifest_of(&only)),
            "{err}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    // The checkpoint of epoch 1 of the example's run (F32, 256 items, width 64) in `dir`.
    fn first_epoch_checkpoint(dir: &std::path::Path) {
        let _ = std::fs::remove_dir_all(dir);
        let config = small(Precision::F32)
            .with_epochs(1)
            .with_train_items(256)
            .with_valid_items(64)
            .with_checkpoint_dir(Some(dir.to_string_lossy().into_owned()));
        train_with_rule::<Train>(&config, SmallOps::KeepF32).unwrap();
    }

    // Resumes from `dir` as the example's run does up to epoch 2 (the settings of
    // `first_epoch_checkpoint`), with `between` run once the directory is checked and before
    // the training starts: the epoch resumed from, and the trained model's logits on the
    // validation set.
    fn resume_from(dir: &std::path::Path, between: impl FnOnce()) -> (Option<usize>, Vec<f32>) {
        use crate::mlp::{BlobBatcher, Mlp, MlpComponents, QuietRenderer};
        use burn::data::dataloader::DataLoaderBuilder;
        use burn::data::dataloader::batcher::Batcher;
        use burn::data::dataset::InMemDataset;
        use burn::optim::AdamConfig;
        use burn::tensor::backend::{AutodiffBackend, Backend};
        use burn::train::{Learner, SupervisedTraining};
        use burn_accelerate::AccelerateConfig;
        use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
        use burn_accelerate::distributed::ProcessState;
        use burn_accelerate::train::{AccelerateStrategy, WithAccelerate};
        use std::sync::Arc;

        type Inner = <Train as AutodiffBackend>::InnerBackend;
        let _one = ONE_TRAINING.lock().unwrap_or_else(|e| e.into_inner());
        let device = Default::default();
        let train = ShardLoaderBuilder::new(
            DataLoaderConfig::new(64)
                .with_shuffle(true)
                .with_data_seed(Some(42)),
            InMemDataset::new(mlp::blobs(256, 1)),
            BlobBatcher,
        )
        .build_for(&ProcessState::from_env().unwrap(), device)
        .unwrap();
        let accelerate = AccelerateConfig::new().with_small_ops(Some(SmallOps::KeepF32));
        let strategy = AccelerateStrategy::<MlpComponents<Train>>::new(accelerate, &device)
            .unwrap()
            .try_with_checkpoint_dir(dir)
            .unwrap()
            .with_checkpointed_loader(&train);
        let report = strategy.report();
        between();
        let valid_data = mlp::blobs(64, 2);
        let valid = DataLoaderBuilder::<Inner, _, _>::new(BlobBatcher)
            .batch_size(64)
            .build(InMemDataset::new(valid_data.clone()));
        Train::seed(&device, 42);
        let model = Mlp::<Train>::new(64, &device);
        let learner = Learner::new(model, AdamConfig::new().init(), 1e-3);
        let artifacts = dir.with_extension("artifacts");
        let result = SupervisedTraining::new(&artifacts, Arc::new(train), valid)
            .num_epochs(2)
            .renderer(QuietRenderer)
            .with_application_logger(None)
            .with_accelerate(strategy.with_artifact_dir(&artifacts))
            .launch(learner);
        let _ = std::fs::remove_dir_all(&artifacts);
        let x = Batcher::<Inner, _, _>::batch(&BlobBatcher, valid_data, &device).x;
        let logits = result.model.forward(x).into_data().to_vec().unwrap();
        (report.stats().resumed_from, logits)
    }

    // Issue 49 / 46: the resume loads the checkpoint `try_with_checkpoint_dir` read and
    // verified, from memory, the loss scale and the loaders' positions included: files changed
    // on disk between the check and the training change nothing (read again, the altered
    // records would fail their checksums, and the other state file would be restored).
    #[test]
    fn the_resume_loads_the_checkpoint_the_start_up_check_verified_not_the_files_again() {
        use burn_accelerate_checkpoint::{FileDigest, Manifest};

        let root = std::env::temp_dir().join(format!(
            "burn-accelerate-verified-once-{}",
            std::process::id()
        ));
        let written = root.join("written");
        first_epoch_checkpoint(&written);
        let copy = |name: &str| {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            for file in std::fs::read_dir(&written).unwrap() {
                let file = file.unwrap();
                std::fs::copy(file.path(), dir.join(file.file_name())).unwrap();
            }
            dir
        };
        let (from, reference) = resume_from(&copy("reference"), || {});
        assert_eq!(from, Some(1));

        // Every record of the checkpoint overwritten with zeros of its length (the manifest
        // unchanged: read again, none would verify, and no checkpoint would be whole).
        let zeroed = copy("zeroed");
        let (from, logits) = resume_from(&zeroed, || {
            let listed = Manifest::read(&zeroed).unwrap();
            for file in &listed.entry(1).unwrap().files {
                let path = zeroed.join(&file.name);
                let len = std::fs::metadata(&path).unwrap().len() as usize;
                std::fs::write(&path, vec![0u8; len]).unwrap();
            }
        });
        assert_eq!(from, Some(1));
        assert!(
            logits == reference,
            "the resume differs from the untouched directory's"
        );

        // Another valid state file, listed in the manifest with its checksum (as the strategy
        // itself relists one): another state of the loader's sampler, so another order of
        // epoch 2 if it were restored.
        let relisted = copy("relisted");
        let (from, logits) = resume_from(&relisted, || {
            let name = "accelerate-1.json";
            let path = relisted.join(name);
            let mut state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            let rng = &mut state["loaders"][0]["sampler_rng"];
            *rng = (rng.as_u64().unwrap() ^ 1).into();
            let bytes = serde_json::to_vec_pretty(&state).unwrap();
            std::fs::write(&path, &bytes).unwrap();
            Manifest::read(&relisted)
                .unwrap()
                .relisted(1, FileDigest::of(name, &bytes))
                .unwrap()
                .write(&relisted)
                .unwrap();
        });
        assert_eq!(from, Some(1));
        assert!(
            logits == reference,
            "the resume differs from the untouched directory's"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    // Issue 49: a checkpoint of another model is refused where the model is known, before
    // training, naming the record file and the parameter: here of another width (shapes),
    // and of another module (names).
    #[test]
    fn a_checkpoint_of_another_model_is_refused_before_training_naming_the_parameter() {
        use crate::mlp::{Mlp, MlpComponents};
        use burn::module::Module;
        use burn::nn::{Linear, LinearConfig};
        use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
        use burn_accelerate::AccelerateConfig;
        use burn_accelerate::train::AccelerateStrategy;
        use burn_accelerate_checkpoint::{FileDigest, Manifest};
        use std::path::Path;

        #[derive(Module, Debug)]
        struct Other<B: burn::tensor::backend::Backend> {
            encoder: Linear<B>,
            head: Linear<B>,
        }

        let root = std::env::temp_dir().join(format!(
            "burn-accelerate-other-model-{}",
            std::process::id()
        ));
        let shapes = root.join("shapes");
        first_epoch_checkpoint(&shapes);
        let device = Default::default();
        let check = |dir: &Path, hidden: usize| {
            AccelerateStrategy::<MlpComponents<Train>>::new(AccelerateConfig::new(), &device)
                .unwrap()
                .try_with_checkpoint_dir(dir)
                .unwrap()
                .check_checkpoint_fits(&Mlp::new(hidden, &device))
        };
        let refused = |dir: &Path, hidden: usize| match check(dir, hidden) {
            Err(AccelerateError::Checkpoint { path, reason }) => {
                assert_eq!(
                    Path::new(&path),
                    dir.join("accelerate-1-model.mpk"),
                    "{reason}"
                );
                reason
            }
            other => panic!("expected a checkpoint error naming the model's record, got {other:?}"),
        };
        // The model that wrote it fits.
        check(&shapes, 64).unwrap();
        // Another width: the first parameter of another shape is named, with both shapes.
        let reason = refused(&shapes, 32);
        assert!(reason.contains("fc1.weight"), "{reason}");
        assert!(
            reason.contains("[8, 64]") && reason.contains("[8, 32]"),
            "{reason}"
        );
        // The example's run says it before training, as the same error.
        let config = small(Precision::F32)
            .with_epochs(2)
            .with_hidden(32)
            .with_checkpoint_dir(Some(shapes.to_string_lossy().into_owned()));
        let err = train_with_rule::<Train>(&config, SmallOps::KeepF32).unwrap_err();
        assert!(
            matches!(&err, AccelerateError::Checkpoint { path, .. } if Path::new(path) == shapes.join("accelerate-1-model.mpk")),
            "{err}"
        );

        // A record of another module, listed with its checksum: the parameter it lacks.
        let names = root.join("names");
        std::fs::create_dir_all(&names).unwrap();
        for file in std::fs::read_dir(&shapes).unwrap() {
            let file = file.unwrap();
            std::fs::copy(file.path(), names.join(file.file_name())).unwrap();
        }
        let other = Other::<Train> {
            encoder: LinearConfig::new(8, 64).init(&device),
            head: LinearConfig::new(64, 4).init(&device),
        };
        let bytes = Recorder::<Train>::record(
            &NamedMpkBytesRecorder::<FullPrecisionSettings>::default(),
            other.into_record(),
            (),
        )
        .unwrap();
        std::fs::write(names.join("accelerate-1-model.mpk"), &bytes).unwrap();
        Manifest::read(&names)
            .unwrap()
            .relisted(1, FileDigest::of("accelerate-1-model.mpk", &bytes))
            .unwrap()
            .write(&names)
            .unwrap();
        let reason = refused(&names, 64);
        assert!(
            reason.contains("parameter `fc1.bias` (shape [64]) is not in the record"),
            "{reason}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn small(precision: Precision) -> DemoConfig {
        DemoConfig::new()
            .with_precision(precision)
            .with_epochs(3)
            .with_train_items(2048)
            .with_valid_items(512)
            .with_allow_fallback(false)
    }

    #[test]
    fn half_precisions_end_within_two_percent_of_f32() {
        let f32_run = train::<Train>(&small(Precision::F32)).unwrap();
        assert!(f32_run.loss.is_finite());
        // The model learned something: 4 classes, chance is 0.25.
        assert!(f32_run.accuracy > 0.5, "{}", f32_run.summary_line());
        for precision in [Precision::Bf16, Precision::F16] {
            let run = train::<Train>(&small(precision)).unwrap();
            assert_eq!(run.stats.precision, precision);
            assert!(!run.stats.fell_back);
            let rel = (run.loss - f32_run.loss).abs() / f32_run.loss;
            assert!(
                rel < 0.02,
                "{precision:?}: {} vs f32 {} ({:.2}%)",
                run.summary_line(),
                f32_run.summary_line(),
                rel * 100.0
            );
        }
    }

    #[test]
    fn the_last_line_says_when_small_ops_kept_everything_in_f32() {
        // The example's defaults under the default rule: at width 64 every linear is small,
        // so bf16 runs nothing in bf16 and ends at f32's bits, and the line says why.
        let tiny = |precision| {
            DemoConfig::new()
                .with_precision(precision)
                .with_epochs(1)
                .with_train_items(256)
                .with_valid_items(64)
        };
        let keep = SmallOps::KeepF32;
        let f32_run = train_with_rule::<Train>(&tiny(Precision::F32), keep).unwrap();
        let bf16_run = train_with_rule::<Train>(&tiny(Precision::Bf16), keep).unwrap();
        let line = bf16_run.summary_line();
        assert_eq!(bf16_run.stats.lower_ops.half_ops, 0, "{line}");
        assert!(
            line.contains("below autocast's small-op threshold"),
            "{line}"
        );
        assert_eq!(bf16_run.loss.to_bits(), f32_run.loss.to_bits(), "{line}");
        // At `--hidden 512` the hidden layer (2·64·512² flops) runs in bf16: the line counts
        // it, has nothing to explain, and the loss moves off f32's.
        let wide = |precision| tiny(precision).with_hidden(512);
        let f32_run = train_with_rule::<Train>(&wide(Precision::F32), keep).unwrap();
        let bf16_run = train_with_rule::<Train>(&wide(Precision::Bf16), keep).unwrap();
        let line = bf16_run.summary_line();
        let ops = bf16_run.stats.lower_ops;
        assert!(ops.half_ops > 0 && ops.small_ops > 0, "{line}");
        assert!(!line.contains("threshold"), "{line}");
        assert_ne!(bf16_run.loss.to_bits(), f32_run.loss.to_bits(), "{line}");
    }

    #[test]
    fn fp8_ends_within_five_percent_of_f32() {
        use burn_accelerate::fp8::Fp8Mode;
        let f32_run = train::<Train>(&small(Precision::F32)).unwrap();
        for mode in [Fp8Mode::E4M3, Fp8Mode::Hybrid] {
            let run = train::<Train>(&small(Precision::Fp8(mode))).unwrap();
            let rel = (run.loss - f32_run.loss).abs() / f32_run.loss;
            assert!(
                rel < 0.05,
                "{mode:?}: {} vs f32 {} ({:.2}%)",
                run.summary_line(),
                f32_run.summary_line(),
                rel * 100.0
            );
        }
    }

    #[test]
    fn partial_last_window_steps_optimizer_and_scheduler_at_epoch_end() {
        // 10 batches of 16 with K = 4: windows of 4, 4 and 2 batches, so 3 optimizer steps an
        // epoch (Burn 0.21's own loop drops the window of 2 and steps the scheduler 10 times).
        let config = DemoConfig::new()
            .with_grad_accum(4)
            .with_epochs(2)
            .with_train_items(160)
            .with_valid_items(32)
            .with_batch_size(16);
        let run = train::<Train>(&config).unwrap();
        assert_eq!(run.stats.epochs.len(), 2);
        for epoch in &run.stats.epochs {
            assert_eq!(epoch.batches, 10, "{epoch:?}");
            assert_eq!(epoch.optimizer_steps, 3, "{epoch:?}");
            assert_eq!(epoch.scheduler_steps, 3, "{epoch:?}");
            assert_eq!(epoch.skipped_steps, 0, "{epoch:?}");
        }
        // Counted by the scheduler itself, not by the loop.
        assert_eq!(run.scheduler_steps, 6);
    }

    #[test]
    fn f16_run_that_overflows_early_recovers() {
        // 2^40 times the loss overflows f16 in the backward pass: the first steps are skipped
        // while the scale backs off by half each time, then training proceeds.
        let config = small(Precision::F16).with_init_scale(Some(2f64.powi(40)));
        let run = train::<Train>(&config).unwrap();
        let skipped = run.stats.skipped_steps();
        assert!(skipped > 0, "{}", run.summary_line());
        // Each skip halved the scale (no growth within 2000 clean steps).
        assert_eq!(
            run.stats.loss_scale.loss_scale(),
            (2f64.powi(40) * 0.5f64.powi(skipped as i32)) as f32
        );
        let epoch1 = run.stats.epochs[0];
        assert_eq!(
            epoch1.optimizer_steps + epoch1.skipped_steps,
            epoch1.batches
        );
        assert_eq!(run.scheduler_steps, run.stats.optimizer_steps());
        // Finite parameters (a NaN anywhere would make the loss NaN) and a falling loss:
        // an untrained model sits near ln 4 ≈ 1.39.
        assert!(
            run.loss.is_finite() && run.loss < 0.6,
            "{}",
            run.summary_line()
        );
        assert!(run.accuracy > 0.7, "{}", run.summary_line());
    }

    #[test]
    fn a_zero_stage_over_the_devices_of_one_process_is_refused_not_ignored() {
        use crate::mlp::{BlobBatcher, Mlp, MlpComponents, blobs};
        use burn::data::dataset::InMemDataset;
        use burn_accelerate::AccelerateConfig;
        use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
        use burn_accelerate::train::AccelerateStrategy;
        use burn_accelerate::zero::ZeroStage;
        type B = Autodiff<Flex>;
        let device = Default::default();
        let shards = ShardLoaderBuilder::new(
            DataLoaderConfig::new(8),
            InMemDataset::new(blobs(16, 1)),
            BlobBatcher,
        )
        .build(&[device, device])
        .unwrap();
        let config = AccelerateConfig::new().with_zero_stage(ZeroStage::Gradients);
        let model = Mlp::<B>::new(4, &device);
        let err = AccelerateStrategy::<MlpComponents<B>>::data_parallel(config, shards, &model)
            .err()
            .expect("refused");
        assert!(
            matches!(
                err,
                AccelerateError::InvalidConfig {
                    field: "zero_stage",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("shard across processes"), "{err}");
    }

    // Stage 3 runs under `with_accelerate` (several processes: tests/processes,
    // `stage_3_with_accelerate_ends_where_stage_2_and_the_hand_written_loop_do`); on one process
    // it shards nothing, and the training is stage 0's to the bit.
    #[test]
    fn zero_stage_3_with_accelerate_on_one_process_trains_as_stage_0() {
        use burn_accelerate::zero::ZeroStage;
        let config = small(Precision::F32).with_epochs(1);
        let stage0 = train::<Train>(&config).unwrap();
        let stage3 =
            train::<Train>(&config.clone().with_zero_stage(ZeroStage::Parameters)).unwrap();
        assert_eq!(stage3.loss.to_bits(), stage0.loss.to_bits());
        assert_eq!(
            stage3.stats.optimizer_steps(),
            stage0.stats.optimizer_steps()
        );
    }

    #[test]
    fn mixed_precision_on_a_plain_autodiff_backend_is_a_typed_error() {
        let err = train::<Autodiff<Flex>>(&small(Precision::Bf16)).unwrap_err();
        assert!(
            matches!(
                err,
                AccelerateError::NotAccelerated {
                    precision: Precision::Bf16,
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    use burn::backend::NdArray;

    type Train = Accelerated<Autodiff<NdArray>>;

    fn tiny(precision: Precision) -> DemoConfig {
        DemoConfig::new()
            .with_precision(precision)
            .with_epochs(1)
            .with_train_items(256)
            .with_valid_items(64)
    }

    #[test]
    fn autocast_request_runs_in_f32_with_the_fallback_reported() {
        let run = train::<Train>(&tiny(Precision::Bf16)).unwrap();
        assert!(run.stats.fell_back);
        assert_eq!(run.stats.requested, Precision::Bf16);
        assert_eq!(run.stats.precision, Precision::F32);
        assert!(run.loss.is_finite());
        // Trained in f32 with autocast off: no op was lowered, so none is counted.
        assert!(
            run.summary_line().contains(" precision=f32 half_ops=0/0 "),
            "{}",
            run.summary_line()
        );
    }

    #[test]
    fn without_fallback_the_request_is_refused() {
        let err = train::<Train>(&tiny(Precision::F16).with_allow_fallback(false)).unwrap_err();
        assert!(
            matches!(err, AccelerateError::UnsupportedPrecision { .. }),
            "{err}"
        );
    }
}

/// Burn's own machinery under the strategy: file checkpoints, resuming with `.checkpoint(n)`,
/// and the interrupter.
#[cfg(feature = "flex")]
mod burn_machinery {
    use std::path::Path;
    use std::sync::Arc;

    use crate::mlp::{BlobBatcher, Mlp, MlpComponents, QuietRenderer, blobs};
    use burn::backend::Flex;
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::data::dataset::InMemDataset;
    use burn::optim::AdamConfig;
    use burn::record::CompactRecorder;
    use burn::tensor::backend::Backend;
    use burn::train::metric::LossMetric;
    use burn::train::{Learner, SupervisedTraining};
    use burn_accelerate::AccelerateConfig;
    use burn_accelerate::scaler::GradScalerConfig;
    use burn_accelerate::train::metrics::AccelerateMetric;
    use burn_accelerate::train::{
        AccelerateStrategy, TrainingReport, TrainingStats, WithAccelerate,
    };

    use super::*;

    type Train = Accelerated<Autodiff<Flex>>;
    type Components = MlpComponents<Train>;
    type Training = SupervisedTraining<Components>;

    // The net is tiny: its trainings cast every lower-class op (PyTorch's rule), so that f16
    // and its loss scaling are what runs.
    fn cast_small() -> AccelerateConfig {
        AccelerateConfig::new().with_small_ops(Some(SmallOps::Cast))
    }

    // 4 batches of 32 an epoch, in bf16 with windows of 3 (3 + 1).
    fn training(dir: &Path) -> (Training, AccelerateStrategy<Components>) {
        let strategy = AccelerateStrategy::new(
            cast_small()
                .with_mixed_precision(Precision::Bf16)
                .with_gradient_accumulation_steps(3),
            &Default::default(),
        )
        .unwrap();
        let builder = training_with(dir, strategy.report());
        (builder, strategy)
    }

    fn training_with(dir: &Path, report: TrainingReport) -> Training {
        let train = DataLoaderBuilder::<Train, _, _>::new(BlobBatcher)
            .batch_size(32)
            .build(InMemDataset::new(blobs(128, 1)));
        let valid = DataLoaderBuilder::<Accelerated<Flex>, _, _>::new(BlobBatcher)
            .batch_size(32)
            .build(InMemDataset::new(blobs(64, 2)));
        SupervisedTraining::new(dir, train, valid)
            .metric_train_numeric(AccelerateMetric::loss_scale(&report))
            .metric_train_numeric(AccelerateMetric::skipped_steps(&report))
            .metric_train_numeric(LossMetric::new())
            .metric_valid_numeric(LossMetric::new())
            .renderer(QuietRenderer)
            .with_application_logger(None)
    }

    fn learner() -> Learner<Components> {
        let device = Default::default();
        Train::seed(&device, 5);
        Learner::new(Mlp::new(16, &device), AdamConfig::new().init(), 1e-3)
    }

    fn launch(builder: Training, strategy: AccelerateStrategy<Components>) -> TrainingStats {
        launch_model(builder, strategy).0
    }

    // The stats and the trained model's logits on a fixed batch.
    fn launch_model(
        builder: Training,
        strategy: AccelerateStrategy<Components>,
    ) -> (TrainingStats, Vec<f32>) {
        let _one = ONE_TRAINING.lock().unwrap_or_else(|e| e.into_inner());
        let report = strategy.report();
        let model = builder.with_accelerate(strategy).launch(learner()).model;
        let batch = burn::data::dataloader::batcher::Batcher::<Accelerated<Flex>, _, _>::batch(
            &BlobBatcher,
            blobs(16, 9),
            &Default::default(),
        );
        let logits = model.forward(batch.x).into_data().to_vec::<f32>().unwrap();
        (report.stats(), logits)
    }

    #[test]
    fn file_checkpoints_are_written_and_resumed_from() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-checkpoints-{}",
            std::process::id()
        ));
        let (builder, strategy) = training(&dir);
        let stats = launch(
            builder
                .num_epochs(2)
                .with_file_checkpointer(CompactRecorder::new()),
            strategy,
        );
        assert_eq!(stats.epochs.len(), 2);
        assert!(stats.epochs.iter().all(|e| e.optimizer_steps == 2));
        for name in ["model-2.mpk", "optim-2.mpk", "scheduler-2.mpk"] {
            let path = dir.join("checkpoint").join(name);
            assert!(path.exists(), "{} missing", path.display());
        }

        // Resumed from epoch 2's checkpoint: only epoch 3 runs.
        let (builder, strategy) = training(&dir);
        let stats = launch(
            builder
                .num_epochs(3)
                .checkpoint(2)
                .with_file_checkpointer(CompactRecorder::new()),
            strategy,
        );
        let _ = std::fs::remove_dir_all(&dir);
        let epochs: Vec<usize> = stats.epochs.iter().map(|e| e.epoch).collect();
        assert_eq!(epochs, [3]);
    }

    // f16 from a scale of 2^22: epoch 1 overflows and backs off; epoch 2 runs at the scale
    // reached.
    fn f16_training(dir: &Path) -> (Training, AccelerateStrategy<Components>) {
        let strategy = AccelerateStrategy::new(
            cast_small()
                .with_mixed_precision(Precision::F16)
                .with_grad_scaler(GradScalerConfig::new().with_init_scale(2f64.powi(22))),
            &Default::default(),
        )
        .unwrap()
        .with_checkpoint_dir(dir.join("checkpoint"));
        let builder = training_with(dir, strategy.report());
        (
            builder.with_file_checkpointer(CompactRecorder::new()),
            strategy,
        )
    }

    #[test]
    fn a_resumed_run_goes_on_with_the_saved_loss_scale() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-resume-{}",
            std::process::id()
        ));
        let (builder, strategy) = f16_training(&dir);
        let whole = launch(builder.num_epochs(2), strategy);
        assert!(whole.epochs[0].skipped_steps > 0, "{whole:?}");
        assert!(
            whole.epochs[1].skipped_steps < whole.epochs[0].skipped_steps,
            "{whole:?}"
        );

        let (builder, strategy) = f16_training(&dir);
        let resumed = launch(builder.num_epochs(2).checkpoint(1), strategy);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(resumed.epochs.len(), 1);
        // Without the saved scale, epoch 2 would start over at 2^40 and skip again.
        assert_eq!(resumed.epochs[0], whole.epochs[1]);
        assert_eq!(resumed.loss_scale, whole.loss_scale);
    }

    // As the `Accelerator`'s `load_state` refuses it (tests/accelerator.rs,
    // `load_state_refuses_a_checkpoint_from_other_settings`): a resumed run with another
    // window would step at other batches than the run that saved the checkpoint.
    #[test]
    fn a_checkpoint_saved_with_other_accumulation_is_refused_naming_it() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-resume-window-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let run = |steps: usize, epochs: usize| {
            let strategy = AccelerateStrategy::new(
                cast_small().with_gradient_accumulation_steps(steps),
                &Default::default(),
            )
            .unwrap()
            .with_checkpoint_dir(dir.join("checkpoint"));
            let builder = training_with(&dir, strategy.report()).num_epochs(epochs);
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| launch(builder, strategy)))
                .map_err(|payload| {
                    payload
                        .downcast_ref::<String>()
                        .cloned()
                        .unwrap_or_default()
                })
        };
        let saved = run(2, 1).unwrap();
        assert_eq!(saved.epochs.len(), 1);
        let refused = run(3, 2).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            refused.contains(
                "cannot resume: cannot restore gradient_accumulation_steps: the checkpoint was \
                 saved with 2, this accelerator has 3"
            ),
            "{refused}"
        );
    }

    fn list(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.extend(list(&path));
            } else {
                out.push(path.display().to_string());
            }
        }
        out
    }

    #[test]
    fn a_resumed_run_ends_with_the_parameters_of_the_uninterrupted_one() {
        // Full-precision records (Burn's `CompactRecorder` stores f16) and an unshuffled
        // loader, so that the resumed epoch sees the same batches.
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-resume-exact-{}",
            std::process::id()
        ));
        let f16 = |dir: &Path| {
            let strategy = AccelerateStrategy::new(
                cast_small()
                    .with_mixed_precision(Precision::F16)
                    .with_gradient_accumulation_steps(3)
                    .with_grad_scaler(GradScalerConfig::new().with_init_scale(2f64.powi(22))),
                &Default::default(),
            )
            .unwrap()
            .with_checkpoint_dir(dir.join("checkpoint"));
            let builder =
                training_with(dir, strategy.report())
                    .with_file_checkpointer(burn::record::NamedMpkFileRecorder::<
                        burn::record::FullPrecisionSettings,
                    >::new());
            (builder, strategy)
        };
        let (builder, strategy) = f16(&dir);
        let (whole, whole_logits) = launch_model(builder.num_epochs(2), strategy);
        let (builder, strategy) = f16(&dir);
        let (resumed, resumed_logits) = launch_model(builder.num_epochs(2).checkpoint(1), strategy);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(resumed.epochs[..], whole.epochs[1..]);
        assert_eq!(resumed_logits, whole_logits);
    }

    // A shuffled, seeded `ShardLoader` as Burn's training loader, 2 epochs of 4 batches (Burn
    // keeps the last 2 checkpoints); with `tracked`, the strategy saves and restores the
    // loader's position with the checkpoints.
    fn shuffled_run(
        dir: &Path,
        tracked: bool,
        checkpoint: Option<usize>,
    ) -> Result<(TrainingStats, Vec<f32>), String> {
        use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};

        let loader = ShardLoaderBuilder::new(
            DataLoaderConfig::new(32)
                .with_shuffle(true)
                .with_data_seed(Some(11)),
            InMemDataset::new(blobs(128, 1)),
            BlobBatcher,
        )
        .build(&[Default::default()])
        .unwrap()
        .remove(0);
        let mut strategy = AccelerateStrategy::new(cast_small(), &Default::default())
            .unwrap()
            .with_checkpoint_dir(dir.join("checkpoint"));
        if tracked {
            strategy = strategy.with_checkpointed_loader(&loader);
        }
        let valid = DataLoaderBuilder::<Accelerated<Flex>, _, _>::new(BlobBatcher)
            .batch_size(32)
            .build(InMemDataset::new(blobs(64, 2)));
        let mut builder = SupervisedTraining::new(dir, Arc::new(loader), valid)
            .num_epochs(2)
            .renderer(QuietRenderer)
            .with_application_logger(None)
            .with_file_checkpointer(burn::record::NamedMpkFileRecorder::<
                burn::record::FullPrecisionSettings,
            >::new());
        if let Some(epoch) = checkpoint {
            builder = builder.checkpoint(epoch);
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            launch_model(builder, strategy)
        }));
        caught.map_err(|payload| {
            payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default()
        })
    }

    #[test]
    fn a_resumed_run_sees_the_shuffled_order_of_the_uninterrupted_one() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-resume-shuffled-{}",
            std::process::id()
        ));
        let (whole, whole_logits) = shuffled_run(&dir, true, None).unwrap();
        let saved =
            burn_accelerate::train::AccelerateCheckpoint::load_epoch(&dir.join("checkpoint"), 1)
                .unwrap()
                .unwrap();
        // After epoch 1 (the loader's epoch 0) the next iterator starts the loader's epoch 1.
        assert_eq!(saved.loaders.len(), 1);
        assert_eq!((saved.loaders[0].epoch, saved.loaders[0].position), (1, 0));
        assert_eq!(saved.loaders[0].seed, 11);

        let (resumed, resumed_logits) = shuffled_run(&dir, true, Some(1)).unwrap();
        assert_eq!(resumed.epochs[..], whole.epochs[1..]);
        assert_eq!(resumed_logits, whole_logits);

        // Without the loader's position the resumed epochs replay epoch 1's order: another
        // run, which is what the position is for.
        let (_, untracked_logits) = shuffled_run(&dir, false, Some(1)).unwrap();
        assert_ne!(untracked_logits, whole_logits);

        // A checkpoint written with the loader tracked cannot be resumed by a strategy that
        // tracks a different number of loaders without saying so.
        std::fs::write(
            burn_accelerate::train::AccelerateCheckpoint::path(&dir.join("checkpoint"), 1),
            serde_json::to_string(&{
                let mut two = saved.clone();
                two.loaders.push(two.loaders[0]);
                two
            })
            .unwrap(),
        )
        .unwrap();
        let err = shuffled_run(&dir, true, Some(1)).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            err.contains("cannot resume") && err.contains("checkpointed loaders"),
            "{err}"
        );
    }

    #[test]
    fn loss_scale_and_skipped_steps_reach_burns_metric_logs() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-metrics-{}",
            std::process::id()
        ));
        let (builder, strategy) = f16_training(&dir);
        let stats = launch(builder.num_epochs(1), strategy);
        let epoch1 = dir.join("train").join("epoch-1");
        let read = |name: &str| {
            std::fs::read_to_string(epoch1.join(format!("{name}.log")))
                .unwrap_or_else(|e| panic!("{name} in {}: {e}; {:?}", epoch1.display(), list(&dir)))
        };
        // Burn's file logger spells the names' spaces as underscores.
        let scales = read("Loss_Scale_[f16]");
        let skipped = read("Skipped_Steps_[f16]");
        let _ = std::fs::remove_dir_all(&dir);
        // One line a batch; the last skip count logged is the run's.
        assert_eq!(scales.lines().count(), stats.epochs[0].batches, "{scales}");
        let last: f64 = skipped
            .lines()
            .last()
            .and_then(|l| l.split(',').next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{skipped}"));
        assert_eq!(last as usize, stats.skipped_steps(), "{skipped}");
    }

    #[test]
    fn the_interrupter_stops_training_after_the_current_batch() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-train-interrupt-{}",
            std::process::id()
        ));
        let (builder, strategy) = training(&dir);
        let builder = builder.num_epochs(3);
        builder.interrupter().stop(Some("test"));
        let stats = launch(builder, strategy);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(stats.epochs.len(), 1);
        assert_eq!(stats.epochs[0].batches, 1);
        assert_eq!(stats.epochs[0].optimizer_steps, 0);
    }
}

// The test hook of `examples/common/mlp.rs` (the runs that use it are in tests/faults).
mod fail_at_hook {
    use crate::mlp::{FailAction, StepFailure, parse_fail_at};

    #[test]
    fn the_fail_at_hook_reads_attempts_ranks_steps_and_actions() {
        assert_eq!(
            parse_fail_at("0:1:21, 1:0:5:exit=7").unwrap(),
            [
                StepFailure {
                    restart: 0,
                    rank: 1,
                    step: 21,
                    action: FailAction::Kill
                },
                StepFailure {
                    restart: 1,
                    rank: 0,
                    step: 5,
                    action: FailAction::Exit(7)
                }
            ]
        );
        assert_eq!(parse_fail_at("").unwrap(), []);
        assert!(
            parse_fail_at("0:1")
                .unwrap_err()
                .contains("RESTART:RANK:STEP")
        );
        assert!(parse_fail_at("0:x:3").unwrap_err().contains("the rank"));
        assert_eq!(
            parse_fail_at("2:0:1:stop").unwrap()[0].action,
            FailAction::Stop
        );
        assert!(
            parse_fail_at("0:1:3:halt")
                .unwrap_err()
                .contains("`kill`, `stop` or `exit=N`")
        );
        assert!(parse_fail_at("0:1:3:exit=").unwrap_err().contains("exit=N"));
    }
}
