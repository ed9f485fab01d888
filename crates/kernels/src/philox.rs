//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011;
//! cuRAND's default generator, and the one of PyTorch's CUDA backend and of TensorFlow's
//! stateless ops) on every core: the words of the root crate's dropout masks
//! (`src/cpu/counter_rng.rs`, which says why and when they are drawn here).
//!
//! Every value is a function of three numbers only: the key (the seed), the call's stream
//! number and the value's index. Philox's ten rounds of 32-bit multiplies vectorise (AVX-512
//! registers of 16 counters here). A buffer is filled in chunks on rayon's threads, each chunk
//! computing its own values, so the values are the same on any number of threads.
//!
//! # Stream layout
//!
//! Value `i` of the call with stream `s` under key `k` (the seed) is word `i % 4` of
//! `Philox4x32-10(counter, key)` with
//!
//! - `key = [k as u32, (k >> 32) as u32]`,
//! - `counter = [b as u32, (b >> 32) as u32, s as u32, (s >> 32) as u32]`, `b = i / 4`,
//!
//! so one counter gives four consecutive values, and the streams of two calls never share a
//! counter. The tests pin this layout, and Random123's published answers pin Philox itself.

use crate::half::filled;

/// Philox's multipliers and key increments (Random123's `PHILOX_M4x32_*`, `PHILOX_W32_*`).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;
const ROUNDS: usize = 10;

/// Counters computed side by side, as lanes of vectors: two AVX-512 registers of 16, so that
/// one's multiplies run while the other's wait for theirs (a round is a chain of dependent
/// instructions: one register alone left the multiplier idle most of the time).
const LANES: usize = 32;

/// Words drawn at once into a stack buffer before they become values (L1-sized).
const CHUNK: usize = 256;

#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let product = u64::from(a) * u64::from(b);
    ((product >> 32) as u32, product as u32)
}

/// Philox4x32-10 of `counter` under `key`: four 32-bit words.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for _ in 0..ROUNDS {
        let (hi0, lo0) = mulhilo(M0, c0);
        let (hi1, lo1) = mulhilo(M1, c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
    }
    [c0, c1, c2, c3]
}

fn key_words(key: u64) -> [u32; 2] {
    [key as u32, (key >> 32) as u32]
}

/// The counter of block `block` (values `4 · block..4 · block + 4`) of stream `stream`.
pub fn counter(block: u64, stream: u64) -> [u32; 4] {
    [
        block as u32,
        (block >> 32) as u32,
        stream as u32,
        (stream >> 32) as u32,
    ]
}

/// The words of `LANES` consecutive counters from `block` (`4 · LANES` values), the lanes
/// side by side so that each round is a few vector instructions.
#[inline(always)]
fn philox_lanes(key: [u32; 2], block: u64, stream: u64, out: &mut [u32]) {
    let (mut c0, mut c1) = ([0u32; LANES], [0u32; LANES]);
    for (lane, (c0, c1)) in c0.iter_mut().zip(&mut c1).enumerate() {
        let b = block.wrapping_add(lane as u64);
        (*c0, *c1) = (b as u32, (b >> 32) as u32);
    }
    let mut c2 = [stream as u32; LANES];
    let mut c3 = [(stream >> 32) as u32; LANES];
    let [mut k0, mut k1] = key;
    for _ in 0..ROUNDS {
        for lane in 0..LANES {
            let (hi0, lo0) = mulhilo(M0, c0[lane]);
            let (hi1, lo1) = mulhilo(M1, c2[lane]);
            (c0[lane], c1[lane], c2[lane], c3[lane]) =
                (hi1 ^ c1[lane] ^ k0, lo1, hi0 ^ c3[lane] ^ k1, lo0);
        }
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
    }
    for (lane, out) in out.chunks_exact_mut(4).take(LANES).enumerate() {
        out.copy_from_slice(&[c0[lane], c1[lane], c2[lane], c3[lane]]);
    }
}

