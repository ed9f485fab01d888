//! Random tensors under autocast on Flex: the decorator's counter-based generator
//! (`src/cpu/counter_rng.rs`), which draws Bernoulli tensors (dropout's masks) only, against
//! Burn's sampler's Bernoulli, its seeding and its independence from the number of threads;
//! every other distribution Flex's own values bit for bit after the same seed under autocast
//! (a parameter's initial values can be drawn there), and every draw Flex's with autocast off.
//!
//! The generator and Flex's are process-wide, so every test takes one lock and seeds first:
//! each test's draws are then fixed, and its statistical checks (six standard deviations of
//! the estimated mean, where a true generator misses about one time in 10⁹) cannot flake.
#![cfg(feature = "flex")]

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::nn::DropoutConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, FloatDType, Tensor, TensorData};
use burn_accelerate::{Accelerated, Precision, autocast};

type Acc = Accelerated<Flex>;
type AccAd = Accelerated<Autodiff<Flex>>;

const HALVES_AND_F32: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

// One test at a time, for one reason: each seeds Burn's generator, which is the process's
// (`Backend::seed`; the decorator's follows it), and draws after it.
fn exclusive() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn seed<B: Backend>(seed: u64) {
    B::seed(&Default::default(), seed);
}

fn draw<B: Backend>(len: usize, distribution: Distribution, dtype: DType) -> TensorData {
    Tensor::<B, 1>::random([len], distribution, (&Default::default(), dtype)).into_data()
}

// `draw` under bf16 autocast (the tensor's dtype is still the one asked for).
fn draw_autocast<B: Backend>(len: usize, distribution: Distribution, dtype: DType) -> TensorData {
    let _bf16 = autocast::enable(Precision::Bf16);
    draw::<B>(len, distribution, dtype)
}

