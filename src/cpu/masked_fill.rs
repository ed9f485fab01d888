//! `mask_fill` on Flex with a broadcast mask, read where it lies.
//!
//! Attention masks are broadcast: Burn's multi-head attention fills `[batch, heads, seq, seq]`
//! scores through a causal mask of `[batch, 1, seq, seq]` (itself an expanded `[seq, seq]`).
//! Flex 0.21 first copies the mask out to the scores' full shape, one element at a time
//! through its strided iterator, then fills on one thread; in a transformer's bf16 step that
//! was about a tenth of the time, forward and backward (the backward fills the gradient
//! through the same mask). Here each value is read from the tensor or the fill value by the
//! mask's own strides (0 along a broadcast dimension), on rayon's threads.
//!
//! The values are Flex's bits (a copy or the fill value, converted as Flex converts it), so
//! the decorator takes this path with or without autocast. Not for f64, masks that do not
//! broadcast to the tensor, or masks longer than it (Flex's own).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Bytes, DType, Shape};
use burn_backend::Scalar;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::{BoolTensor, FloatTensor};
use half::{bf16, f16};

use burn_accelerate_kernels::strided;

/// The mask's strides along each of the tensor's dimensions (0 where it is broadcast), or
/// `None` where it does not broadcast to `shape`.
fn broadcast_strides(shape: &[usize], mask: &Layout) -> Option<Vec<usize>> {
    strided::broadcast_strides(shape, mask.shape(), mask.strides())
}

/// `tensor` with `value` where `mask` is true, as `Flex::float_mask_fill` gives it.
pub(crate) fn mask_fill(tensor: FlexTensor, mask: FlexTensor, value: Scalar) -> FlexTensor {
    // Converted as Flex converts it (through f64 for the half types).
    let wide: f64 = value.elem();
    let filled = match tensor.dtype() {
        DType::F32 => fill::<f32>(&tensor, &mask, wide as f32),
        DType::F16 => fill::<f16>(&tensor, &mask, f16::from_f64(wide)),
        DType::BF16 => fill::<bf16>(&tensor, &mask, bf16::from_f64(wide)),
        _ => None,
    };
    match filled {
        Some(out) => out,
        None => Flex::float_mask_fill(tensor, mask, value),
    }
}

fn fill<T: bytemuck::Pod + burn_backend::Element + Send + Sync>(
    tensor: &FlexTensor,
    mask: &FlexTensor,
    value: T,
) -> Option<FlexTensor> {
    let shape: Vec<usize> = tensor.layout().shape().to_vec();
    let strides = broadcast_strides(&shape, mask.layout())?;
    let rank = shape.len();
    let len: usize = shape.iter().product();
    if rank == 0 || len == 0 || !matches!(mask.dtype(), DType::Bool(_)) {
        return None;
    }
    // A view is made contiguous by Flex first (the scores and their gradients are already).
    let tensor = match tensor.layout().is_contiguous() {
        true => tensor.clone(),
        false => tensor.to_contiguous(),
    };
    let start = tensor.layout().start_offset();
    let values = &tensor.storage::<T>()[start..start + len];
    let mask_at = (mask.bytes(), mask.layout().start_offset(), &strides[..]);
    let out = strided::masked_fill(values, &shape, mask_at, value);
    Some(FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(Shape::from(shape)),
        tensor.dtype(),
    ))
}

