//! Autocast's lower-class matmul, linear and convolutions on the crate's own kernels, where
//! they apply.
//!
//! `scripts/gen_forwarding.py` routes the autocast call of `float_matmul`, `linear`, `conv1d`
//! and `conv2d` here, after the inputs were cast. Each takes the kernel registered for `B`
//! ([`kernels`]) when four things hold, and `B`'s own op otherwise:
//! - autocast lowers the call (a run with autocast off is the backend's own);
//! - the operands are what the kernel takes (half tensors of one dtype; for a matmul, 2-D or
//!   batches whose leading dimensions are equal or broadcast, a size 1 on one side);
//! - `B` has the kernel (Flex and `Autodiff<Flex>`);
//! - the process's half path takes it: always, by rule (never by a timing), unless
//!   the context fixed the backend's own (`HalfPath::Own`).

use burn_backend::ops::ConvOptions;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};

use super::kernels::{self, Kernels, Route};
use crate::autocast::{self, CastPlan};
use crate::capability::{self, HalfPath};

/// Whether `x`, `weight` and `bias` (if any) are all bf16 or all f16: the operands the
/// kernels of lower-class ops take.
fn half_operands<T: TensorMetadata>(x: &T, weight: &T, bias: Option<&T>) -> bool {
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    half && weight.dtype() == x.dtype() && bias.is_none_or(|b| b.dtype() == x.dtype())
}

// The shapes the two half matmul operands take for the kernel, which multiplies batches of
// one size: each leading (batch) dimension the larger of the two where the other is 1, as
// Burn broadcasts them; the matrices' own dimensions kept. `None` where the kernel does not
// apply (other dtypes, fewer than two dimensions, ranks that differ, batch sizes that
// neither equal nor broadcast).
fn batch_shapes<T: TensorMetadata>(a: &T, b: &T) -> Option<(Shape, Shape)> {
    if !half_operands(a, b, None) {
        return None;
    }
    broadcast_batches(a.shape(), b.shape())
}

/// The shapes two matmul operands of shapes `a_shape` and `b_shape` take for the crate's
/// kernel (see `batch_shapes`), whatever their dtypes: stage 3's bounded half `matmul` expands
/// a gathered parameter as this path expands it.
pub(crate) fn broadcast_batches(mut a_shape: Shape, mut b_shape: Shape) -> Option<(Shape, Shape)> {
    let dims = a_shape.num_dims();
    if dims < 2 || b_shape.num_dims() != dims {
        return None;
    }
    for d in 0..dims - 2 {
        match (a_shape[d], b_shape[d]) {
            (x, y) if x == y => {}
            (1, y) => a_shape[d] = y,
            (x, 1) => b_shape[d] = x,
            _ => return None,
        }
    }
    Some((a_shape, b_shape))
}

// The kernels for `B` and the route they take, where autocast takes them: always, unless the
// process fixed the backend's own path (a rule, see `capability`'s docs).
pub(crate) fn chosen<B: Backend>() -> Option<(Kernels<B>, Route)> {
    let kernels = kernels::of::<B>()?;
    let take = match capability::half_path() {
        HalfPath::ViaF32 | HalfPath::Widened => true,
        HalfPath::Own => false,
    };
    take.then(|| {
        autocast::record_crate_kernel();
        (kernels, capability::route())
    })
}

/// `B::float_matmul` of an autocast call, on the registered kernel where it applies (see the
/// [module docs](self)).
#[inline]
pub(crate) fn matmul<B: Backend>(
    plan: &CastPlan,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
) -> FloatTensor<B> {
    if plan.target().is_some()
        && let Some((a_shape, b_shape)) = batch_shapes(&a, &b)
        && let Some((kernels, route)) = chosen::<B>()
    {
        // A broadcast operand is expanded as a view (stride 0 over the batch: the dot-product
        // and tile kernels read it in place, the widened route copies it out), and Burn's
        // expand node sums its gradient over the broadcast dimensions, in the half type, as
        // Burn's own matmul's backward does.
        let expanded = |t: FloatTensor<B>, shape: Shape| match t.shape() == shape {
            true => t,
            false => B::float_expand(t, shape),
        };
        return (kernels.matmul)(expanded(a, a_shape), expanded(b, b_shape), route);
    }
    B::float_matmul(a, b)
}

/// `B::linear` of an autocast call, as [`matmul`]. An input of more than two dimensions
/// (`[batch, sequence, features]`, say) goes through as the matrix of its rows, reshaped
/// back after: one GEMM, and a weight gradient summed over every row in f32 where Burn's
/// default sums per-batch products in the half type.
#[inline]
pub(crate) fn linear<B: Backend>(
    plan: &CastPlan,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let dims = x.shape().num_dims();
    if plan.target().is_some()
        && dims >= 2
        && weight.shape().num_dims() == 2
        && half_operands(&x, &weight, bias.as_ref())
        && let Some((kernels, route)) = chosen::<B>()
    {
        if dims == 2 {
            return (kernels.linear)(x, weight, bias, route);
        }
        let shape = x.shape();
        let features = shape[dims - 1];
        let rows = shape.num_elements() / features.max(1);
        let mut out_shape = shape.clone();
        out_shape[dims - 1] = weight.shape()[1];
        let x = B::float_reshape(x, [rows, features].into());
        let product = (kernels.linear)(x, weight, bias, route);
        return B::float_reshape(product, out_shape);
    }
    B::linear(x, weight, bias)
}

