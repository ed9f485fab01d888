//! ZeRO stage 3's reduction in the backward pass (FSDP's post-backward reduce-scatter): on the
//! pass that completes an accumulation window, each parameter's gradient is reduce-scattered
//! as soon as it is final, every process keeping its slice's mean; the window's earlier
//! passes accumulate whole gradients locally (FSDP's `no_sync`).
//!
//! Every op of a pass reads a released parameter through its *anchor*
//! (`crate::backend::placeholder`): an identity node between the parameter and its uses,
//! made at the first use and placed just above that op's input, so that Burn's autodiff runs
//! it once every use's gradient is summed into it (a layer used twice, tied weights) and
//! before the layers below. On the reducing pass the anchor adds the window's earlier sum
//! (handed to it by [`begin`]), reduce-scatters the total (the mean, in f32, padded as the
//! parameter is: [`slice_len`](super::slice_len)) and registers this process's slice of it
//! on the parameter, shaped as the optimizer steps the slice (`[1, .., 1, slice]`). A
//! parameter the pass does not reach is reduced by [`end`], in the model's visiting order.
//! The step then finds each process's slice of every averaged gradient: the loss scaler's
//! overflow check and the global norm's clipping read them as they read stage 2's
//! partition's (on two processes the means are stage 2's bit for bit; on more, each slice
//! sums in its own ring order, so they agree to rounding).
//!
//! An anchor lives until its backward runs, the parameters are released, or no pass is
//! being built: the `Accelerator`'s `accumulate` (a batch starts) and the end of each backward
//! pass discard the anchors left (`placeholder::discard_anchors`). A forward pass on the
//! training model whose graph is dropped without a backward (an evaluation that reads its
//! loss) thus leaves nothing to the next batch's pass, whose backward runs its own nodes alone
//! (tested by `stage_3_forward_passes_dropped_without_backward_leave_nothing_and_end_where_stage_2_does`).
//! One run after `accumulate` and before the batch's forward pass is still reused by it: that
//! pass's backward then also runs the dropped pass's nodes, with zero gradients (a zero added
//! to each gradient; more work, the same values but for the sign of a zero).
//!
//! The reduction needs every parameter released (by `prepare_model`, which the
//! `with_accelerate` fit runs before its first forward pass, or else from the first step on:
//! the first window is then reduce-scattered at the step) and the decorator over a registered
//! autodiff backend (whose ops make anchors); elsewhere [`begin`] declines and the step
//! reduce-scatters the window into slices at its end.

use std::any::Any;
use std::collections::BTreeMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::placeholder;

// The parameter `value` is, as its node id and shard, if it is a released parameter.
fn registered<B: AutodiffBackend, const D: usize>(
    value: Tensor<B, D>,
) -> Option<(u64, std::sync::Arc<dyn placeholder::Shard>)> {
    placeholder::registered::<B>(&value.into_primitive().tensor())
}

/// Before the backward pass that completes a window: hands the window's earlier passes' sums
/// (`window`, emptied) to the anchors and makes them reduce. Returns `false`, and changes
/// nothing, where some parameter of `model` is not released or the backend makes no anchors.
pub(crate) fn begin<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    window: &mut GradientsParams,
) -> bool {
    struct AllReleased(bool);
    impl<B: AutodiffBackend> ModuleVisitor<B> for AllReleased {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 &= registered(param.val()).is_some();
        }
    }
    let mut all = AllReleased(true);
    model.visit(&mut all);
    if !all.0 {
        return false;
    }
    struct Hand<'a> {
        window: &'a mut GradientsParams,
        by_node: BTreeMap<u64, Box<dyn Any + Send>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Hand<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some((node, _)) = registered(param.val()) else {
                return;
            };
            if let Some(sum) = self.window.remove::<B::InnerBackend, D>(param.id) {
                self.by_node
                    .insert(node, Box::new(sum.into_primitive().tensor()));
            }
        }
    }
    let mut hand = Hand {
        window,
        by_node: BTreeMap::new(),
    };
    model.visit(&mut hand);
    placeholder::begin_reducing(hand.by_node);
    true
}

/// After the pass [`begin`] started: the window's sums of the parameters the pass did not
/// reach are reduce-scattered in the model's visiting order (every process the same), each
/// process registering its slice's mean in `grads`.
pub(crate) fn end<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
) {
    let left = placeholder::end_reducing();
    if left.is_empty() {
        return;
    }
    struct Reduce<'a> {
        grads: &'a mut GradientsParams,
        left: BTreeMap<u64, Box<dyn Any + Send>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Reduce<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some((node, shard)) = registered(param.val()) else {
                return;
            };
            let Some(sum) = self.left.remove(&node) else {
                return;
            };
            let sum = *sum
                .downcast::<burn::tensor::ops::FloatTensor<B::InnerBackend>>()
                .unwrap_or_else(|_| unreachable!("`begin` kept the inner backend's tensors"));
            let mean = placeholder::reduce_to_slice::<B::InnerBackend>(shard.as_ref(), sum);
            let mean = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(mean));
            self.grads.register(param.id, mean);
        }
    }
    model.visit(&mut Reduce { grads, left });
}
