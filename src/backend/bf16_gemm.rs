//! A bf16 GEMM for x86-64 CPUs with AVX512-BF16: bf16 products summed in f32 by `vdpbf16ps`.
//!
//! Autocast's lower-class matmul on Flex otherwise widens its bf16 operands to f32 and runs
//! Flex's f32 GEMM (see [`low_gemm`](super::low_gemm)): the numbers of a bf16 GEMM at f32 speed.
//! `vdpbf16ps` multiplies pairs of bf16 values and adds both products to an f32 lane, twice the
//! multiply-adds of an f32 FMA per instruction (on the 2-core EPYC this crate is built on,
//! 220–230 GFLOP/s a core against 100–115 for f32 FMAs, register-bound loops). It is what
//! oneDNN, and so PyTorch's CPU autocast, runs on such CPUs.
//!
//! Numerics: a bf16 product is exact in f32, and each lane adds the products of one k-pair to
//! its f32 sum, pair after pair in k order. That is a bf16 GEMM with f32 accumulation (as
//! cuBLAS and oneDNN compute one), but not the bits of an f32 GEMM over the widened operands:
//! the sums run in another order. The instruction also treats bf16 subnormal inputs as zero
//! and flushes subnormal sums to zero (Intel SDM, `VDPBF16PS`), as oneDNN's bf16 GEMM does.
//!
//! The layout is the classic one (Goto and van de Geijn): both operands packed once into
//! k-pair interleaved panels, the product computed in `MR × NR` tiles held in registers, the
//! k dimension in blocks of `KC` pairs so that a tile's panels stay in L1, and tiles of `C`
//! shared among threads by blocks of `MC × NC`.

use half::bf16;
use rayon::prelude::*;

/// Rows of the product one micro-kernel call computes.
const MR: usize = 12;
/// Columns of the product one micro-kernel call computes: two vectors of 16 f32 lanes. With
/// `MR` rows that is 24 accumulators of the 32 vector registers, enough in flight to hide
/// the instruction's latency (6 cycles) at one issue a cycle.
const NR: usize = 32;
/// k-pairs per block: a B panel of `KC × NR` pairs (16 KiB) and an A panel (6 KiB) stay in
/// L1 while a tile is computed.
const KC: usize = 128;
/// Rows of the product per parallel task (4 A panels, 48 KiB of packed A per k block).
const MC: usize = 4 * MR;
/// Columns of the product per parallel task (8 B panels).
const NC: usize = 8 * NR;

