//! The gradient sync on Flex, where a tensor lends its storage: each gradient is reduced as it
//! lies in memory and given back with the layout it came with.
//!
//! The generic path flattens and downloads each gradient: a weight used transposed (torch's
//! `[out, in]` layout) has a transposed view for a gradient, which Flex copies out with a
//! single-threaded tiled transpose; a large gradient alone in its bucket is downloaded while
//! its slot still holds it, which Flex copies twice (out of the shared buffer, then again to
//! align it, in `Bytes::from_bytes_vec`). Every copy lands in fresh pages, and the kernel
//! zeroing those pages costs more than the copies themselves (issue 38's profile: the
//! 100M-parameter MLP's sync faulted in 768 MiB a step). Here:
//!
//! - a gradient alone in its bucket (every large one) is reduced in its own storage, when
//!   nothing else holds that storage: no copy at all, then one pass dividing the sum by the
//!   number of processes over pages already resident;
//! - the small ones share a bucket buffer kept from step to step (one per process, grown to
//!   the largest bucket and never given back): each is copied in as it lies, and copied back
//!   into its own storage with the mean's division folded into that copy;
//! - the order the values travel in is agreed first ([`grad_layout`](super::grad_layout)),
//!   in the one small collective the generic path spends on counting which processes have
//!   each gradient: as stored where every process has the same layout, in logical order
//!   otherwise, so that values that do not line up are never summed.
//!
//! ZeRO stage 2's reduce-scatter goes the same way, and the parameters ZeRO shares back after
//! its step travel bucket by bucket too, a large one from and into its own storage
//! ([`share_parameters`]).
//!
//! The values are the generic path's bit for bit wherever the ring adds them in the same
//! order: always on two processes (`a + b == b + a`); on more, a transposed gradient's values
//! sit at other offsets of the buffer than the generic path's, in blocks the ring sums
//! starting from another process, so they agree to rounding, as ZeRO stage 2 does with
//! stage 0.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

use burn::backend::flex::{FlexTensor, Layout};
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorData, TensorPrimitive};

use super::Element;
use super::bucket::{self, Inner, numel};
use super::error::DistributedError;
use super::grad_layout::{self, Agreed, Held, Route};
use super::group::{ProcessGroup, ReduceOp};

/// Whether `B`'s float tensors are Flex's (Flex, and the decorator over it).
pub(crate) fn applies<B: Backend>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<FlexTensor>()
}

/// `value` as a `U`, when `T` is `U`; `value` back otherwise. Safe code: a generic primitive
/// and Flex's tensor are the same type only when their `TypeId`s are.
fn cast_type<T: 'static, U: 'static>(value: T) -> Result<U, T> {
    let mut slot = Some(value);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<U>>() {
        Some(u) => Ok(u.take().expect("just filled")),
        None => Err(slot.expect("not taken")),
    }
}

/// The Flex tensor under `tensor` (`None` on another backend).
pub(crate) fn into_flex<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Option<FlexTensor> {
    cast_type::<B::FloatTensorPrimitive, FlexTensor>(tensor.into_primitive().tensor()).ok()
}

/// The tensor of `B` over `flex`, when `B`'s float tensors are Flex's.
fn from_flex<B: Backend, const D: usize>(flex: FlexTensor) -> Tensor<B, D> {
    let primitive = cast_type::<FlexTensor, B::FloatTensorPrimitive>(flex)
        .unwrap_or_else(|_| unreachable!("the sync checked that B's float tensors are Flex's"));
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// Values the generic path copies to flatten `tensor`: all of them for a Flex view that is not
/// contiguous, none otherwise (a reshape that shares the buffer).
pub(crate) fn values_copied_to_flatten<B: Backend, const D: usize>(tensor: &Tensor<B, D>) -> usize {
    if !applies::<B>() {
        return 0;
    }
    into_flex(tensor.clone()).map_or(0, |flex| {
        if flex.is_contiguous() {
            0
        } else {
            flex.layout().num_elements()
        }
    })
}

// The bucket buffer, kept for the life of the process so that no step faults in fresh pages
// for it: a bucket of several tensors is at most BUCKET_VALUES values (a few small ones); a
// tensor alone in its bucket travels in its own storage, or in a copy of its own (zeros that
// this process neither has nor keeps come here).
static BUCKET: Mutex<Vec<f32>> = Mutex::new(Vec::new());

/// One parameter's gradient on this process, in f32.
struct Slot {
    id: ParamId,
    dims: Vec<usize>,
    // The gradient's dtype, given back after the sync (the parameter's where there is none).
    dtype: DType,
    grad: Option<FlexTensor>,
}

impl Slot {
    fn held(&self) -> Held<'_> {
        match &self.grad {
            None => Held::Absent,
            Some(grad) => {
                let layout = grad.layout();
                if grad_layout::is_dense(&self.dims, layout.strides()) {
                    Held::Dense(layout.strides())
                } else {
                    Held::Logical
                }
            }
        }
    }
}

