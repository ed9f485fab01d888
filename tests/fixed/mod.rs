//! Deterministic tensors and layers for the tests that compare runs bit for bit or expect a
//! trajectory: they must not draw from Burn's RNG, which is the process's (parallel tests
//! share and reseed it).

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Deterministic values in [-amplitude, amplitude], different for each `salt`.
pub fn fixed<B: Backend, const D: usize>(
    shape: [usize; D],
    salt: f32,
    amplitude: f32,
    device: &B::Device,
) -> Tensor<B, D> {
    let n = shape.iter().product::<usize>();
    let values: Vec<f32> = (0..n)
        .map(|i| (salt * 7.3 + i as f32 * 1.7).sin() * amplitude)
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A `Linear` with fixed weights (scaled like Burn's default init) and zero bias.
pub fn fixed_linear<B: Backend>(
    d_in: usize,
    d_out: usize,
    salt: f32,
    device: &B::Device,
) -> Linear<B> {
    Linear {
        weight: Param::from_tensor(fixed(
            [d_in, d_out],
            salt,
            (1.0 / d_in as f32).sqrt(),
            device,
        )),
        bias: Some(Param::from_tensor(Tensor::zeros([d_out], device))),
    }
}