/// A bf16 matrix read in place: `data[offset + i * row_stride + j * col_stride]` is its
/// element `(i, j)`, so transposed views need no copy.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bf16Matrix<'a> {
    data: &'a [bf16],
    offset: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Bf16Matrix<'a> {
    /// The `rows × cols` matrix at `offset` and those strides in `data`; `None` if any element
    /// lies outside `data`.
    pub(crate) fn new(
        data: &'a [bf16],
        offset: usize,
        [rows, cols]: [usize; 2],
        [row_stride, col_stride]: [usize; 2],
    ) -> Option<Self> {
        if rows > 0 && cols > 0 {
            let last = (rows - 1)
                .checked_mul(row_stride)?
                .checked_add((cols - 1).checked_mul(col_stride)?)?
                .checked_add(offset)?;
            if last >= data.len() {
                return None;
            }
        }
        Some(Self {
            data,
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }

    // The bits of element `(i, j)`, or 0 (a bf16 zero) past the last column: how an odd k is
    // padded to whole pairs.
    #[inline(always)]
    fn bits(&self, i: usize, j: usize) -> u32 {
        if j >= self.cols {
            return 0;
        }
        let at = self.offset + i * self.row_stride + j * self.col_stride;
        // SAFETY: `new` checked that every `(i < rows, j < cols)` lies inside `data`; callers
        // pass `i < rows`.
        u32::from(unsafe { self.data.get_unchecked(at) }.to_bits())
    }

    fn transposed(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// Whether this CPU runs the kernel (AVX512-F and AVX512-BF16), checked once.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `c = a @ b`, `c` the `a.rows × b.cols` product in row-major order, computed on rayon's
/// threads when `parallel`; `packed` is scratch for the packed operands, kept by the caller
/// (whatever it holds is overwritten). `None` (and `c` untouched) where the CPU lacks
/// AVX512-BF16 or the shapes do not match.
pub(crate) fn gemm(
    a: Bf16Matrix,
    b: Bf16Matrix,
    c: &mut [f32],
    parallel: bool,
    packed: &mut [Vec<u32>; 2],
) -> Option<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if !available() || b.rows != k || c.len() != m * n {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if k == 0 {
            c.fill(0.0);
            return Some(());
        }
        let pairs = k.div_ceil(2);
        // A is packed by rows and B by columns alike: B's columns are the rows of its
        // transpose.
        let [packed_a, packed_b] = packed;
        pack(a, pairs, MR, packed_a, parallel);
        pack(b.transposed(), pairs, NR, packed_b, parallel);
        let blocks = Blocks {
            packed_a,
            packed_b,
            c: CPtr(c.as_mut_ptr()),
            m,
            n,
            pairs,
        };
        let (row_blocks, col_blocks) = (m.div_ceil(MC), n.div_ceil(NC));
        let task = |t: usize| {
            // SAFETY: the CPU has the kernel's features (`available`), and tasks own disjoint
            // blocks of `c`.
            unsafe { blocks.block(t / col_blocks * MC, t % col_blocks * NC) }
        };
        match parallel {
            true => (0..row_blocks * col_blocks).into_par_iter().for_each(task),
            false => (0..row_blocks * col_blocks).for_each(task),
        }
    }
    Some(())
}

/// The first `len` values of the scratch buffer `buf`, which grows (zeroed) only past its
/// longest use so far: callers write every value before they read it, and a GEMM's buffers
/// change size from call to call (zeroing what a shorter call had cut off showed as 3% of a
/// bf16 training step).
pub(crate) fn scratch_of<T: Copy + Default>(buf: &mut Vec<T>, len: usize) -> &mut [T] {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    &mut buf[..len]
}

// `m`'s rows (A's rows, or B's columns through its transpose) in panels of `width` rows, into
// `packed`: panel `q` holds, for each k-pair `p`, `width` words `(m[r][2p] | m[r][2p + 1] << 16)`
// for its rows `r`, zero past the last row and the last column. One instruction then reads a
// panel's pair for a row (a broadcast) or for 16 columns (a vector). Every word is written,
// so `packed` may come with old values.
fn pack(m: Bf16Matrix, pairs: usize, width: usize, packed: &mut Vec<u32>, parallel: bool) {
    let panel_len = pairs * width;
    let packed = scratch_of(packed, m.rows.div_ceil(width) * panel_len);
    let fill = |(q, panel): (usize, &mut [u32])| pack_panel(m, q * width, width, panel);
    match parallel {
        true => packed.par_chunks_mut(panel_len).enumerate().for_each(fill),
        false => packed.chunks_mut(panel_len).enumerate().for_each(fill),
    }
}

// The panel of `width` rows from row `i0`, as `pack` lays it out.
fn pack_panel(m: Bf16Matrix, i0: usize, width: usize, panel: &mut [u32]) {
    // The high halves of a last, odd column's words.
    const ZEROS: [bf16; NR] = [bf16::ZERO; NR];
    let rows = width.min(m.rows - i0);
    if rows < width {
        panel.fill(0);
    }
    let word = |lo: &bf16, hi: &bf16| u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16;
    if m.row_stride == 1 {
        // The panel's rows lie side by side (B's columns of a row-major B, A's rows of a
        // transposed A): each pair's words zip two runs of `rows` values, which vectorises.
        let run = |j: usize| &m.data[m.offset + i0 + j * m.col_stride..][..rows];
        for (p, words) in panel.chunks_exact_mut(width).enumerate() {
            let high = if 2 * p + 1 < m.cols {
                run(2 * p + 1)
            } else {
                &ZEROS[..rows]
            };
            for (w, (lo, hi)) in words.iter_mut().zip(run(2 * p).iter().zip(high)) {
                *w = word(lo, hi);
            }
        }
    } else if m.col_stride == 1 {
        // Each row's pairs lie side by side (A's rows of a row-major A, B's columns of a
        // transposed B): the panel is their transpose, taken 16 × 16 words at a time with
        // vector shuffles (scalar stores `width` apart cost 3× as much), the rest one by one.
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `pack` runs for `gemm` only, on a CPU with AVX512-F (`available`).
        let done = unsafe { transpose_pairs(m, i0, rows, width, panel) };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        for r in 0..rows {
            let row = &m.data[m.offset + (i0 + r) * m.row_stride..][..m.cols];
            let words = panel[done * width..].chunks_exact_mut(width);
            for (pair, words) in row[2 * done..].chunks(2).zip(words) {
                words[r] = word(&pair[0], pair.get(1).unwrap_or(&ZEROS[0]));
            }
        }
    } else {
        for r in 0..rows {
            for (p, w) in panel[r..].iter_mut().step_by(width).enumerate() {
                *w = m.bits(i0 + r, 2 * p) | m.bits(i0 + r, 2 * p + 1) << 16;
            }
        }
    }
}

// The first pairs of the panel's rows, where each row's pairs lie side by side, in blocks
// of 16 pairs of 16 rows: each block one 16 × 16 transpose of 32-bit words. Returns the
// pairs done (a multiple of 16, all of them whole).
//
// SAFETY: the CPU has AVX512-F; `m`'s columns are contiguous (`col_stride == 1`); `panel`
// holds `width` words for each of `m`'s pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_pairs(
    m: Bf16Matrix,
    i0: usize,
    rows: usize,
    width: usize,
    panel: &mut [u32],
) -> usize {
    use std::arch::x86_64::*;
    let blocks = m.cols / 32;
    assert!(panel.len() >= blocks * 16 * width);
    for g in (0..rows).step_by(16) {
        // The panel's words for rows `g..g + 16` of each pair, fewer in a narrower panel.
        let lanes: __mmask16 = match width - g {
            16.. => 0xFFFF,
            n => (1 << n) - 1,
        };
        for block in 0..blocks {
            let mut words = [_mm512_setzero_si512(); 16];
            for (i, words) in words.iter_mut().enumerate().take(rows - g) {
                let at = m.offset + (i0 + g + i) * m.row_stride + 32 * block;
                // SAFETY: the row's columns `32 * block..32 * block + 32` lie in `data`
                // (`Bf16Matrix::new` checked its last element, and `block < cols / 32`).
                *words = unsafe { _mm512_loadu_si512(m.data.as_ptr().add(at).cast()) };
            }
            transpose16(&mut words);
            for (p, words) in words.iter().enumerate() {
                let at = (block * 16 + p) * width + g;
                // SAFETY: pair `block * 16 + p` has `width` words in `panel` (asserted), of
                // which `lanes` from `g`.
                unsafe {
                    _mm512_mask_storeu_epi32(panel.as_mut_ptr().add(at).cast(), lanes, *words)
                };
            }
        }
    }
    blocks * 16
}

// The transpose of 16 rows of 16 32-bit words, in three rounds of shuffles: words, then
// pairs of words within each 128-bit lane, then lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(rows: &mut [std::arch::x86_64::__m512i; 16]) {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_si512(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    // `u[4j + c]` now holds, in lane `l`, column `4l + c` of rows `4j..4j + 4`.
    let mut u = [_mm512_setzero_si512(); 16];
    for j in 0..4 {
        u[4 * j] = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
        u[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
        u[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
        u[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
    }
    for c in 0..4 {
        // Lanes 0 and 2, then 1 and 3, of rows 0..8 and of rows 8..16.
        let even_top = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[c], u[4 + c]);
        let even_bottom = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[8 + c], u[12 + c]);
        let odd_top = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[c], u[4 + c]);
        let odd_bottom = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[8 + c], u[12 + c]);
        rows[c] = _mm512_shuffle_i32x4::<0b10_00_10_00>(even_top, even_bottom);
        rows[8 + c] = _mm512_shuffle_i32x4::<0b11_01_11_01>(even_top, even_bottom);
        rows[4 + c] = _mm512_shuffle_i32x4::<0b10_00_10_00>(odd_top, odd_bottom);
        rows[12 + c] = _mm512_shuffle_i32x4::<0b11_01_11_01>(odd_top, odd_bottom);
    }
}