/// What a bucket's collective is.
enum Collective<'a> {
    /// Every process gets the mean of every value.
    AllReduce,
    /// Process `r` gets the mean of the `counts[r]` values after `counts[..r]`: the slots of
    /// the bucket owned by `owners[slot] == r`, laid out owner by owner.
    ReduceScatter {
        counts: &'a [usize],
        owners: &'a [usize],
    },
}

/// [`all_reduce_gradients`](super::all_reduce_gradients) on Flex (see the [module docs](self)).
pub(crate) fn all_reduce<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
    grads: &mut GradientsParams,
) -> Result<(), DistributedError> {
    let mut slots = take_slots::<B, M>(module, grads);
    let agreed = agree(group, &slots)?;
    let mut reduced = HashMap::new();
    let sizes: Vec<usize> = slots.iter().map(|s| numel(&s.dims)).collect();
    for bucket in bucket::bucket_ranges(&sizes) {
        let order: Vec<usize> = bucket.collect();
        reduce_bucket(
            group,
            &mut slots,
            &agreed,
            &order,
            &Collective::AllReduce,
            &mut reduced,
        )?;
    }
    put_back::<B, M>(module, grads, reduced);
    Ok(())
}

/// ZeRO stage 2's reduce-scatter on Flex: bucket by bucket as the all-reduce, owner by owner
/// within each (`owner_order` gives a bucket's slots in that order and each owner's count).
pub(crate) fn reduce_scatter<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
    grads: &mut GradientsParams,
    owner_of: impl Fn(ParamId) -> usize,
    owner_order: impl Fn(&[usize], &[usize]) -> (Vec<usize>, Vec<usize>),
) -> Result<(), DistributedError> {
    let mut slots = take_slots::<B, M>(module, grads);
    let agreed = agree(group, &slots)?;
    let owners: Vec<usize> = slots.iter().map(|s| owner_of(s.id)).collect();
    let sizes: Vec<usize> = slots.iter().map(|s| numel(&s.dims)).collect();
    let mut reduced = HashMap::new();
    for bucket in bucket::bucket_ranges(&sizes) {
        let (order, counts) = owner_order(&owners[bucket.clone()], &sizes[bucket.clone()]);
        let order: Vec<usize> = order.into_iter().map(|j| bucket.start + j).collect();
        let collective = Collective::ReduceScatter {
            counts: &counts,
            owners: &owners,
        };
        reduce_bucket(
            group,
            &mut slots,
            &agreed,
            &order,
            &collective,
            &mut reduced,
        )?;
    }
    put_back::<B, M>(module, grads, reduced);
    Ok(())
}

