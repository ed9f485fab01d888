//! The optimizer state of sharded training: split among the processes while training, and
//! whole in a checkpoint.
//!
//! At ZeRO stages 1 and 2 each process's optimizer holds state for its own partition of the
//! parameters alone ([`Partition`]); at stage 3, slice-shaped state for its slice of every
//! parameter. A checkpoint holds the whole state, merged (or joined from the slices) on the
//! main process ([`consolidate_state`], torch's
//! `ZeroRedundancyOptimizer.consolidate_state_dict`), so it is the record a stage 0 run
//! writes: it resumes at any stage, on any number of processes, each keeping its new
//! partition's part ([`keep_own_state`]) or its slices ([`keep_own_slices`]).

use burn::module::{AutodiffModule, ParamId};
use burn::record::{Record, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use hashbrown::HashMap;

use crate::distributed::{DistributedError, ProcessGroup};
use crate::record_bytes::{Bytes, from_bytes};

use super::sharded::{Partition, param_ids, param_shapes};
use super::state_slices::{join_state, slice_state};

/// An optimizer record that keeps its state per parameter, so that sharded training can split
/// it among the processes (by parameter, or into slices) and merge it back.
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

    /// The record cut into `parts` records: part `i` holds the state of each parameter
    /// `part_of` gives `i` (and none holds that of a parameter it gives `None`), its tensors
    /// on `device`.
    ///
    /// A sharded checkpoint at ZeRO stage 3 sends each process's slices of every parameter's
    /// state to that parameter's owner, one part per owner. The default encodes the record
    /// once and reads it back once per part, keeping each part's own parameters
    /// ([`rekey`](Self::rekey)), since a record need not be `Clone`; override it where the
    /// record can be cut without that (Burn's records are).
    ///
    /// # Errors
    /// The record cannot be encoded or read back (the default only).
    fn split(
        self,
        part_of: &dyn Fn(ParamId) -> Option<usize>,
        parts: usize,
        device: &B::Device,
    ) -> Result<Vec<Self>, String>
    where
        Self: Sized,
    {
        let encoded = Bytes::default()
            .record(self, ())
            .map_err(|e| format!("cannot encode the state: {e}"))?;
        (0..parts)
            .map(|i| {
                let whole: Self = from_bytes::<B, Self>(encoded.clone(), device)
                    .map_err(|e| format!("cannot read the state back: {e}"))?;
                Ok(whole.rekey(&mut |id| (part_of(id) == Some(i)).then_some(id)))
            })
            .collect()
    }

    /// The record with the state of each parameter whose shape `shapes` gives cut to process
    /// `rank`'s flat slice of `processes` (the state of a parameter it gives none of stays as
    /// it is), its tensors on `device`.
    ///
    /// At ZeRO stage 3 each process steps only its flat slice of every parameter (FSDP's
    /// sharded optimizer state, [`slice_range`](crate::zero::slice_range)), so an elementwise
    /// optimizer's state has the slices' shape there: a run resuming from a checkpoint's whole
    /// state at stage 3 keeps its own slices of it.
    ///
    /// # Errors
    /// The default: the record cannot be sliced. Burn's records: a state that cannot be
    /// encoded or read back, or holds no tensor of its parameter's shape.
    fn slice(
        self,
        shapes: &dyn Fn(ParamId) -> Option<Vec<usize>>,
        processes: usize,
        rank: usize,
        device: &B::Device,
    ) -> Result<Self, String>
    where
        Self: Sized,
    {
        let _ = (shapes, processes, rank, device);
        Err(cannot_slice::<Self>())
    }

    /// The whole record of every process's sliced one (`parts`, in rank order, each as
    /// [`slice`](Self::slice) cut it, keyed by the same ids): the state of each parameter whose
    /// shape `shapes` gives joined from the parts' slices (the state of a parameter it gives
    /// none of is part 0's), its tensors on `device`.
    ///
    /// A checkpoint holds the whole state (as a run at stages 0 to 2 writes it, so that it
    /// resumes at any stage on any number of processes): at ZeRO stage 3, where each process
    /// holds its slices of every parameter's state, consolidating it joins them.
    ///
    /// # Errors
    /// The default: the record cannot be joined. Burn's records: no parts, a state one part
    /// holds and another does not, parts of different structure or sliced over another number
    /// of processes.
    fn join(
        parts: Vec<Self>,
        shapes: &dyn Fn(ParamId) -> Option<Vec<usize>>,
        device: &B::Device,
    ) -> Result<Self, String>
    where
        Self: Sized,
    {
        let _ = (parts, shapes, device);
        Err(cannot_slice::<Self>())
    }
}

