//! ZeRO stage 3's model made whole again: its record on one process, gathered parameter by
//! parameter for a checkpoint (FSDP's `FULL_STATE_DICT` with `rank0_only`), so that the file
//! is the one a stage 0 run writes: Burn loads it without this crate, and a run resumes from
//! it at any stage on any number of processes; or the model itself whole on every process, for
//! what follows the training (FSDP's `summon_full_params`: `with_accelerate` hands Burn back a
//! whole model).
//!
//! Between steps a stage 3 process holds its slice of every parameter only
//! ([`release_parameters`](super::release_parameters)); a record made the way Burn makes one
//! (`into_record` on the main process alone) would gather on the main process alone, whose
//! collectives no other process meets. Here every process visits the model in the same order
//! and sends its slice of each released parameter to the root alone, point to point (torch's
//! `gather` to rank 0, not an all-gather: the save's traffic is the model once, not `N - 1`
//! times); the root receives the slices in visiting order, joins them in rank order and cuts
//! the padding. A process other than the root never holds a parameter whole; the root holds
//! the whole model while it writes, as it holds the whole optimizer state
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

use super::full_shard::{HeldParam, Releasing};
use super::sharded::Partition;

/// The record of `module` (Burn's `into_record`, each parameter's save mapper applied), whole,
/// on process `root` (`None` on the others), from a model whose parameters may be released
/// (ZeRO stage 3, between steps) or whole. Every process must call it at the same point, with
/// the same model, and no process may read the model in between.
///
/// Each process sends its slice of each released parameter to `root` alone, point to point, in
/// visiting order, and no other process receives it (the save's traffic is the model once); `root`
/// joins the slices and cuts the padding. A parameter held whole (on one process, or read already
/// during a step) is read as an op reads it. `module` itself is left as it was: its released
/// parameters stay released.
///
/// # Errors
/// [`DistributedError::InvalidCall`] when `root` is not a process of `group`; what the group's
/// point-to-point messages return (a process that left); [`DistributedError::Mismatch`] when
/// a process sends a slice of another parameter than the one `root` expects, or of another
/// size (the processes' models differ).
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
        world: n,
        root: Root::One(root),
        // Every process opens it, so that the streams opened after it pair up.
        stream: Some(group.stream()),
        place: 0,
        failed: None,
        whole: Whole::Gather(Gather {
            keep,
            tracked: false,
        }),
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

/// The record of `module` with the values of the parameters `partition` gives to `rank` alone (each
/// with its save mapper applied), every other parameter a value of no elements: this process's part
/// of a sharded checkpoint (FSDP's `SHARDED_STATE_DICT`, DeepSpeed's per-rank files), in the layout
/// stages 1 and 2 write, so that a run resumes from it at any stage on any number of processes. A
/// whole parameter (stages 1 and 2) gives its own value, with nothing sent; a released one (ZeRO
/// stage 3) is gathered from every process's slice to the process `partition` gives it to alone,
/// point to point (the save's traffic is the model once). Every process must call it at the same
/// point, with the same model (`group`: the processes' group, which a model with released
/// parameters needs). `module` itself is left as it was.
///
/// # Errors
/// What the group's point-to-point messages return (a process that left);
/// [`DistributedError::Mismatch`] when a process sends another slice than the one expected
/// (the processes' models differ).
pub(crate) fn own_model_record<B, M>(
    module: &M,
    partition: &Partition,
    rank: usize,
    group: Option<&ProcessGroup>,
) -> Result<M::Record, DistributedError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut to_owner = ToRoot {
        rank,
        world: group.map_or(1, ProcessGroup::world_size),
        root: Root::Owner(partition),
        stream: group.map(ProcessGroup::stream),
        place: 0,
        failed: None,
        whole: Whole::OwnOnly,
    };
    let reading = placeholder::reading_held();
    // A clone, as in `gather_model_record`: `module`'s released parameters stay released.
    let own = module.clone().map(&mut to_owner);
    drop(reading);
    match to_owner.failed {
        Some(err) => Err(err),
        None => Ok(own.into_record()),
    }
}

/// [`release_parameters`](super::release_parameters) of a model whose parameters `partition`
/// gives to this process were loaded from a sharded checkpoint (whole), and the others are
/// fresh (Burn's lazy initializers) or released already (`Accelerator::prepare_model`'s):
/// each parameter goes from the process `partition` gives it to (whose file held it) to every
/// process, one at a time in visiting order, and each keeps its slice; the others' values are
/// dropped as they are held, without gathering them. Every process must call it at the same
/// point.
///
/// # Errors
/// What the broadcasts return; [`DistributedError::Mismatch`] when a parameter's sender sends
/// another size than this process's model has (the processes' models differ).
pub(crate) fn release_loaded<B, M>(
    group: &ProcessGroup,
    module: M,
    partition: &Partition,
) -> Result<M, DistributedError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    struct FromOwners<'a> {
        group: &'a ProcessGroup,
        partition: &'a Partition,
        releasing: Releasing<'a>,
        place: u64,
        failed: Option<DistributedError>,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for FromOwners<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let place = self.place;
            self.place += 1;
            let owner = self.partition.owner(param.id);
            let owned = owner == self.group.rank();
            let (id, value, mappers) = param.consume();
            let (shape, dtype, device) = (value.shape(), value.dtype(), value.device());
            let require_grad = value.is_require_grad();
            let own = owned.then(|| value.into_data().bytes.to_vec());
            if self.failed.is_some() {
                return Param::from_mapped_value(id, Tensor::empty([0; D], &device), mappers);
            }
            let expected = shape.num_elements() * dtype.size();
            let whole = self
                .group
                .broadcast_bytes(owner, own.unwrap_or_default())
                .and_then(|bytes| {
                    if bytes.len() == expected {
                        Ok(bytes)
                    } else {
                        Err(DistributedError::Mismatch {
                            rank: owner,
                            detail: format!(
                                "it sent {} bytes for parameter #{place} (in the model's \
                                 visiting order), a {dtype:?} parameter of shape {shape:?} \
                                 here ({expected} bytes): the processes' models differ",
                                bytes.len()
                            ),
                        })
                    }
                });
            match whole {
                Ok(bytes) => {
                    let data = TensorData::from_bytes_vec(bytes, shape.clone(), dtype);
                    let whole = Tensor::<B, D>::from_data(data, &device);
                    let whole = whole.set_require_grad(require_grad);
                    let held = HeldParam::whole(id, whole, mappers, self.group);
                    self.releasing.add(held)
                }
                Err(err) => {
                    self.failed = Some(err);
                    Param::from_mapped_value(id, Tensor::empty([0; D], &device), mappers)
                }
            }
        }
    }
    let reading = placeholder::reading_held();
    let mut from_owners = FromOwners {
        group,
        partition,
        releasing: Releasing::start(group),
        place: 0,
        failed: None,
    };
    let released = module.map(&mut from_owners);
    drop(reading);
    from_owners.releasing.end();
    match from_owners.failed {
        Some(err) => Err(err),
        None => Ok(released),
    }
}