fn values(data: &TensorData) -> Vec<f64> {
    data.clone().convert::<f64>().to_vec::<f64>().unwrap()
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

// Six standard deviations of the mean of `n` draws of Bernoulli(p).
fn tolerance(p: f64, n: usize) -> f64 {
    6.0 * (p * (1.0 - p) / n as f64).sqrt()
}

fn check_bernoulli<B: Backend>(len: usize, p: f64, dtype: DType) {
    let data = draw_autocast::<B>(len, Distribution::Bernoulli(p), dtype);
    assert_eq!(data.dtype, dtype, "the dtype asked for");
    let v = values(&data);
    assert_eq!(v.len(), len);
    assert!(v.iter().all(|&x| x == 0.0 || x == 1.0), "p {p}, {dtype:?}");
    let m = mean(&v);
    assert!(
        (m - p).abs() <= tolerance(p, len),
        "p {p}, {dtype:?}, len {len}: mean {m}"
    );
}

fn bernoulli_means_on_an_odd_length<B: Backend>() {
    seed::<B>(1);
    for dtype in HALVES_AND_F32 {
        for p in [0.1, 0.5, 0.9] {
            check_bernoulli::<B>(1_000_003, p, dtype);
        }
    }
    // The ends: exactly, whatever the length.
    for dtype in HALVES_AND_F32 {
        for p in [0.0, 1.0] {
            check_bernoulli::<B>(10_007, p, dtype);
        }
    }
}

#[test]
fn bernoulli_means_on_an_odd_length_flex() {
    let _lock = exclusive();
    bernoulli_means_on_an_odd_length::<Acc>();
}

#[test]
fn bernoulli_means_on_an_odd_length_autodiff() {
    let _lock = exclusive();
    bernoulli_means_on_an_odd_length::<AccAd>();
}

// Lengths shorter than a counter's four values, a vector's lanes or a block: many draws,
// the mean of each position (the last ones lie in a counter's tail) and of all.
fn bernoulli_on_small_lengths<B: Backend>() {
    seed::<B>(2);
    let p = 0.9;
    for len in [1, 7, 17] {
        for dtype in HALVES_AND_F32 {
            let calls = 4_000;
            let mut per_position = vec![0.0; len];
            for _ in 0..calls {
                let data = draw_autocast::<B>(len, Distribution::Bernoulli(p), dtype);
                assert_eq!(data.dtype, dtype);
                for (sum, x) in per_position.iter_mut().zip(values(&data)) {
                    assert!(x == 0.0 || x == 1.0);
                    *sum += x;
                }
            }
            for (position, sum) in per_position.iter().enumerate() {
                let m = sum / calls as f64;
                assert!(
                    (m - p).abs() <= tolerance(p, calls),
                    "len {len}, {dtype:?}, position {position}: mean {m}"
                );
            }
            let m = per_position.iter().sum::<f64>() / (calls * len) as f64;
            assert!((m - p).abs() <= tolerance(p, calls * len), "len {len}: {m}");
        }
    }
}

#[test]
fn bernoulli_on_small_lengths_flex() {
    let _lock = exclusive();
    bernoulli_on_small_lengths::<Acc>();
}

#[test]
fn bernoulli_on_small_lengths_autodiff() {
    let _lock = exclusive();
    bernoulli_on_small_lengths::<AccAd>();
}

fn seeds_replay_and_streams_differ<B: Backend>() {
    let run = |s: u64| {
        seed::<B>(s);
        [
            draw_autocast::<B>(1_001, Distribution::Bernoulli(0.5), DType::BF16),
            draw_autocast::<B>(1_001, Distribution::Bernoulli(0.5), DType::BF16),
            draw_autocast::<B>(1_001, Distribution::Bernoulli(0.5), DType::F32),
        ]
    };
    let (first, again, other_seed) = (run(42), run(42), run(43));
    assert_eq!(first, again, "the same seed, the same tensors");
    assert_ne!(first[0], first[1], "the next call takes another stream");
    assert_ne!(first[0], other_seed[0], "another seed");
    assert_ne!(first[2], other_seed[2], "another seed");
}

#[test]
fn seeds_replay_and_streams_differ_flex() {
    let _lock = exclusive();
    seeds_replay_and_streams_differ::<Acc>();
}

#[test]
fn seeds_replay_and_streams_differ_autodiff() {
    let _lock = exclusive();
    seeds_replay_and_streams_differ::<AccAd>();
}

#[test]
fn the_flex_and_autodiff_decorators_draw_the_same_values() {
    let _lock = exclusive();
    let run = |flex: bool| {
        let draw = |d, t| match flex {
            true => draw_autocast::<Acc>(50_001, d, t),
            false => draw_autocast::<AccAd>(50_001, d, t),
        };
        seed::<Acc>(5);
        [
            draw(Distribution::Bernoulli(0.8), DType::F16),
            draw(Distribution::Bernoulli(0.3), DType::BF16),
        ]
    };
    assert_eq!(run(true), run(false));
}

// Large enough to be split into tasks on two threads.
fn drawn_on_threads(threads: usize) -> Vec<TensorData> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        seed::<Acc>(6);
        let mut out = Vec::new();
        for dtype in HALVES_AND_F32 {
            out.push(draw_autocast::<Acc>(
                300_007,
                Distribution::Bernoulli(0.9),
                dtype,
            ));
            out.push(draw_autocast::<Acc>(
                300_007,
                Distribution::Bernoulli(0.5),
                dtype,
            ));
        }
        out
    })
}

#[test]
fn one_thread_and_two_threads_draw_the_same_values() {
    let _lock = exclusive();
    assert_eq!(drawn_on_threads(1), drawn_on_threads(2));
}

