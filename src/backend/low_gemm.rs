//! Autocast's lower-class matmul and linear on backends with no fast half-precision GEMM.
//!
//! Flex 0.21 multiplies bf16 matrices by copying both to contiguous f32 with a scalar loop,
//! running its f32 GEMM, and rounding the result back, element by element
//! (`matmul_bf16` in `burn-flex-0.21.0/src/ops/matmul.rs`; f16 goes through the `gemm` crate's
//! f16 kernels, slower still). Its f32 GEMM reads transposed operands in place. So here the
//! half operands are widened to f32 in one vectorised pass that keeps a transposed view
//! transposed, multiplied by the f32 GEMM, and the product rounded to the half type: the
//! numbers of a half-precision GEMM with f32 accumulation, the operands kept in the half type
//! (what autodiff saves for the backward pass stays half the size), at f32 GEMM speed.
//!
//! As for the fast cast, the replacement under autodiff is a backward node of its own,
//! registered per backend type (Flex and `Autodiff<Flex>`); 2-D operands only, other shapes
//! and other backends keep the backend's own op.

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};

use crate::autocast::CastPlan;
use crate::backend::hooks::Hooks;

type MatmulHook<B> = fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>;
type LinearHook<B> = fn(FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) -> FloatTensor<B>;

static MATMUL: Hooks = Hooks::new(register_known);
static LINEAR: Hooks = Hooks::new(register_known);

fn register_known() {
    #[cfg(feature = "flex")]
    flex::register();
}

// Half operands of two dimensions: what the hooks handle.
fn eligible<T: TensorMetadata>(a: &T, b: &T) -> bool {
    let half = |t: &T| matches!(t.dtype(), DType::BF16 | DType::F16);
    half(a) && a.dtype() == b.dtype() && a.shape().num_dims() == 2 && b.shape().num_dims() == 2
}

/// `B::float_matmul` of an autocast call, through the registered half-precision path where
/// it applies: under autocast only, so that a run with autocast off is the backend's own.
#[inline]
pub(crate) fn matmul<B: Backend>(
    plan: &CastPlan,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
) -> FloatTensor<B> {
    if plan.target().is_some()
        && eligible(&a, &b)
        && let Some(hook) = MATMUL.get::<B, MatmulHook<B>>()
    {
        return hook(a, b);
    }
    B::float_matmul(a, b)
}