/// [`mask_fill`] as a node of Burn's autodiff: the gradient is filled with 0 through the same
/// mask, as Burn's own node does.
pub(crate) fn mask_fill_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    mask: BoolTensor<Autodiff<Flex>>,
    value: Scalar,
) -> FloatTensor<Autodiff<Flex>> {
    #[derive(Debug)]
    struct MaskFill;

    impl Backward<Flex, 1> for MaskFill {
        type State = FlexTensor;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let mask = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
                mask_fill(grad, mask, 0f32.into())
            });
        }
    }

    match MaskFill
        .prepare::<NoCheckpointing>([tensor.node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = mask_fill(tensor.primitive, mask.clone(), value);
            prep.finish(mask, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(mask_fill(tensor.primitive, mask, value)),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use burn_backend::FloatDType;
    use burn_backend::ops::BoolTensorOps;

    use super::*;

    fn floats(shape: &[usize], dtype: FloatDType) -> FlexTensor {
        let len: usize = shape.iter().product();
        let values: Vec<f32> = (0..len)
            .map(|i| ((i * 7919) % 211) as f32 / 7.0 - 15.0)
            .collect();
        Flex::float_cast(
            FlexTensor::from_data(TensorData::new(values, shape.to_vec())),
            dtype,
        )
    }

    fn bools(shape: &[usize], seed: usize) -> FlexTensor {
        let len: usize = shape.iter().product();
        let values: Vec<bool> = (0..len)
            .map(|i| (i * 31 + seed).is_multiple_of(3))
            .collect();
        Flex::bool_from_data(TensorData::new(values, shape.to_vec()), &Default::default())
    }

    fn bits(t: FlexTensor) -> (Vec<usize>, Vec<u8>) {
        let shape = t.layout().shape().to_vec();
        (shape, t.into_data().bytes.to_vec())
    }

    #[test]
    fn broadcast_and_strided_masks_fill_as_flex_does() {
        let causal = |s: usize| {
            // Burn's causal mask: `[s, s]` expanded over a batch of 2, then a head dimension.
            let tril = Flex::bool_from_data(
                TensorData::new(
                    (0..s * s).map(|i| i % s > i / s).collect::<Vec<bool>>(),
                    [s, s],
                ),
                &Default::default(),
            );
            let tril = Flex::bool_reshape(tril, [1, s, s].into());
            let expanded = Flex::bool_expand(tril, [2, s, s].into());
            Flex::bool_reshape(expanded, [2, 1, s, s].into())
        };
        for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
            for (shape, mask) in [
                // Attention: heads broadcast, an expanded (strided) mask; odd lengths.
                (vec![2, 3, 17, 17], causal(17)),
                (vec![2, 5, 1, 1], causal(1)),
                // A mask of the tensor's own shape, and one of lower rank.
                (vec![7, 33], bools(&[7, 33], 1)),
                (vec![4, 9, 33], bools(&[9, 33], 2)),
                // A transposed (strided) mask.
                (vec![5, 6], Flex::bool_swap_dims(bools(&[6, 5], 3), 0, 1)),
                // Large enough for several tasks.
                (vec![3, 4, 160, 161], bools(&[3, 1, 160, 161], 4)),
            ] {
                let x = floats(&shape, dtype);
                for value in [-1e4, 0.0, f64::NEG_INFINITY] {
                    let value = Scalar::from(value);
                    assert_eq!(
                        bits(mask_fill(x.clone(), mask.clone(), value)),
                        bits(Flex::float_mask_fill(x.clone(), mask.clone(), value)),
                        "{dtype:?} {shape:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_autodiff_node_gives_burns_values_and_gradient() {
        use burn::tensor::{Bool, Tensor, TensorPrimitive};
        type A = Autodiff<Flex>;
        let device = Default::default();
        let shape = [2, 3, 9, 9];
        let len: usize = shape.iter().product();
        let x: Vec<f32> = (0..len)
            .map(|i| ((i * 37) % 101) as f32 / 10.0 - 5.0)
            .collect();
        let w: Vec<f32> = (0..len)
            .map(|i| ((i * 53) % 97) as f32 / 9.0 - 5.0)
            .collect();
        let mask = Tensor::<A, 4, Bool>::from_data(
            TensorData::new(
                (0..2 * 81)
                    .map(|i| i % 9 > (i / 9) % 9)
                    .collect::<Vec<bool>>(),
                [2, 1, 9, 9],
            ),
            &device,
        );
        let run = |ours: bool| {
            let x = Tensor::<A, 4>::from_data(TensorData::new(x.clone(), shape), &device)
                .require_grad();
            let y = match ours {
                true => Tensor::from_primitive(TensorPrimitive::Float(mask_fill_tracked(
                    x.clone().into_primitive().tensor(),
                    mask.clone().into_primitive(),
                    Scalar::from(-1e4),
                ))),
                false => x.clone().mask_fill(mask.clone(), -1e4),
            };
            let weights = Tensor::<A, 4>::from_data(TensorData::new(w.clone(), shape), &device);
            let grads = (y.clone() * weights).sum().backward();
            let grad = x.grad(&grads).expect("x is tracked");
            (
                y.into_data().bytes.to_vec(),
                grad.into_data().bytes.to_vec(),
            )
        };
        assert_eq!(run(true), run(false));
    }

    #[test]
    fn a_view_of_the_tensor_and_a_mask_that_does_not_broadcast() {
        let x = Flex::float_swap_dims(floats(&[6, 5], FloatDType::BF16), 0, 1);
        let mask = bools(&[5, 6], 5);
        let value = Scalar::from(-1e4);
        assert_eq!(
            bits(mask_fill(x.clone(), mask.clone(), value)),
            bits(Flex::float_mask_fill(x, mask, value))
        );
        // `[3]` against `[5, 6]`: no broadcast, so no kernel.
        let shape = Layout::contiguous([5, 6].into());
        assert!(broadcast_strides(&[5, 6], &shape).is_some());
        assert!(broadcast_strides(&[5, 6], &Layout::contiguous([3].into())).is_none());
        assert!(broadcast_strides(&[6], &shape).is_none());
    }
}
