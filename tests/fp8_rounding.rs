//! fp8 quantize-dequantize on the device, bit for bit: against ml_dtypes' golden vectors and
//! against a host-side bit-level reference over every fp8 value, every midpoint between
//! neighbours, the values either side of each midpoint, and random f32 bit patterns.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::fp8::{Fp8Format, quantize_dequantize_tensor};
use serde_json::Value;

const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

// ---- the host-side reference: integer arithmetic on f32 bits, no float rounding -----------

/// Saturating round-to-nearest-even of `x` to `format`, by integer arithmetic on its bits.
fn reference(x: f32, format: Fp8Format) -> f32 {
    if x.is_nan() {
        return x;
    }
    let max = format.max_finite();
    let x = x.clamp(-max, max);
    let bits = x.to_bits();
    let negative = bits >> 31 == 1;
    let (exponent, significand) = match (bits >> 23) & 0xff {
        0 => (-126, bits & 0x7f_ffff), // f32 subnormal (or zero)
        e => (e as i32 - 127, (bits & 0x7f_ffff) | 0x80_0000),
    };
    // x = significand * 2^(exponent - 23); on the fp8 grid the quantum is 2^(e - m) with e the
    // binade, clamped below at the smallest normal exponent (subnormals share its quantum).
    let mantissa = format.mantissa_bits() as i32;
    let binade = exponent.max(format.min_normal_exponent());
    let shift = (23 - mantissa + binade - exponent) as u32;
    let units = round_shift_even(significand, shift);
    let magnitude = units as f32 * 2f32.powi(binade - mantissa);
    if negative { -magnitude } else { magnitude }
}

/// `value / 2^shift` rounded to nearest, ties to even, on integers.
fn round_shift_even(value: u32, shift: u32) -> u32 {
    if shift == 0 {
        return value;
    }
    if shift >= 32 {
        return 0; // value < 2^24, far below half of 2^shift
    }
    let quotient = value >> shift;
    let remainder = value & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if remainder > half || (remainder == half && quotient & 1 == 1) {
        quotient + 1
    } else {
        quotient
    }
}

/// Every finite value of `format`, decoded from its bit patterns.
fn all_values(format: Fp8Format) -> Vec<f32> {
    let (exponent_bits, mantissa_bits, bias) = match format {
        Fp8Format::E4M3 => (4, 3, 7),
        Fp8Format::E5M2 => (5, 2, 15),
    };
    let mut values = Vec::new();
    for byte in 0u32..256 {
        let sign = if byte >> 7 == 1 { -1.0 } else { 1.0 };
        let e = (byte >> mantissa_bits) & ((1 << exponent_bits) - 1);
        let m = byte & ((1 << mantissa_bits) - 1);
        let top = (1 << exponent_bits) - 1;
        let special = match format {
            Fp8Format::E4M3 => e == top && m == (1 << mantissa_bits) - 1, // NaN only
            Fp8Format::E5M2 => e == top,                                  // inf and NaN
        };
        if special {
            continue;
        }
        let value = if e == 0 {
            m as f32 * 2f32.powi(1 - bias - mantissa_bits)
        } else {
            (1.0 + m as f32 / (1 << mantissa_bits) as f32) * 2f32.powi(e as i32 - bias)
        };
        values.push(sign * value);
    }
    values
}

/// Every fp8 value, every midpoint between neighbours, the f32s either side of each, values
/// beyond the range, and the specials.
fn probe_values(format: Fp8Format) -> Vec<f32> {
    let mut grid = all_values(format);
    grid.sort_by(f32::total_cmp);
    grid.dedup_by(|a, b| a.to_bits() == b.to_bits());
    let mut probes = grid.clone();
    for pair in grid.windows(2) {
        let mid = (pair[0] + pair[1]) / 2.0; // exact: both are short fp8 values
        probes.extend([mid, mid.next_up(), mid.next_down()]);
    }
    let max = format.max_finite();
    probes.extend([
        max.next_up(),
        max * 1.03,
        max * 1.0625,
        max * 2.0,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -0.0,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        -f32::from_bits(1),
    ]);
    let negated: Vec<f32> = probes.iter().map(|x| -x).collect();
    probes.extend(negated);
    probes
}

/// Deterministic random f32 bit patterns (every class: normal, subnormal, inf, NaN), plus
/// random values inside the format's range where the interesting rounding happens.
fn random_values(format: Fp8Format, n: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ format.max_finite() as u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 32) as u32
    };
    (0..n)
        .map(|i| {
            let r = next();
            if i % 2 == 0 {
                f32::from_bits(r)
            } else {
                // Uniform exponent over the format's range and a bit below it.
                let e = (r % 40) as i32 - 25;
                let m = next() as f32 / u32::MAX as f32;
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                sign * (1.0 + m) * 2f32.powi(e)
            }
        })
        .collect()
}

fn same_bits(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}

// ---- the device side ------------------------------------------------------------------