// The conv2d kernel and its route, where they apply to these operands.
fn conv_kernel<B: Backend>(
    plan: &CastPlan,
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
) -> Option<(Kernels<B>, Route)> {
    let applies = plan.target().is_some() && half_operands(x, weight, bias);
    applies.then(chosen::<B>).flatten()
}

/// `B::conv2d` of an autocast call, on the registered kernel where it applies (see the
/// [module docs](self)).
#[inline]
pub(crate) fn conv2d<B: Backend>(
    plan: &CastPlan,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
) -> FloatTensor<B> {
    match conv_kernel::<B>(plan, &x, &weight, bias.as_ref()) {
        Some((kernels, route)) => (kernels.conv2d)(x, weight, bias, options, route),
        None => B::conv2d(x, weight, bias, options),
    }
}

/// `B::conv1d` of an autocast call: where the 2-D kernel applies, as a convolution of
/// one-pixel-high images (`[batch, channels, 1, length]`, kernel `1 × k`) reshaped back after,
/// so that 1-D convolutions (audio, sequences) take the same GEMMs.
#[inline]
pub(crate) fn conv1d<B: Backend>(
    plan: &CastPlan,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<1>,
) -> FloatTensor<B> {
    let (x_shape, w_shape) = (x.shape(), weight.shape());
    if x_shape.num_dims() == 3
        && w_shape.num_dims() == 3
        && let Some((kernels, route)) = conv_kernel::<B>(plan, &x, &weight, bias.as_ref())
    {
        let as_2d = |shape: &Shape| Shape::from([shape[0], shape[1], 1, shape[2]]);
        let options = ConvOptions::new(
            [1, options.stride[0]],
            [0, options.padding[0]],
            [1, options.dilation[0]],
            options.groups,
        );
        let x = B::float_reshape(x, as_2d(&x_shape));
        let weight = B::float_reshape(weight, as_2d(&w_shape));
        let out = (kernels.conv2d)(x, weight, bias, options, route);
        let out_shape = out.shape();
        return B::float_reshape(out, [out_shape[0], out_shape[1], out_shape[3]].into());
    }
    B::conv1d(x, weight, bias, options)
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::backend::Flex;
    use burn::backend::flex::FlexTensor;
    use burn::tensor::TensorData;
    use burn_backend::FloatDType;
    use burn_backend::ops::FloatTensorOps;

    use super::batch_shapes;

    fn t(shape: &[usize]) -> FlexTensor {
        let n = shape.iter().product();
        let data = TensorData::new(vec![1f32; n], shape.to_vec());
        Flex::float_cast(FlexTensor::from_data(data), FloatDType::BF16)
    }

    fn shapes(a: &[usize], b: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
        batch_shapes(&t(a), &t(b)).map(|(a, b)| (a.to_vec(), b.to_vec()))
    }

    #[test]
    fn the_gemm_takes_batches_of_one_size_or_broadcast_to_one() {
        let same = |a: &[usize], b: &[usize]| Some((a.to_vec(), b.to_vec()));
        assert_eq!(shapes(&[4, 5], &[5, 6]), same(&[4, 5], &[5, 6]));
        assert_eq!(
            shapes(&[2, 3, 4, 5], &[2, 3, 5, 6]),
            same(&[2, 3, 4, 5], &[2, 3, 5, 6])
        );
        // Broadcast batches: expanded to the larger size, on either side or both.
        assert_eq!(shapes(&[2, 4, 5], &[1, 5, 6]), same(&[2, 4, 5], &[2, 5, 6]));
        assert_eq!(shapes(&[1, 4, 5], &[3, 5, 6]), same(&[3, 4, 5], &[3, 5, 6]));
        assert_eq!(
            shapes(&[2, 1, 4, 5], &[1, 3, 5, 6]),
            same(&[2, 3, 4, 5], &[2, 3, 5, 6])
        );
        // The matrices' own sizes are not broadcast: a 1 there stays.
        assert_eq!(shapes(&[2, 1, 5], &[1, 5, 1]), same(&[2, 1, 5], &[2, 5, 1]));
    }

    #[test]
    fn other_operands_go_to_the_backends_own_matmul() {
        // Ranks that differ, vectors, batch sizes that do not broadcast, mixed dtypes.
        assert_eq!(shapes(&[2, 4, 5], &[5, 6]), None);
        assert_eq!(shapes(&[5], &[5]), None);
        assert_eq!(shapes(&[2, 4, 5], &[3, 5, 6]), None);
        let f32s = FlexTensor::from_data(TensorData::new(vec![1f32; 30], [5, 6]));
        assert!(batch_shapes(&t(&[4, 5]), &f32s).is_none());
    }
}
