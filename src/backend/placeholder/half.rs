//! ZeRO stage 3's bounded `linear` and `matmul` under bf16 and f16 autocast (FSDP's
//! `param_dtype`), on `Autodiff<Flex>` where autocast runs the crate's half kernels: a
//! `linear`'s weight and bias (a `matmul`'s parameter operand, also one Burn broadcasts over
//! the other operand's batch) are gathered in the half type the op runs in, so each process
//! casts its f32 slice and sends halves (half the bytes of an f32 gather), for the forward op
//! alone and again for the input's gradient; the gradients reach the f32 parameters through
//! their anchors, summed over a broadcast and cast back to f32 as autocast's expand and cast
//! nodes do it.
//!
//! The numbers are the op's own under autocast at stage 2, bit for bit: autocast casts the
//! f32 weight with the crate's cast kernel (`crate::cpu::table::cast`, an elementwise
//! rounding), and so does each process here to its slice before it sends, so the halves every
//! process receives are the cast of the gathered f32 value, the same bits; the forward and backward
//! are [`low_gemm::linear_tracked`]'s and [`low_gemm::gemm_tracked`]'s (the same GEMMs on the
//! same route, the same bias add and bias gradient; a broadcast operand expanded as the
//! same stride-0 view `lowered::matmul` makes, its gradient summed by the same
//! `float_sum_dim`s as Burn's expand node), and each parameter's gradient is cast to f32 as
//! the cast node's backward (`fast_cast::convert_tracked`) casts it.

use std::sync::Arc;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, broadcast_shape};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{DType, FloatDType, Shape, TensorMetadata};

use crate::backend::lowered::broadcast_batches;
use crate::cpu::Route;
use crate::cpu::low_gemm;

use super::{Shard, WithOptionalThird, count_dropped, received, up_to_three};

/// The hook's signature: the cast input (a half tensor, 2-D), the weight's and the bias's
/// anchors (f32), their shards, the half type and the kernels' route.
pub(super) type HalfLinear<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    FloatDType,
    Route,
) -> FloatTensor<B>;

// f32 through the crate's cast kernel: the cast node's forward and backward
// (`fast_cast::convert_tracked`).
pub(super) fn cast(tensor: FlexTensor, dtype: FloatDType) -> FlexTensor {
    crate::cpu::table::cast::<Flex>(tensor, dtype)
}

// One use's gather of the parameter `tensor` stands for (its f32 placeholder), in `dtype`:
// each process casts its slice and the halves are gathered. Returns the bytes counted as
// whole.
pub(super) fn gather_cast(
    shard: &dyn Shard,
    tensor: &FlexTensor,
    dtype: FloatDType,
) -> (FlexTensor, u64) {
    let device = Flex::float_device(tensor);
    received::<Flex>(shard, tensor.shape(), DType::from(dtype), &device)
}

// The weight as the node keeps it: its f32 placeholder and shard, gathered again in the half type
// where the input's gradient needs it.
#[derive(Clone)]
pub(super) struct HalfWeight {
    pub(super) tensor: FlexTensor,
    pub(super) shard: Arc<dyn Shard>,
}

impl core::fmt::Debug for HalfWeight {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("HalfWeight")
    }
}

// The input where the weight's gradient needs it (half), the weight where the input's does.
type State = (Option<FlexTensor>, Option<HalfWeight>);

#[derive(Debug)]
struct BoundedHalfLinear {
    route: Route,
    dtype: FloatDType,
}

impl WithOptionalThird<Flex> for BoundedHalfLinear {
    type State = State;

    // `linear_tracked`'s backward: the bias add's node (the bias's gradient, the product's
    // unchanged), then the GEMM's (the input's gradient, the weight's), each parameter's
    // gradient cast to f32 as its cast node's backward casts it.
    fn run(
        self,
        [node_x, node_weight, node_bias]: [Option<NodeId>; 3],
        grad: FlexTensor,
        (x, weight): State,
        grads: &mut Gradients,
    ) {
        let route = self.route;
        if let Some(node) = node_bias {
            let grad = cast(low_gemm::bias_grad(grad.clone()), FloatDType::F32);
            grads.register::<Flex>(node, grad);
        }
        if let Some(node) = node_x {
            let weight = weight.expect("kept where the input is tracked");
            let (whole, bytes) = gather_cast(weight.shard.as_ref(), &weight.tensor, self.dtype);
            let grad = low_gemm::gemm(grad.clone(), low_gemm::transposed(whole), route);
            count_dropped(bytes);
            grads.register::<Flex>(node, grad);
        }
        if let Some(node) = node_weight {
            let x = x.expect("kept where the weight is tracked");
            let grad = low_gemm::gemm(low_gemm::transposed(x), grad, route);
            grads.register::<Flex>(node, cast(grad, FloatDType::F32));
        }
    }
}

