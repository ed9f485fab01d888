//! The optimizer state of sharded training: split among its owners while training, and whole
//! in a checkpoint.
//!
//! At ZeRO stages 1 and 2 each process's optimizer holds state for its own partition of the
//! parameters alone ([`Partition`]). A checkpoint holds the whole state, merged on the main
//! process ([`consolidate_state`], torch's `ZeroRedundancyOptimizer.consolidate_state_dict`), so it
//! is the record a stage 0 run writes: it resumes at any stage, on any number of processes,
//! each keeping its new partition's part ([`keep_own_state`]).

use burn::module::{AutodiffModule, ParamId};
use burn::record::{Record, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use hashbrown::HashMap;

use crate::distributed::{DistributedError, ProcessGroup};
use crate::record_bytes::{Bytes, from_bytes};

use super::sharded::{Partition, param_ids};

/// An optimizer record that keeps its state per parameter, so that sharded training can split
/// it among the parameters' owners and merge it back.
///
/// Burn's optimizers (`OptimizerAdaptor`: Adam, AdamW, SGD, RMSProp, ...) record
/// `hashbrown::HashMap<ParamId, _>`, which implements it; implement it for an optimizer of your own to
/// train it sharded with [`with_accelerate`](crate::train::WithAccelerate).
pub trait ParamStateRecord<B: Backend>: Record<B> {
    /// The record with each parameter's state under the id `key` gives it, and without the
    /// state of the parameters it gives none.
    fn rekey(self, key: &mut dyn FnMut(ParamId) -> Option<ParamId>) -> Self;

    /// The state of both records (parameters are in one or the other).
    fn merge(self, other: Self) -> Self;
}

impl<B: Backend, R: Record<B>> ParamStateRecord<B> for HashMap<ParamId, R> {
    fn rekey(self, key: &mut dyn FnMut(ParamId) -> Option<ParamId>) -> Self {
        self.into_iter()
            .filter_map(|(id, state)| Some((key(id)?, state)))
            .collect()
    }

    fn merge(mut self, other: Self) -> Self {
        self.extend(other);
        self
    }
}

/// The part of `record` this process steps: the state of the parameters `partition` gives to
/// `rank` (state of parameters the model does not have stays with rank 0).
pub fn keep_own_state<B: Backend, R: ParamStateRecord<B>>(
    record: R,
    partition: &Partition,
    rank: usize,
) -> R {
    record.rekey(&mut |id| (partition.owner(id) == rank).then_some(id))
}

/// Every process's part of the optimizer state of `module`, merged on process `root` (`None`
/// on the others), with its tensors on `device`. Every process must call it at the same point.
///
/// Each part travels whole to the root, which holds the whole state for a moment, as torch's
/// `consolidate_state_dict` does. Processes give the same parameter different ids (Burn draws
/// them at random), so the state travels keyed by the parameter's place in `module`, and is
/// merged under the root's ids.
///
/// # Errors
/// What the group's point-to-point messages return; [`DistributedError::Malformed`] when a
/// part cannot be read back (processes built from different optimizers).
pub fn consolidate_state<B, M, R>(
    group: &ProcessGroup,
    module: &M,
    part: R,
    root: usize,
    device: &B::Device,
) -> Result<Option<R>, DistributedError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let (rank, n) = (group.rank(), group.world_size());
    if root >= n {
        return Err(DistributedError::InvalidCall(format!(
            "consolidate on process {root}, but there are {n} (ranks 0..{n})"
        )));
    }
    if n == 1 {
        return Ok(Some(part));
    }
    let ids = param_ids::<B, M>(module);
    let place: HashMap<ParamId, u64> = ids.iter().zip(0u64..).map(|(id, i)| (*id, i)).collect();
    // NamedMpk rather than bincode: Burn's bincode recorder allocates whatever length the
    // bytes claim (a damaged part aborted the main process), and MessagePack's decoder reads
    // a claimed length only as far as the bytes go (SECURITY.md).
    let recorder = Bytes::default();
    // Every process opens the stream, so that the streams opened after it pair up.
    let stream = group.stream();
    if rank != root {
        // State of a parameter the module does not have has no place to travel to.
        let part = part.rekey(&mut |id| place.get(&id).map(|&i| ParamId::from(i)));
        let bytes = recorder
            .record(part, ())
            .map_err(|e| DistributedError::InvalidCall(format!("cannot encode the state: {e}")))?;
        stream.send(root, 0, 0, &bytes)?;
        return Ok(None);
    }
    let mut whole = part;
    for from in (0..n).filter(|&r| r != root) {
        let (_, _, bytes) = stream.recv(from)?;
        let other: R =
            from_bytes::<B, R>(bytes, device).map_err(|e| DistributedError::Malformed {
                rank: from,
                detail: format!("its optimizer state cannot be read: {e}"),
            })?;
        let mut unknown = None;
        let other = other.rekey(&mut |place| {
            let id = ids.get(place.val() as usize).copied();
            if id.is_none() {
                unknown = Some(place.val());
            }
            id
        });
        if let Some(place) = unknown {
            return Err(DistributedError::Malformed {
                rank: from,
                detail: format!(
                    "it sent the optimizer state of parameter #{place}, and this process's \
                     model has {} parameters",
                    ids.len()
                ),
            });
        }
        whole = whole.merge(other);
    }
    Ok(Some(whole))
}

/// `part` keyed by each parameter's place in `module`'s visiting order instead of its id (ids
/// are drawn at random per process): how a sharded checkpoint's file keeps a process's part of
/// the optimizer state. State of a parameter `module` does not have is dropped.
pub(crate) fn keyed_by_place<B, M, R>(module: &M, part: R) -> R
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let place: HashMap<ParamId, u64> = param_ids::<B, M>(module).into_iter().zip(0u64..).collect();
    part.rekey(&mut |id| place.get(&id).map(|&i| ParamId::from(i)))
}

/// `part` ([`keyed_by_place`]'s) keyed by the ids of `module`'s parameters again.
///
/// # Errors
/// The place of a parameter `module` does not have (the state is of another model).
pub(crate) fn keyed_by_id<B, M, R>(module: &M, part: R) -> Result<R, String>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let ids = param_ids::<B, M>(module);
    let mut unknown = None;
    let part = part.rekey(&mut |place| {
        let id = ids.get(place.val() as usize).copied();
        if id.is_none() {
            unknown = Some(place.val());
        }
        id
    });
    match unknown {
        Some(place) => Err(format!(
            "it holds the optimizer state of parameter #{place}, and the model has {} \
             parameters: it is of another model",
            ids.len()
        )),
        None => Ok(part),
    }
}
