//! Two starts of one training, one on a quiet machine and one with a busy loop on every core,
//! make the same cast decisions and end with the same bits (issue 37): what runs in half
//! precision, and on which kernel path, is a rule over the op, its shapes, the policy and the
//! configuration, never a timing. (The capability probe still times a matmul at start-up, to
//! flag a dtype that runs tens of times slower than f32; nothing else reads its clock.)
//!
//! The test binary starts itself twice as a worker (`--exact` this test, with
//! [`WORKER`] set); the worker trains the demo MLP under bf16 and prints one line with the
//! cast decisions and the bits of the result. Its hidden layer's product
//! (`[64, 448] × [448, 448]`, 25.7 MFLOP) lies where the threshold used to move with the load
//! (15–41 MFLOP on the 2-core machine): a timed threshold cast it on one start and kept it in
//! f32 on another.
#![cfg(feature = "flex")]

#[path = "../examples/common/mlp.rs"]
mod mlp;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use burn::backend::{Autodiff, Flex};
use burn_accelerate::{Accelerated, Precision, capability};
use mlp::DemoConfig;

const TEST: &str = "a_busy_machine_changes_no_cast_decision_and_no_bit";
const WORKER: &str = "BURN_ACCELERATE_LOAD_TEST_WORKER";
const LINE: &str = "load-test-result:";

type B = Accelerated<Autodiff<Flex>>;

// The worker's run: the decisions it took and the bits it ended with, on one line.
fn train_and_report() {
    // What autocast asks of the backend under the decorator, where the kernels are chosen.
    let caps = capability::probe::<Autodiff<Flex>>(&Default::default());
    let config = DemoConfig::new()
        .with_precision(Precision::Bf16)
        .with_hidden(448)
        .with_train_items(512)
        .with_valid_items(128)
        .with_epochs(1)
        .with_allow_fallback(false);
    let outcome = mlp::run::<B>(&config, &Default::default()).expect("the demo trains");
    let ops = outcome.stats.lower_ops;
    println!(
        "{LINE} bf16_via_f32={} bf16_dot_products={} min_half_flops={:?} fastest={} \
         half_ops={} half_flops={} small_ops={} small_flops={} loss_bits={:#010x} \
         accuracy_bits={:#010x}",
        caps.bf16_via_f32,
        caps.bf16_dot_products,
        caps.min_half_flops,
        caps.fastest(),
        ops.half_ops,
        ops.half_flops,
        ops.small_ops,
        ops.small_flops,
        outcome.loss.to_bits(),
        outcome.accuracy.to_bits(),
    );
}

// Runs the worker in a fresh process (so its probe runs afresh), with every core busy or not.
fn start(busy: bool) -> String {
    let stop = Arc::new(AtomicBool::new(false));
    let cores = thread::available_parallelism().map_or(2, |n| n.get());
    let spinners: Vec<_> = (0..if busy { cores } else { 0 })
        .map(|_| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        })
        .collect();
    let output = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", TEST, "--nocapture", "--test-threads", "1"])
        .env(WORKER, "1")
        .output()
        .expect("the worker starts");
    stop.store(true, Ordering::Relaxed);
    for spinner in spinners {
        spinner.join().expect("a spinner ends");
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the worker failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .find_map(|line| Some(line.split_once(LINE)?.1))
        .unwrap_or_else(|| panic!("no result line in:\n{stdout}"))
        .trim()
        .to_string()
}

#[test]
fn a_busy_machine_changes_no_cast_decision_and_no_bit() {
    if std::env::var_os(WORKER).is_some() {
        return train_and_report();
    }
    let quiet = start(false);
    let busy = start(true);
    assert_eq!(quiet, busy, "quiet start, then busy start");
    // Both kinds of decision were taken: the hidden layer in bf16, the thin ones in f32.
    let count = |key: &str| -> u64 {
        quiet
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {quiet}"))
    };
    assert!(count("half_ops") > 0 && count("small_ops") > 0, "{quiet}");
}