/// Runs the crate's qdq on `B` over `values`, as a rank-3 tensor to exercise rank-agnosticism.
fn on_device<B: Backend>(values: &[f32], format: Fp8Format, scale: f32) -> Vec<f32> {
    let device = Default::default();
    let n = values.len();
    let x = Tensor::<B, 3>::from_data(TensorData::new(values.to_vec(), [1, 1, n]), &device);
    quantize_dequantize_tensor(x, format, scale)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

fn mismatches(input: &[f32], got: &[f32], want: &[f32]) -> Vec<String> {
    input
        .iter()
        .zip(got.iter().zip(want))
        .filter(|(_, (g, w))| !same_bits(**g, **w))
        .map(|(x, (g, w))| format!("{x:e} ({:#010x}) -> {g:e}, want {w:e}", x.to_bits()))
        .collect()
}

fn number(v: &Value) -> f32 {
    match v {
        Value::String(s) => s.parse::<f32>().unwrap(),
        v => v.as_f64().unwrap() as f32,
    }
}

fn golden() -> Vec<(String, Fp8Format, Vec<f32>, Vec<f32>)> {
    let text = include_str!("golden/fp8_rounding.json");
    let file: Value = serde_json::from_str(text).unwrap();
    file["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let format = match case["format"].as_str().unwrap() {
                "e4m3" => Fp8Format::E4M3,
                "e5m2" => Fp8Format::E5M2,
                other => panic!("unknown format {other}"),
            };
            assert_eq!(
                case["max_finite"].as_f64().unwrap() as f32,
                format.max_finite()
            );
            let values = |k: &str| case[k].as_array().unwrap().iter().map(number).collect();
            (
                case["id"].as_str().unwrap().to_string(),
                format,
                values("input"),
                values("expected"),
            )
        })
        .collect()
}

/// Every golden case through `B`'s qdq: all must agree bit for bit.
fn golden_on<B: Backend>() {
    let cases = golden();
    assert_eq!(cases.len(), 76, "the golden file's case count");
    let mut failed = Vec::new();
    for (id, format, input, expected) in &cases {
        let got = on_device::<B>(input, *format, 1.0);
        let bad = mismatches(input, &got, expected);
        if !bad.is_empty() {
            failed.push(format!("{id}: {} wrong, first {}", bad.len(), bad[0]));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} golden cases failed:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

/// The device agrees with the bit-level reference over every probe value and random ones,
/// with scale 1 and with a scale that is not a power of two.
fn reference_on<B: Backend>() {
    for format in FORMATS {
        let mut input = probe_values(format);
        input.extend(random_values(format, 20_000));
        let want: Vec<f32> = input.iter().map(|x| reference(*x, format)).collect();
        let bad = mismatches(&input, &on_device::<B>(&input, format, 1.0), &want);
        assert!(
            bad.is_empty(),
            "{format}: {} of {}: {bad:#?}",
            bad.len(),
            input.len()
        );

        // fp8(x × s) / s, with the product and quotient rounded in f32 as on the device.
        let scale = 3.7;
        let want: Vec<f32> = input
            .iter()
            .map(|x| reference(x * scale, format) / scale)
            .collect();
        let bad = mismatches(&input, &on_device::<B>(&input, format, scale), &want);
        assert!(
            bad.is_empty(),
            "{format} scaled: {} of {}: {bad:#?}",
            bad.len(),
            input.len()
        );
    }
}

/// Half-precision inputs are rounded in f32 and come back in their own dtype, exactly (on
/// Flex, whose tensors hold f16 and bf16; NdArray's do not).
#[cfg(feature = "flex")]
fn half_inputs_on<B: Backend>(dtype: burn::tensor::FloatDType) {
    let device = Default::default();
    for format in FORMATS {
        let input: Vec<f32> = probe_values(format)
            .into_iter()
            .filter(|x| x.is_finite() && x.abs() < 60000.0)
            .collect();
        let x = Tensor::<B, 1>::from_data(TensorData::new(input.clone(), [input.len()]), &device)
            .cast(dtype);
        let widened: Vec<f32> = x
            .clone()
            .cast(burn::tensor::FloatDType::F32)
            .into_data()
            .to_vec()
            .unwrap();
        let got = quantize_dequantize_tensor(x, format, 1.0);
        assert_eq!(got.dtype(), dtype.into());
        let got: Vec<f32> = got
            .cast(burn::tensor::FloatDType::F32)
            .into_data()
            .to_vec()
            .unwrap();
        let want: Vec<f32> = widened.iter().map(|x| reference(*x, format)).collect();
        let bad = mismatches(&widened, &got, &want);
        assert!(bad.is_empty(), "{format} {dtype:?}: {bad:#?}");
    }
}

#[test]
fn reference_agrees_with_ml_dtypes() {
    for (id, format, input, expected) in golden() {
        let got: Vec<f32> = input.iter().map(|x| reference(*x, format)).collect();
        let bad = mismatches(&input, &got, &expected);
        assert!(bad.is_empty(), "{id}: {bad:#?}");
    }
}

#[test]
fn reference_keeps_every_fp8_value_and_breaks_ties_to_even() {
    for format in FORMATS {
        let grid = all_values(format);
        assert_eq!(
            grid.len(),
            if format == Fp8Format::E4M3 { 254 } else { 248 }
        );
        for x in &grid {
            assert!(same_bits(reference(*x, format), *x), "{format}: {x}");
        }
    }
    // Between 16 and 18 (E4M3 quantum 2 there), 17 goes to 16, whose mantissa is even.
    assert_eq!(reference(17.0, Fp8Format::E4M3), 16.0);
    assert_eq!(reference(19.0, Fp8Format::E4M3), 20.0);
    // Half the smallest subnormal ties to zero, keeping its sign.
    assert!(same_bits(
        reference(-(2f32.powi(-10)), Fp8Format::E4M3),
        -0.0
    ));
}

#[cfg(feature = "flex")]
mod flex {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::FloatDType;

    #[test]
    fn golden_cases_all_pass() {
        golden_on::<Flex>();
    }

    #[test]
    fn matches_the_bit_level_reference() {
        reference_on::<Flex>();
    }

    #[test]
    fn half_inputs_round_in_f32() {
        half_inputs_on::<Flex>(FloatDType::F16);
        half_inputs_on::<Flex>(FloatDType::BF16);
    }
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use super::*;
    use burn::backend::NdArray;

    #[test]
    fn golden_cases_all_pass() {
        golden_on::<NdArray>();
    }

    #[test]
    fn matches_the_bit_level_reference() {
        reference_on::<NdArray>();
    }
}
