//! ZeRO stage 3's reshaped parameters and their bounded products (Burn's `nn::RmsNorm`:
//! `normalized * gamma.unsqueeze()`).
//!
//! A reshape of a registered parameter gathers nothing: it gives a *view*, a placeholder of
//! the new shape registered with the parameter's shard and remembered with the parameter it
//! views. The gathered bytes of a view are the
//! parameter's, in the same logical order, so every op reads a view as it reads a parameter;
//! its anchor is the parameter's anchor reshaped, so that its gradient is reshaped back and
//! summed into the parameter's (Burn's `ReshapeDim` backward), reduced once with the
//! parameter's other uses.
//!
//! `float_mul` with one registered operand (a parameter or a view of one), autocast off and
//! both operands of one dtype, is one node that gathers the parameter for the product alone,
//! keeps its placeholder, and gathers it again in backward for the other operand's gradient:
//! Burn's `Mul` backward (the products, `broadcast_shape` to each operand's shape) followed,
//! for a view, by its reshape to the parameter's shape, bit for bit as stage 2 computes it.
//! The parameter's anchor sits just above the other operand, so it runs right after the
//! product's backward.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, broadcast_shape};
use burn::tensor::backend::AutodiffBackend;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, Shape, TensorData, TensorMetadata};

use crate::hooks::{self, HookKind};

use super::{
    PlaceholderHooks, Shard, Weight, anchored, count_dropped, counted, gather, registry, shard_of,
    tracked,
};

/// A view's entry in the registry: the parameter it reshapes (a `FloatTensor<B>` of the
/// backend that made it) and its own shape.
pub(super) struct View {
    parameter: Box<dyn std::any::Any + Send>,
    shape: Shape,
}

// A new view of a parameter (the tensor reshaped, the new shape): a placeholder of the new
// shape.
type ViewHook<B> = fn(&FloatTensor<B>, Shape) -> FloatTensor<B>;

// The bounded product: the other operand, the parameter's anchor, the registered operand's
// shape, whether it is the left operand, its shard.
type MulHook<B> = fn(FloatTensor<B>, FloatTensor<B>, Shape, bool, Arc<dyn Shard>) -> FloatTensor<B>;

struct ViewHooks;

impl HookKind for ViewHooks {
    fn register_known() {
        PlaceholderHooks::register_known();
    }
}

/// Registers views and the bounded product for `Autodiff<B, C>` (see `super::register`).
pub(super) fn register<B: Backend, C: CheckpointStrategy>() {
    hooks::insert::<ViewHooks, Autodiff<B, C>, _>((
        new_view::<B, C> as ViewHook<Autodiff<B, C>>,
        bounded_mul::<B, C> as MulHook<Autodiff<B, C>>,
    ));
}

fn view_hooks<B: Backend>() -> Option<(ViewHook<B>, MulHook<B>)> {
    hooks::get::<ViewHooks, B, (ViewHook<B>, MulHook<B>)>()
}

// The parameter `tensor` views and the view's shape, if `tensor` is a view.
fn viewed<B: Backend>(tensor: &FloatTensor<B>) -> Option<(FloatTensor<B>, Shape)> {
    let id = (tracked::<B>()?.node_id)(tensor);
    registry(|r| {
        let view = r.views.get(&id)?;
        let parameter = view.parameter.downcast_ref::<FloatTensor<B>>()?.clone();
        Some((parameter, view.shape.clone()))
    })
}

/// `reshape(tensor, shape)` as a view, where `tensor` is a registered parameter (or a view of
/// one) and `B` makes views: nothing is gathered. Otherwise the inputs back.
pub(crate) fn float_reshape<B: Backend>(
    tensor: FloatTensor<B>,
    shape: Shape,
) -> Result<FloatTensor<B>, (FloatTensor<B>, Shape)> {
    let Some(shard) = shard_of::<B>(&tensor) else {
        return Err((tensor, shape));
    };
    let (Some(tracked), Some((new_view, _))) = (tracked::<B>(), view_hooks::<B>()) else {
        return Err((tensor, shape));
    };
    // A reshape that does not fit goes through the op's path, which says why.
    if shape.num_elements() != tensor.shape().num_elements() {
        return Err((tensor, shape));
    }
    // A view of a view is a view of its parameter.
    let parameter = viewed::<B>(&tensor).map_or_else(|| tensor.clone(), |(parameter, _)| parameter);
    let view = new_view(&tensor, shape.clone());
    let id = (tracked.node_id)(&view);
    let entry = View {
        parameter: Box::new(parameter),
        shape,
    };
    registry(|r| {
        r.views.insert(id, entry);
        r.shards.insert(id, shard);
    });
    Ok(view)
}

/// The anchor a view is read through: its parameter's anchor (made as [`anchored`] makes
/// it), reshaped to the view's shape. `None` where `tensor` is not a view.
pub(super) fn anchored_view<B: Backend>(
    tensor: &FloatTensor<B>,
    input: Option<&FloatTensor<B>>,
    shard: &Arc<dyn Shard>,
) -> Option<FloatTensor<B>> {
    let (parameter, shape) = viewed::<B>(tensor)?;
    let anchor = anchored::<B>(parameter, input, shard.clone());
    Some(B::float_reshape(anchor, shape))
}

