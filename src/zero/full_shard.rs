//! ZeRO stage 3 ([`ZeroStage::Parameters`](super::ZeroStage::Parameters), FSDP's
//! `FULL_SHARD`): between steps each process holds only the parameters its partition owns,
//! and gathers every other one from its owner where an op uses it.
//!
//! # The mechanism
//!
//! After the optimizer steps this process's partition, [`release_parameters`] turns every float
//! parameter of the model into one of Burn's lazy parameters (`Param::uninitialized`, the
//! form `Module::init` builds): the value is dropped, and the parameter keeps its id, shape,
//! device, gradient requirement and an initializer. The owner's initializer holds the owned
//! value; the others' hold nothing but the owner's rank. What the first `Param::val()` of the
//! next forward pass caches in the `Param` depends on the backend:
//!
//! - On the decorator over Burn's autodiff over a backend this crate has a feature for
//!   (`Accelerated<Autodiff<Flex>>`, and over NdArray, wgpu, CUDA and LibTorch): the owner's
//!   value on its owner, elsewhere a
//!   *placeholder* of the full shape (a stride-0 view of one `-0.0`: a few bytes), each
//!   registered with the collective that gathers it (`crate::backend::placeholder`). Every
//!   op that reads it is then one gather on every process (the owner sends, the others
//!   receive): the per-layer bound below.
//! - On any other backend (Burn's `Autodiff<Flex>` without the decorator, whose ops cannot
//!   recognise a placeholder): the gathered value itself. The gather runs once, at the first
//!   use, and the value stays whole until the step releases it (FSDP's `FULL_SHARD` with the
//!   whole model as its one unit; the peak is stage 2's).
//!
//! Before the optimizer steps, [`end_gathers`] makes the parameters' uses plain reads again
//! (the optimizer reads the values it steps on their owner alone), until the release.
//!
//! Every process runs the same forward and backward passes, so every process gathers the
//! same parameter at the same moment, and the collectives pair up with no schedule agreed
//! beforehand. Each gather first all-gathers the parameter's place in the model's visiting
//! order (8 bytes), so processes that read different parameters (a parameter used on one rank
//! only, a module visited on the main process only) fail at once with an error naming both,
//! and the op (or initializer) panics with it (neither has an error channel).
//!
//! Gradients and optimizer state follow stage 2's partition: each process's optimizer keeps
//! state for its own partition and steps it. The gradients are reduced to their owners in the
//! backward pass that completes an accumulation window, each as soon as it is final
//! ([`post_backward`](super::post_backward): every op reads a parameter through an anchor
//! node that sums its uses' gradients and reduces the sum to the owner; the other processes
//! keep nothing of it), with the sums in stage 2's order (so stage 3 ends bit for bit where
//! stage 2 does, and where stage 0 does on two processes). The window's earlier passes
//! accumulate whole gradients (FSDP's `no_sync`); the first window, before any parameter is
//! released, and backends without the decorator reduce-scatter the window at the step
//! ([`reduce_scatter_gradients`](super::reduce_scatter_gradients)), as stage 2 does. Ownership
//! is per parameter ([`partition`](super::partition): whole parameters, largest first), not
//! FSDP's 1/N slice of each parameter: a process's share of the model is balanced to within
//! its largest parameter, and "reduce-scatter" is, per parameter, a reduction to its owner.
//!
//! # What is bounded
//!
//! Between steps (from the end of one step to the next forward pass) a process holds its
//! partition's parameters and optimizer state and no gradients: about 1/N of the model's
//! training state.
//!
//! During the forward and backward passes, on the decorator, the parameters of Burn's
//! `linear` op (`nn::Linear`: the product and its bias add) are whole for that op alone,
//! where autocast lowers nothing (f32 training) and the operands share a dtype: the op
//! gathers the weight and bias, runs the inner backend's `linear`, and drops them; its
//! backward node keeps the placeholder (a few bytes) instead of the weight, and gathers the
//! weight again for the input's gradient (the weight's and bias's gradients need only the
//! input and the output's gradient). At most one layer's gathered weight and bias are whole
//! at a time, besides the process's own partition
//! ([`gathered_bytes`](super::gathered_bytes) counts them). The forward and backward ops
//! are Burn's own (`B::linear`, `linear_x_backward`, `linear_weight_backward`,
//! `linear_bias_backward`, in Burn's order), so the numbers are stage 2's bit for bit.
//!
//! `matmul` with a parameter operand (autocast off) and `embedding` hold the same bound: the
//! parameter is gathered for the op alone; `matmul`'s node gathers it again for the other
//! operand's gradient, `embedding`'s needs only the table's shape.
//!
//! Under bf16/f16 autocast, on `Autodiff<Flex>` (whose autocast runs `linear` and `matmul`
//! on the crate's half kernels), `linear` and `matmul` (a parameter operand, no broadcast)
//! hold the same bound and gather in the half type the op runs in
//! (FSDP's `param_dtype`): the owner casts its f32 weight and bias and sends halves (half an
//! f32 gather's bytes), the op runs as autocast runs it on the cast values, and the gradients
//! reach the f32 parameters cast back as autocast's cast nodes cast them. The cast of a
//! gathered f32 value and the gathered cast of the owner's value are the same bits (one
//! elementwise rounding of the same values), so the numbers are stage 2's under the same
//! autocast, bit for bit; the gradients are reduced in f32.
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
//! gradient is whole from the op that computes it to its anchor's reduction, which runs right
//! after the backward of the layer that first reads the parameter (a `linear` or `matmul`
//! anchor sits just above the op's other input; an anchor made by another op, an
//! embedding's among them, sits above the parameter alone, and reduces at the end of the
//! pass: right, but not bounded). Afterwards a process holds
//! its partition's averaged gradients only. The window's earlier passes hold every gradient
//! whole, as FSDP's `no_sync` does. Not bounded: the activations the graph keeps are every
//! process's own.
//!
//! Traffic per step (the built-in engine's ring, [`sent_bytes`](super::sent_bytes)): every
//! use of a parameter is a broadcast from its owner that every process but one passes on, and
//! every reduction is the owner's block of a reduce-scatter that every process but the owner
//! sends once; summed over the `n` processes, `(n - 1)` × (the parameters once for the
//! forward pass, the weights read again in backward, the parameters once for the reduction):
//! about 3 (n - 1) / n of the parameters' bytes per process, as FSDP's, against stage 0's
//! 2 (n - 1) / n. Under bf16/f16 autocast the gathers of `linear` and `matmul` send two bytes a
//! value (the reductions stay f32): about 2 (n - 1) / n of the f32 bytes. Each gather and reduction is preceded by a 16-byte-per-process agreement
//! on the parameter.
//!
//! A released parameter keeps Burn's parameter mappers (the transforms a record applies on
//! save and load), which a checkpoint's record applies
//! ([`gather_model_record`](super::gather_model_record)).

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Shape, Tensor, TensorData};