/// ZeRO's sharing of the updated parameters on Flex: every parameter from its owner, bucket by
/// bucket as the gradients go (owner by owner within each, `owner_order` as for
/// [`reduce_scatter`]), in logical order (each owner's layout is its optimizer's, which the
/// others cannot know). A parameter alone in its bucket travels in its own storage: the owner
/// sends from it, the others receive into theirs where they hold it alone. The small ones go
/// through the bucket buffer: from the owners' values as they lie, into the others' own
/// storage where they can. Values are moved, never summed: the generic path's bits.
pub(crate) fn share_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
    owner_of: impl Fn(ParamId) -> usize,
    owner_order: impl Fn(&[usize], &[usize]) -> (Vec<usize>, Vec<usize>),
) -> Result<M, DistributedError> {
    struct Params {
        ids: Vec<ParamId>,
        sizes: Vec<usize>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Params {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.ids.push(param.id);
            self.sizes.push(param.val().shape().num_elements());
        }
    }
    let mut params = Params {
        ids: Vec::new(),
        sizes: Vec::new(),
    };
    module.visit(&mut params);
    let Params { ids, sizes } = params;
    let rank = group.rank();
    let owners: Vec<usize> = ids.iter().map(|&id| owner_of(id)).collect();
    let buckets = bucket::bucket_ranges(&sizes);
    // This process's values of the parameters it owns in buckets shared with others: read
    // before the mapper reaches the bucket, whose collective needs all of them at once.
    let mut wanted = vec![false; ids.len()];
    for bucket in buckets.iter().filter(|b| b.len() > 1) {
        for i in bucket.clone() {
            wanted[i] = owners[i] == rank;
        }
    }
    struct Own<'a> {
        wanted: &'a [bool],
        at: usize,
        values: HashMap<usize, FlexTensor>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Own<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.wanted[self.at] {
                self.values
                    .insert(self.at, logical_f32(param.val().inner()));
            }
            self.at += 1;
        }
    }
    let mut own = Own {
        wanted: &wanted,
        at: 0,
        values: HashMap::new(),
    };
    module.visit(&mut own);
    let mut share = Share {
        group,
        ids: &ids,
        owners: &owners,
        sizes: &sizes,
        buckets: &buckets,
        owner_order: &owner_order,
        own: own.values,
        at: 0,
        bucket: 0,
        gathered: None,
        replaced: HashSet::new(),
        failed: None,
    };
    let module = module.map(&mut share);
    match share.failed {
        Some(error) => Err(error),
        None => Ok(module),
    }
}

// `tensor` in f32 and logical order: itself where it already is, else a copy.
fn logical_f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FlexTensor {
    let tensor = if tensor.dtype() == DType::F32 {
        tensor
    } else {
        tensor.cast(FloatDType::F32)
    };
    let flex = into_flex(tensor).unwrap_or_else(|| unreachable!("the sync runs on Flex only"));
    if flex.is_contiguous() {
        flex
    } else {
        bucket::count_copied(flex.layout().num_elements());
        flex.to_contiguous()
    }
}

// A tensor of `shape` holding `values` in logical order.
fn contiguous(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

// A shared bucket's gathered values (the bucket buffer, locked) and each parameter's offset.
type Gathered = (MutexGuard<'static, Vec<f32>>, HashMap<usize, usize>);

// Replaces every parameter by its owner's, running each bucket's all-gather when it reaches
// the bucket's first parameter. A failed collective is kept (a mapper cannot return it) and
// leaves every later parameter as it is.
struct Share<'a, O> {
    group: &'a ProcessGroup,
    ids: &'a [ParamId],
    owners: &'a [usize],
    sizes: &'a [usize],
    buckets: &'a [std::ops::Range<usize>],
    owner_order: &'a O,
    // This process's values of its parameters in shared buckets, by index.
    own: HashMap<usize, FlexTensor>,
    // The next parameter's index, and its bucket's.
    at: usize,
    bucket: usize,
    // The current shared bucket's gathered values (the bucket buffer, held until the mapper
    // leaves the bucket), and each parameter's offset in them.
    gathered: Option<Gathered>,
    // A tied parameter is replaced where it is first met, as the generic path does.
    replaced: HashSet<ParamId>,
    failed: Option<DistributedError>,
}

impl<B: AutodiffBackend, O> ModuleMapper<B> for Share<'_, O>
where
    O: Fn(&[usize], &[usize]) -> (Vec<usize>, Vec<usize>),
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let i = self.at;
        self.at += 1;
        while self.buckets[self.bucket].end <= i {
            self.bucket += 1;
        }
        let bucket = self.buckets[self.bucket].clone();
        if self.failed.is_some() {
            return param;
        }
        let first = self.replaced.insert(self.ids[i]);
        if bucket.len() == 1 {
            return self.alone(param, i, first);
        }
        if i == bucket.start {
            self.gathered = None;
            match self.gather(bucket) {
                Ok(gathered) => self.gathered = Some(gathered),
                Err(error) => {
                    self.failed = Some(error);
                    return param;
                }
            }
        }
        if self.owners[i] == self.group.rank() || !first {
            return param;
        }
        let Some((buffer, offsets)) = &self.gathered else {
            unreachable!("the bucket's first parameter gathered it");
        };
        let at = offsets[&i];
        let values = &buffer[at..at + self.sizes[i]];
        param.map(|tensor| write_into(tensor, values))
    }
}

