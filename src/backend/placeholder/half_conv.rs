//! ZeRO stage 3's bounded `conv2d` (and `conv1d`, which `lowered::conv1d` runs as a 2-D
//! convolution of one-pixel-high images: here with the weight's reshape inside the node)
//! under bf16 and f16 autocast (FSDP's `param_dtype`), on `Autodiff<Flex>` where autocast
//! runs the crate's half convolution ([`low_conv::conv2d_tracked`]): the weight and bias are gathered in the half type the op
//! runs in (each process casts its f32 slice and sends halves, as `half` does for `linear`), for
//! the forward op alone, and the weight again for the backward pass, whose input and weight
//! gradients both read it there (the im2col GEMMs take the weight whole); the gradients
//! reach the f32 parameters through their anchors, cast back to f32 as autocast's cast node
//! casts them.
//!
//! The numbers are the op's own under autocast at stage 2, bit for bit: the halves every
//! process receives are the cast of the f32 value (`half::gather_cast`), and the forward and
//! backward are `conv2d_tracked`'s ([`low_conv::conv2d`], [`low_conv::conv2d_gradients`]).

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn_backend::ops::ConvOptions;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, FloatDType, TensorMetadata};

use crate::cpu::Route;
use crate::cpu::low_conv;
use crate::hooks::{self, HookKind};

use super::half::{HalfWeight, cast, gather_cast};
use super::{Shard, count_dropped};

/// A convolution's inputs, given back where `B` has no hook or the process runs the
/// backend's own half convolution.
type Inputs<B, O> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, O);

/// The hook's signature: the cast input (half), the weight's and the bias's anchors (f32; a
/// bias that is no parameter already cast), their shards, the options, the half type, the
/// kernels' route, and whether the weight is a `conv1d`'s (`[out, in, k]`, read as
/// `[out, in, 1, k]`).
type HalfConv2d<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    ConvOptions<2>,
    FloatDType,
    Route,
    bool,
) -> FloatTensor<B>;

struct HalfConvHooks;

impl HookKind for HalfConvHooks {
    fn register_known() {
        hooks::insert::<HalfConvHooks, Autodiff<Flex>, _>(
            bounded_half_conv2d as HalfConv2d<Autodiff<Flex>>,
        );
    }
}

/// `conv2d` under bf16/f16 autocast where `lowered::conv2d` runs it on the crate's half
/// convolution (`B` has the hook, the process takes the crate's kernels): `x` cast to
/// `dtype`, the parameters' anchors, gathered in `dtype` for the op alone. The inputs back
/// otherwise.
pub(super) fn conv2d<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    options: ConvOptions<2>,
    dtype: FloatDType,
) -> Result<FloatTensor<B>, Inputs<B, ConvOptions<2>>> {
    let Some(half_conv2d) = hooks::get::<HalfConvHooks, B, HalfConv2d<B>>() else {
        return Err((x, weight, bias, options));
    };
    let Some((_, route)) = crate::backend::lowered::chosen::<B>() else {
        return Err((x, weight, bias, options));
    };
    Ok(half_conv2d(
        x,
        weight,
        bias,
        weight_shard,
        bias_shard,
        options,
        dtype,
        route,
        false,
    ))
}

/// `conv1d` as `lowered::conv1d` runs it on the crate's half convolution: a 2-D convolution
/// of one-pixel-high images, the input and output reshaped around it as there, the weight
/// reshaped inside the node (its halves are gathered there). The inputs back where
/// [`conv2d`] gives them back.
pub(super) fn conv1d<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    options: ConvOptions<1>,
    dtype: FloatDType,
) -> Result<FloatTensor<B>, Inputs<B, ConvOptions<1>>> {
    let (x_shape, w_shape) = (x.shape(), weight.shape());
    let Some(half_conv2d) = hooks::get::<HalfConvHooks, B, HalfConv2d<B>>() else {
        return Err((x, weight, bias, options));
    };
    if x_shape.num_dims() != 3 || w_shape.num_dims() != 3 {
        return Err((x, weight, bias, options));
    }
    let Some((_, route)) = crate::backend::lowered::chosen::<B>() else {
        return Err((x, weight, bias, options));
    };
    let options = ConvOptions::new(
        [1, options.stride[0]],
        [0, options.padding[0]],
        [1, options.dilation[0]],
        options.groups,
    );
    let x = B::float_reshape(x, [x_shape[0], x_shape[1], 1, x_shape[2]].into());
    let out = half_conv2d(
        x,
        weight,
        bias,
        weight_shard,
        bias_shard,
        options,
        dtype,
        route,
        true,
    );
    let out_shape = out.shape();
    Ok(B::float_reshape(
        out,
        [out_shape[0], out_shape[1], out_shape[3]].into(),
    ))
}

