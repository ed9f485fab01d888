//! The crate's own kernels a backend type has: one [`Kernels`] table per backend type,
//! looked up by `TypeId` in the crate's hook registry (`crate::hooks`), since the kernels
//! take Flex's tensors (or `Autodiff<Flex>`'s, for their backward nodes) while their callers
//! only see a generic `B: Backend`. A lookup for any other backend finds nothing and the
//! backend's own op runs.
//!
//! Read by the decorator's routes (`backend::kernels`, `backend::lowered`), autocast's casts
//! ([`cast`]) and the capability probe, which times the registered matmul against the
//! backend's own and reports the CPU's bf16 instructions; it knows none of them.

use burn_backend::ops::ConvOptions;
use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, Distribution, FloatDType, Scalar, Shape};

pub(crate) use super::Route;
use crate::hooks::{self, HookKind};

type Cast<B> = fn(FloatTensor<B>, FloatDType) -> FloatTensor<B>;
type Matmul<B> = fn(FloatTensor<B>, FloatTensor<B>, Route) -> FloatTensor<B>;
type Linear<B> =
    fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, Route) -> FloatTensor<B>;
type Conv2d<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    ConvOptions<2>,
    Route,
) -> FloatTensor<B>;
type Relu<B> = fn(FloatTensor<B>) -> FloatTensor<B>;
type Reshape<B> = fn(FloatTensor<B>, Shape) -> FloatTensor<B>;
type MaskFill<B> = fn(FloatTensor<B>, BoolTensor<B>, Scalar) -> FloatTensor<B>;
type Random<B> = fn(&Shape, Distribution, FloatDType) -> Option<FloatTensor<B>>;
pub(crate) type Softmax<B> = fn(FloatTensor<B>, usize) -> FloatTensor<B>;
type Gelu<B> = fn(FloatTensor<B>) -> FloatTensor<B>;
type Binary<B> = fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>;
type WithScalar<B> = fn(FloatTensor<B>, Scalar) -> FloatTensor<B>;

/// The kernels registered for one backend type `B`.
pub(crate) struct Kernels<B: Backend> {
    /// A cast between f32 and a half type (any other cast: the backend's own).
    pub(crate) cast: Cast<B>,
    /// A matmul of half matrices of one dtype, 2-D or batches with the same leading
    /// dimensions.
    pub(crate) matmul: Matmul<B>,
    /// A linear of a 2-D half input, its 2-D weight and its bias, all of one dtype.
    pub(crate) linear: Linear<B>,
    /// A 2-D convolution of half operands of one dtype.
    pub(crate) conv2d: Conv2d<B>,
    /// ReLU (half tensors in the kernels, any other through the backend's own).
    pub(crate) relu: Relu<B>,
    /// `mask_fill` with a mask broadcast to the tensor (the backend's own bits; any other
    /// through the backend's own).
    pub(crate) mask_fill: MaskFill<B>,
    /// A reshape, of a view copied out to contiguous memory where the backend's reshape would
    /// copy it (the same values), and the same for its gradient.
    pub(crate) reshape: Reshape<B>,
    /// A random tensor from the crate's counter-based generator (`crate::cpu::counter_rng`),
    /// `None` for a distribution or dtype it leaves to the backend's own.
    pub(crate) random: Random<B>,
    /// Softmax along a dimension (f32 along the last one in the kernel, anything else through
    /// the backend's own).
    pub(crate) softmax: Softmax<B>,
    /// Log-softmax along a dimension, as `softmax`.
    pub(crate) log_softmax: Softmax<B>,
    /// The f32 softmax of a half tensor along a dimension, as its cast to f32 and `softmax`
    /// give it (widened as the kernel reads it along the last dimension).
    pub(crate) softmax_of_half: Softmax<B>,
    /// The f32 log-softmax of a half tensor, as `softmax_of_half`.
    pub(crate) log_softmax_of_half: Softmax<B>,
    /// GELU (f32, bf16 and f16 in the kernel, anything else through the backend's own).
    pub(crate) gelu: Gelu<B>,
    /// `lhs + rhs` of two half tensors of one dtype and shape (the backend's own bits; any
    /// other through the backend's own).
    pub(crate) add: Binary<B>,
    /// `lhs - rhs`, as `add`.
    pub(crate) sub: Binary<B>,
    /// `lhs * rhs`, as `add`.
    pub(crate) mul: Binary<B>,
    /// `lhs / rhs`, as `add`.
    pub(crate) div: Binary<B>,
    /// `lhs + rhs` of a half tensor and a scalar (the backend's own bits; any other through
    /// the backend's own).
    pub(crate) add_scalar: WithScalar<B>,
    /// `lhs - rhs` of a scalar, as `add_scalar`.
    pub(crate) sub_scalar: WithScalar<B>,
    /// `lhs * rhs` of a scalar, as `add_scalar`.
    pub(crate) mul_scalar: WithScalar<B>,
    /// `lhs / rhs` of a scalar, as `add_scalar`.
    pub(crate) div_scalar: WithScalar<B>,
}

