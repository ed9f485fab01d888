//! The f32 GEMM Flex itself runs (the `gemm` crate), called directly on strided slices, and
//! the choice of GEMM for half matrices: this one over operands widened to f32, or the bf16
//! GEMM of [`bf16_gemm`].

use crate::bf16_gemm::{self, Bf16Kernel};
use crate::several_threads;

/// Which GEMM multiplies half matrices (a matmul's, or a convolution's patches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// The bf16 GEMM (`bf16_gemm`) on this kernel: bf16 only, 1.5–2× as fast on dot
    /// products. A convolution's GEMMs run on the process's kernel ([`bf16_gemm::kernel`])
    /// whichever this names.
    Bf16(Bf16Kernel),
    /// Flex's f32 GEMM over the operands widened to f32: for a bf16 matmul, Flex's own
    /// bits.
    F32,
}

impl Kernel {
    /// The CPU's bf16 kernel for bf16 matrices, unless `widened` (the operands widened to f32
    /// whatever the CPU has); the f32 one otherwise.
    pub fn for_bf16(widened: bool) -> Self {
        match bf16_gemm::kernel() {
            Some(kernel) if !widened => Self::Bf16(kernel),
            _ => Self::F32,
        }
    }
}

/// Flex's rule for an `m × k` by `k × n` product: threads from 192³ multiply-adds up,
/// where rayon has several (`several_threads`).
pub fn parallel(m: usize, n: usize, k: usize) -> bool {
    large(m, n, k) && several_threads()
}

/// Whether an `m × k` by `k × n` product is large enough for threads (192³ multiply-adds).
pub fn large(m: usize, n: usize, k: usize) -> bool {
    m.saturating_mul(n).saturating_mul(k) >= 192 * 192 * 192
}

/// `c = a @ b` of f32 matrices `[m, k]` and `[k, n]`, each given as a slice and the
/// (row, column) strides of its values from the slice's start, by Flex's GEMM (the `gemm`
/// crate, on rayon's threads where `parallel`); `c` row-major. `None` where a matrix
/// does not fit its slice or `c` is not `m × n`.
pub fn f32_gemm(
    (a, [a_rs, a_cs]): (&[f32], [usize; 2]),
    (b, [b_rs, b_cs]): (&[f32], [usize; 2]),
    [m, k, n]: [usize; 3],
    c: &mut [f32],
    parallel: bool,
) -> Option<()> {
    let fits = |len: usize, [rows, cols]: [usize; 2], [rs, cs]: [usize; 2]| {
        rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
    };
    if !fits(a.len(), [m, k], [a_rs, a_cs]) || !fits(b.len(), [k, n], [b_rs, b_cs]) {
        return None;
    }
    if c.len() != m * n {
        return None;
    }
    let parallelism = match parallel {
        true => gemm::Parallelism::Rayon(0),
        false => gemm::Parallelism::None,
    };
    let stride = |s: usize| isize::try_from(s).ok();
    let (a_rs, a_cs, b_rs, b_cs) = (stride(a_rs)?, stride(a_cs)?, stride(b_rs)?, stride(b_cs)?);
    // SAFETY: `a` holds the `m×k` matrix at strides (a_rs, a_cs) from its start, `b` the
    // `k×n` one likewise (both checked above), and `c` `m×n` row-major values; `c` is
    // borrowed mutably, so it overlaps neither.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    Some(())
}
