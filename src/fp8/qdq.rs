//! Quantize-dequantize: rounding a tensor to the fp8 grid with tensor ops on its device.

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, FloatDType, TensorMetadata, get_device_settings};

use super::format::{Fp8Format, pow2};

/// Rounds `tensor` to `format` the way a cast to fp8 and back would, with `scale` applied
/// first and undone after: `fp8(tensor × scale) / scale`.
///
/// Each element is scaled, saturated to `±max_finite` (so ±∞ become ±max; NaN stays NaN),
/// rounded to the nearest value of the format with ties to even (subnormals included, the
/// sign of zero kept), and unscaled. This is what `ml_dtypes` does for
/// `clip(x, -max, max).astype(float8_e4m3fn | float8_e5m2)`, bit for bit (see the golden
/// file `tests/golden/fp8_rounding.json`).
///
/// It runs as about thirty elementwise tensor ops of `B` on the tensor's own device, for any
/// rank, with no read back to the host and no lookup table. f16 and bf16 inputs are rounded
/// in f32 and cast back (every fp8 value is exact in both); f64 inputs are rounded in f64.
///
/// On an autodiff backend the ops are recorded like any others, and `round` has a zero
/// gradient: for training, let autocast insert it (`Precision::Fp8`), which wraps it in a
/// straight-through node.
///
/// # Panics
///
/// When `scale` is not a positive finite number.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::tensor::{Tensor, TensorPrimitive};
/// use burn_accelerate::fp8::{Fp8Format, quantize_dequantize};
///
/// let x = Tensor::<Flex, 1>::from_floats([0.3, 1000.0, -17.0, 0.0009], &Default::default());
/// let y = quantize_dequantize::<Flex>(x.into_primitive().tensor(), Fp8Format::E4M3, 1.0);
/// let y = Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(y));
/// // 0.3 lies between 0.28125 and 0.3125; 1000 saturates; 17 ties between 16 and 18 and goes
/// // to the even mantissa; 0.0009 is a subnormal's multiple (2^-9 x 0.46) and rounds to 0.
/// assert_eq!(y.to_data().to_vec::<f32>().unwrap(), [0.3125, 448.0, -16.0, 0.0]);
/// # }
/// ```
pub fn quantize_dequantize<B: Backend>(
    tensor: FloatTensor<B>,
    format: Fp8Format,
    scale: f32,
) -> FloatTensor<B> {
    assert!(
        scale.is_finite() && scale > 0.0,
        "fp8 scale must be positive and finite, got {scale}"
    );
    let dtype = FloatDType::from(tensor.dtype());
    match dtype {
        // The grid's extremes (2^16 for E5M2's inverse quantum) do not fit f16.
        FloatDType::F16 | FloatDType::BF16 => {
            let wide = B::float_cast(tensor, FloatDType::F32);
            B::float_cast(round_to_grid::<B>(wide, format, scale), dtype)
        }
        _ => round_to_grid::<B>(tensor, format, scale),
    }
}

/// [`quantize_dequantize`] on a [`Tensor`].
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::tensor::Tensor;
/// use burn_accelerate::fp8::{Fp8Format, quantize_dequantize_tensor};
///
/// let x = Tensor::<Flex, 2>::from_floats([[3.3, -70000.0]], &Default::default());
/// let y = quantize_dequantize_tensor(x, Fp8Format::E5M2, 1.0);
/// assert_eq!(y.to_data().to_vec::<f32>().unwrap(), [3.5, -57344.0]);
/// # }
/// ```
pub fn quantize_dequantize_tensor<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    format: Fp8Format,
    scale: f32,
) -> Tensor<B, D> {
    let out = quantize_dequantize::<B>(tensor.into_primitive().tensor(), format, scale);
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

fn round_to_grid<B: Backend>(x: FloatTensor<B>, format: Fp8Format, scale: f32) -> FloatTensor<B> {
    let device = B::float_device(&x);
    let bools = get_device_settings::<B>(&device).bool_dtype;
    let max = format.max_finite();
    let emin = format.min_normal_exponent();
    let mantissa = format.mantissa_bits() as i32;

    let scaled = if scale == 1.0 {
        x
    } else {
        B::float_mul_scalar(x, scale.into())
    };
    let saturated = B::float_clamp(scaled.clone(), (-max).into(), max.into());
    let magnitude = B::float_abs(saturated.clone());

    // The binade of each element, 2^floor(log2 |x|) clamped below at the smallest normal
    // exponent, found by a binary search over the exponent with exact power-of-two products
    // and comparisons: log2 is not exact near powers of two on every backend, and pow with a
    // tensor exponent is not exact everywhere either.
    let mut binade = B::float_full(
        magnitude.shape(),
        pow2(emin).into(),
        &device,
        magnitude.dtype().into(),
    );
    for step in exponent_steps(format) {
        let candidate = B::float_mul_scalar(binade.clone(), pow2(step).into());
        let reaches = B::float_greater_equal(magnitude.clone(), candidate.clone(), bools);
        binade = B::float_mask_where(binade, reaches, candidate);
    }

    // Within a binade the grid is evenly spaced by `quantum`, a power of two: scaling by its
    // inverse and back is exact, so rounding to an integer there is rounding to the grid, and
    // `float_round` is specified as ties-to-even. Subnormals share the smallest binade's
    // quantum, which is why the binade is clamped below.
    let quantum = B::float_mul_scalar(binade, pow2(-mantissa).into());
    let units = B::float_mul(saturated.clone(), B::float_recip(quantum.clone()));
    let rounded = B::float_mul(B::float_round(units), quantum);

    // A value that rounds to zero keeps its sign in fp8 (-0.0001 becomes -0.0). Some
    // backends' round gives +0 for -0.5; multiplying the saturated input by zero gives the
    // zero of the right sign.
    let is_zero = B::float_equal_elem(rounded.clone(), 0.0f32.into(), bools);
    let signed_zero = B::float_mul_scalar(saturated, 0.0f32.into());
    let rounded = B::float_mask_where(rounded, is_zero, signed_zero);

    // Clamping NaN is backend-defined (SIMD min/max may return the bound): put NaN back.
    let is_nan = B::float_is_nan(scaled.clone(), bools);
    let out = B::float_mask_where(rounded, is_nan, scaled);

    if scale == 1.0 {
        out
    } else {
        B::float_div_scalar(out, scale.into())
    }
}

// Powers of two, largest first, whose sums reach every exponent offset in the format's normal
// range: a binary search needs one step per bit of `max_exponent - min_normal_exponent`.
fn exponent_steps(format: Fp8Format) -> impl Iterator<Item = i32> {
    let span = format.max_exponent() - format.min_normal_exponent();
    let top = 31 - (span as u32).leading_zeros();
    (0..=top).rev().map(|bit| 1 << bit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponent_steps_cover_the_normal_range() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let reach: i32 = exponent_steps(format).sum();
            let span = format.max_exponent() - format.min_normal_exponent();
            assert!(reach >= span && reach < 2 * span + 1, "{format}: {reach}");
        }
        assert_eq!(
            exponent_steps(Fp8Format::E4M3).collect::<Vec<_>>(),
            [8, 4, 2, 1]
        );
        assert_eq!(
            exponent_steps(Fp8Format::E5M2).collect::<Vec<_>>(),
            [16, 8, 4, 2, 1]
        );
    }
}
