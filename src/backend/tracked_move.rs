//! Moving an autodiff tensor between two devices that have no device-to-device copy (Burn
//! 0.21's wgpu), through the host, with the move recorded so its gradient goes back the same
//! way.
//!
//! Burn's autodiff `float_to_device` records the move and runs the inner backend's own copy,
//! which on wgpu fails on the device's server thread and leaves the result unwritten; Burn
//! calls it itself (loading a checkpoint onto a model on another device, `Module::fork`), so
//! the decorator must not let such a move reach it. A backward node can only be built with the
//! concrete `Autodiff<B, C>` in hand, so, as for fp8's node, the decorator looks up by `TypeId`
//! a function registered for its inner backend by code that had the concrete type.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::tensor::{Device, FloatTensor};
use burn_backend::{Backend, try_read_sync};

use crate::hooks::{self, HookKind};

/// A float tensor of the inner backend rebuilt on `device` from a host copy (same dtype);
/// `None` when the read fails.
fn through_host<B: Backend>(tensor: FloatTensor<B>, device: &B::Device) -> Option<FloatTensor<B>> {
    let data = try_read_sync(B::float_into_data(tensor)).and_then(Result::ok)?;
    Some(B::float_from_data(data, device))
}

/// The move staged through the host, as a node of `Autodiff<B, C>`'s graph: the gradient
/// is staged back to the source device. `None` when reading the tensor fails.
fn autodiff_move<B: Backend, C: CheckpointStrategy>(
    tensor: FloatTensor<Autodiff<B, C>>,
    device: &B::Device,
) -> Option<FloatTensor<Autodiff<B, C>>> {
    #[derive(Debug)]
    struct StagedMove;

    impl<B: Backend> Backward<B, 1> for StagedMove {
        type State = B::Device;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let source = ops.state;
            unary::<B, _>(ops.parents, ops.node, grads, |grad| {
                // A read that fails here has no error channel; the backend's own move is the
                // only other way back.
                match through_host::<B>(grad.clone(), &source) {
                    Some(moved) => moved,
                    None => B::float_to_device(grad, &source),
                }
            });
        }
    }

    let source = B::float_device(&tensor.primitive);
    let node = tensor.node.clone();
    let moved = through_host::<B>(tensor.primitive, device)?;
    Some(
        match StagedMove.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(source, moved),
            OpsKind::UnTracked(prep) => prep.finish(moved),
        },
    )
}

type Hook<B> = fn(FloatTensor<B>, &Device<B>) -> Option<FloatTensor<B>>;

// The hooks' kind in the crate's registry.
struct StagedMoves;

impl HookKind for StagedMoves {
    fn register_known() {
        register_known();
    }
}

/// Lets the decorator stage tracked moves on `Autodiff<B, C>` (Burn's autodiff over the
/// backends this crate has features for, with default checkpointing, is registered without
/// asking).
pub fn register<B: Backend, C: CheckpointStrategy>() {
    let hook: Hook<Autodiff<B, C>> = autodiff_move::<B, C>;
    hooks::insert::<StagedMoves, Autodiff<B, C>, _>(hook);
}

fn register_known() {
    struct Register;
    impl hooks::ForEachBackend for Register {
        fn call<B: Backend>(&mut self) {
            use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
            register::<B, NoCheckpointing>();
        }
    }
    hooks::each_backend(&mut Register);
}

/// `tensor` moved to `device` through the host as a recorded autodiff op, where `B` is a
/// registered autodiff backend and the read succeeds; otherwise `Err(tensor)` back.
pub(crate) fn staged<B: Backend>(
    tensor: FloatTensor<B>,
    device: &B::Device,
) -> Result<FloatTensor<B>, FloatTensor<B>> {
    match hooks::get::<StagedMoves, B, Hook<B>>() {
        Some(hook) => hook(tensor.clone(), device).ok_or(tensor),
        None => Err(tensor),
    }
}
