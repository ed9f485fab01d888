//! [`ProcessGroup`]: the collectives of a run's processes (Accelerate's process group), on
//! flat buffers of any size, over whichever [engine](super::engine) carries the bytes.
//!
//! One per process, joined on first use ([`ProcessState::group`]). The group numbers the
//! calls (every process makes the same ones in the same order), turns sums into means, checks
//! the arguments, and remembers the first failure: a failed collective breaks the group, and
//! every later call reports it.
//!
//! ## Why not burn-collective's global all-reduce
//!
//! burn-collective 0.21 does cross-process all-reduce (its "global" level), but a registration
//! can run only **one** global all-reduce: the second waits forever. Every global strategy
//! (`global/node/{centralized,tree,ring}.rs`) ends with `SyncService::sync`
//! (`burn-collective-0.21.0/src/global/node/sync.rs`), which adds the node's id to a shared
//! list of syncing peers and returns when the sorted list equals the node ids; the list is
//! then "cleared" through a copy (`self.syncing_peers.lock().unwrap().to_vec()` ...
//! `syncing_peers.clear()`), so the shared list keeps every id, and at the next sync it holds
//! duplicates and never equals the node ids again. (Burn's `multinode-tests` run one
//! all-reduce per registration, which is why they pass.) The same `sync` can also lose a
//! wake-up and hang the first all-reduce now and then: it checks the list, then waits on
//! `self.sync_notif.notified()`, a future created after the check, while
//! `handle_sync_connection` wakes with `notify_waiters()`, which reaches only the futures that
//! already exist. Registering again for each step races in the orchestrator's node numbering
//! (`global/orchestrator/state.rs`: a node id is the count of registered nodes, reused while
//! another node is still finishing). Upstream deleted the crate since. A test in
//! `tests/processes` (two processes, the second all-reduce never returned) showed this until
//! it was removed with the burn-collective dev-dependency, which every build of an example or
//! test compiled (axum, tungstenite and their tree); it is in the git history.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytemuck::Pod;

use super::element::{Element, Reducible};
use super::engine::TcpEngine;
use super::engine::{self, Engine, Lane};
use super::error::DistributedError;
use super::process_state::ProcessState;

/// How a reducing collective combines the processes' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// The sum over processes.
    Sum,
    /// The mean over processes (the sum divided by their number, in the values' own type:
    /// integers divide as integers do).
    Mean,
}

/// The collectives of this process's run; a cheap handle, the same for every caller.
///
/// Every collective carries any size: values travel in pieces of a megabyte, so a buffer of
/// gigabytes needs no more memory than itself, and an all-reduce runs in place.
///
/// ```
/// use burn_accelerate::distributed::{ProcessState, ReduceOp};
///
/// let state = ProcessState::from_env()?; // one process here
/// let group = state.group()?;
/// let mut values = vec![1.0f32, 2.0];
/// group.all_reduce(&mut values, ReduceOp::Mean)?; // the mean over every process
/// assert_eq!(values, [1.0, 2.0]);
/// let everyone: Vec<u32> = group.all_gather(&[group.rank() as u32])?; // [0, 1, …] in rank order
/// assert_eq!(everyone, [0]);
/// group.barrier()?;
/// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

struct Inner {
    rank: usize,
    world_size: usize,
    /// `None` for a single process.
    engine: Option<Box<dyn Engine>>,
    // Serialises this process's collectives and numbers them; set once one fails.
    sequence: Mutex<Result<u64, DistributedError>>,
    // The lane the next stream gets (lane 0 is the collectives').
    next_lane: AtomicU32,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .finish_non_exhaustive()
    }
}

// The process's group, once joined (a failed join may be retried).
static JOINED: OnceLock<Mutex<Option<ProcessGroup>>> = OnceLock::new();

impl ProcessState {
    /// The process group of this run, joined on the first call (the rendezvous waits for
    /// every process); the same group afterwards.
    ///
    /// # Errors
    /// What joining can fail with: a rendezvous that times out or refuses this process, a
    /// port that is taken; [`DistributedError::AlreadyJoined`] for another layout than the
    /// one joined before.
    pub fn group(&self) -> Result<ProcessGroup, DistributedError> {
        ProcessGroup::join(self)
    }
}

