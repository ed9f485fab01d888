//! Autocast's fused softmax, log-softmax and GELU kernels on `Accelerated<Autodiff<Flex>>`
//! (`src/cpu/softmax.rs`, `src/cpu/gelu.rs`) against Burn's own on plain `Autodiff<Flex>`:
//! forward and backward within stated tolerances under autocast (the kernels' `exp` and
//! normal CDF are not libm's, and their sums run in another order), Burn's own bits with
//! autocast off and for every case the kernels leave to Flex, and the same bits on one
//! thread and two.
//!
//! The kernels' accuracy against f64, the paths forced one by one (AVX-512, AVX2, the portable
//! fallback) and the half-precision GELU are tested in the modules themselves; here the
//! routing and the autodiff nodes are.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor, TensorData, activation};
use burn_accelerate::{Accelerated, Precision, autocast};

type Plain = Autodiff<Flex>;
type Acc = Accelerated<Autodiff<Flex>>;

/// Deterministic scores of an attention-like tensor with rows of `len`: ordinary values,
/// large magnitudes (±80, ±1e4), and masked entries (-1e4, -∞) in some rows, never a whole row.
fn scores(rows: usize, len: usize, seed: u32) -> Vec<f32> {
    let mut v: Vec<f32> = (0..(rows * len) as u32)
        .map(|i| {
            let h = i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97_531);
            (h % 16_000) as f32 / 1000.0 - 8.0
        })
        .collect();
    for (r, row) in v.chunks_mut(len).enumerate() {
        match r % 5 {
            1 => row.iter_mut().skip(1).step_by(3).for_each(|x| *x = -1e4),
            2 => row
                .iter_mut()
                .skip(1)
                .step_by(2)
                .for_each(|x| *x = f32::NEG_INFINITY),
            3 => row
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x *= [10.0, 1.0, -1250.0, 1.0][i % 4]),
            _ => {}
        }
    }
    v
}

fn f32s(t: TensorData) -> Vec<f32> {
    t.convert::<f32>().to_vec::<f32>().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Softmax,
    LogSoftmax,
    Gelu,
}

/// The output of `op` on `x` (shape `[2, rows / 2, len]`, cast to `dtype`), and `x`'s
/// gradient for the loss `Σ out · w`, as f32 values, run on `B` under `precision` (or with
/// autocast off).
fn run<B: AutodiffBackend>(
    op: Op,
    x: &[f32],
    len: usize,
    dtype: FloatDType,
    precision: Option<Precision>,
) -> (Vec<f32>, Vec<f32>) {
    let device = Default::default();
    let rows = x.len() / len;
    let shape = [2, rows / 2, len];
    let input = Tensor::<B, 3>::from_data(TensorData::new(x.to_vec(), shape), &device);
    let input = input.cast(dtype).require_grad();
    let weights: Vec<f32> = (0..x.len())
        .map(|i| ((i % 23) as f32 - 11.0) / 7.0)
        .collect();
    let weights = Tensor::<B, 3>::from_data(TensorData::new(weights, shape), &device);
    let _mode = match precision {
        Some(p) => autocast::enable(p),
        None => autocast::disable(),
    };
    let out = match op {
        Op::Softmax => activation::softmax(input.clone(), 2),
        Op::LogSoftmax => activation::log_softmax(input.clone(), 2),
        Op::Gelu => activation::gelu(input.clone()),
    };
    let masked = out.clone().cast(FloatDType::F32).is_finite();
    let loss = (out.clone().cast(FloatDType::F32) * weights)
        .mask_fill(masked.bool_not(), 0.0)
        .sum();
    let grads = loss.backward();
    let grad = input.grad(&grads).expect("x takes part in the loss");
    (f32s(out.into_data()), f32s(grad.into_data()))
}

const LENGTHS: [usize; 6] = [1, 7, 17, 255, 256, 257];

#[test]
fn softmax_and_log_softmax_under_autocast_are_burns_within_tolerance() {
    for len in LENGTHS {
        let x = scores(10, len, len as u32);
        for op in [Op::Softmax, Op::LogSoftmax] {
            let (want_y, want_dx) = run::<Plain>(op, &x, len, FloatDType::F32, None);
            let (y, dx) = run::<Acc>(op, &x, len, FloatDType::F32, Some(Precision::Bf16));
            assert_softmax_within_tolerance(op, len, (&y, &dx), (&want_y, &want_dx), 0.0);
        }
    }
}

