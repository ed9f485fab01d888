//! Dropout's masks (Bernoulli tensors) on Flex from a counter-based generator, on every core.
//!
//! Flex 0.21 draws a random tensor one value at a time from one ChaCha `StdRng` behind a
//! process-wide lock (`float_random` in `burn-flex-0.21.0/src/ops/float.rs`, through
//! `TensorData::random` and Burn's `DistributionSampler`), a half value as an f32 sample
//! rounded: a transformer's dropout masks took a fifth of a bf16 training step. A sequential
//! generator cannot be split over threads without making the values depend on the split.
//!
//! Here every value is a function of three numbers only: the key (the seed), the call's stream
//! number and the value's index in the tensor: Philox4x32-10 on every core
//! (`burn_accelerate_kernels::philox`, whose docs give the stream layout, and whose tests pin
//! it), so the values are the same on any number of threads; they are written straight in the
//! tensor's dtype.
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
use burn_accelerate_kernels::philox::{bernoulli, counter, philox4x32_10};
use burn_backend::tensor::FloatTensor;
use burn_backend::{AutodiffBackend, Distribution, FloatDType, Shape};

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