// With autocast off the decorator is the backend: the same values after the same seed, for
// every distribution and dtype, a second draw included (the backend's generator advanced).
fn autocast_off_draws_the_backends_values<Plain: Backend, Decorated: Backend>() {
    let distributions = [
        Distribution::Default,
        Distribution::Bernoulli(0.9),
        Distribution::Uniform(-1.0, 2.0),
        Distribution::Normal(0.0, 1.0),
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for distribution in distributions {
            let run = |plain: bool| {
                let _off = autocast::disable();
                let draw = || match plain {
                    true => draw::<Plain>(1_003, distribution, dtype),
                    false => draw::<Decorated>(1_003, distribution, dtype),
                };
                match plain {
                    true => seed::<Plain>(7),
                    false => seed::<Decorated>(7),
                }
                [draw(), draw()]
            };
            let (plain, decorated) = (run(true), run(false));
            assert_eq!(
                plain[0].bytes, decorated[0].bytes,
                "{distribution:?} {dtype:?}"
            );
            assert_eq!(
                plain[1].bytes, decorated[1].bytes,
                "{distribution:?} {dtype:?}"
            );
            assert_eq!(decorated[0].dtype, dtype);
        }
    }
}

#[test]
fn autocast_off_draws_flexs_values_bit_for_bit() {
    let _lock = exclusive();
    autocast_off_draws_the_backends_values::<Flex, Acc>();
    autocast_off_draws_the_backends_values::<Autodiff<Flex>, AccAd>();
}

// Under autocast what the generator does not take is the backend's own: every distribution
// but Bernoulli, and f64.
#[test]
fn autocast_leaves_all_but_bernoulli_and_f64_to_flex() {
    let _lock = exclusive();
    for (distribution, dtype) in [
        (Distribution::Normal(0.0, 1.0), DType::BF16),
        (Distribution::Normal(1.0, 2.0), DType::F32),
        (Distribution::Uniform(-1.0, 1.0), DType::BF16),
        (Distribution::Uniform(-2.0, 3.0), DType::F32),
        (Distribution::Default, DType::F16),
        (Distribution::Bernoulli(0.5), DType::F64),
        (Distribution::Default, DType::F64),
    ] {
        seed::<Flex>(8);
        let flex = draw::<Flex>(513, distribution, dtype);
        seed::<Acc>(8);
        let ours = draw_autocast::<Acc>(513, distribution, dtype);
        assert_eq!(flex.bytes, ours.bytes, "{distribution:?} {dtype:?}");
    }
    // While Bernoulli in bf16 is drawn by the crate's generator: not Flex's values.
    seed::<Flex>(8);
    let flex = draw::<Flex>(513, Distribution::Bernoulli(0.5), DType::BF16);
    seed::<Acc>(8);
    let ours = draw_autocast::<Acc>(513, Distribution::Bernoulli(0.5), DType::BF16);
    assert_ne!(flex.bytes, ours.bytes);
}

// A module's parameters are initialised lazily, at their first use: under autocast a uniform
// draw can be a model's initial weights, so it is the backend's own, bit for bit the draw with
// autocast off after the same seed (a bf16 run starts from the f32 run's weights), in the
// default dtype and in the halves. Bernoulli under autocast stays the crate's generator's.
fn autocast_draws_uniform_as_the_backend<B: Backend>() {
    let device = Default::default();
    let uniform = |autocast_on: bool, dtype: Option<DType>| {
        let _precision = match autocast_on {
            true => autocast::enable(Precision::Bf16),
            false => autocast::disable(),
        };
        B::seed(&device, 12);
        let dist = Distribution::Uniform(-1.0, 1.0);
        let [first, second] = [(); 2].map(|_| match dtype {
            None => Tensor::<B, 1>::random([4_099], dist, &device).into_data(),
            Some(dtype) => Tensor::<B, 1>::random([4_099], dist, (&device, dtype)).into_data(),
        });
        [first, second]
    };
    for dtype in [None, Some(DType::F32), Some(DType::BF16), Some(DType::F16)] {
        let (on, off) = (uniform(true, dtype), uniform(false, dtype));
        assert_eq!(on[0].dtype, off[0].dtype, "{dtype:?}");
        assert_eq!(on[0].bytes, off[0].bytes, "{dtype:?}");
        assert_eq!(on[1].bytes, off[1].bytes, "{dtype:?}, the second draw");
    }
    let bernoulli = |autocast_on: bool| {
        let _precision = match autocast_on {
            true => autocast::enable(Precision::Bf16),
            false => autocast::disable(),
        };
        B::seed(&device, 12);
        Tensor::<B, 1>::random([4_099], Distribution::Bernoulli(0.5), &device).into_data()
    };
    assert_ne!(bernoulli(true).bytes, bernoulli(false).bytes);
}

