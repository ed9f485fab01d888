//! ZeRO stage 3 ([`ZeroStage::Parameters`](super::ZeroStage::Parameters), FSDP's
//! `FULL_SHARD`): between steps each process holds only the parameters its partition owns,
//! and gathers every other one from its owner at that parameter's first use.
//!
//! # The mechanism
//!
//! After the optimizer steps this process's partition, [`release_parameters`] turns every float
//! parameter of the model into one of Burn's lazy parameters (`Param::uninitialized`, the
//! form `Module::init` builds): the value is dropped, and the parameter keeps its id, shape,
//! device, gradient requirement and an initializer. The owner's initializer holds the owned
//! value; the others' hold nothing but the owner's rank. The first `Param::val()` of the next
//! forward pass runs the initializer, which broadcasts the owner's bytes to every process: a
//! gather at the parameter's first use, in the order the forward pass uses the parameters.
//! Every process runs the same forward pass, so every process gathers the same parameter at
//! the same moment, and the collectives pair up with no schedule agreed beforehand. Each
//! gather first all-gathers the parameter's place in the model's visiting order (8 bytes), so
//! processes that read different parameters (a parameter used on one rank only, a module
//! visited on the main process only) fail at once with an error naming both, and the
//! initializer panics with it (Burn's lazy initializers cannot return an error).
//!
//! Gradients and optimizer state follow stage 2: the window's gradients are
//! reduce-scattered owner by owner ([`reduce_scatter_gradients`](super::reduce_scatter_gradients)),
//! each process's optimizer keeps state for its own partition and steps it, and the sums run
//! in stage 2's order (so stage 3 ends bit for bit where stage 2 does, and where stage 0 does
//! on two processes). Ownership is per parameter ([`partition`](super::partition): whole
//! parameters, largest first), not FSDP's 1/N slice of each parameter: a process's share of
//! the model is balanced to within its largest parameter.
//!
//! # What is bounded, and what is not yet
//!
//! Between steps (from the end of one step to the next forward pass) a process holds its
//! partition's parameters and optimizer state and no gradients: about 1/N of the model's
//! training state. During the forward and backward passes it is not bounded layer by layer:
//! a gathered parameter stays in its `Param` (and in the autodiff graph, which keeps a
//! matmul's weight for its backward) until the step releases it, so by the end of the
//! forward pass every parameter the pass used is whole, and the backward pass adds whole
//! gradients until the reduce-scatter. The peak is then stage 2's: this is FSDP's
//! `FULL_SHARD` with one unit, the whole model, not its per-layer units. Freeing a parameter
//! after its op and gathering it again in backward needs the decorator to give each use of
//! a parameter a backward node of its own that holds the shard instead of the gathered
//! weight (`docs/DESIGN.md`, "The training step"); that is the next increment.
//!
//! # The next increment: the per-layer bound
//!
//! Burn caches a lazy parameter's value in the `Param` until the module is mapped again, so
//! the per-layer bound needs what the `Param` caches to be tiny: a *placeholder* of the full
//! shape, with the shard kept beside it, resolved by the decorator (`Accelerated<B>`, which
//! sees every op) when an op reads it. Checked on Burn 0.21 and Flex (a scratch program, not
//! kept): a placeholder made as `Tensor::from_inner(scalar(-0.0).expand(shape)).require_grad()`
//! is a stride-0 view (an 8192×8192 one added 0.7 MiB of resident memory, a real one 256 MiB),
//! is an autodiff leaf whose gradient comes back whole, and `placeholder + gathered` is the
//! gathered value bit for bit (−0.0 is the additive identity), with the sum's gradient flowing
//! to the placeholder: an op can swap in the gathered weight without the parameter's
//! gradient changing key. What is left: the decorator's ops recognising a placeholder (by its
//! autodiff node id, through the concrete `Autodiff<B, C>` that `crate::hooks` registers per
//! backend type), and a backward node per use that holds the placeholder and gathers again,
//! instead of the op's own node keeping the gathered weight (`docs/DESIGN.md`, "The training
//! step"). Both are in `src/backend/`, outside this increment.
//!
//! Burn's parameter mappers (the transforms a record applies on save and load) are not kept
//! by a released parameter, which is one reason checkpoints refuse stage 3 for now
//! ([`ZeroStage::check_checkpointable`](super::ZeroStage)).

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Shape, Tensor, TensorData};