impl<O> Share<'_, O>
where
    O: Fn(&[usize], &[usize]) -> (Vec<usize>, Vec<usize>),
{
    // A parameter alone in its bucket, gathered in its own storage: the owner's is sent as it
    // is, another's received into it where nothing else holds it.
    fn alone<B: AutodiffBackend, const D: usize>(
        &mut self,
        param: Param<Tensor<B, D>>,
        i: usize,
        first: bool,
    ) -> Param<Tensor<B, D>> {
        let (group, owner) = (self.group, self.owners[i] == self.group.rank());
        let mut counts = vec![0; group.world_size()];
        counts[self.owners[i]] = self.sizes[i];
        let mut failed = None;
        let param = param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            let inner = tensor.inner();
            let (dtype, shape) = (inner.dtype(), inner.shape());
            // Kept: a half parameter (sent through an f32 copy), a tied one met again.
            let original = (dtype != DType::F32 || !first).then(|| inner.clone());
            let mut flex = logical_f32(inner);
            if flex.try_storage_mut::<f32>().is_none() {
                bucket::count_copied(self.sizes[i]);
                flex = contiguous(span(&flex).to_vec(), shape);
            }
            if let Err(error) = group.all_gather_in_place(span_mut(&mut flex), &counts) {
                failed = Some(error);
            }
            let value = match original {
                Some(original) if owner || !first || failed.is_some() => original,
                Some(_) => from_flex::<Inner<B>, D>(flex).cast(FloatDType::from(dtype)),
                None => from_flex(flex),
            };
            let value = Tensor::<B, D>::from_inner(value);
            if require_grad {
                value.require_grad()
            } else {
                value
            }
        });
        self.failed = self.failed.take().or(failed);
        param
    }

    // Gathers a shared bucket into the bucket buffer: returns it, locked, with each
    // parameter's offset in it.
    fn gather(&mut self, bucket: std::ops::Range<usize>) -> Result<Gathered, DistributedError> {
        let (order, counts) =
            (self.owner_order)(&self.owners[bucket.clone()], &self.sizes[bucket.clone()]);
        let len: usize = counts.iter().sum();
        let mut buffer = BUCKET.lock().unwrap_or_else(PoisonError::into_inner);
        if buffer.len() < len {
            buffer.resize(len, 0.0);
        }
        let mut offsets = HashMap::new();
        let mut at = 0;
        for j in order {
            let i = bucket.start + j;
            let size = self.sizes[i];
            if let Some(own) = self.own.remove(&i) {
                bucket::count_copied(size);
                buffer[at..at + size].copy_from_slice(span(&own));
            }
            offsets.insert(i, at);
            at += size;
        }
        self.group
            .all_gather_in_place(&mut buffer[..len], &counts)?;
        Ok((buffer, offsets))
    }
}

