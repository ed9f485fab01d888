//! Strided views copied out to contiguous memory on every core, where Flex walks them one
//! value at a time.
//!
//! Multi-head attention reshapes transposed views: `[batch, heads, seq, d_k]` back to
//! `[batch, seq, d_model]` after the context product, and the gradients of the head splits
//! in the backward pass. Flex 0.21 copies a view of more than two dimensions (after merging
//! the ones that lie contiguous) through its strided iterator, one index computation per
//! value, on one thread: about a tenth of a transformer's bf16 step. Here the view's rows
//! (its last dimension) are copied as runs, on rayon's threads.
//!
//! A copy is exact, so the decorator takes this path with or without autocast: before a
//! reshape that Flex would have to copy anyway (a view that is not contiguous from its
//! buffer's start), the copy is made here and Flex's reshape of it is free. Negative strides
//! (flipped views) and views Flex copies quickly itself (one or two dimensions after merging)
//! stay Flex's.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Bytes, Shape};
use burn_backend::TensorMetadata;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;

use burn_accelerate_kernels::strided;

/// Whether Flex's reshape copies `t` (it is a view only of a tensor contiguous from its
/// buffer's start).
pub(crate) fn reshape_copies(t: &FlexTensor) -> bool {
    !(t.layout().is_contiguous() && t.layout().start_offset() == 0)
}

// The view's dimensions without those of size 1, adjacent ones merged where they lie
// contiguous: (sizes, strides), outermost first. `None` for a negative stride.
fn collapsed(layout: &Layout) -> Option<(Vec<usize>, Vec<usize>)> {
    strided::collapsed(layout.shape(), layout.strides())
}

/// `t`'s values in order, in a contiguous tensor of its shape: `t` itself where it is
/// contiguous from its buffer's start, Flex's own copy where that is quick, this module's
/// otherwise.
pub(crate) fn contiguous(t: FlexTensor) -> FlexTensor {
    if !reshape_copies(&t) {
        return t;
    }
    let copied = match collapsed(t.layout()) {
        Some((sizes, strides)) if sizes.len() > 2 => match t.dtype().size() {
            2 => Some(copy::<u16>(&t, &sizes, &strides)),
            4 => Some(copy::<u32>(&t, &sizes, &strides)),
            8 => Some(copy::<u64>(&t, &sizes, &strides)),
            _ => None,
        },
        _ => None,
    };
    match copied {
        Some(bytes) => FlexTensor::new(
            bytes,
            Layout::contiguous(Shape::from(t.layout().shape().to_vec())),
            t.dtype(),
        ),
        None => t.to_contiguous(),
    }
}

fn copy<T: bytemuck::Pod + Send + Sync>(
    t: &FlexTensor,
    sizes: &[usize],
    strides: &[usize],
) -> Bytes {
    let src: &[T] = bytemuck::cast_slice(t.bytes());
    Bytes::from_elems(strided::copy(
        src,
        t.layout().start_offset(),
        sizes,
        strides,
    ))
}

/// `Flex::float_reshape` of `t`, copied out by [`contiguous`] first where Flex would copy it.
pub(crate) fn reshape(t: FlexTensor, shape: Shape) -> FlexTensor {
    Flex::float_reshape(contiguous(t), shape)
}