/// `linear` of the half input `x` with the f32 parameters `weight` and `bias` (their
/// anchors), gathered in `dtype` for the op alone: [`low_gemm::linear_tracked`]'s forward
/// on the cast weight and bias, in one node that keeps the weight's placeholder instead of
/// its halves.
pub(super) fn bounded_half_linear(
    x: FloatTensor<Autodiff<Flex>>,
    weight: FloatTensor<Autodiff<Flex>>,
    bias: Option<FloatTensor<Autodiff<Flex>>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    dtype: FloatDType,
    route: Route,
) -> FloatTensor<Autodiff<Flex>> {
    let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
    let (whole_weight, mut bytes) = gather_cast(weight_shard.as_ref(), &weight.primitive, dtype);
    let whole_bias = match (&bias, &bias_shard) {
        (Some(bias), Some(shard)) => {
            let (whole, counted) = gather_cast(shard.as_ref(), &bias.primitive, dtype);
            bytes += counted;
            Some(whole)
        }
        // Not a parameter of stage 3 (every float parameter is): cast here, as autocast
        // would have.
        (Some(bias), None) => Some(cast(bias.primitive.clone(), dtype)),
        (None, _) => None,
    };
    let product = low_gemm::gemm(x.primitive.clone(), whole_weight, route);
    let output = match whole_bias {
        Some(bias) => low_gemm::add_bias(product, bias),
        None => product,
    };
    count_dropped(bytes);
    let state = || {
        (
            weight_tracked.then(|| x.primitive.clone()),
            x_tracked.then(|| HalfWeight {
                tensor: weight.primitive.clone(),
                shard: weight_shard.clone(),
            }),
        )
    };
    let node = BoundedHalfLinear { route, dtype };
    up_to_three::<Flex, NoCheckpointing, _>(node, [&x, &weight], bias.as_ref(), state, output)
}

/// The hook's signature for `matmul`: the operands (a registered parameter as its f32
/// anchor, any other already cast to the half type), their shards, the half type and the
/// kernels' route.
pub(super) type HalfMatmul<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<Arc<dyn Shard>>,
    Option<Arc<dyn Shard>>,
    FloatDType,
    Route,
) -> FloatTensor<B>;

// A `matmul` operand as the node keeps it: a registered parameter as its f32 placeholder and
// shard, gathered again in the half type where the other operand's
// gradient needs it; any other operand as it is (half). `batch` is the shape the kernel
// takes it in: its own, or its batch dimensions broadcast to the other operand's
// (`lowered::broadcast_batches`).
#[derive(Clone)]
struct HalfOperand {
    tensor: FlexTensor,
    shard: Option<Arc<dyn Shard>>,
    batch: Shape,
}

impl core::fmt::Debug for HalfOperand {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("HalfOperand")
    }
}

impl HalfOperand {
    // The half value (gathered where registered) in the kernel's shape, and the bytes a
    // gather counted. A broadcast operand is expanded as a view, as `lowered::matmul` expands
    // it (stride 0 over the batch: nothing more is whole than the gathered value).
    fn whole(&self, dtype: FloatDType) -> (FlexTensor, u64) {
        let (value, bytes) = match &self.shard {
            Some(shard) => gather_cast(shard.as_ref(), &self.tensor, dtype),
            None => (self.tensor.clone(), 0),
        };
        match value.shape() == self.batch {
            true => (value, bytes),
            false => (Flex::float_expand(value, self.batch.clone()), bytes),
        }
    }
}

