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
//! before its prefetch threads ask for them. A process that left fails the others' next
//! batch with the reason (a panic in the loader: Burn's data loader iterator has no error
//! channel), and a stuck one times out.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::dispatch::{Dispatch, IndexedSource, StepSource};
use super::epoch::{Epoch, EpochKey};
use crate::distributed::{DistributedError, Stream};

/// A dispatched shard of one process of a run.
pub(crate) struct ProcessDispatch<I> {
    stream: Stream,
    role: Role<I>,
}

enum Role<I> {
    /// Process 0: reads every step and sends the others their slices.
    Reader {
        source: IndexedSource<I>,
        /// The most steps any process's plan has.
        steps: usize,
        reading: Mutex<Reading<I>>,
    },
    /// Every other process: receives.
    Receiver {
        kept: Mutex<BTreeMap<(u64, usize), Vec<I>>>,
    },
}

/// Process 0's reading of one epoch.
struct Reading<I> {
    key: Option<EpochKey>,
    /// The first step not read yet.
    next_step: usize,
    /// Its own slices, read (and sent) ahead of its asking for them.
    kept: BTreeMap<usize, Vec<I>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Plain buffers: a panic elsewhere leaves them usable.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

// Burn's loader iterator has no error channel: the loader stops the run with the reason.
fn fail(err: DistributedError) -> ! {
    panic!("burn-accelerate: dispatch_batches across processes: {err}")
}

impl<I> ProcessDispatch<I>
where
    I: Serialize + DeserializeOwned + Clone + Send + Sync,
{
    /// The dispatch of process `process` over `stream`, reading from `source` on process 0.
    pub(crate) fn new(stream: Stream, process: usize, source: IndexedSource<I>) -> Self {
        let role = if process == 0 {
            Role::Reader {
                steps: source
                    .plans()
                    .iter()
                    .map(|p| p.num_batches())
                    .max()
                    .unwrap_or(0),
                source,
                reading: Mutex::new(Reading {
                    key: None,
                    next_step: 0,
                    kept: BTreeMap::new(),
                }),
            }
        } else {
            Role::Receiver {
                kept: Mutex::new(BTreeMap::new()),
            }
        };
        Self { stream, role }
    }

    // Process 0: reads steps `from..=to`, sends the others their slices, keeps its own.
    fn read(&self, source: &IndexedSource<I>, reading: &mut Reading<I>, epoch: &Epoch, to: usize) {
        let processes: Vec<usize> = (0..self.stream.group().world_size()).collect();
        for step in reading.next_step..=to {
            let mut slices = source
                .read_step(&mut (), epoch, step, &processes)
                .into_iter();
            let own = slices.next().unwrap_or_default();
            for (process, slice) in slices.enumerate() {
                let bytes = rmp_serde::to_vec(&slice).unwrap_or_else(|e| {
                    panic!("burn-accelerate: dispatch_batches: an item cannot be sent: {e}")
                });
                self.stream
                    .send(process + 1, epoch.key().0, step as u32, &bytes)
                    .unwrap_or_else(|err| fail(err));
            }
            reading.kept.insert(step, own);
        }
        reading.next_step = reading.next_step.max(to + 1);
    }
}

impl<I> Dispatch<I> for ProcessDispatch<I>
where
    I: Serialize + DeserializeOwned + Clone + Send + Sync,
{
    fn take(&self, _process: usize, epoch: &Epoch, step: usize, first_step: usize) -> Vec<I> {
        match &self.role {
            Role::Reader {
                source,
                steps,
                reading,
            } => {
                let mut reading = lock(reading);
                if reading.key != Some(epoch.key()) {
                    *reading = Reading {
                        key: Some(epoch.key()),
                        next_step: first_step.min(step),
                        kept: BTreeMap::new(),
                    };
                }
                if let Some(slice) = reading.kept.remove(&step) {
                    return slice;
                }
                if step < reading.next_step {
                    // The epoch started again (a new iterator at an earlier step): so do the
                    // others, and they need the steps again.
                    reading.kept.clear();
                    reading.next_step = step;
                }
                // Process 0's last batch reads to the end of the longest plan, so that no
                // process waits for a step nobody reads.
                let to = if step + 1 >= epoch.num_batches() {
                    step.max(steps.saturating_sub(1))
                } else {
                    step
                };
                self.read(source, &mut reading, epoch, to);
                reading.kept.remove(&step).unwrap_or_default()
            }
            Role::Receiver { kept } => {
                let mut kept = lock(kept);
                let wanted = (epoch.key().0, step);
                loop {
                    if let Some(slice) = kept.remove(&wanted) {
                        return slice;
                    }
                    let (epoch_number, got_step, bytes) =
                        self.stream.recv(0).unwrap_or_else(|err| fail(err));
                    let slice: Vec<I> = rmp_serde::from_slice(&bytes).unwrap_or_else(|e| {
                        fail(DistributedError::Mismatch {
                            rank: 0,
                            detail: format!("its items are not this loader's: {e}"),
                        })
                    });
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
        match &self.role {
            Role::Reader { reading, .. } => {
                let mut reading = lock(reading);
                if reading.key == Some(key) {
                    reading.kept.clear();
                }
            }
            Role::Receiver { .. } => {}
        }
    }
}