/// The words of values `start..start + out.len()` of stream `stream` under `key`, `lanes`
/// computing those of `LANES` whole counters at a time (`4 · LANES` words).
#[inline(always)]
fn words_by(
    key: u64,
    stream: u64,
    start: u64,
    out: &mut [u32],
    lanes: &impl Fn([u32; 2], u64, u64, &mut [u32]),
) {
    let key = key_words(key);
    let mut done = 0;
    while done < out.len() {
        let index = start + done as u64;
        let (block, skip) = (index / 4, (index % 4) as usize);
        let left = out.len() - done;
        if skip == 0 && left >= 4 * LANES {
            lanes(key, block, stream, &mut out[done..][..4 * LANES]);
            done += 4 * LANES;
            continue;
        }
        // A counter the tensor starts or ends inside of.
        let words = philox4x32_10(counter(block, stream), key);
        let take = (4 - skip).min(left);
        out[done..][..take].copy_from_slice(&words[skip..][..take]);
        done += take;
    }
}

/// Values `start..start + out.len()` of stream `stream` under `key`: their words drawn by
/// `lanes` a chunk at a time into a buffer on the stack, made values by `make`.
#[inline(always)]
fn fill_by<T, F: Fn(&[u32], &mut [T])>(
    key: u64,
    stream: u64,
    start: u64,
    out: &mut [T],
    make: &F,
    lanes: &impl Fn([u32; 2], u64, u64, &mut [u32]),
) {
    let mut buf = [0u32; CHUNK];
    for (i, out) in out.chunks_mut(CHUNK).enumerate() {
        let buf = &mut buf[..out.len()];
        words_by(key, stream, start + (i * CHUNK) as u64, buf, lanes);
        make(buf, out);
    }
}

