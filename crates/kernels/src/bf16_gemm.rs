//! A bf16 GEMM for x86-64 CPUs: bf16 products summed in f32 on Intel AMX tiles (`tdpbf16ps`)
//! or on AVX512-BF16 dot products (`vdpbf16ps`), whichever the CPU has ([`kernel`]).
//!
//! Autocast's lower-class matmul on Flex otherwise widens its bf16 operands to f32 and runs
//! Flex's f32 GEMM (see [`f32_gemm`](crate::f32_gemm)): the numbers of a bf16 GEMM at f32 speed.
//! `vdpbf16ps` multiplies pairs of bf16 values and adds both products to an f32 lane, twice the
//! multiply-adds of an f32 FMA per instruction (on the 2-core EPYC this crate is built on,
//! 220–230 GFLOP/s a core against 100–115 for f32 FMAs, register-bound loops). It is what
//! oneDNN, and so PyTorch's CPU autocast, runs on such CPUs. On Intel Xeons with AMX (4th
//! generation and later) oneDNN runs its bf16 GEMMs on tiles instead: `tdpbf16ps` does
//! 16 × 16 × 32 multiply-adds per instruction, several times the vector units' rate, and so
//! does `tile_gemm` where the CPU has AMX-BF16 and Linux grants the tile state
//! ([`amx_support`]; refused, the dot products, said once in the log and in
//! `burn-accelerate env`).
//!
//! Numerics, both kernels: f32 sums of exact bf16 products (a bf16 product is exact in f32),
//! as cuBLAS and oneDNN compute a bf16 GEMM, but not the bits of an f32 GEMM over the widened
//! operands: the sums run in another order, and the two kernels' orders differ too. The dot
//! products add each k-pair's two products to a lane's sum, pair after pair in k order; the
//! tiles sum each step of 16 pairs' even and odd products apart, add the two, and add that
//! to the sum, step after step (see `tiles::model`). Both treat bf16 subnormal inputs as zero
//! and flush subnormal sums to zero (Intel SDM, `VDPBF16PS`, `TDPBF16PS`), as oneDNN's bf16
//! GEMM does.
//! Neither result depends on the number of threads.
//!
//! The dot products' layout is the classic one (Goto and van de Geijn): both operands packed once into
//! k-pair interleaved panels, the product computed in `MR × NR` tiles held in registers (12 or
//! 8 rows, whichever wastes less on the product's rows), the k dimension in blocks of at most
//! `KC` pairs so that a tile's A panel stays in L1 while B's panels stream past it, and tiles
//! of `C` shared among threads by blocks of `MC × NC`. Where k is long and runs contiguously
//! in both operands (a convolution's weight gradient: k is every output position of a chunk
//! of images) packing costs more than it saves, and an inner-product kernel (`dots`) takes
//! the product, on AMX CPUs too: each value a dot product of an A row and a B column as they lie, in f32
//! lanes summed across at the end of each k block.
//!
//! The product comes out as f32 sums, or rounded to bf16 as each task completes its block
//! ([`Product::Bf16`]): a linear's output, or a convolution's laid out in its images' planes
//! ([`Finish::Planes`]), then never exists in f32 outside the cache.

use std::mem::MaybeUninit;

use half::bf16;

use crate::half::round_bf16_into;

#[cfg(target_arch = "x86_64")]
mod dots;
mod tile_gemm;
mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use tiles::amx::Support;
use tiles::amx::{self, Amx};
use tiles::model::TileModel;

/// A bf16 matrix read in place: `data[offset + i * row_stride + j * col_stride]` is its
/// element `(i, j)`, so transposed views need no copy.
#[derive(Clone, Copy, Debug)]
pub struct Bf16Matrix<'a> {
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
    pub fn new(
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

/// Which kernel multiplies bf16 matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// The CPU's AMX tiles (`tile_gemm` on `Amx`).
    Tiles,
    /// The CPU's AVX512-BF16 dot products (`x86`).
    DotProducts,
    /// `tile_gemm` on the software model of the tiles (`TileModel`): the tile kernel's
    /// code and bits on any CPU, far slower. For tests and benchmarks, never chosen by
    /// [`kernel`].
    TileModel,
}