/// `B::linear` of an autocast call, as [`matmul`].
#[inline]
pub(crate) fn linear<B: Backend>(
    plan: &CastPlan,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let bias_fits = bias.as_ref().is_none_or(|b| b.dtype() == x.dtype());
    if plan.target().is_some()
        && bias_fits
        && eligible(&x, &weight)
        && let Some(hook) = LINEAR.get::<B, LinearHook<B>>()
    {
        return hook(x, weight, bias);
    }
    B::linear(x, weight, bias)
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
    use burn::backend::flex::FlexTensor;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Bytes, DType};
    use burn_backend::FloatDType;
    use burn_backend::ops::{FloatTensorOps, ModuleOps};
    use burn_backend::tensor::FloatTensor;
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};

    use super::{LINEAR, LinearHook, MATMUL, MatmulHook};
    use crate::backend::fast_cast::flex::convert;

    pub(super) fn register() {
        let plain: MatmulHook<Flex> = gemm;
        MATMUL.insert::<Flex, _>(plain);
        let plain: LinearHook<Flex> = linear;
        LINEAR.insert::<Flex, _>(plain);
        let tracked: MatmulHook<Autodiff<Flex>> = gemm_tracked;
        MATMUL.insert::<Autodiff<Flex>, _>(tracked);
        let tracked: LinearHook<Autodiff<Flex>> = linear_tracked;
        LINEAR.insert::<Autodiff<Flex>, _>(tracked);
    }

    // A half matrix as f32, keeping a transposed (or otherwise permuted) view as it is: the
    // f32 GEMM reads strides, where a contiguous copy would cost a strided pass.
    fn widen(t: FlexTensor) -> FlexTensor {
        let layout = t.layout().clone();
        let n = layout.num_elements();
        let stored = match t.dtype() {
            DType::BF16 => t.storage::<bf16>().len(),
            _ => t.storage::<f16>().len(),
        };
        let dense = layout.start_offset() == 0 && stored == n;
        if !dense {
            return convert(t, FloatDType::F32);
        }
        let mut out = vec![0f32; n];
        match t.dtype() {
            DType::BF16 => t.storage::<bf16>().convert_to_f32_slice(&mut out),
            _ => t.storage::<f16>().convert_to_f32_slice(&mut out),
        }
        FlexTensor::new(Bytes::from_elems(out), layout, DType::F32)
    }

    /// `a @ b` of two half matrices: f32 products and sums, rounded once to the half type.
    pub(super) fn gemm(a: FlexTensor, b: FlexTensor) -> FlexTensor {
        let dtype = FloatDType::from(a.dtype());
        let product = Flex::float_matmul(widen(a), widen(b));
        convert(product, dtype)
    }

    // `x @ w + b` as Burn's default linear computes it on half tensors: the product rounded,
    // then the bias added in the half type.
    fn linear(x: FlexTensor, weight: FlexTensor, bias: Option<FlexTensor>) -> FlexTensor {
        let output = gemm(x, weight);
        match bias {
            Some(bias) => {
                let n = bias.layout().shape()[0];
                Flex::float_add(output, Flex::float_reshape(bias, [1, n].into()))
            }
            None => output,
        }
    }

    fn transposed(t: FlexTensor) -> FlexTensor {
        Flex::float_swap_dims(t, 0, 1)
    }

    fn gemm_tracked(
        a: FloatTensor<Autodiff<Flex>>,
        b: FloatTensor<Autodiff<Flex>>,
    ) -> FloatTensor<Autodiff<Flex>> {
        #[derive(Debug)]
        struct Gemm;

        impl Backward<Flex, 2> for Gemm {
            type State = (Option<FlexTensor>, Option<FlexTensor>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (a, b) = ops.state;
                binary::<Flex, _, _>(
                    ops.parents,
                    ops.node,
                    grads,
                    |grad| gemm(grad, transposed(b.expect("kept for a's gradient"))),
                    |grad| gemm(transposed(a.expect("kept for b's gradient")), grad),
                );
            }
        }

        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        match Gemm
            .prepare::<NoCheckpointing>([a.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                // Each operand is needed for the other's gradient only.
                let state = (
                    b_tracked.then(|| a.primitive.clone()),
                    a_tracked.then(|| b.primitive.clone()),
                );
                prep.finish(state, gemm(a.primitive, b.primitive))
            }
            OpsKind::UnTracked(prep) => prep.finish(gemm(a.primitive, b.primitive)),
        }
    }

    fn linear_tracked(
        x: FloatTensor<Autodiff<Flex>>,
        weight: FloatTensor<Autodiff<Flex>>,
        bias: Option<FloatTensor<Autodiff<Flex>>>,
    ) -> FloatTensor<Autodiff<Flex>> {
        let Some(bias) = bias else {
            return gemm_tracked(x, weight);
        };
        #[derive(Debug)]
        struct Bias;

        // The bias's gradient is the sum of the output's over the batch, as Burn's
        // `linear_bias_backward`; the product's goes on unchanged.
        impl Backward<Flex, 2> for Bias {
            type State = ();

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                binary::<Flex, _, _>(
                    ops.parents,
                    ops.node,
                    grads,
                    |grad| grad,
                    Flex::linear_bias_backward,
                );
            }
        }

        let product = gemm_tracked(x, weight);
        let n = bias.primitive.layout().shape()[0];
        let row = Flex::float_reshape(bias.primitive, [1, n].into());
        let output = Flex::float_add(product.primitive, row);
        Bias.prepare::<NoCheckpointing>([product.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateless(output)
    }

    #[cfg(test)]
    mod tests {
        use burn::tensor::TensorData;

        use super::*;

        fn half(values: Vec<f32>, shape: [usize; 2], dtype: FloatDType) -> FlexTensor {
            Flex::float_cast(FlexTensor::from_data(TensorData::new(values, shape)), dtype)
        }

        fn values(n: usize, seed: u32) -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 300.0 - 3.3)
                .collect()
        }

        #[test]
        fn bf16_gemm_gives_flexs_own_bits_transposed_or_not() {
            let a = half(values(6 * 5, 1), [6, 5], FloatDType::BF16);
            let b = half(values(5 * 7, 2), [5, 7], FloatDType::BF16);
            let bits = |t: FlexTensor| t.into_data().bytes.to_vec();
            assert_eq!(
                bits(gemm(a.clone(), b.clone())),
                bits(Flex::float_matmul(a.clone(), b.clone()))
            );
            // Transposed views, as the backward pass multiplies them.
            let at = transposed(half(values(5 * 6, 3), [5, 6], FloatDType::BF16));
            let bt = transposed(half(values(7 * 5, 4), [7, 5], FloatDType::BF16));
            assert_eq!(
                bits(gemm(at.clone(), bt.clone())),
                bits(Flex::float_matmul(at, bt))
            );
        }

        #[test]
        fn f16_gemm_is_the_f32_product_rounded_once() {
            let (av, bv) = (values(8 * 16, 5), values(16 * 3, 6));
            let a = half(av.clone(), [8, 16], FloatDType::F16);
            let b = half(bv.clone(), [16, 3], FloatDType::F16);
            let exact = Flex::float_matmul(widen(a.clone()), widen(b.clone()));
            let want = Flex::float_cast(exact, FloatDType::F16);
            assert_eq!(
                gemm(a, b).into_data().bytes.to_vec(),
                want.into_data().bytes.to_vec()
            );
        }
    }
}
