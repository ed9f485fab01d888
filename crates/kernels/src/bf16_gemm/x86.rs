//! The bf16 GEMM's x86-64 parts: packing the operands, and the `vdpbf16ps` kernel.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use half::bf16;

use super::{Bf16Matrix, Out, Packed, Product, RUN, finish_block, through_local, zero_product};
use crate::tasks::{for_each_chunk, for_each_task};

/// Rows of the product one micro-kernel call computes, at most.
const MR: usize = 12;
/// Columns of the product one micro-kernel call computes: two vectors of 16 f32 lanes. With
/// `MR` rows that is 24 accumulators of the 32 vector registers, enough in flight to hide
/// the instruction's latency (6 cycles) at one issue a cycle.
const NR: usize = 32;
/// The other height of a tile, for products whose rows fit whole 8-row tiles only (a
/// convolution's 32 or 64 output channels): 16 accumulators, still enough in flight. With
/// 12-row tiles, a third or a sixth of such a product's tiles were edge tiles, summed in
/// full through a copy.
const MR_SHORT: usize = 8;

/// The tile height for a product of `m` rows: `MR`, unless its edge would waste more than
/// 1/32 of the work where `MR_SHORT` divides `m`.
fn tile_rows(m: usize) -> usize {
    let waste = m.div_ceil(MR) * MR - m;
    match 32 * waste > m && m.is_multiple_of(MR_SHORT) {
        true => MR_SHORT,
        false => MR,
    }
}
/// k-pairs per block: a tile's A panel of `KC × MR` pairs (12 KiB) stays in L1 while the
/// task's B panels (32 KiB each) stream past it from L2, one tile after another, and the
/// tiles' sums are loaded and stored once per block. With 128 pairs and the B panel held in
/// L1 instead (the tiles' A panels then coming from L2), a 4096 × 1024 × 1024 GEMM ran at
/// 380 GFLOP/s on 2 cores against 405–421 so.
const KC: usize = 256;
/// Row tiles per parallel task.
const TILES: usize = 4;
/// Rows of the product per parallel task, at most (4 A panels, 48 KiB of packed A per k
/// block).
const MC: usize = TILES * MR;
/// Columns of the product per parallel task (8 B panels).
const NC: usize = 8 * NR;
// A task's rows of a rounded product are finished a run at a time.
const _: () = assert!(NC <= RUN);

/// `c = a @ b`, as [`super::gemm`] (which checked the shapes).
///
/// # Safety
///
/// The CPU has AVX512-F, AVX512-BW and AVX512-BF16; `a.cols == b.rows` and the product holds
/// `a.rows * b.cols` values.
pub(super) unsafe fn gemm(
    a: Bf16Matrix,
    b: Bf16Matrix,
    product: Product,
    parallel: bool,
    packed: &mut Packed,
) {
    // SAFETY: the caller's promises.
    unsafe { gemm_reading_a(a, b, product, parallel, packed, reads_a_in_place(&a)) }
}

/// Whether the kernel reads A's k-pairs where they lie instead of packing them: each row's
/// pairs are whole 32-bit words side by side (a row-major A with an even k), which is what
/// a packed panel holds too, only `MR` rows apart instead of adjacent. The broadcasts then
/// read `MR` rows' lines, which stay in L1 across the tile's B panels as the packed panel
/// did; packing A was a tenth of the GEMM's time in a transformer's step on Zen 4 (attention's
/// 256 × 256 probabilities packed for 32 columns of V), for no change in the sums. Unless the
/// rows would crowd a few of L1's sets (`rows_spread_over_l1`).
fn reads_a_in_place(a: &Bf16Matrix) -> bool {
    a.col_stride == 1
        && a.cols.is_multiple_of(2)
        && super::rows_spread_over_l1(a.row_stride * size_of::<bf16>(), MR)
}