impl Bf16Kernel {
    /// Whether this process runs it.
    pub fn runs_here(self) -> bool {
        match self {
            Bf16Kernel::Tiles => amx::support() == Support::Granted,
            Bf16Kernel::DotProducts => dot_products(),
            Bf16Kernel::TileModel => true,
        }
    }
}

/// Whether this CPU has the dot-product kernel's instructions (AVX512-F, AVX512-BW for
/// packing, and AVX512-BF16: every CPU with the last has the others), checked once.
fn dot_products() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Lines of 64 bytes and 64 sets: the L1 data cache of Zen 4 (32 KiB, 8 ways) and of the
/// Xeons with AMX (48 KiB, 12 ways) alike, so addresses 4 KiB apart share a set.
const L1_SETS: usize = 64;
const LINE: usize = 64;

/// Whether `rows` rows of a matrix, `row_bytes` apart, spread over the L1 data cache's sets
/// so that at most 4 share one (half of its 8 ways or fewer, the rest left to the other
/// operand and the sums). A kernel that reads a tile's rows of A where they lie keeps them
/// in L1 across the tile's B panels; rows whose starts fall into a few sets (k = 2048: every
/// row 4 KiB on, all in one set) evict each other, and the GEMM fell to 0.90 of its packed
/// speed on Zen 4, so such an A is packed. A fact of the shape, never of a timing.
fn rows_spread_over_l1(row_bytes: usize, rows: usize) -> bool {
    if !row_bytes.is_multiple_of(LINE) {
        // Each row starts elsewhere in its line: the starts drift across the sets.
        return true;
    }
    let lines = (row_bytes / LINE) % L1_SETS;
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    // Row starts cycle through `period` sets.
    let period = L1_SETS / gcd(lines, L1_SETS);
    rows.div_ceil(period) <= 4
}

/// Whether this CPU has AVX512-F and AVX512-BW, checked once: what the tile kernel's packing
/// is compiled for where the CPU has it.
#[cfg(target_arch = "x86_64")]
fn avx512bw() -> bool {
    use std::sync::OnceLock;
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    })
}

/// The kernel this CPU runs bf16 GEMMs on: its tiles where it has AMX-BF16 and Linux granted
/// them, else its dot products where it has AVX512-BF16, else none (the caller widens to
/// f32). A CPU with AMX whose tiles were refused says so once, in the log.
pub fn kernel() -> Option<Bf16Kernel> {
    use std::sync::OnceLock;
    static KERNEL: OnceLock<Option<Bf16Kernel>> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        let support = amx::support();
        if !matches!(support, Support::Granted | Support::NoAmx) {
            log::warn!(
                "bf16 GEMMs run without AMX tiles ({support}); {}",
                match dot_products() {
                    true => "AVX512-BF16 dot products instead",
                    false => "widened to f32 instead",
                }
            );
        }
        [Bf16Kernel::Tiles, Bf16Kernel::DotProducts]
            .into_iter()
            .find(|kernel| kernel.runs_here())
    })
}

/// Why the CPU's AMX tiles are or are not used, for `burn-accelerate env`.
pub fn amx_support() -> Support {
    amx::support()
}

/// Alters a run of a product row's values in place once rounded to bf16:
/// `epilogue(column, values)`, `column` the run's first column (a linear adds its bias).
pub type Epilogue<'a> = &'a (dyn Fn(usize, &mut [bf16]) + Sync);

/// Where a GEMM puts its product of `a.rows × b.cols` values.
pub enum Product<'a> {
    /// The f32 sums, in row-major order.
    F32(&'a mut [f32]),
    /// The sums rounded to bf16 (to nearest even, `half`'s bits), laid out and altered as
    /// `finish` says, each run as soon as a task has summed it: no f32 product goes out to
    /// memory (for a linear's `4096 × 1024` output, 16 MiB written, mapped afresh and read back
    /// to be rounded). Every value of `out` is written where [`gemm()`] returns `Some`.
    Bf16 {
        out: &'a mut [MaybeUninit<bf16>],
        finish: Finish<'a>,
    },
}

