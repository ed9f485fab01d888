//! GELU (Burn's exact form, `x · Φ(x)` with `Φ(x) = (1 + erf(x / √2)) / 2`) of f32, bf16 and
//! f16 values, vectorised and on every core, and its derivative.
//!
//! Flex 0.21 computes GELU one value at a time with libm's scalar `erff`, each bf16 or f16
//! value widened and rounded alone (`gelu` in `burn-flex-0.21.0/src/ops/activation.rs`), and
//! its backward likewise with `erff` and `expf`. A transformer's feed-forward activation
//! (`[batch, seq, 4 · d_model]`) spent a large share of a bf16 step there. Here a block of
//! values is widened in one vectorised conversion, `Φ` computed on vectors, the block rounded
//! once to the input's dtype (nearest even, as the crate's conversions round). The backward
//! (from the input) computes Flex's exact derivative, `g · (Φ(x) + x · φ(x))` with
//! `φ(x) = e^(-x²/2) / √(2π)`, in one pass (Burn's trait default `gelu_backward` is the
//! derivative of the tanh approximation, but Flex, and so `Autodiff<Flex>`, overrides it with
//! the exact one).
//!
//! # How Φ is computed
//!
//! - `|x| < 0.75`: `Φ(x) = 1/2 + x · A(x²)`, `A` a minimax polynomial of degree 4 (relative
//!   error 2.4e-9).
//! - `|x| ≥ 0.75`: the tail `Φ(-|x|) = e^(-x²/2) / (√(2π) · |x| + B(t))` with
//!   `t = 1 / (1 + |x|/4)` and `B` a minimax polynomial of degree 9 in `t` (relative error of
//!   the denominator 4.2e-9; `B(t) = √(2π) · (1/m - |x|)`, `m` Mills' ratio), and
//!   `Φ(x) = 1 - Φ(-x)` for positive `x`. `x²` is carried exactly (its rounding error from a
//!   fused multiply-add) into [`exp_scaled`]: the rounding of `x²` alone would cost
//!   `x² · 2⁻²⁴` of relative error, 40 ulp at `x = -13`.
//!
//! No `1 + erf` is ever formed, so the left tail keeps its relative accuracy where Flex's
//! `1 + erff(x/√2)` cancels (Flex's GELU is off by 10% at `x = -5` and is `-0` from -5.8 on;
//! here it is exact to a few ulp down to the underflow of `x · Φ(x)` near -13.4).
//!
//! # Accuracy
//!
//! Against f64 (tested on dense sweeps): `Φ` within 3 ulp and f32 GELU within 4 ulp (of the
//! result where it is a normal f32, within 4 · 2⁻¹⁴⁹ below); the backward's factor
//! `Φ(x) + x · φ(x)` within 4 ulp of the larger of its two terms (it crosses zero at
//! x ≈ -0.75, where no f32 formula keeps relative accuracy). A bf16 or f16 result is the
//! exact value rounded to the dtype but for values within a few f32 ulp of a rounding tie:
//! within one ulp of the dtype. At the infinities GELU and its derivative take their limits
//! (`gelu(+∞) = +∞`, `gelu(-∞) = -0`, slopes 1 and 0) where Flex's formula gives NaN at
//! `-∞` (and for the slope at both); NaN gives NaN.
//!
//! The code is compiled for AVX-512, AVX2 and the baseline target as the softmax kernels are
//! (see [`Isa`]), the same bits on each path and on any number of threads. The root crate's
//! `src/cpu/gelu.rs` takes Flex's f32, bf16 and f16 tensors whose values lie contiguous here,
//! with its autodiff node.

use half::{bf16, f16};

use crate::exp::exp_scaled;
use crate::half::{Half, filled, in_row_tasks};
use crate::isa::{Isa, isa_variants};

