//! Autocast's lower-class 2-D convolution on Flex, whose own half-precision one is slow.
//!
//! Flex 0.21 convolves bf16 tensors by widening them to f32 one scalar conversion at a time,
//! convolving in f32 and rounding the result back (`bf16_via_f32!` in
//! `burn-flex-0.21.0/src/ops/conv_common.rs`), and f16 ones with the `gemm` crate's f16 kernels,
//! 1.4× the f32 step of a small conv net. Its backward pass does the same through transposed
//! convolutions and half-precision sums. On [`Route::Widened`] the operands are widened with
//! the vectorised conversions of [`fast_cast`](super::fast_cast), the convolution and its
//! gradients run in f32 (Flex's own kernels), and each result is rounded once: for bf16 the
//! bits Flex gives; for f16 a convolution with f32 accumulation, as for bf16, in place of f16
//! sums.
//!
//! On [`Route::Fastest`], the convolution and its gradients run instead as GEMMs over `im2col`
//! patches ([`half_conv`]), f32 sums rounded once: on the dot-product GEMM for bf16 where the
//! CPU has AVX512-BF16, on Flex's f32 GEMM over widened patches otherwise. Flex's convolution
//! spends about half its time in copies around its GEMMs; on a small conv net the bf16 step
//! took a third of f32's time this way. Grouped convolutions, which the GEMMs do not compute,
//! take the widened road on either route.
//!
//! The decorator runs a `conv1d` as a convolution of one-pixel-high images through here.
//!
//! Under autodiff the node ([`conv2d_tracked`]) saves the half operands (half the memory of
//! f32 ones) and the forward's route for the backward pass.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Bytes, DType};
use burn_backend::FloatDType;
use burn_backend::ops::{ConvOptions, ModuleOps};
use burn_backend::tensor::FloatTensor;

use burn_accelerate_kernels::f32_gemm::Kernel;
use burn_accelerate_kernels::half::Half as _;
use burn_accelerate_kernels::half_conv::{self, Conv2dOptions, Geometry, SumOrder};
use burn_accelerate_kernels::several_threads;

use super::Route;
use super::fast_cast::convert;
use super::half_kernels::{TASK, with_half};
use super::low_gemm::kernel_for;

fn wide(t: &FlexTensor) -> FlexTensor {
    convert(t.clone(), FloatDType::F32)
}

fn round(t: FlexTensor, dtype: DType) -> FlexTensor {
    convert(t, FloatDType::from(dtype))
}

/// The convolution of half tensors: f32 sums, bias included, rounded once.
pub(crate) fn conv2d(
    x: FlexTensor,
    weight: FlexTensor,
    bias: Option<FlexTensor>,
    options: ConvOptions<2>,
    route: Route,
) -> FlexTensor {
    if let Some(out) = conv2d_by_gemm(&x, &weight, bias.as_ref(), &options, route) {
        return out;
    }
    let dtype = x.dtype();
    let out = Flex::conv2d(wide(&x), wide(&weight), bias.as_ref().map(wide), options);
    round(out, dtype)
}

// The kernel and geometry of the convolution as `im2col` GEMMs (`half_conv`): bf16 on the
// dot-product GEMM where the CPU has it, the f32 GEMM otherwise; none on `Route::Widened`
// (Flex's own convolution, for its bits) or for what the GEMMs do not compute (groups).
fn gemm_conv(
    x: &FlexTensor,
    weight: &FlexTensor,
    options: &ConvOptions<2>,
    route: Route,
) -> Option<(Kernel, Geometry)> {
    if route == Route::Widened {
        return None;
    }
    let kernel = kernel_for(x.dtype(), route);
    let options = Conv2dOptions::new(
        options.stride,
        options.padding,
        options.dilation,
        options.groups,
    );
    let geometry = Geometry::new(x.layout().shape(), weight.layout().shape(), &options)?;
    Some((kernel, geometry))
}

fn half_tensor(bits: Vec<u16>, shape: &[usize], dtype: DType) -> FlexTensor {
    let layout = Layout::contiguous(shape.to_vec().into());
    FlexTensor::new(Bytes::from_elems(bits), layout, dtype)
}

// The convolution as `im2col` GEMMs, where they apply.
fn conv2d_by_gemm(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
    options: &ConvOptions<2>,
    route: Route,
) -> Option<FlexTensor> {
    let (kernel, geometry) = gemm_conv(x, weight, options, route)?;
    let (x, weight, bias) = (x.to_contiguous(), weight.to_contiguous(), bias.map(wide));
    let bias = bias.as_ref().map(|b| b.storage::<f32>());
    let out = with_half!(x.dtype(), H => {
        half_conv::forward::<H>(kernel, &geometry, x.storage(), weight.storage(), bias)
    }, _ => None)?;
    Some(half_tensor(out, &geometry.output_shape(), x.dtype()))
}

