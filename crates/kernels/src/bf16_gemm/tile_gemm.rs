//! The bf16 GEMM on tiles (Intel AMX, `tdpbf16ps`): packing, blocking and edges, written once
//! over [`Tiles`] and run on the CPU's tiles or on their software model.
//!
//! Both operands are packed into whole tiles of 16 rows × 16 bf16 pairs (1 KiB each, zero
//! past the matrix's last row and column, so that every tile instruction works on whole
//! tiles): A's as its rows hold them (row `m`, pair `p`), B's with the pairs as rows (pair
//! `p`, column `n`), the layout `tdpbf16ps` reads. The product is computed in micro tiles of
//! 2 × 2 product tiles (32 × 32 f32 sums in `tmm0`–`tmm3`), two A tiles (`tmm4`, `tmm5`)
//! and two B tiles (`tmm6`, `tmm7`) loaded per k step of 16 pairs, four `tdpbf16ps` on
//! them; the k dimension runs in blocks of `BLOCK_STEPS` steps, the sums stored and loaded
//! again between blocks, and the threads share the product by blocks of `MC × NC`.
//!
//! Numerics: each value of the product is the instruction's arithmetic applied step after
//! step in k order (see [`super::tiles::model`]): per step, the even and the odd elements'
//! products summed apart in f32, then those two sums added, and their sum added to the sum.
//! Storing a sum between k blocks keeps it exact, so the bits depend on neither the blocking
//! nor the threads. Like the dot-product kernel's, these are f32 sums of exact bf16 products,
//! in another order than an f32 GEMM's.

use std::mem::MaybeUninit;

use half::bf16;

use super::tiles::{TILE_ROW_BYTES, TILE_ROWS, TILE_WORDS, Tiles};
use super::{Bf16Matrix, Out, Product, finish_block, through_local, zero_product};
use crate::tasks::{for_each_chunk, for_each_task};

/// Pairs of k per tile step: a tile row of bf16 pairs.
const STEP: usize = TILE_WORDS;
/// Words of one packed operand tile.
const TILE: usize = TILE_ROWS * TILE_WORDS;
/// Rows (and columns) of the product per micro tile: 2 × 2 product tiles.
const MICRO: usize = 2 * TILE_ROWS;
/// k steps per block: a micro row's two A panels of a block (32 KiB) stay in L1 and L2 while
/// the task's B panels stream past, and the sums are stored and loaded once per block.
const BLOCK_STEPS: usize = 16;
/// Rows of the product per parallel task.
const MC: usize = 2 * MICRO;
/// Columns of the product per parallel task.
const NC: usize = 8 * MICRO;

/// `product = a @ b` on the tiles `tiles()` gives each task, as [`super::gemm`] (which checked
/// the shapes); `packed` is the packing scratch.
///
/// # Safety
///
/// `tiles()` gives tiles this thread may run (the CPU's where it has them and the OS granted
/// them; the model anywhere); `a.cols == b.rows` and the product holds `a.rows * b.cols`
/// values.
pub(super) unsafe fn gemm<T: Tiles>(
    a: Bf16Matrix,
    b: Bf16Matrix,
    product: Product,
    parallel: bool,
    packed: &mut super::Packed,
    tiles: impl Fn() -> T + Sync,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if k == 0 {
        return zero_product(product, m, n);
    }
    // SAFETY: the caller's promises.
    unsafe { gemm_reading_a(a, b, product, parallel, packed, tiles, reads_a_in_place(&a)) }
}

/// Whether the A tiles are loaded from A where it lies instead of from packed tiles: an A
/// tile is 16 rows of 16 k-pairs side by side, which a row-major A with whole steps of k
/// (`k` a multiple of 32) already is, rows `row_stride` apart, and `tileloadd` takes any
/// stride (oneDNN's brgemm reads A so too). Only micro tiles of whole rows; the bottom edge's
/// are packed as the kernel reaches them, and so is an A whose rows would crowd a few of L1's
/// sets (`rows_spread_over_l1`). The same words reach the same instructions, so the bits are
/// those of the packed path (tested).
fn reads_a_in_place(a: &Bf16Matrix) -> bool {
    a.col_stride == 1
        && a.cols.is_multiple_of(2 * STEP)
        && super::rows_spread_over_l1(a.row_stride * size_of::<bf16>(), MICRO)
}