// `gemm`, with A packed or read in place as `a_in_place` says (the same sums in the same
// order either way: tested bit for bit).
//
// SAFETY: as for `gemm`; where `a_in_place`, `reads_a_in_place(&a)`.
unsafe fn gemm_reading_a(
    a: Bf16Matrix,
    b: Bf16Matrix,
    product: Product,
    parallel: bool,
    packed: &mut Packed,
    a_in_place: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if k == 0 {
        return zero_product(product, m, n);
    }
    let pairs = k.div_ceil(2);
    let mr = tile_rows(m);
    // A is packed by rows and B by columns alike: B's columns are the rows of its transpose.
    let [packed_a, packed_b] = packed;
    // SAFETY: the CPU has AVX512-F and AVX512-BW (the caller's promise).
    let (a_panels, packed_b) = unsafe {
        (
            match a_in_place {
                true => APanels::InPlace(a),
                false => APanels::Packed(pack(a, pairs, mr, packed_a, parallel)),
            },
            pack(b.transposed(), pairs, NR, packed_b, parallel),
        )
    };
    let blocks = Blocks {
        a: a_panels,
        packed_b,
        out: Out::of(product),
        m,
        n,
        pairs,
        mr,
    };
    let mc = blocks.rows();
    let (row_blocks, col_blocks) = (m.div_ceil(mc), n.div_ceil(NC));
    let task = |t: usize| {
        // SAFETY: the CPU has the kernel's features (the caller's promise), and tasks own
        // disjoint blocks of `c`.
        unsafe { blocks.block(t / col_blocks * mc, t % col_blocks * NC) }
    };
    for_each_task(row_blocks * col_blocks, parallel, task);
}

/// Where the tiles read A's k-pairs.
#[derive(Clone, Copy)]
enum APanels<'a> {
    /// Packed in panels of `mr` rows (`pack`).
    Packed(&'a [u32]),
    /// In A itself, each row's pairs side by side (`reads_a_in_place`).
    InPlace(Bf16Matrix<'a>),
}

// `m`'s rows (A's rows, or B's columns through its transpose) in panels of `width` rows, into
// `packed`: panel `q` holds, for each k-pair `p`, `width` words `(m[r][2p] | m[r][2p + 1] << 16)`
// for its rows `r`, zero past the last row and the last column. One instruction then reads a
// panel's pair for a row (a broadcast) or for 16 columns (a vector). Every word is written
// (so `packed` may come with old values, or none), and the packed words are returned.
//
// SAFETY: the CPU has AVX512-F.
unsafe fn pack<'p>(
    m: Bf16Matrix,
    pairs: usize,
    width: usize,
    packed: &'p mut Vec<MaybeUninit<u32>>,
    parallel: bool,
) -> &'p [u32] {
    let panel_len = pairs * width;
    let len = m.rows.div_ceil(width) * panel_len;
    if packed.len() < len {
        packed.resize(len, MaybeUninit::uninit());
    }
    let packed = &mut packed[..len];
    // As many panels a task as `GROUP_ROWS` rows hold, but 8 tasks at least where there are
    // enough panels, for the threads to share.
    let panels = m.rows.div_ceil(width);
    let group = (GROUP_ROWS / width).min(panels.div_ceil(8)).max(1);
    // SAFETY: as for `pack`.
    let fill = |g: usize, panels: &mut [MaybeUninit<u32>]| unsafe {
        pack_panels(m, g * group * width, width, panel_len, panels)
    };
    for_each_chunk(packed, group * panel_len, parallel, fill);
    // SAFETY: the panels cover `packed`, and each wrote every word of its own.
    unsafe { &*(packed as *const [MaybeUninit<u32>] as *const [u32]) }
}

/// Rows of `m` a packing task takes at most: whole panels of them (32 of A's, 12 of B's).
/// Side-by-side rows are read `GROUP_ROWS` values at a time, 12 cache lines a row and pair.
const GROUP_ROWS: usize = 384;
const _: () = assert!(
    GROUP_ROWS.is_multiple_of(MR)
        && GROUP_ROWS.is_multiple_of(MR_SHORT)
        && GROUP_ROWS.is_multiple_of(NR)
);
/// Pairs ahead of the one `zip_panels` zips whose values it asks the cache for.
const AHEAD: usize = 4;

// The panels of `width` rows from row `i0`, each `panel_len` words, as `pack` lays them out.
//
// SAFETY: the CPU has AVX512-F and AVX512-BW.
unsafe fn pack_panels(
    m: Bf16Matrix,
    i0: usize,
    width: usize,
    panel_len: usize,
    panels: &mut [MaybeUninit<u32>],
) {
    if m.row_stride == 1 {
        // SAFETY: the caller's promise.
        return unsafe { zip_panels(m, i0, width, panel_len, panels) };
    }
    for (q, panel) in panels.chunks_mut(panel_len).enumerate() {
        // SAFETY: the caller's promise.
        unsafe { pack_panel(m, i0 + q * width, width, panel) };
    }
}