impl ProcessGroup {
    /// This process's group for `state`: joined on the first call, the same afterwards.
    fn join(state: &ProcessState) -> Result<Self, DistributedError> {
        let mut joined = JOINED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (rank, world) = (state.process_index(), state.num_processes());
        if let Some(group) = &*joined {
            let inner = &group.inner;
            return if (inner.rank, inner.world_size) == (rank, world) {
                Ok(group.clone())
            } else {
                Err(DistributedError::AlreadyJoined {
                    joined_rank: inner.rank,
                    joined_world: inner.world_size,
                    rank,
                    world,
                })
            };
        }
        if let Some(line) = state.engine_line().filter(|_| state.is_main_process()) {
            eprintln!("{line}");
        }
        let engine: Option<Box<dyn Engine>> = match state.rendezvous() {
            _ if state.over_mpi() => Some(mpi_engine(rank, world)?),
            Some(rendezvous) => Some(Box::new(TcpEngine::join(rank, world, rendezvous)?)),
            None => None,
        };
        let group = Self {
            inner: Arc::new(Inner {
                rank,
                world_size: world,
                engine,
                sequence: Mutex::new(Ok(1)),
                next_lane: AtomicU32::new(1),
            }),
        };
        *joined = Some(group.clone());
        Ok(group)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// Replaces `values` on every process by their sum or mean over all processes, computed
    /// in `T` (f32, f64, f16, bf16 or an integer type), in place; every process ends with the
    /// same bits. Every process must call it, in the same order as its other collectives,
    /// with as many values.
    ///
    /// Memory: none beyond `values` but the connections' pieces (a few megabytes), whatever
    /// the size.
    ///
    /// # Errors
    /// [`DistributedError::PeerExited`], [`DistributedError::PeerClosed`] or
    /// [`DistributedError::ConnectionFailed`] when a process left or its connection broke,
    /// [`DistributedError::Timeout`] when one did not come in time,
    /// [`DistributedError::Mismatch`] for processes calling different collectives or with
    /// other lengths, [`DistributedError::Broken`] after any earlier failure.
    pub fn all_reduce<T: Reducible>(
        &self,
        values: &mut [T],
        op: ReduceOp,
    ) -> Result<(), DistributedError> {
        self.all_reduce_bytes(T::ELEMENT, bytemuck::cast_slice_mut(values), op)
    }

    /// [`all_reduce`](Self::all_reduce) of bytes holding values of `element`.
    pub(crate) fn all_reduce_bytes(
        &self,
        element: Element,
        bytes: &mut [u8],
        op: ReduceOp,
    ) -> Result<(), DistributedError> {
        self.collective(|engine, seq| engine.all_reduce(seq, element, bytes))?;
        if op == ReduceOp::Mean && self.world_size() > 1 {
            element.divide(bytes, self.world_size());
        }
        Ok(())
    }

    /// Sums (or averages) `values` over the processes and leaves each process its own slice
    /// of the result: process `r` gets the `counts[r]` values after the first
    /// `counts[..r].sum()` (MPI's `MPI_Reduce_scatter`, with its per-process counts, so that
    /// slices may differ in size; [`shard_counts`] gives torch's even split, with a shorter
    /// last slice and no padding). Returns that slice of `values`; the rest of `values` is
    /// left as scratch. Every process passes the same `counts`.
    ///
    /// ```
    /// use burn_accelerate::distributed::{ProcessState, ReduceOp, shard_counts};
    ///
    /// let group = ProcessState::single().group()?;
    /// let mut grads = vec![1.0f32, 2.0, 3.0];
    /// let counts = shard_counts(grads.len(), group.world_size()); // [3] for one process
    /// let mine = group.reduce_scatter(&mut grads, &counts, ReduceOp::Mean)?;
    /// assert_eq!(mine, [1.0, 2.0, 3.0]);
    /// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
    /// ```
    ///
    /// # Errors
    /// [`DistributedError::InvalidCall`] when `counts` does not have a count per process
    /// summing to `values.len()`; otherwise as [`all_reduce`](Self::all_reduce).
    pub fn reduce_scatter<'a, T: Reducible>(
        &self,
        values: &'a mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<&'a mut [T], DistributedError> {
        let size = size_of::<T>();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(values);
        let mine = self.reduce_scatter_bytes(T::ELEMENT, bytes, counts, op)?;
        Ok(&mut values[mine.start / size..mine.end / size])
    }

    /// [`reduce_scatter`](Self::reduce_scatter) of bytes holding values of `element`
    /// (`counts` in values); returns this process's bytes.
    pub(crate) fn reduce_scatter_bytes(
        &self,
        element: Element,
        bytes: &mut [u8],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Range<usize>, DistributedError> {
        let size = element.size();
        self.check_counts(counts, bytes.len() / size, "reduce_scatter")?;
        let blocks = engine::blocks(counts.iter().copied(), size);
        let mine = blocks[self.rank()].clone();
        self.collective(|engine, seq| engine.reduce_scatter(seq, element, bytes, &blocks))?;
        if op == ReduceOp::Mean && self.world_size() > 1 {
            element.divide(&mut bytes[mine.clone()], self.world_size());
        }
        Ok(mine)
    }

    /// Every process's `values`, concatenated in rank order, on every process (MPI's
    /// `MPI_Allgatherv`: the processes may pass different lengths). Exact for any `T`.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_gather<T: Pod>(&self, values: &[T]) -> Result<Vec<T>, DistributedError> {
        let counts = self.counts(values.len())?;
        let mut gathered = gather_buffer::<T>(&counts)?;
        let own = engine::blocks(counts.iter().copied(), 1)[self.rank()].clone();
        gathered[own].copy_from_slice(values);
        self.all_gather_in_place(&mut gathered, &counts)?;
        Ok(gathered)
    }

    /// [`all_gather`](Self::all_gather) into a buffer laid out in advance: `buffer` holds
    /// `counts[r]` values for each process `r` in rank order, this process's already in
    /// place; afterwards every slot holds its process's values. Every process passes the same
    /// `counts` (what sharded training knows: each parameter's owner and size).
    ///
    /// # Errors
    /// [`DistributedError::InvalidCall`] when `counts` does not have a count per process
    /// summing to `buffer.len()`; otherwise as [`all_reduce`](Self::all_reduce).
    pub fn all_gather_in_place<T: Pod>(
        &self,
        buffer: &mut [T],
        counts: &[usize],
    ) -> Result<(), DistributedError> {
        self.check_counts(counts, buffer.len(), "all_gather_in_place")?;
        let blocks = engine::blocks(counts.iter().copied(), size_of::<T>());
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buffer);
        self.collective(|engine, seq| engine.all_gather(seq, bytes, &blocks))
    }

