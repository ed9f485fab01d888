//! Sharded data parallel's collectives (ZeRO stages 1 and 2, see [`ZeroStage`]): each process
//! steps only the parameters it owns ([`partition`]), and the updated parameters are shared
//! back so that every process again holds the whole model.
//!
//! - Stage 1: the gradients are averaged whole, as at stage 0, then [`keep_own`] drops those of
//!   parameters another process owns, so the optimizer (Burn's `OptimizerAdaptor` steps and
//!   keeps state only for the parameters it is given gradients for) holds state for this
//!   process's partition alone.
//! - Stage 2: [`reduce_scatter_gradients`] packs the gradients owner by owner and
//!   reduce-scatters them: each process receives only its partition's averages.
//! - Both: after the step, [`share_parameters`] all-gathers every parameter from its owner.
//!
//! With two processes every averaged value is one f32 addition, whatever the schedule, so the
//! stages end bit for bit where stage 0 does; with more, stage 2 sums in another order than
//! stage 0's all-reduce and agrees to rounding.
//!
//! On Flex both collectives read and write the tensors where they lie, as the all-reduce does
//! ([`SyncLayout`](crate::distributed::SyncLayout)): stage 2 reduce-scatters each large
//! gradient in its own storage and the small ones through a bucket buffer kept from step to
//! step; the parameters are shared bucket by bucket, a large one sent from and received into
//! its own storage, instead of through a buffer of the whole model made afresh each step.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};

use crate::distributed::bucket::{Inner, numel};
use crate::distributed::gradients;
use crate::distributed::{DistributedError, Element, ProcessGroup, ReduceOp};

use super::sharding::{ZeroStage, partition};

/// The owner of every float parameter of a model, by id.
#[derive(Debug, Clone)]
pub struct Partition {
    owners: HashMap<ParamId, usize>,
}

impl Partition {
    /// `module`'s parameters over `processes` processes ([`partition`]).
    pub fn of<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M, processes: usize) -> Self {
        let params = params(module);
        let sizes: Vec<usize> = params.iter().map(|(_, n)| *n).collect();
        let owners = partition(&sizes, processes);
        Self {
            owners: params.iter().map(|(id, _)| *id).zip(owners).collect(),
        }
    }

    /// The process that owns parameter `id` (0 for one this partition does not know).
    pub fn owner(&self, id: ParamId) -> usize {
        self.owners.get(&id).copied().unwrap_or(0)
    }
}

/// Every float parameter's id, in visiting order.
pub(crate) fn param_ids<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<ParamId> {
    params(module).into_iter().map(|(id, _)| id).collect()
}

/// Every float parameter's id and shape, in visiting order, without reading it.
pub(crate) fn param_shapes<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
) -> Vec<(ParamId, Vec<usize>)> {
    struct Shapes(Vec<(ParamId, Vec<usize>)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0
                .push((param.id, param.lazy_shape().dims::<D>().to_vec()));
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    shapes.0
}

// Every float parameter's id and number of values, in visiting order.
fn params<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<(ParamId, usize)> {
    struct Sizes(Vec<(ParamId, usize)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            // Without reading it (a released parameter, ZeRO stage 3, is not gathered) nor
            // initialising a lazy one (stage 3 can release a model before it is ever whole).
            self.0.push((param.id, param.lazy_shape().num_elements()));
        }
    }
    let mut sizes = Sizes(Vec::new());
    module.visit(&mut sizes);
    sizes.0
}

/// Stage 1: drops from `grads` the gradients of the parameters other processes own.
pub fn keep_own<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    partition: &Partition,
    rank: usize,
) {
    struct Drop<'a> {
        grads: &'a mut GradientsParams,
        partition: &'a Partition,
        rank: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Drop<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.partition.owner(param.id) != self.rank {
                let _ = self.grads.remove::<Inner<B>, D>(param.id);
            }
        }
    }
    module.visit(&mut Drop::<'_> {
        grads,
        partition,
        rank,
    });
}

/// Stage 2: replaces the gradients in `grads` by their mean over the processes, for this
/// process's partition only; the others' are dropped. Every process must call it at the same
/// step, with the same partition.
///
/// # Errors
/// What [`ProcessGroup::reduce_scatter`] returns.
pub fn reduce_scatter_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
    grads: &mut GradientsParams,
    partition: &Partition,
) -> Result<(), DistributedError> {
    #[cfg(feature = "flex")]
    if gradients::as_stored::<Inner<B>>() {
        return crate::distributed::flex_sync::reduce_scatter::<B, M>(
            group,
            module,
            grads,
            |id| partition.owner(id),
            |owners, sizes| by_owner(owners, sizes, group.world_size()),
        );
    }
    let (rank, n) = (group.rank(), group.world_size());
    let mut slots = gradients::take_slots(module, grads);
    let present = gradients::presence(group, &slots)?;
    let owners: Vec<usize> = slots.iter().map(|s| partition.owner(s.id)).collect();
    let mut reduced = HashMap::new();
    // Bucket by bucket (consecutive parameters, as stage 0's all-reduce goes), owner by owner
    // within each: a process holds one bucket's packed copy at a time, and drops its own
    // gradients of a bucket as soon as they are packed.
    for bucket in gradients::buckets(&slots) {
        let sizes: Vec<usize> = slots[bucket.clone()]
            .iter()
            .map(|s| numel(&s.dims))
            .collect();
        let (order, counts) = by_owner(&owners[bucket.clone()], &sizes, n);
        let order: Vec<usize> = order.into_iter().map(|j| bucket.start + j).collect();
        let device = slots[bucket.start].device.clone();
        let flat = gradients::pack(order.iter().map(|&i| &slots[i]));
        for i in bucket.clone() {
            slots[i].grad = None;
        }
        let mut data = flat.into_data();
        let mine =
            group.reduce_scatter_bytes(Element::F32, &mut data.bytes, &counts, ReduceOp::Mean)?;
        let own = data.bytes[mine].to_vec();
        drop(data);
        let own = TensorData::from_bytes_vec(own, [counts[rank]], DType::F32);
        let own = Tensor::<Inner<B>, 1>::from_data(own, &device);
        let own_slots = order
            .iter()
            .filter(|&&i| owners[i] == rank)
            .map(|&i| (&slots[i], &present[i]));
        gradients::unpack(&own, own_slots, &mut reduced);
    }
    gradients::put_back(module, grads, reduced);
    Ok(())
}