// `pack_panels` where the panels' rows lie side by side (B's columns of a row-major B, A's
// rows of a transposed A): each pair's words zip two runs of values, up to `GROUP_ROWS` of
// them at once for all the task's panels (a panel's 12 took a 64-byte line for 24 bytes, and
// the loop did not vectorise past SSE2), then split among the panels.
//
// SAFETY: the CPU has AVX512-F and AVX512-BW; `m.row_stride == 1`.
#[target_feature(enable = "avx512f,avx512bw")]
fn zip_panels(
    m: Bf16Matrix,
    i0: usize,
    width: usize,
    panel_len: usize,
    panels: &mut [MaybeUninit<u32>],
) {
    // The high halves of a last, odd column's words.
    const ZEROS: [bf16; GROUP_ROWS] = [bf16::ZERO; GROUP_ROWS];
    let group = panels.len() / panel_len;
    let rows = (group * width).min(m.rows - i0);
    let run = |j: usize| &m.data[m.offset + i0 + j * m.col_stride..][..rows];
    // The pair's words for the group's rows, zero past the last row of `m`.
    let mut words = [0u32; GROUP_ROWS];
    let pairs = panel_len / width;
    for p in 0..pairs {
        // The lines of the rows `AHEAD` pairs on: read `col_stride` apart, they are not
        // fetched ahead by the CPU, and waiting on them took most of this loop's time.
        for j in [2 * (p + AHEAD), 2 * (p + AHEAD) + 1]
            .into_iter()
            .filter(|j| *j < m.cols)
        {
            let run = run(j);
            for line in (0..rows).step_by(32) {
                _mm_prefetch::<_MM_HINT_T0>(run[line..].as_ptr().cast());
            }
        }
        let high = match 2 * p + 1 < m.cols {
            true => run(2 * p + 1),
            false => &ZEROS[..rows],
        };
        for (w, (lo, hi)) in words.iter_mut().zip(run(2 * p).iter().zip(high)) {
            *w = u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16;
        }
        let words = words[..group * width].chunks_exact(width);
        for (panel, words) in panels.chunks_exact_mut(panel_len).zip(words) {
            copy_words(words, &mut panel[p * width..][..width]);
        }
    }
}

// `src` into `dst` (as long), 16 words a vector, the last ones masked: a few words at a
// time, the compiler's copy was a call to `memmove` (a tenth of a conv net's packing).
#[target_feature(enable = "avx512f")]
fn copy_words(src: &[u32], dst: &mut [MaybeUninit<u32>]) {
    assert_eq!(src.len(), dst.len());
    for (at, src) in src.chunks(16).enumerate() {
        let lanes: __mmask16 = ((1u32 << src.len()) - 1) as u16;
        // SAFETY: the masked lanes are the `src.len()` words of `src`, and as many of `dst`
        // from the same place.
        unsafe {
            let v = _mm512_maskz_loadu_epi32(lanes, src.as_ptr().cast());
            _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(16 * at).cast(), lanes, v);
        }
    }
}

