//! Dropout's masks (Bernoulli tensors) on Flex from a counter-based generator, on every core.
//!
//! Flex 0.21 draws a random tensor one value at a time from one ChaCha `StdRng` behind a
//! process-wide lock (`float_random` in `burn-flex-0.21.0/src/ops/float.rs`, through
//! `TensorData::random` and Burn's `DistributionSampler`), a half value as an f32 sample
//! rounded: a transformer's dropout masks took a fifth of a bf16 training step. A sequential
//! generator cannot be split over threads without making the values depend on the split.
//!
//! Here every value is a function of three numbers only: the key (the seed), the call's stream
//! number and the value's index in the tensor. The function is Philox4x32-10 (Salmon et al.,
//! "Parallel random numbers: as easy as 1, 2, 3", SC 2011; cuRAND's default generator, and
//! the one of PyTorch's CUDA backend and of TensorFlow's stateless ops), whose ten rounds of
//! 32-bit multiplies vectorise (AVX-512 registers of 16 counters here). The tensor is filled
//! in chunks on rayon's threads, each chunk computing its own values, so the values are the
//! same on any number of threads; they are written straight in the tensor's dtype.
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
//!
//! # Distributions
//!
//! With `w` a value's 32-bit word:
//!
//! - `Bernoulli(p)`: 1 where `w · 2⁻³² < p`, else 0, as Burn's sampler's `u < p` (`rand`'s
//!   `Bernoulli` compares 64 bits: here `p` counts in steps of 2⁻³², rounded up). A `p` above
//!   1 − 2⁻³² gives ones without drawing. Written as 1 or 0 in f32, bf16 or f16 directly.
//!
//! Every other distribution (`Uniform`, `Default`, `Normal`) is the backend's own, autocast or
//! not: Burn initialises a module's parameters lazily, at their first use, so a draw under
//! autocast can be a model's initial weights, and those must not depend on the precision a
//! run trains in. Flex's own generator also draws f64 and `Flex32` tensors, and a `p` Burn's
//! sampler rejects (outside `[0, 1]`), so that it fails exactly as Flex does.
//!
//! # Seeding
//!
//! [`seed`] (the decorator's `Backend::seed`) sets the key and restarts the streams at 0; each
//! tensor drawn takes the next stream number, so a run seeded the same way draws the same
//! tensors. Unseeded, the key is drawn from the OS once. The masks are not Flex's for the same
//! seed (another generator): the decorator uses this one for dropout's masks under autocast
//! only, where a run's values already differ from Flex's f32 run, and Flex's own with autocast
//! off.

use std::sync::{Mutex, PoisonError};

use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Bytes, DType};
use burn_backend::tensor::FloatTensor;
use burn_backend::{AutodiffBackend, Distribution, FloatDType, Shape};

use super::half_kernels::filled;

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
fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
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

fn counter(block: u64, stream: u64) -> [u32; 4] {
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

/// What a value is made of its word, decided once per call.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Sample {
    /// 1 where the word is below `threshold`, else 0.
    Bernoulli { threshold: u32 },
    /// Bernoulli of a `p` above 1 − 2⁻³²: ones, no word drawn.
    Ones,
}

/// The dtypes the generator writes: f32 and the half types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    F32,
    Bf16,
    F16,
}

