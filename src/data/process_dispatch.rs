//! `dispatch_batches` across processes: process 0 alone reads the dataset, one global step
//! at a time, and sends every other process its slice of the step (Accelerate's
//! `DataLoaderDispatcher`, which broadcasts from process 0); the others only receive.
//!
//! The slices are the [`Sharding::Dispatch`](super::shard::Sharding::Dispatch) batches of
//! every process's [`ShardPlan`](super::shard::ShardPlan), tail rules included, read by the
//! same [`IndexedSource`] the shards of one process share. Items travel as MessagePack, so a
//! label or a mask arrives exactly as it left. They go over a stream of their own (see
//! [`ProcessGroup`](crate::distributed::ProcessGroup)): the loader's prefetch threads read
//! ahead without getting in the way of the training's collectives.
//!
//! Each message is tagged with its epoch and step; a receiver keeps the steps that arrive
//! before its prefetch threads ask for them. Burn's data loader iterator has no error
//! channel, so a failure on the stream ends the loader's epoch there, and every later one at
//! once, without a panic: process 0 exiting, closing its connection or falling silent (every
//! wait has the run's timeout), a batch that does not decode (process 0's items are of
//! another type, or the bytes were changed), or, on process 0, a receiver it cannot send to.
//! The reason ([`DistributedError::Dispatch`], naming the process) breaks the process group,
//! so that the next collective (the gradients' all-reduce in `optimizer_step`,
//! `wait_for_everyone`) returns it as an error.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::dispatch::{Dispatch, StepSource};
use super::epoch::EpochKey;
use crate::distributed::{DistributedError, Stream};

/// A dispatched shard of one process of a run, over the steps of `S`.
pub(crate) struct ProcessDispatch<S: StepSource> {
    stream: Stream,
    role: Role<S>,
    /// The stream failed: nothing more is sent or read (a receiver no longer knows that the
    /// stream's next bytes start a batch), and every epoch ends at once.
    ended: AtomicBool,
}

enum Role<S: StepSource> {
    /// Process 0: reads every step and sends the others their slices.
    Reader {
        source: S,
        reading: Mutex<Option<Reading<S>>>,
    },
    /// Every other process: receives, keeping the steps that arrive before they are asked
    /// for (by epoch number and step).
    Receiver {
        kept: Mutex<BTreeMap<(u64, usize), S::Slice>>,
    },
}

