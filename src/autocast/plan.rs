//! The cast plan: what the decorator does to an op's float inputs before forwarding it.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use super::rounding::InputRounding;
use super::small_ops::{call_flops, keeps_f32};
use super::tally::{self, Kept};
use super::{Op, OpClass};
use crate::capability;
use crate::context;
use crate::fp8::Fp8Site;
use crate::precision::Precision;

/// The float inputs of one op call, as the generated forwarding code hands them over.
pub enum CastInput<'a, T> {
    /// A float tensor argument.
    One(&'a T),
    /// An optional float tensor argument (a bias, say).
    Maybe(&'a Option<T>),
    /// A list of float tensors (`cat`).
    Many(&'a [T]),
}

/// The dtype one op's float inputs are cast to, decided once per call, and under fp8 the call
/// their rounding belongs to.
///
/// With autocast off and inputs of one dtype, the plan is empty and costs one read of the
/// thread's context (a thread-local and, where it entered none, an atomic load) and a dtype
/// comparison per input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastPlan {
    target: Option<FloatDType>,
    // Whether f64 inputs are cast too. Autocast's classes leave f64 alone (as PyTorch does);
    // only promotion, which must make the dtypes agree, touches them.
    include_f64: bool,
    // Under fp8, lower-class ops round their required f32 inputs after the cast.
    fp8: Option<Fp8Site>,
}

impl CastPlan {
    /// A plan that casts nothing.
    pub const NONE: CastPlan = CastPlan {
        target: None,
        include_f64: false,
        fp8: None,
    };

    /// Decides the plan for `op` given its float inputs.
    #[inline]
    pub fn new<B: Backend>(op: Op, inputs: &[CastInput<'_, FloatTensor<B>>]) -> Self {
        let mut fp8 = None;
        // The thread's context, read once for the op.
        let (class, precision, rule) = context::with_current(|context| {
            (
                context.op_class(op),
                context.precision(),
                context.small_ops(),
            )
        });
        let class_target = match class {
            OpClass::Passthrough | OpClass::Promote => None,
            OpClass::Fp32 => precision.map(|_| FloatDType::F32),
            OpClass::Lower => match precision {
                // fp8 is emulated in f32, which every device runs: nothing to probe.
                Some(Precision::Fp8(mode)) => {
                    fp8 = Some(Fp8Site::new(mode, op));
                    Some(FloatDType::F32)
                }
                Some(precision) => first_input(inputs).map(|t| {
                    let device = B::float_device(t);
                    let flops = call_flops::<B>(op, inputs);
                    match capability::lower_dtype::<B>(&device, precision, op) {
                        // Too small for the half type to pay: run as an fp32-class op.
                        low if low != FloatDType::F32
                            && keeps_f32::<B>(rule, &device, op, flops) =>
                        {
                            tally::record(Some(Kept::Small), flops);
                            FloatDType::F32
                        }
                        FloatDType::F32 => {
                            tally::record(Some(Kept::Unsupported), flops);
                            FloatDType::F32
                        }
                        low => {
                            tally::record(None, flops);
                            low
                        }
                    }
                }),
                None => None,
            },
        };
        CastPlan {
            fp8,
            ..Self::resolve(class_target, inputs)
        }
    }

    fn resolve<T: TensorMetadata>(
        class_target: Option<FloatDType>,
        inputs: &[CastInput<'_, T>],
    ) -> Self {
        // The dtype each input has once the class has had its say; if they still disagree
        // (a bias of another dtype, an f64 operand) promote them all to the widest.
        let mut first: Option<FloatDType> = None;
        let mut widest: Option<FloatDType> = None;
        let mut uniform = true;
        for_each_dtype(inputs, |dtype| {
            let Some(dtype) = float_dtype(dtype) else {
                return;
            };
            let after = match class_target {
                Some(target) if eligible(dtype) => target,
                _ => dtype,
            };
            match first {
                None => first = Some(after),
                Some(f) if f != after => uniform = false,
                _ => {}
            }
            widest = Some(widest.map_or(after, |w| wider(w, after)));
        });
        if uniform {
            CastPlan {
                target: class_target,
                include_f64: false,
                fp8: None,
            }
        } else {
            CastPlan {
                target: widest,
                include_f64: true,
                fp8: None,
            }
        }
    }

    /// The dtype this plan casts to, if any.
    pub fn target(&self) -> Option<FloatDType> {
        self.target
    }

    /// Whether this plan rounds inputs to fp8.
    pub fn rounds_to_fp8(&self) -> bool {
        self.fp8.is_some()
    }

    /// Under fp8, the rounding of the op's `input`-th required float input (its cast's
    /// quantizers, keyed for the input's amax histories), for an op that rounds that input
    /// itself: stage 3's bounded `linear` and `matmul`, which round a parameter each time they
    /// gather it.
    pub(crate) fn fp8_rounding(&self, input: u32) -> Option<InputRounding> {
        self.fp8.map(|site| InputRounding(site.cast(input)))
    }

    /// Applies the plan to the op's `input`-th required float input (0-based, in signature
    /// order): the cast, then under fp8 the rounding, whose scale belongs to that input.
    #[inline]
    pub fn cast_at<B: Backend>(&self, input: u32, tensor: FloatTensor<B>) -> FloatTensor<B> {
        let tensor = self.cast::<B>(tensor);
        match self.fp8 {
            Some(site) if rounds(tensor.dtype()) => site.apply::<B>(input, tensor),
            _ => tensor,
        }
    }

    /// Applies the plan's cast to one input, without fp8 rounding: optional inputs (biases,
    /// masks) stay in f32 under fp8, as Transformer Engine keeps biases in high precision.
    #[inline]
    pub fn cast<B: Backend>(&self, tensor: FloatTensor<B>) -> FloatTensor<B> {
        let Some(target) = self.target else {
            return tensor;
        };
        let dtype = tensor.dtype();
        let castable = match float_dtype(dtype) {
            Some(FloatDType::F64) => self.include_f64,
            Some(_) => true,
            None => false,
        };
        if castable && dtype != DType::from(target) {
            crate::cpu::table::cast::<B>(tensor, target)
        } else {
            tensor
        }
    }

    /// Applies the plan to an optional input.
    #[inline]
    pub fn cast_opt<B: Backend>(&self, tensor: Option<FloatTensor<B>>) -> Option<FloatTensor<B>> {
        tensor.map(|t| self.cast::<B>(t))
    }

    /// Applies the plan to a list of inputs, each its own input for fp8 (by position).
    #[inline]
    pub fn cast_vec<B: Backend>(&self, tensors: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        if self.target.is_none() {
            return tensors;
        }
        tensors
            .into_iter()
            .enumerate()
            .map(|(i, t)| self.cast_at::<B>(i as u32, t))
            .collect()
    }
}

// fp8 rounds f32 values; f64 is a deliberate choice autocast leaves alone.
fn rounds(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::Flex32)
}

fn first_input<'a, T>(inputs: &'a [CastInput<'a, T>]) -> Option<&'a T> {
    inputs.iter().find_map(|input| match input {
        CastInput::One(t) => Some(*t),
        CastInput::Maybe(t) => t.as_ref(),
        CastInput::Many(ts) => ts.first(),
    })
}

fn for_each_dtype<T: TensorMetadata>(inputs: &[CastInput<'_, T>], mut f: impl FnMut(DType)) {
    for input in inputs {
        match input {
            CastInput::One(t) => f(t.dtype()),
            CastInput::Maybe(t) => {
                if let Some(t) = t {
                    f(t.dtype())
                }
            }
            CastInput::Many(ts) => ts.iter().for_each(|t| f(t.dtype())),
        }
    }
}

fn float_dtype(dtype: DType) -> Option<FloatDType> {
    dtype.is_float().then(|| FloatDType::from(dtype))
}

// Autocast's classes act on f32 and the half types; f64 is a deliberate user choice.
fn eligible(dtype: FloatDType) -> bool {
    !matches!(dtype, FloatDType::F64)
}

/// The dtype both `a` and `b` fit in: f16 and bf16 meet at f32, as in PyTorch's promotion.
pub(crate) fn wider(a: FloatDType, b: FloatDType) -> FloatDType {
    fn rank(d: FloatDType) -> u8 {
        match d {
            FloatDType::F64 => 4,
            FloatDType::F32 | FloatDType::Flex32 => 3,
            FloatDType::F16 | FloatDType::BF16 => 1,
        }
    }
    if a == b {
        a
    } else if rank(a) == rank(b) {
        // f16 vs bf16, or f32 vs flex32: neither holds the other.
        if rank(a) == 1 { FloatDType::F32 } else { a }
    } else if rank(a) > rank(b) {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promotion_is_symmetric_and_half_types_meet_at_f32() {
        use FloatDType::*;
        let all = [F64, F32, F16, BF16];
        for a in all {
            for b in all {
                assert_eq!(wider(a, b), wider(b, a), "{a:?} {b:?}");
            }
        }
        assert_eq!(wider(F16, BF16), F32);
        assert_eq!(wider(BF16, F32), F32);
        assert_eq!(wider(F32, F64), F64);
        assert_eq!(wider(F16, F16), F16);
    }
}