// A `conv1d`'s weight `[out, in, k]` as `lowered::conv1d` reads it, `[out, in, 1, k]`.
fn as_2d(weight: FlexTensor) -> FlexTensor {
    let shape = weight.shape();
    Flex::float_reshape(weight, [shape[0], shape[1], 1, shape[2]].into())
}

// The node's state: the half input, the weight's placeholder, the options.
type State = (FlexTensor, HalfWeight, ConvOptions<2>);

#[derive(Debug)]
struct BoundedHalfConv2d {
    route: Route,
    dtype: FloatDType,
    // A `conv1d`'s weight, reshaped to 2-D for the kernel and its gradient back.
    flat_weight: bool,
    // Whether the bias is a parameter (its gradient cast to f32) or a tensor autocast cast.
    bias_registered: bool,
}

// One node for both arities: `[x, weight]`, or `[x, weight, bias]`.
impl<const N: usize> Backward<Flex, N> for BoundedHalfConv2d {
    type State = State;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node);
        let parents = ops.parents.map(|parent| parent.map(|node| node.id));
        let want = [0, 1, 2].map(|i| matches!(parents.get(i), Some(Some(_))));
        let (x, weight, options) = ops.state;
        // The GEMMs read the whole weight for either gradient; the bias's alone reads none.
        let (whole, bytes) = match want[0] || want[1] {
            true => gather_cast(weight.shard.as_ref(), &weight.tensor, self.dtype),
            false => (weight.tensor.clone(), 0),
        };
        let whole = match self.flat_weight {
            true => as_2d(whole),
            false => whole,
        };
        let [dx, dw, db] = low_conv::conv2d_gradients(x, whole, options, self.route, grad, want);
        count_dropped(bytes);
        // The input's as it is (half); each parameter's cast to f32 as its cast node's
        // backward casts it.
        let to_param = |grad: FlexTensor| cast(grad, FloatDType::F32);
        let dw = dw.map(|grad| match self.flat_weight {
            true => Flex::float_reshape(grad, weight.tensor.shape()),
            false => grad,
        });
        let db = match self.bias_registered {
            true => db.map(to_param),
            false => db,
        };
        for (i, grad) in [(2, db), (0, dx), (1, dw.map(to_param))] {
            if let (Some(Some(id)), Some(grad)) = (parents.get(i), grad) {
                grads.register::<Flex>(*id, grad);
            }
        }
    }
}

// `low_conv::conv2d_tracked`'s forward on the weight and bias gathered in `dtype`, in one
// node that keeps the weight's placeholder instead of its halves.
#[allow(clippy::too_many_arguments)]
fn bounded_half_conv2d(
    x: FloatTensor<Autodiff<Flex>>,
    weight: FloatTensor<Autodiff<Flex>>,
    bias: Option<FloatTensor<Autodiff<Flex>>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    options: ConvOptions<2>,
    dtype: FloatDType,
    route: Route,
    flat_weight: bool,
) -> FloatTensor<Autodiff<Flex>> {
    let (whole_weight, mut bytes) = gather_cast(weight_shard.as_ref(), &weight.primitive, dtype);
    let whole_weight = match flat_weight {
        true => as_2d(whole_weight),
        false => whole_weight,
    };
    let whole_bias = match (&bias, &bias_shard) {
        (Some(bias), Some(shard)) => {
            let (whole, counted) = gather_cast(shard.as_ref(), &bias.primitive, dtype);
            bytes += counted;
            Some(whole)
        }
        // Cast by autocast before the op.
        (Some(bias), None) => Some(bias.primitive.clone()),
        (None, _) => None,
    };
    let output = low_conv::conv2d(
        x.primitive.clone(),
        whole_weight,
        whole_bias,
        options.clone(),
        route,
    );
    count_dropped(bytes);
    let state = (
        x.primitive.clone(),
        HalfWeight {
            tensor: weight.primitive.clone(),
            shard: weight_shard,
        },
        options,
    );
    let node = BoundedHalfConv2d {
        route,
        dtype,
        flat_weight,
        bias_registered: bias_shard.is_some(),
    };
    match bias {
        Some(bias) => match node
            .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match node
            .prepare::<NoCheckpointing>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    }
}
