//! Elementwise arithmetic on half values (bf16, f16), at the speed of f32 arithmetic.
//!
//! Flex 0.21 computes a bf16 or f16 op one element at a time: each value widened to f32 with
//! a scalar conversion, the f32 op, the result rounded back (`binary_op_typed` in
//! `burn-flex-0.21.0/src/ops/binary.rs`, `reduce_dim_half` in `ops/reduce.rs`). Measured on a
//! 256×2048 tensor, a bf16 bias add costs 17× its f32 one and an f16 ReLU 44×, so the few
//! elementwise ops between two GEMMs cost an autocast step more than the GEMMs save.
//!
//! The kernels here do the same arithmetic in blocks: a block of half values widened to an f32
//! buffer with `half`'s vectorised slice conversion, the f32 op over the buffer, the block
//! rounded back in one conversion. Each value sees the same f32 op and the same rounding as
//! in Flex, so the bits are Flex's own (tested against Flex by the root crate's adapters,
//! `src/cpu/half_kernels.rs`); only the speed changes.

use std::mem::MaybeUninit;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::several_threads;
use crate::tasks::for_each_chunk;

// Small enough that the f32 buffers stay in L1 beside the data they stream.
const BLOCK: usize = 256;

/// Which of the two half types a [`Half`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HalfKind {
    /// `bf16`: f32's exponent, 8 bits of significand.
    Bf16,
    /// `f16`: IEEE binary16.
    F16,
}

/// A half type Flex stores: bf16 or f16.
pub trait Half: bytemuck::Pod + Default + PartialEq + core::fmt::Debug + Send + Sync {
    /// Which one it is.
    const KIND: HalfKind;
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (same length), to nearest even.
    fn round(src: &[f32], dst: &mut [Self]);
}

impl Half for bf16 {
    const KIND: HalfKind = HalfKind::Bf16;
    fn widen(src: &[Self], dst: &mut [f32]) {
        // SAFETY: `widen_bf16_into` writes widened values only.
        widen_bf16_into(src, unsafe { as_uninit(dst) });
    }
    fn round(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if avx512::converts() {
            // SAFETY: the CPU has AVX512-F, AVX512-BW and AVX512-BF16 (checked just above);
            // the conversion writes rounded values only.
            return unsafe { avx512::round_bf16_by_conversion(src, as_uninit(dst)) };
        }
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            // SAFETY: as above.
            return unsafe { avx512::round_bf16(src, dst) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { avx2::round_bf16(src, dst) };
        }
        round_bf16(src, dst);
    }
}

/// `values` as memory a conversion writes without reading, for the loops that also fill new
/// buffers.
///
/// # Safety
///
/// Only values of `T` are written through the result (never `MaybeUninit::uninit()`), so that
/// `values` stays initialised.
pub(crate) unsafe fn as_uninit<T>(values: &mut [T]) -> &mut [MaybeUninit<T>] {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout; the caller's promise keeps `values` valid.
    unsafe { &mut *(values as *mut [T] as *mut [MaybeUninit<T>]) }
}

// `half` 2.7 converts bf16 slices with an indexed loop that does not vectorise. A bf16 is the
// high half of the f32 it stands for, NaNs made quiet as `half` does; the loop has no branch,
// so it vectorises (to AVX2's width where the CPU has it, see `avx2`). It writes memory that
// may not be initialised yet (a new tensor's), as well as a slice's values.
#[inline(always)]
fn widen_bf16_uninit(src: &[bf16], dst: &mut [MaybeUninit<f32>]) {
    for (dst, src) in dst.iter_mut().zip(src) {
        dst.write(bf16_as_f32(*src));
    }
}

// One bf16 as f32, a NaN made quiet, without a branch.
#[inline(always)]
fn bf16_as_f32(half: bf16) -> f32 {
    let bits = half.to_bits();
    let bits = if bits & 0x7FFF > 0x7F80 {
        bits | 0x0040
    } else {
        bits
    };
    f32::from_bits(u32::from(bits) << 16)
}

