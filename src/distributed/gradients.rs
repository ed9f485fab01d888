//! Averaging a model's gradients over the processes, as DDP does at a synchronising step:
//! packed into a few flat buffers (buckets of up to [`BUCKET_VALUES`] values, as DDP's 25 MB
//! buckets), so that a step makes a few collective calls and reads the device a few times,
//! whatever the number of parameters.
//!
//! Every process packs every float parameter of the model, in the module's visiting order, so
//! the buffers line up value for value. A parameter with no gradient on a process contributes
//! zeros; a first small all-reduce counts the processes that have each parameter's gradient,
//! so that a parameter no process has a gradient for stays without one (an optimizer would
//! otherwise move it with a zero gradient, through its momentum).
//!
//! Host copies per bucket: the concatenation into the bucket on the device (none for a
//! parameter alone in its bucket), the device's download and upload (none on a CPU backend
//! that hands its buffer over), and the kernel's copies in and out of the sockets; the
//! received pieces are added straight into the bucket.
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

use super::error::DistributedError;
use super::group::{ProcessGroup, ReduceOp};

/// The most values one collective call carries (25 MiB of f32, DDP's default bucket); a
/// larger parameter travels alone.
pub const BUCKET_VALUES: usize = 25 * 1024 * 1024 / 4;

pub(crate) type Inner<B> = <B as AutodiffBackend>::InnerBackend;

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

/// Replaces the gradients of `module`'s parameters in `grads` by their mean over the
/// processes of `group`. Every process must call it at the same step. Does nothing for a
/// single process.
///
/// # Errors
/// What [`ProcessGroup::all_reduce`] returns.
pub fn all_reduce_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
    grads: &mut GradientsParams,
) -> Result<(), DistributedError> {
    if group.world_size() == 1 {
        return Ok(());
    }
    let slots = take_slots(module, grads);
    let present = presence(group, &slots)?;
    let mut reduced = HashMap::new();
    for bucket in buckets(&slots) {
        let (present, bucket) = (&present[bucket.clone()], &slots[bucket]);
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
        _ => Tensor::cat(
            slots
                .iter()
                .map(|s| {
                    s.grad
                        .clone()
                        .unwrap_or_else(|| Tensor::zeros([numel(&s.dims)], &s.device))
                })
                .collect(),
            0,
        ),
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

pub(crate) fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

// Consecutive runs of slots of at most BUCKET_VALUES values (a larger slot alone).
pub(crate) fn buckets<B: AutodiffBackend>(slots: &[Slot<B>]) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, slot) in slots.iter().enumerate() {
        let n = numel(&slot.dims);
        if i > start && size + n > BUCKET_VALUES {
            ranges.push(start..i);
            (start, size) = (i, 0);
        }
        size += n;
    }
    if start < slots.len() {
        ranges.push(start..slots.len());
    }
    ranges
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
