//! The kernels' parallel loops: tasks numbered `0..n` shared among rayon's threads, with the
//! calling thread taking its share where it is outside the pool.
//!
//! A program's `main` is outside rayon's pool. There, a rayon parallel loop hands the whole
//! loop to the pool and puts the caller to sleep until the pool's threads are done: a
//! sleeping worker woken first, and the caller woken back last, for every op, tens of times
//! a step, while a third thread (the caller) competes with the pool's for the cores.
//!
//! Here the caller computes as an OpenMP program's main thread does. The tasks are split into
//! contiguous ranges, one per thread (the caller's first), as rayon splits a loop, so that
//! neighbouring tasks (a GEMM's blocks along a row of blocks, a conversion's chunks) stay on
//! one core and in its caches. The caller asks the pool for a helper per other range (one job
//! each, `rayon::spawn`) and starts on its own range at once; a thread done with its range
//! takes the back half of what is left of another's, so a helper that starts late (its worker
//! asleep, or busy) leaves its range to the others. The caller then waits only for tasks a
//! helper has taken and not finished, spinning for about a task's time and then parked; it
//! never waits for a worker to wake. A helper that starts after the last task is taken finds
//! nothing to do and returns.
//!
//! Inside a pool (under `with_accelerate`'s step pool, a `ThreadPool::install`, or a rayon
//! worker of any kind) the loop is rayon's own `for_each`, whose caller already works.
//!
//! A task's panic reaches the caller, as from rayon's loops: no task starts after it, and the
//! caller carries the panic on once no helper is inside a task any more.
//!
//! The tasks write disjoint results and each value is computed alone, so the split (which
//! thread runs which task) never shows in the bits.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::several_threads;

/// How long a caller waiting for helpers' last tasks spins before it parks: about a task's
/// time, so that the common wait (a helper finishing its last task) costs no wake-up.
const SPIN: Duration = Duration::from_micros(100);
/// How long a parked caller sleeps before it looks again; helpers also wake it.
const PARK: Duration = Duration::from_millis(1);

/// `task(i)` for every `i` in `0..tasks`, each exactly once, on rayon's threads where
/// `parallel` is true and there are several tasks, in order on this thread otherwise.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use burn_accelerate_kernels::tasks::for_each_task;
///
/// let sum = AtomicUsize::new(0);
/// for_each_task(100, true, |i| {
///     sum.fetch_add(i, Ordering::Relaxed);
/// });
/// assert_eq!(sum.into_inner(), 4950);
/// ```
pub fn for_each_task(tasks: usize, parallel: bool, task: impl Fn(usize) + Sync) {
    if !parallel || tasks < 2 || !several_threads() {
        (0..tasks).for_each(task);
    } else if rayon::current_thread_index().is_some() {
        (0..tasks).into_par_iter().for_each(&task);
    } else {
        let participants = rayon::current_num_threads().min(tasks);
        shared_with_the_pool(tasks, participants, &|job| rayon::spawn(job), &task);
    }
}

/// `task(i, chunk)` for the chunks of `chunk_len` values of `values` (the last may be
/// shorter), `i` the chunk's number, as [`for_each_task`] runs tasks.
///
/// ```
/// use burn_accelerate_kernels::tasks::for_each_chunk;
///
/// let mut values = vec![0usize; 10];
/// for_each_chunk(&mut values, 4, true, |i, chunk| chunk.fill(i));
/// assert_eq!(values, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]);
/// ```
pub fn for_each_chunk<T: Send>(
    values: &mut [T],
    chunk_len: usize,
    parallel: bool,
    task: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk_len = chunk_len.max(1);
    let len = values.len();
    let base = Base(values.as_mut_ptr());
    for_each_task(len.div_ceil(chunk_len), parallel, |i| {
        let start = i * chunk_len;
        let end = (start + chunk_len).min(len);
        // SAFETY: `for_each_task` runs each `i` once, so the chunks are disjoint parts of
        // `values`, which this call borrows mutably until every task has returned.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), end - start) };
        task(i, chunk)
    });
}

// The start of a slice that tasks on several threads take disjoint parts of.
struct Base<T>(*mut T);

impl<T> Base<T> {
    // Through a method, so that closures capture the `Base` (which is `Sync`), not its field.
    fn at(&self, offset: usize) -> *mut T {
        // SAFETY (of the `add`): callers pass offsets within the slice.
        unsafe { self.0.add(offset) }
    }
}

// SAFETY: only disjoint parts of the slice are reached through it, each from one thread, as
// `par_chunks_mut` hands them out; `T: Send` lets each part move to that thread.
unsafe impl<T: Send> Sync for Base<T> {}