// Likewise `half` rounds one branchy `bf16::from_f32` at a time (0.3 ns a value here).
#[inline(always)]
fn round_bf16(src: &[f32], dst: &mut [bf16]) {
    for (dst, src) in dst.iter_mut().zip(src) {
        *dst = bf16::from_bits(round_to_bf16_bits(src.to_bits()));
    }
}

// `round_bf16` into memory that may not be initialised yet.
fn round_bf16_uninit(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
    for (dst, src) in dst.iter_mut().zip(src) {
        dst.write(bf16::from_bits(round_to_bf16_bits(src.to_bits())));
    }
}

/// `src` rounded to bf16 as [`Half::round`] rounds it, into `dst` (as long), memory that need
/// not be initialised: a GEMM's output written straight from its sums, where a stack buffer
/// and a copy out of it were 1.6% of a deep MLP's bf16 step.
pub fn round_bf16_into(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
    assert_eq!(src.len(), dst.len(), "one value rounded per value");
    #[cfg(target_arch = "x86_64")]
    if avx512::converts() {
        // SAFETY: the CPU has AVX512-F, AVX512-BW and AVX512-BF16 (checked just above).
        return unsafe { avx512::round_bf16_by_conversion(src, dst) };
    }
    round_bf16_uninit(src, dst);
}

/// `src` widened to f32 (each bf16 the high half of its f32, a NaN made quiet as `half` does),
/// into `dst` (as long), memory that need not be initialised: the AVX-512 or AVX2 loop where
/// the CPU has it. [`Half::widen`] of bf16 is this, into a slice's values.
pub fn widen_bf16_into(src: &[bf16], dst: &mut [MaybeUninit<f32>]) {
    assert_eq!(src.len(), dst.len(), "one value widened per value");
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: the CPU has AVX512-F and AVX512-BW (checked just above).
        return unsafe { avx512::widen_bf16_uninit(src, dst) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { avx2::widen_bf16_uninit(src, dst) };
    }
    widen_bf16_uninit(src, dst);
}

// `widen_bf16_uninit` and `round_bf16` compiled for the target features `$features`, to be
// chosen at run time: the crate is built for baseline x86-64, whose SSE2 lacks the unsigned
// compares these loops vectorise to.
macro_rules! bf16_loops_for {
    ($features:literal) => {
        /// # Safety
        /// The CPU must have the module's target features.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn round_bf16(src: &[f32], dst: &mut [half::bf16]) {
            super::round_bf16(src, dst);
        }

        /// # Safety
        /// The CPU must have the module's target features.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn widen_bf16_uninit(
            src: &[half::bf16],
            dst: &mut [std::mem::MaybeUninit<f32>],
        ) {
            super::widen_bf16_uninit(src, dst);
        }
    };
}

// The bf16 loops for AVX2.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    bf16_loops_for!("avx2");
}

