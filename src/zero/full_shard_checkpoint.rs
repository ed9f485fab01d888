//! ZeRO stage 3's model made whole again: its record on one process, gathered parameter by
//! parameter for a checkpoint (FSDP's `FULL_STATE_DICT` with `rank0_only`), so that the file
//! is the one a stage 0 run writes: Burn loads it without this crate, and a run resumes from
//! it at any stage on any number of processes; or the model itself whole on every process, for
//! what follows the training (FSDP's `summon_full_params`: `with_accelerate` hands Burn back a
//! whole model).
//!
//! Between steps a stage 3 process holds its partition's parameters only
//! ([`release_parameters`](super::release_parameters)); a record made the way Burn makes one
//! (`into_record` on the main process alone) would gather on the main process alone, whose
//! collectives no other process meets. Here every process visits the model in the same order;
//! each released parameter's owner reads its own value where it holds it and sends it to the
//! root alone, point to point (torch's `gather` to rank 0, not a broadcast: the save's traffic
//! is the model once, not `N - 1` times), and the root receives each in visiting order. A
//! process other than the root never holds a parameter it does not own; the root holds the
//! whole model while it writes, as it holds the whole optimizer state
//! ([`consolidate_state`](super::consolidate_state)).
//!
//! The record keeps Burn's parameter mappers: a released parameter keeps its mappers
//! (`release_parameters`), so the root's record applies each parameter's save mapper as
//! `into_record` would have on a whole model.

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use burn::tensor::TensorData;

use crate::backend::placeholder;
use crate::distributed::{DistributedError, ProcessGroup, Stream};

use super::sharded::Partition;

/// The record of `module` (Burn's `into_record`, each parameter's save mapper applied), whole,
/// on process `root` (`None` on the others), from a model whose parameters may be released
/// (ZeRO stage 3, between steps) or whole. Every process must call it at the same point, with
/// the same model, and no process may read the model in between.
///
/// Each released parameter goes from its owner to `root` alone, point to point, in visiting
/// order: its owner reads the value it holds, and no other process receives it (the save's
/// traffic is the model once). A parameter held whole (on one process, or read already during
/// a step) is read as an op reads it. `module` itself is left as it was: its released
/// parameters stay released.
///
/// # Errors
/// [`DistributedError::InvalidCall`] when `root` is not a process of `group`; what the group's
/// point-to-point messages return (a process that left); [`DistributedError::Mismatch`] when
/// an owner sends another parameter than the one `root` expects, or another size (the
/// processes' models differ).
pub fn gather_model_record<B, M>(
    group: &ProcessGroup,
    module: &M,
    root: usize,
) -> Result<Option<M::Record>, DistributedError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let n = group.world_size();
    if root >= n {
        return Err(DistributedError::InvalidCall(format!(
            "gather the model on process {root}, but there are {n} (ranks 0..{n})"
        )));
    }
    let keep = group.rank() == root;
    let mut to_root = ToRoot {
        rank: group.rank(),
        root,
        partition: Partition::of::<B, M>(module, n),
        // Every process opens it, so that the streams opened after it pair up.
        stream: group.stream(),
        place: 0,
        failed: None,
        whole: Gather {
            keep,
            tracked: false,
        },
    };
    let reading = placeholder::reading_held();
    // A clone: a released parameter's clone is released too (Burn clones a lazy parameter
    // without initialising it), so reading the clone leaves `module`'s parameters as they
    // were; an initialised one shares its tensor.
    let gathered = module.clone().map(&mut to_root);
    drop(reading);
    if let Some(err) = to_root.failed {
        return Err(err);
    }
    Ok(keep.then(|| gathered.into_record()))
}

/// The record of `module` with the values of the parameters `partition` gives to `rank` alone
/// (each with its save mapper applied), every other parameter a value of no elements: this
/// process's part of a sharded checkpoint (FSDP's `SHARDED_STATE_DICT`, DeepSpeed's per-rank
/// files). Nothing is sent or gathered: a released parameter (ZeRO stage 3) gives the value
/// its owner holds, a whole one (stages 1 and 2) its own. `module` itself is left as it was.
pub(crate) fn own_model_record<B, M>(module: &M, partition: &Partition, rank: usize) -> M::Record
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    struct OwnOnly<'a> {
        partition: &'a Partition,
        rank: usize,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for OwnOnly<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let own = self.partition.owner(param.id) == self.rank;
            let device = param.lazy_device();
            // The held value (`reads_held_values`) of a released parameter: no collective.
            let (id, value, mappers) = param.consume();
            let value = if own {
                own_value(value)
            } else {
                Tensor::empty([0; D], &device)
            };
            Param::from_mapped_value(id, value, mappers)
        }
    }
    let reading = placeholder::reading_held();
    // A clone, as in `gather_model_record`: `module`'s released parameters stay released.
    let own = module.clone().map(&mut OwnOnly { partition, rank });
    drop(reading);
    own.into_record()
}

// The value this process owns of a parameter, read without a collective: a placeholder the
// model holds initialised (Burn's `Learner` reloads the stepped model, whose owned values stay
// registered as the parameters they stand for) is read as the tensor it is, its registration
// set aside for the read and put back; any other value is itself.
fn own_value<B: AutodiffBackend, const D: usize>(value: Tensor<B, D>) -> Tensor<B, D> {
    let primitive = value.clone().into_primitive().tensor();
    let Some((_, shard)) = placeholder::registered::<B>(&primitive) else {
        return value;
    };
    let device = value.device();
    placeholder::unregister_tensor::<B>(&primitive);
    let data = value.into_data();
    placeholder::register_tensor::<B>(&primitive, shard);
    Tensor::from_data(data, &device)
}

