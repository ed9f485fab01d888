//! ZeRO stage 3 ([`ZeroStage::Parameters`](super::ZeroStage::Parameters), FSDP's
//! `FULL_SHARD`): between steps each process holds a flat 1/N slice of every parameter
//! ([`slice_range`]: the parameter flattened, zero-padded to a multiple of the processes, cut
//! into equal slices), and every use of a parameter gathers the slices.
//!
//! # The mechanism
//!
//! After the optimizer steps the slices, [`release_parameters`] (or `release_stepped`) turns
//! every float parameter of the model into one of Burn's lazy parameters
//! (`Param::uninitialized`, the form `Module::init` builds): the value is dropped, and the
//! parameter keeps its id, shape, device, gradient requirement and an initializer. Each
//! process keeps its slice in a [`FlatShard`], kept by parameter id
//! (`crate::backend::placeholder::keep_slices`); no process holds a parameter whole. What the
//! first `Param::val()` of the next forward pass caches in the `Param` depends on the backend:
//!
//! - On the decorator over Burn's autodiff over a backend this crate has a feature for
//!   (`Accelerated<Autodiff<Flex>>`, and over NdArray, wgpu, CUDA and LibTorch): on every
//!   process a *placeholder* of the full shape (a stride-0 view of one `-0.0`: a few bytes),
//!   registered with the shard that gathers it (`crate::backend::placeholder`). Every op that
//!   reads it is then one all-gather of the slices on every process: the per-layer bound
//!   below.
//! - On any other backend (Burn's `Autodiff<Flex>` without the decorator, whose ops cannot
//!   recognise a placeholder): the gathered value itself. The gather runs once, at the first
//!   use, and the value stays whole until the step releases it (FSDP's `FULL_SHARD` with the
//!   whole model as its one unit; the peak is stage 2's).
//!
//! Before the optimizer steps, [`to_slices`] replaces every parameter by this process's
//! slice, shaped `[1, .., 1, slice]` in the parameter's rank (Burn's optimizers are
//! elementwise: they step a slice and keep slice-shaped state as they would the whole), and
//! [`end_gathers`] makes the uses plain reads; after it, `release_stepped` releases the
//! stepped slices again.
//!
//! Every process runs the same forward and backward passes, so every process gathers the
//! same parameter at the same moment, and the collectives pair up with no schedule agreed
//! beforehand. Each gather first all-gathers the parameter's place in the model's visiting
//! order (8 bytes), so processes that read different parameters (a parameter used on one rank
//! only, a module visited on the main process only) fail at once with an error naming both,
//! and the op (or initializer) panics with it (neither has an error channel).
//!
//! Gradients follow the slices: in the backward pass that completes an accumulation window,
//! each parameter's gradient is reduce-scattered as soon as it is final
//! ([`post_backward`](super::post_backward): every op reads a parameter through an anchor
//! node that sums its uses' gradients and reduce-scatters the sum: the mean, in f32, padded
//! as the parameter is), and every process keeps its slice's mean. The window's earlier
//! passes accumulate whole gradients (FSDP's `no_sync`); the first window, before any
//! parameter is released, backends without the decorator, and a pass after the reducing one
//! reduce-scatter into slices at the step ([`reduce_scatter_slices`]).
//!
//! On two processes stage 3 ends bit for bit where stage 2 does, and where stage 0 does (a
//! mean of two values is one rounding, whatever the order). On more, stage 2 sums each
//! parameter in its owner's block's ring order and stage 3 each slice in its own block's, so
//! the runs agree to rounding. A global norm that clips the gradients sums slices instead of
//! whole parameters: with clipping too the runs agree to rounding.
//!
//! # What is bounded
//!
//! Between steps (from the end of one step to the next forward pass) a process holds its
//! slice of every parameter and of its optimizer state, and no gradients: about 1/N of the
//! model's training state (a parameter of fewer values than processes is padded: some
//! processes hold padding only).
//!
//! During the forward and backward passes, on the decorator, the parameters of Burn's
//! `linear` op (`nn::Linear`: the product and its bias add) are whole for that op alone,
//! where autocast lowers nothing (f32 training) and the operands share a dtype: the op
//! gathers the weight and bias, runs the inner backend's `linear`, and drops them; its
//! backward node keeps the placeholder (a few bytes) instead of the weight, and gathers the
//! weight again for the input's gradient (the weight's and bias's gradients need only the
//! input and the output's gradient). At most one layer's gathered weight and bias are whole
//! at a time, on every process ([`gathered_bytes`](super::gathered_bytes) counts every
//! gather). The forward and backward ops are Burn's own (`B::linear`, `linear_x_backward`,
//! `linear_weight_backward`, `linear_bias_backward`, in Burn's order), so the op's numbers
//! are stage 2's bit for bit.
//!
//! `matmul` with a parameter operand (autocast off) and `embedding` hold the same bound: the
//! parameter is gathered for the op alone; `matmul`'s node gathers it again for the other
//! operand's gradient, `embedding`'s needs only the table's shape.
//!
//! Under bf16/f16 autocast, on `Autodiff<Flex>` (whose autocast runs `linear` and `matmul`
//! on the crate's half kernels), `linear` and `matmul` (a parameter operand, no broadcast)
//! hold the same bound and gather in the half type the op runs in (FSDP's `param_dtype`):
//! each process casts its f32 slice with autocast's cast on the op's backend and sends halves
//! (half an f32 gather's bytes), the op runs as autocast runs it on the cast values, and the
//! gradients reach the f32 parameters cast back as autocast's cast nodes cast them. The
//! gathered casts of the slices and the cast of the gathered f32 value are the same bits (one
//! elementwise rounding of the same values), so the op's numbers are stage 2's under the same
//! autocast, bit for bit; the gradients are reduce-scattered in f32.
//!
//! Every other op that reads a placeholder (convolutions, layer norms, casts under autocast,
//! `linear` and `matmul` in fp8 autocast or where autocast keeps them in f32, a broadcast
//! `matmul` under autocast) gathers it whole and reads
//! `anchor + gathered` (bit for bit the gathered value: `-0.0` is the additive identity; the
//! gradient flows to the anchor): right numbers, but the gathered value stays whole while the
//! autodiff graph keeps it, until the step, as with the lazy gather. Such ops are listed in
//! `crate::backend::placeholder`'s docs.
//!
//! The gradients, on the decorator: in the window's last backward pass each parameter's
//! gradient is whole from the op that computes it to its anchor's reduce-scatter, which runs
//! right after the backward of the layer that first reads the parameter (a `linear` or
//! `matmul` anchor sits just above the op's other input; an anchor made by another op, an
//! embedding's among them, sits above the parameter alone, and reduces at the end of the
//! pass: right, but not bounded). Afterwards a process holds its slice of every parameter's
//! averaged gradient only. The window's earlier passes hold every gradient whole, as FSDP's
//! `no_sync` does. Not bounded: the activations the graph keeps are every process's own.
//!
//! Traffic per process per step (the built-in engine's ring,
//! [`sent_bytes`](super::sent_bytes)), for each parameter on `n` processes: each gather
//! sends `(n - 1)` × [`slice_len`] values in the gathered dtype, each reduce-scatter
//! `(n - 1)` × `slice_len` f32 values, and each collective first agrees on the parameter
//! (2 × 8 × (n - 1) bytes). With a gather for the forward pass, one more of the weights read
//! again in backward, and a reduce-scatter, that is about 3 (n - 1) / n of the parameters'
//! bytes per process, as FSDP's, against stage 0's 2 (n - 1) / n. Under bf16/f16 autocast the
//! gathers of `linear` and `matmul` send two bytes a value (the reduce-scatters stay f32):
//! about 2 (n - 1) / n of the f32 bytes.
//!
//! A released parameter keeps Burn's parameter mappers (the transforms a record applies on
//! save and load), which a checkpoint's record applies
//! ([`gather_model_record`](super::gather_model_record)).

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Shape, Tensor, TensorData};