    /// Waits until every process calls it (Accelerate's `wait_for_everyone`).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn barrier(&self) -> Result<(), DistributedError> {
        self.all_reduce::<u8>(&mut [], ReduceOp::Sum)
    }

    /// Every process's count, in rank order (an all-gather of one value each).
    pub(crate) fn counts(&self, own: usize) -> Result<Vec<usize>, DistributedError> {
        let n = self.world_size();
        let mut counts = vec![0u64; n];
        counts[self.rank()] = own as u64;
        self.all_gather_in_place(&mut counts, &vec![1; n])?;
        Ok(counts.into_iter().map(|c| c as usize).collect())
    }

    /// Process `root`'s `bytes` on every process (the others' are replaced).
    pub(crate) fn broadcast_bytes(
        &self,
        root: usize,
        bytes: Vec<u8>,
    ) -> Result<Vec<u8>, DistributedError> {
        let n = self.world_size();
        if root >= n {
            return Err(DistributedError::InvalidCall(format!(
                "broadcast from process {root}, but there are {n} (ranks 0..{n})"
            )));
        }
        let mut bytes = bytes;
        self.collective(|engine, seq| engine.broadcast(seq, root, &mut bytes))?;
        Ok(bytes)
    }

    // Checks that `counts` has a count per process summing to `len`.
    fn check_counts(
        &self,
        counts: &[usize],
        len: usize,
        call: &str,
    ) -> Result<(), DistributedError> {
        let n = self.world_size();
        let total = counts.iter().try_fold(0usize, |sum, c| sum.checked_add(*c));
        if counts.len() != n || total != Some(len) {
            return Err(DistributedError::InvalidCall(format!(
                "{call}: counts {counts:?} must have one count per process ({n}) summing to \
                 the buffer's length ({len})"
            )));
        }
        Ok(())
    }

    /// Breaks this process's group with `err`, as a failed collective does: its next
    /// collective returns it ([`DistributedError::Broken`]). For a failure found where nothing
    /// can return it (a dispatching loader's receiver, inside Burn's batch iterator). The
    /// first failure stays.
    pub(crate) fn break_with(&self, err: DistributedError) {
        let mut sequence = self
            .inner
            .sequence
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sequence.is_ok() {
            *sequence = Err(err);
        }
    }

    /// Ends the run's collectives on every process: this process failed where the others
    /// must not go on (a panic while they wait for its work). Nothing for one process.
    pub(crate) fn abort(&self, reason: String) {
        if let Some(engine) = &self.inner.engine {
            engine.abort(reason);
        }
    }

    /// A new stream of point-to-point messages, ordered apart from the collectives (whose
    /// order every process shares) and from other streams. Every process must open its streams
    /// in the same order: the n-th stream of each process talks to the n-th of the others.
    pub(crate) fn stream(&self) -> Stream {
        Stream {
            group: self.clone(),
            lane: self.inner.next_lane.fetch_add(1, Ordering::SeqCst),
        }
    }

    // Runs the next collective (nothing to do for one process), or reports the failure that
    // broke the group; a failure breaks it.
    fn collective(
        &self,
        run: impl FnOnce(&dyn Engine, u64) -> Result<(), DistributedError>,
    ) -> Result<(), DistributedError> {
        let Some(engine) = &self.inner.engine else {
            return Ok(());
        };
        let mut sequence = self
            .inner
            .sequence
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seq = match &*sequence {
            Ok(seq) => *seq,
            Err(err) => return Err(DistributedError::Broken(err.to_string())),
        };
        let outcome = run(engine.as_ref(), seq);
        *sequence = match &outcome {
            Ok(()) => Ok(seq + 1),
            Err(err) => Err(err.clone()),
        };
        outcome
    }
}