/// Where `Φ` switches from the series-like polynomial to the tail formula.
const NEAR: f32 = 0.75;
/// `(Φ(x) - 1/2) / x ≈ A(x²)` on `|x| < NEAR`, lowest degree first.
const A: [f32; 5] = [
    0.398_942_3,
    -0.066_490_29,
    0.009_972_349,
    -0.001_181_285_1,
    1.029_406e-4,
];
/// `√(2π) · (1/m(u) - u) ≈ B(t - T_MID)` for `u = |x|` in `[NEAR, CLAMP]`,
/// `t = 1 / (1 + u/4)`, `m` Mills' ratio `Φ(-u) / φ(u)`; lowest degree first.
const B: [f32; 10] = [
    0.573_761_4,
    1.889_326_6,
    1.996_379,
    0.819_994_1,
    -1.070_766_4,
    -1.726_974_1,
    0.068_617_51,
    2.164_835_5,
    0.691_481,
    -1.931_887_7,
];
/// The middle of `t`'s range, `(1/6 + 1/1.1875) / 2` in f32.
const T_MID: f32 = 0.504_385_95;
/// Past ±20, `Φ` is 0 or 1 and `φ` 0 in f32: arguments are clamped there, which keeps
/// `x²` finite and `t` in the polynomial's range.
const CLAMP: f32 = 20.0;
const SQRT_2PI: f32 = 2.506_628_3;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `e^(-x²/2)`, and so the tails, carried scaled by 2⁶⁴ until the last product: near
/// `x = ±13.2`, where `x · Φ(x)` and `x · φ(x)` are still normal f32 values, `e^(-x²/2)` and
/// `Φ(x)` alone are subnormal and would have lost their last bits.
const SCALE: i32 = 64;
/// 2⁻⁶⁴.
const UNSCALE: f32 = 5.421_011e-20;

/// What GELU and its derivative are made of, for one value.
struct Parts {
    /// `x` clamped to `±CLAMP`.
    x: f32,
    /// Whether `|x| < NEAR`.
    near: bool,
    /// `Φ(x)` where `near`.
    near_cdf: f32,
    /// `φ(x) · 2⁶⁴`.
    pdf: f32,
    /// `Φ(-|x|) · 2⁶⁴`.
    tail: f32,
}

/// The [`Parts`] of `x`, without branches (see the [module docs](self)).
#[inline(always)]
fn parts(x: f32) -> Parts {
    // Comparisons that keep a NaN.
    let x = if x < -CLAMP { -CLAMP } else { x };
    let x = if x > CLAMP { CLAMP } else { x };
    let u = x.abs();
    let square = x * x;
    let square_error = x.mul_add(x, -square);
    let gauss = exp_scaled(-0.5 * square, -0.5 * square_error, SCALE);

    let mut a = A[A.len() - 1];
    for c in A[..A.len() - 1].iter().rev() {
        a = a.mul_add(square, *c);
    }
    let near_cdf = x.mul_add(a, 0.5);

    let t = 1.0 / 0.25f32.mul_add(u, 1.0);
    let s = t - T_MID;
    let mut b = B[B.len() - 1];
    for c in B[..B.len() - 1].iter().rev() {
        b = b.mul_add(s, *c);
    }
    Parts {
        x,
        near: u < NEAR,
        near_cdf,
        pdf: gauss * INV_SQRT_2PI,
        tail: gauss / SQRT_2PI.mul_add(u, b),
    }
}

/// `Φ(x)`.
#[cfg(test)]
#[inline(always)]
fn cdf(x: f32) -> f32 {
    let p = parts(x);
    let tail = p.tail * UNSCALE;
    let far = if p.x < 0.0 { tail } else { 1.0 - tail };
    if p.near { p.near_cdf } else { far }
}

/// `x · Φ(x)`; `-0` for `-∞` (the limit, where Flex's formula gives NaN).
#[inline(always)]
fn gelu_of(x: f32) -> f32 {
    let p = parts(x);
    // `x · Φ(-|x|)`, unscaled last.
    let w = p.x * p.tail * UNSCALE;
    let far = if p.x < 0.0 { w } else { x - w };
    if p.near { x * p.near_cdf } else { far }
}

