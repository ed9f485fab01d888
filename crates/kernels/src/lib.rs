//! burn-accelerate's CPU kernels for half-precision training, on slices: what the root crate's
//! Flex adapters (`burn_accelerate`'s `src/cpu/`) run where Flex 0.21's own half-precision ops
//! are slow. Nothing here knows Burn, a tensor or autodiff: every kernel takes and returns
//! plain values (`&[f32]`, `&mut [bf16]`, strides), and the adapters hand them a tensor's
//! buffer and wrap what comes back.
//!
//! - [`half`]: the conversions between f32 and bf16 or f16, vectorised (AVX-512, AVX2, F16C)
//!   and bit for bit `half`'s own, and the elementwise blocks built on them (maps, a linear's
//!   epilogue, row sums), in tasks on rayon's threads.
//! - [`bf16_gemm`]: a bf16 GEMM summing in f32 on AVX512-BF16 dot products or Intel AMX tiles,
//!   whichever the CPU has (detected at run time).
//! - [`f32_gemm`]: the f32 GEMM Flex itself runs (the `gemm` crate), called with strides, and
//!   the choice between it and the bf16 one.
//! - [`half_conv`]: 2-D convolution of half tensors, forward and backward, as `im2col` GEMMs,
//!   and its bias gradient's channel sums.
//! - [`softmax`], [`gelu`] (over [`exp`]): row-wise softmax and log-softmax and GELU, with
//!   their gradients, compiled for AVX-512, AVX2 and a portable fallback that give the same
//!   bits ([`isa`]).
//! - [`philox`]: Philox4x32-10 words on every core, and Bernoulli values written from them.
//! - [`strided`]: strided views copied out in order, and values filled through a broadcast
//!   mask read by its own strides.
//! - [`tasks`]: the parallel loops all of the above run on rayon's threads, in which a
//!   calling thread outside rayon's pool (a program's `main`) computes its share instead of
//!   sleeping until the pool is done.
//!
//! What the process holds here (6 statics, none a setting): the CPU's capabilities, detected
//! once (`OnceLock`s: `AVAILABLE` twice and `KERNEL` in [`bf16_gemm`], `SUPPORT` for its AMX
//! tiles, which also asks Linux for the tile state once), and per-thread scratch reused across
//! calls, as a fresh buffer is mapped and page-faulted in on every call (`thread_local`s
//! `SCRATCH` and `IMAGE_WORK` in [`half_conv`]). Each kernel gives the same values whichever
//! thread runs it.

pub mod bf16_gemm;
pub mod exp;
pub mod f32_gemm;
pub mod gelu;
pub mod half;
pub mod half_conv;
pub mod isa;
pub mod philox;
pub mod softmax;
pub mod strided;
pub mod tasks;

/// Whether rayon has several threads to share work among. The kernels run their parallel
/// loops only then: from outside the pool, a loop in a pool of one thread only adds a
/// hand-over to its worker and back (4% of a one-thread f16 step for the conversions, 6% of a
/// bf16 step for the GEMMs), as the `gemm` crate knows.
pub fn several_threads() -> bool {
    rayon::current_num_threads() > 1
}