// The bias's gradient: the half output gradient's summed over batch and positions, one f32
// sum per channel, rounded once. Each plane is widened into a buffer of its own as it is
// summed, not the whole gradient. On `Route::Widened` each sum is taken in Flex's order
// (batch, then position: Flex's bits); on `Route::Fastest` each plane is summed in 16 lanes
// that vectorise (a single chain of dependent additions was 6% of a bf16 conv net's step).
// Channels are summed in tasks on rayon's threads where the gradient is large (on one thread
// this was 1% of that step, with the other threads idle); each sum runs over the images in
// order either way.
//
// `grad` is contiguous.
fn bias_grad(grad: &FlexTensor, route: Route) -> FlexTensor {
    let dtype = grad.dtype();
    let shape = grad.layout().shape();
    let sizes = [shape[0], shape[1], shape[2] * shape[3]];
    let bytes = with_half!(dtype, H => {
        let values: &[H] = grad.storage();
        // On threads from two tasks' worth up, as the elementwise kernels.
        let parallel = values.len() > TASK && several_threads();
        let order = match route {
            Route::Widened => SumOrder::InOrder,
            Route::Fastest => SumOrder::InLanes,
        };
        let sums = half_conv::channel_sums(values, sizes, order, parallel);
        let mut out = vec![H::default(); sums.len()];
        H::round(&sums, &mut out);
        Bytes::from_elems(out)
    }, _ => unreachable!("the hook admits half tensors only"));
    FlexTensor::new(bytes, Layout::contiguous([sizes[1]].into()), dtype)
}

// The node's state: the half operands, the options and the route of the forward pass.
#[derive(Debug, Clone)]
struct Saved {
    x: FlexTensor,
    weight: FlexTensor,
    options: ConvOptions<2>,
    route: Route,
}

// The gradients of a convolution's parents `[x, weight, bias]` (bias absent without one).
fn backward(saved: Saved, parents: &[Option<NodeId>], grad: FlexTensor, grads: &mut Gradients) {
    let want = [0, 1, 2].map(|i| matches!(parents.get(i), Some(Some(_))));
    let Saved {
        x,
        weight,
        options,
        route,
    } = saved;
    let computed = conv2d_gradients(x, weight, options, route, grad, want);
    // The bias's first, then the input's and the weight's, as computed.
    for i in [2, 0, 1] {
        if let (Some(Some(id)), Some(grad)) = (parents.get(i), computed[i].clone()) {
            grads.register::<Flex>(*id, grad);
        }
    }
}

/// The half gradients of [`conv2d`] of `x` and `weight` for the output gradient `grad`, on
/// `route`: the input's, the weight's and the bias's, each where `want` asks for it (the
/// node's backward, [`conv2d_tracked`]'s, without the node: ZeRO stage 3's bounded
/// convolution, which gathers the weight for it alone, runs the same).
pub(crate) fn conv2d_gradients(
    x: FlexTensor,
    weight: FlexTensor,
    options: ConvOptions<2>,
    route: Route,
    grad: FlexTensor,
    [want_x, want_weight, want_bias]: [bool; 3],
) -> [Option<FlexTensor>; 3] {
    let (dtype, grad) = (grad.dtype(), grad.to_contiguous());
    let bias = want_bias.then(|| bias_grad(&grad, route));
    if !want_x && !want_weight {
        return [None, None, bias];
    }
    if let Some((kernel, geometry)) = gemm_conv(&x, &weight, &options, route) {
        let want = [want_x, want_weight];
        let (xc, wc) = (x.to_contiguous(), weight.to_contiguous());
        let computed = with_half!(dtype, H => {
            half_conv::backward::<H>(kernel, &geometry, xc.storage(), wc.storage(), grad.storage(), want)
        }, _ => None);
        if let Some([dx, dw]) = computed {
            let as_tensor = |bits: Option<Vec<u16>>, shape: &[usize]| {
                bits.map(|bits| half_tensor(bits, shape, dtype))
            };
            let dx = as_tensor(dx, x.layout().shape());
            let dw = as_tensor(dw, weight.layout().shape());
            return [dx, dw, bias];
        }
    }
    let (x32, w32, g32) = (wide(&x), wide(&weight), wide(&grad));
    let dx = want_x.then(|| {
        let dx = Flex::conv2d_x_backward(x32.clone(), w32.clone(), g32.clone(), options.clone());
        round(dx, dtype)
    });
    let dw =
        want_weight.then(|| round(Flex::conv2d_weight_backward(x32, w32, g32, options), dtype));
    [dx, dw, bias]
}

#[derive(Debug)]
struct Conv;

// One node for both arities: `[x, weight]`, or `[x, weight, bias]`.
impl<const N: usize> Backward<Flex, N> for Conv {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        backward(ops.state, &parents, grad, grads);
    }
}

// The convolution's node over `parents`, or none where no parent is tracked.
fn node<const N: usize>(
    parents: [&FloatTensor<Autodiff<Flex>>; N],
    saved: Saved,
    output: FlexTensor,
) -> FloatTensor<Autodiff<Flex>> {
    let parents = parents.map(|parent| parent.node.clone());
    match Conv
        .prepare::<NoCheckpointing>(parents)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(saved, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

/// [`conv2d`] as a node of Burn's autodiff: the gradients on the same route.
pub(crate) fn conv2d_tracked(
    x: FloatTensor<Autodiff<Flex>>,
    weight: FloatTensor<Autodiff<Flex>>,
    bias: Option<FloatTensor<Autodiff<Flex>>>,
    options: ConvOptions<2>,
    route: Route,
) -> FloatTensor<Autodiff<Flex>> {
    let saved = Saved {
        x: x.primitive.clone(),
        weight: weight.primitive.clone(),
        options: options.clone(),
        route,
    };
    let output = conv2d(
        x.primitive.clone(),
        weight.primitive.clone(),
        bias.as_ref().map(|b| b.primitive.clone()),
        options,
        route,
    );
    match &bias {
        Some(bias) => node([&x, &weight, bias], saved, output),
        None => node([&x, &weight], saved, output),
    }
}