impl Product<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(c) => c.len(),
            Self::Bf16 { out, .. } => out.len(),
        }
    }

    // Whether its layout holds an `m × n` product: planes of `positions` values that the
    // columns fill whole, and a bias value per row.
    fn fits(&self, m: usize, n: usize) -> bool {
        match self {
            Self::Bf16 {
                finish: Finish::Planes { positions, bias },
                ..
            } => {
                *positions > 0 && n.is_multiple_of(*positions) && bias.is_none_or(|b| b.len() >= m)
            }
            _ => true,
        }
    }
}

/// How a product rounded to bf16 is laid out, and what is done to it on the way.
#[derive(Clone, Copy)]
pub enum Finish<'a> {
    /// In row-major order, each run passed through the epilogue once rounded (a linear adds
    /// its bias, in bf16 as Flex does).
    Rows(Option<Epilogue<'a>>),
    /// A convolution's output `[images, m, positions]` from its product `[m, images ·
    /// positions]` (the weight times the patches of images side by side): row `i`'s column
    /// `j` at `((j / positions) · m + i) · positions + j % positions`, the row's `bias` added
    /// to the f32 sums before they are rounded. Rounded once written to memory as f32, the
    /// product of a conv net's first layer was 4 MiB out and back.
    Planes {
        positions: usize,
        bias: Option<&'a [f32]>,
    },
}

impl Finish<'_> {
    /// Where the values of row `i` from column `j` go, `len` of them, for a product of `m`
    /// rows and `n` columns: `(first column, values, first index in the output)` for each
    /// run that lies whole in the output, in order.
    fn runs(
        self,
        [m, n]: [usize; 2],
        i: usize,
        j: usize,
        len: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> {
        let mut at = j;
        std::iter::from_fn(move || {
            let left = j + len - at;
            if left == 0 {
                return None;
            }
            let run = match self {
                Finish::Rows(_) => (at, left, i * n + at),
                Finish::Planes { positions, .. } => {
                    let (image, p) = (at / positions, at % positions);
                    (at, left.min(positions - p), (image * m + i) * positions + p)
                }
            };
            at += run.1;
            Some(run)
        })
    }
}

/// The product of `a @ b` into `product` on this CPU's [`kernel`], computed on rayon's threads
/// when `parallel`; `packed` is scratch for the packed operands, kept by the caller (whatever
/// it holds is overwritten). `None` (and `product` untouched) where the CPU has no bf16
/// kernel or the shapes do not match.
pub fn gemm(
    a: Bf16Matrix,
    b: Bf16Matrix,
    product: Product,
    parallel: bool,
    packed: &mut Packed,
) -> Option<()> {
    gemm_on(kernel()?, a, b, product, parallel, packed)
}

/// [`gemm()`] on `kernel`; `None` where this process does not run it.
pub fn gemm_on(
    kernel: Bf16Kernel,
    a: Bf16Matrix,
    b: Bf16Matrix,
    product: Product,
    parallel: bool,
    packed: &mut Packed,
) -> Option<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if !kernel.runs_here() || b.rows != k || product.len() != m * n || !product.fits(m, n) {
        return None;
    }
    // The inner-product kernel for long contiguous k, on a CPU kernel with the dot products.
    #[cfg(target_arch = "x86_64")]
    if kernel != Bf16Kernel::TileModel && dot_products() && dots::applies(&a, &b) {
        // SAFETY: the CPU has AVX512-F, AVX512-BW and AVX512-BF16 (`dot_products`); the
        // inner-product kernel's layout `dots::applies` checked; the shapes match.
        unsafe {
            match product {
                Product::F32(c) => dots::gemm(a, b, c, parallel),
                // The kernel's products are small (m and n at most 512): through an f32 buffer.
                Product::Bf16 { out, finish } => {
                    let mut c = vec![0.0; m * n];
                    dots::gemm(a, b, &mut c, parallel);
                    finish_rows(&c, n, out, finish);
                }
            }
        }
        return Some(());
    }
    match kernel {
        // SAFETY: the model runs anywhere; the shapes match.
        Bf16Kernel::TileModel => unsafe {
            tile_gemm::gemm(a, b, product, parallel, packed, TileModel::default)
        },
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Tiles => {
            let tiles = || Amx::new().expect("granted to the process (`runs_here`)");
            // SAFETY: the process may run the tiles (`runs_here`), on any of its threads;
            // the shapes match.
            unsafe { tile_gemm::gemm(a, b, product, parallel, packed, tiles) }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX512-F, AVX512-BW and AVX512-BF16 (`runs_here`); the shapes
        // match.
        Bf16Kernel::DotProducts => unsafe { x86::gemm(a, b, product, parallel, packed) },
        #[cfg(not(target_arch = "x86_64"))]
        Bf16Kernel::Tiles | Bf16Kernel::DotProducts => unreachable!("`runs_here` is false"),
    }
    Some(())
}

