//! Autocast's fast half-precision paths on Flex (the vectorised casts; matmul, batched matmul,
//! linear and conv2d in f32 over half operands with their own backward nodes) against Burn's
//! own: on the widened path the same bits for bf16 (Flex's bf16 matmul and convolution are
//! themselves f32 ones over the widened operands), forward and backward, and for f16 the f32
//! result rounded once, within an f16 rounding of Burn's (whose f16 kernels sum in f16).
//!
//! The bf16 GEMM on AVX512-BF16 dot products (where the CPU has them) and the convolutions as
//! `im2col` GEMMs sum in another order: within a rounding of Burn's. A linear of more than two
//! dimensions and a 1-D convolution are checked against the 2-D forms they are computed as.
//!
//! Each test fixes its path for its own thread (`capability::scope_half_path`), so the tests
//! run at once. Every lower-class op is cast whatever its size (`SmallOps::Cast`, PyTorch's
//! rule, also the thread's): these products are small, and the half paths are what is tested.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::module::{conv1d, conv2d};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_accelerate::autocast::SmallOps;
use burn_accelerate::capability::{self, HalfPath};
use burn_accelerate::{Accelerated, Precision, autocast};

type Plain = Autodiff<Flex>;
type Acc = Accelerated<Autodiff<Flex>>;

/// Deterministic, varied values: Burn's seeded RNG is process-global and tests run in parallel.
fn data<const D: usize>(shape: [usize; D], seed: u64) -> TensorData {
    let values = (0..shape.iter().product::<usize>())
        .map(|i| ((i as f32 + 1.0) * (seed as f32 + 0.37)).sin() * 2.0)
        .collect::<Vec<f32>>();
    TensorData::new(values, shape)
}

fn bias_data() -> TensorData {
    let bias = data([1, 24], 3);
    TensorData::new(bias.to_vec::<f32>().unwrap(), [24])
}