/// Why a record without [`ParamStateRecord::slice`] and [`join`](ParamStateRecord::join)
/// cannot train at ZeRO stage 3.
fn cannot_slice<R>() -> String {
    format!(
        "the optimizer's record ({}) cannot be cut along ZeRO stage 3's parameter slices: \
         implement `ParamStateRecord::slice` and `ParamStateRecord::join` for it",
        std::any::type_name::<R>()
    )
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

    fn split(
        self,
        part_of: &dyn Fn(ParamId) -> Option<usize>,
        parts: usize,
        _: &B::Device,
    ) -> Result<Vec<Self>, String> {
        let mut split: Vec<Self> = (0..parts).map(|_| Self::new()).collect();
        for (id, state) in self {
            if let Some(part) = part_of(id).and_then(|i| split.get_mut(i)) {
                part.insert(id, state);
            }
        }
        Ok(split)
    }

    fn slice(
        self,
        shapes: &dyn Fn(ParamId) -> Option<Vec<usize>>,
        processes: usize,
        rank: usize,
        device: &B::Device,
    ) -> Result<Self, String> {
        self.into_iter()
            .map(|(id, state)| {
                let Some(shape) = shapes(id) else {
                    return Ok((id, state));
                };
                let bytes = state_bytes::<B, R>(id, state)?;
                let sliced = slice_state(&bytes, &shape, processes, rank)
                    .map_err(|e| format!("the optimizer state of {}: {e}", param_name(id)))?;
                Ok((id, state_from_bytes::<B, R>(id, sliced, device)?))
            })
            .collect()
    }

    fn join(
        parts: Vec<Self>,
        shapes: &dyn Fn(ParamId) -> Option<Vec<usize>>,
        device: &B::Device,
    ) -> Result<Self, String> {
        let mut parts = parts.into_iter();
        let Some(first) = parts.next() else {
            return Err("no process's optimizer state to join".into());
        };
        let mut others: Vec<Self> = parts.collect();
        for (rank, other) in (1..).zip(&others) {
            if let Some(&id) = other.keys().find(|id| !first.contains_key(*id)) {
                return Err(format!(
                    "process {rank}'s optimizer state holds {}'s, and process 0's does not",
                    param_name(id)
                ));
            }
        }
        first
            .into_iter()
            .map(|(id, state)| {
                let mut states = vec![state];
                for (rank, other) in (1..).zip(&mut others) {
                    states.push(other.remove(&id).ok_or_else(|| {
                        format!(
                            "process {rank}'s optimizer state holds none of {}, and process 0's \
                             does",
                            param_name(id)
                        )
                    })?);
                }
                let Some(shape) = shapes(id) else {
                    return Ok((id, states.swap_remove(0)));
                };
                let parts = states
                    .into_iter()
                    .map(|state| state_bytes::<B, R>(id, state))
                    .collect::<Result<Vec<_>, _>>()?;
                let whole = join_state(&parts, &shape)
                    .map_err(|e| format!("the optimizer state of {}: {e}", param_name(id)))?;
                Ok((id, state_from_bytes::<B, R>(id, whole, device)?))
            })
            .collect()
    }
}