// The same loops compiled for AVX-512, where 32-bit lanes narrow to 16 bits in one
// instruction (`vpmovdw`): twice AVX2's width.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::mem::MaybeUninit;

    use half::bf16;

    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    }

    /// Whether the CPU has `vcvtneps2bf16` (AVX512-BF16) too.
    pub(super) fn converts() -> bool {
        available() && std::is_x86_feature_detected!("avx512bf16")
    }

    /// `round_bf16` by the CPU's own conversion, 16 values an instruction, which rounds to
    /// nearest even and quiets NaNs keeping the high half, as `half` does, but takes subnormal
    /// inputs for zero: a vector holding one goes through the loop instead. Twice as fast as
    /// the loop (its compares and selects were 4% of a conv net's bf16 step).
    ///
    /// # Safety
    /// The CPU must have AVX512-F, AVX512-BW and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn round_bf16_by_conversion(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
        use std::arch::x86_64::*;
        assert_eq!(src.len(), dst.len());
        let whole = src.len() / 16 * 16;
        let (exponent, mantissa) = (_mm512_set1_epi32(0x7F80_0000), _mm512_set1_epi32(0x7F_FFFF));
        for (src, dst) in src[..whole].chunks_exact(16).zip(dst.chunks_exact_mut(16)) {
            // SAFETY: 16 f32 read, 16 bf16 (256 bits) written, in bounds.
            unsafe {
                let v = _mm512_loadu_ps(src.as_ptr());
                let bits = _mm512_castps_si512(v);
                let normal = _mm512_test_epi32_mask(bits, exponent);
                let nonzero = _mm512_test_epi32_mask(bits, mantissa);
                if nonzero & !normal != 0 {
                    super::round_bf16_uninit(src, dst);
                    continue;
                }
                let halves = _mm512_cvtneps_pbh(v);
                let halves = std::mem::transmute::<__m256bh, __m256i>(halves);
                _mm256_storeu_si256(dst.as_mut_ptr().cast(), halves);
            }
        }
        super::round_bf16_uninit(&src[whole..], &mut dst[whole..]);
    }

    bf16_loops_for!("avx512f,avx512bw");
}

// f32 bits to bf16 bits, nearest even, NaN kept quiet with its high payload: `half`'s
// `bf16::from_f32`, with selects for branches. Ties-to-even by adding 0x7FFF plus the kept
// lowest bit: the sum carries into the kept bits exactly when the dropped half is over a
// half-unit, or exactly half with the kept lowest bit odd.
#[inline(always)]
fn round_to_bf16_bits(x: u32) -> u16 {
    let nan = (x >> 16) | 0x0040;
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let is_nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    (if is_nan { nan } else { rounded }) as u16
}

impl Half for f16 {
    const KIND: HalfKind = HalfKind::F16;
    fn widen(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if f16c::available() {
            // SAFETY: the CPU has F16C and AVX (checked just above).
            return unsafe { f16c::widen(src, dst) };
        }
        src.convert_to_f32_slice(dst);
    }
    fn round(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if f16c::available() {
            // SAFETY: as above.
            return unsafe { f16c::round(src, dst) };
        }
        dst.convert_from_f32_slice(src);
    }
}

// f16 conversions eight at a time with F16C, the instructions `half` itself uses where the
// CPU has them (so the same bits), but inlined into one loop: `half`'s slice conversion calls
// a function per eight values and showed as 8% of an f16 training step.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use core::arch::x86_64::{
        __m128i, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_cvtph_ps,
        _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
    };

    use half::f16;

    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("f16c") && std::is_x86_feature_detected!("avx")
    }

    /// # Safety
    /// The CPU must have F16C and AVX; `dst` is as long as `src`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        let whole = src.len() / 8 * 8;
        for (src, dst) in src[..whole]
            .chunks_exact(8)
            .zip(dst[..whole].chunks_exact_mut(8))
        {
            // SAFETY: eight f16 (16 bytes) read and eight f32 (32 bytes) written, in bounds.
            unsafe {
                let halves = _mm_loadu_si128(src.as_ptr().cast::<__m128i>());
                _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_cvtph_ps(halves));
            }
        }
        for (src, dst) in src[whole..].iter().zip(&mut dst[whole..]) {
            *dst = src.to_f32();
        }
    }

    /// # Safety
    /// As [`widen`]; rounds to nearest even.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn round(src: &[f32], dst: &mut [f16]) {
        assert_eq!(src.len(), dst.len());
        let whole = src.len() / 8 * 8;
        for (src, dst) in src[..whole]
            .chunks_exact(8)
            .zip(dst[..whole].chunks_exact_mut(8))
        {
            // SAFETY: eight f32 read and eight f16 written, in bounds.
            unsafe {
                let halves =
                    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr()));
                _mm_storeu_si128(dst.as_mut_ptr().cast::<__m128i>(), halves);
            }
        }
        for (src, dst) in src[whole..].iter().zip(&mut dst[whole..]) {
            *dst = f16::from_f32(*src);
        }
    }
}

