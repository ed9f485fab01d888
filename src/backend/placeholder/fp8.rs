//! ZeRO stage 3's bounded `linear` and `matmul` under fp8 autocast: a parameter is gathered in
//! f32 for the op alone and rounded there by the op's own fp8 cast, and gathered and rounded
//! again in backward where the other operand's gradient needs it; the node keeps the
//! placeholder, not the rounded value.
//!
//! The numbers are stage 2's under the same recipe, bit for bit. At stage 2 autocast rounds the
//! whole f32 parameter through its fp8 cast node (`crate::fp8::Fp8Differentiable`): the
//! forward quantizer records the parameter's amax under its key (`linear#c.1/forward`) and
//! rounds it with the current scale, the op (Burn's `linear`, or `matmul`) runs on the rounded
//! value, and under HYBRID the cast node's backward rounds the parameter's gradient to E5M2,
//! recording that amax too. Here the gathered value is the same f32 bits, rounded by the same
//! quantizer of the same call's plan (so the same key, scale and amax); the gather for the
//! input's gradient rounds again with that scale without recording (stage 2 records one amax
//! a forward pass); the op and its backward are Burn's own (`burn-autodiff`'s `Linear*` and
//! `Matmul` nodes: the same inner ops in the same order), and the parameter's gradient is
//! rounded by the cast node's backward quantizer before it reaches the anchor.
//!
//! The bytes gathered are f32's: torchao's float8 all-gather sends the fp8 bytes instead, which
//! would need each process to round its slice with the parameter's scale and an fp8 encoding of the
//! rounded values; every process's scale is the same (a parameter's amax history is), but the
//! rounding here is emulated in f32 (`crate::fp8::quantize_dequantize`), so there are no fp8 bytes
//! to send.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, broadcast_shape};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, Shape, TensorMetadata};

use crate::autocast::{CastInput, CastPlan, InputRounding, Op};

use super::{
    Shard, WithOptionalThird, anchored_operands, anchors, count_dropped, counted, gather, resolve,
    resolve_opt, shard_of, up_to_three,
};

/// The hook's signature for `linear`: the input (already through its fp8 cast), the weight's
/// and the bias's anchors (f32), their shards, and the weight's fp8 rounding.
pub(super) type Fp8Linear<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    InputRounding,
) -> FloatTensor<B>;

/// The hook's signature for `matmul`: the operands (a registered parameter as its f32 anchor,
/// any other already through its fp8 cast), and each parameter operand's shard and fp8
/// rounding.
pub(super) type Fp8Matmul<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    [Option<(Arc<dyn Shard>, InputRounding)>; 2],
) -> FloatTensor<B>;

/// Whether the bounded fp8 path runs on `B` the way stage 2 would: fp8 autocast, and fp8's own
/// cast node is registered for `B` (without it stage 2 takes the straight-through estimate,
/// whose gradients are not rounded).
pub(super) fn applies<B: Backend>() -> bool {
    matches!(crate::autocast::current(), Some(crate::Precision::Fp8(_)))
        && crate::autocast::rounds_through_node::<B>()
}

// Whether the plan rounds f32 operands in f32 (fp8's lower class), as the bounded paths do
// (`linear`, `matmul`, and the convolutions': `conv`).
pub(super) fn rounds_f32<B: Backend>(plan: &CastPlan, operands: &[&FloatTensor<B>]) -> bool {
    plan.rounds_to_fp8()
        && plan.target() == Some(FloatDType::F32)
        && operands.iter().all(|t| t.dtype() == DType::F32)
}

/// `linear` of the registered parameter `weight` under fp8 autocast, where [`applies`]: the
/// op's own path (`crate::backend::forward`'s `linear`: the plan, the casts,
/// `lowered::linear`) with the plan decided once, the weight gathered in f32 and rounded by
/// its cast for the op alone. Otherwise (another class for `linear`, other dtypes) the
/// weight is gathered whole, as every other op reads a parameter.
pub(super) fn autocast_linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    weight_shard: Arc<dyn Shard>,
    hook: Option<Fp8Linear<B>>,
) -> FloatTensor<B> {
    let plan = CastPlan::new::<B>(
        Op::Linear,
        &[
            CastInput::One(&x),
            CastInput::One(&weight),
            CastInput::Maybe(&bias),
        ],
    );
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    let x = plan.cast_at::<B>(0, x);
    let operands: Vec<&FloatTensor<B>> = [Some(&x), Some(&weight), bias.as_ref()]
        .into_iter()
        .flatten()
        .collect();
    if let Some(hook) = hook
        && rounds_f32::<B>(&plan, &operands)
        && bias.is_none() == bias_shard.is_none()
        && let Some(rounding) = plan.fp8_rounding(1)
    {
        let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
        return hook(x, weight, bias, weight_shard, bias_shard, rounding);
    }
    let weight = plan.cast_at::<B>(1, resolve::<B>(weight));
    let bias = plan.cast_opt::<B>(resolve_opt::<B>(bias));
    super::super::lowered::linear::<B>(&plan, x, weight, bias)
}

