//! Preparing batches ahead of the consumer on background threads (`num_workers`,
//! `non_blocking`, `prefetch`).
//!
//! Worker `w` of `n` prepares batches `start + w`, `start + w + n`, ... and hands them over
//! through its own bounded channel; the consumer takes batch `b` from worker `(b - start) % n`.
//! Batches therefore arrive in order with no reordering buffer, and each worker is at most
//! `depth` batches ahead: a rendezvous channel of capacity `depth - 1` plus the one batch a
//! worker holds while it waits to hand it over.
//!
//! Dropping the pipeline (an epoch broken off early) raises a stop flag, drops the receivers
//! (which wakes any worker blocked on a full channel) and joins every worker, so no thread
//! outlives the iterator.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// The two halves of making a batch, so the pipeline can run either half on a worker.
pub(crate) trait Produce: Send + Sync + 'static {
    /// What reading yields (the items of a batch).
    type Items: Send + 'static;
    /// The finished batch.
    type Batch: Send + 'static;
    /// Reads batch `index`'s items.
    fn read(&self, index: usize) -> Self::Items;
    /// Turns items into the batch, on the target device.
    fn batch(&self, items: Self::Items) -> Self::Batch;
}

/// Where each half of a batch is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Threading {
    /// Background threads; 0 prepares everything in the consumer's thread.
    pub(crate) workers: usize,
    /// Batches each worker may have ready ahead (at least 1 when `workers > 0`).
    pub(crate) depth: usize,
    /// Whether workers also batch (on the device), or only read.
    pub(crate) batch_in_worker: bool,
}

enum Prepared<P: Produce> {
    Items(P::Items),
    Batch(P::Batch),
}

struct Lane<P: Produce> {
    receiver: Receiver<Prepared<P>>,
    handle: Option<JoinHandle<()>>,
}

/// Yields batches `start..end` of a producer, in order.
pub(crate) struct Pipeline<P: Produce> {
    producer: Arc<P>,
    next: usize,
    start: usize,
    end: usize,
    lanes: Vec<Lane<P>>,
    stop: Arc<AtomicBool>,
}

impl<P: Produce> Pipeline<P> {
    pub(crate) fn new(producer: Arc<P>, start: usize, end: usize, threading: Threading) -> Self {
        let mut pipeline = Self {
            producer,
            next: start,
            start,
            end,
            lanes: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
        };
        // No thread is worth starting for an epoch with nothing left to prepare.
        let workers = threading.workers.min(end.saturating_sub(start));
        for w in 0..workers {
            let (sender, receiver) = sync_channel(threading.depth.saturating_sub(1));
            match pipeline.spawn(w, workers, sender, threading.batch_in_worker) {
                Ok(handle) => pipeline.lanes.push(Lane {
                    receiver,
                    handle: Some(handle),
                }),
                Err(err) => {
                    // Correctness does not need the threads: fall back to preparing inline.
                    log::warn!(
                        "burn-accelerate: cannot start a data loader thread ({err}); preparing \
                         batches in the iterating thread instead"
                    );
                    pipeline.shutdown();
                    break;
                }
            }
        }
        pipeline
    }

    fn spawn(
        &self,
        worker: usize,
        workers: usize,
        sender: SyncSender<Prepared<P>>,
        batch_in_worker: bool,
    ) -> std::io::Result<JoinHandle<()>> {
        let producer = Arc::clone(&self.producer);
        let stop = Arc::clone(&self.stop);
        let (first, end) = (self.start + worker, self.end);
        std::thread::Builder::new()
            .name(format!("shard-loader-{worker}"))
            .spawn(move || {
                for index in (first..end).step_by(workers) {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let items = producer.read(index);
                    let prepared = if batch_in_worker {
                        Prepared::Batch(producer.batch(items))
                    } else {
                        Prepared::Items(items)
                    };
                    if sender.send(prepared).is_err() {
                        return; // The iterator is gone.
                    }
                }
            })
    }

    /// Index of the batch the next call to `next` yields.
    pub(crate) fn position(&self) -> usize {
        self.next
    }

    /// Stops and joins every worker; what they prepared is dropped. Idempotent.
    pub(crate) fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let lanes = std::mem::take(&mut self.lanes);
        let handles: Vec<_> = lanes
            .into_iter()
            .filter_map(|lane| {
                drop(lane.receiver); // Wakes a worker blocked on a full channel.
                lane.handle
            })
            .collect();
        for handle in handles {
            if handle.join().is_err() {
                log::error!("burn-accelerate: a data loader thread panicked while shutting down");
            }
        }
    }
}

impl<P: Produce> Iterator for Pipeline<P> {
    type Item = P::Batch;

