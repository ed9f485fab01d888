//! The crate's own kernels a backend type has, and the one place the decorator reaches them.
//!
//! The kernels of [`crate::cpu`] take Flex's tensors, or `Autodiff<Flex>`'s for their backward
//! nodes, while the decorator only sees a generic `B: Backend`. So they are registered here,
//! per backend type, as one [`Kernels`] table looked up by `TypeId` (see [`Hooks`]): a lookup
//! for any other backend finds nothing and the backend's own op runs. Only this file calls
//! into `crate::cpu`; the forwarding reaches the kernels through [`cast`] and [`relu`] here,
//! and through [`lowered`](super::lowered) for autocast's lower-class ops, and the capability
//! probe times the registered matmul against the backend's own.

use burn_backend::ops::ConvOptions;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use super::hooks::Hooks;
pub(crate) use crate::cpu::Route;

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
}

// By hand: a derive would ask `B: Copy`.
impl<B: Backend> Clone for Kernels<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for Kernels<B> {}

static KERNELS: Hooks = Hooks::new(register_known);

// The registration point: `crate::cpu`'s kernels for Flex, and their autodiff nodes for
// `Autodiff<Flex>` (default checkpointing; another strategy keeps Burn's own ops).
fn register_known() {
    #[cfg(feature = "flex")]
    {
        use crate::cpu::{fast_cast, half_activation, low_conv, low_gemm};
        use burn::backend::{Autodiff, Flex};

        KERNELS.insert::<Flex, _>(Kernels::<Flex> {
            cast: fast_cast::convert,
            matmul: low_gemm::gemm,
            linear: low_gemm::linear,
            conv2d: low_conv::conv2d,
            relu: half_activation::relu,
        });
        KERNELS.insert::<Autodiff<Flex>, _>(Kernels::<Autodiff<Flex>> {
            cast: fast_cast::convert_tracked,
            matmul: low_gemm::gemm_tracked,
            linear: low_gemm::linear_tracked,
            conv2d: low_conv::conv2d_tracked,
            relu: half_activation::relu_tracked,
        });
    }
}

/// The kernels registered for `B`, if any.
#[inline]
pub(crate) fn of<B: Backend>() -> Option<Kernels<B>> {
    KERNELS.get::<B, Kernels<B>>()
}

/// Whether the CPU kernels can run bf16 GEMMs on this CPU's AVX512-BF16 dot-product
/// instructions (on [`Route::Fastest`]): the CPU has them and Flex is built in.
pub(crate) fn has_bf16_dot_products() -> bool {
    #[cfg(feature = "flex")]
    {
        crate::cpu::bf16_gemm::available()
    }
    #[cfg(not(feature = "flex"))]
    false
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