use crate::backend::placeholder::{self, Shard, slice_shape};
use crate::distributed::bucket::Inner;
use crate::distributed::gradients;
use crate::distributed::{DistributedError, ProcessGroup, ReduceOp};

use super::sharding::{slice_len, slice_range};

/// Stage 3, between steps: every float parameter of `module` released, each process keeping
/// its slice of it ([`slice_range`]: the parameter flattened, padded to a multiple of the
/// processes, cut in equal parts, FSDP's `FULL_SHARD`), to be gathered from every process's
/// slice at each use by an op (at its first use, on backends whose ops do not resolve
/// placeholders). Each becomes one of Burn's lazy parameters (same id, shape, device,
/// gradient requirement, mappers) whose value is dropped.
///
/// A parameter's slice comes from its value where the model holds it whole (a model not yet
/// released, or loaded), and from its shard where it is released already (every process
/// holds the same whole value, or the same released model).
///
/// Every process must call it at the same step, and afterwards read the parameters in the
/// same order (a forward pass, a visit of the whole module): each read by an op (each first
/// read, on a backend without placeholders) is a collective: the processes first agree on
/// which parameter they gather, so a read of another parameter (or of one on some processes
/// only, paired with the others' next gather) panics at once with a
/// [`DistributedError::Mismatch`] naming both parameters; a read that no other collective
/// ever meets waits until the group's timeout, and panics with its error.
///
/// # Memory
///
/// Between steps a process holds its slice of every parameter and of their optimizer state,
/// and no gradients. During a step, on the decorator (`Accelerated<Autodiff<B>>`), a
/// `linear` layer's gathered parameters are whole for its forward op and its input
/// gradient's op alone (f32, or bf16/f16 autocast, gathered in the half type), as are a
/// `matmul` operand's, an embedding's table and the convolutions'; other ops, and other
/// backends, keep a gathered parameter whole until the step. In the backward pass that
/// completes a window (the [`Accelerator`](crate::Accelerator)'s `backward`, or the user's
/// `loss.backward()` in a `TrainStep` under `with_accelerate`: both run through the step
/// core), each gradient is reduce-scattered as soon as it is final: every process keeps its
/// slice's mean. The notes atop `src/zero/full_shard.rs` say which ops hold the bound.
pub fn release_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
) -> M {
    release::<B, M>(group, module, Held::AsReleased)
}