// `gemm`, with A packed or loaded in place as `a_in_place` says.
//
// SAFETY: as for `gemm`; where `a_in_place`, `reads_a_in_place(&a)`.
unsafe fn gemm_reading_a<T: Tiles>(
    a: Bf16Matrix,
    b: Bf16Matrix,
    product: Product,
    parallel: bool,
    packed: &mut super::Packed,
    tiles: impl Fn() -> T + Sync,
    a_in_place: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if k == 0 {
        return zero_product(product, m, n);
    }
    let steps = k.div_ceil(2 * STEP);
    let [packed_a, packed_b] = packed;
    let a_tiles = match a_in_place {
        true => ATiles::InPlace(a),
        false => ATiles::Packed(pack(a, steps, Order::Rows, packed_a, parallel)),
    };
    let packed_b = pack(b.transposed(), steps, Order::Pairs, packed_b, parallel);
    let blocks = Blocks {
        a: a_tiles,
        packed_b,
        out: Out::of(product),
        m,
        n,
        steps,
    };
    let (row_blocks, col_blocks) = (m.div_ceil(MC), n.div_ceil(NC));
    let task = |t: usize| {
        let mut tiles = tiles();
        // SAFETY: the caller's promise for `tiles`; tasks own disjoint blocks of the product.
        unsafe {
            tiles.configure();
            blocks.block(&mut tiles, t / col_blocks * MC, t % col_blocks * NC);
            tiles.release();
        }
    };
    for_each_task(row_blocks * col_blocks, parallel, task);
}

/// How a packed tile lays out its 16 rows of the matrix and 16 pairs of k.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    /// Row after row, each row's 16 pairs side by side: an A tile.
    Rows,
    /// Pair after pair, each pair's 16 rows side by side: a B tile (the rows being B's
    /// columns).
    Pairs,
}

/// `m`'s rows (A's rows, or B's columns through its transpose) packed as tiles of `order`,
/// into `packed`: panel `q` (rows `16q..16q + 16`, the panels' count rounded up to whole micro
/// tiles) holds `steps` tiles, one per 16 pairs of k. Every word is written (so `packed` may
/// come with old values, or none), and the packed words are returned.
fn pack<'p>(
    m: Bf16Matrix,
    steps: usize,
    order: Order,
    packed: &'p mut Vec<MaybeUninit<u32>>,
    parallel: bool,
) -> &'p [u32] {
    let panel_len = steps * TILE;
    let panels = m.rows.div_ceil(MICRO) * (MICRO / TILE_ROWS);
    let len = panels * panel_len;
    if packed.len() < len {
        packed.resize(len, MaybeUninit::uninit());
    }
    let packed = &mut packed[..len];
    for_each_chunk(packed, panel_len, parallel, |q, panel| {
        for (s, tile) in panel.chunks_exact_mut(TILE).enumerate() {
            pack_tile(m, q * TILE_ROWS, s * STEP, order, tile);
        }
    });
    // SAFETY: the panels cover `packed`, and `pack_tile` wrote every word of each tile.
    unsafe { &*(packed as *const [MaybeUninit<u32>] as *const [u32]) }
}

/// [`pack_tile_as_compiled`], compiled for AVX-512 where the CPU has it (every CPU with AMX
/// does: the loops that zip and copy the words vectorise 32 values at a time), for the
/// baseline target elsewhere (the model's tests, on any CPU: the same code and words).
fn pack_tile(m: Bf16Matrix, r0: usize, p0: usize, order: Order, tile: &mut [MaybeUninit<u32>]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx512bw() {
        // SAFETY: the CPU has AVX512-F and AVX512-BW.
        return unsafe { pack_tile_avx512(m, r0, p0, order, tile) };
    }
    pack_tile_as_compiled(m, r0, p0, order, tile)
}

/// # Safety
///
/// The CPU has AVX512-F and AVX512-BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_tile_avx512(
    m: Bf16Matrix,
    r0: usize,
    p0: usize,
    order: Order,
    tile: &mut [MaybeUninit<u32>],
) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_storeu_si512};
    let (words, gathered) = gather_tile(m, r0, p0);
    if gathered == order {
        return write_tile(&words, gathered, order, tile);
    }
    // The tile's transpose by vector shuffles: 256 scalar stores 64 bytes apart were the
    // packing of a transposed A (a weight gradient's activations) or of a column-major B.
    assert_eq!(tile.len(), TILE);
    let mut rows: [__m512i; TILE_ROWS] = core::array::from_fn(|r| {
        // SAFETY: row `r` of `words` holds `TILE_WORDS` = 16 words.
        unsafe { _mm512_loadu_si512(words[r * TILE_WORDS..].as_ptr().cast()) }
    });
    super::x86::transpose16(&mut rows);
    for (r, row) in rows.iter().enumerate() {
        // SAFETY: `tile` holds 16 rows of 16 words (asserted); every word is written.
        unsafe { _mm512_storeu_si512(tile[r * TILE_WORDS..].as_mut_ptr().cast(), *row) };
    }
}