// The panel of `width` rows from row `i0`, as `pack` lays it out, where its rows do not lie
// side by side.
//
// SAFETY: the CPU has AVX512-F.
unsafe fn pack_panel(m: Bf16Matrix, i0: usize, width: usize, panel: &mut [MaybeUninit<u32>]) {
    // The high halves of a last, odd column's words.
    const ZEROS: [bf16; NR] = [bf16::ZERO; NR];
    let rows = width.min(m.rows - i0);
    if rows < width {
        panel.fill(MaybeUninit::new(0));
    }
    let word = |lo: &bf16, hi: &bf16| u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16;
    if m.col_stride == 1 {
        // Each row's pairs lie side by side (A's rows of a row-major A, B's columns of a
        // transposed B): the panel is their transpose, taken 16 × 16 words at a time with
        // vector shuffles (scalar stores `width` apart cost 3× as much), the rest one by one.
        // SAFETY: the CPU has AVX512-F (the caller's promise).
        let done = unsafe { transpose_pairs(m, i0, rows, width, panel) };
        for r in 0..rows {
            let row = &m.data[m.offset + (i0 + r) * m.row_stride..][..m.cols];
            let words = panel[done * width..].chunks_exact_mut(width);
            for (pair, words) in row[2 * done..].chunks(2).zip(words) {
                words[r].write(word(&pair[0], pair.get(1).unwrap_or(&ZEROS[0])));
            }
        }
    } else {
        for r in 0..rows {
            for (p, w) in panel[r..].iter_mut().step_by(width).enumerate() {
                w.write(m.bits(i0 + r, 2 * p) | m.bits(i0 + r, 2 * p + 1) << 16);
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
#[target_feature(enable = "avx512f")]
unsafe fn transpose_pairs(
    m: Bf16Matrix,
    i0: usize,
    rows: usize,
    width: usize,
    panel: &mut [MaybeUninit<u32>],
) -> usize {
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
#[target_feature(enable = "avx512f")]
pub(super) fn transpose16(rows: &mut [__m512i; 16]) {
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

#[derive(Clone, Copy)]
struct Blocks<'a> {
    a: APanels<'a>,
    packed_b: &'a [u32],
    out: Out<'a>,
    m: usize,
    n: usize,
    pairs: usize,
    /// The tiles' height (`MR` or `MR_SHORT`), and so A's panels'.
    mr: usize,
}

impl Blocks<'_> {
    // Rows of the product per task: `TILES` tiles of `mr` rows (`MC` at most).
    fn rows(&self) -> usize {
        TILES * self.mr
    }

    // The `MC × NC` block of the product at row `i0` and column `j0`: summed in place in an
    // f32 product, or in a buffer of the task's own and then finished row by row.
    //
    // SAFETY: the CPU has AVX512-F and AVX512-BF16; no other thread writes this block.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn block(&self, i0: usize, j0: usize) {
        let (rows, cols) = (self.rows().min(self.m - i0), NC.min(self.n - j0));
        match self.out {
            // SAFETY: `(i0, j0)` is inside the `m × n` product, rows `n` apart.
            Out::F32(c) => unsafe { self.sums(i0, j0, c.0.add(i0 * self.n + j0), self.n) },
            Out::Bf16(out, finish) => {
                // Not zeroed (16 MiB of stores for a 4096 × 1024 product): the first k block
                // writes each sum before any is read.
                let mut sums = [MaybeUninit::<f32>::uninit(); MC * NC];
                let sums = sums.as_mut_ptr().cast::<f32>();
                // SAFETY: `sums` holds the block, rows `NC` apart.
                unsafe { self.sums(i0, j0, sums, NC) };
                let shape = [self.m, self.n];
                // SAFETY: `sums` wrote the block's `rows × cols` values, rows `NC` apart; only
                // this task writes their places in the output.
                unsafe { finish_block(out, finish, shape, [i0, j0], [rows, cols], sums, NC) };
            }
        }
    }

    // The sums of the block at `(i0, j0)` over all k blocks, into `block`, the block's
    // corner, rows `ld` apart (written by the first k block, before any is read).
    //
    // SAFETY: as for `block`; `block` holds the block's rows, `ld` apart.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn sums(&self, i0: usize, j0: usize, block: *mut f32, ld: usize) {
        let mr = self.mr;
        let (rows, cols) = (
            (i0..(i0 + self.rows()).min(self.m)),
            (j0..(j0 + NC).min(self.n)),
        );
        // k in blocks of at most `KC` pairs, as even as they go: a short last block (16 pairs
        // of a conv net's 144) paid a load and a store of every sum for few products.
        let block_pairs = self.pairs.div_ceil(self.pairs.div_ceil(KC));
        for p0 in (0..self.pairs).step_by(block_pairs) {
            let kc = block_pairs.min(self.pairs - p0);
            // Row tiles outer: each A panel stays in L1 across the B panels (see `KC`).
            for i in rows.clone().step_by(mr) {
                // An edge tile's rows of an A read in place are packed here, zero past the
                // last row, as `pack` would have them: the kernel reads `mr` rows.
                let mut edge = [MaybeUninit::<u32>::uninit(); KC * MR];
                let a = match self.a {
                    APanels::Packed(packed) => {
                        ARows::Packed(&packed[(i / mr) * self.pairs * mr + p0 * mr..])
                    }
                    APanels::InPlace(a) if i + mr <= self.m => ARows::InPlace {
                        // SAFETY: row `i` and its pairs from `p0` lie in `a.data`.
                        first: unsafe { a.data.as_ptr().add(a.offset + i * a.row_stride + 2 * p0) },
                        stride: a.row_stride,
                    },
                    APanels::InPlace(a) => {
                        // The block's pairs of A, a view packed as `pack` packs a panel.
                        let pairs = Bf16Matrix {
                            offset: a.offset + 2 * p0,
                            cols: 2 * kc,
                            ..a
                        };
                        let edge = &mut edge[..kc * mr];
                        // SAFETY: the CPU has AVX512-F (the caller's promise); `pack_panel`
                        // writes every word of the panel (zero past the last row), so the
                        // words read back are initialised.
                        unsafe {
                            pack_panel(pairs, i, mr, edge);
                            ARows::Packed(&*(edge as *const [MaybeUninit<u32>] as *const [u32]))
                        }
                    }
                };
                for j in cols.clone().step_by(NR) {
                    let b = &self.packed_b[(j / NR) * self.pairs * NR + p0 * NR..];
                    // SAFETY: the panels hold `kc` pairs from `p0`; the tile lies in the
                    // block.
                    let corner = unsafe { block.add((i - i0) * ld + (j - j0)) };
                    unsafe { self.tile(kc, a, b, [i, j], corner, ld, p0 > 0) };
                }
            }
        }
    }

    // One `mr × NR` tile at `(i, j)` of the product, whose values lie at `corner`, rows `ld`
    // apart: summed there where the tile lies whole, through a local tile at the right and
    // bottom edges.
    //
    // SAFETY: as for `block`; `corner` holds the tile's rows and columns inside the product.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile(
        &self,
        kc: usize,
        a: ARows,
        b: &[u32],
        [i, j]: [usize; 2],
        corner: *mut f32,
        ld: usize,
        add: bool,
    ) {
        let mr = self.mr;
        // SAFETY: (for both) the caller's promises for `kernel`.
        let kernel = |c: *mut f32, ld: usize| match mr {
            MR => unsafe { kernel::<MR>(kc, a, b, c, ld, add) },
            _ => unsafe { kernel::<MR_SHORT>(kc, a, b, c, ld, add) },
        };
        let (rows, cols) = (mr.min(self.m - i), NR.min(self.n - j));
        if rows == mr && cols == NR {
            // SAFETY: the whole tile lies at `corner`, rows `ld` apart.
            return kernel(corner, ld);
        }
        // SAFETY: the tile's `rows × cols` values lie at `corner`, rows `ld` apart, within
        // its `MR × NR`; the kernel writes one whole tile of `mr ≤ MR` rows.
        unsafe { through_local::<{ MR * NR }>(corner, ld, [rows, cols], NR, add, kernel) }
    }
}

/// A tile's rows of A from its first k-pair, as the kernel reads them.
#[derive(Clone, Copy)]
enum ARows<'a> {
    /// A packed panel: `ROWS` words a pair.
    Packed(&'a [u32]),
    /// A itself: the tile's first row at `first`, its rows `stride` values apart, each
    /// row's pairs side by side (`reads_a_in_place`).
    InPlace { first: *const bf16, stride: usize },
}

// `c (+)= a · b` for one tile of `ROWS` rows: `a` the tile's rows of A, `b` the B panel from
// its first pair (`NR` words a pair), `c` the tile's corner with rows `ldc` apart; the sums
// start from the tile's values when `add` (a later k block), from zero otherwise.
//
// SAFETY: the CPU has AVX512-F and AVX512-BF16; `a` and `b` hold `kc` pairs (`a` read in
// place: `ROWS` rows of them); `c` points at `ROWS` rows of `NR` writable values, `ldc` apart.
//
// Never inlined, for its 26 vectors' sake (see `dots::dots`).
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel<const ROWS: usize>(
    kc: usize,
    a: ARows,
    b: &[u32],
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    let b = &b[..kc * NR];
    let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
    if add {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row `r` of the tile holds `NR` values.
            unsafe {
                acc[0] = _mm512_loadu_ps(c.add(r * ldc));
                acc[1] = _mm512_loadu_ps(c.add(r * ldc + 16));
            }
        }
    }
    match a {
        ARows::Packed(a) => {
            let a = &a[..kc * ROWS];
            for (a, b) in a.chunks_exact(ROWS).zip(b.chunks_exact(NR)) {
                // SAFETY: `b` holds `NR` words; `a` the pair's `ROWS`.
                unsafe { pair_step(&mut acc, b, |r| a[r]) };
            }
        }
        ARows::InPlace { first, stride } => {
            for (p, b) in b.chunks_exact(NR).enumerate() {
                // SAFETY: the caller's promise: row `r`'s pair `p` lies at `first`, `r`
                // rows and `p` pairs on (read unaligned: a row may start at an odd value).
                let word = |r: usize| unsafe {
                    first.add(r * stride + 2 * p).cast::<u32>().read_unaligned()
                };
                // SAFETY: `b` holds `NR` words.
                unsafe { pair_step(&mut acc, b, word) };
            }
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

// One k-pair of a tile: each row's word of A (`word(r)`), broadcast, dotted with B's `NR`
// words of the pair into the row's two accumulators.
//
// SAFETY: the CPU has AVX512-F and AVX512-BF16; `b` holds `NR` words.
#[inline(always)]
unsafe fn pair_step<const ROWS: usize>(
    acc: &mut [[__m512; 2]; ROWS],
    b: &[u32],
    word: impl Fn(usize) -> u32,
) {
    // 32 bf16 values from 16 words: a `__m512i` and a `__m512bh` are the same 512 bits.
    let pairs = |words: __m512i| unsafe { std::mem::transmute::<__m512i, __m512bh>(words) };
    // SAFETY: `b` holds `NR` = 32 words, two vectors of 16.
    let (b0, b1) = unsafe {
        let b = b.as_ptr().cast::<__m512i>();
        (
            pairs(_mm512_loadu_si512(b)),
            pairs(_mm512_loadu_si512(b.add(1))),
        )
    };
    for (r, acc) in acc.iter_mut().enumerate() {
        // SAFETY: the CPU has AVX512-F and AVX512-BF16 (the caller's promise); inlined into
        // the kernel, compiled for them.
        unsafe {
            let a = pairs(_mm512_set1_epi32(word(r) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], a, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], a, b1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{matrix, values};
    use super::*;

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn a_read_in_place_gives_the_bits_of_a_packed_a() {
        assert!(
            super::super::dot_products(),
            "not run: this test needs a CPU with AVX512-BF16"
        );
        // Even k only (an odd one is always packed): edge tiles of 12 and of 8 rows, k blocks
        // that split (600 pairs: three blocks), rows from an offset and `stride` apart, a row
        // starting at an odd value (the words read unaligned), several tasks.
        let shapes = [
            [1, 2, 1],
            [13, 8, 33],
            [12, 512, 32],
            [37, 1200, 70],
            [64, 30, 40],
            [5, 2, 7],
        ];
        for [m, k, n] in shapes {
            let a_values = matrix(&values(m * (k + 3) + 1, 7));
            let b_values = matrix(&values(k * n, 8));
            let b = Bf16Matrix::new(&b_values, 0, [k, n], [n, 1]).unwrap();
            for (offset, stride) in [(0, k), (1, k + 3)] {
                let a = Bf16Matrix::new(&a_values, offset, [m, k], [stride, 1]).unwrap();
                assert!(reads_a_in_place(&a));
                for parallel in [false, true] {
                    let product = |in_place| {
                        let mut c = vec![f32::NAN; m * n];
                        let out = Product::F32(&mut c);
                        // SAFETY: the CPU has the kernel's features (asserted above), the
                        // shapes agree, `c` holds the product, and `in_place` only where
                        // `reads_a_in_place` (asserted above).
                        unsafe {
                            gemm_reading_a(a, b, out, parallel, &mut Default::default(), in_place)
                        };
                        c.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    assert_eq!(
                        product(true),
                        product(false),
                        "{m}×{k}×{n}, A from {offset}, rows {stride} apart, parallel {parallel}"
                    );
                }
            }
        }
        // What is never read in place: an odd k, or rows that do not run along k.
        let a_values = matrix(&values(64, 1));
        assert!(!reads_a_in_place(
            &Bf16Matrix::new(&a_values, 0, [4, 3], [3, 1]).unwrap()
        ));
        assert!(!reads_a_in_place(
            &Bf16Matrix::new(&a_values, 0, [4, 4], [1, 4]).unwrap()
        ));
    }

    #[test]
    fn short_tiles_take_products_whose_rows_they_divide_where_tall_ones_waste() {
        // A conv net's channels: 8-row tiles.
        for m in [8, 16, 32, 40, 64, 80] {
            assert_eq!(tile_rows(m), MR_SHORT, "{m}");
        }
        // Whole 12-row tiles, edges too small to matter, or rows 8 does not divide.
        for m in [12, 24, 96, 1024, 4096, 27, 10, 1] {
            assert_eq!(tile_rows(m), MR, "{m}");
        }
    }
}
