//! A software model of the AMX tile instructions the GEMM uses, for every CPU.
//!
//! `tdpbf16ps` as the Intel SDM's pseudo-code defines it: for each row `m` and column `n` of
//! `C`, the products of the even elements of each pair (`A[m][2k] · B[k][2n]`) are summed in
//! one f32 temporary and those of the odd elements in another, each starting from zero and
//! adding the tile's 16 pairs in k order by fused multiply-add; then the two temporaries are
//! added (`tmpf32 := temp1.fp32[2*n] + temp1.fp32[2*n+1]`) and their sum added to `C`
//! (`C[m][n] = C[m][n] + (even + odd)`). Every operation rounds to nearest even, treats
//! subnormal inputs as zero (bf16 operands, and `C`'s old value) and flushes subnormal
//! results to zero, keeping the sign, whatever MXCSR says. A bf16 product is exact in f32, so
//! the fused multiply-add rounds once, as the sum alone would.
//!
//! NaN payloads are the one thing left out: any NaN in, a NaN out, as on the hardware, but
//! not necessarily with the hardware's bits.

use super::{TILE_ROW_BYTES, TILE_ROWS, TILE_WORDS, Tiles};

/// Eight tiles of 16 × 16 32-bit words in memory, and the instructions on them done by the
/// arithmetic above. Slow (a library call per multiply-add where the CPU has no FMA): for
/// tests of the code that drives the tiles.
#[derive(Clone)]
pub struct TileModel {
    tiles: [[u32; TILE_ROWS * TILE_WORDS]; 8],
    configured: bool,
}

impl Default for TileModel {
    fn default() -> Self {
        Self {
            tiles: [[0; TILE_ROWS * TILE_WORDS]; 8],
            configured: false,
        }
    }
}

/// A bf16 value as f32, subnormals as zero of their sign (the instruction's DAZ).
pub fn widen_daz(bits: u16) -> f32 {
    let bits = match bits & 0x7F80 == 0 {
        true => bits & 0x8000,
        false => bits,
    };
    f32::from_bits(u32::from(bits) << 16)
}

/// `x`, or a zero of its sign where it is subnormal (FTZ, and DAZ on an input).
pub fn flush(x: f32) -> f32 {
    match x.is_subnormal() {
        true => f32::from_bits(x.to_bits() & 0x8000_0000),
        false => x,
    }
}

impl TileModel {
    fn tile(&mut self, t: u8) -> &mut [u32; TILE_ROWS * TILE_WORDS] {
        assert!(self.configured, "a tile instruction before `configure`");
        &mut self.tiles[usize::from(t)]
    }
}

impl Tiles for TileModel {
    unsafe fn configure(&mut self) {
        self.configured = true;
    }

    unsafe fn zero<const T: u8>(&mut self) {
        self.tile(T).fill(0);
    }

    unsafe fn load<const T: u8>(&mut self, at: *const u8, stride: usize) {
        let tile = self.tile(T);
        for (r, row) in tile.chunks_exact_mut(TILE_WORDS).enumerate() {
            let mut bytes = [0u8; TILE_ROW_BYTES];
            // SAFETY: the caller's promise: row `r` is readable at `at + r * stride`.
            unsafe {
                std::ptr::copy_nonoverlapping(at.add(r * stride), bytes.as_mut_ptr(), bytes.len())
            };
            for (word, bytes) in row.iter_mut().zip(bytes.chunks_exact(4)) {
                *word = u32::from_le_bytes(bytes.try_into().unwrap());
            }
        }
    }