/// Stage 3, after the optimizer stepped the slices [`to_slices`] gave it: every parameter
/// released again, each process keeping its stepped slice. Every process must call it at the
/// same step.
pub(crate) fn release_stepped<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
) -> M {
    release::<B, M>(group, module, Held::Stepped)
}

/// Stage 3, before the optimizer steps: every parameter of `module` replaced by this
/// process's slice of it, shaped `[1, .., 1, slice]` in the parameter's rank (Burn's
/// optimizers are elementwise: they step a slice, and keep its state, as they would the
/// whole), with the gradient requirement and mappers it had. The gradients the step core
/// holds then are the slices' ([`reduce_scatter_slices`], or the backward pass's reductions).
/// No collective: a released parameter's slice is its shard's, a whole one's is cut from it.
pub(crate) fn to_slices<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
) -> M {
    struct ToSlices<'a> {
        group: &'a ProcessGroup,
        place: u64,
        // The slices about to be stepped, as shards: where their parameters' shapes and
        // places are kept for `release_stepped`.
        slices: BTreeMap<u64, Arc<dyn Shard>>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for ToSlices<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let held = HeldParam::<B, D>::read(param, self.group, Held::AsReleased);
            let shard = held.shard(self.group, self.place);
            self.place += 1;
            self.slices.insert(held.id.val(), shard);
            let len = held.slice.dims()[0];
            let value = Tensor::<B, D>::from_inner(held.slice.reshape(slice_shape(D, len)));
            let value = value.set_require_grad(held.require_grad);
            Param::from_mapped_value(held.id, value, held.mappers)
        }
    }
    let reading = placeholder::reading_held();
    let mut to_slices = ToSlices {
        group,
        place: 0,
        slices: BTreeMap::new(),
    };
    let module = module.map(&mut to_slices);
    drop(reading);
    placeholder::keep_slices(to_slices.slices);
    module
}

// What the parameters of a model to release hold.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    // Whole values, or released parameters (placeholders, lazy ones, gathered whole values):
    // each process's slice is its shard's, or cut from the whole value.
    AsReleased,
    // The slices the optimizer stepped ([`to_slices`]), of the shards' shapes.
    Stepped,
}

