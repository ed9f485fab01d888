//! The precision a model computes in, named the way Accelerate names it.

use burn_backend::FloatDType;
use core::fmt;
use core::str::FromStr;
use serde::{Deserialize, Serialize};

use crate::fp8::Fp8Mode;

/// The mixed-precision mode: which low dtype autocast lowers eligible ops to.
///
/// `F32` means "no mixed precision" (Accelerate's `"no"`): autocast leaves every op alone.
///
/// ```
/// use burn_accelerate::Precision;
/// use burn_accelerate::fp8::Fp8Mode;
///
/// let p: Precision = "bf16".parse().unwrap();
/// assert_eq!(p, Precision::Bf16);
/// assert_eq!(p.to_string(), "bf16");
/// assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::F16);
/// // Accelerate's "fp8" is Transformer Engine's default format, HYBRID.
/// assert_eq!("fp8".parse::<Precision>().unwrap(), Precision::Fp8(Fp8Mode::Hybrid));
/// assert_eq!("fp8-e4m3".parse::<Precision>().unwrap(), Precision::Fp8(Fp8Mode::E4M3));
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
    /// fp8, emulated: lower-class ops' inputs are rounded to E4M3 (and, under
    /// [`Fp8Mode::Hybrid`], their gradients to E5M2) with per-tensor delayed scaling, and the
    /// ops run in f32. See [`fp8`](crate::fp8).
    #[serde(rename = "fp8")]
    Fp8(Fp8Mode),
}

impl Precision {
    /// Every precision, in the order `env`-style reports list them.
    pub const ALL: [Precision; 5] = [
        Precision::F32,
        Precision::Bf16,
        Precision::F16,
        Precision::Fp8(Fp8Mode::E4M3),
        Precision::Fp8(Fp8Mode::Hybrid),
    ];

    /// The dtype lower-class ops run in, `None` where there is none to cast to: full
    /// precision, and fp8, whose values stay in f32 tensors.
    pub fn low_dtype(self) -> Option<FloatDType> {
        match self {
            Precision::F32 | Precision::Fp8(_) => None,
            Precision::Bf16 => Some(FloatDType::BF16),
            Precision::F16 => Some(FloatDType::F16),
        }
    }

    /// Whether autocast changes anything under this precision (everything but `F32`).
    pub fn is_mixed(self) -> bool {
        !matches!(self, Precision::F32)
    }

    /// The fp8 mode, for the fp8 precisions.
    pub fn fp8_mode(self) -> Option<Fp8Mode> {
        match self {
            Precision::Fp8(mode) => Some(mode),
            _ => None,
        }
    }

    /// Accelerate's name for this mode (`"no"`, `"bf16"`, `"fp16"`, `"fp8"`).
    pub fn accelerate_name(self) -> &'static str {
        match self {
            Precision::F32 => "no",
            Precision::Bf16 => "bf16",
            Precision::F16 => "fp16",
            Precision::Fp8(_) => "fp8",
        }
    }

    /// The precision without its fp8 mode (`"f32"`, `"bf16"`, `"f16"`, `"fp8"`): how the
    /// training metrics and [`TrainingStats`](crate::train::TrainingStats) label their values,
    /// and how the examples' `--precision` flag spells it.
    ///
    /// ```
    /// use burn_accelerate::Precision;
    ///
    /// assert_eq!("fp8-e4m3".parse::<Precision>()?.short_name(), "fp8");
    /// # Ok::<(), burn_accelerate::AccelerateError>(())
    /// ```
    pub fn short_name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::Fp8(_) => "fp8",
        }
    }

    /// Whether dynamic loss scaling is on by default for this precision (as in Accelerate:
    /// only f16's narrow exponent range needs it; fp8 scales each tensor instead).
    pub fn wants_loss_scaling(self) -> bool {
        matches!(self, Precision::F16)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::Fp8(Fp8Mode::E4M3) => "fp8-e4m3",
            Precision::Fp8(Fp8Mode::Hybrid) => "fp8-hybrid",
        })
    }
}

/// A precision name [`Precision`]'s `from_str` does not know (the name it was given); an
/// [`AccelerateError::UnknownPrecision`](crate::AccelerateError::UnknownPrecision) by `?`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown precision {0:?}: use one of \"no\"/\"f32\", \"bf16\", \"fp16\"/\"f16\", \
     \"fp8\" (= \"fp8-hybrid\"), \"fp8-e4m3\""
)]
pub struct UnknownPrecision(pub String);

impl FromStr for Precision {
    type Err = UnknownPrecision;

    /// Accepts Accelerate's names (`no`, `bf16`, `fp16`, `fp8`), Burn-style ones (`f32`,
    /// `f16`) and the fp8 modes (`fp8-e4m3`, `fp8-hybrid`; `_` for `-` too).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "no" | "f32" | "fp32" | "full" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "fp16" | "f16" | "float16" | "half" => Ok(Precision::F16),
            "fp8" | "fp8-hybrid" | "f8" => Ok(Precision::Fp8(Fp8Mode::Hybrid)),
            "fp8-e4m3" => Ok(Precision::Fp8(Fp8Mode::E4M3)),
            _ => Err(UnknownPrecision(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_accelerate_and_burn_names() {
        for p in Precision::ALL {
            let by_accelerate_name = p.accelerate_name().parse::<Precision>().unwrap();
            // "fp8" names both fp8 modes; it parses to the default one.
            assert_eq!(by_accelerate_name.accelerate_name(), p.accelerate_name());
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
        }
        assert_eq!(
            "FP8_E4M3".parse::<Precision>().unwrap(),
            Precision::Fp8(Fp8Mode::E4M3)
        );
    }

    #[test]
    fn fp8_serializes_with_its_mode() {
        let p = Precision::Fp8(Fp8Mode::E4M3);
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"fp8":"e4m3"}"#);
        assert_eq!(serde_json::from_str::<Precision>(&json).unwrap(), p);
        assert_eq!(serde_json::to_string(&Precision::F32).unwrap(), r#""no""#);
    }

    #[test]
    fn unknown_name_is_a_typed_error_that_lists_the_choices() {
        let err = "fp12".parse::<Precision>().unwrap_err();
        assert_eq!(err, UnknownPrecision("fp12".into()));
        assert!(err.to_string().contains("bf16"), "{err}");
    }
}
