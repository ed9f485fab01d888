//! Autocast's fast half-precision paths on Flex (the vectorised casts, and matmul/linear as an
//! f32 GEMM over half operands with its own backward node) against Burn's own: the same bits
//! for bf16 (Flex's bf16 matmul is itself an f32 GEMM of the widened operands), forward and
//! backward, and for f16 the f32 product rounded once, within half an f16 ulp of Burn's.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_accelerate::{Accelerated, Precision, autocast};

type Plain = Autodiff<Flex>;
type Acc = Accelerated<Autodiff<Flex>>;

/// Deterministic, varied values: Burn's seeded RNG is process-global and tests run in parallel.
fn data(shape: [usize; 2], seed: u64) -> TensorData {
    let values = (0..shape[0] * shape[1])
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
    [
        bits(out.into_data()),
        bits(x.grad(&grads).unwrap().into_data()),
        bits(w.grad(&grads).unwrap().into_data()),
        bits(
            b.grad(&grads)
                .map_or(TensorData::new(vec![0f32; 24], [24]), |g| g.into_data()),
        ),
    ]
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
    [
        bits(out.into_data()),
        bits(x.grad(&grads).unwrap().into_data()),
        bits(w.grad(&grads).unwrap().into_data()),
        bits(
            b.grad(&grads)
                .map_or(TensorData::new(vec![0f32; 24], [24]), |g| g.into_data()),
        ),
    ]
}

#[test]
fn bf16_linear_and_matmul_give_burns_bits_forward_and_backward() {
    for with_linear in [true, false] {
        let want = burns(FloatDType::BF16, with_linear);
        let got = autocasts(Precision::Bf16, with_linear);
        for (i, name) in ["output", "x's gradient", "w's gradient", "b's gradient"]
            .iter()
            .enumerate()
        {
            assert_eq!(got[i], want[i], "{name} (linear: {with_linear})");
        }
    }
}

#[test]
fn f16_linear_is_within_an_f16_rounding_of_burns() {
    let want = burns(FloatDType::F16, true);
    let got = autocasts(Precision::F16, true);
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