/// A new buffer of `len` half values for a kernel to fill, as bits, in any order. Zeros of
/// `u16` are `calloc`'s, which skips the memset where the pages are fresh, where
/// `vec![H::default(); len]` always writes them (3% of an f16 step): only primitive types are
/// known to be all-zero. Memory the allocator reuses is still zeroed first; a buffer written
/// in order takes [`filled`] instead.
pub fn half_buffer(len: usize) -> Vec<u16> {
    vec![0u16; len]
}

/// Values per parallel task of the kernels here (256 KiB of f32). Flex runs its elementwise
/// ops on one thread; these, converting and streaming memory, take rayon's threads from two
/// tasks up, so that on two cores the conversions autocast adds around a GEMM take half the
/// time the GEMM's threads would wait for them. Every value is computed alone, so the bits
/// do not depend on the split.
pub const TASK: usize = 1 << 16;

/// `f(start, chunk)` for the chunks of `TASK` values of `values` (`start` the chunk's first
/// index), on rayon's threads where there are several chunks and several threads
/// ([`several_threads`]).
fn in_tasks<T: Send>(values: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    in_row_tasks(1, values, f);
}

/// `in_tasks` for values in rows of `row` values, each task whole rows (about `TASK` values,
/// one row at least): `f(first, rows)`, `first` the index of the chunk's first row.
pub fn in_row_tasks<T: Send>(row: usize, values: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    let row = row.max(1);
    let rows = (TASK / row).max(1);
    let task = rows * row;
    let parallel = values.len() > task && several_threads();
    for_each_chunk(values, task, parallel, |i, chunk| f(i * rows, chunk));
}

/// A new buffer of `len` values, written block by block by `fill(start, block)` (the block of
/// values from `start`), in tasks on rayon's threads where it is large, with no pass to zero it
/// first: the allocator hands back memory of freed tensors, which `vec![0; len]` zeroes with a
/// memset (2–3% of a half-precision step). Each block goes through a small buffer on the
/// stack, as safe code cannot write memory that is not yet initialised.
pub fn filled<T: bytemuck::Pod + Send>(
    len: usize,
    fill: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let write = |start: usize, task: &mut [MaybeUninit<T>]| {
        let mut block = [T::zeroed(); BLOCK];
        for (i, dst) in task.chunks_mut(BLOCK).enumerate() {
            let block = &mut block[..dst.len()];
            fill(start + i * BLOCK, block);
            for (dst, value) in dst.iter_mut().zip(block.iter()) {
                dst.write(*value);
            }
        }
    };
    // SAFETY: `write` writes every value of its task (the blocks cover it).
    unsafe { written(len, write) }
}

/// `src` widened into `dst` (as long), in tasks on rayon's threads where they are large.
pub fn widen_in_tasks<H: Half>(src: &[H], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "one value widened per value");
    in_tasks(dst, |start, dst| H::widen(&src[start..][..dst.len()], dst));
}

/// A new buffer of `len` values, each task of values (as `in_tasks` splits them) written by
/// `write(start, task)` straight into the buffer. [`filled`] is this with a block on the stack
/// for fills that take initialised values, and a copy out of it; a loop that writes memory not
/// yet initialised calls this directly (`filled`'s copies were 3% of the samples of an MLP's
/// bf16 step on a Zen 5; with the casts written straight, the casts and copies together fell
/// from 12.9% to 11.5%).
///
/// # Safety
///
/// `write` writes every value of the task it is given.
unsafe fn written<T: Send>(
    len: usize,
    write: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    in_tasks(&mut out.spare_capacity_mut()[..len], write);
    // SAFETY: the tasks cover the first `len` values, and `write` wrote each (the caller's
    // promise).
    unsafe { out.set_len(len) };
    out
}

