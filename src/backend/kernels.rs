//! The crate's own kernels a backend type has, and the one place the decorator reaches them.
//!
//! The kernels of [`crate::cpu`] take Flex's tensors, or `Autodiff<Flex>`'s for their backward
//! nodes, while the decorator only sees a generic `B: Backend`. So they are registered here,
//! per backend type, as one [`Kernels`] table looked up by `TypeId` (see [`Hooks`]): a lookup
//! for any other backend finds nothing and the backend's own op runs. Only this file calls
//! into `crate::cpu`; the forwarding reaches the kernels through [`cast`], [`relu`],
//! [`mask_fill`], [`reshape`], [`random`], [`softmax`], [`log_softmax`], [`gelu`] and the
//! elementwise arithmetic ([`add`], [`mul_scalar`], ...) here, and through [`lowered`](super::lowered) for autocast's
//! lower-class ops, and the capability probe times the registered matmul against the
//! backend's own. [`seed`] is the decorator's
//! `Backend::seed` reaching the random kernel's generator.

use burn_backend::ops::ConvOptions;
use burn_backend::tensor::{BoolTensor, FloatTensor};
use burn_backend::{Backend, DType, Distribution, FloatDType, Scalar, Shape, TensorMetadata};

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
type Reshape<B> = fn(FloatTensor<B>, Shape) -> FloatTensor<B>;
type MaskFill<B> = fn(FloatTensor<B>, BoolTensor<B>, Scalar) -> FloatTensor<B>;
type Random<B> = fn(&Shape, Distribution, FloatDType) -> Option<FloatTensor<B>>;
type Softmax<B> = fn(FloatTensor<B>, usize) -> FloatTensor<B>;
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

static KERNELS: Hooks = Hooks::new(register_known);

// The registration point: `crate::cpu`'s kernels for Flex, and their autodiff nodes for
// `Autodiff<Flex>` (default checkpointing; another strategy keeps Burn's own ops).
fn register_known() {
    #[cfg(feature = "flex")]
    {
        use crate::cpu::{
            counter_rng, fast_cast, gelu, half_activation, half_elementwise, low_conv, low_gemm,
            masked_fill, softmax, strided_copy,
        };
        use burn::backend::{Autodiff, Flex};

        KERNELS.insert::<Flex, _>(Kernels::<Flex> {
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
        KERNELS.insert::<Autodiff<Flex>, _>(Kernels::<Autodiff<Flex>> {
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
    KERNELS.get::<B, Kernels<B>>()
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

/// `B::softmax` of an autocast call (its input already cast), through the registered kernel
/// under autocast for f32 along the last dimension; the kernel hands a strided view to `B`'s
/// own.
#[inline]
pub(crate) fn softmax<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    if fused_softmax(&tensor, dim)
        && let Some(kernels) = of::<B>()
    {
        return (kernels.softmax)(tensor, dim);
    }
    B::softmax(tensor, dim)
}

/// `B::log_softmax` of an autocast call, as [`softmax`].
#[inline]
pub(crate) fn log_softmax<B: Backend>(tensor: FloatTensor<B>, dim: usize) -> FloatTensor<B> {
    if fused_softmax(&tensor, dim)
        && let Some(kernels) = of::<B>()
    {
        return (kernels.log_softmax)(tensor, dim);
    }
    B::log_softmax(tensor, dim)
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
