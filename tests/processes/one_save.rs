//! A whole checkpoint's save ends alike on every process, through the one function both entry
//! points end theirs with: a save the main process cannot write fails on every process, at
//! once, with the main process's reason (the others hold no whole record and wrote nothing).

use std::path::PathBuf;

use burn::backend::{Autodiff, Flex};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn_accelerate::AccelerateConfig;
use burn_accelerate::checkpoint::CheckpointDir;

use super::harness::{self, launch, report, worker};

type B = Autodiff<Flex>;

#[test]
fn a_checkpoint_the_main_process_cannot_write_fails_on_every_process_with_its_reason() {
    const TEST: &str = "one_save::a_checkpoint_the_main_process_cannot_write_fails_on_every_process_with_its_reason";
    if let Some(blocked) = worker::<PathBuf>() {
        let device = Default::default();
        let accelerator = AccelerateConfig::new().init::<B>(&device).unwrap();
        let model: Linear<B> = LinearConfig::new(2, 2).init(&device);
        let optimizer = SgdConfig::new().init::<B, Linear<B>>();
        let saved =
            accelerator.save_checkpoint(&CheckpointDir::new(&blocked), 1, &model, &optimizer);
        return report(&saved.map_err(|e| e.to_string()));
    }
    // A directory below a plain file: the main process cannot make it.
    let dir = harness::scratch_dir("one-save");
    let file = dir.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let blocked = file.join("checkpoints");
    // The collectives' timeout beyond the launch's deadline: only the main process's answer
    // ends the others' wait in time.
    let launched = launch(TEST, 2, &blocked, &["--timeout", "600"]);
    let saved: Vec<Result<(), String>> = launched.assert_success().reports(2);
    let (Err(main), Err(other)) = (&saved[0], &saved[1]) else {
        panic!("both fail: {saved:?}\n{}", launched.output());
    };
    assert!(main.contains(file.to_str().unwrap()), "{main}");
    assert!(
        other.contains("the main process's checkpoint") && other.contains(main.as_str()),
        "{other}"
    );
    harness::clean(&dir);
}