use crate::distributed::{DistributedError, ProcessGroup};

use super::sharded::Partition;

/// Stage 3, after the step: every float parameter of `module` released, to be gathered from
/// its owner at its first use. Each becomes one of Burn's lazy parameters (same id, shape,
/// device, gradient requirement) whose initializer broadcasts the owner's value: the
/// parameters this process owns keep their values (inside their initializer), the others'
/// values are dropped.
///
/// Every process must call it at the same step, with the same partition, and afterwards read
/// the parameters in the same order (a forward pass, a visit of the whole module): each first
/// read is a collective: the processes first agree on which parameter they gather, so a
/// read of another parameter (or of one on some processes only, paired with the others' next
/// gather) panics at once with a [`DistributedError::Mismatch`] naming both parameters; a
/// read that no other collective ever meets waits until the group's timeout, and panics with
/// its error.
///
/// # Memory
///
/// Between steps a process holds its partition's parameters and optimizer state and no
/// gradients. During a step it is not bounded layer by layer: a gathered parameter stays
/// whole until the step releases it, so the peak is ZeRO stage 2's (FSDP's `FULL_SHARD` with
/// the whole model as its one unit). The design, and what the per-layer bound needs, are in
/// the notes atop `src/zero/full_shard.rs`.
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
            let (id, value, _mappers) = param.consume();
            let require_grad = value.is_require_grad();
            let (shape, dtype, device) = (value.shape(), value.dtype(), value.device());
            let owner = self.partition.owner(id);
            // The autodiff wrapper is not kept: the next use starts a new leaf, as Burn's
            // optimizers start one for the values they step.
            let own = (owner == self.group.rank()).then(|| value.inner());
            let group = self.group.clone();
            let gathered_shape = shape.clone();
            let place = self.place;
            self.place += 1;
            Param::uninitialized(
                id,
                move |device: &B::Device, require_grad: bool| {
                    let value = agree_on(&group, place)
                        .and_then(|()| {
                            gather::<B, D>(
                                &group,
                                owner,
                                own.as_ref(),
                                &gathered_shape,
                                dtype,
                                device,
                            )
                        })
                        .unwrap_or_else(|err| {
                            panic!(
                                "ZeRO stage 3 could not gather a parameter from process {owner} \
                                 at its first use: {err}. Every process must run the same \
                                 forward pass and read the same parameters in the same order"
                            )
                        });
                    if require_grad {
                        value.require_grad()
                    } else {
                        value
                    }
                },
                device,
                require_grad,
                shape,
            )
        }
    }
    if group.world_size() == 1 {
        return module;
    }
    module.map(&mut Release::<'_> {
        group,
        partition,
        place: 0,
    })
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

/// Gathers one released parameter: its owner's value on every process (the owner sends it,
/// the others receive it), as a new leaf without a gradient requirement.
fn gather<B: AutodiffBackend, const D: usize>(
    group: &ProcessGroup,
    owner: usize,
    own: Option<&Tensor<B::InnerBackend, D>>,
    shape: &Shape,
    dtype: DType,
    device: &B::Device,
) -> Result<Tensor<B, D>, DistributedError> {
    if let Some(own) = own {
        let bytes = own.clone().into_data().bytes.to_vec();
        group.broadcast_bytes(owner, bytes)?;
        return Ok(Tensor::from_inner(own.clone()));
    }
    let bytes = group.broadcast_bytes(owner, Vec::new())?;
    let expected = shape.num_elements() * dtype.size();
    if bytes.len() != expected {
        return Err(DistributedError::Mismatch {
            rank: owner,
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