// `tensor` with `values` (in logical order): written into its own storage where it is f32,
// contiguous and held alone, a new tensor otherwise.
fn write_into<B: AutodiffBackend, const D: usize>(
    tensor: Tensor<B, D>,
    values: &[f32],
) -> Tensor<B, D> {
    bucket::count_copied(values.len());
    let require_grad = tensor.is_require_grad();
    let inner = tensor.inner();
    let (dtype, shape) = (inner.dtype(), inner.shape());
    let value: Tensor<Inner<B>, D> = if dtype == DType::F32 {
        let mut flex = into_flex(inner).unwrap_or_else(|| unreachable!("Flex only"));
        if flex.is_contiguous() && flex.try_storage_mut::<f32>().is_some() {
            span_mut(&mut flex).copy_from_slice(values);
            from_flex(flex)
        } else {
            from_flex(contiguous(values.to_vec(), shape))
        }
    } else {
        from_flex::<Inner<B>, D>(contiguous(values.to_vec(), shape)).cast(FloatDType::from(dtype))
    };
    let value = Tensor::<B, D>::from_inner(value);
    if require_grad {
        value.require_grad()
    } else {
        value
    }
}

// Every float parameter's gradient, taken out of `grads` in f32, in visiting order.
fn take_slots<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
) -> Vec<Slot> {
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        slots: Vec<Slot>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = self.grads.remove::<Inner<B>, D>(param.id);
            let (dims, dtype) = match &grad {
                Some(g) => (g.dims().to_vec(), g.dtype()),
                None => {
                    let value = param.val();
                    (value.dims().to_vec(), value.dtype())
                }
            };
            // A half gradient is summed in f32, as the generic path sums it, and cast back.
            let grad = grad.map(|g| {
                let g = if g.dtype() == DType::F32 {
                    g
                } else {
                    g.cast(FloatDType::F32)
                };
                into_flex(g).unwrap_or_else(|| unreachable!("the sync runs on Flex only"))
            });
            self.slots.push(Slot {
                id: param.id,
                dims,
                dtype,
                grad,
            });
        }
    }
    let mut take = Take {
        grads,
        slots: Vec::new(),
    };
    module.visit(&mut take);
    take.slots
}

// Every process's description of its gradients, gathered in one collective (the generic
// path's presence count costs one too), and the routes every process derives from them.
fn agree(group: &ProcessGroup, slots: &[Slot]) -> Result<Vec<Agreed>, DistributedError> {
    let ranks: Vec<usize> = slots.iter().map(|s| s.dims.len()).collect();
    let len = grad_layout::record_len(&ranks);
    let (rank, n) = (group.rank(), group.world_size());
    let mut words = vec![0u64; len * n];
    let mut own = Vec::with_capacity(len);
    for slot in slots {
        grad_layout::record(slot.held(), slot.dims.len(), &mut own);
    }
    words[rank * len..(rank + 1) * len].copy_from_slice(&own);
    // Processes with other models have records of other lengths: the all-gather refuses them
    // (buffers of different lengths) before anything is summed.
    group.all_gather_in_place(&mut words, &vec![len; n])?;
    grad_layout::agree(&ranks, &words, n)
        .map_err(|(rank, detail)| DistributedError::Malformed { rank, detail })
}

