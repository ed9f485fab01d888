//! The tile instructions the AMX GEMM ([`super::tile_gemm`]) is written against, and the two
//! machines that run them: the CPU's own ([`amx::Amx`], Intel AMX-BF16) and a software model
//! of the same instructions ([`model::TileModel`]) that runs on any CPU.
//!
//! The GEMM's blocking, packing and edges are one piece of code generic over [`Tiles`]: where
//! the CPU has no AMX, its tests run that code on the model, which follows the instructions'
//! documented arithmetic (Intel SDM, `TDPBF16PS`) bit for bit, so a bug in the index
//! arithmetic shows on every machine, and the model's fidelity is checked against the
//! hardware where there is one (`tile_gemm`'s tests with `--ignored`).
//!
//! Only what the GEMM needs is modelled: palette 1 with every tile configured as
//! [`TILE_ROWS`] rows of [`TILE_ROW_BYTES`] bytes, and `tilezero`, `tileloadd`, `tilestored`,
//! `tdpbf16ps`, `tilerelease`.

pub mod amx;
pub mod model;

/// Rows of every tile as the GEMM configures them (the most palette 1 allows).
pub const TILE_ROWS: usize = 16;
/// Bytes of each tile row (the most palette 1 allows): 16 f32 sums, or 16 pairs of bf16.
pub const TILE_ROW_BYTES: usize = 64;
/// 32-bit words in a tile row: f32 sums of a product tile, bf16 pairs of an operand tile.
pub const TILE_WORDS: usize = TILE_ROW_BYTES / 4;

/// The tile registers and the instructions on them. A tile is named by its register number
/// (`0..8`), a const parameter as in the instructions' encoding.
///
/// # Safety
///
/// Every method but `configure` needs `configure` to have run on this thread since the last
/// `release` (the hardware faults otherwise). Loads and stores touch [`TILE_ROWS`] rows of
/// [`TILE_ROW_BYTES`] bytes, `stride` bytes apart from `at`: the caller promises they are
/// readable (writable for a store).
pub trait Tiles {
    /// Configures the tiles: palette 1, all 8 as [`TILE_ROWS`] × [`TILE_ROW_BYTES`] (`ldtilecfg`).
    unsafe fn configure(&mut self);
    /// Sets every byte of tile `T` to zero (`tilezero`).
    unsafe fn zero<const T: u8>(&mut self);
    /// Loads tile `T`'s rows from `at`, `stride` bytes apart (`tileloadd`).
    unsafe fn load<const T: u8>(&mut self, at: *const u8, stride: usize);
    /// Stores tile `T`'s rows at `at`, `stride` bytes apart (`tilestored`).
    unsafe fn store<const T: u8>(&mut self, at: *mut u8, stride: usize);
    /// `C += A · B` on tiles of bf16 pairs (`tdpbf16ps`): row `m` of `A` holds 16 pairs along
    /// k, row `p` of `B` holds pair `p` for each of 16 columns, and `C` 16 × 16 f32 sums.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self);
    /// Returns the tiles to their initial state (`tilerelease`), so that the thread's saved
    /// state on a context switch shrinks back.
    unsafe fn release(&mut self);
}

/// The 64-byte operand of `ldtilecfg` that [`Tiles::configure`] loads: palette 1, no restart
/// row, each of the 8 tiles [`TILE_ROWS`] rows of [`TILE_ROW_BYTES`] bytes.
pub fn configuration() -> [u8; 64] {
    let mut config = [0u8; 64];
    config[0] = 1;
    for tile in 0..8 {
        config[16 + 2 * tile..][..2].copy_from_slice(&(TILE_ROW_BYTES as u16).to_le_bytes());
        config[48 + tile] = TILE_ROWS as u8;
    }
    config
}
