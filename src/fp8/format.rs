//! The two fp8 formats and the modes that combine them.

use core::fmt;
use serde::{Deserialize, Serialize};

/// An 8-bit floating-point format, as NVIDIA's Hopper GPUs and `ml_dtypes` define it.
///
/// Both are emulated: values stay in f32 tensors and are rounded to the format's grid
/// (see [`quantize_dequantize`](super::quantize_dequantize)).
///
/// ```
/// use burn_accelerate::fp8::Fp8Format;
///
/// assert_eq!(Fp8Format::E4M3.max_finite(), 448.0);
/// assert_eq!(Fp8Format::E5M2.max_finite(), 57344.0);
/// // The smallest subnormal of E4M3 is 2^-9.
/// assert_eq!(Fp8Format::E4M3.min_subnormal(), 2f32.powi(-9));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Fp8Format {
    /// `float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, no infinities, max 448. More
    /// precision, less range: the format of weights and activations.
    #[serde(rename = "e4m3")]
    E4M3,
    /// `float8_e5m2`: 5 exponent bits, 2 mantissa bits, f16's exponent range, max 57344. More
    /// range, less precision: the format of gradients under [`Fp8Mode::Hybrid`].
    #[serde(rename = "e5m2")]
    E5M2,
}

impl Fp8Format {
    /// The largest finite value; everything beyond it saturates to it.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// Explicit mantissa bits: each binade holds `2^mantissa_bits` values.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }

    /// The exponent of the smallest normal value (below it, values are subnormal and spaced
    /// evenly by [`min_subnormal`](Self::min_subnormal)).
    pub const fn min_normal_exponent(self) -> i32 {
        match self {
            Fp8Format::E4M3 => -6,
            Fp8Format::E5M2 => -14,
        }
    }

    /// The exponent of the largest binade, the one [`max_finite`](Self::max_finite) is in.
    pub const fn max_exponent(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 8,
            Fp8Format::E5M2 => 15,
        }
    }

    /// The spacing of the subnormals, which is also the smallest positive value.
    pub fn min_subnormal(self) -> f32 {
        pow2(self.min_normal_exponent() - self.mantissa_bits() as i32)
    }

    /// The name `ml_dtypes` and the golden files use (`"e4m3"`, `"e5m2"`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }
}

impl fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which format each pass uses: Transformer Engine's `Format.E4M3` and `Format.HYBRID`.
///
/// ```
/// use burn_accelerate::fp8::{Fp8Format, Fp8Mode};
///
/// assert_eq!(Fp8Mode::Hybrid.forward_format(), Fp8Format::E4M3);
/// assert_eq!(Fp8Mode::Hybrid.backward_format(), Some(Fp8Format::E5M2));
/// assert_eq!(Fp8Mode::E4M3.backward_format(), None); // gradients stay f32
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Fp8Mode {
    /// E4M3 in the forward pass; gradients pass through unquantized.
    #[serde(rename = "e4m3")]
    E4M3,
    /// E4M3 in the forward pass, E5M2 for the gradients of the same inputs in the backward
    /// pass. Transformer Engine's default, and the one `"fp8"` names.
    #[default]
    #[serde(rename = "hybrid")]
    Hybrid,
}

impl Fp8Mode {
    /// Both modes, E4M3 first.
    pub const ALL: [Fp8Mode; 2] = [Fp8Mode::E4M3, Fp8Mode::Hybrid];

    /// The format the inputs of lower-class ops are rounded to in the forward pass.
    pub const fn forward_format(self) -> Fp8Format {
        Fp8Format::E4M3
    }

    /// The format the gradients of those inputs are rounded to, `None` when they stay f32.
    pub const fn backward_format(self) -> Option<Fp8Format> {
        match self {
            Fp8Mode::E4M3 => None,
            Fp8Mode::Hybrid => Some(Fp8Format::E5M2),
        }
    }

    /// Lower-case name (`"e4m3"`, `"hybrid"`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Mode::E4M3 => "e4m3",
            Fp8Mode::Hybrid => "hybrid",
        }
    }
}

impl fmt::Display for Fp8Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// 2^e for the small exponents fp8 needs, exactly.
pub(crate) fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_finite_is_the_top_of_the_largest_binade() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            // e4m3fn gives up the top mantissa pattern to NaN, e5m2 gives its top binade to
            // inf/NaN: either way the largest finite value is 1.75 x 2^max_exponent.
            assert_eq!(f.max_finite(), 1.75 * pow2(f.max_exponent()), "{f}");
        }
        assert_eq!(Fp8Format::E5M2.min_subnormal(), pow2(-16));
    }
}