/// [`fill_by`] on the widest vectors this CPU has, `make` compiled for them too: the crate is
/// built for baseline x86-64, whose SSE2 multiplies two 32-bit lanes at a time.
fn fill<T, F: Fn(&[u32], &mut [T])>(key: u64, stream: u64, start: u64, out: &mut [T], make: &F) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX512-F (checked just above).
            return unsafe { x86::fill_avx512(key, stream, start, out, make) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { x86::fill_avx2(key, stream, start, out, make) };
        }
    }
    fill_by(key, stream, start, out, make, &philox_lanes)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{LANES, M0, M1, ROUNDS, W0, W1};

    /// # Safety
    /// The CPU must have AVX512-F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fill_avx512<T, F: Fn(&[u32], &mut [T])>(
        key: u64,
        stream: u64,
        start: u64,
        out: &mut [T],
        make: &F,
    ) {
        let lanes = |key, block, stream, out: &mut [u32]| {
            // SAFETY: the CPU has AVX512-F (this function's contract); `out` holds the
            // words of `LANES` counters (`words_by`).
            unsafe { philox_registers(key, block, stream, out) }
        };
        super::fill_by(key, stream, start, out, make, &lanes)
    }

    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fill_avx2<T, F: Fn(&[u32], &mut [T])>(
        key: u64,
        stream: u64,
        start: u64,
        out: &mut [T],
        make: &F,
    ) {
        super::fill_by(key, stream, start, out, make, &super::philox_lanes)
    }

    // 16 products `a · m` of 32-bit lanes: (high halves, low halves). The multiply takes the
    // even lanes, so the odd ones go through it shifted down and come back blended in.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn mulhilo(a: __m512i, m: __m512i) -> (__m512i, __m512i) {
        const ODD: __mmask16 = 0xAAAA;
        let even = _mm512_mul_epu32(a, m);
        let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(a), m);
        let hi = _mm512_mask_blend_epi32(ODD, _mm512_srli_epi64::<32>(even), odd);
        let lo = _mm512_mask_blend_epi32(ODD, even, _mm512_slli_epi64::<32>(odd));
        (hi, lo)
    }

    /// `super::philox_lanes` in AVX-512 registers: each of a counter's four words in a
    /// register per 16 counters, then transposed so that each counter's words lie together,
    /// in counter order.
    ///
    /// # Safety
    /// The CPU must have AVX512-F; `out` holds `4 · LANES` words.
    #[target_feature(enable = "avx512f")]
    unsafe fn philox_registers(key: [u32; 2], block: u64, stream: u64, out: &mut [u32]) {
        const REGISTERS: usize = LANES / 16;
        assert!(out.len() >= 4 * LANES);
        let lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        let (mut c0, mut c1) = (
            [_mm512_setzero_si512(); REGISTERS],
            [_mm512_setzero_si512(); REGISTERS],
        );
        for r in 0..REGISTERS {
            // The counters' low words, with the carry into the high ones lane by lane.
            let first = block.wrapping_add(16 * r as u64);
            let low = _mm512_set1_epi32(first as u32 as i32);
            c0[r] = _mm512_add_epi32(low, lane);
            let carry = _mm512_cmplt_epu32_mask(c0[r], low);
            let high = _mm512_set1_epi32((first >> 32) as u32 as i32);
            c1[r] = _mm512_mask_add_epi32(high, carry, high, _mm512_set1_epi32(1));
        }
        let mut c2 = [_mm512_set1_epi32(stream as u32 as i32); REGISTERS];
        let mut c3 = [_mm512_set1_epi32((stream >> 32) as u32 as i32); REGISTERS];
        let (m0, m1) = (_mm512_set1_epi32(M0 as i32), _mm512_set1_epi32(M1 as i32));
        let [mut k0, mut k1] = key;
        for _ in 0..ROUNDS {
            let k0v = _mm512_set1_epi32(k0 as i32);
            let k1v = _mm512_set1_epi32(k1 as i32);
            for r in 0..REGISTERS {
                let (hi0, lo0) = mulhilo(c0[r], m0);
                let (hi1, lo1) = mulhilo(c2[r], m1);
                // 0x96: a ^ b ^ c.
                (c0[r], c1[r], c2[r], c3[r]) = (
                    _mm512_ternarylogic_epi32::<0x96>(hi1, c1[r], k0v),
                    lo1,
                    _mm512_ternarylogic_epi32::<0x96>(hi0, c3[r], k1v),
                    lo0,
                );
            }
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        for (r, out) in out.chunks_exact_mut(64).take(REGISTERS).enumerate() {
            transpose_store(c0[r], c1[r], c2[r], c3[r], out);
        }
    }

    /// Word j of counter l (lane l of register j) to `out[4l + j]`: 32-bit then 64-bit
    /// interleaves put counters 4q + r in 128-bit lane q of register r, then a 4 × 4
    /// transpose of 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose_store(c0: __m512i, c1: __m512i, c2: __m512i, c3: __m512i, out: &mut [u32]) {
        let (t0, t1) = (_mm512_unpacklo_epi32(c0, c1), _mm512_unpackhi_epi32(c0, c1));
        let (t2, t3) = (_mm512_unpacklo_epi32(c2, c3), _mm512_unpackhi_epi32(c2, c3));
        let (u0, u1) = (_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2));
        let (u2, u3) = (_mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3));
        let v0 = _mm512_shuffle_i64x2::<0b01_00_01_00>(u0, u1);
        let v1 = _mm512_shuffle_i64x2::<0b01_00_01_00>(u2, u3);
        let v2 = _mm512_shuffle_i64x2::<0b11_10_11_10>(u0, u1);
        let v3 = _mm512_shuffle_i64x2::<0b11_10_11_10>(u2, u3);
        let rows = [
            _mm512_shuffle_i64x2::<0b10_00_10_00>(v0, v1),
            _mm512_shuffle_i64x2::<0b11_01_11_01>(v0, v1),
            _mm512_shuffle_i64x2::<0b10_00_10_00>(v2, v3),
            _mm512_shuffle_i64x2::<0b11_01_11_01>(v2, v3),
        ];
        for (row, out) in rows.into_iter().zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 words written, in bounds (`chunks_exact_mut`).
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), row) };
        }
    }
}

/// `len` values of stream `stream` under `key`, each made of its word by `make`, in tasks on
/// rayon's threads where they are large (the values do not depend on the split).
fn values<T: bytemuck::Pod + Send>(
    len: usize,
    key: u64,
    stream: u64,
    make: impl Fn(&[u32], &mut [T]) + Sync,
) -> Vec<T> {
    filled(len, |start, block: &mut [T]| {
        fill(key, stream, start as u64, block, &make)
    })
}