// By hand: a derive would ask `B: Copy`.
impl<B: Backend> Clone for Kernels<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Kernels<B> {}

// The kernels' kind in the crate's hook registry.
struct CpuKernels;

impl HookKind for CpuKernels {
    fn register_known() {
        register_known();
    }
}

// The registration point: this folder's kernels for Flex, and their autodiff nodes for
// `Autodiff<Flex>` (default checkpointing; another strategy keeps Burn's own ops).
fn register_known() {
    #[cfg(feature = "flex")]
    {
        use super::{
            counter_rng, fast_cast, gelu, half_activation, half_elementwise, low_conv, low_gemm,
            masked_fill, softmax, strided_copy,
        };
        use burn::backend::{Autodiff, Flex};

        hooks::insert::<CpuKernels, Flex, _>(Kernels::<Flex> {
            cast: fast_cast::convert,
            matmul: low_gemm::gemm,
            linear: low_gemm::linear,
            conv2d: low_conv::conv2d,
            relu: half_activation::relu,
            mask_fill: masked_fill::mask_fill,
            reshape: strided_copy::reshape,
            random: counter_rng::random,
            softmax: softmax::softmax,
            log_softmax: softmax::log_softmax,
            softmax_of_half: softmax::softmax_of_half,
            log_softmax_of_half: softmax::log_softmax_of_half,
            gelu: gelu::gelu,
            add: half_elementwise::add,
            sub: half_elementwise::sub,
            mul: half_elementwise::mul,
            div: half_elementwise::div,
            add_scalar: half_elementwise::add_scalar,
            sub_scalar: half_elementwise::sub_scalar,
            mul_scalar: half_elementwise::mul_scalar,
            div_scalar: half_elementwise::div_scalar,
        });
        hooks::insert::<CpuKernels, Autodiff<Flex>, _>(Kernels::<Autodiff<Flex>> {
            cast: fast_cast::convert_tracked,
            matmul: low_gemm::gemm_tracked,
            linear: low_gemm::linear_tracked,
            conv2d: low_conv::conv2d_tracked,
            relu: half_activation::relu_tracked,
            mask_fill: masked_fill::mask_fill_tracked,
            reshape: strided_copy::reshape_tracked,
            random: counter_rng::random_tracked,
            softmax: softmax::softmax_tracked,
            log_softmax: softmax::log_softmax_tracked,
            softmax_of_half: softmax::softmax_of_half_tracked,
            log_softmax_of_half: softmax::log_softmax_of_half_tracked,
            gelu: gelu::gelu_tracked,
            add: half_elementwise::add_tracked,
            sub: half_elementwise::sub_tracked,
            mul: half_elementwise::mul_tracked,
            div: half_elementwise::div_tracked,
            add_scalar: half_elementwise::add_scalar_tracked,
            sub_scalar: half_elementwise::sub_scalar_tracked,
            mul_scalar: half_elementwise::mul_scalar_tracked,
            div_scalar: half_elementwise::div_scalar_tracked,
        });
    }
}

/// The kernels registered for `B`, if any.
#[inline]
pub(crate) fn of<B: Backend>() -> Option<Kernels<B>> {
    hooks::get::<CpuKernels, B, Kernels<B>>()
}

/// Whether the CPU kernels can run bf16 GEMMs on this CPU's own bf16 instructions (AMX tiles
/// or AVX512-BF16 dot products, on [`Route::Fastest`]): the CPU has them and Flex is built in.
pub(crate) fn has_bf16_dot_products() -> bool {
    bf16_gemm_instructions().is_some()
}

/// The instructions the CPU kernels' bf16 GEMMs run on (on [`Route::Fastest`]), if any.
pub(crate) fn bf16_gemm_instructions() -> Option<&'static str> {
    #[cfg(feature = "flex")]
    {
        use burn_accelerate_kernels::bf16_gemm::{self, Bf16Kernel};
        match bf16_gemm::kernel()? {
            Bf16Kernel::Tiles => Some("AMX tiles (tdpbf16ps)"),
            Bf16Kernel::DotProducts => Some("AVX512-BF16 dot products (vdpbf16ps)"),
            Bf16Kernel::TileModel => unreachable!("never the CPU's kernel"),
        }
    }
    #[cfg(not(feature = "flex"))]
    None
}

/// Whether the CPU kernels use this CPU's AMX tiles, and why not where they do not.
pub(crate) fn amx_status() -> String {
    #[cfg(feature = "flex")]
    {
        burn_accelerate_kernels::bf16_gemm::amx_support().to_string()
    }
    #[cfg(not(feature = "flex"))]
    "not used (the CPU kernels come with the `flex` feature)".to_string()
}

/// Casts `tensor` to `dtype` (one of autocast's casts): through the registered kernel for `B`
/// where there is one, else with `B`'s own.
#[inline]
pub(crate) fn cast<B: Backend>(tensor: FloatTensor<B>, dtype: FloatDType) -> FloatTensor<B> {
    match of::<B>() {
        Some(kernels) => (kernels.cast)(tensor, dtype),
        None => B::float_cast(tensor, dtype),
    }
}