/// `module` with every parameter whole on this process: each released parameter gathered from every
/// process's slice (as an op gathers it, in visiting order), with its gradient requirement and
/// mappers; a whole one as it is. Every process must call it at the same point, with the same
/// model. The result reads no placeholder and gathers nothing at its uses: every process may use it
/// alone (evaluate it, save it).
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

// Where a released parameter's slices go: to one process, or each parameter's to the process
// whose file holds it in a sharded checkpoint (`zero::partition`'s owner).
enum Root<'a> {
    One(usize),
    Owner(&'a Partition),
}

// How a parameter held whole is read: as an op reads it (kept on the root), or as this
// process's own value where it is the parameter's root (a value of no elements elsewhere,
// with nothing sent).
enum Whole {
    Gather(Gather),
    OwnOnly,
}

// Sends every process's slice of each released parameter to its root, in visiting order; a
// parameter held whole is read as `whole` says. The root keeps the values; the others keep a
// value of no elements.
struct ToRoot<'a> {
    rank: usize,
    world: usize,
    root: Root<'a>,
    // Where there are released parameters: the group's.
    stream: Option<Stream>,
    // The next parameter's place in visiting order: the message's tag.
    place: u64,
    // The first failure; no message is sent or awaited after it.
    failed: Option<DistributedError>,
    whole: Whole,
}

impl ToRoot<'_> {
    // The value `root` keeps of the parameter at `place`, of which this process holds
    // `held`'s slice: every slice, in rank order, cut to the parameter's values.
    fn value<B: AutodiffBackend, const D: usize>(
        &mut self,
        root: usize,
        place: u64,
        held: &HeldParam<B, D>,
    ) -> Result<Option<Tensor<B, D>>, DistributedError> {
        let (rank, n) = (self.rank, self.world);
        let stream = self
            .stream
            .as_ref()
            .expect("released parameters come with their group");
        let own = held.slice.clone().into_data().bytes;
        if rank != root {
            stream.send(root, place, 0, &own)?;
            return Ok(None);
        }
        let block = own.len();
        let mut whole = vec![0u8; block * n];
        whole[rank * block..(rank + 1) * block].copy_from_slice(&own);
        drop(own);
        for from in (0..n).filter(|&r| r != root) {
            let (tag, _, bytes) = stream.recv(from)?;
            if tag != place || bytes.len() != block {
                return Err(DistributedError::Mismatch {
                    rank: from,
                    detail: format!(
                        "for a checkpoint it sent a slice of parameter #{tag} ({} bytes) where \
                         this process expects one of #{place}, a {:?} parameter of shape {:?} \
                         ({block} bytes a slice): the processes' models differ",
                        bytes.len(),
                        held.dtype,
                        held.shape
                    ),
                });
            }
            whole[from * block..(from + 1) * block].copy_from_slice(&bytes);
        }
        whole.truncate(held.shape.num_elements() * held.dtype.size());
        let data = TensorData::from_bytes_vec(whole, held.shape.clone(), held.dtype);
        Ok(Some(Tensor::from_data(data, &held.device)))
    }
}

impl<B: AutodiffBackend> ModuleMapper<B> for ToRoot<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let place = self.place;
        self.place += 1;
        let root = match self.root {
            Root::One(root) => root,
            Root::Owner(partition) => partition.owner(param.id),
        };
        if !super::full_shard::is_released(&param) {
            return match &mut self.whole {
                Whole::Gather(gather) => <Gather as ModuleMapper<B>>::map_float(gather, param),
                Whole::OwnOnly => {
                    let (id, value, mappers) = param.consume();
                    let value = if root == self.rank {
                        value
                    } else {
                        Tensor::empty([0; D], &value.device())
                    };
                    Param::from_mapped_value(id, value, mappers)
                }
            };
        }
        // The held value (`reads_held_values`): no collective, nothing registered.
        let held = HeldParam::<B, D>::released(param);
        let value = match self.failed {
            Some(_) => None,
            None => self
                .value::<B, D>(root, place, &held)
                .unwrap_or_else(|err| {
                    self.failed = Some(err);
                    None
                }),
        };
        let value = value.unwrap_or_else(|| Tensor::empty([0; D], &held.device));
        Param::from_mapped_value(held.id, value, held.mappers)
    }
}
