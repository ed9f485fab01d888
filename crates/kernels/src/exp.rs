//! The vectorisable `exp` the softmax and GELU kernels are built on.
//!
//! [`exp`] is within 1 ulp of the exact value over the whole f32 range (tested against f64's
//! `exp`, subnormal results included); it is `+∞` above 88.72, `0` below -103.97, and NaN
//! for NaN. It has no branches, so the compiler vectorises the loops that call it, and it
//! gives the same bits on every [`Isa`](crate::isa::Isa) (fused multiply-adds round once on
//! every path).

// exp(x) = 2ⁿ · exp(r), n = round(x / ln 2), r = x - n · ln 2 in two steps (Cody and Waite;
// `LN2_HI` has 9 significant bits, so `n · LN2_HI` is exact), |r| ≤ ln 2 / 2.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
// 1.5 · 2²³: added to a value below 2²² in magnitude, rounds it to an integer (to nearest
// even), which then sits in the low bits of the sum's representation.
const ROUNDER: f32 = 12_582_912.0;
// Past these exp is +∞ (above 88.72) or rounds to 0 (below -103.97) anyway; clamping keeps n
// small enough for two normal powers of two.
const EXP_MIN: f32 = -110.0;
const EXP_MAX: f32 = 89.0;
// Cephes' `expf` polynomial, its coefficients in f32: exp(r) ≈ 1 + r + r² · P(r) on
// |r| ≤ ln 2 / 2.
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_66,
    0.5,
];

/// `2^k` for `k` in `-126..=127`, from its bits.
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `e^x` in f32, within 1 ulp, without branches (see the [module docs](self)).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp_scaled(x, 0.0, 0)
}

/// `e^(hi + lo)` times `2^scale`, rounded once, for an argument carried as an unevaluated sum
/// (`|lo|` at most half an ulp of `hi`: the low half of a product from a fused multiply-add),
/// the low part entering after the range reduction, where it is not lost; the scaling keeps
/// a result that would be subnormal whole for a later product. `scale` is 0, or in `1..=64`
/// with `hi ≤ 0`. NaN in `hi` gives NaN.
#[inline(always)]
pub fn exp_scaled(hi: f32, lo: f32, scale: i32) -> f32 {
    // Comparisons that keep a NaN (`f32::max` would drop it).
    let x = if hi < EXP_MIN { EXP_MIN } else { hi };
    let x = if x > EXP_MAX { EXP_MAX } else { x };
    let v = x.mul_add(LOG2E, ROUNDER);
    let n = v - ROUNDER;
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r) + lo;
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p.mul_add(r, *c);
    }
    let p = p.mul_add(r * r, r) + 1.0;
    // n as an integer, from the sum's low bits; 2ⁿ as two factors, so that n from -159 to
    // 128 needs no subnormal or infinite power: the first product is exact, the second rounds
    // once (to a subnormal, infinity or zero where the result is one).
    let k = (v.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let k1 = k >> 1;
    p * pow2(k1) * pow2(k - k1 + scale)
}

#[cfg(test)]
#[inline(always)]
fn exp_values(values: &mut [f32]) {
    for v in values {
        *v = exp(*v);
    }
}

#[cfg(test)]
crate::isa::isa_variants! {
    fn exp_values(values: &mut [f32]);
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::isa::Isa;
    use crate::isa::tests::paths;

    /// The distance from `got` to `want` in ulps of `want` rounded to f32 (2⁻¹⁴⁹ for
    /// subnormals).
    pub fn ulps(got: f32, want: f64) -> f64 {
        if got as f64 == want {
            return 0.0;
        }
        let rounded = (want as f32).abs();
        let ulp = if rounded < f32::MIN_POSITIVE {
            f64::from(f32::from_bits(1))
        } else {
            let next = f32::from_bits(rounded.to_bits() + 1);
            f64::from(next) - f64::from(rounded)
        };
        (f64::from(got) - want).abs() / ulp
    }

    #[test]
    fn exp_is_within_one_ulp_of_f64_on_every_path() {
        // Every 64th f32 from -104 to 89 (one in 64 of all the values there), and the values
        // where the result leaves the normal range or overflows.
        let (low, high) = ((-104.0f32).to_bits(), 89.0f32.to_bits());
        let mut xs: Vec<f32> = (0..high)
            .step_by(64)
            .chain((0x8000_0000..=low).step_by(64))
            .map(f32::from_bits)
            .collect();
        xs.extend([
            0.0,
            -0.0,
            88.722_83,
            88.722_84,
            -87.336_55,
            -103.972_08,
            -103.972_09,
            f32::MIN_POSITIVE,
        ]);
        let mut first: Option<Vec<u32>> = None;
        for isa in paths() {
            let mut got = xs.clone();
            on::exp_values(isa, &mut got);
            let mut worst = 0f64;
            for (x, e) in xs.iter().zip(&got) {
                let want = f64::from(*x).exp();
                let err = match want > f64::from(f32::MAX) {
                    true => {
                        assert_eq!(*e, f32::INFINITY, "exp({x}) on {isa:?}");
                        0.0
                    }
                    false => ulps(*e, want),
                };
                assert!(
                    err <= 1.0,
                    "exp({x}) = {e}, not {want}: {err} ulp on {isa:?}"
                );
                worst = worst.max(err);
            }
            eprintln!("exp on {isa:?}: at most {worst:.3} ulp");
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            match &first {
                None => first = Some(got),
                Some(first) => assert!(first == &got, "{isa:?} gives other bits"),
            }
        }
        let mut special = [
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -1e4,
            1e4,
            -200.0,
        ];
        on::exp_values(Isa::Portable, &mut special);
        assert_eq!(special[..2], [0.0, f32::INFINITY]);
        assert!(special[2].is_nan());
        assert_eq!(special[3..], [0.0, f32::INFINITY, 0.0]);
    }
}