/// `y` and `dx` (of `op`, rows of `len`) against Burn's `want_y` and `want_dx`: the output
/// within a few ulp (softmax) or on the scale of the row's shifts (log-softmax), the gradient
/// on the scale of the row's sum, plus `grad_slack` of each value (a rounding to a half type).
fn assert_softmax_within_tolerance(
    op: Op,
    len: usize,
    (y, dx): (&[f32], &[f32]),
    (want_y, want_dx): (&[f32], &[f32]),
    grad_slack: f32,
) {
    for (row, (got, want)) in y.chunks(len).zip(want_y.chunks(len)).enumerate() {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            // Softmax: both within a few ulp of the exact value (Burn's through libm's
            // `expf`). Log-softmax: absolute, on the scale of the row's shifts.
            let tol = match op {
                Op::Softmax => 2e-6 * w.abs() + 1e-37,
                _ => 2e-6 * (1.0 + w.abs()),
            };
            match w.is_finite() {
                true => assert!(
                    (g - w).abs() <= tol,
                    "{op:?} [{row}][{i}] of {len}: {g}, not {w}"
                ),
                false => assert_eq!(g, w, "{op:?} [{row}][{i}] of {len}"),
            }
        }
    }
    // Gradients of a loss of O(1) weights: absolute, on the scale of the row's sum.
    let scale = |d: &[f32]| d.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (row, (got, want)) in dx.chunks(len).zip(want_dx.chunks(len)).enumerate() {
        let tol = 4e-6 * (1.0 + scale(want));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol + grad_slack * w.abs(),
                "{op:?}' [{row}][{i}] of {len}: {g}, not {w}"
            );
        }
    }
}

#[test]
fn a_half_input_is_widened_by_the_kernel_as_its_cast_would_widen_it() {
    // A bf16 (or f16) input of softmax under autocast is widened inside the kernel, not cast
    // first: the output is the f32 softmax of the half values, the gradient comes back in
    // the input's type. Against Burn's own f32 softmax of the same (widened) values, with the
    // tolerances above, and the gradient within one rounding to the half type.
    for (dtype, eps) in [
        (FloatDType::BF16, 1.0 / 256.0),
        (FloatDType::F16, 1.0 / 2048.0),
    ] {
        for len in [7, 256] {
            let x = scores(10, len, 3 * len as u32);
            // The half values, exactly, as f32 (a half value widens exactly).
            let halves = f32s(
                Tensor::<Flex, 1>::from_data(
                    TensorData::new(x.clone(), [x.len()]),
                    &Default::default(),
                )
                .cast(dtype)
                .into_data(),
            );
            for op in [Op::Softmax, Op::LogSoftmax] {
                let (want_y, want_dx) = run::<Plain>(op, &halves, len, FloatDType::F32, None);
                let (y, dx) = run::<Acc>(op, &x, len, dtype, Some(Precision::Bf16));
                assert_softmax_within_tolerance(op, len, (&y, &dx), (&want_y, &want_dx), eps);
            }
        }
    }
}

// Values from -6 to 6 and a few beyond, in an odd count.
fn gelu_inputs(n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..n).map(|i| (i as f32 / n as f32) * 12.0 - 6.0).collect();
    v[..6].copy_from_slice(&[-0.0, 0.0, -13.0, 13.0, -40.0, 40.0]);
    v
}

#[test]
fn gelu_under_autocast_is_burns_within_tolerance() {
    let x = gelu_inputs(2 * 1543);
    let len = 1543;
    // f32: within 4 ulp of the exact value (Flex's `1 + erff` cancels below -3: absolute).
    let (want_y, want_dx) = run::<Plain>(Op::Gelu, &x, len, FloatDType::F32, None);
    let (y, dx) = run::<Acc>(Op::Gelu, &x, len, FloatDType::F32, Some(Precision::Bf16));
    for i in 0..x.len() {
        let tol = 1e-6 * want_y[i].abs() + 2e-7 * (1.0 + x[i].abs());
        assert!(
            (y[i] - want_y[i]).abs() <= tol,
            "gelu({}) = {}, not {}",
            x[i],
            y[i],
            want_y[i]
        );
        let tol = 2e-6 * (1.0 + want_dx[i].abs());
        assert!(
            (dx[i] - want_dx[i]).abs() <= tol,
            "gelu'({}): {}, not {}",
            x[i],
            dx[i],
            want_dx[i]
        );
    }
    // bf16 and f16: one value of the dtype or its neighbour, where Flex is accurate (above -3).
    for (dtype, step) in [
        (FloatDType::BF16, 1.0 / 128.0),
        (FloatDType::F16, 1.0 / 1024.0),
    ] {
        let (want_y, want_dx) = run::<Plain>(Op::Gelu, &x, len, dtype, None);
        let (y, dx) = run::<Acc>(Op::Gelu, &x, len, dtype, Some(Precision::Bf16));
        let mut differ = 0;
        for i in 0..x.len() {
            if x[i] < -3.0 {
                continue;
            }
            let tol = step * want_y[i].abs() + 1e-6;
            assert!((y[i] - want_y[i]).abs() <= tol, "{dtype:?} gelu({})", x[i]);
            let tol = 2.0 * step * (1.0 + want_dx[i].abs());
            assert!(
                (dx[i] - want_dx[i]).abs() <= tol,
                "{dtype:?} gelu'({})",
                x[i]
            );
            differ += usize::from(y[i] != want_y[i]);
        }
        assert!(
            differ < x.len() / 50,
            "{dtype:?}: {differ} values differ from Flex's"
        );
    }
}