// The product's buffer, shared by tasks that each write a block of their own.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write disjoint blocks (see `Blocks::block`).
unsafe impl Send for CPtr {}
// SAFETY: as above.
unsafe impl Sync for CPtr {}

#[derive(Clone, Copy)]
struct Blocks<'a> {
    packed_a: &'a [u32],
    packed_b: &'a [u32],
    c: CPtr,
    m: usize,
    n: usize,
    pairs: usize,
}

#[cfg(target_arch = "x86_64")]
impl Blocks<'_> {
    // The `MC × NC` block of the product at row `i0` and column `j0`, over all k blocks.
    //
    // SAFETY: the CPU has AVX512-F and AVX512-BF16; no other thread writes this block.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn block(&self, i0: usize, j0: usize) {
        let (rows, cols) = ((i0..(i0 + MC).min(self.m)), (j0..(j0 + NC).min(self.n)));
        for p0 in (0..self.pairs).step_by(KC) {
            let kc = KC.min(self.pairs - p0);
            for j in cols.clone().step_by(NR) {
                let b = &self.packed_b[(j / NR) * self.pairs * NR + p0 * NR..];
                for i in rows.clone().step_by(MR) {
                    let a = &self.packed_a[(i / MR) * self.pairs * MR + p0 * MR..];
                    // SAFETY: the panels hold `kc` pairs from `p0`; the tile lies in `c`.
                    unsafe { self.tile(kc, a, b, i, j, p0 > 0) };
                }
            }
        }
    }

    // One `MR × NR` tile at `(i, j)`, straight into the product where it lies whole, through
    // a local tile at the right and bottom edges.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile(&self, kc: usize, a: &[u32], b: &[u32], i: usize, j: usize, add: bool) {
        let (rows, cols) = (MR.min(self.m - i), NR.min(self.n - j));
        // SAFETY: (for every pointer below) `(i, j)` is inside the `m × n` product.
        let corner = unsafe { self.c.0.add(i * self.n + j) };
        if rows == MR && cols == NR {
            // SAFETY: the whole tile lies in the product, rows `n` apart.
            return unsafe { kernel(kc, a, b, corner, self.n, add) };
        }
        let mut local = [0f32; MR * NR];
        for r in 0..rows {
            // SAFETY: row `r` of the tile has `cols` values inside the product.
            let row = unsafe { std::slice::from_raw_parts_mut(corner.add(r * self.n), cols) };
            local[r * NR..][..cols].copy_from_slice(row);
        }
        // SAFETY: `local` is a whole tile, rows `NR` apart.
        unsafe { kernel(kc, a, b, local.as_mut_ptr(), NR, add) };
        for r in 0..rows {
            // SAFETY: as above.
            let row = unsafe { std::slice::from_raw_parts_mut(corner.add(r * self.n), cols) };
            row.copy_from_slice(&local[r * NR..][..cols]);
        }
    }
}

