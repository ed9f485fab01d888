//! ReLU on half tensors on Flex, whose own is slow.
//!
//! Autocast leaves activations in the dtype they get, so after a lower-class linear the ReLU
//! runs in bf16 or f16; Flex 0.21 computes that one scalar conversion at a time (5× its f32
//! ReLU in bf16, 44× in f16, on a 256×2048 tensor). Here it runs through
//! [`half_kernels`](super::half_kernels), bit for bit the same values.
//!
//! Under autodiff the node saves ReLU's *output* for the backward pass, where Burn's saves its
//! input: the mask is the same (`output > 0` exactly where `input > 0`), and the output is what
//! the next layer saves anyway, so one activation fewer stays alive until the backward pass.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn_backend::ops::ActivationOps;
use burn_backend::tensor::FloatTensor;

use super::half_kernels::{fits, map, with_half, zip};

/// ReLU of a tensor (half tensors through the kernels, anything else through Flex's), with
/// Flex's own values.
pub(crate) fn relu(tensor: FlexTensor) -> FlexTensor {
    // Flex's `x.max(0.0)` gives +0 for -0 and NaN, which a vectorised max need not; the
    // comparison does so always.
    let positive = |x: f32| if x > 0.0 { x } else { 0.0 };
    match fits(&tensor) {
        true => {
            with_half!(tensor.dtype(), H => map::<H>(tensor, positive), _ => Flex::relu(tensor))
        }
        false => Flex::relu(tensor),
    }
}

fn relu_backward(output: FlexTensor, grad: FlexTensor) -> FlexTensor {
    let mask = |out: f32, g: f32| if out > 0.0 { g } else { 0.0 };
    let same = output.dtype() == grad.dtype() && output.layout().shape() == grad.layout().shape();
    match same && fits(&output) && fits(&grad) {
        true => {
            with_half!(output.dtype(), H => zip::<H>(&output, grad, mask), _ => Flex::relu_backward(output, grad))
        }
        false => Flex::relu_backward(output, grad),
    }
}

/// [`relu`] as a node of Burn's autodiff, saving the output.
pub(crate) fn relu_tracked(tensor: FloatTensor<Autodiff<Flex>>) -> FloatTensor<Autodiff<Flex>> {
    #[derive(Debug)]
    struct Relu;

    impl Backward<Flex, 1> for Relu {
        type State = FlexTensor;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let output = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
                relu_backward(output, grad)
            });
        }
    }

    let node = tensor.node.clone();
    let output = relu(tensor.primitive);
    match Relu
        .prepare::<NoCheckpointing>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(output.clone(), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use burn_backend::FloatDType;
    use burn_backend::ops::FloatTensorOps;

    use super::*;

    #[test]
    fn relu_and_its_backward_give_flexs_own_bits() {
        let mut v: Vec<f32> = (0..999)
            .map(|i| ((i * 7919) % 201) as f32 / 9.0 - 11.0)
            .collect();
        // Flex's ReLU makes +0 of both; a vectorised max need not.
        v[..2].copy_from_slice(&[-0.0, f32::NAN]);
        let g: Vec<f32> = (0..999)
            .map(|i| ((i * 104_729) % 173) as f32 / 7.0 - 12.0)
            .collect();
        let bits = |t: FlexTensor| t.into_data().bytes.to_vec();
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            let cast = |v: &Vec<f32>| {
                Flex::float_cast(
                    FlexTensor::from_data(TensorData::new(v.clone(), [27, 37])),
                    dtype,
                )
            };
            let (x, grad) = (cast(&v), cast(&g));
            let out = relu(x.clone());
            assert_eq!(bits(out.clone()), bits(Flex::relu(x.clone())), "{dtype:?}");
            // Burn's backward masks by the input; this one by the output: the same bits.
            assert_eq!(
                bits(relu_backward(out, grad.clone())),
                bits(Flex::relu_backward(x, grad)),
                "{dtype:?} backward"
            );
        }
    }
}