#[test]
fn autocast_draws_uniform_as_the_backend_flex() {
    let _lock = exclusive();
    autocast_draws_uniform_as_the_backend::<Acc>();
}

#[test]
fn autocast_draws_uniform_as_the_backend_autodiff() {
    let _lock = exclusive();
    autocast_draws_uniform_as_the_backend::<AccAd>();
}

#[test]
fn a_random_tensor_is_a_leaf_without_gradient() {
    let _lock = exclusive();
    seed::<AccAd>(9);
    let device = Default::default();
    let x = Tensor::<AccAd, 1>::from_data([1.0, 2.0, 3.0, 4.0, 5.0], &device).require_grad();
    let (mask, grads) = {
        let _bf16 = autocast::enable(Precision::Bf16);
        let mask = x.random_like(Distribution::Bernoulli(0.5));
        assert!(!mask.is_require_grad());
        let grads = (x.clone() * mask.clone()).sum().backward();
        (mask, grads)
    };
    assert!(mask.grad(&grads).is_none());
    // d(sum(x · mask))/dx is the mask.
    assert_eq!(
        values(&x.grad(&grads).unwrap().into_data()),
        values(&mask.into_data())
    );
}

// Burn's dropout on the decorator under autocast: each value zeroed or scaled by 1 / keep,
// about `prob` of them zeroed.
#[test]
fn dropout_under_autocast_drops_its_share() {
    let _lock = exclusive();
    seed::<AccAd>(10);
    let (prob, len) = (0.1, 200_003);
    let dropout = DropoutConfig::new(prob).init();
    let device = Default::default();
    let x = Tensor::<AccAd, 1>::ones([len], &device);
    let out = {
        let _bf16 = autocast::enable(Precision::Bf16);
        dropout.forward(x.cast(FloatDType::BF16))
    };
    assert_eq!(out.dtype(), DType::BF16);
    let kept = 1.0 / (1.0 - prob);
    let v = values(&out.into_data());
    let scaled = half::bf16::from_f64(kept).to_f64();
    assert!(v.iter().all(|&x| x == 0.0 || x == scaled), "{scaled}");
    let dropped = v.iter().filter(|&&x| x == 0.0).count() as f64 / len as f64;
    assert!((dropped - prob).abs() <= tolerance(prob, len), "{dropped}");
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn time(mut run: impl FnMut()) -> Duration {
    run();
    median(
        (0..7)
            .map(|_| {
                let start = Instant::now();
                run();
                start.elapsed()
            })
            .collect(),
    )
}

/// A transformer's attention-dropout mask ([batch 6, 12 heads, 256 × 256] in bf16), drawn by
/// Flex and by the decorator under autocast.
#[test]
#[ignore = "a timing: cargo test --release --test fast_random -- --ignored --nocapture"]
fn dropout_mask_timing() {
    let _lock = exclusive();
    let shape = [6, 12, 256, 256];
    let device = Default::default();
    let dist = Distribution::Bernoulli(0.9);
    seed::<Acc>(11);
    let flex = time(|| {
        let _ = Tensor::<Flex, 4>::random(shape, dist, (&device, DType::BF16));
    });
    let ours = time(|| {
        let _bf16 = autocast::enable(Precision::Bf16);
        let _ = Tensor::<Acc, 4>::random(shape, dist, (&device, DType::BF16));
    });
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| {
            time(|| {
                let _bf16 = autocast::enable(Precision::Bf16);
                let _ = Tensor::<Acc, 4>::random(shape, dist, (&device, DType::BF16));
            })
        });
    println!(
        "[6, 12, 256, 256] bf16 Bernoulli(0.9), {} rayon threads: Flex {flex:?}, \
         counter-based {ours:?} ({:.1}x), on one thread {one_thread:?}",
        rayon::current_num_threads(),
        flex.as_secs_f64() / ours.as_secs_f64()
    );
}