/// [`reshape`] as a node of Burn's autodiff: the gradient is reshaped back the same way (the
/// gradient of a reshaped transposed view is itself a transposed view, which Burn's own node
/// hands to Flex's copy). As Burn's node, a gradient broadcast along a dimension of size 1 is
/// summed along it first.
pub(crate) fn reshape_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    shape: Shape,
) -> FloatTensor<Autodiff<Flex>> {
    #[derive(Debug)]
    struct Reshape;

    impl Backward<Flex, 1> for Reshape {
        type State = (Shape, Shape);

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let (original, shape) = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |mut grad| {
                let grad_shape = grad.shape();
                for i in 0..shape.num_dims() {
                    if shape[i] == 1 && grad_shape[i] != 1 {
                        grad = Flex::float_sum_dim(grad, i);
                    }
                }
                reshape(grad, original)
            });
        }
    }

    match Reshape
        .prepare::<NoCheckpointing>([tensor.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (tensor.primitive.shape(), shape.clone()),
            reshape(tensor.primitive, shape),
        ),
        OpsKind::UnTracked(prep) => prep.finish(reshape(tensor.primitive, shape)),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use burn_backend::FloatDType;

    use super::*;

    fn tensor(shape: &[usize], dtype: FloatDType) -> FlexTensor {
        let len: usize = shape.iter().product();
        let values: Vec<f32> = (0..len).map(|i| i as f32 * 0.25 - 7.0).collect();
        Flex::float_cast(
            FlexTensor::from_data(TensorData::new(values, shape.to_vec())),
            dtype,
        )
    }

    fn bits(t: FlexTensor) -> (Vec<usize>, Vec<u8>) {
        (t.layout().shape().to_vec(), t.into_data().bytes.to_vec())
    }

    #[test]
    fn views_copy_out_to_flexs_values() {
        for dtype in [
            FloatDType::F32,
            FloatDType::BF16,
            FloatDType::F16,
            FloatDType::F64,
        ] {
            let heads = |shape: [usize; 4]| {
                // `[b, s, h, d]` → `[b, h, s, d]`: attention's head split.
                Flex::float_swap_dims(tensor(&shape, dtype), 1, 2)
            };
            let views = [
                heads([2, 17, 3, 5]),
                heads([3, 64, 12, 32]),
                // The last dimension strided too.
                Flex::float_permute(tensor(&[4, 5, 6, 7], dtype), &[3, 1, 0, 2]),
                // An offset view (a slice) of a transposed one.
                Flex::float_slice(
                    heads([2, 9, 4, 3]),
                    &[
                        burn::tensor::Slice::from(1..2),
                        burn::tensor::Slice::from(1..4),
                    ],
                ),
                // Two dimensions and contiguous ones: Flex's own, or none.
                Flex::float_swap_dims(tensor(&[9, 7], dtype), 0, 1),
                tensor(&[3, 4, 5], dtype),
                Flex::float_swap_dims(tensor(&[1, 6, 1, 5], dtype), 0, 2),
            ];
            for view in views {
                let want = bits(view.to_contiguous());
                let copy = contiguous(view.clone());
                assert!(!reshape_copies(&copy), "{dtype:?}");
                assert_eq!(bits(copy), want, "{dtype:?} {:?}", view.layout());
            }
        }
    }

    #[test]
    fn the_autodiff_node_gives_burns_values_and_gradient() {
        use burn::tensor::{Tensor, TensorPrimitive};
        type A = Autodiff<Flex>;
        let device = Default::default();
        let shape = [2, 5, 3, 4];
        let len: usize = shape.iter().product();
        let x: Vec<f32> = (0..len)
            .map(|i| ((i * 37) % 101) as f32 / 10.0 - 5.0)
            .collect();
        let w: Vec<f32> = (0..len)
            .map(|i| ((i * 53) % 97) as f32 / 9.0 - 5.0)
            .collect();
        let run = |ours: bool| {
            let x = Tensor::<A, 4>::from_data(TensorData::new(x.clone(), shape), &device)
                .require_grad();
            // Attention's merge of the heads: `[b, h, s, d]` → `[b, s, h, d]` → `[b, s, h·d]`.
            let heads = x.clone().swap_dims(1, 2);
            let y: Tensor<A, 3> = match ours {
                true => Tensor::from_primitive(TensorPrimitive::Float(reshape_tracked(
                    heads.into_primitive().tensor(),
                    Shape::from([2, 3, 20]),
                ))),
                false => heads.reshape([2, 3, 20]),
            };
            let weights =
                Tensor::<A, 3>::from_data(TensorData::new(w.clone(), [2, 3, 20]), &device);
            // Through a transposed view again, so that the gradient arrives strided.
            let grads = (y.clone().swap_dims(0, 1) * weights.swap_dims(0, 1))
                .sum()
                .backward();
            let grad = x.grad(&grads).expect("x is tracked");
            (
                y.into_data().bytes.to_vec(),
                grad.into_data().bytes.to_vec(),
            )
        };
        assert_eq!(run(true), run(false));
    }

    #[test]
    fn dimensions_merge_where_they_lie_contiguous() {
        let layout = |t: FlexTensor| t.layout().clone();
        let t = Flex::float_swap_dims(tensor(&[2, 3, 4, 5], FloatDType::F32), 1, 2);
        // Strides [60, 5, 20, 1]: nothing merges with its neighbour.
        assert_eq!(
            collapsed(&layout(t)),
            Some((vec![2, 4, 3, 5], vec![60, 5, 20, 1]))
        );
        let t = Flex::float_swap_dims(tensor(&[2, 3, 4, 5], FloatDType::F32), 0, 1);
        // [3, 2, 4, 5] with strides [20, 60, 5, 1]: the last two merge.
        assert_eq!(
            collapsed(&layout(t)),
            Some((vec![3, 2, 20], vec![20, 60, 1]))
        );
        let flipped = Flex::float_flip(tensor(&[3, 4], FloatDType::F32), &[0]);
        assert_eq!(collapsed(&layout(flipped.clone())), None);
        assert_eq!(
            bits(contiguous(flipped.clone())),
            bits(flipped.to_contiguous())
        );
    }
}
