//! Preparing batches ahead of the consumer on background threads (`num_workers`,
//! `non_blocking`, `prefetch`).
//!
//! Worker `w` of `n` prepares batches `start + w`, `start + w + n`, ... and hands them over
//! through its own bounded [`Handoff`]; the consumer takes batch `b` from worker
//! `(b - start) % n`. Batches therefore arrive in order with no reordering buffer, and each
//! worker is at most `depth` batches ahead (it waits for room *before* preparing the next).
//!
//! A full worker is woken only once its queue has drained to half (not after every batch
//! taken): on a busy machine every wake can cost a scheduler slice, and with this hysteresis
//! a worker prepares batches in bursts instead of one wake per batch. The consumer spins
//! briefly before it parks, since the next batch is often microseconds away.
//!
//! Dropping the pipeline (an epoch broken off early) raises a stop flag, closes the queues
//! (which wakes any worker waiting for room) and joins every worker, so no thread outlives
//! the iterator.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use burn::tensor::backend::Backend;

/// The two halves of making a batch, so the pipeline can run either half on a worker.
pub(crate) trait Produce: Send + Sync + 'static {
    /// What reading yields (the items of a batch).
    type Items: Send + 'static;
    /// The finished batch.
    type Batch: Send + 'static;
    /// Reads batch `index`'s items; `None` ends the epoch there (they cannot come: a
    /// dispatched batch that does not decode, whose reason the reader keeps).
    fn read(&self, index: usize) -> Option<Self::Items>;
    /// Turns items into the batch, on the target device.
    fn batch(&self, items: Self::Items) -> Self::Batch;
    /// Whether nothing comes after `items` (a stream's last step, or its end): a worker
    /// stops there instead of asking for batches that do not exist.
    fn ends(&self, _items: &Self::Items) -> bool {
        false
    }
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

impl Threading {
    /// The threads a loader configured by `config` uses: `non_blocking` without workers gets
    /// one, which also batches on the device, so the move happens ahead of the consumer.
    pub(crate) fn of(config: &super::config::DataLoaderConfig) -> Self {
        Self {
            workers: match (config.num_workers, config.non_blocking) {
                (0, true) => 1,
                (n, _) => n,
            },
            depth: config.prefetch,
            batch_in_worker: config.non_blocking,
        }
    }

    /// These settings for a loader whose batches are made on `device`: on a backend that
    /// queues each thread's device work on a stream of its own (cubecl's runtimes: wgpu,
    /// CUDA, ROCm, also under fusion), batches are made by the consumer's thread, and the
    /// workers only read items.
    ///
    /// cubecl 0.10 orders one thread's use of a buffer after the stream that allocated it,
    /// and gives memory a thread freed back to the stream that allocated it: a batch made on
    /// a worker, used and dropped by the consumer, lets the worker's next upload land in
    /// memory the consumer's queued kernels still read. Training on `non_blocking` batches
    /// on wgpu ended differently now and then (1 run in 8; a sync on the worker after each
    /// batch made it 8 in 16), and identically with batches made by the consumer.
    pub(crate) fn on_device<B: Backend>(self, device: &B::Device) -> Self {
        if !self.batch_in_worker || !B::name(device).contains("cubecl") {
            return self;
        }
        crate::warnings::once("non_blocking batches made by the consumer", (), || {
            log::info!(
                "non_blocking on {}: batches are made on the device by the iterating thread \
                 (cubecl's per-thread streams cannot hand device buffers between threads \
                 safely); workers still read items ahead",
                B::name(device)
            )
        });
        Self {
            batch_in_worker: false,
            workers: self.workers,
            depth: self.depth,
        }
    }
}

enum Prepared<P: Produce> {
    Items(P::Items),
    Batch(P::Batch),
}

struct Queue<T> {
    items: VecDeque<T>,
    /// The worker has nothing more to hand over (finished, stopped or panicked).
    done: bool,
    /// The consumer is gone; the worker should stop.
    closed: bool,
    consumer_waiting: bool,
    producer_waiting: bool,
}

/// A bounded single-producer, single-consumer queue with a low watermark for the producer.
pub(crate) struct Handoff<T> {
    queue: Mutex<Queue<T>>,
    ready: Condvar,
    room: Condvar,
    depth: usize,
    /// A waiting producer is woken once the queue is down to this many.
    low: usize,
    /// Items in the queue, readable without the lock (for spinning).
    pending: AtomicUsize,
    /// `done`, readable without the lock.
    finished: AtomicBool,
}