// The MPI engine; `ProcessState` never asks for it in a build without it.
fn mpi_engine(rank: usize, world: usize) -> Result<Box<dyn Engine>, DistributedError> {
    #[cfg(feature = "mpi")]
    {
        Ok(Box::new(super::engine::MpiEngine::join(rank, world)?))
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = (rank, world);
        Err(DistributedError::MpiNotBuilt {
            launcher: super::env::OMPI_SIZE,
        })
    }
}

/// The per-process counts of `len` values split as torch splits a tensor into `n` shards:
/// `len.div_ceil(n)` values each, the last ones shorter (or empty) where `len` does not
/// divide. For [`ProcessGroup::reduce_scatter`] and
/// [`ProcessGroup::all_gather_in_place`].
///
/// ```
/// use burn_accelerate::distributed::shard_counts;
/// assert_eq!(shard_counts(10, 4), [3, 3, 3, 1]);
/// assert_eq!(shard_counts(2, 4), [1, 1, 0, 0]);
/// ```
pub fn shard_counts(len: usize, n: usize) -> Vec<usize> {
    let each = len.div_ceil(n.max(1));
    (0..n)
        .map(|r| len.saturating_sub(r * each).min(each))
        .collect()
}

/// Point-to-point messages between processes on a lane of their own (see
/// [`ProcessGroup::stream`]): each carries a tag (`seq`, `step`) the receiver checks, in the
/// order it was sent. Every wait has the run's timeout.
pub(crate) struct Stream {
    group: ProcessGroup,
    lane: Lane,
}

impl Stream {
    /// The group this stream belongs to.
    pub(crate) fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Sends `payload` to process `to`, tagged `(seq, step)`.
    pub(crate) fn send(
        &self,
        to: usize,
        seq: u64,
        step: u32,
        payload: &[u8],
    ) -> Result<(), DistributedError> {
        match &self.group.inner.engine {
            Some(engine) => engine.send(self.lane, to, (seq, step), payload),
            None => Ok(()),
        }
    }