fn bits(data: TensorData) -> Vec<u32> {
    data.convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Output, and the gradients of x, the weight and the bias, as f32 values' bits.
type Run = [Vec<u32>; 4];

// A run's output and its leaves' gradients (zeros for a bias the op did not use, as `x @ w`).
fn outcome<B: AutodiffBackend, const D: usize, const W: usize>(
    out: Tensor<B, D>,
    grads: &B::Gradients,
    x: &Tensor<B, D>,
    w: &Tensor<B, W>,
    b: &Tensor<B, 1>,
) -> Run {
    let unused = || TensorData::zeros::<f32, _>(b.shape());
    [
        bits(out.into_data()),
        bits(x.grad(grads).unwrap().into_data()),
        bits(w.grad(grads).unwrap().into_data()),
        bits(b.grad(grads).map_or_else(unused, |g| g.into_data())),
    ]
}

// `linear(x, w, b)` (or `x @ w`) in `low` through Burn's own ops on a plain autodiff backend,
// casts written out by hand.
fn burns(low: FloatDType, with_linear: bool) -> Run {
    let device = Default::default();
    let x = Tensor::<Plain, 2>::from_data(data([6, 32], 1), &device).require_grad();
    let w = Tensor::<Plain, 2>::from_data(data([32, 24], 2), &device).require_grad();
    let b = Tensor::<Plain, 1>::from_data(bias_data(), &device).require_grad();
    let out = if with_linear {
        burn::tensor::module::linear(
            x.clone().cast(low),
            w.clone().cast(low),
            Some(b.clone().cast(low)),
        )
    } else {
        x.clone().cast(low).matmul(w.clone().cast(low))
    };
    let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
    outcome(out, &grads, &x, &w, &b)
}

// `run` with this thread's half path fixed to `path` and every lower-class op cast.
fn on_path<R>(path: HalfPath, run: impl FnOnce() -> R) -> R {
    let _path = capability::scope_half_path(path);
    let _cast = autocast::scope_small_ops(SmallOps::Cast).expect("a valid rule");
    run()
}

// The same under autocast, on the decorator: its fast paths.
fn autocasts(precision: Precision, with_linear: bool) -> Run {
    let device = Default::default();
    let x = Tensor::<Acc, 2>::from_data(data([6, 32], 1), &device).require_grad();
    let w = Tensor::<Acc, 2>::from_data(data([32, 24], 2), &device).require_grad();
    let b = Tensor::<Acc, 1>::from_data(bias_data(), &device).require_grad();
    let (out, grads) = {
        let _low = autocast::enable(precision);
        let out = if with_linear {
            burn::tensor::module::linear(x.clone(), w.clone(), Some(b.clone()))
        } else {
            x.clone().matmul(w.clone())
        };
        let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
        (out, grads)
    };
    outcome(out, &grads, &x, &w, &b)
}

#[test]
fn bf16_linear_and_matmul_give_burns_bits_forward_and_backward() {
    for with_linear in [true, false] {
        let want = burns(FloatDType::BF16, with_linear);
        let got = on_path(HalfPath::Widened, || {
            autocasts(Precision::Bf16, with_linear)
        });
        for (i, name) in ["output", "x's gradient", "w's gradient", "b's gradient"]
            .iter()
            .enumerate()
        {
            assert_eq!(got[i], want[i], "{name} (linear: {with_linear})");
        }
    }
}

// `got` within a bf16 rounding of `want`, value by value: f32 sums of the same exact bf16
// products in two orders, each rounded to bf16, are one bf16 step apart at most (2^-7
// relative), where the sums do not cancel to near zero (the absolute room).
fn assert_within_a_bf16_rounding(got: &Run, want: &Run, what: &str) {
    for (i, name) in ["output", "x's gradient", "w's gradient", "b's gradient"]
        .iter()
        .enumerate()
    {
        assert_eq!(got[i].len(), want[i].len(), "{what}: {name}");
        for (g, w) in got[i].iter().zip(&want[i]) {
            let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
            assert!(
                (g - w).abs() <= w.abs() / 128.0 + 1e-4,
                "{what}: {name}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn bf16_dot_products_are_within_a_bf16_rounding_of_burns() {
    // The bf16 kernels where the CPU has them, the widened path (Burn's bits) elsewhere.
    for with_linear in [true, false] {
        let want = burns(FloatDType::BF16, with_linear);
        let got = on_path(HalfPath::ViaF32, || autocasts(Precision::Bf16, with_linear));
        assert_within_a_bf16_rounding(&got, &want, &format!("linear: {with_linear}"));
    }
    let want = burns_conv(FloatDType::BF16);
    let got = on_path(HalfPath::ViaF32, || autocasts_conv(Precision::Bf16));
    assert_within_a_bf16_rounding(&got, &want, "conv2d");
}

#[test]
fn bf16_dot_products_run_where_the_cpu_has_them_unless_widened() {
    #[cfg(target_arch = "x86_64")]
    let cpu_has_them =
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    let cpu_has_them = false;
    on_path(HalfPath::ViaF32, || {
        assert_eq!(capability::bf16_dot_products(), cpu_has_them)
    });
    on_path(HalfPath::Widened, || {
        assert!(!capability::bf16_dot_products())
    });
}

// `linear` under autocast of the `[6, 32]` test input, or of the same rows as `[2, 3, 32]`.
fn autocasts_rows(precision: Precision, three_dims: bool) -> Run {
    if !three_dims {
        return autocasts(precision, true);
    }
    let device = Default::default();
    let w = Tensor::<Acc, 2>::from_data(data([32, 24], 2), &device).require_grad();
    let b = Tensor::<Acc, 1>::from_data(bias_data(), &device).require_grad();
    let rows = data([6, 32], 1).to_vec::<f32>().unwrap();
    let x = Tensor::<Acc, 3>::from_data(TensorData::new(rows, [2, 3, 32]), &device);
    let x = x.require_grad();
    let _low = autocast::enable(precision);
    let out = burn::tensor::module::linear(x.clone(), w.clone(), Some(b.clone()));
    let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
    outcome(out, &grads, &x, &w, &b)
}

// `run(precision, false) == run(precision, true)` on both crate paths, in both half types.
fn same_either_way(run: impl Fn(Precision, bool) -> Run) {
    for path in [HalfPath::ViaF32, HalfPath::Widened] {
        for precision in [Precision::Bf16, Precision::F16] {
            let (plain, other) = on_path(path, || (run(precision, false), run(precision, true)));
            assert_eq!(plain, other, "{precision:?} on {path:?}");
        }
    }
}

#[test]
fn a_linear_of_three_dimensions_is_the_linear_of_its_rows() {
    same_either_way(autocasts_rows);
}

// Queries `q` by transposed keys `k` (`[2, 3, 6, 32]` by `[2, 3, 24, 32]`, as attention
// multiplies them: a batch of matrices, one operand a transposed view; or with a batch size of
// 1 on one side, broadcast). Through Burn's own ops in `low` (casts written out by hand) on a
// plain autodiff backend, or under autocast to `precision`.
fn batched_matmul([q, k]: [[usize; 4]; 2], low: FloatDType, precision: Option<Precision>) -> Run {
    fn run<B: AutodiffBackend>(
        [q, k]: [[usize; 4]; 2],
        cast: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
    ) -> Run {
        let device = Default::default();
        let q = Tensor::<B, 4>::from_data(data(q, 1), &device).require_grad();
        let k = Tensor::<B, 4>::from_data(data(k, 2), &device).require_grad();
        let unused = Tensor::<B, 1>::from_data(TensorData::new(vec![0f32], [1]), &device);
        let out = cast(q.clone()).matmul(cast(k.clone()).swap_dims(2, 3));
        let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
        outcome(out, &grads, &q, &k, &unused.require_grad())
    }
    match precision {
        None => run::<Plain>([q, k], |t| t.cast(low)),
        Some(precision) => {
            let _low = autocast::enable(precision);
            run::<Acc>([q, k], |t| t)
        }
    }
}

// Attention's queries and keys, one batch of each size.
const ATTENTION: [[usize; 4]; 2] = [[2, 3, 6, 32], [2, 3, 24, 32]];

#[test]
fn batched_matmuls_give_burns_numbers_on_every_path() {
    let want = batched_matmul(ATTENTION, FloatDType::BF16, None);
    let widened = on_path(HalfPath::Widened, || {
        batched_matmul(ATTENTION, FloatDType::BF16, Some(Precision::Bf16))
    });
    assert_eq!(widened, want, "bf16, widened: Burn's bits");
    let dot = on_path(HalfPath::ViaF32, || {
        batched_matmul(ATTENTION, FloatDType::BF16, Some(Precision::Bf16))
    });
    assert_within_a_bf16_rounding(&dot, &want, "bf16, dot products");
    // f16: the f32 sums rounded once, within an f16 rounding of Burn's f16 sums.
    let want = batched_matmul(ATTENTION, FloatDType::F16, None);
    let got = on_path(HalfPath::ViaF32, || {
        batched_matmul(ATTENTION, FloatDType::F16, Some(Precision::F16))
    });
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        for (g, w) in got.iter().zip(want) {
            let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
            assert!(
                (g - w).abs() <= 2e-3 * w.abs().max(1.0),
                "f16 [{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn broadcast_batched_matmuls_take_the_kernel() {
    // Shared keys (multi-query attention), shared heads, and both.
    let cases = [
        ([2, 3, 6, 32], [1, 3, 24, 32]),
        ([2, 3, 6, 32], [2, 1, 24, 32]),
        ([1, 3, 6, 32], [2, 1, 24, 32]),
    ];
    for (q, k) in cases {
        // On the widened path: Burn's own bits, forward and backward (the broadcast operand's
        // gradient summed over the batch in bf16 by Burn's expand node, as Burn's matmul sums it).
        let want = batched_matmul([q, k], FloatDType::BF16, None);
        let widened = on_path(HalfPath::Widened, || {
            batched_matmul([q, k], FloatDType::BF16, Some(Precision::Bf16))
        });
        assert_eq!(widened, want, "bf16, widened: {q:?} by {k:?}");
        let dot = on_path(HalfPath::ViaF32, || {
            batched_matmul([q, k], FloatDType::BF16, Some(Precision::Bf16))
        });
        assert_within_a_bf16_rounding(&dot, &want, &format!("bf16, dot products: {q:?} by {k:?}"));
        // The product ran on the crate's kernel, on every path and in both half types: counted
        // by the thread's tally (the forward product; the backward's products are nodes of
        // their own, not autocast calls).
        for path in [HalfPath::ViaF32, HalfPath::Widened] {
            for precision in [Precision::Bf16, Precision::F16] {
                let before = autocast::thread_tally();
                on_path(path, || {
                    batched_matmul([q, k], FloatDType::BF16, Some(precision))
                });
                let ran = autocast::thread_tally().since(&before);
                assert_eq!(
                    (ran.half_ops, ran.crate_kernel_ops),
                    (1, 1),
                    "{precision:?} on {path:?}: {q:?} by {k:?}"
                );
            }
        }
    }
}

#[test]
fn f16_linear_is_within_an_f16_rounding_of_burns() {
    let want = burns(FloatDType::F16, true);
    let got = on_path(HalfPath::ViaF32, || autocasts(Precision::F16, true));
    for (i, name) in ["output", "x's gradient", "w's gradient", "b's gradient"]
        .iter()
        .enumerate()
    {
        for (g, w) in got[i].iter().zip(&want[i]) {
            let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
            // One f16 rounding of a sum of 32 products: 2^-10 relative, and a little absolute
            // room for sums that cancel.
            assert!(
                (g - w).abs() <= 2e-3 * w.abs().max(1.0),
                "{name}: {g} vs {w}"
            );
        }
    }
}

// A strided, padded convolution with bias, as in a small conv net.
fn conv_options() -> ConvOptions<2> {
    ConvOptions::new([2, 1], [1, 1], [1, 1], 1)
}

// `conv2d(x, w, b)` in `low` through Burn's own ops, casts written out by hand.
fn burns_conv(low: FloatDType) -> Run {
    let device = Default::default();
    let x = Tensor::<Plain, 4>::from_data(data([2, 3, 7, 6], 4), &device).require_grad();
    let w = Tensor::<Plain, 4>::from_data(data([4, 3, 3, 3], 5), &device).require_grad();
    let b = Tensor::<Plain, 1>::from_data(data([4], 6), &device).require_grad();
    let (xl, wl, bl) = (
        x.clone().cast(low),
        w.clone().cast(low),
        b.clone().cast(low),
    );
    let out = conv2d(xl, wl, Some(bl), conv_options());
    let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
    outcome(out, &grads, &x, &w, &b)
}

fn autocasts_conv(precision: Precision) -> Run {
    let device = Default::default();
    let x = Tensor::<Acc, 4>::from_data(data([2, 3, 7, 6], 4), &device).require_grad();
    let w = Tensor::<Acc, 4>::from_data(data([4, 3, 3, 3], 5), &device).require_grad();
    let b = Tensor::<Acc, 1>::from_data(data([4], 6), &device).require_grad();
    let (out, grads) = {
        let _low = autocast::enable(precision);
        let out = conv2d(x.clone(), w.clone(), Some(b.clone()), conv_options());
        let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
        (out, grads)
    };
    outcome(out, &grads, &x, &w, &b)
}

#[test]
fn bf16_conv2d_gives_burns_bits_forward_and_backward() {
    let (want, got) = (
        burns_conv(FloatDType::BF16),
        on_path(HalfPath::Widened, || autocasts_conv(Precision::Bf16)),
    );
    for (i, name) in ["output", "x's gradient", "w's gradient", "b's gradient"]
        .iter()
        .enumerate()
    {
        assert_eq!(got[i], want[i], "{name}");
    }
}

// A strided, padded, dilated 1-D convolution with bias under autocast, or the same as a 2-D
// one over one-pixel-high images: `[2, 3, 11]` by `[4, 3, 3]`.
fn autocasts_conv1d(precision: Precision, as_2d: bool) -> Run {
    let device = Default::default();
    let x = data([2, 3, 11], 7).to_vec::<f32>().unwrap();
    let w = data([4, 3, 3], 8).to_vec::<f32>().unwrap();
    let b = Tensor::<Acc, 1>::from_data(data([4], 9), &device).require_grad();
    let _low = autocast::enable(precision);
    if as_2d {
        let x = Tensor::<Acc, 4>::from_data(TensorData::new(x, [2, 3, 1, 11]), &device);
        let w = Tensor::<Acc, 4>::from_data(TensorData::new(w, [4, 3, 1, 3]), &device);
        let (x, w) = (x.require_grad(), w.require_grad());
        let options = ConvOptions::new([1, 2], [0, 1], [1, 2], 1);
        let out = conv2d(x.clone(), w.clone(), Some(b.clone()), options);
        let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
        outcome(out, &grads, &x, &w, &b)
    } else {
        let x = Tensor::<Acc, 3>::from_data(TensorData::new(x, [2, 3, 11]), &device);
        let w = Tensor::<Acc, 3>::from_data(TensorData::new(w, [4, 3, 3]), &device);
        let (x, w) = (x.require_grad(), w.require_grad());
        let options = ConvOptions::new([2], [1], [2], 1);
        let out = conv1d(x.clone(), w.clone(), Some(b.clone()), options);
        let grads = (out.clone().cast(FloatDType::F32) * 0.5).sum().backward();
        outcome(out, &grads, &x, &w, &b)
    }
}

#[test]
fn a_1d_convolution_is_the_2d_one_of_one_pixel_high_images() {
    same_either_way(autocasts_conv1d);
}

// The f32 convolution and its gradients over operands rounded to f16, each result rounded to
// f16 once: what a half-precision convolution with f32 accumulation gives.
fn f32_conv_of_f16_operands() -> Run {
    fn rounded<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Plain, D> {
        let device = Default::default();
        let values = Tensor::<Plain, D>::from_data(data(shape, seed), &device)
            .cast(FloatDType::F16)
            .cast(FloatDType::F32);
        Tensor::from_data(values.into_data(), &device).require_grad()
    }
    let (x, w, b) = (
        rounded([2, 3, 7, 6], 4),
        rounded([4, 3, 3, 3], 5),
        rounded([4], 6),
    );
    let out = conv2d(x.clone(), w.clone(), Some(b.clone()), conv_options());
    let grads = (out.clone() * 0.5).sum().backward();
    let f16 = |t: Tensor<Flex, 4>| bits(t.cast(FloatDType::F16).into_data());
    [
        f16(out.inner()),
        f16(x.grad(&grads).unwrap()),
        f16(w.grad(&grads).unwrap()),
        bits(b.grad(&grads).unwrap().cast(FloatDType::F16).into_data()),
    ]
}

#[test]
fn f16_conv2d_sums_in_f32_and_rounds_once() {
    let got = on_path(HalfPath::ViaF32, || autocasts_conv(Precision::F16));
    let want = f32_conv_of_f16_operands();
    for (i, name) in ["output", "x's gradient", "w's gradient", "b's gradient"]
        .iter()
        .enumerate()
    {
        for (g, w) in got[i].iter().zip(&want[i]) {
            let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
            // The same f32 sums, perhaps in another order: one f16 rounding apart at most.
            assert!((g - w).abs() <= w.abs() / 1024.0, "{name}: {g} vs {w}");
        }
    }
}
