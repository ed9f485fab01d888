//! A flood of half-open connections during a run of 2 processes (issue 49): 1,000 connections
//! that never say a word, on each port the run listens on (the rendezvous and both processes'
//! data ports), held through the run. Before authentication a stranger may cost a listener one
//! small buffer and one timeout, and a listener holds at most `MAX_PENDING` (128) strangers at
//! once (the oldest is dropped): the run's final loss must be the unflooded run's, bit for bit,
//! and each process's peak memory within 10% of the unflooded run's (issue 49).

use std::net::TcpStream;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::nn::{Initializer, Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::Tensor;
use burn_accelerate::{AccelerateConfig, Accelerator};
use serde::{Deserialize, Serialize};

use super::harness::{self, report, worker};

type B = Autodiff<Flex>;

/// Connections per port.
const FLOOD: usize = 1_000;
/// The flags the test creates in the workers' directory.
const FIRST_FLOODED: &str = "rendezvous-and-process-0-flooded";
const ALL_FLOODED: &str = "all-flooded";

/// What a process of the run ended with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Ended {
    /// The last step's loss, as bits.
    loss: u32,
    /// The process's peak resident memory (`VmHWM`), in KiB.
    peak_kib: u64,
}

fn peak_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status")
}

/// Waits for the test to create `flag` in the worker's directory: the flood is in place.
fn wait_for(flag: &str) {
    let path = std::path::Path::new(&std::env::var(harness::WORKER_DIR).unwrap()).join(flag);
    let start = Instant::now();
    while !path.exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no {flag}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// Trains a small linear model on both processes, averaging the gradients. Process 1 joins
// once the rendezvous and process 0's data port are flooded (process 0 waits for it at the
// rendezvous meanwhile), and both train once process 1's data port is flooded too.
fn training_worker() -> Ended {
    let device = Default::default();
    let state = burn_accelerate::distributed::ProcessState::from_env().unwrap();
    if state.process_index() == 1 {
        wait_for(FIRST_FLOODED);
    }
    let mut accelerator = Accelerator::<B>::new(AccelerateConfig::new(), &device).unwrap();
    wait_for(ALL_FLOODED);
    let mut model: Linear<B> = LinearConfig::new(8, 4)
        .with_initializer(Initializer::Constant { value: 0.05 })
        .init(&device);
    let mut optim = AdamConfig::new().init();
    let rank = state.process_index();
    let mut loss_bits = 0;
    for step in 0..40 {
        let _batch = accelerator.accumulate(&model);
        let x: Vec<f32> = (0..16)
            .map(|j| ((step * 32 + rank * 16 + j) as f32 * 0.37).sin())
            .collect();
        let y: Vec<f32> = (0..8)
            .map(|j| ((step * 16 + rank * 8 + j) as f32 * 0.71).cos())
            .collect();
        let x = Tensor::<B, 1>::from_floats(x.as_slice(), &device).reshape([2, 8]);
        let y = Tensor::<B, 1>::from_floats(y.as_slice(), &device).reshape([2, 4]);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        loss_bits = loss.clone().into_scalar().to_bits();
        accelerator.backward(loss, &model);
        let mut lr = 0.01;
        let (stepped, _) = accelerator
            .optimizer_step(&mut optim, model, &mut lr)
            .unwrap();
        model = stepped;
        std::thread::sleep(Duration::from_millis(50));
    }
    accelerator.wait_for_everyone().unwrap();
    Ended {
        loss: loss_bits,
        peak_kib: peak_kib(),
    }
}

/// Runs the 2 processes on fresh ports; with `flood`, holds [`FLOOD`] silent connections to
/// each listening port from before the run's first step (the rendezvous's and process 0's
/// from before process 1 joins) until the run ends.
fn run(test: &str, flood: bool) -> Vec<Ended> {
    let (main, data) = (harness::free_port(), harness::free_port());
    let dir = harness::scratch_dir(&format!("{test}-{flood}"));
    let processes: Vec<_> = (0..2)
        .map(|rank| {
            let command =
                harness::rank_of_two(test, &dir, rank, [main, data], "the flooded run's secret");
            let dir = dir.clone();
            std::thread::spawn(move || harness::run(command, dir))
        })
        .collect();
    // Silent connections to `port`, once it listens.
    let open = |port: u16| {
        let start = Instant::now();
        let mut held = Vec::with_capacity(FLOOD);
        while held.len() < FLOOD {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(stream) => held.push(stream),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
            assert!(start.elapsed() < Duration::from_secs(120), "port {port}");
        }
        held
    };
    let flag = |name: &str| std::fs::write(dir.join(name), b"").unwrap();
    let mut held = Vec::new();
    if flood {
        held.extend(open(main));
        held.extend(open(data));
    }
    flag(FIRST_FLOODED);
    if flood {
        held.extend(open(data + 1));
    }
    flag(ALL_FLOODED);
    let runs: Vec<_> = processes.into_iter().map(|p| p.join().unwrap()).collect();
    // Held through the whole run.
    assert_eq!(held.len(), if flood { 3 * FLOOD } else { 0 });
    drop(held);
    for run in &runs {
        assert!(run.status.success(), "{}", run.output());
    }
    let ended = runs[0].reports(2);
    harness::clean(&dir);
    ended
}

/// How much a flood may raise a process's peak memory, in percent of the unflooded run's
/// (issue 49's goal). Without the cap on pending handshakes, 2,000 connections to process 0's
/// two listeners cost it 10.6% (1.4 KiB each); with it, at most 2 x 128 of them are held at
/// once.
const GROWTH_PERCENT: u64 = 10;

#[test]
fn a_thousand_silent_connections_per_port_leave_the_loss_and_the_memory_within_ten_percent() {
    const TEST: &str = "flood::a_thousand_silent_connections_per_port_leave_the_loss_and_the_memory_within_ten_percent";
    if worker::<()>().is_some() {
        return report(&training_worker());
    }
    let quiet = run(TEST, false);
    let flooded = run(TEST, true);
    // Process 0 listens on the rendezvous and its data port, process 1 on its data port.
    for (rank, ports) in [(0, 2), (1, 1)] {
        assert_eq!(
            flooded[rank].loss, quiet[rank].loss,
            "rank {rank}: the final loss, as bits"
        );
        let (with, without) = (flooded[rank].peak_kib, quiet[rank].peak_kib);
        // Printed for SECURITY.md.
        eprintln!(
            "rank {rank}: peak {without} KiB quiet, {with} KiB with {} silent connections ({:+.1}%)",
            ports * FLOOD,
            (with as f64 / without as f64 - 1.0) * 100.0
        );
        let bound = without + without * GROWTH_PERCENT / 100;
        assert!(
            with <= bound,
            "rank {rank}: peak memory {with} KiB flooded, {without} KiB quiet (at most {bound}, \
             {GROWTH_PERCENT}% more)"
        );
    }
}
