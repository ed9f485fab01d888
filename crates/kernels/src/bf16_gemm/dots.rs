//! The bf16 GEMM's inner-product kernel, for products whose k is long and runs contiguously in
//! both operands: a convolution's weight gradient, `grad · patchesᵀ`, where k is every output
//! position of a chunk of images (thousands) and m, n are channels and patch sizes (tens to
//! hundreds).
//!
//! The packing kernel (`x86`) lays both operands out anew, k-pair by k-pair, before it
//! multiplies: for such shapes that is a transpose of two long matrices for few products per
//! value (12% of a bf16 conv net's step). Here each product value is a dot product of an A row
//! and a B column as they lie, 32 bf16 values a `vdpbf16ps`, `R × R` of them at once, summed
//! across the vector's lanes at the end of each k block. Each value is computed by one task in
//! a fixed order, so the bits do not depend on the thread count.

use std::arch::x86_64::*;

use half::bf16;

use super::Bf16Matrix;
use crate::tasks::for_each_chunk;

/// A rows and B columns of one kernel call: `R × R` dot products, 16 accumulators.
const R: usize = 4;
/// k values per block: the block's runs of A's and B's values stay in L2 while every
/// `R × R` group of the product's rows takes its share.
const KB: usize = 4096;

/// Whether the kernel takes `a @ b`: both operands contiguous along k, k long against m and n,
/// and m and n small (packing's share of the work falls as they grow; this kernel was timed
/// against it on a conv net's weight gradients, m and n 27–288, only).
pub(super) fn applies(a: &Bf16Matrix, b: &Bf16Matrix) -> bool {
    let widest = a.rows.max(b.cols);
    a.col_stride == 1 && b.row_stride == 1 && widest <= MAX_SIDE && a.cols >= 4 * widest
}

/// The largest m or n the kernel takes.
const MAX_SIDE: usize = 512;

/// `c = a @ b`, as [`super::gemm`], in tasks of `R` product rows where `parallel`.
///
/// # Safety
///
/// The CPU has AVX512-F, AVX512-BW and AVX512-BF16; `a.col_stride == 1`, `b.row_stride == 1`,
/// `a.cols == b.rows` and `c.len() == a.rows * b.cols`.
pub(super) unsafe fn gemm(a: Bf16Matrix, b: Bf16Matrix, c: &mut [f32], parallel: bool) {
    if c.is_empty() {
        return;
    }
    let n = b.cols;
    // SAFETY: the caller's promises; tasks own disjoint rows of `c`.
    for_each_chunk(c, R * n, parallel, |block, c| unsafe {
        rows(a, b, block * R, c)
    });
}

// The product's rows from `i0` (up to `R` of them: `c`), k block by k block.
//
// SAFETY: as for `gemm`; `i0 < a.rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn rows(a: Bf16Matrix, b: Bf16Matrix, i0: usize, c: &mut [f32]) {
    let (k, n) = (a.cols, b.cols);
    let rows = R.min(a.rows - i0);
    // Where A's row `r` of the group (the last one standing in past the edge: its sums are
    // computed and dropped) and B's column `s` start; k runs along each.
    let a_row = |r: usize| a.offset + (i0 + r.min(rows - 1)) * a.row_stride;
    for k0 in (0..k).step_by(KB) {
        let len = KB.min(k - k0);
        for j0 in (0..n).step_by(R) {
            let cols = R.min(n - j0);
            let b_col = |s: usize| b.offset + (j0 + s.min(cols - 1)) * b.col_stride;
            let mut acc = [[_mm512_setzero_ps(); R]; R];
            // SAFETY: each run of `len` values from `k0` lies inside its matrix, which lies in
            // its data (`Bf16Matrix::new`).
            unsafe {
                dots(
                    std::array::from_fn(|r| a.data.as_ptr().add(a_row(r) + k0)),
                    std::array::from_fn(|s| b.data.as_ptr().add(b_col(s) + k0)),
                    len,
                    &mut acc,
                )
            };
            // Loops, not `map`'s closures: one build called a closure per sum.
            for (r, acc) in acc.iter().enumerate().take(rows) {
                let c = &mut c[r * n + j0..][..cols];
                for (c, acc) in c.iter_mut().zip(acc) {
                    let sum = _mm512_reduce_add_ps(*acc);
                    *c = if k0 == 0 { sum } else { *c + sum };
                }
            }
        }
    }
}

// The `R × R` dot products of the runs of `len` values at `a[r]` and `b[s]`, into `out`: a
// vector of 16 partial sums each, for the caller to sum across.
//
// SAFETY: the CPU has the features; `len` values are readable from each pointer.
//
// Never inlined, and the lanes summed across by the caller: inlined into `rows`, or summing
// its accumulators across itself, the loop's 21 live vectors were at the mercy of the
// register allocator, and builds spilled an accumulator or more to the stack on every
// iteration (the weight gradient's GEMM took 1.6× as long in one).
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dots(a: [*const bf16; R], b: [*const bf16; R], len: usize, out: &mut [[__m512; R]; R]) {
    let mut acc = [[_mm512_setzero_ps(); R]; R];
    // The products of the 32 values from `t` of each run, `$load` reading the 32 values at
    // `$p`: A's four vectors, then B's one at a time (21 live vectors). A macro, not a
    // closure: the loads must inline into this function.
    macro_rules! step {
        ($t:expr, |$p:ident| $load:expr) => {
            let mut av = [_mm512_setzero_si512(); R];
            for (av, a) in av.iter_mut().zip(a) {
                let $p = a.wrapping_add($t);
                *av = $load;
            }
            for b in b.iter().enumerate() {
                let (s, $p) = (b.0, b.1.wrapping_add($t));
                let bv = pairs($load);
                for (acc, a) in acc.iter_mut().zip(av) {
                    acc[s] = _mm512_dpbf16_ps(acc[s], pairs(a), bv);
                }
            }
        };
    }
    let whole = len / 32 * 32;
    let mut t = 0;
    while t < whole {
        // SAFETY: values `t..t + 32` of each run are readable.
        step!(t, |p| unsafe { _mm512_loadu_si512(p.cast()) });
        t += 32;
    }
    if whole < len {
        // The last values, zero past them: masked lanes are neither read nor faulted on.
        let mask: __mmask32 = (1 << (len - whole)) - 1;
        // SAFETY: the unmasked lanes are values `whole..len` of each run, all readable.
        step!(whole, |p| unsafe {
            _mm512_maskz_loadu_epi16(mask, p.cast())
        });
    }
    *out = acc;
}

// 32 bf16 values: a `__m512i` and a `__m512bh` are the same 512 bits.
#[inline(always)]
fn pairs(v: __m512i) -> __m512bh {
    // SAFETY: both are 512 bits of plain data.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}