/// `lhs * rhs` with the per-layer bound, where one operand is a registered parameter (or a
/// view of one) and the other is not, both share a rank and a device, and the product reads
/// the parameter as it is: autocast off and both of one dtype, or under autocast a plan that
/// leaves the parameter alone and casts the other operand to its dtype (`autocast_operands`).
/// Two half tensors of one shape keep the op's path, the crate's half kernel. Otherwise the
/// inputs back.
pub(crate) fn float_mul<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
) -> Result<FloatTensor<B>, (FloatTensor<B>, FloatTensor<B>)> {
    let (param_is_lhs, shard) = match (shard_of::<B>(&lhs), shard_of::<B>(&rhs)) {
        (Some(shard), None) => (true, shard),
        (None, Some(shard)) => (false, shard),
        _ => return Err((lhs, rhs)),
    };
    if view_hooks::<B>().is_none() || B::float_device(&lhs) != B::float_device(&rhs) {
        // The op's path co-locates them first.
        return Err((lhs, rhs));
    }
    let (lhs, rhs) = match crate::autocast::current() {
        None => (lhs, rhs),
        Some(_) => autocast_operands::<B>(lhs, rhs, param_is_lhs)?,
    };
    let dtype = lhs.dtype();
    let half_kernel = matches!(dtype, DType::BF16 | DType::F16) && lhs.shape() == rhs.shape();
    let applies =
        dtype == rhs.dtype() && !half_kernel && lhs.shape().num_dims() == rhs.shape().num_dims();
    let Some((_, bounded)) = view_hooks::<B>().filter(|_| applies) else {
        return Err((lhs, rhs));
    };
    let (param, other) = if param_is_lhs { (lhs, rhs) } else { (rhs, lhs) };
    let operand_shape = param.shape();
    let parameter = viewed::<B>(&param).map_or(param, |(parameter, _)| parameter);
    let anchor = anchored::<B>(parameter, Some(&other), shard.clone());
    Ok(bounded(other, anchor, operand_shape, param_is_lhs, shard))
}

// The two operands of a product, in its order.
type Operands<B> = (FloatTensor<B>, FloatTensor<B>);

// The operands of `lhs * rhs` under autocast as the op's own path hands them to the product
// (`crate::backend::forward`'s `float_mul`: the cast plan, the casts), where that plan reads
// the parameter operand as it is: `mul` is a promote-class op (`crate::op_table`), whose plan
// casts nothing where the dtypes agree and otherwise casts both to the wider (a half operand
// times an f32 parameter, `nn::RmsNorm`'s `normalized * gamma` under bf16/f16: the half
// operand cast up to f32 by autocast's cast node, the parameter read in f32). Those are the
// bounded product's operands (the parameter gathered in its own dtype), and the numbers are
// the op's own. An op class of the lower class (an override) gives the inputs back: its plan
// would cast the parameter itself (or round it under fp8), and counts the call in autocast's
// tally, which the op's path does once.
fn autocast_operands<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    param_is_lhs: bool,
) -> Result<Operands<B>, Operands<B>> {
    use crate::autocast::{CastInput, CastPlan, Op, OpClass};
    if crate::autocast::op_class(Op::Mul) == OpClass::Lower {
        return Err((lhs, rhs));
    }
    let plan = CastPlan::new::<B>(Op::Mul, &[CastInput::One(&lhs), CastInput::One(&rhs)]);
    let param_dtype = if param_is_lhs {
        lhs.dtype()
    } else {
        rhs.dtype()
    };
    let keeps_param = plan
        .target()
        .is_none_or(|target| DType::from(target) == param_dtype);
    if !keeps_param || plan.rounds_to_fp8() {
        return Err((lhs, rhs));
    }
    Ok(match param_is_lhs {
        true => (lhs, plan.cast_at::<B>(1, rhs)),
        false => (plan.cast_at::<B>(0, lhs), rhs),
    })
}

// A view of `tensor` on `Autodiff<B, C>`: a new leaf that builds no graph (ops read it
// through its anchor), a stride-0 view of one `-0.0` of the new shape (a few bytes, as the
// parameter's placeholder).
fn new_view<B: Backend, C: CheckpointStrategy>(
    tensor: &FloatTensor<Autodiff<B, C>>,
    shape: Shape,
) -> FloatTensor<Autodiff<B, C>> {
    let dtype = tensor.primitive.dtype();
    let device = B::float_device(&tensor.primitive);
    let ones = Shape::from(vec![1; shape.num_dims()]);
    let zero = B::float_from_data(TensorData::new(vec![-0.0f32], ones), &device);
    let zero = if dtype == DType::F32 {
        zero
    } else {
        B::float_cast(zero, FloatDType::from(dtype))
    };
    Autodiff::<B, C>::from_inner(B::float_expand(zero, shape))
}