/// An `m × n` product of an empty sum (k = 0): zeros, finished as `product` says.
fn zero_product(product: Product, m: usize, n: usize) {
    match product {
        Product::F32(c) => c.fill(0.0),
        Product::Bf16 { out, finish } => finish_rows(&vec![0.0; m * n], n, out, finish),
    }
}

/// The product's buffer, shared by tasks that each write a block of their own.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write disjoint blocks.
unsafe impl Send for CPtr {}
// SAFETY: as above.
unsafe impl Sync for CPtr {}

/// Likewise for a product rounded to bf16.
#[derive(Clone, Copy)]
struct BPtr(*mut MaybeUninit<bf16>);
// SAFETY: as for `CPtr`.
unsafe impl Send for BPtr {}
// SAFETY: as above.
unsafe impl Sync for BPtr {}

/// Where a kernel's tasks put the product (see [`Product`]).
#[derive(Clone, Copy)]
enum Out<'a> {
    F32(CPtr),
    Bf16(BPtr, Finish<'a>),
}

impl<'a> Out<'a> {
    /// The product's buffer, to be shared by the tasks.
    fn of(product: Product<'a>) -> Self {
        match product {
            Product::F32(c) => Out::F32(CPtr(c.as_mut_ptr())),
            Product::Bf16 { out, finish } => Out::Bf16(BPtr(out.as_mut_ptr()), finish),
        }
    }
}

/// A kernel's tile at an edge of the product, summed in a local tile: `sum(local, width)` sums
/// a whole tile of `LEN / width` rows, `width` values each, in `local`, which stands in for
/// the `rows × cols` values at `corner` (rows `ld` apart) that lie in the product. They are
/// copied in first where `add` (an earlier k block wrote them; the first block's tile starts
/// from zero) and out after.
///
/// # Safety
///
/// `corner` holds `rows` rows of `cols` values, `ld` apart, with `rows ≤ LEN / width` and
/// `cols ≤ width`; `sum` writes no more than its whole tile at the pointer it is given.
#[inline(always)]
unsafe fn through_local<const LEN: usize>(
    corner: *mut f32,
    ld: usize,
    [rows, cols]: [usize; 2],
    width: usize,
    add: bool,
    sum: impl FnOnce(*mut f32, usize),
) {
    let mut local = [0f32; LEN];
    for r in (0..rows).filter(|_| add) {
        // SAFETY: row `r` has `cols` values at `corner` (the caller's promise).
        let row = unsafe { std::slice::from_raw_parts(corner.add(r * ld), cols) };
        local[r * width..][..cols].copy_from_slice(row);
    }
    sum(local.as_mut_ptr(), width);
    for r in 0..rows {
        // SAFETY: as above.
        let row = unsafe { std::slice::from_raw_parts_mut(corner.add(r * ld), cols) };
        row.copy_from_slice(&local[r * width..][..cols]);
    }
}

