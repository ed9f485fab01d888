//! ZeRO stage 3's bounded `conv2d` under bf16 and f16 autocast (FSDP's `param_dtype`), on
//! `Autodiff<Flex>` where autocast runs the crate's half convolution
//! ([`low_conv::conv2d_tracked`]): the weight and bias are gathered in the half type the op
//! runs in (the owner casts its f32 value and sends halves, as `half` does for `linear`), for
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
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use crate::cpu::Route;
use crate::cpu::low_conv;
use crate::hooks::{self, HookKind};

use super::half::{HalfWeight, cast, gather_cast};
use super::{Shard, anchored, count_dropped, resolve, resolve_opt, shard_of};

/// `conv2d`'s inputs, given back where `B` has no hook.
type Conv2dInputs<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    ConvOptions<2>,
);

/// The hook's signature: the cast input (half), the weight's and the bias's anchors (f32),
/// their shards, the options, the half type and the kernels' route.
type HalfConv2d<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    ConvOptions<2>,
    FloatDType,
    Route,
) -> FloatTensor<B>;

struct HalfConvHooks;

impl HookKind for HalfConvHooks {
    fn register_known() {
        hooks::insert::<HalfConvHooks, Autodiff<Flex>, _>(
            bounded_half_conv2d as HalfConv2d<Autodiff<Flex>>,
        );
    }
}

/// `conv2d` under bf16/f16 autocast of the registered parameter `weight` (`x` not one), where
/// `B` has the half hook (`Autodiff<Flex>`): the op's own path (`crate::backend::forward`'s
/// `conv2d`: the cast plan, the casts, `lowered::conv2d`), the plan decided once, with the
/// weight and bias gathered in the half type for the op alone where the op runs on the
/// crate's half convolution; otherwise gathered whole in f32 and cast, as every other op
/// reads a parameter. The inputs back where `B` has no hook.
pub(super) fn autocast_conv2d<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
    weight_shard: Arc<dyn Shard>,
) -> Result<FloatTensor<B>, Conv2dInputs<B>> {
    use crate::autocast::{CastInput, CastPlan, Op};
    let Some(half_conv2d) = hooks::get::<HalfConvHooks, B, HalfConv2d<B>>() else {
        return Err((x, weight, bias, options));
    };
    let plan = CastPlan::new::<B>(
        Op::Conv2d,
        &[
            CastInput::One(&x),
            CastInput::One(&weight),
            CastInput::Maybe(&bias),
        ],
    );
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    let x = plan.cast_at::<B>(0, x);
    let target = plan
        .target()
        .filter(|t| matches!(t, FloatDType::BF16 | FloatDType::F16));
    // `lowered::conv2d`'s conditions for the kernel: half operands of one dtype (the plan
    // casts the f32 parameters to it).
    let kernel_applies = target.is_some_and(|t| x.dtype() == DType::from(t))
        && weight.dtype() == DType::F32
        && bias
            .as_ref()
            .is_none_or(|b| b.dtype() == DType::F32 && bias_shard.is_some());
    if let (Some(target), true) = (target, kernel_applies)
        && let Some((_, route)) = crate::backend::lowered::chosen::<B>()
    {
        let weight = anchored::<B>(weight, Some(&x), weight_shard.clone());
        let bias = match (bias, &bias_shard) {
            (Some(bias), Some(shard)) => Some(anchored::<B>(bias, Some(&x), shard.clone())),
            (bias, _) => bias,
        };
        return Ok(half_conv2d(
            x,
            weight,
            bias,
            weight_shard,
            bias_shard,
            options,
            target,
            route,
        ));
    }
    let weight = plan.cast_at::<B>(1, resolve::<B>(weight));
    let bias = plan.cast_opt::<B>(resolve_opt::<B>(bias));
    Ok(crate::backend::lowered::conv2d::<B>(
        &plan, x, weight, bias, options,
    ))
}

// The node's state: the half input, the weight's placeholder, the options.
type State = (FlexTensor, HalfWeight, ConvOptions<2>);

#[derive(Debug)]
struct BoundedHalfConv2d {
    route: Route,
    dtype: FloatDType,
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
        let [dx, dw, db] = low_conv::conv2d_gradients(x, whole, options, self.route, grad, want);
        count_dropped(bytes);
        // The input's as it is (half); each parameter's cast to f32 as its cast node's
        // backward casts it.
        let to_param = |grad: FlexTensor| cast(grad, FloatDType::F32);
        for (i, grad) in [(2, db.map(to_param)), (0, dx), (1, dw.map(to_param))] {
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
) -> FloatTensor<Autodiff<Flex>> {
    let (whole_weight, mut bytes) = gather_cast(weight_shard.as_ref(), &weight.primitive, dtype);
    let whole_bias = match (&bias, &bias_shard) {
        (Some(bias), Some(shard)) => {
            let (whole, counted) = gather_cast(shard.as_ref(), &bias.primitive, dtype);
            bytes += counted;
            Some(whole)
        }
        (Some(bias), None) => Some(cast(bias.primitive.clone(), dtype)),
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
    let node = BoundedHalfConv2d { route, dtype };
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