    fn next(&mut self) -> Option<P::Batch> {
        if self.next >= self.end {
            self.shutdown();
            return None;
        }
        let index = self.next;
        if self.lanes.is_empty() {
            self.next += 1;
            let items = self.producer.read(index);
            return Some(self.producer.batch(items));
        }
        let lane = (index - self.start) % self.lanes.len();
        match self.lanes[lane].receiver.recv() {
            Ok(prepared) => {
                self.next += 1;
                Some(match prepared {
                    Prepared::Batch(batch) => batch,
                    Prepared::Items(items) => self.producer.batch(items),
                })
            }
            Err(_) => {
                // The worker ended without this batch: it panicked (in the dataset or the
                // batcher, i.e. user code). Surface that panic here, where it would have
                // happened without a worker.
                let handle = self.lanes[lane].handle.take();
                self.shutdown();
                if let Some(Err(payload)) = handle.map(JoinHandle::join) {
                    std::panic::resume_unwind(payload);
                }
                self.next = self.end;
                None
            }
        }
    }
}

impl<P: Produce> Drop for Pipeline<P> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Records how far ahead the workers got and how many threads are alive.
    #[derive(Default)]
    struct Probe {
        read: AtomicUsize,
        alive: AtomicUsize,
        panic_at: Option<usize>,
    }

    struct Alive<'a>(&'a AtomicUsize);
    impl Drop for Alive<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Produce for Probe {
        type Items = usize;
        type Batch = (usize, Option<String>);
        fn read(&self, index: usize) -> usize {
            self.alive.fetch_add(1, Ordering::SeqCst);
            let _alive = Alive(&self.alive);
            assert_ne!(Some(index), self.panic_at, "dataset failure");
            self.read.fetch_add(1, Ordering::SeqCst);
            index
        }
        fn batch(&self, index: usize) -> (usize, Option<String>) {
            (index, std::thread::current().name().map(str::to_owned))
        }
    }

    fn threading(workers: usize, depth: usize, batch_in_worker: bool) -> Threading {
        Threading {
            workers,
            depth,
            batch_in_worker,
        }
    }

    #[test]
    fn every_mode_yields_the_batches_in_order() {
        for t in [
            threading(0, 1, false),
            threading(1, 1, true),
            threading(2, 3, false),
            threading(3, 2, true),
            threading(8, 1, true),
        ] {
            let pipeline = Pipeline::new(Arc::new(Probe::default()), 3, 20, t);
            let got: Vec<usize> = pipeline.map(|(i, _)| i).collect();
            assert_eq!(got, (3..20).collect::<Vec<_>>(), "{t:?}");
        }
    }

    #[test]
    fn batching_runs_where_configured() {
        let on_worker = Pipeline::new(Arc::new(Probe::default()), 0, 4, threading(1, 2, true))
            .all(|(_, name)| name.as_deref() == Some("shard-loader-0"));
        assert!(on_worker);
        let here = std::thread::current().name().map(str::to_owned);
        let on_consumer = Pipeline::new(Arc::new(Probe::default()), 0, 4, threading(2, 2, false))
            .all(|(_, name)| name == here);
        assert!(on_consumer);
    }

    #[test]
    fn workers_stay_within_the_prefetch_depth() {
        // Waits (without timing) until the worker has filled its window, then checks it
        // went no further: it cannot read a fifth batch before the consumer takes one.
        let probe = Arc::new(Probe::default());
        let mut pipeline = Pipeline::new(probe.clone(), 0, 100, threading(1, 3, true));
        assert_eq!(pipeline.next().map(|b| b.0), Some(0));
        while probe.read.load(Ordering::SeqCst) < 4 {
            std::thread::yield_now();
        }
        // One taken, three ready (two queued, one in hand): never more.
        std::thread::yield_now();
        assert_eq!(probe.read.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn dropping_early_joins_every_worker() {
        let probe = Arc::new(Probe::default());
        let mut pipeline = Pipeline::new(probe.clone(), 0, 1000, threading(4, 1, true));
        assert_eq!(pipeline.next().map(|b| b.0), Some(0));
        drop(pipeline);
        let read = probe.read.load(Ordering::SeqCst);
        assert_eq!(probe.alive.load(Ordering::SeqCst), 0);
        assert!(read < 1000);
        // Only the test's own reference is left: every worker has exited.
        assert_eq!(Arc::strong_count(&probe), 1);
    }

    #[test]
    fn a_worker_panic_reaches_the_consumer() {
        let probe = Probe {
            panic_at: Some(3),
            ..Probe::default()
        };
        let mut pipeline = Pipeline::new(Arc::new(probe), 0, 10, threading(2, 1, true));
        for i in 0..3 {
            assert_eq!(pipeline.next().map(|b| b.0), Some(i));
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pipeline.next()));
        assert!(caught.is_err());
    }
}
