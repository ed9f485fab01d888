//! The decorator's routes to the crate's kernels for the ops it forwards with or without
//! autocast: each checks what the registered kernel takes (dtype, shape, autocast where the
//! kernel gives other bits than the backend's) and otherwise calls `B`'s own op. The table of
//! kernels a backend type has is [`crate::cpu::table`], below the decorator, autocast and the
//! capability probe, which read it too (autocast's casts; the probe's paths).

use crate::autocast::CastPlan;
use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, DType, Distribution, FloatDType, Scalar, Shape, TensorMetadata};

use crate::cpu::table::Softmax;
pub(crate) use crate::cpu::table::{Kernels, Route, of};

/// `B::relu`, through the registered kernel for bf16 and f16 tensors.
#[inline]
pub(crate) fn relu<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    if matches!(tensor.dtype(), DType::BF16 | DType::F16)
        && let Some(kernels) = of::<B>()
    {
        return (kernels.relu)(tensor);
    }
    B::relu(tensor)
}

/// `B::float_mask_fill`, through the registered kernel for f32, bf16 and f16 tensors, with or
/// without autocast: its values are `B`'s own bits (a copy or the fill value), read through
/// a broadcast mask where it lies instead of copied out to the tensor's shape first.
#[inline]
pub(crate) fn mask_fill<B: Backend>(
    tensor: FloatTensor<B>,
    mask: BoolTensor<B>,
    value: Scalar,
) -> FloatTensor<B> {
    if matches!(tensor.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && let Some(kernels) = of::<B>()
    {
        return (kernels.mask_fill)(tensor, mask, value);
    }
    B::float_mask_fill(tensor, mask, value)
}

/// Whether the registered elementwise kernels may take `lhs` and `rhs`: one half dtype, one
/// shape (the kernel itself hands strided views to the backend's own).
#[inline]
fn half_pair<T: TensorMetadata>(lhs: &T, rhs: &T) -> bool {
    let dtype = lhs.dtype();
    matches!(dtype, DType::BF16 | DType::F16) && rhs.dtype() == dtype && lhs.shape() == rhs.shape()
}

// The forwarding of `float_add`, `float_sub`, `float_mul` and `float_div` (after autocast's
// plan has promoted mixed dtypes), and of their `_scalar` forms: through the registered kernel
// for half tensors, with or without autocast, as the values are `B`'s own bits (each rounded
// once from the f32 op); broadcast shapes, f32 and f64 through `B`'s own.
macro_rules! elementwise_routes {
    ($($(#[$doc:meta])* $name:ident => $own:ident;)*) => {$(
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name<B: Backend>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
            if half_pair(&lhs, &rhs)
                && let Some(kernels) = of::<B>()
            {
                return (kernels.$name)(lhs, rhs);
            }
            B::$own(lhs, rhs)
        }
    )*};
}

macro_rules! scalar_routes {
    ($($(#[$doc:meta])* $name:ident => $own:ident;)*) => {$(
        $(#[$doc])*
        #[inline]
        pub(crate) fn $name<B: Backend>(lhs: FloatTensor<B>, rhs: Scalar) -> FloatTensor<B> {
            if matches!(lhs.dtype(), DType::BF16 | DType::F16)
                && let Some(kernels) = of::<B>()
            {
                return (kernels.$name)(lhs, rhs);
            }
            B::$own(lhs, rhs)
        }
    )*};
}

elementwise_routes! {
    /// `B::float_add`, through the registered kernel for two half tensors of one shape.
    add => float_add;
    /// `B::float_sub`, as [`add`].
    sub => float_sub;
    /// `B::float_mul`, as [`add`].
    mul => float_mul;
    /// `B::float_div`, as [`add`].
    div => float_div;
}

scalar_routes! {
    /// `B::float_add_scalar`, through the registered kernel for half tensors.
    add_scalar => float_add_scalar;
    /// `B::float_sub_scalar`, as [`add_scalar`].
    sub_scalar => float_sub_scalar;
    /// `B::float_mul_scalar`, as [`add_scalar`].
    mul_scalar => float_mul_scalar;
    /// `B::float_div_scalar`, as [`add_scalar`].
    div_scalar => float_div_scalar;
}

/// `B::float_reshape`, of a copy made by the registered kernel where `B`'s reshape would copy
/// the view itself: the same values, with or without autocast.
#[inline]
pub(crate) fn reshape<B: Backend>(tensor: FloatTensor<B>, shape: Shape) -> FloatTensor<B> {
    match of::<B>() {
        Some(kernels) => (kernels.reshape)(tensor, shape),
        None => B::float_reshape(tensor, shape),
    }
}

/// `B::float_random`: a Bernoulli tensor (dropout's mask) drawn by the registered generator
/// under autocast where it takes the dtype, every other call by `B`'s own.
///
/// Under autocast a mask is not `B`'s for the same seed (another generator, whose values do
/// not depend on the number of threads): a mixed-precision run's values already differ from
/// its f32 run's, and dropout asks for independent masks, not for Flex's. Every other
/// distribution is `B`'s own, autocast or not: Burn initialises parameters lazily, at their
/// first use, so a `Uniform` or `Normal` draw under autocast can be a model's initial weights,
/// which must be the same in a bf16 run as in an f32 one, and as in Burn's
/// `SupervisedTraining`, whose `fork` initialises them before autocast starts. With autocast
/// off every call is `B`'s own, so the decorator then draws `B`'s values for a seed, bit for
/// bit.
#[inline]
pub(crate) fn random<B: Backend>(
    shape: Shape,
    distribution: Distribution,
    device: &B::Device,
    dtype: FloatDType,
) -> FloatTensor<B> {
    if matches!(distribution, Distribution::Bernoulli(_))
        && crate::autocast::current().is_some()
        && let Some(kernels) = of::<B>()
        && let Some(tensor) = (kernels.random)(&shape, distribution, dtype)
    {
        return tensor;
    }
    B::float_random(shape, distribution, device, dtype)
}

/// Whether a softmax of `tensor` along `dim` goes to the registered kernel: under autocast
/// (with autocast off the call is `B`'s own, bit for bit), of an f32 tensor (autocast's plan
/// has cast it: softmax is of its fp32 class) along its last dimension.
#[inline]
fn fused_softmax<T: TensorMetadata>(tensor: &T, dim: usize) -> bool {
    crate::autocast::current().is_some() && tensor.dtype() == DType::F32 && dim + 1 == tensor.rank()
}

/// Whether the plan would cast `tensor`, a half tensor, to f32 for a softmax along its last
/// dimension `dim`: then the kernel takes it as it is and widens each row as it reads it,
/// with the bits of the cast and the f32 softmax (widening is exact), and without the f32
/// copy (attention's scores are the largest tensor of a transformer's step, and their cast
/// and its fresh pages a few percent of it).
#[inline]
fn widened_softmax<T: TensorMetadata>(plan: &CastPlan, tensor: &T, dim: usize) -> bool {
    plan.target() == Some(FloatDType::F32)
        && !plan.rounds_to_fp8()
        && matches!(tensor.dtype(), DType::BF16 | DType::F16)
        && dim + 1 == tensor.rank()
}

/// `B::softmax` of an autocast call, given its plan and its input as the caller passed it:
/// through the registered kernel under autocast for f32, or a half input the plan would widen,
/// along the last dimension; the plan's cast and `B`'s own otherwise. The kernel hands a
/// strided view to `B`'s own.
#[inline]
pub(crate) fn softmax<B: Backend>(
    plan: &CastPlan,
    tensor: FloatTensor<B>,
    dim: usize,
) -> FloatTensor<B> {
    let kernels = |k: Kernels<B>| (k.softmax_of_half, k.softmax);
    softmax_route::<B>(plan, tensor, dim, kernels, B::softmax)
}

/// `B::log_softmax` of an autocast call, as [`softmax`].
#[inline]
pub(crate) fn log_softmax<B: Backend>(
    plan: &CastPlan,
    tensor: FloatTensor<B>,
    dim: usize,
) -> FloatTensor<B> {
    let kernels = |k: Kernels<B>| (k.log_softmax_of_half, k.log_softmax);
    softmax_route::<B>(plan, tensor, dim, kernels, B::log_softmax)
}

// The route both take: `kernels` picks the (half input, f32 input) kernels of the table, `own`
// is `B`'s op.
#[inline]
fn softmax_route<B: Backend>(
    plan: &CastPlan,
    tensor: FloatTensor<B>,
    dim: usize,
    kernels: impl Fn(Kernels<B>) -> (Softmax<B>, Softmax<B>),
    own: Softmax<B>,
) -> FloatTensor<B> {
    if widened_softmax(plan, &tensor, dim)
        && let Some(table) = of::<B>()
    {
        return (kernels(table).0)(tensor, dim);
    }
    let tensor = plan.cast_at::<B>(0, tensor);
    if fused_softmax(&tensor, dim)
        && let Some(table) = of::<B>()
    {
        return (kernels(table).1)(tensor, dim);
    }
    own(tensor, dim)
}

/// `B::gelu`, through the registered kernel under autocast for f32, bf16 and f16 tensors. With
/// autocast off the call is `B`'s own, bit for bit: the kernel's `erf` is not libm's.
#[inline]
pub(crate) fn gelu<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    if crate::autocast::current().is_some()
        && matches!(tensor.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && let Some(kernels) = of::<B>()
    {
        return (kernels.gelu)(tensor);
    }
    B::gelu(tensor)
}

/// Restarts the registered generator at `seed`, stream 0, beside `B::seed`: a run seeded the
/// same way draws the same tensors under autocast too.
pub(crate) fn seed(seed: u64) {
    #[cfg(feature = "flex")]
    crate::cpu::counter_rng::seed(seed);
    #[cfg(not(feature = "flex"))]
    let _ = seed;
}