/// Finishes a task's block of a product rounded to bf16: the `rows × cols` sums of the block
/// at `(i0, j0)` of the `m × n` product, rows `ld` apart in `sums`, rounded into `out` as
/// `finish` lays them out, a run at a time.
///
/// # Safety
///
/// `sums` holds the block's `rows × cols` values, rows `ld` apart, inside the product; no
/// other thread writes their places in `out` (`Finish::runs` maps each value of the product
/// to one place of its own).
#[allow(clippy::too_many_arguments)]
unsafe fn finish_block(
    out: BPtr,
    finish: Finish,
    shape: [usize; 2],
    [i0, j0]: [usize; 2],
    [rows, cols]: [usize; 2],
    sums: *const f32,
    ld: usize,
) {
    for r in 0..rows {
        for (column, len, at) in finish.runs(shape, i0 + r, j0, cols) {
            // SAFETY: the caller's promises; the run's `len` values lie in the output from
            // `at`.
            let (sums, out) = unsafe {
                (
                    std::slice::from_raw_parts(sums.add(r * ld + column - j0), len),
                    std::slice::from_raw_parts_mut(out.0.add(at), len),
                )
            };
            finish_run(i0 + r, column, sums, out, finish);
        }
    }
}

/// The product's rows of `n` sums in `sums` into `out` as `finish` lays them out, by
/// [`finish_run`], a run of at most `RUN` values at a time.
fn finish_rows(sums: &[f32], n: usize, out: &mut [MaybeUninit<bf16>], finish: Finish) {
    let m = sums.len() / n.max(1);
    for (i, row) in sums.chunks(n.max(1)).enumerate() {
        for (column, len, at) in finish.runs([m, n], i, 0, n) {
            for start in (0..len).step_by(RUN) {
                let len = RUN.min(len - start);
                let sums = &row[column + start..][..len];
                finish_run(
                    i,
                    column + start,
                    sums,
                    &mut out[at + start..][..len],
                    finish,
                );
            }
        }
    }
}

/// The longest run [`finish_run`] takes.
const RUN: usize = 256;

/// A run of at most `RUN` sums of row `row` from `column`, rounded as `half` rounds and
/// finished as `finish` says, into `out` (as long), which may not be initialised yet.
fn finish_run(
    row: usize,
    column: usize,
    sums: &[f32],
    out: &mut [MaybeUninit<bf16>],
    finish: Finish,
) {
    match finish {
        Finish::Rows(epilogue) => {
            round_bf16_into(sums, out);
            if let Some(epilogue) = epilogue {
                // SAFETY: `round_bf16_into` wrote every value of `out`.
                epilogue(column, unsafe { &mut *(out as *mut [_] as *mut [bf16]) });
            }
        }
        Finish::Planes { bias: None, .. } => round_bf16_into(sums, out),
        Finish::Planes {
            bias: Some(bias), ..
        } => {
            let mut biased = [0f32; RUN];
            let biased = &mut biased[..sums.len()];
            biased
                .iter_mut()
                .zip(sums)
                .for_each(|(b, s)| *b = s + bias[row]);
            round_bf16_into(biased, out);
        }
    }
}

/// Scratch for a GEMM's two packed operands, kept by its caller between GEMMs. Not zeroed:
/// packing writes every word before the kernel reads it, and zeroing an 8 MiB panel buffer
/// afresh (larger than `SCRATCH_KEPT`, it goes back after each GEMM) took 1% of a step on the
/// calling thread alone.
pub type Packed = [Vec<MaybeUninit<u32>>; 2];

/// The largest scratch buffer kept between GEMMs, in bytes (8 MiB). Larger ones go back after
/// their GEMM: kept, they would sit beside the activations autocast halves (13 MiB of a 200 MiB
/// peak on `examples/autocast_memory`), and a GEMM that large costs enough that mapping its
/// buffers afresh is lost in it.
pub const SCRATCH_KEPT: usize = 8 << 20;

/// `f` of this thread's scratch in `key`, or of a fresh one where the thread's is in use: a
/// rayon worker waiting on its own GEMM's tasks may run another caller's job meanwhile, and
/// that job may be a GEMM or convolution too.
pub fn with_scratch<S: Default, R>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<S>>,
    f: impl FnOnce(&mut S) -> R,
) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch),
        Err(_) => f(&mut S::default()),
    })
}