/// `matmul` with a registered parameter operand under fp8 autocast, as [`autocast_linear`]:
/// each parameter operand gathered in f32 and rounded by its cast for the product alone.
pub(super) fn autocast_matmul<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    [lhs_shard, rhs_shard]: [Option<Arc<dyn Shard>>; 2],
    hook: Option<Fp8Matmul<B>>,
) -> FloatTensor<B> {
    let plan = CastPlan::new::<B>(Op::Matmul, &[CastInput::One(&lhs), CastInput::One(&rhs)]);
    if let Some(hook) = hook
        && rounds_f32::<B>(&plan, &[&lhs, &rhs])
    {
        // Each operand as stage 2 reads it: a parameter kept f32 (rounded where gathered),
        // any other through its cast.
        let lhs = match &lhs_shard {
            Some(_) => lhs,
            None => plan.cast_at::<B>(0, lhs),
        };
        let rhs = match &rhs_shard {
            Some(_) => rhs,
            None => plan.cast_at::<B>(1, rhs),
        };
        let roundings = [
            lhs_shard.clone().zip(plan.fp8_rounding(0)),
            rhs_shard.clone().zip(plan.fp8_rounding(1)),
        ];
        let (lhs, rhs) = anchored_operands::<B>(lhs, rhs, &lhs_shard, &rhs_shard);
        return hook(lhs, rhs, roundings);
    }
    let lhs = plan.cast_at::<B>(0, resolve::<B>(lhs));
    let rhs = plan.cast_at::<B>(1, resolve::<B>(rhs));
    super::super::lowered::matmul::<B>(&plan, lhs, rhs)
}

// An operand as a node keeps it: a registered parameter as its placeholder, its shard and
// its rounding (gathered and rounded again where the other operand's
// gradient needs it); any other operand as it is (rounded already, by its own cast node).
struct Operand<B: Backend> {
    tensor: FloatTensor<B>,
    rounded: Option<(Arc<dyn Shard>, InputRounding)>,
}

impl<B: Backend> Clone for Operand<B> {
    fn clone(&self) -> Self {
        Operand {
            tensor: self.tensor.clone(),
            rounded: self.rounded.clone(),
        }
    }
}

impl<B: Backend> core::fmt::Debug for Operand<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Fp8Operand")
    }
}

// Which read of a parameter an op makes: the forward's records its amax, as stage 2's cast
// node does once a pass; a backward one rounds the same value again, recording nothing.
#[derive(Clone, Copy)]
enum Read {
    Forward,
    Again,
}

impl<B: Backend> Operand<B> {
    // The value the op reads (a parameter gathered and rounded), with the bytes the gather
    // counted.
    fn whole(&self, read: Read) -> (FloatTensor<B>, u64) {
        match &self.rounded {
            Some((shard, rounding)) => {
                let bytes = counted(&self.tensor);
                let gathered = gather::<B>(shard.as_ref(), &self.tensor);
                let rounded = match read {
                    Read::Forward => rounding.forward::<B>(gathered),
                    Read::Again => rounding.again::<B>(gathered),
                };
                (rounded, bytes)
            }
            None => (self.tensor.clone(), 0),
        }
    }
}

// An operand's gradient as its cast node's backward hands it on, where it is a parameter
// (`rounding`); as it is otherwise (any other operand's own cast node does that).
fn through_cast<B: Backend>(
    grad: FloatTensor<B>,
    rounding: Option<InputRounding>,
) -> FloatTensor<B> {
    match rounding {
        Some(rounding) => rounding.gradient::<B>(grad),
        None => grad,
    }
}

// The input where the weight's gradient needs it, the weight where the input's does.
type LinearState<B> = (Option<FloatTensor<B>>, Option<Operand<B>>);

// Burn's `linear` nodes (`burn-autodiff`'s `LinearWithBias`, `LinearNoBias`), with the
// weight gathered and rounded for the input's gradient alone, and the weight's gradient
// through its cast node's backward (`rounding`).
#[derive(Debug)]
struct BoundedFp8Linear {
    rounding: InputRounding,
}

impl<B: Backend> WithOptionalThird<B> for BoundedFp8Linear {
    type State = LinearState<B>;

    fn run(
        self,
        [node_x, node_weight, node_bias]: [Option<NodeId>; 3],
        grad: FloatTensor<B>,
        (x, weight): LinearState<B>,
        grads: &mut Gradients,
    ) {
        if let Some(node) = node_x {
            let weight = weight.expect("kept where the input is tracked");
            let (whole, bytes) = weight.whole(Read::Again);
            let grad = B::linear_x_backward(whole, grad.clone());
            count_dropped(bytes);
            grads.register::<B>(node, grad);
        }
        if let Some(node) = node_weight {
            let x = x.expect("kept where the weight is tracked");
            let grad = B::linear_weight_backward(x, grad.clone());
            grads.register::<B>(node, self.rounding.gradient::<B>(grad));
        }
        if let Some(node) = node_bias {
            grads.register::<B>(node, B::linear_bias_backward(grad));
        }
    }
}

