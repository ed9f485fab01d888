//! The crate's own CPU kernels for half-precision ops on Flex.

#[cfg(feature = "flex")]
pub(crate) mod bf16_gemm;
pub(crate) mod fast_cast;
pub(crate) mod half_activation;
#[cfg(feature = "flex")]
pub(crate) mod half_conv;
#[cfg(feature = "flex")]
pub(crate) mod half_kernels;
pub(crate) mod low_conv;
pub(crate) mod low_gemm;

/// Whether rayon has several threads to share work among. The crate's CPU kernels run their
/// parallel loops only then: from outside the pool, a loop in a pool of one thread only adds
/// a hand-over to its worker and back (4% of a one-thread f16 step for the conversions, 6% of
/// a bf16 step for the GEMMs), as the `gemm` crate knows.
#[cfg(feature = "flex")]
pub(crate) fn several_threads() -> bool {
    rayon::current_num_threads() > 1
}