/// Frees the scratch buffer `buf` if it holds more than 8 MiB (see `SCRATCH_KEPT`).
pub fn release_large<T>(buf: &mut Vec<T>) {
    if buf.capacity() * size_of::<T>() > SCRATCH_KEPT {
        *buf = Vec::new();
    }
}

/// The first `len` values of the scratch buffer `buf`, which grows (zeroed) only past its
/// longest use so far: callers write every value before they read it, and a GEMM's buffers
/// change size from call to call (zeroing what a shorter call had cut off showed as 3% of a
/// bf16 training step).
pub fn scratch_of<T: Copy + Default>(buf: &mut Vec<T>, len: usize) -> &mut [T] {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    &mut buf[..len]
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn matrix(values: &[f32]) -> Vec<bf16> {
        values.iter().map(|&v| bf16::from_f32(v)).collect()
    }

    // `a @ b` summed in f64 over the bf16 values, with the bound of an f32 sum of `k` terms:
    // `k · ε · Σ|a||b|` per element.
    pub(super) fn reference(a: &Bf16Matrix, b: &Bf16Matrix) -> Vec<(f64, f64)> {
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

    pub(super) fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 300.0 - 3.3)
            .collect()
    }

    // Shapes with edges on every side: a row panel, a column panel and a k block each partly
    // filled, an odd k, one that spans several tasks, one that spans several k blocks, and
    // products of 8-row tiles. The last three have k long enough for the inner-product kernel
    // where both operands run along it: a group of rows and of columns partly filled, k
    // shorter than one vector, several k blocks with a partial vector at the end.
    const SHAPES: [[usize; 3]; 11] = [
        [1, 1, 1],
        [13, 7, 33],
        [12, 256, 32],
        [50, 301, 300],
        [20, 1101, 70],
        // 8-row tiles: one task's rows, and two tasks'.
        [32, 29, 70],
        [64, 300, 40],
        [3, 2, 70],
        [5, 300, 7],
        [4, 17, 1],
        [9, 8200, 6],
    ];

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn products_are_f32_sums_of_exact_bf16_products_in_every_layout() {
        assert!(
            kernel().is_some(),
            "not run: this test needs a CPU with AVX512-BF16"
        );
        for [m, k, n] in SHAPES {
            let a = matrix(&values(2 * m * k + 1, 1));
            let b = matrix(&values(2 * k * n + 1, 2));
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
                // Every other value from an offset: neither dimension contiguous.
                (
                    Bf16Matrix::new(&a, 1, [m, k], [2 * k, 2]),
                    Bf16Matrix::new(&b, 1, [k, n], [2, 2 * k]),
                ),
                // A's rows and B's columns running along k, as in a convolution's weight
                // gradient (the inner-product kernel where k is long).
                (
                    Bf16Matrix::new(&a, 0, [m, k], [k, 1]),
                    Bf16Matrix::new(&b, 0, [k, n], [1, k]),
                ),
            ];
            for (a, b) in layouts {
                let (a, b) = (a.unwrap(), b.unwrap());
                let want = reference(&a, &b);
                for parallel in [false, true] {
                    let mut c = vec![f32::NAN; m * n];
                    gemm(
                        a,
                        b,
                        Product::F32(&mut c),
                        parallel,
                        &mut Default::default(),
                    )
                    .unwrap();
                    for (got, (sum, bound)) in c.iter().zip(&want) {
                        let err = (f64::from(*got) - sum).abs();
                        assert!(err <= *bound, "{m}×{k}×{n}: {got} against {sum} ± {bound}");
                    }
                }
            }
        }
    }

    // The f32 product of `a @ b` and the bf16 one, through `epilogue`.
    fn both_products(
        a: Bf16Matrix,
        b: Bf16Matrix,
        epilogue: Option<Epilogue>,
    ) -> (Vec<f32>, Vec<bf16>) {
        let len = a.rows * b.cols;
        let mut c = vec![f32::NAN; len];
        gemm(a, b, Product::F32(&mut c), true, &mut Default::default()).unwrap();
        let mut out = vec![MaybeUninit::new(bf16::NAN); len];
        let product = Product::Bf16 {
            out: &mut out,
            finish: Finish::Rows(epilogue),
        };
        gemm(a, b, product, true, &mut Default::default()).unwrap();
        // SAFETY: every value was initialised (with NaN) before the GEMM.
        (c, out.iter().map(|v| unsafe { v.assume_init() }).collect())
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn a_product_finished_as_planes_is_the_f32_product_biased_rounded_and_moved() {
        assert!(
            kernel().is_some(),
            "not run: this test needs a CPU with AVX512-BF16"
        );
        // `[m, k, positions, images]`: planes shorter than a task's columns, longer ones that
        // runs cross, one plane of one position; the next to last shape takes the
        // inner-product kernel; k = 0.
        for [m, k, positions, images] in [
            [16, 27, 100, 3],
            [8, 40, 300, 2],
            [13, 7, 1, 33],
            [5, 9000, 3, 2],
            [4, 0, 5, 2],
        ] {
            let n = positions * images;
            let a = matrix(&values(m * k + 1, 1));
            let b = matrix(&values(k * n + 1, 2));
            let a = Bf16Matrix::new(&a, 0, [m, k], [k, 1]).unwrap();
            let b = match k > 4 * m.max(n) {
                true => Bf16Matrix::new(&b, 0, [k, n], [1, k]),
                false => Bf16Matrix::new(&b, 0, [k, n], [n, 1]),
            }
            .unwrap();
            let bias: Vec<f32> = (0..m).map(|i| i as f32 * 0.37 - 1.1).collect();
            let mut c = vec![f32::NAN; m * n];
            gemm(a, b, Product::F32(&mut c), true, &mut Default::default()).unwrap();
            for bias in [None, Some(&bias[..])] {
                let mut out = vec![MaybeUninit::new(bf16::NAN); m * n];
                let finish = Finish::Planes { positions, bias };
                let product = Product::Bf16 {
                    out: &mut out,
                    finish,
                };
                gemm(a, b, product, true, &mut Default::default()).unwrap();
                for (i, row) in c.chunks(n).enumerate() {
                    for (j, sum) in row.iter().enumerate() {
                        let at = ((j / positions) * m + i) * positions + j % positions;
                        let want = bf16::from_f32(sum + bias.map_or(0.0, |b| b[i]));
                        // SAFETY: every value was initialised (with NaN) before the GEMM.
                        let got = unsafe { out[at].assume_init() };
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{m}×{k}×{positions}·{images}, bias {}, row {i} column {j}",
                            bias.is_some()
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn a_product_rounded_as_summed_is_the_f32_product_rounded() {
        assert!(
            kernel().is_some(),
            "not run: this test needs a CPU with AVX512-BF16"
        );
        // Each value's column as the epilogue is told it, for bits: every run lands where it
        // belongs.
        let column = |column: usize, values: &mut [bf16]| {
            for (t, v) in values.iter_mut().enumerate() {
                *v = bf16::from_bits((column + t) as u16);
            }
        };
        // Wider than a task's columns and taller than its rows, with edges, for both kernels
        // (the next to last shape takes the inner-product one), and k = 0.
        for [m, k, n] in [
            [13, 7, 33],
            [50, 301, 300],
            [100, 20, 600],
            [9, 8200, 6],
            [3, 0, 5],
        ] {
            let a = matrix(&values(m * k + 1, 1));
            let b = matrix(&values(k * n + 1, 2));
            let a = Bf16Matrix::new(&a, 0, [m, k], [k, 1]).unwrap();
            let b = Bf16Matrix::new(&b, 0, [k, n], [1, k]).unwrap();
            let (c, rounded) = both_products(a, b, None);
            for (i, (c, r)) in c.iter().zip(&rounded).enumerate() {
                assert_eq!(
                    r.to_bits(),
                    bf16::from_f32(*c).to_bits(),
                    "{m}×{k}×{n} at {i}"
                );
            }
            let (_, columns) = both_products(a, b, Some(&column));
            for (i, v) in columns.iter().enumerate() {
                assert_eq!(usize::from(v.to_bits()), i % n, "{m}×{k}×{n} at {i}");
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_inner_product_kernel_takes_long_contiguous_k_only() {
        let data = matrix(&values(2 * 9 * 8200 + 1, 1));
        let [m, k, n] = SHAPES[SHAPES.len() - 1];
        let a = Bf16Matrix::new(&data, 0, [m, k], [k, 1]).unwrap();
        let b = Bf16Matrix::new(&data, 0, [k, n], [1, k]).unwrap();
        assert!(dots::applies(&a, &b));
        let row_major_b = Bf16Matrix::new(&data, 0, [k, n], [n, 1]).unwrap();
        assert!(!dots::applies(&a, &row_major_b));
        let short = Bf16Matrix::new(&data, 0, [m, 30], [30, 1]).unwrap();
        let short_b = Bf16Matrix::new(&data, 0, [30, n], [1, 30]).unwrap();
        assert!(!dots::applies(&short, &short_b));
        // m past the kernel's widest side, however long k.
        let (m, k) = (513, 4 * 513);
        let data = vec![bf16::ONE; m * k];
        let wide = Bf16Matrix::new(&data, 0, [m, k], [k, 1]).unwrap();
        let column = Bf16Matrix::new(&data, 0, [k, 1], [1, k]).unwrap();
        assert!(!dots::applies(&wide, &column));
        let fewer = Bf16Matrix::new(&data, 0, [m - 1, k], [k, 1]).unwrap();
        assert!(dots::applies(&fewer, &column));
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn small_integer_products_are_exact() {
        assert!(
            kernel().is_some(),
            "not run: this test needs a CPU with AVX512-BF16"
        );
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
        gemm(a, b, Product::F32(&mut c), true, &mut Default::default()).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|t| av[i * k + t] * bv[t * n + j]).sum();
                assert_eq!(c[i * n + j], want, "({i}, {j})");
            }
        }
    }

    #[test]
    fn rows_that_share_l1_sets_are_told_apart_by_their_stride() {
        // 12 rows of k bf16 values: k = 384, 512, 1536 spread; 1024 (6 rows a set) and
        // 2048 (all 12 in one set) do not; a stride off the lines' grid drifts.
        let spread = |k: usize| rows_spread_over_l1(2 * k, 12);
        assert!(spread(384) && spread(512) && spread(1536) && spread(385) && spread(32));
        assert!(!spread(1024) && !spread(2048) && !spread(4096));
        // The tiles' 32 rows: k = 384 spreads, 1536 (8 rows a set) does not.
        assert!(rows_spread_over_l1(768, 32) && !rows_spread_over_l1(3072, 32));
    }

    #[test]
    fn scratch_in_use_gives_way_to_a_fresh_one() {
        thread_local! {
            static KEY: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::default();
        }
        let inner = with_scratch(&KEY, |outer| {
            outer.push(1);
            with_scratch(&KEY, |inner| inner.len())
        });
        assert_eq!(inner, 0);
        assert_eq!(with_scratch(&KEY, |kept| kept.len()), 1);
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
        assert!(gemm(a, a, Product::F32(&mut [0.0; 6]), false, packed).is_none());
        assert!(
            gemm(
                a,
                a.transposed(),
                Product::F32(&mut [0.0; 3]),
                false,
                packed
            )
            .is_none()
        );
        // A 3 × 3 product in planes its columns do not fill, in none at all, or with too
        // short a bias; the last, whole planes, is taken where the CPU runs the kernel.
        let b = a.transposed();
        let mut out = [MaybeUninit::new(bf16::ZERO); 9];
        let one = [1.0];
        for (positions, bias, taken) in [
            (2, None, false),
            (0, None, false),
            (3, Some(&one[..]), false),
            (3, None, kernel().is_some()),
        ] {
            let finish = Finish::Planes { positions, bias };
            let product = Product::Bf16 {
                out: &mut out,
                finish,
            };
            let done = gemm(b, a, product, false, packed).is_some();
            assert_eq!(done, taken, "{positions} {bias:?}");
        }
    }
}