/// The tile of `m`'s rows from `r0` and pairs from `p0` in `order` into `tile` (every word
/// written): word `(r, p)` is `m[r][2p] | m[r][2p + 1] << 16`, zero past `m`'s last row or
/// column.
#[inline(always)]
fn pack_tile_as_compiled(
    m: Bf16Matrix,
    r0: usize,
    p0: usize,
    order: Order,
    tile: &mut [MaybeUninit<u32>],
) {
    let (words, gathered) = gather_tile(m, r0, p0);
    write_tile(&words, gathered, order, tile)
}

/// The words of the tile of `m`'s rows from `r0` and pairs from `p0`, gathered in the order
/// the matrix lies in (along a row where its columns are contiguous, along a column where
/// its rows are), and that order: zero past `m`'s last row or column.
#[inline(always)]
fn gather_tile(m: Bf16Matrix, r0: usize, p0: usize) -> ([u32; TILE], Order) {
    let mut words = [0u32; TILE];
    let rows = TILE_ROWS.min(m.rows.saturating_sub(r0));
    let pairs = STEP.min(m.cols.div_ceil(2).saturating_sub(p0));
    let word = |lo: u16, hi: u16| u32::from(lo) | u32::from(hi) << 16;
    let gathered = if m.col_stride == 1 && 2 * (p0 + pairs) <= m.cols {
        // A row's pairs lie side by side, all of them whole.
        for r in 0..rows {
            let at = m.offset + (r0 + r) * m.row_stride + 2 * p0;
            let values = &m.data[at..][..2 * pairs];
            let row = &mut words[r * TILE_WORDS..][..pairs];
            for (w, pair) in row.iter_mut().zip(values.chunks_exact(2)) {
                *w = word(pair[0].to_bits(), pair[1].to_bits());
            }
        }
        Order::Rows
    } else if m.row_stride == 1 && rows > 0 {
        // A column's values lie side by side: each pair zips two runs of them.
        for p in 0..pairs {
            let run = |j: usize| {
                (j < m.cols).then(|| &m.data[m.offset + r0 + j * m.col_stride..][..rows])
            };
            let (lo, hi) = (run(2 * (p0 + p)), run(2 * (p0 + p) + 1));
            let lo = lo.expect("pairs end at the last column");
            let row = &mut words[p * TILE_WORDS..][..rows];
            match hi {
                Some(hi) => {
                    for (w, (lo, hi)) in row.iter_mut().zip(lo.iter().zip(hi)) {
                        *w = word(lo.to_bits(), hi.to_bits());
                    }
                }
                None => {
                    for (w, lo) in row.iter_mut().zip(lo) {
                        *w = word(lo.to_bits(), 0);
                    }
                }
            }
        }
        Order::Pairs
    } else {
        for r in 0..rows {
            for p in 0..pairs {
                let j = 2 * (p0 + p);
                words[r * TILE_WORDS + p] = m.bits(r0 + r, j) | m.bits(r0 + r, j + 1) << 16;
            }
        }
        Order::Rows
    };
    (words, gathered)
}

/// `words`, gathered in `gathered` order, into `tile` in `order` (every word written).
#[inline(always)]
fn write_tile(words: &[u32; TILE], gathered: Order, order: Order, tile: &mut [MaybeUninit<u32>]) {
    if gathered == order {
        for (out, w) in tile.iter_mut().zip(words.iter()) {
            out.write(*w);
        }
    } else {
        for (i, row) in words.chunks_exact(TILE_WORDS).enumerate() {
            for (j, w) in row.iter().enumerate() {
                tile[j * TILE_WORDS + i].write(*w);
            }
        }
    }
}

/// Where the A tiles are loaded from.
#[derive(Clone, Copy)]
enum ATiles<'a> {
    /// Packed tiles (`pack`, `Order::Rows`).
    Packed(&'a [u32]),
    /// A itself (`reads_a_in_place`).
    InPlace(Bf16Matrix<'a>),
}

/// A micro tile's two A tiles of its first step: their first rows, the bytes between a
/// tile's rows, and the bytes from one step's tile to the next.
#[derive(Clone, Copy)]
struct ARows {
    first: [*const u8; 2],
    stride: usize,
    step: usize,
}

#[derive(Clone, Copy)]
struct Blocks<'a> {
    a: ATiles<'a>,
    packed_b: &'a [u32],
    out: Out<'a>,
    m: usize,
    n: usize,
    steps: usize,
}