#[test]
fn the_kernels_are_taken_under_autocast_only() {
    // Flex's GELU forms `1 + erff(x/√2)`, which cancels in the left tail; the kernel's does
    // not: at -5 and -8 it is within a few ulp of the exact value, Flex's far off.
    let x = vec![-5.0, -8.0];
    let exact = [-1.433_257_859_395_969_5e-6, -4.976_768_459_417_424e-15];
    let (low, _) = run::<Acc>(Op::Gelu, &x, 1, FloatDType::F32, Some(Precision::Bf16));
    let (off, _) = run::<Acc>(Op::Gelu, &x, 1, FloatDType::F32, None);
    for i in 0..2 {
        let error = |y: f32| (f64::from(y) / exact[i] - 1.0).abs();
        assert!(
            error(low[i]) < 4e-7,
            "gelu({}) = {} under autocast",
            x[i],
            low[i]
        );
        assert!(
            error(off[i]) > 1e-3,
            "gelu({}) = {} with autocast off",
            x[i],
            off[i]
        );
    }
    // The softmax kernel sums in sixteen lanes and has its own `exp`: some bits differ from
    // Burn's on long rows, none with autocast off.
    let x = scores(4, 257, 1);
    let (burns, _) = run::<Plain>(Op::Softmax, &x, 257, FloatDType::F32, None);
    let (low, _) = run::<Acc>(Op::Softmax, &x, 257, FloatDType::F32, Some(Precision::Bf16));
    let (off, _) = run::<Acc>(Op::Softmax, &x, 257, FloatDType::F32, None);
    assert_ne!(bits(&low), bits(&burns));
    assert_eq!(bits(&off), bits(&burns));
}

#[test]
fn without_autodiff_the_same_kernels() {
    // `Accelerated<Flex>` (inference, or `valid()`'s inner backend) reaches the kernels on
    // Flex's tensors: the values of the autodiff node's forward.
    let device = Default::default();
    let x = scores(6, 17, 4);
    let low = || autocast::enable(Precision::Bf16);
    for op in [Op::Softmax, Op::LogSoftmax, Op::Gelu] {
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            if op != Op::Gelu && dtype != FloatDType::F32 {
                continue;
            }
            let (want, _) = run::<Acc>(op, &x, 17, dtype, Some(Precision::Bf16));
            let input = Tensor::<Accelerated<Flex>, 2>::from_data(
                TensorData::new(x.clone(), [6, 17]),
                &device,
            )
            .cast(dtype);
            let _low = low();
            let out = match op {
                Op::Softmax => activation::softmax(input, 1),
                Op::LogSoftmax => activation::log_softmax(input, 1),
                Op::Gelu => activation::gelu(input),
            };
            assert_eq!(
                bits(&f32s(out.into_data())),
                bits(&want),
                "{op:?} {dtype:?}"
            );
        }
    }
}

#[test]
fn with_autocast_off_the_decorator_is_flex_bit_for_bit() {
    for len in [7, 257] {
        let x = scores(6, len, 3);
        for op in [Op::Softmax, Op::LogSoftmax, Op::Gelu] {
            for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
                if op != Op::Gelu && dtype != FloatDType::F32 {
                    continue;
                }
                let x: Vec<f32> = match op {
                    Op::Gelu => x.iter().map(|v| v.clamp(-20.0, 20.0)).collect(),
                    _ => x.clone(),
                };
                let (want_y, want_dx) = run::<Plain>(op, &x, len, dtype, None);
                let (y, dx) = run::<Acc>(op, &x, len, dtype, None);
                assert_eq!(bits(&y), bits(&want_y), "{op:?} {dtype:?} at {len}");
                assert_eq!(bits(&dx), bits(&want_dx), "{op:?}' {dtype:?} at {len}");
            }
        }
    }
}