/// After a sharded step: every parameter from its owner, so that every process holds the
/// whole updated model. Every process must call it at the same step.
///
/// # Errors
/// What [`ProcessGroup::all_gather_in_place`] returns.
pub fn share_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
    partition: &Partition,
) -> Result<M, DistributedError> {
    let (rank, n) = (group.rank(), group.world_size());
    if n == 1 {
        return Ok(module);
    }
    #[cfg(feature = "flex")]
    if gradients::as_stored::<Inner<B>>() {
        return crate::distributed::flex_sync::share_parameters::<B, M>(
            group,
            module,
            |id| partition.owner(id),
            |owners, sizes| by_owner(owners, sizes, n),
        );
    }
    // Every parameter's value, flat in f32, owner by owner.
    struct Values<B: AutodiffBackend>(Vec<(ParamId, Tensor<Inner<B>, 1>, DType)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val().inner();
            let dtype = value.dtype();
            let flat = value.reshape([-1]);
            let flat = if dtype == DType::F32 {
                flat
            } else {
                flat.cast(FloatDType::F32)
            };
            self.0.push((param.id, flat, dtype));
        }
    }
    let mut values = Values::<B>(Vec::new());
    module.visit(&mut values);
    let values = values.0;
    let owners: Vec<usize> = values.iter().map(|v| partition.owner(v.0)).collect();
    let sizes: Vec<usize> = values.iter().map(|v| v.1.dims()[0]).collect();
    let (order, counts) = by_owner(&owners, &sizes, n);
    let mut buffer = vec![0f32; counts.iter().sum()];
    let start: usize = counts[..rank].iter().sum();
    let mut at = start;
    for &i in order.iter().filter(|&&i| owners[i] == rank) {
        let own = values[i].1.clone().into_data().convert::<f32>();
        let own = own.as_slice::<f32>().expect("f32 values");
        buffer[at..at + own.len()].copy_from_slice(own);
        at += own.len();
    }
    group.all_gather_in_place(&mut buffer, &counts)?;
    // The others' parameters, replaced by their owners' values.
    let mut updated = HashMap::new();
    let mut at = 0;
    for &i in &order {
        let (id, flat, dtype) = &values[i];
        let len = flat.dims()[0];
        if owners[i] != rank {
            let device = flat.device();
            let data = TensorData::new(buffer[at..at + len].to_vec(), [len]);
            let value = Tensor::<Inner<B>, 1>::from_data(data, &device);
            updated.insert(*id, (value, *dtype));
        }
        at += len;
    }
    struct Replace<B: AutodiffBackend>(HashMap<ParamId, (Tensor<Inner<B>, 1>, DType)>);
    impl<B: AutodiffBackend> ModuleMapper<B> for Replace<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some((flat, dtype)) = self.0.remove(&param.id) else {
                return param;
            };
            param.map(|tensor| {
                let require_grad = tensor.is_require_grad();
                let value = flat.reshape(tensor.shape());
                let value = if dtype == DType::F32 {
                    value
                } else {
                    value.cast(FloatDType::from(dtype))
                };
                let value = Tensor::<B, D>::from_inner(value);
                if require_grad {
                    value.require_grad()
                } else {
                    value
                }
            })
        }
    }
    Ok(module.map(&mut Replace::<B>(updated)))
}

/// The parameters (by index) owner by owner, each owner's in visiting order, and how many
/// values each owner's block holds.
fn by_owner(owners: &[usize], sizes: &[usize], processes: usize) -> (Vec<usize>, Vec<usize>) {
    let mut order: Vec<usize> = (0..owners.len()).collect();
    // A stable sort keeps each owner's parameters in visiting order.
    order.sort_by_key(|&i| owners[i]);
    let mut counts = vec![0; processes];
    for (owner, size) in owners.iter().zip(sizes) {
        counts[*owner] += size;
    }
    (order, counts)
}

/// Whether `stage` shards anything across `group`'s processes.
pub(crate) fn shards(stage: ZeroStage, group: Option<&ProcessGroup>) -> bool {
    stage.partitions_state() && group.is_some_and(|g| g.world_size() > 1)
}