/// The bytes of the state of parameter `id` on its own, as a record of one entry keyed by
/// `id`: `from_bytes`'s check knows an optimizer state by the parameter id it is under, and
/// refuses a state record on its own (whose state is under Burn's `item`, not an id).
fn state_bytes<B: Backend, R: Record<B>>(id: ParamId, state: R) -> Result<Vec<u8>, String> {
    Recorder::<B>::record(&Bytes::default(), HashMap::from([(id, state)]), ()).map_err(|e| {
        format!(
            "cannot encode the optimizer state of {}: {e}",
            param_name(id)
        )
    })
}

/// The state of parameter `id` from [`state_bytes`]'s, on `device`.
fn state_from_bytes<B: Backend, R: Record<B>>(
    id: ParamId,
    bytes: Vec<u8>,
    device: &B::Device,
) -> Result<R, String> {
    let cannot = |e: String| {
        format!(
            "the optimizer state of {} cannot be read: {e}",
            param_name(id)
        )
    };
    from_bytes::<B, HashMap<ParamId, R>>(bytes, device)
        .map_err(cannot)?
        .remove(&id)
        .ok_or_else(|| cannot("it is under another id".into()))
}

/// A parameter as an error names it: by its place in the model where the id is one (the
/// state of another process is keyed by place, [`keyed_by_place`]; Burn draws ids at random
/// over 64 bits, so a drawn one is below 2^32 about once in four billion), else by its id.
fn param_name(id: ParamId) -> String {
    match id.val() {
        place if place < 1 << 32 => format!("parameter #{place}"),
        _ => format!("parameter {id}"),
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

/// ZeRO stage 3: the part of a whole `record` (a checkpoint's, or a fresh optimizer's) this
/// process steps: every parameter's state cut to this process's slice of the parameter
/// ([`ParamStateRecord::slice`]), its tensors on `device`.
///
/// # Errors
/// What [`ParamStateRecord::slice`] returns.
pub fn keep_own_slices<B, M, R>(
    module: &M,
    record: R,
    processes: usize,
    rank: usize,
    device: &B::Device,
) -> Result<R, String>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let shapes: HashMap<ParamId, Vec<usize>> = param_shapes::<B, M>(module).into_iter().collect();
    record.slice(&|id| shapes.get(&id).cloned(), processes, rank, device)
}

/// Every process's part of the optimizer state of `module`, merged on process `root` (`None`
/// on the others), with its tensors on `device`. Every process must call it at the same point.
/// Where `sliced` (ZeRO stage 3: each process holds its slices of every parameter's state),
/// the parts are joined ([`ParamStateRecord::join`]); otherwise each parameter's state is its
/// owner's.
///
/// Each part travels whole to the root, which holds the whole state for a moment, as torch's
/// `consolidate_state_dict` does. Processes give the same parameter different ids (Burn draws
/// them at random), so the state travels keyed by the parameter's place in `module`, and is
/// merged under the root's ids.
///
/// # Errors
/// What the group's point-to-point messages return; [`DistributedError::Malformed`] when a
/// part cannot be read back (processes built from different optimizers), or joined.
pub fn consolidate_state<B, M, R>(
    group: &ProcessGroup,
    module: &M,
    part: R,
    root: usize,
    sliced: bool,
    device: &B::Device,
) -> Result<Option<R>, DistributedError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let n = group.world_size();
    if root >= n {
        return Err(DistributedError::InvalidCall(format!(
            "consolidate on process {root}, but there are {n} (ranks 0..{n})"
        )));
    }
    if n == 1 {
        return Ok(Some(part));
    }
    let part = keyed_by_place::<B, M, R>(module, part);
    let Some(parts) = parts_at(group, part, root, device)? else {
        return Ok(None);
    };
    let whole = if sliced {
        let shapes = param_shapes::<B, M>(module);
        let by_place = |place: ParamId| shapes.get(place.val() as usize).map(|(_, s)| s.clone());
        R::join(parts, &by_place, device).map_err(|detail| DistributedError::Malformed {
            rank: root,
            detail: format!("the processes' slices of the optimizer state do not join: {detail}"),
        })?
    } else {
        let mut parts = parts.into_iter();
        let first = parts.next().expect("one part a process");
        parts.fold(first, R::merge)
    };
    keyed_by_id::<B, M, R>(module, whole)
        .map(Some)
        .map_err(|detail| DistributedError::Malformed { rank: root, detail })
}