/// Burn's `linear` on `Autodiff<B, C>` of the rounded input `x` and the f32 parameters
/// `weight` and `bias` (their anchors): the weight gathered and rounded by `rounding` for the op
/// alone (the bias gathered, not rounded: fp8 keeps biases in f32), in one node that keeps the
/// weight's placeholder instead of its rounded value.
pub(super) fn bounded_fp8_linear<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    rounding: InputRounding,
) -> FloatTensor<Autodiff<B, C>> {
    let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
    let kept = Operand::<B> {
        tensor: weight.primitive.clone(),
        rounded: Some((weight_shard, rounding)),
    };
    let (whole_weight, mut bytes) = kept.whole(Read::Forward);
    let whole_bias = bias.as_ref().map(|bias| match &bias_shard {
        Some(shard) => {
            bytes += counted(&bias.primitive);
            gather::<B>(shard.as_ref(), &bias.primitive)
        }
        None => bias.primitive.clone(),
    });
    let output = B::linear(x.primitive.clone(), whole_weight, whole_bias);
    count_dropped(bytes);
    let state = || {
        (
            weight_tracked.then(|| x.primitive.clone()),
            x_tracked.then_some(kept),
        )
    };
    let node = BoundedFp8Linear { rounding };
    up_to_three::<B, C, _>(node, [&x, &weight], bias.as_ref(), state, output)
}

// Burn's `matmul` node (`burn-autodiff`'s `Matmul`, its broadcast included), each parameter
// operand gathered and rounded for the other's gradient alone, and its own gradient through
// its cast node's backward (`roundings`: each parameter operand's).
#[derive(Debug)]
struct BoundedFp8Matmul {
    roundings: [Option<InputRounding>; 2],
}

// The left operand where the right one's gradient needs it, the reverse, and the operands'
// shapes where they differ (Burn's `BinaryOpsBroadcast`).
type MatmulState<B> = (
    Option<Operand<B>>,
    Option<Operand<B>>,
    Option<(Shape, Shape)>,
);

impl<B: Backend> Backward<B, 2> for BoundedFp8Matmul {
    type State = MatmulState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (lhs, rhs, broadcast) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [node_lhs, node_rhs] = ops.parents;
        let [lhs_rounding, rhs_rounding] = self.roundings;
        if let Some(node) = node_lhs {
            let rhs = rhs.expect("kept where the left operand is tracked");
            let (whole, bytes) = rhs.whole(Read::Again);
            let out = B::float_matmul(grad.clone(), B::float_transpose(whole));
            count_dropped(bytes);
            let out = match &broadcast {
                Some((lhs_shape, _)) => broadcast_shape::<B>(out, lhs_shape),
                None => out,
            };
            grads.register::<B>(node.id, through_cast::<B>(out, lhs_rounding));
        }
        if let Some(node) = node_rhs {
            let lhs = lhs.expect("kept where the right operand is tracked");
            let (whole, bytes) = lhs.whole(Read::Again);
            let out = B::float_matmul(B::float_transpose(whole), grad);
            count_dropped(bytes);
            let out = match &broadcast {
                Some((_, rhs_shape)) => broadcast_shape::<B>(out, rhs_shape),
                None => out,
            };
            grads.register::<B>(node.id, through_cast::<B>(out, rhs_rounding));
        }
    }
}

/// Burn's `matmul` on `Autodiff<B, C>` with each parameter operand (an f32 anchor, with its
/// shard and rounding in `params`) gathered and rounded for the product alone, in a node that
/// keeps its placeholder instead of its rounded value.
pub(super) fn bounded_fp8_matmul<B: Backend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    [lhs_param, rhs_param]: [Option<(Arc<dyn Shard>, InputRounding)>; 2],
) -> FloatTensor<Autodiff<B, C>> {
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    let (lhs_shape, rhs_shape) = (lhs.primitive.shape(), rhs.primitive.shape());
    // Burn's `BinaryOpsBroadcast`: any dimension that differs.
    let broadcast = (0..lhs_shape.num_dims())
        .any(|i| lhs_shape[i] != rhs_shape[i])
        .then_some((lhs_shape, rhs_shape));
    let roundings = [
        lhs_param.as_ref().map(|(_, rounding)| *rounding),
        rhs_param.as_ref().map(|(_, rounding)| *rounding),
    ];
    let lhs_kept = Operand::<B> {
        tensor: lhs.primitive.clone(),
        rounded: lhs_param,
    };
    let rhs_kept = Operand::<B> {
        tensor: rhs.primitive.clone(),
        rounded: rhs_param,
    };
    let (lhs_whole, lhs_bytes) = lhs_kept.whole(Read::Forward);
    let (rhs_whole, rhs_bytes) = rhs_kept.whole(Read::Forward);
    let output = B::float_matmul(lhs_whole, rhs_whole);
    count_dropped(lhs_bytes + rhs_bytes);
    match (BoundedFp8Matmul { roundings })
        .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                rhs_tracked.then_some(lhs_kept),
                lhs_tracked.then_some(rhs_kept),
                broadcast,
            ),
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}