// Reduces the slots `order` (one bucket, laid out in that order) and puts the gradients this
// process keeps into `reduced`.
fn reduce_bucket(
    group: &ProcessGroup,
    slots: &mut [Slot],
    agreed: &[Agreed],
    order: &[usize],
    collective: &Collective<'_>,
    reduced: &mut HashMap<ParamId, (FlexTensor, DType)>,
) -> Result<(), DistributedError> {
    let (rank, n) = (group.rank(), group.world_size());
    let keeps = |i: usize| {
        agreed[i].present > 0
            && match collective {
                Collective::AllReduce => true,
                Collective::ReduceScatter { owners, .. } => owners[i] == rank,
            }
    };
    let run = |values: &mut [f32]| -> Result<(), DistributedError> {
        match collective {
            Collective::AllReduce => group.all_reduce(values, ReduceOp::Sum),
            Collective::ReduceScatter { counts, .. } => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(values);
                group
                    .reduce_scatter_bytes(Element::F32, bytes, counts, ReduceOp::Sum)
                    .map(drop)
            }
        }
    };
    // Alone in its bucket: reduced in a buffer of its own, its own storage where it can; zeros
    // this process neither has nor keeps go through the bucket buffer, not fresh pages.
    if let [i] = *order
        && (slots[i].grad.is_some() || keeps(i))
    {
        let slot = &mut slots[i];
        let mut tensor = own_buffer(slot, &agreed[i].route);
        let values = span_mut(&mut tensor);
        run(values)?;
        if keeps(i) {
            divide(values, n);
            reduced.insert(slot.id, (tensor, slot.dtype));
        }
        return Ok(());
    }
    let len: usize = order.iter().map(|&i| numel(&slots[i].dims)).sum();
    let mut bucket = BUCKET.lock().unwrap_or_else(PoisonError::into_inner);
    if bucket.len() < len {
        bucket.resize(len, 0.0);
    }
    let buffer = &mut bucket[..len];
    let mut at = 0;
    for &i in order {
        let size = numel(&slots[i].dims);
        copy_in(
            &mut buffer[at..at + size],
            slots[i].grad.as_ref(),
            &agreed[i].route,
        );
        at += size;
    }
    run(buffer)?;
    let mut at = 0;
    for &i in order {
        let slot = &mut slots[i];
        let size = numel(&slot.dims);
        if keeps(i) {
            let tensor = copy_out(&buffer[at..at + size], slot, &agreed[i].route, n);
            reduced.insert(slot.id, (tensor, slot.dtype));
        }
        at += size;
    }
    Ok(())
}

// A tensor that this process alone holds, whose span (from its start offset) holds `slot`'s
// values in `route`'s order: the gradient itself where nothing else holds its storage and its
// values lie in that order; a copy otherwise; zeros where this process has no gradient.
fn own_buffer(slot: &mut Slot, route: &Route) -> FlexTensor {
    let shape = Shape::from(slot.dims.clone());
    let size = numel(&slot.dims);
    let Some(mut grad) = slot.grad.take() else {
        return with_route(vec![0.0; size], shape, route);
    };
    let in_order = match route {
        // Every process that has it has it with the route's strides, this one included.
        Route::AsStored(_) => true,
        Route::Logical => grad.is_contiguous(),
        Route::Absent => unreachable!("a process has it"),
    };
    if in_order && grad.try_storage_mut::<f32>().is_some() {
        return grad;
    }
    let mut values = vec![0.0; size];
    copy_in(&mut values, Some(&grad), route);
    with_route(values, shape, route)
}

// `values` (in `route`'s order) as a tensor of `shape` laid out as the route says.
fn with_route(values: Vec<f32>, shape: Shape, route: &Route) -> FlexTensor {
    let flat = FlexTensor::from_data(TensorData::new(values, [shape.num_elements()]));
    let layout = match route {
        Route::AsStored(strides) => Layout::new(shape, strides.clone(), 0),
        Route::Logical | Route::Absent => Layout::contiguous(shape),
    };
    flat.with_layout(layout)
}

// The values of a tensor's span: as many as it has, from its start offset.
fn span(tensor: &FlexTensor) -> &[f32] {
    let layout = tensor.layout();
    let start = layout.start_offset();
    &tensor.storage::<f32>()[start..start + layout.num_elements()]
}

// The same, to write: the tensor must hold its storage alone.
fn span_mut(tensor: &mut FlexTensor) -> &mut [f32] {
    let (start, len) = (
        tensor.layout().start_offset(),
        tensor.layout().num_elements(),
    );
    let storage = tensor
        .try_storage_mut::<f32>()
        .unwrap_or_else(|| unreachable!("own_buffer gives a tensor that holds its storage"));
    &mut storage[start..start + len]
}

// Writes `grad`'s values into `into` in `route`'s order (zeros without a gradient).
fn copy_in(into: &mut [f32], grad: Option<&FlexTensor>, route: &Route) {
    let Some(grad) = grad else {
        into.fill(0.0);
        return;
    };
    bucket::count_copied(into.len());
    match route {
        Route::AsStored(_) => into.copy_from_slice(span(grad)),
        Route::Logical if grad.is_contiguous() => into.copy_from_slice(span(grad)),
        Route::Logical => {
            // Another layout than the others' (or not dense): read in logical order, as the
            // generic path does.
            bucket::count_copied(into.len());
            into.copy_from_slice(span(&grad.to_contiguous()));
        }
        Route::Absent => unreachable!("a process has it"),
    }
}