/// ZeRO stage 3's part of a sharded checkpoint: the whole state of the parameters `partition`
/// gives to this process (the layout stages 1 and 2 write, so that a run resumes from it at
/// any stage on any number of processes), joined from every process's slices (`part`), each
/// parameter's on its owner alone, keyed by place ([`keyed_by_place`]). Every process must
/// call it at the same point.
///
/// # Errors
/// As [`consolidate_state`]'s.
pub(crate) fn own_whole_state<B, M, R>(
    group: &ProcessGroup,
    module: &M,
    part: R,
    partition: &Partition,
    device: &B::Device,
) -> Result<R, DistributedError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let (rank, n) = (group.rank(), group.world_size());
    let shapes = param_shapes::<B, M>(module);
    let owners: Vec<usize> = shapes.iter().map(|(id, _)| partition.owner(*id)).collect();
    let by_place = |place: ParamId| shapes.get(place.val() as usize).map(|(_, s)| s.clone());
    let part = keyed_by_place::<B, M, R>(module, part);
    let shares = part
        .split(
            &|place| owners.get(place.val() as usize).copied(),
            n,
            device,
        )
        .map_err(DistributedError::InvalidCall)?;
    if shares.len() != n {
        return Err(DistributedError::InvalidCall(format!(
            "`ParamStateRecord::split` cut the optimizer state into {} parts for {n} owners",
            shares.len()
        )));
    }
    let mut own = None;
    for (owner, share) in shares.into_iter().enumerate() {
        if let Some(parts) = parts_at(group, share, owner, device)? {
            let joined = R::join(parts, &by_place, device).map_err(|detail| {
                DistributedError::Malformed {
                    rank,
                    detail: format!(
                        "the processes' slices of the optimizer state do not join: {detail}"
                    ),
                }
            })?;
            own = Some(joined);
        }
    }
    Ok(own.expect("this process is one of the owners"))
}