fn release<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
    held: Held,
) -> M {
    struct Release<'a> {
        held: Held,
        releasing: Releasing<'a>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Release<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let held = HeldParam::<B, D>::read(param, self.releasing.group, self.held);
            self.releasing.add(held)
        }
    }
    if group.world_size() == 1 {
        return module;
    }
    // A lazy parameter's read gives a placeholder, with no collective, and registers nothing.
    let reading = placeholder::reading_held();
    let mut release = Release {
        held,
        releasing: Releasing::start(group),
    };
    let module = module.map(&mut release);
    drop(reading);
    release.releasing.end();
    module
}

/// A model's parameters released one by one, in visiting order (each one's place is what the
/// processes agree on at its collectives).
pub(crate) struct Releasing<'a> {
    group: &'a ProcessGroup,
    place: u64,
    slices: BTreeMap<u64, Arc<dyn Shard>>,
}

impl<'a> Releasing<'a> {
    pub(crate) fn start(group: &'a ProcessGroup) -> Self {
        Self {
            group,
            place: 0,
            slices: BTreeMap::new(),
        }
    }

    /// The next parameter released, this process keeping `held`'s slice.
    pub(crate) fn add<B: AutodiffBackend, const D: usize>(
        &mut self,
        held: HeldParam<B, D>,
    ) -> Param<Tensor<B, D>> {
        let (param, shard) = held.release(self.group, self.place);
        self.place += 1;
        self.slices.insert(param.id.val(), shard);
        param
    }

    /// The released parameters' shards kept, instead of the last release's; the values the
    /// last step registered forgotten (none is read again: one stage 3 model per process).
    pub(crate) fn end(self) {
        placeholder::forget_all();
        placeholder::keep_slices(self.slices);
    }
}

/// One parameter as this process holds it at stage 3: its slice, and what it takes to
/// make it a parameter again.
pub(crate) struct HeldParam<B: AutodiffBackend, const D: usize> {
    pub(crate) id: ParamId,
    /// This process's slice (padded), in the parameter's dtype.
    pub(crate) slice: Tensor<Inner<B>, 1>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) device: B::Device,
    pub(crate) require_grad: bool,
    pub(crate) mappers: burn::module::ParamMapper<Tensor<B, D>>,
}

impl<B: AutodiffBackend, const D: usize> HeldParam<B, D> {
    // `param` read (under `placeholder::reading_held`: a released lazy parameter gives its
    // placeholder, with no collective) into this process's slice.
    fn read(param: Param<Tensor<B, D>>, group: &ProcessGroup, held: Held) -> Self {
        match held {
            Held::Stepped => {
                let (id, value, mappers) = param.consume();
                let (device, require_grad) = (value.device(), value.is_require_grad());
                let shard = kept_shard(id).unwrap_or_else(|| {
                    unreachable!(
                        "ZeRO stage 3 stepped a parameter it never released (its slice has no \
                         shard)"
                    )
                });
                let shard = flat::<Inner<B>>(shard.as_ref());
                let slice = value.inner().reshape([shard.len()]);
                Self::of_shard(id, slice, shard, (device, require_grad), mappers)
            }
            Held::AsReleased if is_released(&param) => Self::released(param),
            Held::AsReleased => {
                let (id, value, mappers) = param.consume();
                Self::whole(id, value, mappers, group)
            }
        }
    }

    /// A released parameter (see [`is_released`]), read under `placeholder::reading_held`:
    /// its shard's slice, with no collective.
    pub(crate) fn released(param: Param<Tensor<B, D>>) -> Self {
        let (id, value, mappers) = param.consume();
        let shard = kept_shard(id).expect("a released parameter's shard");
        let shard = flat::<Inner<B>>(shard.as_ref());
        let (device, require_grad) = (value.device(), value.is_require_grad());
        let slice = shard.slice.clone();
        Self::of_shard(id, slice, shard, (device, require_grad), mappers)
    }

    // `slice` as the slice of the parameter `shard` holds (its shape, dtype and length).
    fn of_shard(
        id: ParamId,
        slice: Tensor<Inner<B>, 1>,
        shard: &FlatShard<Inner<B>>,
        (device, require_grad): (B::Device, bool),
        mappers: burn::module::ParamMapper<Tensor<B, D>>,
    ) -> Self {
        Self {
            id,
            slice,
            shape: shard.shape.clone(),
            dtype: shard.dtype,
            device,
            require_grad,
            mappers,
        }
    }