// `slot`'s gradient from its sum in `sum` (in `route`'s order), divided by `n`: written into
// the gradient's own storage where this process holds it alone in that order, into a new
// tensor otherwise.
fn copy_out(sum: &[f32], slot: &mut Slot, route: &Route, n: usize) -> FlexTensor {
    bucket::count_copied(sum.len());
    let in_order = |grad: &FlexTensor| match route {
        Route::AsStored(_) => true,
        Route::Logical => grad.is_contiguous(),
        Route::Absent => false,
    };
    if let Some(mut grad) = slot.grad.take()
        && in_order(&grad)
        && grad.try_storage_mut::<f32>().is_some()
    {
        divide_into(span_mut(&mut grad), sum, n);
        return grad;
    }
    let mut values = vec![0.0; sum.len()];
    divide_into(&mut values, sum, n);
    with_route(values, Shape::from(slot.dims.clone()), route)
}

// A sum over `n` processes to its mean, as the collectives' `ReduceOp::Mean` divides.
fn divide(values: &mut [f32], n: usize) {
    let n = n as f32;
    values.iter_mut().for_each(|v| *v /= n);
}

fn divide_into(into: &mut [f32], sum: &[f32], n: usize) {
    let n = n as f32;
    into.iter_mut().zip(sum).for_each(|(v, s)| *v = s / n);
}