// Every process's `part` (keyed by place) on process `root`, in rank order (`None` on the
// others), with its tensors on `device`.
fn parts_at<B: Backend, R: ParamStateRecord<B>>(
    group: &ProcessGroup,
    part: R,
    root: usize,
    device: &B::Device,
) -> Result<Option<Vec<R>>, DistributedError> {
    let (rank, n) = (group.rank(), group.world_size());
    // NamedMpk rather than bincode: Burn's bincode recorder allocates whatever length the
    // bytes claim (a damaged part aborted the main process), and MessagePack's decoder reads
    // a claimed length only as far as the bytes go (SECURITY.md).
    let recorder = Bytes::default();
    // Every process opens the stream, so that the streams opened after it pair up.
    let stream = group.stream();
    if rank != root {
        let bytes = recorder
            .record(part, ())
            .map_err(|e| DistributedError::InvalidCall(format!("cannot encode the state: {e}")))?;
        stream.send(root, 0, 0, &bytes)?;
        return Ok(None);
    }
    let mut parts = Vec::with_capacity(n);
    let mut own = Some(part);
    for from in 0..n {
        if from == root {
            parts.push(own.take().expect("the root's own part, once"));
            continue;
        }
        let (_, _, bytes) = stream.recv(from)?;
        let other: R =
            from_bytes::<B, R>(bytes, device).map_err(|e| DistributedError::Malformed {
                rank: from,
                detail: format!("its optimizer state cannot be read: {e}"),
            })?;
        parts.push(other);
    }
    Ok(Some(parts))
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

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::backend::Flex;
    use burn::record::Record;
    use burn::tensor::Tensor;

    use super::*;

    /// An optimizer's record of the user's own, implementing only what stages 1 and 2 need.
    #[derive(Record)]
    struct Own<B: Backend> {
        moment: Tensor<B, 1>,
    }

    impl<B: Backend> ParamStateRecord<B> for Own<B> {
        fn rekey(self, _: &mut dyn FnMut(ParamId) -> Option<ParamId>) -> Self {
            self
        }

        fn merge(self, _: Self) -> Self {
            self
        }
    }

    #[test]
    fn a_record_without_slice_and_join_says_to_implement_them() {
        let device = Default::default();
        let own = || Own::<Flex> {
            moment: Tensor::zeros([3], &device),
        };
        let shapes = |_: ParamId| Some(vec![3]);
        let err = own().slice(&shapes, 2, 0, &device).err().unwrap();
        assert!(
            err.contains("implement `ParamStateRecord::slice` and `ParamStateRecord::join`"),
            "{err}"
        );
        let err = Own::join(vec![own(), own()], &shapes, &device)
            .err()
            .unwrap();
        assert!(err.contains("cannot be cut along ZeRO stage 3's"), "{err}");
    }

    /// A record of the user's own that cuts and joins by parameter but keeps `split`'s
    /// default.
    #[derive(Record)]
    struct Moments<B: Backend> {
        ids: Vec<u64>,
        moments: Vec<Tensor<B, 1>>,
    }

    impl<B: Backend> ParamStateRecord<B> for Moments<B> {
        fn rekey(self, key: &mut dyn FnMut(ParamId) -> Option<ParamId>) -> Self {
            let (ids, moments) = self
                .ids
                .into_iter()
                .zip(self.moments)
                .filter_map(|(id, moment)| Some((key(ParamId::from(id))?.val(), moment)))
                .unzip();
            Self { ids, moments }
        }

        fn merge(mut self, other: Self) -> Self {
            self.ids.extend(other.ids);
            self.moments.extend(other.moments);
            self
        }
    }

    // Parameters 0..6 go to part `id % 3`, except 4, which goes to none.
    fn part_of(id: ParamId) -> Option<usize> {
        (id.val() != 4).then_some(id.val() as usize % 3)
    }

    fn moment(id: u64, device: &burn::tensor::Device<Flex>) -> Tensor<Flex, 1> {
        Tensor::from_floats([id as f32, id as f32 + 0.5], device)
    }

    fn values(tensor: &Tensor<Flex, 1>) -> Vec<f32> {
        tensor.to_data().to_vec().unwrap()
    }

    #[test]
    fn splitting_a_record_keeps_each_parameters_state_in_its_part_alone() {
        let device = Default::default();
        let whole = Moments::<Flex> {
            ids: (0..6).collect(),
            moments: (0..6).map(|id| moment(id, &device)).collect(),
        };
        let parts = whole.split(&part_of, 3, &device).unwrap();
        assert_eq!(parts.len(), 3);
        let ids: Vec<_> = parts.iter().map(|part| part.ids.clone()).collect();
        assert_eq!(ids, [vec![0, 3], vec![1], vec![2, 5]]);
        for part in &parts {
            for (id, moment) in part.ids.iter().zip(&part.moments) {
                assert_eq!(
                    values(moment),
                    [*id as f32, *id as f32 + 0.5],
                    "parameter {id}"
                );
            }
        }

        let whole: HashMap<ParamId, Tensor<Flex, 1>> = (0..6)
            .map(|id| (ParamId::from(id), moment(id, &device)))
            .collect();
        let parts = whole.split(&part_of, 3, &device).unwrap();
        for (i, part) in parts.iter().enumerate() {
            let mut ids: Vec<_> = part.keys().map(|id| id.val()).collect();
            ids.sort_unstable();
            assert_eq!(ids, [[0, 3].as_slice(), &[1], &[2, 5]][i], "part {i}");
            for (id, moment) in part {
                let id = id.val() as f32;
                assert_eq!(values(moment), [id, id + 0.5]);
            }
        }
    }
}