use std::sync::Arc;

use crate::backend::placeholder::{self, Shard};
use crate::distributed::{DistributedError, Element, ProcessGroup, ReduceOp};

use super::sharded::Partition;

/// Stage 3, after the step: every float parameter of `module` released, to be gathered from
/// its owner at each use by an op (at its first use, on backends whose ops do not resolve
/// placeholders). Each becomes one of Burn's lazy parameters (same id, shape, device,
/// gradient requirement): the parameters this process owns keep their values (inside their
/// initializer), the others' values are dropped.
///
/// Every process must call it at the same step, with the same partition, and afterwards read
/// the parameters in the same order (a forward pass, a visit of the whole module): each read
/// by an op (each first read, on a backend without placeholders) is a collective: the
/// processes first agree on which parameter they gather, so a read of another parameter (or of one on some processes only, paired with the others' next
/// gather) panics at once with a [`DistributedError::Mismatch`] naming both parameters; a
/// read that no other collective ever meets waits until the group's timeout, and panics with
/// its error.
///
/// # Memory
///
/// Between steps a process holds its partition's parameters and optimizer state and no
/// gradients. During a step, on the decorator (`Accelerated<Autodiff<B>>`), a `linear`
/// layer's gathered parameters are whole for its forward op and its input gradient's op
/// alone (f32, or bf16/f16 autocast on `Autodiff<Flex>`, gathered in the half type), as are a `matmul` operand's and an embedding's table; other
/// ops, and other backends, keep a gathered parameter whole until the step. In the backward pass that completes a window (the
/// [`Accelerator`](crate::Accelerator)'s `backward`, or the user's `loss.backward()` in a
/// `TrainStep` under `with_accelerate`: both run through the step core), each gradient is reduced to its owner as
/// soon as it is final and dropped by the others. The notes atop `src/zero/full_shard.rs` say
/// which ops hold the bound.
pub fn release_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: M,
    partition: &Partition,
) -> M {
    struct Release<'a> {
        group: &'a ProcessGroup,
        partition: &'a Partition,
        // The next parameter's place in visiting order.
        place: u64,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Release<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, value, mappers) = param.consume();
            // The value's placeholder (or the owner's own value) is no longer read.
            placeholder::unregister_tensor::<B>(&value.clone().into_primitive().tensor());
            let require_grad = value.is_require_grad();
            let (shape, dtype, device) = (value.shape(), value.dtype(), value.device());
            let owner = self.partition.owner(id);
            // The autodiff wrapper is not kept: the next use starts a new leaf, as Burn's
            // optimizers start one for the values they step.
            let own = (owner == self.group.rank()).then(|| value.inner());
            let shard = Arc::new(ReleasedShard {
                group: self.group.clone(),
                owner,
                place: self.place,
            });
            self.place += 1;
            let gathered_shape = shape.clone();
            let init = move |device: &B::Device, require_grad: bool| {
                // A checkpoint's record reads the owner's value where it is, and sends it to
                // the main process alone (`gather_model_record`): no collective here.
                if placeholder::reads_held_values() {
                    return held::<B, D>(own.clone(), &gathered_shape, dtype, device);
                }
                let placeholders = placeholder::recognised::<B>();
                let value = if placeholders {
                    held::<B, D>(own.clone(), &gathered_shape, dtype, device)
                } else {
                    shard
                        .gather_whole::<B, D>(own.as_ref(), &gathered_shape, dtype, device)
                        .unwrap_or_else(|err| shard.fail(err))
                };
                let value = if require_grad {
                    value.require_grad()
                } else {
                    value
                };
                if placeholders {
                    // Registered once its node is final (`require_grad` keeps a leaf's node).
                    placeholder::register_tensor::<B>(
                        &value.clone().into_primitive().tensor(),
                        shard.clone(),
                    );
                }
                value
            };
            // The mappers go on with it: a checkpoint's record applies them
            // (`gather_model_record`).
            let (load, save) = (mappers.clone(), mappers);
            Param::uninitialized(id, init, device, require_grad, shape)
                .load_mapper(move |value| load.on_load(value))
                .save_mapper(move |value| save.on_save(value))
        }
    }
    if group.world_size() == 1 {
        return module;
    }
    // The step replaced the values the owner registered: none of the last step's is read
    // again (one stage 3 model per process).
    placeholder::forget_all();
    module.map(&mut Release::<'_> {
        group,
        partition,
        place: 0,
    })
}

