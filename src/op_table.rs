//! The autocast op table: every backend op autocast may touch, with its default class, and
//! the classes. Data below everything that reads it (autocast's cast plans, the capability
//! probe, fp8's sites), re-exported as `autocast::{Op, OpClass}`.
//!
//! This is the one place that decides what runs in low precision. It follows PyTorch's CUDA
//! autocast lists (`lower_precision_fp`, `fp32`, `promote` in ATen's `autocast_mode.h`) on every
//! device. PyTorch's CPU autocast is laxer (under CPU bf16 autocast `exp` of a bf16 tensor stays
//! bf16, see `tests/golden/autocast_ops_cpu_bf16.json`); one table for all devices keeps a model's
//! numerics the same wherever it runs, and keeping the precision-sensitive ops in f32 is the
//! safe side of that choice.
//!
//! `scripts/gen_forwarding.py` reads the `autocast_ops!` list below: a backend method named
//! here gets a cast plan in front of its forwarding call; every other method is forwarded
//! untouched. Change a default by editing a line and rerunning the generator, or at run time
//! for a training with [`OpClasses`](crate::autocast::OpClasses) (`AutocastConfig::op_classes`,
//! `AccelerateConfig::op_classes`, [`scope_op_classes`](crate::autocast::scope_op_classes)).

use serde::{Deserialize, Serialize};

/// How autocast treats an op's float inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OpClass {
    /// Cast inputs to the autocast dtype (bf16/f16), where the device can run it.
    Lower,
    /// Cast low-precision inputs up to f32; the result is f32.
    Fp32,
    /// Run in the widest dtype among the inputs, so mixed dtypes never reach the backend.
    Promote,
    /// Leave the inputs alone.
    Passthrough,
}

impl OpClass {
    pub(crate) const fn code(self) -> u8 {
        match self {
            OpClass::Lower => 1,
            OpClass::Fp32 => 2,
            OpClass::Promote => 3,
            OpClass::Passthrough => 4,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<OpClass> {
        Some(match code {
            1 => OpClass::Lower,
            2 => OpClass::Fp32,
            3 => OpClass::Promote,
            4 => OpClass::Passthrough,
            _ => return None,
        })
    }
}

macro_rules! autocast_ops {
    ($($(#[$doc:meta])* $variant:ident = $method:ident => $class:ident,)*) => {
        /// A backend op that autocast may cast the inputs of.
        ///
        /// Each variant is one method of Burn's backend ops traits (named in its doc).
        ///
        /// Serialized by variant name (fp8 checkpoints name tensors by op).
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
            serde::Serialize, serde::Deserialize,
        )]
        #[non_exhaustive]
        pub enum Op {
            $($(#[$doc])* #[doc = concat!("`", stringify!($method), "`")] $variant,)*
        }

        impl Op {
            /// Every op in the table, in table order.
            pub const ALL: &'static [Op] = &[$(Op::$variant,)*];

            /// The class an op has unless overridden.
            pub const fn default_class(self) -> OpClass {
                match self {
                    $(Op::$variant => OpClass::$class,)*
                }
            }

            /// The name of the backend method this op is.
            pub const fn method(self) -> &'static str {
                match self {
                    $(Op::$variant => stringify!($method),)*
                }
            }
        }
    };
}

autocast_ops! {
    // Lower: the matmul-shaped ops, where low precision pays and its error averages out.
    Matmul = float_matmul => Lower,
    Linear = linear => Lower,
    Conv1d = conv1d => Lower,
    Conv2d = conv2d => Lower,
    Conv3d = conv3d => Lower,
    ConvTranspose1d = conv_transpose1d => Lower,
    ConvTranspose2d = conv_transpose2d => Lower,
    ConvTranspose3d = conv_transpose3d => Lower,
    DeformConv2d = deform_conv2d => Lower,
    Attention = attention => Lower,
    Prelu = prelu => Lower,

    // Fp32: ops whose range or accumulated rounding error low precision would ruin.
    Exp = float_exp => Fp32,
    Log = float_log => Fp32,
    Log1p = float_log1p => Fp32,
    Powf = float_powf => Fp32,
    PowfScalar = float_powf_scalar => Fp32,
    PowiScalar = float_powi_scalar => Fp32,
    Sqrt = float_sqrt => Fp32,
    Recip = float_recip => Fp32,
    Erf = float_erf => Fp32,
    Tan = float_tan => Fp32,
    Cosh = float_cosh => Fp32,
    Sinh = float_sinh => Fp32,
    Acos = float_acos => Fp32,
    Asin = float_asin => Fp32,
    Sum = float_sum => Fp32,
    SumDim = float_sum_dim => Fp32,
    Mean = float_mean => Fp32,
    MeanDim = float_mean_dim => Fp32,
    Prod = float_prod => Fp32,
    ProdDim = float_prod_dim => Fp32,
    Cumsum = float_cumsum => Fp32,
    Cumprod = float_cumprod => Fp32,
    Softmax = softmax => Fp32,
    LogSoftmax = log_softmax => Fp32,
    Softmin = softmin => Fp32,
    LogSigmoid = log_sigmoid => Fp32,
    LayerNorm = layer_norm => Fp32,
    Interpolate = interpolate => Fp32,
    GridSample2d = float_grid_sample_2d => Fp32,
    CtcLoss = ctc_loss => Fp32,
    Rfft = rfft => Fp32,

    // Promote: several float inputs; Burn's backends do not mix dtypes, so all run in the widest.
    Add = float_add => Promote,
    Sub = float_sub => Promote,
    Mul = float_mul => Promote,
    Div = float_div => Promote,
    Remainder = float_remainder => Promote,
    Atan2 = float_atan2 => Promote,
    Cross = float_cross => Promote,
    Cat = float_cat => Promote,
    MaskWhere = float_mask_where => Promote,
    ScatterAdd = float_scatter_add => Promote,
    SelectAdd = float_select_add => Promote,
    SliceAssign = float_slice_assign => Promote,
    Equal = float_equal => Promote,
    NotEqual = float_not_equal => Promote,
    Greater = float_greater => Promote,
    GreaterEqual = float_greater_equal => Promote,
    Less = float_lower => Promote,
    LessEqual = float_lower_equal => Promote,
    Irfft = irfft => Promote,
}