/// Softmax (or log-softmax) along `dim` of `x` viewed as `[4, 6, 10]`, transposed first where
/// `transposed`, and the gradient, on `B` under bf16 autocast.
fn along<B: AutodiffBackend>(log: bool, dim: usize, transposed: bool) -> (Vec<u32>, Vec<u32>) {
    let device = Default::default();
    let x = scores(24, 10, 5);
    let input = Tensor::<B, 3>::from_data(TensorData::new(x, [4, 6, 10]), &device).require_grad();
    let _low = autocast::enable(Precision::Bf16);
    let view = match transposed {
        true => input.clone().swap_dims(1, 2),
        false => input.clone(),
    };
    let out = match log {
        true => activation::log_softmax(view, dim),
        false => activation::softmax(view, dim),
    };
    let finite = out.clone().is_finite();
    let grads = (out.clone() * 0.5)
        .mask_fill(finite.bool_not(), 0.0)
        .sum()
        .backward();
    let grad = input.grad(&grads).unwrap();
    (bits(&f32s(out.into_data())), bits(&f32s(grad.into_data())))
}

#[test]
fn other_dims_and_strided_views_are_burns_own_under_autocast() {
    for log in [false, true] {
        for (dim, transposed) in [(0, false), (1, false), (2, true)] {
            let want = along::<Plain>(log, dim, transposed);
            let got = along::<Acc>(log, dim, transposed);
            assert_eq!(got, want, "log: {log}, dim {dim}, transposed: {transposed}");
        }
    }
}

#[test]
fn one_thread_or_two_the_same_bits() {
    // Enough rows and values for several parallel tasks.
    let (rows, len) = (600, 257);
    let x = scores(rows, len, 9);
    let g = gelu_inputs(rows * len);
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let low = Some(Precision::Bf16);
            [
                run::<Acc>(Op::Softmax, &x, len, FloatDType::F32, low),
                run::<Acc>(Op::LogSoftmax, &x, len, FloatDType::F32, low),
                run::<Acc>(Op::Gelu, &g, len, FloatDType::BF16, low),
                run::<Acc>(Op::Gelu, &g, len, FloatDType::F32, low),
            ]
            .map(|(y, dx)| (bits(&y), bits(&dx)))
        })
    };
    assert!(on(1) == on(2));
}

/// Softmax forward and backward of `[8, 12, 256, 256]` f32 attention weights, and GELU of
/// `[8, 256, 1536]` bf16 activations, on Burn's path (the decorator with autocast off: plain
/// `Autodiff<Flex>`) and the kernels' (under bf16 autocast). The backward is that of
/// `out.sum()`, whose own backward is a broadcast view. Run with
/// `cargo test --release --test fused_activation -- --ignored --nocapture`.
#[test]
#[ignore]
fn timings() {
    use std::time::Instant;
    let step = |precision: Option<Precision>, gelu: bool| {
        let device = Default::default();
        let n = if gelu {
            8 * 256 * 1536
        } else {
            8 * 12 * 256 * 256
        };
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 4001) as f32 / 500.0 - 4.0)
            .collect();
        let dtype = if gelu {
            FloatDType::BF16
        } else {
            FloatDType::F32
        };
        let x = Tensor::<Acc, 1>::from_data(TensorData::new(values, [n]), &device)
            .cast(dtype)
            .require_grad();
        let _mode = match precision {
            Some(p) => autocast::enable(p),
            None => autocast::disable(),
        };
        let start = Instant::now();
        let out = match gelu {
            true => activation::gelu(x.clone().reshape([8, 256, 1536])).reshape([n]),
            false => activation::softmax(x.clone().reshape([8, 12, 256, 256]), 3).reshape([n]),
        };
        let forward = start.elapsed().as_secs_f64() * 1e3;
        let loss = out.sum();
        let start = Instant::now();
        let grads = loss.backward();
        let _ = x.grad(&grads).unwrap();
        (forward, start.elapsed().as_secs_f64() * 1e3)
    };
    let time = |what: &str, precision: Option<Precision>, gelu: bool| {
        step(precision, gelu);
        let runs: Vec<(f64, f64)> = (0..5).map(|_| step(precision, gelu)).collect();
        let best = |k: fn(&(f64, f64)) -> f64| runs.iter().map(k).fold(f64::MAX, f64::min);
        let (forward, backward) = (best(|r| r.0), best(|r| r.1));
        println!("{what}: forward {forward:.1} ms, backward {backward:.1} ms");
    };
    println!("rayon threads: {}", rayon::current_num_threads());
    let low = Some(Precision::Bf16);
    time("softmax [8,12,256,256] f32, Burn's", None, false);
    time("softmax [8,12,256,256] f32, fused", low, false);
    time("gelu [8,256,1536] bf16, Flex's", None, true);
    time("gelu [8,256,1536] bf16, fused", low, true);
}