// What the product's node keeps: the other operand where the parameter's gradient needs it,
// the parameter's placeholder where the other's does, and the shapes.
struct MulState<B: Backend> {
    other: Option<FloatTensor<B>>,
    param: Option<Weight<B>>,
    param_is_lhs: bool,
    // The registered operand's shape (a view's), the parameter's, the other operand's.
    operand_shape: Shape,
    param_shape: Shape,
    other_shape: Shape,
    // Burn's `BinaryOpsBroadcast`: whether any dimension differs.
    broadcast: bool,
}

impl<B: Backend> Clone for MulState<B> {
    fn clone(&self) -> Self {
        MulState {
            other: self.other.clone(),
            param: self.param.clone(),
            param_is_lhs: self.param_is_lhs,
            operand_shape: self.operand_shape.clone(),
            param_shape: self.param_shape.clone(),
            other_shape: self.other_shape.clone(),
            broadcast: self.broadcast,
        }
    }
}

impl<B: Backend> core::fmt::Debug for MulState<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("MulState")
    }
}

// `tensor` in `shape`, reshaped only where its shape differs.
fn reshaped<B: Backend>(tensor: FloatTensor<B>, shape: &Shape) -> FloatTensor<B> {
    if &tensor.shape() == shape {
        tensor
    } else {
        B::float_reshape(tensor, shape.clone())
    }
}

// Burn's `Mul` backward (`grad * rhs` summed to the left operand's shape, `grad * lhs` to the
// right one's), with the parameter gathered for the other operand's product alone, and the
// parameter's gradient reshaped back from a view's shape (`ReshapeDim`'s backward: the
// gradient already has the view's shape, nothing is left to sum).
fn mul_backward<B: Backend>(
    [node_lhs, node_rhs]: [Option<NodeId>; 2],
    grad: FloatTensor<B>,
    state: MulState<B>,
    grads: &mut Gradients,
) {
    let (node_param, node_other) = if state.param_is_lhs {
        (node_lhs, node_rhs)
    } else {
        (node_rhs, node_lhs)
    };
    let other_grad = |grad: FloatTensor<B>, grads: &mut Gradients| {
        let Some(node) = node_other else { return };
        let param = state
            .param
            .clone()
            .expect("kept where the other operand is tracked");
        let bytes = counted(&param.tensor);
        let whole = gather::<B>(param.shard.as_ref(), &param.tensor);
        let out = B::float_mul(grad, reshaped::<B>(whole, &state.operand_shape));
        count_dropped(bytes);
        let out = if state.broadcast {
            broadcast_shape::<B>(out, &state.other_shape)
        } else {
            out
        };
        grads.register::<B>(node, out);
    };
    let param_grad = |grad: FloatTensor<B>, grads: &mut Gradients| {
        let Some(node) = node_param else { return };
        let other = state
            .other
            .clone()
            .expect("kept where the parameter is tracked");
        let out = B::float_mul(grad, other);
        let out = if state.broadcast {
            broadcast_shape::<B>(out, &state.operand_shape)
        } else {
            out
        };
        grads.register::<B>(node, reshaped::<B>(out, &state.param_shape));
    };
    // Burn's order: the left operand's gradient first.
    if state.param_is_lhs {
        param_grad(grad.clone(), grads);
        other_grad(grad, grads);
    } else {
        other_grad(grad.clone(), grads);
        param_grad(grad, grads);
    }
}

#[derive(Debug)]
struct BoundedMul;

impl<B: Backend> Backward<B, 2> for BoundedMul {
    type State = MulState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|parent| parent.map(|node| node.id));
        mul_backward::<B>(parents, grad, ops.state, grads);
    }
}

// `other * param` (in the operands' order) on `Autodiff<B, C>` with the parameter gathered
// for the product alone, and a node that keeps its placeholder instead of its gathered value.
fn bounded_mul<B: Backend, C: CheckpointStrategy>(
    other: FloatTensor<Autodiff<B, C>>,
    param: FloatTensor<Autodiff<B, C>>,
    operand_shape: Shape,
    param_is_lhs: bool,
    shard: Arc<dyn Shard>,
) -> FloatTensor<Autodiff<B, C>> {
    let (other_tracked, param_tracked) = (other.is_tracked(), param.is_tracked());
    let other_shape = other.primitive.shape();
    let broadcast = other_shape != operand_shape;
    let bytes = counted(&param.primitive);
    let whole = reshaped::<B>(
        gather::<B>(shard.as_ref(), &param.primitive),
        &operand_shape,
    );
    let output = if param_is_lhs {
        B::float_mul(whole, other.primitive.clone())
    } else {
        B::float_mul(other.primitive.clone(), whole)
    };
    count_dropped(bytes);
    let state = MulState::<B> {
        other: param_tracked.then(|| other.primitive.clone()),
        param: other_tracked.then(|| Weight {
            tensor: param.primitive.clone(),
            shard: shard.clone(),
        }),
        param_is_lhs,
        operand_shape,
        param_shape: param.primitive.shape(),
        other_shape,
        broadcast,
    };
    let parents = if param_is_lhs {
        [param.node.clone(), other.node.clone()]
    } else {
        [other.node.clone(), param.node.clone()]
    };
    match BoundedMul.prepare::<C>(parents).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}
