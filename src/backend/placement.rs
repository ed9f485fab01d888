//! The decorator's part in running a placed model: device moves staged through the host where
//! the inner backend has no direct copy, and the opt-in rule that co-locates an op's inputs.
//!
//! `scripts/gen_forwarding.py` routes `float_to_device`, `int_to_device` and `bool_to_device`
//! here, and puts a [`Colocate`] in front of every op of the autocast table that takes more
//! than one tensor.

use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor};

use burn_backend::{Backend, TensorData, try_read_sync};

use crate::autocast::CastInput;
use crate::device_moves::{colocate_inputs, stages_through_host};

/// A float tensor moved onto `device`.
///
/// Where the move is staged, a tensor of an autodiff backend goes through the host as a
/// recorded op of its own (see [`tracked_move`](super::tracked_move)), so its gradient comes
/// back the same way; a plain copy through the host would cut the graph without a word. Ints
/// and bools carry no gradient and are simply staged.
pub(crate) fn float_to_device<B: Backend>(
    tensor: FloatTensor<B>,
    device: &B::Device,
) -> FloatTensor<B> {
    if B::float_device(&tensor) != *device && stages_through_host::<B>(device) {
        if !B::ad_enabled(device) {
            if let Some(data) = read(B::float_into_data(tensor.clone())) {
                return B::float_from_data(data, device);
            }
        } else {
            match super::tracked_move::staged::<B>(tensor, device) {
                Ok(moved) => return moved,
                Err(tensor) => {
                    warn_tracked_move::<B>(device);
                    return B::float_to_device(tensor, device);
                }
            }
        }
    }
    B::float_to_device(tensor, device)
}

// An autodiff backend the decorator has no staged move for (not registered with
// `placement::register_tracked_moves`): the backend's own move is about to fail deep inside it
// (on wgpu, cubecl's collective copy fails on the device's server thread, so the caller's
// tensor is never written and nothing panics where it could be caught): say why, once.
#[cold]
fn warn_tracked_move<B: Backend>(device: &B::Device) {
    crate::warnings::once("no staged move for an autodiff backend", (), || {
        log::error!(
            "moving a float tensor to {device:?} under autodiff on {}, which has no \
             device-to-device copy, and no staged move is registered for this autodiff backend: \
             the move is left to the backend, whose copy may never be written. Register it \
             with `placement::register_tracked_moves::<B, C>()`",
            B::name(device)
        )
    });
}

/// An int tensor moved onto `device`, through the host where `B` has no direct copy.
pub(crate) fn int_to_device<B: Backend>(tensor: IntTensor<B>, device: &B::Device) -> IntTensor<B> {
    if B::int_device(&tensor) != *device
        && stages_through_host::<B>(device)
        && let Some(data) = read(B::int_into_data(tensor.clone()))
    {
        return B::int_from_data(data, device);
    }
    B::int_to_device(tensor, device)
}

/// A bool tensor moved onto `device`, through the host where `B` has no direct copy.
pub(crate) fn bool_to_device<B: Backend>(
    tensor: BoolTensor<B>,
    device: &B::Device,
) -> BoolTensor<B> {
    if B::bool_device(&tensor) != *device
        && stages_through_host::<B>(device)
        && let Some(data) = read(B::bool_into_data(tensor.clone()))
    {
        return B::bool_from_data(data, device);
    }
    B::bool_to_device(tensor, device)
}

// A failed read falls back to the backend's own move: ops cannot return errors, and the
// backend's move is what would have run without the decorator.
fn read(
    future: impl Future<Output = Result<TensorData, burn_backend::ExecutionError>> + Send,
) -> Option<TensorData> {
    try_read_sync(future).and_then(Result::ok)
}

/// Where one op call's tensor inputs go when the co-locate rule is on.
///
/// Off (the default), this is one relaxed atomic load per op and every input passes through
/// untouched. On, every tensor input not already on the op's target device (that of its last
/// float input: in Burn's ops the weight and bias of `linear`, `conv*` and the right-hand side
/// of a `matmul` come after the activation) is moved there, through
/// [`float_to_device`] and friends.
pub(crate) struct Colocate<B: Backend> {
    target: Option<B::Device>,
}

impl<B: Backend> Colocate<B> {
    #[inline]
    pub(crate) fn new(inputs: &[CastInput<'_, FloatTensor<B>>]) -> Self {
        if !colocate_inputs() {
            return Colocate { target: None };
        }
        Colocate {
            target: last_device::<B>(inputs),
        }
    }

    #[inline]
    pub(crate) fn float(&self, tensor: FloatTensor<B>) -> FloatTensor<B> {
        match &self.target {
            Some(device) if B::float_device(&tensor) != *device => {
                float_to_device::<B>(tensor, device)
            }
            _ => tensor,
        }
    }

    #[inline]
    pub(crate) fn float_opt(&self, tensor: Option<FloatTensor<B>>) -> Option<FloatTensor<B>> {
        tensor.map(|t| self.float(t))
    }

    #[inline]
    pub(crate) fn float_vec(&self, tensors: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
        if self.target.is_none() {
            return tensors;
        }
        tensors.into_iter().map(|t| self.float(t)).collect()
    }

    #[inline]
    pub(crate) fn int(&self, tensor: IntTensor<B>) -> IntTensor<B> {
        match &self.target {
            Some(device) if B::int_device(&tensor) != *device => int_to_device::<B>(tensor, device),
            _ => tensor,
        }
    }

    // Emitted for a table op taking an optional int tensor; none does in Burn 0.21.
    #[allow(dead_code)]
    #[inline]
    pub(crate) fn int_opt(&self, tensor: Option<IntTensor<B>>) -> Option<IntTensor<B>> {
        tensor.map(|t| self.int(t))
    }

    #[inline]
    pub(crate) fn bool(&self, tensor: BoolTensor<B>) -> BoolTensor<B> {
        match &self.target {
            Some(device) if B::bool_device(&tensor) != *device => {
                bool_to_device::<B>(tensor, device)
            }
            _ => tensor,
        }
    }

    #[inline]
    pub(crate) fn bool_opt(&self, tensor: Option<BoolTensor<B>>) -> Option<BoolTensor<B>> {
        tensor.map(|t| self.bool(t))
    }
}

#[cold]
fn last_device<B: Backend>(inputs: &[CastInput<'_, FloatTensor<B>>]) -> Option<B::Device> {
    inputs.iter().rev().find_map(|input| match input {
        CastInput::One(t) => Some(B::float_device(t)),
        CastInput::Maybe(t) => t.as_ref().map(B::float_device),
        CastInput::Many(ts) => ts.last().map(B::float_device),
    })
}
