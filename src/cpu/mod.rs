//! The crate's own CPU kernels for half-precision ops on Flex, where Flex 0.21's are slow: the
//! adapters between Flex's tensors and the kernels of `burn_accelerate_kernels`
//! (crates/kernels), which do the arithmetic on slices and know no Burn.
//!
//! Flex computes bf16 and f16 one scalar conversion at a time around its f32 kernels (or with
//! the `gemm` crate's f16 kernels, which sum in f16), so that without these a bf16 training
//! step on a CPU costs more than an f32 one. Each kernel does the arithmetic of a
//! half-precision op with f32 accumulation, on vectorised conversions and on every core, and
//! comes here in two forms: on `FlexTensor`s (for `Flex`), and as a node of Burn's autodiff
//! (for `Autodiff<Flex>`, default checkpointing), since a backward node can only be built with
//! the concrete backend in hand. An adapter decides which tensors a kernel takes (dtype,
//! layout, shapes), hands it their buffers (in place where nothing else holds one), wraps what
//! comes back, and otherwise calls Flex's own op; its tests hold the pair against Flex.
//!
//! Nothing here knows the decorator or autocast. The decorator reaches these kernels through
//! one table, [`table`], which registers them for `Flex` and `Autodiff<Flex>`;
//! `crate::backend::lowered` decides when autocast's lower-class ops take them, and the
//! capability probe times them against Flex's own (`crate::capability`). Every other backend,
//! and every op or operand not listed below, keeps the backend's own kernel.
//!
//! What each kernel is for, and when it applies:
//!
//! - [`fast_cast`]: the casts autocast inserts between f32 and bf16 or f16. Taken for every
//!   such cast on Flex (it gives Flex's bits, but for the rare f32 just past a rounding tie,
//!   which it rounds correctly where Flex does not); casts between other dtypes go to Flex's.
//! - [`half_activation`]: ReLU of bf16 and f16 tensors, with or without autocast (Flex's own
//!   bits). Not for f32 tensors, nor for a view whose values are not contiguous in order
//!   (Flex's own ReLU).
//! - [`half_elementwise`]: add, sub, mul and div of two bf16 or two f16 tensors of one shape,
//!   and their `_scalar` forms (dropout's `x * mask` and `* (1 / keep)`, attention's scaling),
//!   with autodiff nodes giving Burn's own gradients; with or without autocast (Flex's own bits,
//!   each value rounded once from f32). Not for broadcast shapes, strided views, mixed dtypes,
//!   f32 or f64 (Flex's own, and Burn's own node on `Autodiff<Flex>`).
//! - [`low_gemm`]: autocast's lower-class matmul (batched too, as in attention) and linear
//!   (an input of any rank taken as the matrix of its rows). Applies under autocast to half
//!   operands of one dtype, 2-D or batches with the same leading dimensions (a broadcast
//!   batch comes expanded, as a stride-0 view: `backend::lowered`), by rule unless the context
//!   fixed Flex's own path (`Context::with_half_path`). Not for vectors, mixed dtypes, outside
//!   autocast or under `HalfPath::Own`.
//! - [`low_conv`] (over the kernels' `half_conv`, `im2col` GEMMs): autocast's lower-class
//!   conv2d, and conv1d as a convolution of one-pixel-high images, forward and backward, on
//!   the same conditions as `low_gemm`. Grouped convolutions and [`Route::Widened`] run Flex's
//!   own f32 convolution over widened operands instead of the GEMMs. Not for conv3d,
//!   transposed or deformable convolutions (Flex's own).
//! - the kernels' `bf16_gemm`: the GEMM on AMX tiles or AVX512-BF16 dot products that
//!   `low_gemm` and `half_conv` use for bf16 on [`Route::Fastest`], where the CPU has the
//!   instructions (x86-64: AMD Zen 4, Intel Cooper Lake and later, detected at run time). Not
//!   for f16, on other CPUs or on [`Route::Widened`]: there the operands are widened to f32
//!   for Flex's f32 GEMM.
//! - [`counter_rng`]: Bernoulli tensors (`float_random`) from a counter-based generator
//!   (Philox4x32-10) on every core, written in f32, bf16 or f16 directly: dropout's masks,
//!   which Flex draws one value at a time. Taken under autocast only, with the decorator's
//!   `seed` resetting it; every other distribution is Flex's own (Burn initialises parameters
//!   lazily, so a draw under autocast can be a model's initial weights, which must not depend
//!   on the precision), as are f64 and what Burn's sampler rejects, and everything with
//!   autocast off (so Flex's values for a seed).
//! - [`softmax`]: autocast's softmax and log-softmax (f32, its fp32 class) along the last
//!   dimension, one fused pass per row on every core with a vectorised `exp` (within 1 ulp),
//!   and backward nodes that keep the output; [`gelu`]: GELU (Burn's erf form) of f32, bf16
//!   and f16 tensors, on a vectorised normal CDF, half values widened in-register and rounded
//!   once, with a fused backward. Both are compiled for AVX-512, AVX2 and a portable fallback
//!   that give the same bits. Taken under autocast only (with autocast off the decorator is
//!   Flex's own, bit for bit), for contiguous tensors (softmax: f32 along the last dimension);
//!   anything else goes to Flex's own, or Burn's composition on `Autodiff<Flex>`.
//! - [`masked_fill`]: `mask_fill` of f32, bf16 and f16 tensors through a mask broadcast to
//!   them (attention's causal mask), read by its own strides on every core, with or without
//!   autocast (Flex's own bits: a copy or the fill value). Not for f64 or a mask that does not
//!   broadcast (Flex's own, which copies the mask out to the tensor's shape first).
//! - [`strided_copy`]: a view of three or more (merged) dimensions copied out before a
//!   reshape that Flex would copy it for (attention's head transposes), in runs of its last
//!   dimension on every core, with or without autocast (the same values). Not for flipped
//!   views or those of one or two dimensions (Flex's own copy, already tiled).
//! - [`half_kernels`]: Flex's half tensors handed to the elementwise blocks the others are
//!   built of (the kernels' `half`: conversions, a linear's epilogue, the bias gradient's row
//!   sums, ReLU's map), bit for bit Flex's arithmetic.
//!
//! All of it is compiled with the `flex` feature only; [`Route`], which the decorator passes
//! in, and [`table`], the kernels each backend type has (none without `flex`), always.

