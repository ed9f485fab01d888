//! Conformance runner for the `fp8_rounding` suite: each case's inputs go through the crate's
//! fp8 quantize-dequantize, the tensor ops fp8 autocast runs, on the default backend (Flex),
//! and come back as `{"id", "output"}`.

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use burn_accelerate::fp8::{Fp8Format, quantize_dequantize_tensor};
use serde_json::{Value, json};

/// The suites this module answers.
pub const SUITES: [&str; 1] = ["fp8_rounding"];

/// Rounds `case`'s `input` to its `format` on the device and returns `{"id", "output"}`.
/// Non-finite values are written as the golden file writes them (`"nan"`, `"inf"`, `"-inf"`).
///
/// # Panics
///
/// On a case missing its format or inputs: a bug in the golden file, not a result.
pub fn run_case(_suite: &str, case: &Value) -> Value {
    let format = match case["format"].as_str() {
        Some("e4m3") => Fp8Format::E4M3,
        Some("e5m2") => Fp8Format::E5M2,
        other => panic!("case {}: unknown format {other:?}", case["id"]),
    };
    let input: Vec<f32> = case["input"]
        .as_array()
        .expect("a case has an input list")
        .iter()
        .map(number)
        .collect();
    let n = input.len();
    let x = Tensor::<Flex, 1>::from_data(TensorData::new(input, [n]), &Default::default());
    let output: Vec<Value> = quantize_dequantize_tensor(x, format, 1.0)
        .into_data()
        .to_vec::<f32>()
        .expect("qdq returns f32")
        .into_iter()
        .map(to_json)
        .collect();
    json!({ "id": case["id"], "output": output })
}

fn number(v: &Value) -> f32 {
    match v {
        Value::String(s) => s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}")),
        v => v.as_f64().expect("a number") as f32,
    }
}

fn to_json(x: f32) -> Value {
    if x.is_nan() {
        json!("nan")
    } else if x.is_infinite() {
        json!(if x > 0.0 { "inf" } else { "-inf" })
    } else {
        // Widening is exact, and -0.0 keeps its sign in JSON.
        json!(f64::from(x))
    }
}