/// How a call of `distribution` in `dtype` is drawn here, `None` for Flex's own (see the
/// [module docs](self)).
fn plan(distribution: Distribution, dtype: FloatDType) -> Option<(Sample, Out)> {
    let out = match dtype {
        FloatDType::F32 => Out::F32,
        FloatDType::BF16 => Out::Bf16,
        FloatDType::F16 => Out::F16,
        FloatDType::F64 | FloatDType::Flex32 => return None,
    };
    let sample = match distribution {
        // `w · 2⁻³² < p` for a whole `w` is `w < ⌈p · 2³²⌉` (the product is exact).
        Distribution::Bernoulli(p) if (0.0..=1.0).contains(&p) => {
            match (p * 4_294_967_296.0).ceil() {
                t if t >= 4_294_967_296.0 => Sample::Ones,
                t => Sample::Bernoulli {
                    threshold: t as u32,
                },
            }
        }
        // Parameters are initialised lazily: these must be the backend's own under autocast.
        Distribution::Bernoulli(_)
        | Distribution::Default
        | Distribution::Uniform(..)
        | Distribution::Normal(..) => return None,
    };
    Some((sample, out))
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
fn bernoulli<T>(len: usize, key: u64, stream: u64, threshold: u32, one: T) -> Vec<T>
where
    T: bytemuck::Pod + Send + Sync + From<bool> + core::ops::Mul<Output = T>,
{
    values(len, key, stream, |words, out: &mut [T]| {
        for (out, &w) in out.iter_mut().zip(words) {
            *out = T::from(w < threshold) * one;
        }
    })
}

/// The bits of 1 in each dtype.
const ONE_F32: u32 = 0x3F80_0000;
const ONE_BF16: u16 = 0x3F80;
const ONE_F16: u16 = 0x3C00;

/// A tensor of `shape` drawn as `sample` in `out` from stream `stream` under `key`.
fn draw(shape: &Shape, sample: Sample, out: Out, key: u64, stream: u64) -> FlexTensor {
    let len = shape.num_elements();
    let bytes = match (sample, out) {
        (Sample::Ones, Out::F32) => Bytes::from_elems(vec![ONE_F32; len]),
        (Sample::Ones, Out::Bf16) => Bytes::from_elems(vec![ONE_BF16; len]),
        (Sample::Ones, Out::F16) => Bytes::from_elems(vec![ONE_F16; len]),
        (Sample::Bernoulli { threshold }, Out::F32) => {
            Bytes::from_elems(bernoulli(len, key, stream, threshold, ONE_F32))
        }
        (Sample::Bernoulli { threshold }, Out::Bf16) => {
            Bytes::from_elems(bernoulli(len, key, stream, threshold, ONE_BF16))
        }
        (Sample::Bernoulli { threshold }, Out::F16) => {
            Bytes::from_elems(bernoulli(len, key, stream, threshold, ONE_F16))
        }
    };
    let dtype = match out {
        Out::F32 => DType::F32,
        Out::Bf16 => DType::BF16,
        Out::F16 => DType::F16,
    };
    FlexTensor::new(bytes, Layout::contiguous(shape.clone()), dtype)
}

/// The generator's state: the key and the next call's stream. One lock, not two atomics, so
/// that [`seed`] changes both at once for a call on another thread.
struct Streams {
    key: u64,
    next: u64,
}

static STREAMS: Mutex<Option<Streams>> = Mutex::new(None);

/// Restarts the generator at `seed`, stream 0 (the decorator's `Backend::seed`).
pub(crate) fn seed(seed: u64) {
    *STREAMS.lock().unwrap_or_else(PoisonError::into_inner) = Some(Streams { key: seed, next: 0 });
}

/// The key and a stream number of its own for one call; unseeded, a key from the OS.
fn take_stream() -> (u64, u64) {
    let mut streams = STREAMS.lock().unwrap_or_else(PoisonError::into_inner);
    let streams = streams.get_or_insert_with(|| Streams {
        key: unseeded_key(),
        next: 0,
    });
    let stream = streams.next;
    streams.next = stream.wrapping_add(1);
    (streams.key, stream)
}

// Where the OS has no random bytes, the clock and the process id still tell runs apart
// (reproducibility asks for `seed`, not for this).
fn unseeded_key() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let words = philox4x32_10(counter(nanos, u64::from(std::process::id())), [0, 0]);
        u64::from(words[0]) | (u64::from(words[1]) << 32)
    })
}

/// A random Flex tensor from the counter-based generator, taking the next stream; `None`
/// (and no stream taken) where Flex's own generator draws it (see the [module docs](self)).
pub(crate) fn random(
    shape: &Shape,
    distribution: Distribution,
    dtype: FloatDType,
) -> Option<FlexTensor> {
    let (sample, out) = plan(distribution, dtype)?;
    let (key, stream) = take_stream();
    Some(draw(shape, sample, out, key, stream))
}