// An operand's gradient from the kernel's (`grad`, of the kernel's shape): summed over the
// dimensions the operand was broadcast over (to its shape `own`), in the half type, as Burn's
// expand node sums it (`broadcast_shape`: the same `float_sum_dim`s in the same order), then
// cast to f32 for a parameter, as its cast node casts it.
fn operand_gradient(grad: FlexTensor, own: &Shape, param: bool) -> FlexTensor {
    let grad = match grad.shape() == *own {
        true => grad,
        false => broadcast_shape::<Flex>(grad, own),
    };
    match param {
        true => cast(grad, FloatDType::F32),
        false => grad,
    }
}

#[derive(Debug)]
struct BoundedHalfMatmul {
    route: Route,
    dtype: FloatDType,
    // Whether each operand is a registered parameter (its gradient goes to its f32 anchor,
    // cast as autocast's cast node casts it), and its own shape (before a broadcast).
    params: [bool; 2],
    shapes: [Shape; 2],
}

impl Backward<Flex, 2> for BoundedHalfMatmul {
    // The left operand where the right one's gradient needs it, and the reverse.
    type State = (Option<HalfOperand>, Option<HalfOperand>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (lhs, rhs) = ops.state;
        let grad = grads.consume::<Flex>(&ops.node);
        let [node_lhs, node_rhs] = ops.parents;
        // `low_gemm::gemm_tracked`'s backward: the same GEMMs in the same order, each kept
        // operand gathered for its GEMM alone; then what the expand and cast nodes below it
        // do to each operand's gradient.
        let [lhs_shape, rhs_shape] = &self.shapes;
        if let Some(node) = node_lhs {
            let rhs = rhs.expect("kept where the left operand is tracked");
            let (whole, bytes) = rhs.whole(self.dtype);
            let out = low_gemm::gemm(grad.clone(), low_gemm::transposed(whole), self.route);
            count_dropped(bytes);
            let out = operand_gradient(out, lhs_shape, self.params[0]);
            grads.register::<Flex>(node.id, out);
        }
        if let Some(node) = node_rhs {
            let lhs = lhs.expect("kept where the right operand is tracked");
            let (whole, bytes) = lhs.whole(self.dtype);
            let out = low_gemm::gemm(low_gemm::transposed(whole), grad, self.route);
            count_dropped(bytes);
            let out = operand_gradient(out, rhs_shape, self.params[1]);
            grads.register::<Flex>(node.id, out);
        }
    }
}

/// `matmul` of two operands whose batch dimensions are equal or broadcast (a size 1 on one
/// side: `lowered::broadcast_batches`), a registered parameter among them gathered in
/// `dtype` for the product alone: `lowered::matmul`'s expand views and
/// [`low_gemm::gemm_tracked`]'s product, in a node that keeps the parameter's placeholder
/// instead of its halves.
pub(super) fn bounded_half_matmul(
    lhs: FloatTensor<Autodiff<Flex>>,
    rhs: FloatTensor<Autodiff<Flex>>,
    lhs_shard: Option<Arc<dyn Shard>>,
    rhs_shard: Option<Arc<dyn Shard>>,
    dtype: FloatDType,
    route: Route,
) -> FloatTensor<Autodiff<Flex>> {
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    let params = [lhs_shard.is_some(), rhs_shard.is_some()];
    let shapes = [lhs.primitive.shape(), rhs.primitive.shape()];
    let [lhs_batch, rhs_batch] = match broadcast_batches(shapes[0].clone(), shapes[1].clone()) {
        Some((lhs, rhs)) => [lhs, rhs],
        // The caller checked (`autocast_matmul`); without a broadcast each keeps its shape.
        None => shapes.clone(),
    };
    let lhs_kept = HalfOperand {
        tensor: lhs.primitive.clone(),
        shard: lhs_shard,
        batch: lhs_batch,
    };
    let rhs_kept = HalfOperand {
        tensor: rhs.primitive.clone(),
        shard: rhs_shard,
        batch: rhs_batch,
    };
    let (lhs_whole, lhs_bytes) = lhs_kept.whole(dtype);
    let (rhs_whole, rhs_bytes) = rhs_kept.whole(dtype);
    let output = low_gemm::gemm(lhs_whole, rhs_whole, route);
    count_dropped(lhs_bytes + rhs_bytes);
    let node = BoundedHalfMatmul {
        route,
        dtype,
        params,
        shapes,
    };
    match node
        .prepare::<NoCheckpointing>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                rhs_tracked.then_some(lhs_kept),
                lhs_tracked.then_some(rhs_kept),
            ),
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}