impl Blocks<'_> {
    /// The `MC × NC` block of the product at row `i0` and column `j0`: summed in place in an
    /// f32 product, or in a buffer of the task's own and then finished row by row.
    ///
    /// # Safety
    ///
    /// `tiles` are configured; no other thread writes this block.
    unsafe fn block<T: Tiles>(&self, tiles: &mut T, i0: usize, j0: usize) {
        let (rows, cols) = (MC.min(self.m - i0), NC.min(self.n - j0));
        match self.out {
            Out::F32(c) => {
                // SAFETY: `(i0, j0)` is inside the `m × n` product, rows `n` apart.
                let corner = unsafe { c.0.add(i0 * self.n + j0) };
                unsafe { self.sums(tiles, [i0, j0], [rows, cols], corner, self.n) }
            }
            Out::Bf16(out, finish) => {
                // Not zeroed: the first k block writes each sum (whole micro tiles, which
                // the block's `MC × NC` holds) before any is read.
                let mut sums = [MaybeUninit::<f32>::uninit(); MC * NC];
                let sums = sums.as_mut_ptr().cast::<f32>();
                // SAFETY: `sums` holds the block's whole micro tiles, rows `NC` apart.
                unsafe { self.sums(tiles, [i0, j0], [MC, NC], sums, NC) };
                // SAFETY: the sums of the block's `rows × cols` values were written, rows
                // `NC` apart; only this task writes their places in the output.
                let shape = [self.m, self.n];
                unsafe { finish_block(out, finish, shape, [i0, j0], [rows, cols], sums, NC) };
            }
        }
    }

    /// The sums of the block at `(i0, j0)` over all k blocks into `block`, its corner, rows
    /// `ld` apart: `rows × cols` values, or whole micro tiles where `[rows, cols]` are the
    /// block's full `[MC, NC]` (a task's own buffer).
    ///
    /// # Safety
    ///
    /// As for `block`; `block` holds `rows` rows of `cols` values `ld` apart.
    unsafe fn sums<T: Tiles>(
        &self,
        tiles: &mut T,
        [i0, j0]: [usize; 2],
        [rows, cols]: [usize; 2],
        block: *mut f32,
        ld: usize,
    ) {
        // Micro tiles of the block that hold any value of the product.
        let (row_tiles, col_tiles) = (
            MC.min(self.m - i0).div_ceil(MICRO),
            NC.min(self.n - j0).div_ceil(MICRO),
        );
        let panel_len = self.steps * TILE;
        for s0 in (0..self.steps).step_by(BLOCK_STEPS) {
            let steps = BLOCK_STEPS.min(self.steps - s0);
            for ti in 0..row_tiles {
                let i = i0 + ti * MICRO;
                // The bottom edge's A tiles of an A read in place, packed here (zero past the
                // last row, every word written) as `pack` would have them.
                let mut edge = [MaybeUninit::<u32>::uninit(); 2 * BLOCK_STEPS * TILE];
                let a = match self.a {
                    ATiles::Packed(packed) => {
                        let a_panel = (i / TILE_ROWS) * panel_len + s0 * TILE;
                        ARows {
                            first: [a_panel, a_panel + panel_len]
                                .map(|at| packed[at..].as_ptr().cast()),
                            stride: TILE_ROW_BYTES,
                            step: TILE * size_of::<u32>(),
                        }
                    }
                    ATiles::InPlace(a) if i + MICRO <= self.m => {
                        let row = |r: usize| a.offset + r * a.row_stride + 2 * STEP * s0;
                        ARows {
                            first: [i, i + TILE_ROWS].map(|r| a.data[row(r)..].as_ptr().cast()),
                            stride: a.row_stride * size_of::<bf16>(),
                            step: 2 * STEP * size_of::<bf16>(),
                        }
                    }
                    ATiles::InPlace(a) => {
                        for (half, panel) in edge.chunks_exact_mut(BLOCK_STEPS * TILE).enumerate() {
                            for (s, tile) in panel.chunks_exact_mut(TILE).take(steps).enumerate() {
                                let (r0, p0) = (i + half * TILE_ROWS, (s0 + s) * STEP);
                                pack_tile(a, r0, p0, Order::Rows, tile);
                            }
                        }
                        ARows {
                            first: [0, BLOCK_STEPS * TILE].map(|at| edge[at..].as_ptr().cast()),
                            stride: TILE_ROW_BYTES,
                            step: TILE * size_of::<u32>(),
                        }
                    }
                };
                for tj in 0..col_tiles {
                    let j = j0 + tj * MICRO;
                    let b_panel = (j / TILE_ROWS) * panel_len + s0 * TILE;
                    let b = [b_panel, b_panel + panel_len].map(|at| self.packed_b[at..].as_ptr());
                    let (r, c) = (ti * MICRO, tj * MICRO);
                    let whole = r + MICRO <= rows && c + MICRO <= cols;
                    // SAFETY: the panels hold `steps` tiles from step `s0` (whole micro
                    // tiles: `pack` rounds the panels up); the micro tile lies in `block`
                    // where whole, else goes through a local one.
                    unsafe {
                        let corner = block.add(r * ld + c);
                        match whole {
                            true => micro(tiles, a, b, steps, corner, ld, s0 > 0),
                            // At an edge, through a local micro tile.
                            false => {
                                let shape = [MICRO.min(rows - r), MICRO.min(cols - c)];
                                let sum =
                                    |local, width| micro(tiles, a, b, steps, local, width, s0 > 0);
                                through_local::<{ MICRO * MICRO }>(
                                    corner,
                                    ld,
                                    shape,
                                    MICRO,
                                    s0 > 0,
                                    sum,
                                )
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `c (+)= a · b` for one 32 × 32 micro tile over `steps` k steps: `a` the two A tiles of the
/// block's first step (packed or in A itself), `b` the two B panels from the block's first
/// step (a tile a step), `c` the micro tile's
/// corner with rows `ldc` values apart; the sums start from `c`'s values where `add` (a later
/// k block), from zero otherwise.
///
/// # Safety
///
/// `tiles` are configured; the panels and `a` hold `steps` tiles; `c` points at 32 rows of 32
/// writable values, `ldc` apart.
#[inline(always)]
unsafe fn micro<T: Tiles>(
    tiles: &mut T,
    a: ARows,
    [b0, b1]: [*const u32; 2],
    steps: usize,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    let stride = ldc * size_of::<f32>();
    let half = TILE_ROWS;
    // SAFETY: the caller's promises; each product tile is 16 rows of 16 values (64 bytes)
    // of the micro tile, and each operand tile 1 KiB of its panel, rows 64 bytes apart.
    unsafe {
        let corners = [c, c.add(half), c.add(half * ldc), c.add(half * ldc + half)];
        if add {
            tiles.load::<0>(corners[0].cast(), stride);
            tiles.load::<1>(corners[1].cast(), stride);
            tiles.load::<2>(corners[2].cast(), stride);
            tiles.load::<3>(corners[3].cast(), stride);
        } else {
            tiles.zero::<0>();
            tiles.zero::<1>();
            tiles.zero::<2>();
            tiles.zero::<3>();
        }
        let [a0, a1] = a.first;
        for s in 0..steps {
            let at = s * TILE;
            tiles.load::<4>(a0.add(s * a.step), a.stride);
            tiles.load::<6>(b0.add(at).cast(), TILE_ROW_BYTES);
            tiles.dot::<0, 4, 6>();
            tiles.load::<7>(b1.add(at).cast(), TILE_ROW_BYTES);
            tiles.dot::<1, 4, 7>();
            tiles.load::<5>(a1.add(s * a.step), a.stride);
            tiles.dot::<2, 5, 6>();
            tiles.dot::<3, 5, 7>();
        }
        tiles.store::<0>(corners[0].cast(), stride);
        tiles.store::<1>(corners[1].cast(), stride);
        tiles.store::<2>(corners[2].cast(), stride);
        tiles.store::<3>(corners[3].cast(), stride);
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::super::tests::{matrix, reference, values};
    use super::super::tiles::model::{flush, widen_daz};
    use super::super::{Bf16Kernel, Finish, gemm_on};
    use super::*;

    /// Each value of `a @ b` as the tile instructions compute it, one value at a time: k in
    /// steps of 16 pairs, each step's even and odd products summed apart (fused
    /// multiply-adds, flushed), then those two sums added and their sum added to the sum.
    /// What the packing and blocking must reproduce bit for bit, whatever the shape, layout
    /// or threads.
    fn instruction_order(a: &Bf16Matrix, b: &Bf16Matrix) -> Vec<f32> {
        let k = a.cols;
        let half = |bits: u32| widen_daz(bits as u16);
        let mut out = Vec::with_capacity(a.rows * b.cols);
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut sum = 0f32;
                for step in 0..k.div_ceil(2 * STEP) {
                    let (mut even, mut odd) = (0f32, 0f32);
                    for p in step * STEP..(step + 1) * STEP {
                        let b_at = |t: usize| if t < k { b.bits(t, j) } else { 0 };
                        even = flush(half(a.bits(i, 2 * p)).mul_add(half(b_at(2 * p)), even));
                        odd = flush(half(a.bits(i, 2 * p + 1)).mul_add(half(b_at(2 * p + 1)), odd));
                    }
                    sum = flush(sum + flush(even + odd));
                }
                out.push(sum);
            }
        }
        out
    }

    /// The f32 product `a @ b` of the tile kernel on the model, every value written.
    fn on_the_model(a: Bf16Matrix, b: Bf16Matrix, parallel: bool) -> Vec<f32> {
        let mut c = vec![f32::NAN; a.rows * b.cols];
        let product = Product::F32(&mut c);
        gemm_on(
            Bf16Kernel::TileModel,
            a,
            b,
            product,
            parallel,
            &mut Default::default(),
        )
        .unwrap();
        c
    }

    // `[m, k, n]` with edges everywhere: a single value; k, m and n short of a tile; whole
    // tiles; one past whole tiles; k across several k blocks (512 values a block); rows past
    // a task's 64 and columns past its 256; an odd k.
    const SHAPES: [[usize; 3]; 8] = [
        [1, 1, 1],
        [13, 7, 33],
        [16, 32, 16],
        [33, 33, 17],
        [20, 1101, 40],
        [70, 20, 300],
        [3, 63, 2],
        [32, 64, 32],
    ];

    // Shapes whose row-major A the tiles load in place (k whole steps of 32): a micro row with
    // an edge (70 rows: 6 past two micro rows), k across three blocks (33 steps: 16, 16, 1),
    // one row, rows past a task's.
    const IN_PLACE: [[usize; 3]; 4] = [[70, 64, 40], [33, 1056, 17], [1, 32, 1], [96, 32, 300]];

    // The four layouts of `[m, k]` by `[k, n]` operands the GEMM reads: row-major, both
    // transposed, neither dimension contiguous (every other value from an offset), and rows
    // of A and columns of B along k.
    fn layouts<'a>(
        a: &'a [bf16],
        b: &'a [bf16],
        [m, k, n]: [usize; 3],
    ) -> [(Bf16Matrix<'a>, Bf16Matrix<'a>); 4] {
        let view =
            |data, offset, shape, strides| Bf16Matrix::new(data, offset, shape, strides).unwrap();
        [
            (view(a, 0, [m, k], [k, 1]), view(b, 0, [k, n], [n, 1])),
            (view(a, 0, [m, k], [1, m]), view(b, 0, [k, n], [1, k])),
            (
                view(a, 1, [m, k], [2 * k, 2]),
                view(b, 1, [k, n], [2, 2 * k]),
            ),
            (view(a, 0, [m, k], [k, 1]), view(b, 0, [k, n], [1, k])),
        ]
    }

    #[test]
    fn the_tile_gemm_has_the_bits_of_the_instructions_applied_value_by_value() {
        for shape @ [m, k, n] in SHAPES {
            let a = matrix(&values(2 * m * k + 1, 1));
            let b = matrix(&values(2 * k * n + 1, 2));
            for (layout, (a, b)) in layouts(&a, &b, shape).into_iter().enumerate() {
                let want = instruction_order(&a, &b);
                // Threads only where the product spans several tasks.
                for parallel in [false, m > MC || n > NC] {
                    let c = on_the_model(a, b, parallel);
                    for (at, (got, want)) in c.iter().zip(&want).enumerate() {
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{m}×{k}×{n}, layout {layout}, parallel {parallel}, at {at}: {got} against {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_a_loaded_in_place_gives_the_bits_of_a_packed_a_on_the_model() {
        use super::super::tiles::model::TileModel;
        // `IN_PLACE`'s shapes, A from an offset with rows an odd count of values apart (the
        // tiles' rows start unaligned).
        for [m, k, n] in IN_PLACE {
            let a_values = matrix(&values(m * (k + 3) + 1, 9));
            let b_values = matrix(&values(k * n, 10));
            let b = Bf16Matrix::new(&b_values, 0, [k, n], [n, 1]).unwrap();
            for (offset, stride) in [(0, k), (1, k + 3)] {
                let a = Bf16Matrix::new(&a_values, offset, [m, k], [stride, 1]).unwrap();
                assert!(reads_a_in_place(&a));
                let want: Vec<u32> = instruction_order(&a, &b)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                for in_place in [true, false] {
                    let mut c = vec![f32::NAN; m * n];
                    let product = Product::F32(&mut c);
                    let packed = &mut Default::default();
                    // SAFETY: the model runs anywhere; the shapes agree and `c` holds the
                    // product; `in_place` only where `reads_a_in_place` (asserted).
                    unsafe {
                        gemm_reading_a(a, b, product, true, packed, TileModel::default, in_place)
                    };
                    let got: Vec<u32> = c.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(
                        got, want,
                        "{m}×{k}×{n}, A from {offset}, rows {stride} apart, in place {in_place}"
                    );
                }
            }
        }
        // What is never read in place: k not whole steps, or rows that do not run along k.
        let a_values = matrix(&values(2048, 1));
        assert!(!reads_a_in_place(
            &Bf16Matrix::new(&a_values, 0, [4, 48], [48, 1]).unwrap()
        ));
        assert!(!reads_a_in_place(
            &Bf16Matrix::new(&a_values, 0, [4, 64], [1, 4]).unwrap()
        ));
    }

    #[test]
    fn tiles_load_and_store_inside_operands_of_exactly_their_size() {
        // Row-major operands in buffers of exactly `m · k` and `k · n` values (the other
        // tests' are larger, for their strided layouts and offsets), A read in place where k
        // is whole steps of 32 and packed otherwise, into a product of exactly `m · n`
        // values: the bits of the instructions applied value by value, and, under valgrind's
        // memcheck (.ci/run), no tile load or store past a buffer's end. Values read past a
        // row of A would not show in the bits (B's rows past k are packed as zeros), so the
        // shapes end A on a whole micro row too, with k short of a step (64 × 20, 32 × 48).
        let ends = [[64, 20, 24], [32, 48, 16]];
        for [m, k, n] in SHAPES.into_iter().chain(IN_PLACE).chain(ends) {
            let a_values = matrix(&values(m * k, 11));
            let b_values = matrix(&values(k * n, 12));
            let a = Bf16Matrix::new(&a_values, 0, [m, k], [k, 1]).unwrap();
            let b = Bf16Matrix::new(&b_values, 0, [k, n], [n, 1]).unwrap();
            let bits = |c: Vec<f32>| c.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            let want = bits(instruction_order(&a, &b));
            for parallel in [false, true] {
                let got = bits(on_the_model(a, b, parallel));
                assert_eq!(got, want, "{m}×{k}×{n}, parallel {parallel}");
            }
        }
    }

    #[test]
    fn the_tile_gemm_sums_exact_bf16_products_in_f32() {
        // The results contract of both kernels, checked against an f64 sum.
        let [m, k, n] = [33, 301, 40];
        let (a, b) = (matrix(&values(m * k, 3)), matrix(&values(k * n, 4)));
        let a = Bf16Matrix::new(&a, 0, [m, k], [k, 1]).unwrap();
        let b = Bf16Matrix::new(&b, 0, [k, n], [n, 1]).unwrap();
        let c = on_the_model(a, b, true);
        for (got, (sum, bound)) in c.iter().zip(reference(&a, &b)) {
            assert!(
                (f64::from(*got) - sum).abs() <= bound,
                "{got} against {sum} ± {bound}"
            );
        }
    }

    #[test]
    fn the_tile_gemm_rounds_its_product_in_rows_and_in_planes_as_the_f32_product_rounded() {
        // `[m, k, n, positions]`: a task's rows and columns with edges; planes shorter than a
        // task's columns; k = 0.
        for [m, k, n, positions] in [
            [70, 40, 300, 300],
            [13, 7, 33, 11],
            [16, 27, 300, 100],
            [4, 0, 10, 5],
        ] {
            let (a, b) = (matrix(&values(m * k + 1, 5)), matrix(&values(k * n + 1, 6)));
            let a = Bf16Matrix::new(&a, 0, [m, k], [k, 1]).unwrap();
            let b = Bf16Matrix::new(&b, 0, [k, n], [n, 1]).unwrap();
            let c = on_the_model(a, b, true);
            let bias: Vec<f32> = (0..m).map(|i| i as f32 * 0.37 - 1.1).collect();
            let plus_one = |_: usize, values: &mut [bf16]| {
                values.iter_mut().for_each(|v| *v += bf16::ONE);
            };
            let finishes = [
                Finish::Rows(None),
                Finish::Rows(Some(&plus_one)),
                Finish::Planes {
                    positions,
                    bias: None,
                },
                Finish::Planes {
                    positions,
                    bias: Some(&bias),
                },
            ];
            for finish in finishes {
                let mut out = vec![MaybeUninit::new(bf16::NAN); m * n];
                let product = Product::Bf16 {
                    out: &mut out,
                    finish,
                };
                gemm_on(
                    Bf16Kernel::TileModel,
                    a,
                    b,
                    product,
                    true,
                    &mut Default::default(),
                )
                .unwrap();
                for (i, row) in c.chunks(n.max(1)).enumerate() {
                    for (j, sum) in row.iter().enumerate() {
                        let (at, want) = match finish {
                            Finish::Rows(None) => (i * n + j, bf16::from_f32(*sum)),
                            Finish::Rows(Some(_)) => (i * n + j, bf16::from_f32(*sum) + bf16::ONE),
                            Finish::Planes { bias, .. } => (
                                ((j / positions) * m + i) * positions + j % positions,
                                bf16::from_f32(sum + bias.map_or(0.0, |b| b[i])),
                            ),
                        };
                        // SAFETY: every value was initialised (with NaN) before the GEMM.
                        let got = unsafe { out[at].assume_init() };
                        assert_eq!(got.to_bits(), want.to_bits(), "{m}×{k}×{n} ({i}, {j})");
                    }
                }
            }
        }
    }

    #[test]
    fn every_layout_packs_to_the_same_tiles() {
        let [m, k] = [35, 71];
        let v = matrix(&values(m * k, 7));
        let value = |i: usize, j: usize| v[i * k + j];
        // The same matrix stored row-major, column-major, and every other value from an
        // offset (neither dimension contiguous).
        let column_major: Vec<bf16> = (0..m * k).map(|t| value(t % m, t / m)).collect();
        let mut strided = vec![bf16::NAN; 2 * m * k + 1];
        for (i, j) in (0..m).flat_map(|i| (0..k).map(move |j| (i, j))) {
            strided[1 + i * 2 * k + 2 * j] = value(i, j);
        }
        let views = [
            Bf16Matrix::new(&v, 0, [m, k], [k, 1]).unwrap(),
            Bf16Matrix::new(&column_major, 0, [m, k], [1, m]).unwrap(),
            Bf16Matrix::new(&strided, 1, [m, k], [2 * k, 2]).unwrap(),
        ];
        let steps = k.div_ceil(2 * STEP);
        for order in [Order::Rows, Order::Pairs] {
            let packed: Vec<Vec<u32>> = views
                .iter()
                .map(|view| pack(*view, steps, order, &mut Vec::new(), false).to_vec())
                .collect();
            assert_eq!(
                packed[0].len(),
                4 * steps * TILE,
                "35 rows: two micro tiles' panels"
            );
            for (layout, other) in packed.iter().enumerate().skip(1) {
                let differ = packed[0].iter().zip(other).filter(|(a, b)| a != b).count();
                assert_eq!(differ, 0, "{order:?}: layout {layout} packs other words");
            }
            // Each word where the tile's order puts it; zero past the last row and pair, and
            // an odd k's last high half zero.
            for (at, word) in packed[0].iter().enumerate() {
                let (panel, step, w) = (at / (steps * TILE), at / TILE % steps, at % TILE);
                let (r, p) = match order {
                    Order::Rows => (w / TILE_WORDS, w % TILE_WORDS),
                    Order::Pairs => (w % TILE_WORDS, w / TILE_WORDS),
                };
                let (row, j) = (panel * TILE_ROWS + r, 2 * (step * STEP + p));
                let bits = |j: usize| match row < m && j < k {
                    true => u32::from(value(row, j).to_bits()),
                    false => 0,
                };
                assert_eq!(
                    *word,
                    bits(j) | bits(j + 1) << 16,
                    "{order:?} row {row} column {j}"
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a CPU with AMX-BF16 (on_amx_tiles): .ci/run runs it with --ignored where the CPU has it"]
    fn on_amx_tiles_the_gemm_has_the_models_bits() {
        assert!(
            Bf16Kernel::Tiles.runs_here(),
            "not run: this test needs AMX-BF16 and Linux's grant of the tile state ({})",
            super::super::amx_support()
        );
        // Values of every magnitude, subnormals, infinities and signed zeros among them (no
        // NaN: its payload is the one thing the model leaves out).
        let odd = |n: usize, seed: u32| -> Vec<bf16> {
            (0..n as u32)
                .map(|i| {
                    let bits = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) as u16;
                    let v = bf16::from_bits(bits);
                    if v.is_nan() {
                        bf16::from_bits(bits & 0x807F)
                    } else {
                        v
                    }
                })
                .collect()
        };
        // The edges of SHAPES, two of the LM's shapes, and those whose A is loaded in place.
        let lm = [[1536, 384, 512], [128, 1536, 384]];
        for shape @ [m, k, n] in SHAPES.into_iter().chain(lm).chain(IN_PLACE) {
            let inputs = [
                (
                    matrix(&values(2 * m * k + 1, 1)),
                    matrix(&values(2 * k * n + 1, 2)),
                ),
                (odd(2 * m * k + 1, 3), odd(2 * k * n + 1, 4)),
            ];
            for (a, b) in &inputs {
                for (layout, (a, b)) in layouts(a, b, shape).into_iter().enumerate() {
                    let run = |kernel| {
                        let mut c = vec![f32::NAN; m * n];
                        gemm_on(
                            kernel,
                            a,
                            b,
                            Product::F32(&mut c),
                            true,
                            &mut Default::default(),
                        )
                        .unwrap();
                        c
                    };
                    let (tiles, model) = (run(Bf16Kernel::Tiles), run(Bf16Kernel::TileModel));
                    for (at, (t, mo)) in tiles.iter().zip(&model).enumerate() {
                        assert!(
                            t.to_bits() == mo.to_bits() || (t.is_nan() && mo.is_nan()),
                            "{m}×{k}×{n}, layout {layout}, at {at}: {t} on the tiles, {mo} on the model"
                        );
                    }
                }
            }
        }
    }
}