/// Whether `module` holds a released parameter as it was read on this process (a placeholder,
/// or the owner's value registered with its gather, on the decorator): an op that moves or
/// detaches it would gather it whole.
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

/// Stage 3, before the optimizer steps this process's partition: the parameters' uses by ops
/// stop being collectives until [`release_parameters`] (the optimizer reads the values it
/// steps on their owner alone). Every process must call it at the same step.
pub(crate) fn end_gathers() {
    placeholder::forget_all();
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

// One released parameter's collective: its place in the model's visiting order, and its
// owner, who sends it at each gather.
struct ReleasedShard {
    group: ProcessGroup,
    owner: usize,
    place: u64,
}

impl ReleasedShard {
    // Every process's gather of the parameter's bytes, after agreeing on which it gathers.
    fn bytes(&self, own: Option<Vec<u8>>) -> Result<Vec<u8>, DistributedError> {
        agree_on(&self.group, self.place)?;
        self.group
            .broadcast_bytes(self.owner, own.unwrap_or_default())
    }

    // A gather that failed, inside an op or a lazy initializer (neither has an error channel).
    fn fail(&self, err: DistributedError) -> ! {
        panic!(
            "ZeRO stage 3 could not gather a parameter from process {} at its use: {err}. \
             Every process must run the same forward pass and read the same parameters in \
             the same order",
            self.owner
        )
    }

    /// Gathers the parameter whole, as a new leaf without a gradient requirement (the
    /// lazy gather, for backends whose ops do not resolve placeholders).
    fn gather_whole<B: AutodiffBackend, const D: usize>(
        &self,
        own: Option<&Tensor<B::InnerBackend, D>>,
        shape: &Shape,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, DistributedError> {
        if let Some(own) = own {
            self.bytes(Some(own.clone().into_data().bytes.to_vec()))?;
            return Ok(Tensor::from_inner(own.clone()));
        }
        let bytes = self.bytes(None)?;
        let expected = shape.num_elements() * dtype.size();
        if bytes.len() != expected {
            return Err(DistributedError::Mismatch {
                rank: self.owner,
                detail: format!(
                    "it sent {} bytes for a {dtype:?} parameter of shape {shape:?} ({expected} \
                     bytes): the processes' models differ",
                    bytes.len()
                ),
            });
        }
        let data = TensorData::from_bytes_vec(bytes, shape.clone(), dtype);
        Ok(Tensor::from_data(data, device))
    }
}

impl Shard for ReleasedShard {
    fn is_owned(&self) -> bool {
        self.owner == self.group.rank()
    }

    fn gather(&self, own: Option<Vec<u8>>) -> Vec<u8> {
        self.bytes(own).unwrap_or_else(|err| self.fail(err))
    }

    fn reduce(&self, grad: Vec<u8>) -> Option<Vec<u8>> {
        self.reduced(grad).unwrap_or_else(|err| {
            panic!(
                "ZeRO stage 3 could not reduce a gradient to its owner, process {}: {err}. \
                 Every process must run the same backward pass",
                self.owner
            )
        })
    }
}

impl ReleasedShard {
    // The parameter's gradient summed over the processes onto its owner, as the owner's block
    // of a reduce-scatter whose other blocks are empty: the ring sums that block in the order
    // stage 2's reduce-scatter sums the owner's (the order depends on the block's owner, not
    // on its offset), and divides as it does, so each value is stage 2's bit for bit.
    fn reduced(&self, mut grad: Vec<u8>) -> Result<Option<Vec<u8>>, DistributedError> {
        agree_on(&self.group, self.place)?;
        let mut counts = vec![0; self.group.world_size()];
        counts[self.owner] = grad.len() / Element::F32.size();
        let mine =
            self.group
                .reduce_scatter_bytes(Element::F32, &mut grad, &counts, ReduceOp::Mean)?;
        if !self.is_owned() {
            return Ok(None);
        }
        grad.truncate(mine.end);
        grad.drain(..mine.start);
        Ok(Some(grad))
    }
}

// What a released parameter's `Param` holds once read, where the decorator resolves
// placeholders: the owner's own value, elsewhere a placeholder of the full shape (a stride-0
// view of one `-0.0`, a few bytes), each registered with the shard that gathers it per use.
fn held<B: AutodiffBackend, const D: usize>(
    own: Option<Tensor<B::InnerBackend, D>>,
    shape: &Shape,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    if let Some(own) = own {
        return Tensor::from_inner(own);
    }
    let zero = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(vec![-0.0f32], [1]), device)
        .cast(dtype)
        .reshape([1; D]);
    let dims: [usize; D] = shape.dims();
    Tensor::from_inner(zero.expand(dims))
}