/// Process 0's reading of one epoch.
struct Reading<S: StepSource> {
    key: EpochKey,
    cursor: S::Cursor,
    /// The first step not read yet.
    next_step: usize,
    /// Its own slices, read (and sent) ahead of its asking for them.
    kept: BTreeMap<usize, S::Slice>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain buffers: a panic elsewhere leaves them usable.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<S> ProcessDispatch<S>
where
    S: StepSource,
    S::Slice: Serialize + DeserializeOwned,
{
    /// The dispatch of process `process` over `stream`, reading from `source` on process 0.
    pub(crate) fn new(stream: Stream, process: usize, source: S) -> Self {
        let role = if process == 0 {
            Role::Reader {
                source,
                reading: Mutex::new(None),
            }
        } else {
            Role::Receiver {
                kept: Mutex::new(BTreeMap::new()),
            }
        };
        Self {
            stream,
            role,
            ended: AtomicBool::new(false),
        }
    }

    // Ends this epoch and every later one, and breaks the process group with `reason`, which
    // its next collective returns: Burn's loader iterator has no error channel.
    fn end(&self, reason: DistributedError) -> Option<S::Slice> {
        let err = DistributedError::Dispatch {
            reason: Box::new(reason),
        };
        log::error!("burn-accelerate: {err}");
        self.ended.store(true, Ordering::Relaxed);
        self.stream.group().break_with(err);
        None
    }

    // Process 0: reads steps up to `to`, sends the others their slices, keeps its own.
    fn read(
        &self,
        source: &S,
        reading: &mut Reading<S>,
        epoch: &S::Epoch,
        to: usize,
    ) -> Result<(), DistributedError> {
        let processes: Vec<usize> = (0..self.stream.group().world_size()).collect();
        for step in reading.next_step..=to {
            let mut slices = source
                .read_step(&mut reading.cursor, epoch, step, &processes)
                .into_iter();
            let own = slices
                .next()
                .expect("read_step returns a slice per process");
            for (process, slice) in slices.enumerate() {
                let bytes = rmp_serde::to_vec(&slice).unwrap_or_else(|e| {
                    panic!("burn-accelerate: dispatch_batches: an item cannot be sent: {e}")
                });
                self.stream
                    .send(process + 1, reading.key.0, step as u32, &bytes)?;
            }
            reading.kept.insert(step, own);
        }
        reading.next_step = reading.next_step.max(to + 1);
        Ok(())
    }
}

impl<S> Dispatch<S::Epoch, S::Slice> for ProcessDispatch<S>
where
    S: StepSource,
    S::Slice: Serialize + DeserializeOwned,
{
    fn take(
        &self,
        _process: usize,
        epoch: &S::Epoch,
        step: usize,
        first_step: usize,
    ) -> Option<S::Slice> {
        if self.ended.load(Ordering::Relaxed) {
            return None;
        }
        match &self.role {
            Role::Reader { source, reading } => {
                let mut reading = lock(reading);
                let key = S::key(epoch);
                // A new epoch, or the epoch started again at an earlier step (a new iterator):
                // the others start again too, and need the steps again.
                let restart = match &*reading {
                    None => true,
                    Some(r) => r.key != key || (step < r.next_step && !r.kept.contains_key(&step)),
                };
                if restart {
                    let from = if reading.as_ref().is_some_and(|r| r.key == key) {
                        step
                    } else {
                        first_step.min(step)
                    };
                    *reading = Some(Reading {
                        key,
                        cursor: source.open(epoch, from),
                        next_step: from,
                        kept: BTreeMap::new(),
                    });
                }
                let reading = reading.as_mut().expect("set above");
                if let Some(slice) = reading.kept.remove(&step) {
                    return Some(slice);
                }
                let to = source.read_to(epoch, step);
                if let Err(err) = self.read(source, reading, epoch, to) {
                    return self.end(err);
                }
                Some(reading.kept.remove(&step).expect("the step was just read"))
            }
            Role::Receiver { kept } => {
                let mut kept = lock(kept);
                let wanted = (S::key(epoch).0, step);
                loop {
                    // Another prefetch thread ended the stream while this one waited.
                    if self.ended.load(Ordering::Relaxed) {
                        return None;
                    }
                    if let Some(slice) = kept.remove(&wanted) {
                        return Some(slice);
                    }
                    let (epoch_number, got_step, bytes) = match self.stream.recv(0) {
                        Ok(message) => message,
                        Err(err) => return self.end(err),
                    };
                    let slice: S::Slice = match rmp_serde::from_slice(&bytes) {
                        Ok(slice) => slice,
                        Err(e) => {
                            return self.end(DistributedError::Malformed {
                                rank: 0,
                                detail: format!(
                                    "the batch it dispatched for epoch {epoch_number}, step \
                                     {got_step} ({} bytes) is not this loader's items ({e}); \
                                     every process must build its dispatch_batches loader \
                                     over items of the same type",
                                    bytes.len()
                                ),
                            });
                        }
                    };
                    // Steps of epochs before the one asked for will not be asked again.
                    kept.retain(|(e, _), _| *e >= wanted.0);
                    if epoch_number >= wanted.0 {
                        kept.insert((epoch_number, got_step as usize), slice);
                    }
                }
            }
        }
    }

    fn leave(&self, _process: usize, key: EpochKey) {
        if let Role::Reader { reading, .. } = &self.role {
            let mut reading = lock(reading);
            if let Some(r) = reading.as_mut().filter(|r| r.key == key) {
                r.kept.clear();
            }
        }
    }
}