// The tasks of one loop, shared by the caller and its helpers.
struct Loop {
    tasks: usize,
    // One per participant (the caller's first, then one per helper): the tasks it takes
    // next, from the front, and that others may take from the back once theirs are done.
    ranges: Box<[Range]>,
    // Tasks finished.
    done: AtomicUsize,
    // Helpers inside `work`, and whether a task panicked (no more are taken then).
    active: AtomicUsize,
    stopped: AtomicBool,
    // A helper's panic, for the caller to carry on.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    // The loop's body, on the caller's stack: valid while the caller waits (see
    // `shared_with_the_pool`), and read only by a thread that has just taken a task.
    body: *const (dyn Fn(usize) + Sync + 'static),
    caller: Thread,
}

// SAFETY: `body` is a `Sync` closure, called from several threads only while it lives (the
// protocol of `shared_with_the_pool`); the rest is atomics and a `Thread` handle.
unsafe impl Send for Loop {}
unsafe impl Sync for Loop {}

impl Loop {
    // Runs the tasks of range `own`, then takes half of what is left of another's, until no
    // task is left or the caller stops the loop.
    fn work(&self, own: usize) {
        let range = &self.ranges[own];
        while !self.stopped.load(Ordering::SeqCst) {
            let i = match range.take_front() {
                Some(i) => i,
                None => match self.steal(own) {
                    Some((first, end)) => {
                        range.set(first + 1, end);
                        first
                    }
                    None => return,
                },
            };
            // SAFETY: a task taken keeps the caller waiting until it is done, or (the caller
            // unwinding) until this helper leaves `work`, so the body is alive.
            unsafe { (*self.body)(i) };
            // Release: the caller reads what the task wrote after it sees the count.
            if self.done.fetch_add(1, Ordering::Release) + 1 == self.tasks {
                self.caller.unpark();
            }
        }
    }

    // The back half of another participant's remaining tasks, looking from the next one on.
    fn steal(&self, thief: usize) -> Option<(usize, usize)> {
        let n = self.ranges.len();
        (1..n).find_map(|k| self.ranges[(thief + k) % n].take_back_half())
    }

    // A helper's `work`, counted in `active` so that a caller whose loop stopped can wait
    // for it; a panic is kept for the caller, as rayon's loops carry a task's panic to theirs.
    fn help(&self, own: usize) {
        // SeqCst, with the stores of `stopped` and the caller's loads of `stopped` and then
        // `active`: either the caller sees this helper active and waits for it, or the helper
        // sees `stopped`.
        self.active.fetch_add(1, Ordering::SeqCst);
        if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| self.work(own))) {
            self.stopped.store(true, Ordering::SeqCst);
            let mut kept = self.panic.lock().unwrap_or_else(|e| e.into_inner());
            kept.get_or_insert(panic);
        }
        self.active.fetch_sub(1, Ordering::SeqCst);
        self.caller.unpark();
    }

    // Whether the loop stopped (a task panicked) and no helper is inside `work` any more.
    fn stopped_and_left(&self) -> bool {
        self.stopped.load(Ordering::SeqCst) && self.active.load(Ordering::SeqCst) == 0
    }

    // Waits until `ready()`: spinning for about a task's time, then parked. The clock is
    // read every `SPINS_PER_LOOK` spins only: read on every one, it was 1% of an MLP step.
    fn wait_until(&self, ready: impl Fn() -> bool) {
        const SPINS_PER_LOOK: u32 = 64;
        let start = Instant::now();
        let mut spins = 0u32;
        while !ready() {
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(SPINS_PER_LOOK) || start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                thread::park_timeout(PARK);
            }
        }
    }
}

// A participant's tasks `next..end`, both in one word so that its owner taking from the
// front and a thief taking from the back agree on who took what.
struct Range(AtomicU64);

impl Range {
    fn new(next: usize, end: usize) -> Self {
        Self(AtomicU64::new(Self::pack(next, end)))
    }

    fn pack(next: usize, end: usize) -> u64 {
        (next as u64) | ((end as u64) << 32)
    }

    fn unpack(word: u64) -> (usize, usize) {
        ((word & u64::from(u32::MAX)) as usize, (word >> 32) as usize)
    }

    // Its next task, taken from the front.
    fn take_front(&self) -> Option<usize> {
        let mut word = self.0.load(Ordering::Acquire);
        loop {
            let (next, end) = Self::unpack(word);
            if next >= end {
                return None;
            }
            match self.0.compare_exchange_weak(
                word,
                Self::pack(next + 1, end),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(next),
                Err(now) => word = now,
            }
        }
    }

