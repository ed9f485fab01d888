//! Averaging a model's gradients over the processes, as DDP does at a synchronising step:
//! packed into a few flat buffers (buckets of up to [`BUCKET_VALUES`] values, as DDP's 25 MB
//! buckets), so that a step makes a few collective calls and reads the device a few times,
//! whatever the number of parameters.
//!
//! Every process packs every float parameter of the model, in the module's visiting order, so
//! the buffers line up value for value. A parameter with no gradient on a process contributes
//! zeros; each bucket ends with one presence value per parameter, so that a parameter no
//! process has a gradient for stays without one (an optimizer would otherwise move it with a
//! zero gradient, through its momentum).
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
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorData};

use super::error::DistributedError;
use super::group::{ProcessGroup, ReduceOp, to_f32};

/// The most values one collective call carries (25 MiB of f32, DDP's default bucket); a
/// larger parameter travels alone.
pub const BUCKET_VALUES: usize = 25 * 1024 * 1024 / 4;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

// A parameter's averaged gradient, flat, with the dtype and shape to give it back.
type Reduced<B> = (Tensor<Inner<B>, 1>, DType, Vec<usize>);

// One parameter's slot: its gradient flattened to f32 (None: no gradient here).
struct Slot<B: AutodiffBackend> {
    id: ParamId,
    dims: Vec<usize>,
    dtype: DType,
    device: burn::tensor::Device<B>,
    grad: Option<Tensor<Inner<B>, 1>>,
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
    let mut take = TakeSlots::<B> {
        grads,
        slots: Vec::new(),
    };
    module.visit(&mut take);
    let slots = take.slots;
    let mut reduced = HashMap::new();
    for bucket in buckets(&slots) {
        let bucket = &slots[bucket];
        let device = bucket[0].device.clone();
        let flats: Vec<Tensor<Inner<B>, 1>> = bucket
            .iter()
            .map(|s| {
                s.grad
                    .clone()
                    .unwrap_or_else(|| Tensor::zeros([numel(&s.dims)], &device))
            })
            .collect();
        let mut values = to_f32(Tensor::cat(flats, 0).into_data());
        values.reserve_exact(bucket.len());
        values.extend(bucket.iter().map(|s| f32::from(u8::from(s.grad.is_some()))));
        group.all_reduce(&mut values, ReduceOp::Mean)?;
        let grads_len = values.len() - bucket.len();
        let presence = values.split_off(grads_len);
        let flat = Tensor::<Inner<B>, 1>::from_data(TensorData::new(values, [grads_len]), &device);
        let mut offset = 0;
        for (slot, present) in bucket.iter().zip(presence) {
            let n = numel(&slot.dims);
            if present != 0.0 {
                let grad = flat.clone().slice(offset..offset + n);
                reduced.insert(slot.id, (grad, slot.dtype, slot.dims.clone()));
            }
            offset += n;
        }
    }
    module.visit(&mut PutBack::<B> {
        grads: take.grads,
        reduced,
    });
    Ok(())
}

fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

// Consecutive runs of slots of at most BUCKET_VALUES values (a larger slot alone).
fn buckets<B: AutodiffBackend>(slots: &[Slot<B>]) -> Vec<std::ops::Range<usize>> {
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
