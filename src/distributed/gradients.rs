//! Averaging a model's gradients over the processes, as DDP does at a synchronising step:
//! packed into a few flat buffers (buckets of up to [`BUCKET_VALUES`] values, as DDP's 25 MB
//! buckets), so that a step makes a few collective calls and reads the device a few times,
//! whatever the number of parameters.
//!
//! Every process packs every float parameter of the model, in the module's visiting order, so
//! the buffers line up value for value. A parameter with no gradient on a process contributes
//! zeros; a first small collective counts the processes that have each parameter's gradient,
//! so that a parameter no process has a gradient for stays without one (an optimizer would
//! otherwise move it with a zero gradient, through its momentum).
//!
//! Two paths ([`SyncLayout`]). On Flex (the default backend), each gradient is reduced where
//! it lies, in the order its strides put its values, and given back with its own layout, once
//! every process has said its layouts agree (`flex_sync`): a large gradient is reduced in its
//! own storage, the small ones through a bucket buffer kept from step to step. Elsewhere (and
//! with [`SyncLayout::Contiguous`]), every gradient is flattened in logical order and packed:
//! host copies per bucket are the flattening (a transpose, for a Flex view), the
//! concatenation on the device (none for a parameter alone in its bucket), the device's
//! download and upload (none on a CPU backend that hands its buffer over), and the kernel's
//! copies in and out of the sockets; the received pieces are added straight into the bucket.
//! [`sync_copied_values`] counts the host copies of either path.
//!
//! An inf or a NaN on any process makes the reduced value non-finite on every process (IEEE:
//! `inf + x = inf`, `inf - inf = NaN`, `NaN + x = NaN`), and every process ends with the same
//! bits, so the overflow check that follows finds the same answer everywhere: the overflow
//! flag is reduced with the gradients, in the same buffers, and every rank skips the same
//! steps and keeps the same loss scale.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, FloatDType, Shape, Tensor};

pub(crate) use super::bucket::Inner;
pub use super::bucket::{BUCKET_VALUES, sync_copied_values};
use super::bucket::{bucket_ranges, count_copied, numel};
use super::error::DistributedError;
use super::group::{ProcessGroup, ReduceOp};
use crate::context::{self, ContextGuard, Setting};

// A parameter's averaged gradient, flat, with the dtype and shape to give it back.
pub(crate) type Reduced<B> = (Tensor<Inner<B>, 1>, DType, Vec<usize>);

/// One parameter's slot: its gradient flattened to f32 (None: no gradient here).
pub(crate) struct Slot<B: AutodiffBackend> {
    pub(crate) id: ParamId,
    pub(crate) dims: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) device: burn::tensor::Device<B>,
    pub(crate) grad: Option<Tensor<Inner<B>, 1>>,
}

/// How the gradient sync reads and writes the gradients. Every process of a run must sync
/// with the same one: the two paths make different collectives (the built-in engine refuses
/// to mix them; under MPI a mix is undefined).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SyncLayout {
    /// Where the backend lends its storage (Flex): each gradient reduced as it lies in memory
    /// and given back with its own layout, without a transpose or fresh pages, wherever every
    /// process's layout agrees; in logical order where they do not. Elsewhere, as
    /// [`Contiguous`](Self::Contiguous).
    #[default]
    AsStored,
    /// Every gradient flattened in logical (row-major) order and packed, on every backend.
    Contiguous,
}

impl Setting for SyncLayout {
    const SLOT: context::Slot = context::Slot::SyncLayout;
    fn unset() -> Self {
        SyncLayout::AsStored
    }
}

/// Syncs this thread's gradients with `layout` (both [`all_reduce_gradients`] and ZeRO stage
/// 2's [`reduce_scatter_gradients`](crate::zero::reduce_scatter_gradients)) until the scope
/// drops; [`SyncLayout::AsStored`] otherwise. For comparing the paths; every process must
/// pick the same.
pub fn scope_sync_layout(layout: SyncLayout) -> ContextGuard {
    context::scope(layout)
}

/// Whether this thread syncs `B`'s gradients where they lie (see [`SyncLayout`]).
#[cfg(feature = "flex")]
pub(crate) fn as_stored<B: burn::tensor::backend::Backend>() -> bool {
    context::get::<SyncLayout>() == SyncLayout::AsStored && super::flex_sync::applies::<B>()
}