/// [`release_parameters`](super::release_parameters) of a model some of whose parameters
/// were loaded from a checkpoint and the others are as given: fresh (Burn's lazy
/// initializers) or released already (`Accelerator::prepare_model`'s), whose values are
/// dropped as they are held, without gathering them. Every process must call it at the same
/// point.
pub(crate) fn release_loaded<B, M>(group: &ProcessGroup, module: M, partition: &Partition) -> M
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let reading = placeholder::reading_held();
    let released = super::release_parameters(group, module, partition);
    drop(reading);
    released
}

/// `module` with every parameter whole on this process: each released parameter gathered
/// from its owner (as an op gathers it, in visiting order), with its gradient requirement and
/// mappers; a whole one as it is. Every process must call it at the same point, with the same
/// model. The result reads no placeholder and gathers nothing at its uses: every process may
/// use it alone (evaluate it, save it).
///
/// A gather that fails (a process that left, or whose model differs) panics with the gather's
/// error, as it does inside an op.
pub fn gather_model<B, M>(module: M) -> M
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    module.map(&mut Gather {
        keep: true,
        tracked: true,
    })
}

/// The record of `module` as its parameters are held, without their save mappers: a ZeRO
/// stage 3 placeholder stays the placeholder it is (still registered: no op reads it, nothing
/// is gathered), for loading back into the model it came from on one process alone
/// (`with_accelerate`'s main process, after a checkpoint for which it held the whole model).
/// Every parameter must be initialised (a released one's first read would gather it).
pub(crate) fn held_record<B, M>(module: M) -> M::Record
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    struct Held;
    impl<B: AutodiffBackend> ModuleMapper<B> for Held {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, value, _mappers) = param.consume();
            Param::initialized(id, value)
        }
    }
    module.map(&mut Held).into_record()
}

// Reads every float parameter whole, on every process in visiting order; keeps the values
// on the root and a value of no elements elsewhere.
struct Gather {
    keep: bool,
    // Whether a kept value requires a gradient as its parameter did (a model to go on with);
    // a record's values do not, as a record read back from bytes does not.
    tracked: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Gather {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let released = !param.is_initialized();
        let (id, value, mappers) = param.consume();
        let (device, require_grad) = (value.device(), value.is_require_grad());
        // Where placeholders are recognised, the read below is the gather (every process's
        // collective); elsewhere `consume` gathered it already.
        let primitive = value.clone().into_primitive().tensor();
        let data = value.into_data();
        if released {
            // The clone's own registration, made by its first read: no op reads it again. (An
            // initialised parameter's tensor is the model's own, and stays registered.)
            placeholder::unregister_tensor::<B>(&primitive);
        }
        let value = if self.keep {
            Tensor::from_data(data, &device).set_require_grad(require_grad && self.tracked)
        } else {
            drop(data);
            Tensor::empty([0; D], &device)
        };
        Param::from_mapped_value(id, value, mappers)
    }
}

// Sends each released parameter from its owner to the root, in visiting order; a parameter
// held whole is read as `Gather` reads it. The root keeps the values; the others keep a value
// of no elements.
struct ToRoot {
    rank: usize,
    root: usize,
    partition: Partition,
    stream: Stream,
    // The next parameter's place in visiting order: the message's tag.
    place: u64,
    // The first failure; no message is sent or awaited after it.
    failed: Option<DistributedError>,
    whole: Gather,
}

impl ToRoot {
    // The value the root keeps for the parameter at `place`, owned by `owner`, of which this
    // process holds `held` (the owner's value on its owner, a placeholder elsewhere).
    fn value<B: AutodiffBackend, const D: usize>(
        &mut self,
        owner: usize,
        place: u64,
        held: Tensor<B, D>,
    ) -> Result<Option<Tensor<B, D>>, DistributedError> {
        let (is_owner, is_root) = (self.rank == owner, self.rank == self.root);
        match (is_owner, is_root) {
            (true, true) => Ok(Some(held)),
            (true, false) => {
                let bytes = held.into_data().bytes;
                self.stream.send(self.root, place, 0, &bytes)?;
                Ok(None)
            }
            (false, true) => {
                let (shape, dtype, device) = (held.shape(), held.dtype(), held.device());
                let (tag, _, bytes) = self.stream.recv(owner)?;
                let expected = shape.num_elements() * dtype.size();
                if tag != place || bytes.len() != expected {
                    return Err(DistributedError::Mismatch {
                        rank: owner,
                        detail: format!(
                            "for a checkpoint it sent parameter #{tag} ({} bytes) where this \
                             process expects #{place}, a {dtype:?} parameter of shape \
                             {shape:?} ({expected} bytes): the processes' models differ",
                            bytes.len()
                        ),
                    });
                }
                let data = TensorData::from_bytes_vec(bytes, shape, dtype);
                Ok(Some(Tensor::from_data(data, &device)))
            }
            (false, false) => Ok(None),
        }
    }
}

impl<B: AutodiffBackend> ModuleMapper<B> for ToRoot {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let place = self.place;
        self.place += 1;
        if param.is_initialized() {
            return <Gather as ModuleMapper<B>>::map_float(&mut self.whole, param);
        }
        let owner = self.partition.owner(param.id);
        // The held value (`reads_held_values`): no collective, nothing registered.
        let (id, held, mappers) = param.consume();
        let device = held.device();
        let value = match self.failed {
            Some(_) => None,
            None => self
                .value::<B, D>(owner, place, held)
                .unwrap_or_else(|err| {
                    self.failed = Some(err);
                    None
                }),
        };
        let value = value.unwrap_or_else(|| Tensor::empty([0; D], &device));
        Param::from_mapped_value(id, value, mappers)
    }
}