    /// A parameter this process holds whole (`value`, with its gradient requirement): its
    /// slice cut from it.
    pub(crate) fn whole(
        id: ParamId,
        value: Tensor<B, D>,
        mappers: burn::module::ParamMapper<Tensor<B, D>>,
        group: &ProcessGroup,
    ) -> Self {
        let (shape, dtype, device) = (value.shape(), value.dtype(), value.device());
        let require_grad = value.is_require_grad();
        let (n, rank) = (group.world_size(), group.rank());
        let len = slice_len(shape.num_elements(), n);
        Self {
            id,
            slice: cut_slice(value.inner().reshape([-1]), len, n, rank),
            shape,
            dtype,
            device,
            require_grad,
            mappers,
        }
    }

    // The slice as the shard of the parameter at `place`.
    fn shard(&self, group: &ProcessGroup, place: u64) -> Arc<FlatShard<Inner<B>>> {
        Arc::new(FlatShard::<Inner<B>> {
            group: group.clone(),
            place,
            shape: self.shape.clone(),
            dtype: self.dtype,
            slice: self.slice.clone(),
        })
    }

    // The parameter released: a lazy one whose reads give a placeholder registered with its
    // new shard (or the gathered value, where placeholders are not recognised), and the shard.
    fn release(self, group: &ProcessGroup, place: u64) -> (Param<Tensor<B, D>>, Arc<dyn Shard>) {
        let shard = self.shard(group, place);
        let (shape, dtype) = (self.shape.clone(), self.dtype);
        let for_init = shard.clone();
        let init = move |device: &B::Device, require_grad: bool| {
            let reading = placeholder::reads_held_values();
            let placeholders = placeholder::recognised::<B>();
            let value = if reading || placeholders {
                placeholder_of::<B, D>(&shape, dtype, device)
            } else {
                for_init
                    .gather_whole::<B, D>(device)
                    .unwrap_or_else(|err| for_init.fail(err))
            };
            let value = value.set_require_grad(require_grad);
            if placeholders && !reading {
                // Registered once its node is final (`require_grad` keeps a leaf's node).
                placeholder::register_tensor::<B>(
                    &value.clone().into_primitive().tensor(),
                    for_init.clone(),
                );
            }
            value
        };
        // The mappers go on with it: a checkpoint's record applies them
        // (`gather_model_record`).
        let (load, save) = (self.mappers.clone(), self.mappers);
        let param = Param::uninitialized(self.id, init, self.device, self.require_grad, self.shape)
            .load_mapper(move |value| load.on_load(value))
            .save_mapper(move |value| save.on_save(value));
        (param, shard)
    }
}

/// This process's padded slice of `flat` (a parameter's values in logical order): the values
/// of [`slice_range`], then zeros up to `len`, in storage of its own (a view of `flat`'s would
/// keep the whole parameter alive as long as the slice).
pub(crate) fn cut_slice<I: Backend>(
    flat: Tensor<I, 1>,
    len: usize,
    processes: usize,
    rank: usize,
) -> Tensor<I, 1> {
    let (values, dtype, device) = (flat.dims()[0], flat.dtype(), flat.device());
    let range = slice_range(values, processes, rank);
    let mut bytes = if range.is_empty() {
        Vec::new()
    } else {
        flat.slice(range).into_data().bytes.to_vec()
    };
    bytes.resize(len * dtype.size(), 0);
    Tensor::from_data(TensorData::from_bytes_vec(bytes, [len], dtype), &device)
}

/// Whether `param` is released (this process holds its slice, in its shard): lazy, or read
/// as a placeholder, and not replaced by a whole value since (a checkpoint loaded, the model
/// gathered whole).
pub(crate) fn is_released<B: AutodiffBackend, const D: usize>(param: &Param<Tensor<B, D>>) -> bool {
    kept_shard(param.id).is_some()
        && (!param.is_initialized()
            || placeholder::registered::<B>(&param.val().into_primitive().tensor()).is_some())
}

// The shard this process keeps of the released parameter `id`, if any.
fn kept_shard(id: ParamId) -> Option<Arc<dyn Shard>> {
    placeholder::slice_shard(id.val())
}

// A kept shard as what stage 3 made it.
fn flat<I: Backend>(shard: &dyn Shard) -> &FlatShard<I> {
    shard
        .as_any()
        .downcast_ref::<FlatShard<I>>()
        .expect("a released parameter's shard is of its backend")
}