#[cfg(feature = "flex")]
pub(crate) mod counter_rng;
#[cfg(feature = "flex")]
pub(crate) mod fast_cast;
#[cfg(feature = "flex")]
pub(crate) mod gelu;
#[cfg(feature = "flex")]
pub(crate) mod half_activation;
#[cfg(feature = "flex")]
pub(crate) mod half_elementwise;
#[cfg(feature = "flex")]
pub(crate) mod half_kernels;
#[cfg(feature = "flex")]
pub(crate) mod low_conv;
#[cfg(feature = "flex")]
pub(crate) mod low_gemm;
#[cfg(feature = "flex")]
pub(crate) mod masked_fill;
#[cfg(feature = "flex")]
pub(crate) mod softmax;
#[cfg(feature = "flex")]
pub(crate) mod strided_copy;
pub(crate) mod table;

/// How the GEMMs and convolutions compute: what the thread's (or the process's) half path says
/// (`capability::half_path`), decided by the decorator at each op and kept by the op's backward
/// node for its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// The fastest this CPU has: bf16 on the dot-product GEMM where the CPU has AVX512-BF16,
    /// convolutions as `im2col` GEMMs; sums in another order than Flex's.
    Fastest,
    /// The operands widened to f32 and Flex's own f32 kernels (its GEMM, its convolution): for
    /// bf16 Flex's own bits, the same on every CPU (`HalfPath::Widened`).
    Widened,
}