/// Spin rounds (1, 2, 4, ... 32 spins) then yields before a consumer parks.
const SPIN_STEPS: usize = 10;

impl<T> Handoff<T> {
    pub(crate) fn new(depth: usize) -> Self {
        let depth = depth.max(1);
        Self {
            queue: Mutex::new(Queue {
                items: VecDeque::with_capacity(depth),
                done: false,
                closed: false,
                consumer_waiting: false,
                producer_waiting: false,
            }),
            ready: Condvar::new(),
            room: Condvar::new(),
            depth,
            low: depth / 2,
            pending: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue<T>> {
        // Nothing panics while holding the lock; a poisoned queue is still consistent.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Producer: waits until there is room for one more. `false` once the consumer is gone.
    pub(crate) fn wait_for_room(&self) -> bool {
        let mut queue = self.lock();
        if queue.items.len() >= self.depth && !queue.closed {
            queue.producer_waiting = true;
            while queue.items.len() > self.low && !queue.closed {
                queue = self
                    .room
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            queue.producer_waiting = false;
        }
        !queue.closed
    }

    /// Producer: hands one over (after [`wait_for_room`](Self::wait_for_room)).
    pub(crate) fn push(&self, item: T) {
        let mut queue = self.lock();
        if queue.closed {
            return;
        }
        queue.items.push_back(item);
        self.pending.fetch_add(1, Ordering::Release);
        if queue.consumer_waiting {
            self.ready.notify_one();
        }
    }

    /// Producer: nothing more will come.
    pub(crate) fn finish(&self) {
        self.lock().done = true;
        self.finished.store(true, Ordering::Release);
        self.ready.notify_one();
    }

    /// Consumer: the next item, or `None` once the producer finished and all were taken.
    pub(crate) fn pop(&self) -> Option<T> {
        // A batch is often only microseconds away: spin, then yield, before parking, as
        // std's channels do, so a fast hand-over costs no wake-up.
        for step in 0..SPIN_STEPS {
            if self.pending.load(Ordering::Acquire) > 0 || self.finished.load(Ordering::Acquire) {
                break;
            }
            if step < 6 {
                for _ in 0..1 << step {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::yield_now();
            }
        }
        let mut queue = self.lock();
        loop {
            if let Some(item) = queue.items.pop_front() {
                self.pending.fetch_sub(1, Ordering::Release);
                if queue.producer_waiting && queue.items.len() <= self.low {
                    self.room.notify_one();
                }
                return Some(item);
            }
            if queue.done {
                return None;
            }
            queue.consumer_waiting = true;
            queue = self
                .ready
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
            queue.consumer_waiting = false;
        }
    }

    /// Consumer: gone; drops what is queued and releases a waiting producer.
    pub(crate) fn close(&self) {
        let items = {
            let mut queue = self.lock();
            queue.closed = true;
            self.pending.store(0, Ordering::Release);
            std::mem::take(&mut queue.items)
        };
        self.room.notify_one();
        drop(items); // Outside the lock: dropping batches may take a while.
    }
}

/// Marks the queue finished however the worker ends, unwinding included, so the consumer
/// never waits for a batch that will not come.
struct FinishOnDrop<T>(Arc<Handoff<T>>);

impl<T> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        self.0.finish();
    }
}

struct Lane<P: Produce> {
    queue: Arc<Handoff<Prepared<P>>>,
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
            let queue = Arc::new(Handoff::new(threading.depth));
            match pipeline.spawn(w, workers, Arc::clone(&queue), threading.batch_in_worker) {
                Ok(handle) => pipeline.lanes.push(Lane {
                    queue,
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
        queue: Arc<Handoff<Prepared<P>>>,
        batch_in_worker: bool,
    ) -> std::io::Result<JoinHandle<()>> {
        let producer = Arc::clone(&self.producer);
        let stop = Arc::clone(&self.stop);
        let (first, end) = (self.start + worker, self.end);
        std::thread::Builder::new()
            .name(format!("shard-loader-{worker}"))
            .spawn(move || {
                let _finish = FinishOnDrop(Arc::clone(&queue));
                for index in (first..end).step_by(workers) {
                    if stop.load(Ordering::Relaxed) || !queue.wait_for_room() {
                        return; // The iterator is gone.
                    }
                    let Some(items) = producer.read(index) else {
                        return; // The consumer ends the epoch where this batch was due.
                    };
                    let ends = producer.ends(&items);
                    queue.push(if batch_in_worker {
                        Prepared::Batch(producer.batch(items))
                    } else {
                        Prepared::Items(items)
                    });
                    if ends {
                        return;
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
        for lane in &lanes {
            lane.queue.close(); // Wakes a worker waiting for room.
        }
        for handle in lanes.into_iter().filter_map(|lane| lane.handle) {
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
            let Some(items) = self.producer.read(index) else {
                self.next = self.end;
                return None;
            };
            self.next += 1;
            return Some(self.producer.batch(items));
        }
        let lane = (index - self.start) % self.lanes.len();
        if let Some(prepared) = self.lanes[lane].queue.pop() {
            self.next += 1;
            return Some(match prepared {
                Prepared::Batch(batch) => batch,
                Prepared::Items(items) => self.producer.batch(items),
            });
        }
        // The worker ended without this batch: it panicked (in the dataset or the batcher,
        // i.e. user code), or its batch could not be read (`Produce::read`'s `None`). Surface
        // a panic here, where it would have happened without a worker.
        let handle = self.lanes[lane].handle.take();
        self.shutdown();
        if let Some(Err(payload)) = handle.map(JoinHandle::join) {
            std::panic::resume_unwind(payload);
        }
        self.next = self.end;
        None
    }
}

impl<P: Produce> Drop for Pipeline<P> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    /// Records how far ahead the workers got and how many threads are alive.
    #[derive(Default)]
    struct Probe {
        read: AtomicUsize,
        alive: AtomicUsize,
        panic_at: Option<usize>,
        /// The batch whose items cannot be read (`read`'s `None`).
        unread_at: Option<usize>,
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
        fn read(&self, index: usize) -> Option<usize> {
            self.alive.fetch_add(1, Ordering::SeqCst);
            let _alive = Alive(&self.alive);
            assert_ne!(Some(index), self.panic_at, "dataset failure");
            if self.unread_at.is_some_and(|at| index >= at) {
                return None;
            }
            self.read.fetch_add(1, Ordering::SeqCst);
            Some(index)
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

    /// Yields until `probe` has read `n` batches, then returns how many it has read. The
    /// bound only turns a hang into a failure; it is a count, not a time.
    fn reads_reach(probe: &Probe, n: usize) -> usize {
        for _ in 0..5_000_000 {
            if probe.read.load(Ordering::SeqCst) >= n {
                std::thread::yield_now();
                return probe.read.load(Ordering::SeqCst);
            }
            std::thread::yield_now();
        }
        panic!("the worker never read {n} batches");
    }

    #[test]
    fn workers_stay_within_the_prefetch_depth() {
        // A worker waits for room before reading, so with nothing taken it stops at `depth`.
        let probe = Arc::new(Probe::default());
        let pipeline = Pipeline::new(probe.clone(), 0, 100, threading(1, 3, true));
        assert_eq!(reads_reach(&probe, 3), 3);
        drop(pipeline);
    }

    #[test]
    fn a_full_worker_refills_only_once_drained_to_half() {
        // Depth 4: the worker waits once 4 are ready and resumes at 2 left.
        let probe = Arc::new(Probe::default());
        let mut pipeline = Pipeline::new(probe.clone(), 0, 100, threading(1, 4, true));
        assert_eq!(reads_reach(&probe, 4), 4);
        pipeline.next();
        // Three left (above the watermark): still waiting, nothing more read.
        assert_eq!(probe.read.load(Ordering::SeqCst), 4);
        pipeline.next();
        // Two left: woken, it fills up to 4 ready again (2 more), and no further.
        assert_eq!(reads_reach(&probe, 6), 6);
        let got: Vec<usize> = pipeline.map(|(i, _)| i).collect();
        assert_eq!(got, (2..100).collect::<Vec<_>>());
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

    #[test]
    fn a_batch_that_cannot_be_read_ends_the_epoch_there_without_a_panic() {
        for workers in [0, 1, 3] {
            let probe = Arc::new(Probe {
                unread_at: Some(4),
                ..Probe::default()
            });
            let pipeline = Pipeline::new(Arc::clone(&probe), 1, 10, threading(workers, 2, false));
            let got: Vec<usize> = pipeline.map(|b| b.0).collect();
            assert_eq!(got, [1, 2, 3], "{workers} workers");
            assert_eq!(probe.alive.load(Ordering::SeqCst), 0, "{workers} workers");
        }
    }
}
