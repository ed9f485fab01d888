//! ZeRO stage 3's bounded `layer_norm` (Burn's `nn::LayerNorm`): the normalisation reads no
//! parameter and runs as Burn's own decomposition (the same autodiff ops); the affine part,
//! `normalized * gamma + beta`, is one node that gathers gamma and beta for the forward op
//! alone, keeps gamma's placeholder, and gathers gamma again in backward for the normalised
//! input's gradient. Beta's gradient needs only the output's, gamma's the normalised input:
//! neither is gathered for them.
//!
//! The numbers are Burn's, bit for bit: the forward is the default `ModuleOps::layer_norm`
//! (burn-autodiff 0.21 does not override it), and the node's backward runs the ops Burn's
//! `Mul`, `Add` and `ReshapeDim` nodes run for `reshape(gamma)`, `normalized * gamma_b` and
//! `scaled + reshape(beta)`: the same products, the same broadcast sums
//! (`broadcast_shape`), the same reshapes.
//!
//! Under autocast the op is an fp32-class op (`crate::op_table`): its input is cast to f32
//! as the op's own path casts it, and f32 parameters are gathered in f32 for the op alone.
//! Where the plan would cast a parameter (another policy's class, a parameter of another
//! dtype) the op runs its own path with the parameters gathered whole, as every op without a
//! bound reads them.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::broadcast_shape;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};

use crate::autocast::{CastInput, CastPlan, Op};
use crate::hooks::{self, HookKind};

use super::{
    PlaceholderHooks, Shard, Weight, WithOptionalThird, anchored, count_dropped, counted, gather,
    resolve, resolve_opt, shard_of, up_to_three,
};

/// `layer_norm`'s inputs, given back where the bounded path does not apply.
pub(crate) type LayerNormInputs<B> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, f64);

// The hook per backend type: the normalised input, gamma's and beta's anchors (or beta as it
// is, where it is not registered), their shards.
type AffineHook<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
) -> FloatTensor<B>;

struct LayerNormHooks;

impl HookKind for LayerNormHooks {
    fn register_known() {
        PlaceholderHooks::register_known();
    }
}

/// Registers the bounded affine node for `Autodiff<B, C>` (see `super::register`).
pub(super) fn register<B: Backend, C: CheckpointStrategy>() {
    hooks::insert::<LayerNormHooks, Autodiff<B, C>, _>(
        bounded_affine::<B, C> as AffineHook<Autodiff<B, C>>,
    );
}

/// `layer_norm(tensor, gamma, beta, epsilon)` with the per-layer bound, where gamma is a
/// registered parameter and `tensor` is not, on one device: the op's own cast plan (decided
/// once), the normalisation as Burn decomposes it, and the affine part gathering the
/// parameters for itself alone where the plan casts neither. Otherwise the inputs back, for
/// the op's usual path.
pub(crate) fn layer_norm<B: Backend>(
    tensor: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    epsilon: f64,
) -> Result<FloatTensor<B>, LayerNormInputs<B>> {
    let Some(gamma_shard) = shard_of::<B>(&gamma) else {
        return Err((tensor, gamma, beta, epsilon));
    };
    let device = B::float_device(&tensor);
    let one_device = B::float_device(&gamma) == device
        && beta.as_ref().is_none_or(|b| B::float_device(b) == device);
    let hook = hooks::get::<LayerNormHooks, B, AffineHook<B>>();
    let (Some(hook), true, None) = (hook, one_device, shard_of::<B>(&tensor)) else {
        // Inputs on several devices go through the op's path, which co-locates them.
        return Err((tensor, gamma, beta, epsilon));
    };
    // The op's own path (`crate::backend::forward`'s `layer_norm`), its plan decided once.
    let plan = CastPlan::new::<B>(
        Op::LayerNorm,
        &[
            CastInput::One(&tensor),
            CastInput::One(&gamma),
            CastInput::Maybe(&beta),
        ],
    );
    let tensor = plan.cast_at::<B>(0, tensor);
    // The parameters are read as they are (the plan's cast of them is the identity), in the
    // input's dtype.
    let read_as_is = |t: &FloatTensor<B>| {
        t.dtype() == tensor.dtype()
            && plan
                .target()
                .is_none_or(|target| t.dtype() == DType::from(target))
    };
    if plan.rounds_to_fp8() || !read_as_is(&gamma) || !beta.as_ref().is_none_or(read_as_is) {
        let gamma = plan.cast_at::<B>(1, resolve::<B>(gamma));
        let beta = plan.cast_opt::<B>(resolve_opt::<B>(beta));
        return Ok(B::layer_norm(tensor, gamma, beta, epsilon));
    }
    let normalized = normalize::<B>(tensor, epsilon);
    // The anchors sit just above the normalised input: they run right after the affine
    // node's backward.
    let gamma = anchored::<B>(gamma, Some(&normalized), gamma_shard.clone());
    let beta_shard = beta.as_ref().and_then(shard_of::<B>);
    let beta = match (beta, &beta_shard) {
        (Some(beta), Some(shard)) => Some(anchored::<B>(beta, Some(&normalized), shard.clone())),
        (beta, _) => beta,
    };
    Ok(hook(normalized, gamma, beta, gamma_shard, beta_shard))
}

// Burn's default `ModuleOps::layer_norm` up to the affine part: the same ops of `B` (Burn's
// autodiff over the inner backend, which builds a node for each) in the same order.
fn normalize<B: Backend>(tensor: FloatTensor<B>, epsilon: f64) -> FloatTensor<B> {
    let last_dim = tensor.shape().num_dims() - 1;
    let mean = B::float_mean_dim(tensor.clone(), last_dim);
    let centered = B::float_sub(tensor, mean);
    let var = B::float_mean_dim(B::float_mul(centered.clone(), centered.clone()), last_dim);
    let denom = B::float_sqrt(B::float_add_scalar(var, epsilon.into()));
    B::float_div(centered, denom)
}