/// `values` rounded to `H`, as bits (for a tensor's bytes), in tasks on rayon's threads where
/// they are large, written in order with no pass to zero the buffer first.
pub fn rounded<H: Half>(values: &[f32]) -> Vec<u16> {
    #[cfg(target_arch = "x86_64")]
    if H::KIND == HalfKind::Bf16 && avx512::converts() {
        let write = |start: usize, task: &mut [MaybeUninit<u16>]| {
            // SAFETY: `MaybeUninit<u16>` and `MaybeUninit<bf16>` have one layout.
            let task =
                unsafe { &mut *(task as *mut [MaybeUninit<u16>] as *mut [MaybeUninit<bf16>]) };
            round_bf16_into(&values[start..][..task.len()], task);
        };
        // SAFETY: `round_bf16_into` writes every value of its output.
        return unsafe { written(values.len(), write) };
    }
    filled(values.len(), |start, block: &mut [u16]| {
        H::round(&values[start..][..block.len()], as_half::<H>(block));
    })
}

/// `values` widened to f32, as [`rounded`] rounds them: in tasks, into a new buffer.
pub fn widened_in_tasks<H: Half>(values: &[H]) -> Vec<f32> {
    if H::KIND == HalfKind::Bf16 {
        let values: &[bf16] = bytemuck::cast_slice(values);
        let write = |start: usize, task: &mut [MaybeUninit<f32>]| {
            widen_bf16_into(&values[start..][..task.len()], task);
        };
        // SAFETY: `widen_bf16_into` writes every value of its output.
        return unsafe { written(values.len(), write) };
    }
    filled(values.len(), |start, block| {
        H::widen(&values[start..][..block.len()], block);
    })
}

/// `buf`'s bits as half values.
pub fn as_half<H: Half>(buf: &mut [u16]) -> &mut [H] {
    bytemuck::cast_slice_mut(buf)
}

/// `f` of every value of `values`, in place, block by block, in tasks on rayon's threads where
/// they are large: each value widened, `f` in f32, rounded back once.
pub fn map_in_place<H: Half>(values: &mut [H], f: impl Fn(f32) -> f32 + Sync) {
    in_tasks(values, |_, task| map_block(None, task, &f));
}

/// `f` of every value of `src`, as [`map_in_place`], into a new buffer (as bits, for a tensor's
/// bytes), written in order with no pass to zero it first.
pub fn map_to<H: Half>(src: &[H], f: impl Fn(f32) -> f32 + Sync) -> Vec<u16> {
    filled(src.len(), |start, block: &mut [u16]| {
        map_block(Some(&src[start..][..block.len()]), as_half::<H>(block), &f)
    })
}

// `f` of `src`'s values (or, where `None`, of `dst`'s own) into `dst`, block by block.
fn map_block<H: Half>(src: Option<&[H]>, dst: &mut [H], f: &impl Fn(f32) -> f32) {
    let mut buf = [0f32; BLOCK];
    for (i, dst) in dst.chunks_mut(BLOCK).enumerate() {
        let buf = &mut buf[..dst.len()];
        match src {
            Some(src) => H::widen(&src[i * BLOCK..][..dst.len()], buf),
            None => H::widen(dst, buf),
        }
        buf.iter_mut().for_each(|x| *x = f(*x));
        H::round(buf, dst);
    }
}

/// `f(x, y)` of the values of `xs` and `ys` (as long), value by value, into `ys`: each pair
/// widened, `f` in f32, rounded back once; in tasks on rayon's threads where they are large.
pub fn zip_in_place<H: Half>(xs: &[H], ys: &mut [H], f: impl Fn(f32, f32) -> f32 + Sync) {
    assert_eq!(xs.len(), ys.len(), "zip takes values of one length");
    in_tasks(ys, |start, task| {
        zip_block(&xs[start..][..task.len()], None, task, &f)
    });
}