/// GELU's derivative `Φ(x) + x · φ(x)`: `1` for `+∞`, `0` for `-∞` (the limits).
#[inline(always)]
fn gelu_slope(x: f32) -> f32 {
    let p = parts(x);
    let pdf = p.pdf * UNSCALE;
    let left = p.x.mul_add(p.pdf, p.tail) * UNSCALE;
    let right = p.x.mul_add(pdf, 1.0 - p.tail * UNSCALE);
    let far = if p.x < 0.0 { left } else { right };
    if p.near {
        p.x.mul_add(pdf, p.near_cdf)
    } else {
        far
    }
}

/// [`gelu_of`] each value, in place.
#[inline(always)]
fn gelu_values(values: &mut [f32]) {
    for v in values {
        *v = gelu_of(*v);
    }
}

/// `g · gelu'(x)` for each `x` of `xs` and `g` of `grads`, in place in `grads`.
#[inline(always)]
fn gelu_backward_values(xs: &[f32], grads: &mut [f32]) {
    for (g, x) in grads.iter_mut().zip(xs) {
        *g *= gelu_slope(*x);
    }
}

// `Φ` of each value in place: what the tests hold against f64.
#[cfg(test)]
#[inline(always)]
fn cdf_values(values: &mut [f32]) {
    for v in values {
        *v = cdf(*v);
    }
}

isa_variants! {
    fn gelu_values(values: &mut [f32]);
    fn gelu_backward_values(xs: &[f32], grads: &mut [f32]);
    #[cfg(test)]
    fn cdf_values(values: &mut [f32]);
}

/// Values per block: widened into an f32 buffer on the stack (L1), computed, rounded back.
const BLOCK: usize = 256;

/// An element type the kernels take: f32, bf16 or f16, seen as f32 blocks.
pub trait Real: bytemuck::Pod + Send + Sync {
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Rounds `src` into `dst` (same length), to nearest even.
    fn round(src: &[f32], dst: &mut [Self]);
}