/// Whether `module` holds a released parameter as it was read on this process (a
/// placeholder registered with its gather, on the decorator): an op that moves or detaches it
/// would gather it whole.
pub(crate) fn holds_released<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> bool {
    struct Registered(bool);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Registered {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            // A lazy parameter is not read: reading it would initialise it.
            if !self.0 && param.is_initialized() {
                let primitive = param.val().into_primitive().tensor();
                self.0 = placeholder::registered::<B>(&primitive).is_some();
            }
        }
    }
    let mut registered = Registered(false);
    module.visit(&mut registered);
    registered.0
}

/// Stage 3, before the optimizer steps this process's slices: the parameters' uses by ops
/// stop being collectives until [`release_stepped`]. Every process must call it at the same
/// step.
pub(crate) fn end_gathers() {
    placeholder::forget_all();
}

/// Stage 3 over: the model is whole ([`gather_model`](super::gather_model)), its uses are
/// plain reads again, and the slices are dropped (nothing reads them any more).
pub(crate) fn end_sharding() {
    placeholder::forget_all();
    placeholder::keep_slices(BTreeMap::new());
}

/// Stage 3, where the window's gradients were not reduced in its backward pass (the first
/// window before any release, a backend whose ops make no anchors, a pass after the
/// reducing one): each parameter's gradient in `grads` replaced by this process's slice of
/// its mean over the processes (a reduce-scatter of the gradient padded as the parameter is,
/// FSDP's), shaped as [`to_slices`] shapes the parameter; a parameter no process has a
/// gradient for stays without one. Every process must call it at the same step.
///
/// # Errors
/// What [`ProcessGroup::reduce_scatter`] returns.
pub(crate) fn reduce_scatter_slices<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
    grads: &mut GradientsParams,
) -> Result<(), DistributedError> {
    let n = group.world_size();
    let slots = gradients::take_slots(module, grads);
    let present = gradients::presence(group, &slots)?;
    let mut reduced = HashMap::new();
    for (slot, present) in slots.into_iter().zip(present) {
        if present == 0 {
            continue;
        }
        let values: usize = slot.dims.iter().product();
        let grad = match slot.grad {
            Some(grad) => grad
                .into_data()
                .into_vec::<f32>()
                .expect("the slots' gradients are f32"),
            None => vec![0.0; values],
        };
        let mean = slice_of_mean(group, grad, slice_len(values, n))?;
        let len = mean.len();
        let mean = Tensor::from_data(TensorData::new(mean, [len]), &slot.device);
        let dims = slice_shape(slot.dims.len(), len).to_vec();
        reduced.insert(slot.id, (mean, slot.dtype, dims));
    }
    gradients::put_back(module, grads, reduced);
    Ok(())
}

// This process's slice (`len` values) of the mean over the processes of `grad` (a
// parameter's gradient in logical order), padded as the parameter is: the reduce-scatter of
// stage 3's gradients.
fn slice_of_mean(
    group: &ProcessGroup,
    mut grad: Vec<f32>,
    len: usize,
) -> Result<Vec<f32>, DistributedError> {
    let n = group.world_size();
    grad.resize(len * n, 0.0);
    Ok(group
        .reduce_scatter(&mut grad, &vec![len; n], ReduceOp::Mean)?
        .to_vec())
}

// Every process gathers the parameter at `place` (in the model's visiting order) now: a
// process that reads another parameter, or another process's collective paired with this
// one, is a typed error at once instead of bytes of the wrong parameter or a wait until the
// group's timeout.
fn agree_on(group: &ProcessGroup, place: u64) -> Result<(), DistributedError> {
    let places = group.all_gather(&[place])?;
    match places.iter().position(|&p| p != place) {
        None => Ok(()),
        Some(rank) => Err(DistributedError::Mismatch {
            rank,
            detail: format!(
                "it gathers parameter #{} while this process gathers #{place} (in the model's \
                 visiting order): the processes read different parameters",
                places[rank]
            ),
        }),
    }
}

/// One released parameter's slice on this process, and its collectives: the gather of every
/// process's slice (FSDP's all-gather) and the reduce-scatter of its gradient.
pub(crate) struct FlatShard<I: Backend> {
    group: ProcessGroup,
    // Its place in the model's visiting order, which every process agrees on at each
    // collective.
    place: u64,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    /// This process's slice, padded, in the parameter's dtype.
    pub(crate) slice: Tensor<I, 1>,
}