// The shape Burn reshapes gamma and beta to: ones but the last dimension, the input's.
fn broadcast_dims(shape: &Shape) -> Shape {
    let rank = shape.num_dims();
    let dims: Vec<usize> = (0..rank)
        .map(|i| if i == rank - 1 { shape[i] } else { 1 })
        .collect();
    Shape::from(dims)
}

// What the affine node keeps: the normalised input where gamma's gradient needs it, gamma's
// placeholder where the input's does, the broadcast shape and the parameters' own shapes.
struct AffineState<B: Backend> {
    normalized: Option<FloatTensor<B>>,
    gamma: Option<Weight<B>>,
    broadcast: Shape,
    gamma_shape: Shape,
    beta_shape: Option<Shape>,
}

impl<B: Backend> Clone for AffineState<B> {
    fn clone(&self) -> Self {
        AffineState {
            normalized: self.normalized.clone(),
            gamma: self.gamma.clone(),
            broadcast: self.broadcast.clone(),
            gamma_shape: self.gamma_shape.clone(),
            beta_shape: self.beta_shape.clone(),
        }
    }
}

impl<B: Backend> core::fmt::Debug for AffineState<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("AffineState")
    }
}

// Burn's backward of `reshape(gamma)`, `normalized * gamma_b` and `scaled + reshape(beta)`:
// `Add`'s (the output's gradient to `scaled` as it is, `broadcast_shape` to beta's reshape),
// `Mul`'s (the product with the other operand, `broadcast_shape` to the operand's shape:
// nothing to sum for the normalised input, whose shape is the output's) and `ReshapeDim`'s
// (nothing left to sum: the gradient has the broadcast shape; reshaped to the parameter's).
fn affine_backward<B: Backend>(
    [node_normalized, node_gamma, node_beta]: [Option<NodeId>; 3],
    grad: FloatTensor<B>,
    state: AffineState<B>,
    grads: &mut Gradients,
) {
    if let (Some(node), Some(beta_shape)) = (node_beta, state.beta_shape) {
        let grad = broadcast_shape::<B>(grad.clone(), &state.broadcast);
        grads.register::<B>(node, B::float_reshape(grad, beta_shape));
    }
    if let Some(node) = node_normalized {
        let gamma = state
            .gamma
            .expect("kept where the normalised input is tracked");
        let whole = gather::<B>(gamma.shard.as_ref(), &gamma.tensor);
        let bytes = counted(&gamma.tensor);
        let gamma_b = B::float_reshape(whole, state.broadcast.clone());
        let out = B::float_mul(grad.clone(), gamma_b);
        count_dropped(bytes);
        grads.register::<B>(node, out);
    }
    if let Some(node) = node_gamma {
        let normalized = state.normalized.expect("kept where gamma is tracked");
        let out = B::float_mul(grad, normalized);
        let out = broadcast_shape::<B>(out, &state.broadcast);
        grads.register::<B>(node, B::float_reshape(out, state.gamma_shape));
    }
}

// The affine part's node, as `affine_backward`.
#[derive(Debug)]
struct BoundedAffine;

impl<B: Backend> WithOptionalThird<B> for BoundedAffine {
    type State = AffineState<B>;

    fn run(
        self,
        parents: [Option<NodeId>; 3],
        grad: FloatTensor<B>,
        state: Self::State,
        grads: &mut Gradients,
    ) {
        affine_backward::<B>(parents, grad, state, grads);
    }
}

// `normalized * reshape(gamma) + reshape(beta)` on `Autodiff<B, C>` with gamma (and a
// registered beta) gathered for the forward op alone, and a node that keeps gamma's
// placeholder instead of its gathered value.
fn bounded_affine<B: Backend, C: CheckpointStrategy>(
    normalized: FloatTensor<Autodiff<B, C>>,
    gamma: FloatTensor<Autodiff<B, C>>,
    beta: Option<FloatTensor<Autodiff<B, C>>>,
    gamma_shard: Arc<dyn Shard>,
    beta_shard: Option<Arc<dyn Shard>>,
) -> FloatTensor<Autodiff<B, C>> {
    let (normalized_tracked, gamma_tracked) = (normalized.is_tracked(), gamma.is_tracked());
    let broadcast = broadcast_dims(&normalized.primitive.shape());
    let mut bytes = counted(&gamma.primitive);
    let whole_gamma = gather::<B>(gamma_shard.as_ref(), &gamma.primitive);
    let scaled = B::float_mul(
        normalized.primitive.clone(),
        B::float_reshape(whole_gamma, broadcast.clone()),
    );
    let output = match &beta {
        Some(beta) => {
            let whole_beta = match &beta_shard {
                Some(shard) => {
                    bytes += counted(&beta.primitive);
                    gather::<B>(shard.as_ref(), &beta.primitive)
                }
                None => beta.primitive.clone(),
            };
            B::float_add(scaled, B::float_reshape(whole_beta, broadcast.clone()))
        }
        None => scaled,
    };
    count_dropped(bytes);
    let state = || AffineState::<B> {
        normalized: gamma_tracked.then(|| normalized.primitive.clone()),
        gamma: normalized_tracked.then(|| Weight {
            tensor: gamma.primitive.clone(),
            shard: gamma_shard.clone(),
        }),
        broadcast,
        gamma_shape: gamma.primitive.shape(),
        beta_shape: beta.as_ref().map(|beta| beta.primitive.shape()),
    };
    up_to_three::<B, C, _>(
        BoundedAffine,
        [&normalized, &gamma],
        beta.as_ref(),
        state,
        output,
    )
}