impl Real for f32 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn round(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

macro_rules! real_half {
    ($($h:ty),*) => {$(
        impl Real for $h {
            fn widen(src: &[Self], dst: &mut [f32]) {
                <$h as Half>::widen(src, dst);
            }
            fn round(src: &[f32], dst: &mut [Self]) {
                <$h as Half>::round(src, dst);
            }
        }
    )*};
}
real_half!(bf16, f16);

/// GELU of `values` in `E`, in place, block by block (each block widened, computed on `isa`,
/// rounded once), in tasks on rayon's threads where they are large.
pub fn gelu_in_place<E: Real>(isa: Isa, values: &mut [E]) {
    in_row_tasks(1, values, |_, task| gelu_block(isa, None, task));
}

/// GELU of `src` in `E`, as [`gelu_in_place`], into a new buffer written in order.
pub fn gelu_to<E: Real>(isa: Isa, src: &[E]) -> Vec<E> {
    filled(src.len(), |start, block: &mut [E]| {
        gelu_block(isa, Some(&src[start..][..block.len()]), block)
    })
}

// `src`'s values (or, where `None`, `dst`'s own) through GELU into `dst`.
fn gelu_block<E: Real>(isa: Isa, src: Option<&[E]>, dst: &mut [E]) {
    let mut buf = [0f32; BLOCK];
    for (i, dst) in dst.chunks_mut(BLOCK).enumerate() {
        let buf = &mut buf[..dst.len()];
        match src {
            Some(src) => E::widen(&src[i * BLOCK..][..dst.len()], buf),
            None => E::widen(dst, buf),
        }
        on::gelu_values(isa, buf);
        E::round(buf, dst);
    }
}

/// GELU's input gradient `g · gelu'(x)` in `E` for each `x` of `xs` and `g` of `grads` (as
/// long), in place in `grads`, in tasks on rayon's threads where they are large.
pub fn gelu_backward_in_place<E: Real>(isa: Isa, xs: &[E], grads: &mut [E]) {
    assert_eq!(xs.len(), grads.len(), "one gradient per input");
    in_row_tasks(1, grads, |start, task| {
        gelu_backward_block(isa, &xs[start..][..task.len()], None, task)
    });
}

/// GELU's input gradient, as [`gelu_backward_in_place`], into a new buffer written in order.
pub fn gelu_backward_to<E: Real>(isa: Isa, xs: &[E], grads: &[E]) -> Vec<E> {
    assert_eq!(xs.len(), grads.len(), "one gradient per input");
    filled(xs.len(), |start, block: &mut [E]| {
        let n = block.len();
        gelu_backward_block(isa, &xs[start..][..n], Some(&grads[start..][..n]), block)
    })
}

// `g · gelu'(x)` of `xs` and `gs` (or, where `None`, `dst`'s own values) into `dst`.
fn gelu_backward_block<E: Real>(isa: Isa, xs: &[E], gs: Option<&[E]>, dst: &mut [E]) {
    let (mut bx, mut bg) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (i, dst) in dst.chunks_mut(BLOCK).enumerate() {
        let (at, n) = (i * BLOCK, dst.len());
        let (bx, bg) = (&mut bx[..n], &mut bg[..n]);
        E::widen(&xs[at..][..n], bx);
        match gs {
            Some(gs) => E::widen(&gs[at..][..n], bg),
            None => E::widen(dst, bg),
        }
        on::gelu_backward_values(isa, bx, bg);
        E::round(bg, dst);
    }
}

/// `Φ` and `φ` in f64: the exact values the kernels are held against, here and in the root
/// crate's tests of its Flex adapter.
pub mod reference {
    /// `Φ(x)` in f64, to about 1e-14 relative in both tails: the erf series of positive terms
    /// near 0, the continued fraction of erfc beyond.
    pub fn cdf64(x: f64) -> f64 {
        let upper = 0.5 * erfc64(x.abs() / std::f64::consts::SQRT_2);
        if x < 0.0 { upper } else { 1.0 - upper }
    }

    pub fn erfc64(z: f64) -> f64 {
        let gauss = (-z * z).exp();
        if z < 1.8 {
            // erf(z) = 2/√π · e^(-z²) · Σ 2ⁿ z^(2n+1) / (1 · 3 ⋯ (2n + 1))
            let (mut term, mut sum, mut n) = (z, z, 0.0);
            while term > sum * 1e-17 {
                n += 1.0;
                term *= 2.0 * z * z / (2.0 * n + 1.0);
                sum += term;
            }
            1.0 - 2.0 / std::f64::consts::PI.sqrt() * gauss * sum
        } else {
            // erfc(z) = e^(-z²)/√π · 1/(z + ½/(z + 1/(z + (3/2)/(z + …))))
            let mut f = z;
            for k in (1..400).rev() {
                f = z + f64::from(k) / 2.0 / f;
            }
            gauss / std::f64::consts::PI.sqrt() / f
        }
    }

    pub fn pdf64(x: f64) -> f64 {
        (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::reference::{cdf64, erfc64, pdf64};
    use super::*;
    use crate::exp::tests::ulps;
    use crate::isa::tests::paths;

    #[test]
    fn the_reference_agrees_with_itself() {
        // Both sides of the switch, and known values.
        for z in [1.79f64, 1.8, 1.81] {
            let series = {
                let gauss = (-z * z).exp();
                let (mut term, mut sum, mut n) = (z, z, 0.0);
                while term > sum * 1e-17 {
                    n += 1.0;
                    term *= 2.0 * z * z / (2.0 * n + 1.0);
                    sum += term;
                }
                1.0 - 2.0 / std::f64::consts::PI.sqrt() * gauss * sum
            };
            assert!((series / erfc64(z + 1e-12) - 1.0).abs() < 1e-11, "{z}");
        }
        assert!((cdf64(-1.0) / 0.158_655_253_931_457_05 - 1.0).abs() < 1e-14);
        assert!((cdf64(-10.0) / 7.619_853_024_160_527e-24 - 1.0).abs() < 1e-13);
    }

    // f32 values from -20 to 20: every 509th bit pattern above 1e-3 in magnitude, and a few
    // below, and the values around the formula's switch at 0.75.
    fn sweep() -> Vec<f32> {
        let (low, high) = (1e-3f32.to_bits(), 20.0f32.to_bits());
        let mut xs: Vec<f32> = (low..high).step_by(509).map(f32::from_bits).collect();
        xs.extend((0..low).step_by(1 << 16).map(f32::from_bits));
        let negative: Vec<f32> = xs.iter().map(|x| -x).collect();
        xs.extend(negative);
        for k in -8..=8 {
            let at = f32::from_bits((NEAR.to_bits() as i32 + k) as u32);
            xs.extend([at, -at]);
        }
        xs.extend([0.0, -0.0, 13.5, -13.5, -14.0, 30.0, -30.0, 1e30, -1e30]);
        xs
    }

    // `f` compiled for each path on `xs`, checked to give one set of bits; the values.
    fn on_every_path(xs: &[f32], f: impl Fn(Isa, &mut [f32])) -> Vec<f32> {
        let mut first: Option<Vec<f32>> = None;
        for isa in paths() {
            let mut got = xs.to_vec();
            f(isa, &mut got);
            if let Some(first) = &first {
                let same = first
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{isa:?} gives other bits");
            }
            first.get_or_insert(got);
        }
        first.unwrap()
    }

    #[test]
    fn cdf_and_gelu_against_f64() {
        let xs = sweep();
        let cdf = on_every_path(&xs, on::cdf_values);
        let gelu = on_every_path(&xs, on::gelu_values);
        let (mut worst_cdf, mut worst_gelu) = (0f64, 0f64);
        for ((x, c), g) in xs.iter().zip(&cdf).zip(&gelu) {
            let x64 = f64::from(*x);
            let err = ulps(*c, cdf64(x64));
            assert!(err <= 3.0, "Φ({x}) = {c}, not {}: {err} ulp", cdf64(x64));
            worst_cdf = worst_cdf.max(err);
            let err = ulps(*g, x64 * cdf64(x64));
            assert!(
                err <= 4.0,
                "gelu({x}) = {g}, not {}: {err} ulp",
                x64 * cdf64(x64)
            );
            worst_gelu = worst_gelu.max(err);
        }
        eprintln!("Φ within {worst_cdf:.3} ulp, gelu within {worst_gelu:.3} ulp");
        let mut special = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0];
        on::gelu_values(Isa::Portable, &mut special);
        // The limits at ±∞ (Flex's `0.5 · x · (1 + erf)` gives NaN at -∞).
        assert_eq!(special[0], f32::INFINITY);
        assert_eq!(special[1].to_bits(), (-0.0f32).to_bits());
        assert!(special[2].is_nan());
        assert_eq!(special[3].to_bits(), (-0.0f32).to_bits());
        let x = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 30.0, -30.0];
        let mut slope = [1.0; 5];
        on::gelu_backward_values(Isa::Portable, &x, &mut slope);
        assert_eq!(slope[0], 1.0);
        assert_eq!(slope[1], 0.0);
        assert!(slope[2].is_nan());
        assert_eq!(slope[3..], [1.0, 0.0]);
    }

    #[test]
    fn derivative_against_f64() {
        let xs = sweep();
        let ones = vec![1.0; xs.len()];
        let mut worst = 0f64;
        let got = on_every_path(&ones, |isa, g| on::gelu_backward_values(isa, &xs, g));
        for (x, d) in xs.iter().zip(&got) {
            let x64 = f64::from(*x);
            let (cdf, slope) = (cdf64(x64), x64 * pdf64(x64));
            let scale = cdf.abs().max(slope.abs());
            let ulp = match scale as f32 {
                s if s < f32::MIN_POSITIVE => f64::from(f32::from_bits(1)),
                s => f64::from(f32::from_bits(s.to_bits() + 1) - s),
            };
            let err = (f64::from(*d) - (cdf + slope)).abs() / ulp;
            assert!(
                err <= 4.0,
                "gelu'({x}) = {d}, not {}: {err} ulp",
                cdf + slope
            );
            worst = worst.max(err);
        }
        eprintln!("gelu' within {worst:.3} ulp of its larger term");
    }
}