impl<I: Backend> FlatShard<I> {
    /// Values a process holds: its slice, padding included.
    pub(crate) fn len(&self) -> usize {
        self.slice.dims()[0]
    }

    // A gather that failed, inside an op or a lazy initializer (neither has an error channel).
    fn fail(&self, err: DistributedError) -> ! {
        panic!(
            "ZeRO stage 3 could not gather parameter #{} (in the model's visiting order) at its \
             use: {err}. Every process must run the same forward pass and read the same \
             parameters in the same order",
            self.place
        )
    }

    // Every process's slice (`own`: this process's, in `dtype`), the padding cut: the whole
    // parameter, in a buffer of `dtype`'s values that the tensor takes as it is (a buffer of
    // bytes would be copied to align it).
    fn gathered(&self, own: &[u8], dtype: DType) -> Result<TensorData, DistributedError> {
        fn values<E: bytemuck::Pod + burn::tensor::Element>(
            shard: &FlatShard<impl Backend>,
            own: &[u8],
        ) -> Result<TensorData, DistributedError> {
            let (n, rank) = (shard.group.world_size(), shard.group.rank());
            let len = shard.len();
            let mut whole = vec![E::zeroed(); len * n];
            let block = len * size_of::<E>();
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut whole);
            bytes[rank * block..(rank + 1) * block].copy_from_slice(own);
            shard.group.all_gather_in_place(bytes, &vec![block; n])?;
            whole.truncate(shard.shape.num_elements());
            Ok(TensorData::new(whole, shard.shape.clone()))
        }
        agree_on(&self.group, self.place)?;
        let block = self.len() * dtype.size();
        if own.len() != block {
            return Err(DistributedError::InvalidCall(format!(
                "a slice of {} bytes to gather where a {dtype:?} slice of parameter #{} takes \
                 {block}",
                own.len(),
                self.place
            )));
        }
        match dtype {
            DType::F64 => values::<f64>(self, own),
            DType::F32 => values::<f32>(self, own),
            DType::F16 => values::<half::f16>(self, own),
            DType::BF16 => values::<half::bf16>(self, own),
            other => Err(DistributedError::InvalidCall(format!(
                "ZeRO stage 3 gathers float parameters, not {other:?} ones"
            ))),
        }
    }

    /// The parameter gathered whole, as a new leaf without a gradient requirement (the lazy
    /// gather, for backends whose ops do not resolve placeholders).
    fn gather_whole<B: AutodiffBackend<InnerBackend = I>, const D: usize>(
        &self,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, DistributedError> {
        let own = self.slice.clone().into_data().bytes;
        Ok(Tensor::from_data(self.gathered(&own, self.dtype)?, device))
    }
}

impl<I: Backend> Shard for FlatShard<I> {
    fn slice(&self) -> TensorData {
        self.slice.clone().into_data()
    }

    fn gather(&self, own: &[u8], dtype: DType) -> TensorData {
        self.gathered(own, dtype)
            .unwrap_or_else(|err| self.fail(err))
    }

    fn reduce(&self, grad: Vec<f32>) -> Vec<f32> {
        self.reduced(grad).unwrap_or_else(|err| {
            panic!(
                "ZeRO stage 3 could not reduce-scatter the gradient of parameter #{} (in the \
                 model's visiting order): {err}. Every process must run the same backward pass",
                self.place
            )
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl<I: Backend> FlatShard<I> {
    // The mean over the processes of the parameter's gradient, this process's slice of it (a
    // reduce-scatter of the gradient padded as the parameter is).
    fn reduced(&self, grad: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        agree_on(&self.group, self.place)?;
        slice_of_mean(&self.group, grad, self.len())
    }
}

// A placeholder of the parameter's full shape: a stride-0 view of one `-0.0` (a few bytes).
fn placeholder_of<B: AutodiffBackend, const D: usize>(
    shape: &Shape,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    let zero = Tensor::<Inner<B>, 1>::from_data(TensorData::new(vec![-0.0f32], [1]), device)
        .cast(dtype)
        .reshape([1; D]);
    let dims: [usize; D] = shape.dims();
    Tensor::from_inner(zero.expand(dims))
}
