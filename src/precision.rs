//! The precision a model computes in, named the way Accelerate names it.

use burn_backend::FloatDType;
use core::fmt;
use core::str::FromStr;
use serde::{Deserialize, Serialize};

use crate::error::AccelerateError;

/// The mixed-precision mode: which low dtype autocast lowers eligible ops to.
///
/// `F32` means "no mixed precision" (Accelerate's `"no"`): autocast leaves every op alone.
///
/// ```
/// use burn_accelerate::Precision;
///
/// let p: Precision = "bf16".parse().unwrap();
/// assert_eq!(p, Precision::Bf16);
/// assert_eq!(p.to_string(), "bf16");
/// assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::F16);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[non_exhaustive]
pub enum Precision {
    /// Full precision: autocast is a no-op.
    #[default]
    #[serde(rename = "no")]
    F32,
    /// bfloat16: f32's range with 8 bits of mantissa; needs no loss scaling.
    #[serde(rename = "bf16")]
    Bf16,
    /// IEEE half: 10 bits of mantissa but a narrow range; pair it with loss scaling.
    #[serde(rename = "fp16")]
    F16,
}

impl Precision {
    /// Every precision, in the order `env`-style reports list them.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    /// The dtype lower-class ops run in, `None` for full precision.
    pub fn low_dtype(self) -> Option<FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(FloatDType::BF16),
            Precision::F16 => Some(FloatDType::F16),
        }
    }

    /// Accelerate's name for this mode (`"no"`, `"bf16"`, `"fp16"`).
    pub fn accelerate_name(self) -> &'static str {
        match self {
            Precision::F32 => "no",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
        }
    }

    /// Whether dynamic loss scaling is on by default for this precision (as in Accelerate:
    /// only f16's narrow exponent range needs it).
    pub fn wants_loss_scaling(self) -> bool {
        matches!(self, Precision::F16)
    }

    // A one-byte code, so the process-wide default fits an atomic. 0 is reserved for "off".
    pub(crate) fn code(self) -> u8 {
        match self {
            Precision::F32 => 1,
            Precision::Bf16 => 2,
            Precision::F16 => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Precision> {
        match code {
            1 => Some(Precision::F32),
            2 => Some(Precision::Bf16),
            3 => Some(Precision::F16),
            _ => None,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

impl FromStr for Precision {
    type Err = AccelerateError;

    /// Accepts Accelerate's names (`no`, `bf16`, `fp16`) and Burn-style ones (`f32`, `f16`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "no" | "f32" | "fp32" | "full" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Precision::F16),
            _ => Err(AccelerateError::UnknownPrecision(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_accelerate_and_burn_names() {
        for p in Precision::ALL {
            assert_eq!(p.accelerate_name().parse::<Precision>().unwrap(), p);
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
            assert_eq!(Precision::from_code(p.code()), Some(p));
        }
    }

    #[test]
    fn unknown_name_is_a_typed_error_that_lists_the_choices() {
        let err = "fp12".parse::<Precision>().unwrap_err();
        assert!(matches!(err, AccelerateError::UnknownPrecision(ref s) if s == "fp12"));
        assert!(err.to_string().contains("bf16"), "{err}");
    }
}