    /// The next message from process `from`, with its tag `(seq, step)`.
    pub(crate) fn recv(&self, from: usize) -> Result<(u64, u32, Vec<u8>), DistributedError> {
        let Some(engine) = &self.group.inner.engine else {
            return Err(DistributedError::InvalidCall(
                "a stream of a single process has nobody to receive from".into(),
            ));
        };
        let ((seq, step), payload) = engine.recv(self.lane, from)?;
        Ok((seq, step, payload))
    }
}

/// A zeroed buffer for `counts[r]` values of `T` from each process `r`: the counts other
/// processes claim (issue 49). A claim that no buffer can hold, alone or summed with the
/// others', is an error naming the process that made it, not an overflow or an abort.
pub(crate) fn gather_buffer<T: Pod>(counts: &[usize]) -> Result<Vec<T>, DistributedError> {
    let most = isize::MAX as usize / size_of::<T>().max(1);
    let mut total = 0usize;
    for (rank, &count) in counts.iter().enumerate() {
        total = total
            .checked_add(count)
            .filter(|&total| total <= most)
            .ok_or_else(|| DistributedError::Malformed {
                rank,
                detail: format!(
                    "it claims {count} values to gather, more than a buffer can hold with the \
                     other processes' {total}"
                ),
            })?;
    }
    let mut buffer = Vec::new();
    buffer
        .try_reserve_exact(total)
        .map_err(|e| DistributedError::Io {
            what: format!("a buffer for the {total} values the processes gather"),
            reason: e.to_string(),
        })?;
    buffer.resize(total, T::zeroed());
    Ok(buffer)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Issue 49: the counts another process claims for a gather, summed and allocated.
    #[test]
    fn a_gather_claim_no_buffer_holds_is_an_error_naming_the_process() {
        assert_eq!(gather_buffer::<u32>(&[2, 0, 3]).unwrap(), vec![0; 5]);
        for (counts, rank) in [
            (vec![5, usize::MAX], 1),
            (vec![usize::MAX / 16, 1, usize::MAX / 8], 2),
            (vec![1 << 62, 1], 0),
        ] {
            let err = gather_buffer::<f32>(&counts).unwrap_err();
            assert!(
                matches!(&err, DistributedError::Malformed { rank: r, .. } if *r == rank),
                "{counts:?}: {err}"
            );
        }
    }

    #[test]
    fn shard_counts_split_like_torch_and_sum_to_the_length() {
        assert_eq!(shard_counts(12, 4), [3, 3, 3, 3]);
        assert_eq!(shard_counts(13, 4), [4, 4, 4, 1]);
        assert_eq!(shard_counts(0, 3), [0, 0, 0]);
        for len in 0..40 {
            for n in 1..7 {
                assert_eq!(shard_counts(len, n).iter().sum::<usize>(), len);
            }
        }
    }

    #[test]
    fn a_single_process_group_returns_its_input_and_checks_its_arguments() {
        let group = ProcessState::single().group().unwrap();
        let mut values = vec![1i64, 2, 3];
        group.all_reduce(&mut values, ReduceOp::Mean).unwrap();
        assert_eq!(values, [1, 2, 3]);
        assert_eq!(group.all_gather(&values).unwrap(), values);
        let mine = group
            .reduce_scatter(&mut values, &[3], ReduceOp::Sum)
            .unwrap();
        assert_eq!(mine, [1, 2, 3]);
        let err = group
            .reduce_scatter(&mut values, &[2], ReduceOp::Sum)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("summing to the buffer's length (3)"),
            "{err}"
        );
        let err = group.all_gather_in_place(&mut values, &[1, 2]).unwrap_err();
        assert!(
            err.to_string().contains("one count per process (1)"),
            "{err}"
        );
        let err = group.broadcast_bytes(1, vec![]).unwrap_err();
        assert!(err.to_string().contains("there are 1"), "{err}");
        assert_eq!(group.broadcast_bytes(0, vec![5]).unwrap(), [5]);
        assert!(group.stream().recv(0).is_err());
    }
}
