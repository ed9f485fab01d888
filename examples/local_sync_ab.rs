//! Should `AccelerateStrategy::data_parallel` (devices of one process) combine gradients
//! through burn-collective's local collectives instead of moving them to the main device?
//! Times, on two wgpu devices (lavapipe on a CPU), getting the sum of two devices' gradients
//! of the benchmark MLP (256 → 512 → 256: 262,912 f32) onto the first device:
//!
//! - `move`: what `data_parallel` does: the second device's worker moves its gradients to the
//!   main device (through the host: wgpu has no device-to-device copy) and the main device
//!   adds them;
//! - `all_reduce`: burn-collective's local `all_reduce` (one peer per device, one thread each),
//!   which leaves the sum on both devices;
//! - `reduce`: burn-collective's local `reduce` onto the first device.
//!
//! ```text
//! cargo run --release --features wgpu --example local_sync_ab -- --rounds 5
//! ```
//!
//! Each variant runs `--steps` times per round, rounds interleaved; medians per step are
//! printed with the sum's largest error against the host's.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use burn_accelerate::Accelerated;
use burn_collective::{
    CollectiveConfig, PeerId, ReduceOperation, all_reduce, finish_collective, reduce, register,
    reset_collective,
};
use clap::Parser;

type B = Accelerated<Wgpu>;

/// Time combining two wgpu devices' gradients three ways.
#[derive(Parser)]
struct Args {
    /// Interleaved rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Combinations timed per variant and round.
    #[arg(long, default_value_t = 20)]
    steps: usize,
}

const SHAPES: [[usize; 2]; 4] = [[256, 512], [1, 512], [512, 256], [1, 256]];

fn gradients(device: &WgpuDevice, seed: u64) -> Vec<Tensor<B, 2>> {
    <B as burn::tensor::backend::Backend>::seed(device, seed);
    SHAPES
        .iter()
        .map(|s| Tensor::random(*s, Distribution::Normal(0., 1.), device))
        .collect()
}

fn host(tensors: &[Tensor<B, 2>]) -> Vec<f32> {
    tensors
        .iter()
        .flat_map(|t| t.clone().into_data().to_vec::<f32>().unwrap())
        .collect()
}

fn max_error(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
}

// The data-parallel path: the worker moves its gradients, the main device adds.
fn moved(main: &[Tensor<B, 2>], other: &[Tensor<B, 2>], device: &WgpuDevice) -> Vec<Tensor<B, 2>> {
    let other = other.to_vec();
    let device = device.clone();
    let arrived = std::thread::spawn(move || {
        let arrived: Vec<_> = other.into_iter().map(|t| t.to_device(&device)).collect();
        <B as burn::tensor::backend::Backend>::sync(&device).unwrap();
        arrived
    })
    .join()
    .unwrap();
    main.iter()
        .cloned()
        .zip(arrived)
        .map(|(a, b)| a + b)
        .collect()
}

// burn-collective, one peer per device on a thread each; returns the first device's result.
fn collective(
    sets: [Vec<Tensor<B, 2>>; 2],
    devices: [WgpuDevice; 2],
    all: bool,
) -> Vec<Tensor<B, 2>> {
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = sets
        .into_iter()
        .zip(devices)
        .enumerate()
        .map(|(peer, (tensors, device))| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                let out: Vec<Option<Tensor<B, 2>>> = tensors
                    .into_iter()
                    .map(|t| {
                        let primitive = t.into_primitive().tensor();
                        let result = if all {
                            Some(all_reduce::<B>(
                                peer.into(),
                                primitive,
                                ReduceOperation::Sum,
                            ))
                            .transpose()
                        } else {
                            reduce::<B>(peer.into(), primitive, ReduceOperation::Sum, 0.into())
                        }
                        .unwrap();
                        result.map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
                    })
                    .collect();
                <B as burn::tensor::backend::Backend>::sync(&device).unwrap();
                out
            })
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    results
        .remove(0)
        .into_iter()
        .map(|t| t.expect("peer 0 is the root"))
        .collect()
}

fn median(mut times: Vec<Duration>) -> f64 {
    times.sort();
    times[times.len() / 2].as_secs_f64() * 1e3
}

fn main() {
    let args = Args::parse();
    let devices = [WgpuDevice::Cpu, WgpuDevice::DefaultDevice];
    let main_set = gradients(&devices[0], 1);
    let other_set = gradients(&devices[1], 2);
    let want: Vec<f32> = host(&main_set)
        .iter()
        .zip(host(&other_set))
        .map(|(a, b)| a + b)
        .collect();
    // Register both peers once (each on a thread: register waits for every peer).
    reset_collective::<B>();
    let config = CollectiveConfig::default().with_num_devices(2);
    let registrations: Vec<_> = devices
        .iter()
        .cloned()
        .enumerate()
        .map(|(peer, device)| {
            let config = config.clone();
            std::thread::spawn(move || register::<B>(PeerId::from(peer), device, config).unwrap())
        })
        .collect();
    registrations.into_iter().for_each(|h| h.join().unwrap());

    let mut times: [Vec<Duration>; 3] = Default::default();
    let mut errors = [0f32; 3];
    for _ in 0..args.rounds {
        for (variant, time) in times.iter_mut().enumerate() {
            for _ in 0..args.steps {
                let start = Instant::now();
                let sum = match variant {
                    0 => moved(&main_set, &other_set, &devices[0]),
                    1 => collective([main_set.clone(), other_set.clone()], devices.clone(), true),
                    _ => collective(
                        [main_set.clone(), other_set.clone()],
                        devices.clone(),
                        false,
                    ),
                };
                <B as burn::tensor::backend::Backend>::sync(&devices[0]).unwrap();
                time.push(start.elapsed());
                errors[variant] = errors[variant].max(max_error(&host(&sum), &want));
            }
        }
    }
    for (name, (time, error)) in ["move", "all_reduce", "reduce"]
        .iter()
        .zip(times.into_iter().zip(errors))
    {
        println!(
            "{name:<10} median {:.3} ms  max error {error:e}",
            median(time)
        );
    }
    for peer in 0..2 {
        let _ = finish_collective::<B>(PeerId::from(peer));
    }
}