/// Replaces the gradients of `module`'s parameters in `grads` by their mean over the
/// processes of `group`. Every process must call it at the same step. Does nothing for a
/// single process. On Flex, each gradient keeps its layout (see [`SyncLayout`]).
///
/// # Errors
/// What [`ProcessGroup::all_reduce`] returns; [`DistributedError::Mismatch`] or
/// [`DistributedError::Malformed`] for processes whose models differ.
pub fn all_reduce_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
    grads: &mut GradientsParams,
) -> Result<(), DistributedError> {
    if group.world_size() == 1 {
        return Ok(());
    }
    #[cfg(feature = "flex")]
    if as_stored::<Inner<B>>() {
        return super::flex_sync::all_reduce::<B, M>(group, module, grads);
    }
    let slots = take_slots(module, grads);
    let present = presence(group, &slots)?;
    let mut reduced = HashMap::new();
    for bucket in buckets(&slots) {
        let (present, bucket) = (&present[bucket.clone()], &slots[bucket]);
        #[cfg(feature = "flex")]
        if let [
            Slot {
                grad: Some(grad), ..
            },
        ] = bucket
            && super::flex_sync::applies::<Inner<B>>()
        {
            // A gradient alone travels as it is, but the slot still holds it: Flex's download
            // of a shared buffer copies it, and `Bytes::from_bytes_vec` copies that again to
            // align it (perf, issue 38).
            count_copied(2 * grad.dims()[0]);
        }
        let flat = group.all_reduce_tensor(pack(bucket.iter()), ReduceOp::Mean)?;
        unpack(&flat, bucket.iter().zip(present), &mut reduced);
    }
    put_back(module, grads, reduced);
    Ok(())
}

/// Every float parameter's gradient, taken out of `grads` and flattened to f32, in the
/// module's visiting order.
pub(crate) fn take_slots<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
) -> Vec<Slot<B>> {
    let mut take = TakeSlots::<B> {
        grads,
        slots: Vec::new(),
    };
    module.visit(&mut take);
    take.slots
}

/// How many processes have each parameter's gradient: a parameter none of them has stays
/// without one.
pub(crate) fn presence<B: AutodiffBackend>(
    group: &ProcessGroup,
    slots: &[Slot<B>],
) -> Result<Vec<u32>, DistributedError> {
    let mut present: Vec<u32> = slots.iter().map(|s| u32::from(s.grad.is_some())).collect();
    group.all_reduce(&mut present, ReduceOp::Sum)?;
    Ok(present)
}

/// The slots' gradients in one flat f32 tensor, zeros for a missing one. A parameter alone (a
/// large one) travels as it is, without a copy.
pub(crate) fn pack<'a, B: AutodiffBackend>(
    slots: impl ExactSizeIterator<Item = &'a Slot<B>>,
) -> Tensor<Inner<B>, 1> {
    let slots: Vec<&Slot<B>> = slots.collect();
    match slots.as_slice() {
        [
            Slot {
                grad: Some(grad), ..
            },
        ] => grad.clone(),
        _ => {
            count_copied(slots.iter().map(|s| numel(&s.dims)).sum());
            Tensor::cat(
                slots
                    .iter()
                    .map(|s| {
                        s.grad
                            .clone()
                            .unwrap_or_else(|| Tensor::zeros([numel(&s.dims)], &s.device))
                    })
                    .collect(),
                0,
            )
        }
    }
}

/// Cuts `flat` back into the gradients of `slots` (in the order they were packed), keeping
/// those some process had.
pub(crate) fn unpack<'a, B: AutodiffBackend>(
    flat: &Tensor<Inner<B>, 1>,
    slots: impl Iterator<Item = (&'a Slot<B>, &'a u32)>,
    reduced: &mut HashMap<ParamId, Reduced<B>>,
) {
    let mut offset = 0;
    for (slot, present) in slots {
        let n = numel(&slot.dims);
        if *present != 0 {
            let grad = flat.clone().slice(offset..offset + n);
            reduced.insert(slot.id, (grad, slot.dtype, slot.dims.clone()));
        }
        offset += n;
    }
}

/// Registers the reduced gradients in `grads`, in their parameters' dtypes and shapes.
pub(crate) fn put_back<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    reduced: HashMap<ParamId, Reduced<B>>,
) {
    module.visit(&mut PutBack::<B> { grads, reduced });
}

// Consecutive runs of slots of at most BUCKET_VALUES values (a larger slot alone).
pub(crate) fn buckets<B: AutodiffBackend>(slots: &[Slot<B>]) -> Vec<std::ops::Range<usize>> {
    let sizes: Vec<usize> = slots.iter().map(|s| numel(&s.dims)).collect();
    bucket_ranges(&sizes)
}

struct TakeSlots<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    slots: Vec<Slot<B>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeSlots<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self.grads.remove::<Inner<B>, D>(param.id);
        let (dims, dtype, device) = match &grad {
            Some(g) => (g.dims().to_vec(), g.dtype(), g.device()),
            None => {
                let value = param.val();
                (value.dims().to_vec(), value.dtype(), value.device())
            }
        };
        let grad = grad.map(|g| {
            #[cfg(feature = "flex")]
            count_copied(super::flex_sync::values_copied_to_flatten(&g));
            let flat = g.reshape([numel(&dims)]);
            if flat.dtype() == DType::F32 {
                flat
            } else {
                flat.cast(FloatDType::F32)
            }
        });
        self.slots.push(Slot {
            id: param.id,
            dims,
            dtype,
            device,
            grad,
        });
    }
}

struct PutBack<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    reduced: HashMap<ParamId, Reduced<B>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutBack<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some((flat, dtype, dims)) = self.reduced.remove(&param.id) else {
            return;
        };
        let grad: Tensor<Inner<B>, D> = flat.reshape(Shape::from(dims));
        let grad = if dtype == DType::F32 {
            grad
        } else {
            grad.cast(FloatDType::from(dtype))
        };
        self.grads.register(param.id, grad);
    }
}