    // The back half of its tasks (the last one where one is left), taken from the end.
    fn take_back_half(&self) -> Option<(usize, usize)> {
        let mut word = self.0.load(Ordering::Acquire);
        loop {
            let (next, end) = Self::unpack(word);
            if next >= end {
                return None;
            }
            let middle = end - (end - next).div_ceil(2);
            match self.0.compare_exchange_weak(
                word,
                Self::pack(next, middle),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some((middle, end)),
                Err(now) => word = now,
            }
        }
    }

    // Gives its owner, whose range is empty (no one else writes an empty range), new tasks.
    fn set(&self, next: usize, end: usize) {
        self.0.store(Self::pack(next, end), Ordering::Release);
    }
}

// The loop of `for_each_task` from a thread outside rayon's pools, in `participants`
// ranges, the caller's and one per helper job given to `spawn`: see the module docs.
fn shared_with_the_pool(
    tasks: usize,
    participants: usize,
    spawn: &dyn Fn(Box<dyn FnOnce() + Send>),
    task: &(dyn Fn(usize) + Sync),
) {
    // Task numbers and counts fit a range's halves.
    assert!(u32::try_from(tasks).is_ok(), "{tasks} tasks in one loop");
    // SAFETY (of erasing the closure's lifetime): threads call `body` only after taking a
    // task, and this function returns only once every task is done, or (unwinding) once no
    // helper is inside `work` and none can take a task any more; a helper that starts later
    // finds no task, or the loop stopped, and never reads it.
    let body = unsafe {
        std::mem::transmute::<
            *const (dyn Fn(usize) + Sync + '_),
            *const (dyn Fn(usize) + Sync + 'static),
        >(task)
    };
    // Contiguous ranges, as rayon splits a loop: neighbouring tasks (a GEMM's blocks along a
    // row of blocks, a conversion's chunks) stay on one thread and in its caches.
    let shared = Arc::new(Loop {
        tasks,
        ranges: (0..participants)
            .map(|p| Range::new(p * tasks / participants, (p + 1) * tasks / participants))
            .collect(),
        done: AtomicUsize::new(0),
        active: AtomicUsize::new(0),
        stopped: AtomicBool::new(false),
        panic: Mutex::new(None),
        body,
        caller: thread::current(),
    });
    for own in 1..participants {
        let shared = Arc::clone(&shared);
        spawn(Box::new(move || shared.help(own)));
    }
    let worked = std::panic::catch_unwind(AssertUnwindSafe(|| shared.work(0)));
    if let Err(panic) = worked {
        shared.stopped.store(true, Ordering::SeqCst);
        shared.wait_until(|| shared.active.load(Ordering::SeqCst) == 0);
        std::panic::resume_unwind(panic);
    }
    // Every task is taken: wait for the helpers' last ones, or for a helper's panic.
    shared.wait_until(|| shared.done.load(Ordering::Acquire) == tasks || shared.stopped_and_left());
    let panic = shared
        .panic
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(panic) = panic {
        std::panic::resume_unwind(panic);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Taken by the tests that need the global pool's threads free, or that block them.
    static GLOBAL_POOL: Mutex<()> = Mutex::new(());

    // The global pool to oneself, where it has several threads (else the test is skipped,
    // and says so).
    fn several_pool_threads() -> Option<std::sync::MutexGuard<'static, ()>> {
        if rayon::current_num_threads() < 2 {
            eprintln!("skipped: rayon's pool has one thread here");
            return None;
        }
        Some(GLOBAL_POOL.lock().unwrap_or_else(|e| e.into_inner()))
    }

    #[test]
    fn every_task_runs_once_from_outside_the_pool_and_inside_it() {
        let check = || {
            for tasks in [0, 1, 2, 3, 17, 1000] {
                let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                for_each_task(tasks, true, |i| {
                    runs[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                    "{tasks} tasks"
                );
            }
        };
        check();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        pool.install(check);
    }

    #[test]
    fn many_helpers_stealing_from_each_other_run_every_task_once() {
        // More participants than the global pool has threads: helpers on a pool of their
        // own, uneven tasks so that ranges run dry at different times and are stolen from.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let spawn = |job: Box<dyn FnOnce() + Send>| pool.spawn(job);
        for (tasks, participants) in [(2, 2), (5, 5), (7, 3), (64, 5), (1000, 8)] {
            let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            shared_with_the_pool(tasks, participants, &spawn, &|i| {
                if i % 7 == 0 {
                    thread::sleep(Duration::from_micros(300));
                }
                runs[i].fetch_add(1, Ordering::Relaxed);
            });
            let counts: Vec<usize> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
            assert!(
                counts.iter().all(|c| *c == 1),
                "{tasks} tasks, {participants}: {counts:?}"
            );
        }
    }

    #[test]
    fn a_range_gives_its_front_to_its_owner_and_its_back_half_to_thieves() {
        let range = Range::new(10, 20);
        assert_eq!(range.take_front(), Some(10));
        // 11..20 left, 9 tasks: a thief takes the back 5 (half, rounded up).
        assert_eq!(range.take_back_half(), Some((15, 20)));
        assert_eq!(range.take_back_half(), Some((13, 15)));
        assert_eq!(range.take_front(), Some(11));
        assert_eq!(range.take_back_half(), Some((12, 13)));
        assert_eq!((range.take_front(), range.take_back_half()), (None, None));
        range.set(30, 31);
        assert_eq!((range.take_front(), range.take_front()), (Some(30), None));
    }

    #[test]
    fn chunks_cover_the_values_in_order() {
        for (len, chunk) in [(0, 3), (1, 3), (10, 3), (12, 3), (1 << 16, 1000), (5, 0)] {
            let mut values = vec![usize::MAX; len];
            for_each_chunk(&mut values, chunk, true, |i, part| {
                for (j, v) in part.iter_mut().enumerate() {
                    *v = i * chunk.max(1) + j;
                }
            });
            assert!(
                values.iter().enumerate().all(|(i, v)| i == *v),
                "{len} by {chunk}"
            );
        }
    }

    #[test]
    fn a_caller_outside_the_pool_shares_the_tasks_with_it() {
        // From outside the pool, with a pool of several threads, tasks run on this thread and
        // on the pool's: the point of the module. Tasks long enough that a helper starts.
        let Some(_pool) = several_pool_threads() else {
            return;
        };
        let me = thread::current().id();
        let threads = Mutex::new(Vec::new());
        for_each_task(64, true, |_| {
            threads.lock().unwrap().push(thread::current().id());
            thread::sleep(Duration::from_millis(2));
        });
        let threads = threads.into_inner().unwrap();
        assert!(threads.contains(&me), "the caller took no task");
        assert!(threads.iter().any(|t| *t != me), "no helper took a task");
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_helpers_are_done() {
        let running = AtomicUsize::new(0);
        let panicked = AtomicBool::new(false);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // More tasks than a helper gets through while the panic is reported (a backtrace
            // may take many milliseconds).
            for_each_task(1 << 20, true, |i| {
                running.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_micros(200));
                // Once, in a task of the caller's (a helper's: the next test).
                let caller = rayon::current_thread_index().is_none();
                if caller && i >= 5 && !panicked.swap(true, Ordering::SeqCst) {
                    panic!("task {i}");
                }
                running.fetch_sub(1, Ordering::SeqCst);
            });
        }));
        assert!(result.is_err(), "the caller's panic was lost");
        // No helper is still inside a task (which borrows this frame) when it arrives.
        assert_eq!(
            running.load(Ordering::SeqCst),
            1,
            "only the panicking task left open"
        );
    }

    #[test]
    fn a_helpers_panic_reaches_the_caller() {
        let Some(_pool) = several_pool_threads() else {
            return;
        };
        let result = std::panic::catch_unwind(|| {
            for_each_task(64, true, |i| {
                thread::sleep(Duration::from_millis(2));
                if rayon::current_thread_index().is_some() {
                    panic!("task {i} on a helper");
                }
            });
        });
        let panic = result.expect_err("a helper ran a task, and its panic was lost");
        assert!(
            panic
                .downcast_ref::<String>()
                .is_some_and(|m| m.ends_with("on a helper"))
        );
    }

    #[test]
    fn a_caller_never_waits_for_a_busy_pool_to_start_its_helpers() {
        // Every thread of the pool blocked: the caller does all the tasks itself and returns,
        // where a loop handed to the pool would wait for it.
        let _pool = GLOBAL_POOL.lock().unwrap_or_else(|e| e.into_inner());
        let (release, blocked) = (Arc::new(Mutex::new(())), rayon::current_num_threads());
        let hold = release.lock().unwrap();
        let started = Arc::new(AtomicUsize::new(0));
        for _ in 0..blocked {
            let (release, started) = (Arc::clone(&release), Arc::clone(&started));
            rayon::spawn(move || {
                started.fetch_add(1, Ordering::SeqCst);
                drop(release.lock().unwrap());
            });
        }
        while started.load(Ordering::SeqCst) < blocked {
            thread::yield_now();
        }
        let (done, finished) = std::sync::mpsc::channel();
        let caller = thread::spawn(move || {
            let ran = AtomicUsize::new(0);
            for_each_task(32, true, |_| {
                ran.fetch_add(1, Ordering::Relaxed);
            });
            done.send(ran.into_inner()).unwrap();
        });
        let ran = finished.recv_timeout(Duration::from_secs(20));
        drop(hold);
        caller.join().unwrap();
        assert_eq!(ran, Ok(32), "the caller waited for the blocked pool");
    }
}