/// `len` values of Bernoulli: the bits `one` where the word is below `threshold`, else 0. As
/// a product, which vectorises, where a choice between two values of a generic type
/// compiled to a load through a pointer per value.
pub fn bernoulli<T>(len: usize, key: u64, stream: u64, threshold: u32, one: T) -> Vec<T>
where
    T: bytemuck::Pod + Send + Sync + From<bool> + core::ops::Mul<Output = T>,
{
    values(len, key, stream, |words, out: &mut [T]| {
        for (out, &w) in out.iter_mut().zip(words) {
            *out = T::from(w < threshold) * one;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(words: &[u32], out: &mut [u32]) {
        out.copy_from_slice(words);
    }

    // The words as the kernels draw them, on the CPU's widest path.
    fn words(key: u64, stream: u64, start: u64, out: &mut [u32]) {
        fill(key, stream, start, out, &copy);
    }

    #[test]
    fn philox_gives_random123s_known_answers() {
        // Random123's `kat_vectors` for philox4x32_10: counter, key, answer.
        let cases = [
            (
                [0; 4],
                [0; 2],
                [0x6627_E8D5, 0xE169_C58D, 0xBC57_AC4C, 0x9B00_DBD8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408F_276D, 0x41C8_3B0E, 0xA20B_C7C6, 0x6D54_51FD],
            ),
            (
                [0x243F_6A88, 0x85A3_08D3, 0x1319_8A2E, 0x0370_7344],
                [0xA409_3822, 0x299F_31D0],
                [0xD16C_FE09, 0x94FD_CCEB, 0x5001_E420, 0x2412_6EA1],
            ),
        ];
        for (ctr, key, answer) in cases {
            assert_eq!(philox4x32_10(ctr, key), answer, "{ctr:x?} {key:x?}");
        }
    }

    #[test]
    fn the_stream_layout_is_pinned() {
        // Value i of stream s under key k: word i % 4 of Philox(counter [i/4, 0, s, 0] as
        // 32-bit halves, key [k low, k high]).
        let (key, stream) = (0x0123_4567_89AB_CDEF_u64, 0x0000_0002_0000_0005_u64);
        let mut got = [0u32; 6];
        words(key, stream, (1 << 34) + 2, &mut got);
        let block = |b: u64| philox4x32_10([b as u32, 1, 5, 2], [0x89AB_CDEF, 0x0123_4567]);
        let (first, second) = (block(1 << 32), block((1 << 32) + 1));
        assert_eq!(got[..2], first[2..]);
        assert_eq!(got[2..], second[..]);
        // And fixed numbers, so that a change to Philox's code or to the layout shows.
        let mut seed_7 = [0u32; 6];
        words(7, 3, 0, &mut seed_7);
        assert_eq!(seed_7, PINNED, "{:#010x?}", seed_7);
    }

    // The first six words of key 7, stream 3 (checked against an independent Python Philox).
    const PINNED: [u32; 6] = [
        0x97B3_56D9,
        0x1FB0_3C42,
        0x29A7_96E8,
        0x998B_4610,
        0x965F_7ECE,
        0x75BA_33D8,
    ];

    #[test]
    fn every_split_and_every_path_gives_the_scalar_words() {
        let (key, stream) = (42, 9);
        let reference = |start: u64, len: usize| -> Vec<u32> {
            (start..start + len as u64)
                .map(|i| philox4x32_10(counter(i / 4, stream), key_words(key))[(i % 4) as usize])
                .collect()
        };
        // The last: counters whose low word wraps to 0 among the lanes of one register.
        let wrap = (u64::from(u32::MAX) - 5) * 4;
        for (start, len) in [
            (0, 1),
            (0, 7),
            (3, 17),
            (1, 64),
            (2, 200),
            (0, 128),
            (4, 131),
            (0, 256),
            (5, 1000),
            (wrap, 300),
        ] {
            let want = reference(start, len);
            let mut got = vec![0u32; len];
            words(key, stream, start, &mut got);
            assert_eq!(got, want, "start {start}, len {len}");
            let mut got = vec![0u32; len];
            fill_by(key, stream, start, &mut got, &copy, &philox_lanes);
            assert_eq!(got, want, "start {start}, len {len}, portable");
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                let mut got = vec![0u32; len];
                // SAFETY: the CPU has AVX2 (checked just above).
                unsafe { x86::fill_avx2(key, stream, start, &mut got, &copy) };
                assert_eq!(got, want, "start {start}, len {len}, AVX2");
            }
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512f") {
                let mut got = vec![0u32; len];
                // SAFETY: the CPU has AVX512-F (checked just above).
                unsafe { x86::fill_avx512(key, stream, start, &mut got, &copy) };
                assert_eq!(got, want, "start {start}, len {len}, AVX-512");
            }
        }
    }
}
