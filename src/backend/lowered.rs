//! Autocast's lower-class matmul, linear and convolutions on the crate's own kernels, where
//! they apply.
//!
//! `scripts/gen_forwarding.py` routes the autocast call of `float_matmul`, `linear`, `conv1d`
//! and `conv2d` here, after the inputs were cast. Each takes the kernel registered for `B`
//! ([`kernels`]) when four things hold, and `B`'s own op otherwise:
//! - autocast lowers the call (a run with autocast off is the backend's own);
//! - the operands are what the kernel takes (half tensors of one dtype; for a matmul, 2-D or
//!   batches with the same leading dimensions);
//! - `B` has the kernel (Flex and `Autodiff<Flex>`);
//! - the process's half path takes it: always, by rule (never by a timing), unless
//!   the context fixed the backend's own (`HalfPath::Own`).

use burn_backend::ops::ConvOptions;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};

use super::kernels::{self, Kernels, Route};
use crate::autocast::CastPlan;
use crate::capability::{self, HalfPath};

/// Whether `x`, `weight` and `bias` (if any) are all bf16 or all f16: the operands the
/// kernels of lower-class ops take.
fn half_operands<T: TensorMetadata>(x: &T, weight: &T, bias: Option<&T>) -> bool {
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    half && weight.dtype() == x.dtype() && bias.is_none_or(|b| b.dtype() == x.dtype())
}

// Half matmul operands of two dimensions, or more with the same leading (batch) dimensions,
// no broadcasting: what the matmul kernel takes.
fn eligible<T: TensorMetadata>(a: &T, b: &T) -> bool {
    let (a_shape, b_shape) = (a.shape(), b.shape());
    let dims = a_shape.num_dims();
    half_operands(a, b, None)
        && dims >= 2
        && b_shape.num_dims() == dims
        && a_shape[..dims - 2] == b_shape[..dims - 2]
}

// The kernels for `B` and the route they take, where autocast takes them: always, unless the
// process fixed the backend's own path (a rule, see `capability`'s docs).
fn chosen<B: Backend>() -> Option<(Kernels<B>, Route)> {
    let kernels = kernels::of::<B>()?;
    let take = match capability::half_path() {
        HalfPath::ViaF32 | HalfPath::Widened => true,
        HalfPath::Own => false,
    };
    take.then(|| (kernels, capability::route()))
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
        && eligible(&a, &b)
        && let Some((kernels, route)) = chosen::<B>()
    {
        return (kernels.matmul)(a, b, route);
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

    use super::eligible;

    #[test]
    fn the_gemm_takes_batches_of_the_same_size_only() {
        let t = |shape: &[usize]| {
            let n = shape.iter().product();
            let data = TensorData::new(vec![1f32; n], shape.to_vec());
            Flex::float_cast(FlexTensor::from_data(data), FloatDType::BF16)
        };
        assert!(eligible(&t(&[4, 5]), &t(&[5, 6])));
        assert!(eligible(&t(&[2, 3, 4, 5]), &t(&[2, 3, 5, 6])));
        // Broadcast batches, ranks that differ, vectors: Flex's own matmul.
        assert!(!eligible(&t(&[2, 4, 5]), &t(&[1, 5, 6])));
        assert!(!eligible(&t(&[2, 4, 5]), &t(&[5, 6])));
        assert!(!eligible(&t(&[5]), &t(&[5])));
    }
}