/// `f(x, y)` of the values of `xs` and `ys`, as [`zip_in_place`], into a new buffer (as bits),
/// written in order with no pass to zero it first.
pub fn zip_to<H: Half>(xs: &[H], ys: &[H], f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<u16> {
    assert_eq!(xs.len(), ys.len(), "zip takes values of one length");
    filled(xs.len(), |start, block: &mut [u16]| {
        let n = block.len();
        zip_block(
            &xs[start..][..n],
            Some(&ys[start..][..n]),
            as_half::<H>(block),
            &f,
        )
    })
}

// `f` of `xs` and `ys` (or, where `None`, `dst`'s own values) into `dst`, block by block.
fn zip_block<H: Half>(xs: &[H], ys: Option<&[H]>, dst: &mut [H], f: &impl Fn(f32, f32) -> f32) {
    let (mut bx, mut by) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (i, dst) in dst.chunks_mut(BLOCK).enumerate() {
        let (at, n) = (i * BLOCK, dst.len());
        let (bx, by) = (&mut bx[..n], &mut by[..n]);
        H::widen(&xs[at..][..n], bx);
        match ys {
            Some(ys) => H::widen(&ys[at..][..n], by),
            None => H::widen(dst, by),
        }
        bx.iter_mut()
            .zip(by.iter())
            .for_each(|(x, y)| *x = f(*x, *y));
        H::round(bx, dst);
    }
}

/// A linear layer's epilogue on the f32 product of a half GEMM: each product rounded to `H`,
/// then the row `bias` added in `H` (rounded again), as Flex computes `round(p) + bias` on half
/// tensors. With no bias, the product rounded.
///
/// `product` is `[m, n]` and contiguous (a fresh GEMM output); `bias` has `n` values. The
/// result's bits, for `Bytes`.
pub fn round_add_row<H: Half>(product: &[f32], bias: Option<&[H]>) -> Vec<u16> {
    let mut out = filled(product.len(), |start, block: &mut [u16]| {
        H::round(&product[start..][..block.len()], as_half::<H>(block));
    });
    let values = as_half::<H>(&mut out);
    if let Some(bias) = bias {
        add_row(values, bias);
    }
    out
}

/// Adds `bias` to every row of the contiguous `[m, bias.len()]` half values in `rows`, each sum
/// rounded to `H`, as Flex adds a broadcast row on half tensors.
pub fn add_row<H: Half>(rows: &mut [H], bias: &[H]) {
    let n = bias.len().max(1);
    let wide_bias = widened(bias);
    // Whole rows per task, so that each task's rows start at the bias's first value.
    in_row_tasks(n, rows, |_, rows| {
        rows.chunks_mut(n)
            .for_each(|row| add_widened(row, &wide_bias))
    });
}

/// `values` widened to f32.
pub fn widened<H: Half>(values: &[H]) -> Vec<f32> {
    let mut wide = vec![0f32; values.len()];
    H::widen(values, &mut wide);
    wide
}

/// `row[i] + bias[i]` for each value of `row`, summed in f32 and rounded to `H`, as
/// [`add_row`] adds a row: a run of a linear's output, its bias widened once.
pub fn add_widened<H: Half>(row: &mut [H], bias: &[f32]) {
    let mut buf = [0f32; BLOCK];
    for (dst, bias) in row.chunks_mut(BLOCK).zip(bias.chunks(BLOCK)) {
        let buf = &mut buf[..dst.len()];
        H::widen(dst, buf);
        buf.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
        H::round(buf, dst);
    }
}

/// The sum over the rows of contiguous `[m, n]` half values, `n` values: f32 sums taken row
/// after row, rounded once, as Flex's `sum_dim(0)` on half tensors (same order, same bits).
pub fn sum_rows<H: Half>(src: &[H], n: usize) -> Vec<H> {
    let mut acc = vec![0f32; n];
    let mut buf = [0f32; BLOCK];
    for row in src.chunks(n.max(1)) {
        for (src, acc) in row.chunks(BLOCK).zip(acc.chunks_mut(BLOCK)) {
            let buf = &mut buf[..src.len()];
            H::widen(src, buf);
            acc.iter_mut().zip(buf.iter()).for_each(|(a, x)| *a += x);
        }
    }
    let mut out = vec![H::default(); n];
    H::round(&acc, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // A million scattered f32 bit patterns, and every pattern below a few high halves: ties
    // and near-ties of ordinary numbers, each type's largest finite values and smallest
    // subnormals, infinities, NaNs.
    fn rounding_patterns() -> Vec<f32> {
        let scattered = (0..1u32 << 20).map(|i| i.wrapping_mul(0x9E37_79B1));
        let highs = [
            0x0000u32, 0x8000, 0x3F80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x477F, 0x4780,
            0x3380, 0x3300,
        ];
        let dense = highs
            .into_iter()
            .flat_map(|h| (0..=0xFFFFu32).map(move |l| (h << 16) | l));
        scattered.chain(dense).map(f32::from_bits).collect()
    }

    // Slice conversions of `H` against `half`'s scalar ones: every `H` widened, every
    // pattern above rounded.
    struct Slices<H> {
        widen: fn(&[H], &mut [f32]),
        round: fn(&[f32], &mut [H]),
    }

    // `H`'s own (the vectorised loops where the CPU has them).
    fn conversions_are_halfs<H: Half + PartialEq + core::fmt::Debug>(
        from_bits: fn(u16) -> H,
        to_f32: fn(H) -> f32,
        from_f32: fn(f32) -> H,
    ) {
        let own = Slices {
            widen: H::widen,
            round: H::round,
        };
        slices_are_halfs(own, from_bits, to_f32, from_f32);
    }

    fn slices_are_halfs<H: Half + PartialEq + core::fmt::Debug>(
        slices: Slices<H>,
        from_bits: fn(u16) -> H,
        to_f32: fn(H) -> f32,
        from_f32: fn(f32) -> H,
    ) {
        let all: Vec<H> = (0..=u16::MAX).map(from_bits).collect();
        let mut wide = vec![0f32; all.len()];
        (slices.widen)(&all, &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            assert_eq!(w.to_bits(), to_f32(*h).to_bits(), "{h:?} widened");
        }
        let values = rounding_patterns();
        let mut rounded = vec![from_bits(0); values.len()];
        (slices.round)(&values, &mut rounded);
        for (x, r) in values.iter().zip(&rounded) {
            let want = from_f32(*x);
            // Bit patterns, so that NaNs compare too.
            assert_eq!(
                bytemuck::bytes_of(r),
                bytemuck::bytes_of(&want),
                "{:#010x} rounded",
                x.to_bits()
            );
        }
    }

    #[test]
    fn bf16_conversions_are_halfs() {
        conversions_are_halfs(bf16::from_bits, bf16::to_f32, bf16::from_f32);
        // The AVX-512 loop, which the conversion stands in for where the CPU has it.
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            let avx512 = Slices {
                // SAFETY: the CPU has AVX512-F and AVX512-BW (checked just above); the loop
                // writes widened values only.
                widen: |src, dst| unsafe { avx512::widen_bf16_uninit(src, as_uninit(dst)) },
                // SAFETY: as above.
                round: |src, dst| unsafe { avx512::round_bf16(src, dst) },
            };
            slices_are_halfs(avx512, bf16::from_bits, bf16::to_f32, bf16::from_f32);
        }
        // The AVX2 loops, which the AVX-512 ones stand in for where the CPU has both.
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            let avx2 = Slices {
                // SAFETY: the CPU has AVX2 (checked just above); the loop writes widened values
                // only.
                widen: |src, dst| unsafe { avx2::widen_bf16_uninit(src, as_uninit(dst)) },
                // SAFETY: as above.
                round: |src, dst| unsafe { avx2::round_bf16(src, dst) },
            };
            slices_are_halfs(avx2, bf16::from_bits, bf16::to_f32, bf16::from_f32);
        }
        // Into memory not yet initialised (a GEMM's output), with tails shorter than a vector.
        let values = rounding_patterns();
        for len in [values.len(), values.len() - 7, 5] {
            let mut out = vec![MaybeUninit::<bf16>::uninit(); len];
            round_bf16_into(&values[..len], &mut out);
            for (x, r) in values.iter().zip(&out) {
                // SAFETY: `round_bf16_into` wrote every value.
                let r = unsafe { r.assume_init() };
                let want = bf16::from_f32(*x).to_bits();
                assert_eq!(r.to_bits(), want, "{:#010x} of {len}", x.to_bits());
            }
        }
        // The scalar rounding, which CPUs without AVX2 run.
        for x in rounding_patterns() {
            let want = bf16::from_f32(x).to_bits();
            assert_eq!(
                round_to_bf16_bits(x.to_bits()),
                want,
                "{:#010x}",
                x.to_bits()
            );
        }
    }

    #[test]
    fn f16_conversions_are_halfs() {
        conversions_are_halfs(f16::from_bits, f16::to_f32, f16::from_f32);
    }

    // A tensor's casts (`rounded`, `widened_in_tasks`: in tasks, into new buffers; bf16's
    // straight into them), every value against `half`'s own conversion: lengths of several
    // tasks with a tail, one shorter than a vector, none.
    fn tensor_casts_are_halfs<H: Half>(to_f32: fn(H) -> f32, from_f32: fn(f32) -> H) {
        let values = rounding_patterns();
        for len in [values.len(), 3 * TASK + 17, 5, 0] {
            let bits = rounded::<H>(&values[..len]);
            assert_eq!(bits.len(), len);
            for (x, r) in values.iter().zip(&bits) {
                let want = from_f32(*x);
                assert_eq!(
                    r,
                    bytemuck::cast_ref::<H, u16>(&want),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
        let every: Vec<H> = (0..=u16::MAX)
            .cycle()
            .take(3 * TASK + 17)
            .map(|b| bytemuck::cast(b))
            .collect();
        for len in [every.len(), 5, 0] {
            let wide = widened_in_tasks(&every[..len]);
            assert_eq!(wide.len(), len);
            for (h, w) in every.iter().zip(&wide) {
                assert_eq!(w.to_bits(), to_f32(*h).to_bits(), "{h:?} widened");
            }
        }
    }

    #[test]
    fn a_tensors_casts_are_halfs() {
        tensor_casts_are_halfs(bf16::to_f32, bf16::from_f32);
        tensor_casts_are_halfs(f16::to_f32, f16::from_f32);
        // bf16's widening into memory not yet initialised, on each loop this CPU has.
        let every: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        type Widen<'a> = &'a dyn Fn(&[bf16], &mut [MaybeUninit<f32>]);
        let check = |widen: Widen, loop_name: &str| {
            for len in [every.len(), every.len() - 7, 5] {
                let mut out = vec![MaybeUninit::<f32>::uninit(); len];
                widen(&every[..len], &mut out);
                for (h, w) in every.iter().zip(&out) {
                    // SAFETY: the loop wrote every value.
                    let w = unsafe { w.assume_init() };
                    assert_eq!(w.to_bits(), h.to_f32().to_bits(), "{h:?} by {loop_name}");
                }
            }
        };
        check(&widen_bf16_into, "the chosen loop");
        check(&widen_bf16_uninit, "the portable loop");
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            check(&|s, d| unsafe { avx2::widen_bf16_uninit(s, d) }, "AVX2");
        }
    }
}