// Registers the reduced gradients in `grads`, in their dtypes.
fn put_back<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    reduced: HashMap<ParamId, (FlexTensor, DType)>,
) {
    struct PutBack<'a> {
        grads: &'a mut GradientsParams,
        reduced: HashMap<ParamId, (FlexTensor, DType)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for PutBack<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some((flex, dtype)) = self.reduced.remove(&param.id) else {
                return;
            };
            let grad: Tensor<Inner<B>, D> = from_flex(flex);
            let grad = if dtype == DType::F32 {
                grad
            } else {
                grad.cast(FloatDType::from(dtype))
            };
            self.grads.register(param.id, grad);
        }
    }
    module.visit(&mut PutBack { grads, reduced });
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Distribution;

    use super::*;
    use crate::Accelerated;
    use crate::distributed::ProcessState;

    fn linear_grads<B: AutodiffBackend>() -> (Linear<B>, GradientsParams) {
        let device = Default::default();
        let layer = LinearConfig::new(6, 4).init::<B>(&device);
        let x = Tensor::<B, 2>::random([3, 6], Distribution::Normal(0.0, 1.0), &device);
        let grads = layer.forward(x).powf_scalar(2.0).sum().backward();
        let grads = GradientsParams::from_grads(grads, &layer);
        (layer, grads)
    }

    // What the sync relies on: a gradient is storage nothing else holds, under the decorator
    // too; a Linear's weight gradient is contiguous, a weight used transposed (torch's
    // `[out, in]` layout) has a transposed view, dense.
    fn gradients_are_held_alone<B: AutodiffBackend>() {
        assert!(applies::<Inner<B>>());
        let (layer, mut grads) = linear_grads::<B>();
        let grad = grads.remove::<Inner<B>, 2>(layer.weight.id).unwrap();
        let mut flex = into_flex(grad).unwrap();
        assert!(flex.is_contiguous(), "{:?}", flex.layout());
        assert!(flex.try_storage_mut::<f32>().is_some());

        let device = Default::default();
        let weight = Param::from_tensor(Tensor::<B, 2>::ones([4, 6], &device));
        let x = Tensor::<B, 2>::random([3, 6], Distribution::Normal(0.0, 1.0), &device);
        let grads = x
            .matmul(weight.val().transpose())
            .powf_scalar(2.0)
            .sum()
            .backward();
        let grad = weight.val().grad(&grads).unwrap();
        drop(grads);
        let mut flex = into_flex(grad).unwrap();
        assert!(!flex.is_contiguous(), "{:?}", flex.layout());
        assert!(grad_layout::is_dense(&[4, 6], flex.layout().strides()));
        assert!(flex.try_storage_mut::<f32>().is_some());
    }

    #[test]
    fn flex_gradients_are_held_alone_and_torch_s_layout_gives_transposed_views() {
        gradients_are_held_alone::<Autodiff<Flex>>();
        gradients_are_held_alone::<Accelerated<Autodiff<Flex>>>();
        #[cfg(feature = "ndarray")]
        assert!(!applies::<burn::backend::NdArray>());
    }

    fn values(flex: &FlexTensor) -> Vec<u32> {
        flex.clone()
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    // On one process a bucket goes in and comes back unchanged: every value where it was, in
    // the layout it had, in the storage it had where it held it alone.
    #[test]
    fn a_bucket_comes_back_in_its_own_layout_and_storage() {
        type B = Autodiff<Flex>;
        let group = ProcessState::single().group().unwrap();
        let (layer, mut grads) = linear_grads::<B>();
        let mut slots = take_slots::<B, _>(&layer, &mut grads);
        assert_eq!(slots.len(), 2);
        let before: Vec<Vec<u32>> = slots
            .iter()
            .map(|s| values(s.grad.as_ref().unwrap()))
            .collect();
        let layouts: Vec<Layout> = slots
            .iter()
            .map(|s| s.grad.as_ref().unwrap().layout().clone())
            .collect();
        let storage: Vec<*const u8> = slots
            .iter()
            .map(|s| s.grad.as_ref().unwrap().bytes().as_ptr())
            .collect();
        let agreed = agree(&group, &slots).unwrap();
        assert!(matches!(agreed[0].route, Route::AsStored(_)));
        for order in [vec![0, 1], vec![0]] {
            let mut reduced = HashMap::new();
            reduce_bucket(
                &group,
                &mut slots,
                &agreed,
                &order,
                &Collective::AllReduce,
                &mut reduced,
            )
            .unwrap();
            for &i in &order {
                let (tensor, dtype) = reduced.remove(&slots[i].id).unwrap();
                assert_eq!(dtype, DType::F32);
                assert_eq!(values(&tensor), before[i]);
                assert_eq!(tensor.layout(), &layouts[i]);
                assert_eq!(tensor.bytes().as_ptr(), storage[i]);
                slots[i].grad = Some(tensor);
            }
        }
        // A gradient this process lacks comes back as zeros, in the agreed layout.
        let weight = slots[0].grad.take();
        let mut reduced = HashMap::new();
        let route = Agreed {
            route: agreed[0].route.clone(),
            present: 1,
        };
        reduce_bucket(
            &group,
            &mut slots,
            &[route],
            &[0],
            &Collective::AllReduce,
            &mut reduced,
        )
        .unwrap();
        let (zeros, _) = reduced.remove(&slots[0].id).unwrap();
        assert_eq!(zeros.layout(), &layouts[0]);
        assert!(values(&zeros).iter().all(|&v| v == 0));
        drop(weight);
    }

    // A gradient whose storage something else holds is copied, never written through.
    #[test]
    fn shared_storage_is_copied_not_written() {
        type B = Autodiff<Flex>;
        let group = ProcessState::single().group().unwrap();
        let (layer, mut grads) = linear_grads::<B>();
        let mut slots = take_slots::<B, _>(&layer, &mut grads);
        let agreed = agree(&group, &slots).unwrap();
        let held = slots[0].grad.clone().unwrap();
        let mut reduced = HashMap::new();
        reduce_bucket(
            &group,
            &mut slots,
            &agreed,
            &[0],
            &Collective::AllReduce,
            &mut reduced,
        )
        .unwrap();
        let (tensor, _) = reduced.remove(&slots[0].id).unwrap();
        assert_ne!(tensor.bytes().as_ptr(), held.bytes().as_ptr());
        assert_eq!(values(&tensor), values(&held));
        assert_eq!(tensor.layout().strides(), held.layout().strides());
    }
}