/// [`random`] for `Autodiff<Flex>`: a leaf that requires no gradient, as Burn's autodiff
/// wraps its inner backend's random tensor.
pub(crate) fn random_tracked(
    shape: &Shape,
    distribution: Distribution,
    dtype: FloatDType,
) -> Option<FloatTensor<Autodiff<Flex>>> {
    random(shape, distribution, dtype).map(<Autodiff<Flex> as AutodiffBackend>::from_inner)
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    fn bits(t: FlexTensor) -> Vec<u8> {
        t.into_data().bytes.to_vec()
    }

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

    #[test]
    fn plans_follow_burns_sampler() {
        let bernoulli = |p| plan(Distribution::Bernoulli(p), FloatDType::BF16).map(|s| s.0);
        assert_eq!(bernoulli(0.0), Some(Sample::Bernoulli { threshold: 0 }));
        assert_eq!(
            bernoulli(0.5),
            Some(Sample::Bernoulli { threshold: 1 << 31 })
        );
        // Rounded up: `w · 2⁻³² < p` holds for w = 0 when p is tiny but positive.
        assert_eq!(bernoulli(1e-12), Some(Sample::Bernoulli { threshold: 1 }));
        assert_eq!(bernoulli(1.0), Some(Sample::Ones));
        assert_eq!(bernoulli(1.0 - 1e-12), Some(Sample::Ones));
        // What Burn's sampler rejects, and what is not drawn here, go to Flex's own:
        // every other distribution (a parameter's initial values among them), and f64.
        for rejected in [-0.1, 1.1, f64::NAN] {
            assert_eq!(bernoulli(rejected), None);
        }
        for dist in [
            Distribution::Default,
            Distribution::Uniform(-1.0, 1.0),
            Distribution::Normal(0.0, 1.0),
        ] {
            for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
                assert_eq!(plan(dist, dtype), None, "{dist:?} {dtype:?}");
            }
        }
        assert_eq!(plan(Distribution::Bernoulli(0.5), FloatDType::F64), None);
        assert_eq!(plan(Distribution::Bernoulli(0.5), FloatDType::Flex32), None);
    }

    #[test]
    fn values_are_written_in_the_dtype_asked_for() {
        assert_eq!(f32::from_bits(ONE_F32), 1.0);
        assert_eq!(bf16::from_bits(ONE_BF16), bf16::ONE);
        assert_eq!(f16::from_bits(ONE_F16), f16::ONE);
        let shape = Shape::new([3, 7]);
        for (dtype, one) in [
            (FloatDType::F32, ONE_F32.to_le_bytes().to_vec()),
            (FloatDType::BF16, ONE_BF16.to_le_bytes().to_vec()),
            (FloatDType::F16, ONE_F16.to_le_bytes().to_vec()),
        ] {
            let (sample, out) = plan(Distribution::Bernoulli(0.5), dtype).unwrap();
            let t = draw(&shape, sample, out, 1, 2);
            assert_eq!(t.dtype(), DType::from(dtype));
            assert_eq!(t.layout().shape(), &shape);
            let size = one.len();
            let bytes = bits(t);
            assert_eq!(bytes.len(), 21 * size);
            for v in bytes.chunks(size) {
                assert!(v == one.as_slice() || v.iter().all(|&b| b == 0), "{v:?}");
            }
        }
    }

    #[test]
    fn a_prefix_is_the_shorter_tensor() {
        let (sample, out) = plan(Distribution::Bernoulli(0.3), FloatDType::BF16).unwrap();
        let long = bits(draw(&Shape::new([200_003]), sample, out, 5, 6));
        for len in [1, 7, 17, 65, 70_000] {
            let short = bits(draw(&Shape::new([len]), sample, out, 5, 6));
            assert_eq!(short[..], long[..2 * len], "{len}");
        }
    }
}