// `c (+)= a · b` for one tile: `a` the A panel from its first pair (`MR` words a pair), `b`
// the B panel likewise (`NR` words), `c` the tile's corner with rows `ldc` apart; the sums
// start from the tile's values when `add` (a later k block), from zero otherwise.
//
// SAFETY: the CPU has AVX512-F and AVX512-BF16; `a` and `b` hold `kc` pairs; `c` points at
// `MR` rows of `NR` writable values, `ldc` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(kc: usize, a: &[u32], b: &[u32], c: *mut f32, ldc: usize, add: bool) {
    use std::arch::x86_64::*;
    let (a, b) = (&a[..kc * MR], &b[..kc * NR]);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if add {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row `r` of the tile holds `NR` values.
            unsafe {
                acc[0] = _mm512_loadu_ps(c.add(r * ldc));
                acc[1] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
        }
    }
    // 32 bf16 values from 16 words: a `__m512i` and a `__m512bh` are the same 512 bits.
    let pairs = |words: __m512i| unsafe { std::mem::transmute::<__m512i, __m512bh>(words) };
    for (a, b) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        // SAFETY: `b` holds `NR` = 32 words, two vectors of 16.
        let (b0, b1) = unsafe {
            let b = b.as_ptr().cast::<__m512i>();
            (
                pairs(_mm512_loadu_si512(b)),
                pairs(_mm512_loadu_si512(b.add(1))),
            )
        };
        for (acc, &word) in acc.iter_mut().zip(a) {
            let a = pairs(_mm512_set1_epi32(word as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: as for the loads.
        unsafe {
            _mm512_storeu_ps(c.add(r * ldc), acc[0]);
            _mm512_storeu_ps(c.add(r * ldc + 16), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(values: &[f32]) -> Vec<bf16> {
        values.iter().map(|&v| bf16::from_f32(v)).collect()
    }

    // `a @ b` summed in f64 over the bf16 values, with the bound of an f32 sum of `k` terms:
    // `k · ε · Σ|a||b|` per element.
    fn reference(a: &Bf16Matrix, b: &Bf16Matrix) -> Vec<(f64, f64)> {
        let value = |m: &Bf16Matrix, i, j| f64::from(bf16::from_bits(m.bits(i, j) as u16).to_f32());
        let k = a.cols;
        let mut out = Vec::new();
        for i in 0..a.rows {
            for j in 0..b.cols {
                let terms = (0..k).map(|t| value(a, i, t) * value(b, t, j));
                let (sum, abs) = terms.fold((0.0, 0.0), |(s, m), v| (s + v, m + v.abs()));
                out.push((sum, k as f64 * f64::from(f32::EPSILON) * abs));
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 300.0 - 3.3)
            .collect()
    }

    // Shapes with edges on every side: a row panel, a column panel and a k block each partly
    // filled, an odd k, and one that spans several k blocks and tasks.
    const SHAPES: [[usize; 3]; 5] = [
        [1, 1, 1],
        [13, 7, 33],
        [12, 256, 32],
        [50, 301, 300],
        [3, 2, 70],
    ];

    #[test]
    fn products_are_f32_sums_of_exact_bf16_products_in_every_layout() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        for [m, k, n] in SHAPES {
            let a = matrix(&values(m * k, 1));
            let b = matrix(&values(k * n, 2));
            let layouts = [
                (
                    Bf16Matrix::new(&a, 0, [m, k], [k, 1]),
                    Bf16Matrix::new(&b, 0, [k, n], [n, 1]),
                ),
                // Transposed views, as the backward pass multiplies them.
                (
                    Bf16Matrix::new(&a, 0, [m, k], [1, m]),
                    Bf16Matrix::new(&b, 0, [k, n], [1, k]),
                ),
            ];
            for (a, b) in layouts {
                let (a, b) = (a.unwrap(), b.unwrap());
                let want = reference(&a, &b);
                for parallel in [false, true] {
                    let mut c = vec![f32::NAN; m * n];
                    gemm(a, b, &mut c, parallel, &mut Default::default()).unwrap();
                    for (got, (sum, bound)) in c.iter().zip(&want) {
                        let err = (f64::from(*got) - sum).abs();
                        assert!(err <= *bound, "{m}×{k}×{n}: {got} against {sum} ± {bound}");
                    }
                }
            }
        }
    }

    #[test]
    fn small_integer_products_are_exact() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        // Every partial sum is an integer below 2²⁴, so any order of f32 additions is exact.
        let (m, k, n) = (30, 77, 45);
        let small = |n: usize, s: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * s) % 7) as f32 - 3.0).collect()
        };
        let (av, bv) = (small(m * k, 5), small(k * n, 3));
        let (a, b) = (matrix(&av), matrix(&bv));
        let a = Bf16Matrix::new(&a, 0, [m, k], [k, 1]).unwrap();
        let b = Bf16Matrix::new(&b, 0, [k, n], [n, 1]).unwrap();
        let mut c = vec![0.0; m * n];
        gemm(a, b, &mut c, true, &mut Default::default()).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|t| av[i * k + t] * bv[t * n + j]).sum();
                assert_eq!(c[i * n + j], want, "({i}, {j})");
            }
        }
    }

    #[test]
    fn views_outside_their_data_and_mismatched_shapes_are_refused() {
        let data = matrix(&[1.0; 6]);
        assert!(Bf16Matrix::new(&data, 0, [2, 3], [3, 1]).is_some());
        assert!(Bf16Matrix::new(&data, 1, [2, 3], [3, 1]).is_none());
        assert!(Bf16Matrix::new(&data, 0, [3, 3], [3, 1]).is_none());
        assert!(Bf16Matrix::new(&data, 0, [usize::MAX, 2], [usize::MAX, 1]).is_none());
        let a = Bf16Matrix::new(&data, 0, [2, 3], [3, 1]).unwrap();
        let packed = &mut Default::default();
        assert!(gemm(a, a, &mut [0.0; 6], false, packed).is_none());
        assert!(gemm(a, a.transposed(), &mut [0.0; 3], false, packed).is_none());
    }
}
