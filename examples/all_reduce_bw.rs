//! The all-reduce's bandwidth and memory: `ProcessGroup::all_reduce` of f32 buffers of a few
//! sizes, timed call by call on every process, with the peak resident memory each size adds
//! over its buffer. The torch.distributed (gloo) counterpart is `benches/all_reduce_gloo.py`;
//! the figures are in BENCHMARKS.md.
//!
//! ```text
//! cargo build --release --example all_reduce_bw --bin burn-accelerate
//! target/release/burn-accelerate launch --num-processes 2 -- target/release/examples/all_reduce_bw
//! ```
//!
//! Printed by the main process, per size: the median time of a call, the algorithm bandwidth
//! (bytes / time) and the bus bandwidth (algorithm bandwidth × 2 (n − 1) / n, NCCL's and
//! nccl-tests' measure, which does not depend on n for a ring), and the largest growth of the
//! peak resident memory over the buffer on any process.

#[path = "common/memory.rs"]
mod memory;

use std::time::{Duration, Instant};

use burn_accelerate::distributed::{ProcessState, ReduceOp};
use clap::Parser;
use memory::{peak_memory_mib, reset_peak_memory};

/// Time `ProcessGroup::all_reduce` of f32 buffers.
#[derive(Parser)]
struct Args {
    /// Buffer sizes, in MiB.
    #[arg(long, value_delimiter = ',', default_values_t = [1.0, 64.0, 1024.0])]
    sizes: Vec<f64>,
    /// Timed calls per size: at least this many, and at least a second's worth.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed calls per size first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
}

fn main() {
    let args = Args::parse();
    let state = ProcessState::from_env().expect("a valid launch environment");
    let group = state.group().expect("the process group");
    let n = state.num_processes();
    if state.is_main_process() {
        println!(
            "processes={n} sizes_mib={:?} (median of >= {} calls after {} warm-up)",
            args.sizes, args.iters, args.warmup
        );
    }
    for size in &args.sizes {
        let values = (size * 1024.0 * 1024.0 / 4.0) as usize;
        let mut buffer: Vec<f32> = (0..values).map(|i| (i % 1024) as f32).collect();
        reset_peak_memory();
        let before = peak_memory_mib();
        for _ in 0..args.warmup {
            group
                .all_reduce(&mut buffer, ReduceOp::Sum)
                .expect("all-reduce");
        }
        let mut times = Vec::new();
        let started = Instant::now();
        // The main process decides when to stop, so that every process makes as many calls.
        let more = |times: &[Duration]| {
            let more = times.len() < args.iters || started.elapsed() < Duration::from_secs(1);
            group.broadcast_object(&more, 0).expect("broadcast")
        };
        while more(&times) {
            group.barrier().expect("barrier");
            let start = Instant::now();
            group
                .all_reduce(&mut buffer, ReduceOp::Sum)
                .expect("all-reduce");
            times.push(start.elapsed());
        }
        let added = peak_memory_mib() - before;
        // Every process's time of a call and memory growth: the slowest decides.
        let mut worst = [median(&mut times), added];
        let all: Vec<f64> = group.all_gather(&worst).expect("all-gather");
        for pair in all.chunks_exact(2) {
            worst[0] = worst[0].max(pair[0]);
            worst[1] = worst[1].max(pair[1]);
        }
        if state.is_main_process() {
            let bytes = (values * 4) as f64;
            let algbw = bytes / worst[0] / 1e9;
            let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
            println!(
                "size_mib={size} calls={} median_ms={:.3} algbw_gbps={algbw:.2} \
                 busbw_gbps={busbw:.2} peak_rss_added_mib={:.1}",
                times.len(),
                worst[0] * 1e3,
                worst[1]
            );
        }
    }
}

fn median(times: &mut [Duration]) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64()
}