    unsafe fn store<const T: u8>(&mut self, at: *mut u8, stride: usize) {
        let tile = self.tile(T);
        for (r, row) in tile.chunks_exact(TILE_WORDS).enumerate() {
            let mut bytes = [0u8; TILE_ROW_BYTES];
            for (word, bytes) in row.iter().zip(bytes.chunks_exact_mut(4)) {
                bytes.copy_from_slice(&word.to_le_bytes());
            }
            // SAFETY: the caller's promise: row `r` is writable at `at + r * stride`.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), at.add(r * stride), bytes.len())
            };
        }
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        let (a, b) = (*self.tile(A), *self.tile(B));
        let c = self.tile(C);
        for m in 0..TILE_ROWS {
            for n in 0..TILE_WORDS {
                let (mut even, mut odd) = (0f32, 0f32);
                for k in 0..TILE_WORDS {
                    let (a, b) = (a[m * TILE_WORDS + k], b[k * TILE_WORDS + n]);
                    let half =
                        |word: u32, high: bool| widen_daz((word >> (16 * high as u32)) as u16);
                    even = flush(half(a, false).mul_add(half(b, false), even));
                    odd = flush(half(a, true).mul_add(half(b, true), odd));
                }
                let sum = &mut c[m * TILE_WORDS + n];
                let old = flush(f32::from_bits(*sum));
                *sum = flush(old + flush(even + odd)).to_bits();
            }
        }
    }

    unsafe fn release(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn pair(lo: f32, hi: f32) -> u32 {
        u32::from(bf16::from_f32(lo).to_bits()) | u32::from(bf16::from_f32(hi).to_bits()) << 16
    }

    // Runs one `tdpbf16ps` on tiles given as words, C starting from `c`.
    fn dot(a: &[u32; 256], b: &[u32; 256], c: &[u32; 256]) -> [u32; 256] {
        let mut model = TileModel::default();
        let mut out = [0u32; 256];
        // SAFETY: configured first; each tile is 16 rows of 64 bytes, 64 bytes apart.
        unsafe {
            model.configure();
            model.load::<0>(c.as_ptr().cast(), 64);
            model.load::<1>(a.as_ptr().cast(), 64);
            model.load::<2>(b.as_ptr().cast(), 64);
            model.dot::<0, 1, 2>();
            model.store::<0>(out.as_mut_ptr().cast(), 64);
        }
        out
    }

    #[test]
    fn even_and_odd_products_are_summed_apart_and_their_sum_added_to_c() {
        // Row 0 of A: pair 0 = (2^24, 1), pair 1 = (-2^24, 1); column 0 of B: all ones.
        // Summed apart: even = 2^24 - 2^24 = 0, odd = 1 + 1 = 2, so C = (0 + 0) + 2 = 2. One
        // f32 sum in k order would round 2^24 + 1 to 2^24 and end at 1.
        let (mut a, mut b) = ([0u32; 256], [0u32; 256]);
        a[0] = pair(16_777_216.0, 1.0);
        a[1] = pair(-16_777_216.0, 1.0);
        b[0] = pair(1.0, 1.0);
        b[16] = pair(1.0, 1.0);
        let out = dot(&a, &b, &[0; 256]);
        assert_eq!(f32::from_bits(out[0]), 2.0);
        // The two sums meet first, then C (the SDM's `tmpf32 := temp1.fp32[2*n] +
        // temp1.fp32[2*n+1]`, then `C + tmpf32`): with C = 2^24, even = 1 and odd = 2, even +
        // odd = 3 and 2^24 + 3 rounds to 2^24 + 4 (a tie, to even). C taking the even sum
        // first would round 2^24 + 1 to 2^24, then add 2 exactly: 2^24 + 2.
        let mut c = [0u32; 256];
        c[0] = 16_777_216f32.to_bits();
        a[0] = pair(1.0, 1.0);
        a[1] = pair(0.0, 1.0);
        let out = dot(&a, &b, &c);
        assert_eq!(f32::from_bits(out[0]), 16_777_216.0 + 4.0);
        // Rows and columns land where the pseudo-code puts them: C[m][n] reads A's row m and
        // B's column n only.
        let (mut a, mut b) = ([0u32; 256], [0u32; 256]);
        a[3 * 16 + 5] = pair(3.0, 0.0);
        b[5 * 16 + 7] = pair(5.0, 0.0);
        let out = dot(&a, &b, &[0; 256]);
        for (at, word) in out.iter().enumerate() {
            let want = if at == 3 * 16 + 7 { 15.0 } else { 0.0 };
            assert_eq!(f32::from_bits(*word), want, "at {at}");
        }
    }

    #[test]
    fn subnormal_inputs_count_as_zero_and_subnormal_results_are_flushed() {
        let (mut a, mut b) = ([0u32; 256], [0u32; 256]);
        // The smallest positive bf16 subnormal times 2^100: zero under DAZ.
        a[0] = 1;
        b[0] = u32::from(bf16::from_f32(2f32.powi(100)).to_bits());
        assert_eq!(dot(&a, &b, &[0; 256])[0], 0);
        // 2^-70 · 2^-70 = 2^-140, subnormal in f32 (bits 0x200): flushed to zero.
        a[0] = pair(2f32.powi(-70), 0.0);
        b[0] = pair(2f32.powi(-70), 0.0);
        assert_eq!(dot(&a, &b, &[0; 256])[0], 0);
        // A sum that ends subnormal is flushed too: 1.5 · 2^-126 in C, minus 2^-126.
        let mut c = [0u32; 256];
        c[0] = (1.5 * 2f32.powi(-126)).to_bits();
        a[0] = pair(-(2f32.powi(-63)), 0.0);
        b[0] = pair(2f32.powi(-63), 0.0);
        assert_eq!(dot(&a, &b, &c)[0], 0);
        // The two sums' sum is flushed before it meets C: even = 2^-125 and odd =
        // -1.75 · 2^-126 are normal, their sum 2^-128 is not, so C = 2^-126 stays 2^-126
        // (unflushed, or added to C one sum at a time, it would end at 1.25 · 2^-126).
        let (mut a, mut b) = ([0u32; 256], [0u32; 256]);
        let mut c = [0u32; 256];
        c[0] = 2f32.powi(-126).to_bits();
        a[0] = pair(2f32.powi(-62), -1.75 * 2f32.powi(-63));
        b[0] = pair(2f32.powi(-63), 2f32.powi(-63));
        assert_eq!(f32::from_bits(dot(&a, &b, &c)[0]), 2f32.powi(-126));
        // A subnormal C counts as zero.
        let mut c = [0u32; 256];
        c[0] = 1;
        a[0] = pair(1.0, 0.0);
        b[0] = pair(1.0, 0.0);
        assert_eq!(f32::from_bits(dot(&a, &b, &c)[0]), 1.0);
    }

    #[test]
    #[should_panic(expected = "before `configure`")]
    fn an_instruction_before_configuration_faults() {
        let mut model = TileModel::default();
        // SAFETY: the model checks configuration itself (and panics, as the hardware faults).
        unsafe { model.zero::<0>() };
    }
}
