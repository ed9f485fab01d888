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
//! collectives no other process meets. Here every process visits the model in the same order
//! and reads each parameter's value the way an op reads it (the same gather, on every
//! process, in visiting order); the root keeps each value for the record, the others drop it
//! before the next is gathered. So at most one gathered parameter is whole at a time on a
//! process other than the root, and the root holds the whole model while it writes, as it
//! holds the whole optimizer state ([`consolidate_state`](super::consolidate_state)).
//!
//! The record keeps Burn's parameter mappers: a released parameter keeps its mappers
//! (`release_parameters`), so the root's record applies each parameter's save mapper as
//! `into_record` would have on a whole model.

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use crate::backend::placeholder;
use crate::distributed::{DistributedError, ProcessGroup};

/// The record of `module` (Burn's `into_record`, each parameter's save mapper applied), whole,
/// on process `root` (`None` on the others), from a model whose parameters may be released
/// (ZeRO stage 3, between or during steps) or whole. Every process must call it at the same
/// point, with the same model, and no process may read the model in between.
///
/// Each released parameter is gathered from its owner as an op gathers it (so a process
/// whose model differs fails with the gather's error, naming the parameter's place); the
/// processes other than `root` drop each value once gathered, so no process but `root` holds
/// more than one gathered parameter at a time. `module` itself is left as it was: its
/// released parameters stay released.
///
/// # Errors
/// [`DistributedError::InvalidCall`] when `root` is not a process of `group`. A gather that
/// fails (a process that left, or whose model differs) panics with the gather's error, as it
/// does inside an op.
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
    // A clone: a released parameter's clone is released too (Burn clones a lazy parameter
    // without initialising it), so reading the clone leaves `module`'s parameters as they
    // were; an initialised one shares its tensor.
    let gathered = module.clone().map(&mut Gather {
        keep,
        tracked: false,
    });
    Ok(keep.then(|| gathered.into_record()))
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
