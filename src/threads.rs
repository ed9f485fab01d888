//! The thread that runs a training step, made one of the CPU threads its ops compute on.
//!
//! Flex, the `gemm` crate and this crate's CPU kernels split their work over rayon's global
//! thread pool. Called from a thread outside that pool, such as a program's `main`, each of
//! Flex's and `gemm`'s parallel ops hands its work to the pool and sleeps until the pool's
//! threads are done with it: a sleeping worker woken, and the caller woken back, for every
//! op. This crate's kernels (its GEMMs, conversions, softmax, GELU: most of an autocast
//! step's time) do not: their caller computes its share, helped by the pool's threads as they
//! come (`burn_accelerate_kernels::tasks`), on every thread and without this call. With
//! [`use_current_thread`], the thread that runs the step is also the pool's first thread for
//! the rest: it computes its share of every op itself, as an OpenMP program's main thread
//! does (PyTorch's CPU ops), and a step runs on as many threads as the pool has, not one
//! more.
//!
//! On a 2-core virtual machine (AMD Zen 4), before the kernels shared their loops with their
//! caller, a bf16 step of the small conv net took 0.90× as long, and one of the README's MLP
//! 0.77–0.98× (the more the host is loaded, the more a wake-up costs); Burn's LSTM, whose ops
//! are too small to run in parallel, is unchanged (BENCHMARKS.md, issue 28).
//!
//! It is a choice for the whole process, so the crate never makes it on its own: rayon's
//! global pool is built once, by whichever comes first, this call or the first parallel op.
//! What the crate does on its own is [`run_on_step_pool`]: `with_accelerate` runs its fit on
//! the first thread of a pool of its own, which gives its steps the same without touching the
//! global pool.
//!
//! What it changes beyond speed:
//! - Call it on the thread that runs the training steps. Burn's single-device training runs
//!   them on the thread that calls `fit` (`with_accelerate` on its own pool's thread, where
//!   this call changes nothing); Burn's multi-device
//!   strategies run each device's steps on a thread of its own, and there the call would only
//!   take a thread from their ops.
//! - The calling thread runs pool jobs only while it is inside a parallel op itself (rayon
//!   steals no work for it otherwise). Parallel work that other threads start while it runs
//!   serial code is shared among the other threads of the pool.
//! - While it waits inside a parallel op, it may run another thread's pool job. A job that
//!   takes a lock the calling thread holds around its parallel ops would deadlock; Burn's ops
//!   and this crate's kernels take none.
//! - The numbers do not change: the crate's kernels and Flex's split work so that each value
//!   is computed the same way whichever thread computes it.
//!
//! [`StepThreadsConfig`] can also pin each of the pool's threads to a CPU of its own
//! (`pin: true`). Unpinned, the kernel may put two of them on one core for a while and leave
//! the other core idle: it decides where to run a thread when it wakes, and a step wakes its
//! threads tens of times. On the shared 2-core VM of BENCHMARKS.md, the conv net's median bf16
//! step took 5.9–10.4 ms unpinned and 5.8–7.1 ms pinned (ten runs each way). Pinning suits a
//! machine the run has to itself: pinned threads cannot move away from another program's busy
//! CPU.
//!
//! Which CPUs: those the process may run on (its mask: `taskset`, a container's cpuset), and
//! of those its share.
//! - Under `burn-accelerate launch` and torchrun, which leave every process free to run on
//!   every CPU, the processes on a machine split them by `LOCAL_RANK` and `LOCAL_WORLD_SIZE`,
//!   whole cores each where there are enough.
//! - Under `mpirun` and `srun`, the launcher binds each process to CPUs of its own, and its
//!   mask is its share, as OpenMP programs under them take it. Ask them to bind enough CPUs
//!   for the threads: `mpirun --map-by slot:PE=<threads> --bind-to core`, `srun
//!   --cpus-per-task=<threads> --cpu-bind=cores`. Where a process may run on every CPU of
//!   the machine (`mpirun --bind-to none`), the processes split them as above; where they
//!   share a part of it unbound (`srun` without binding, in a partial allocation), each
//!   would pin to the same CPUs.
//! - Within its share, a process's threads take one hardware thread of every core before any
//!   core's second.
//!
//! ```no_run
//! fn main() -> Result<(), burn_accelerate::AccelerateError> {
//!     // First thing, before any op runs on Flex; `None`: RAYON_NUM_THREADS, else one
//!     // thread per core, this one included.
//!     burn_accelerate::threads::use_current_thread(None)?;
//!     // ... build the model and train on this thread.
//!     Ok(())
//! }
//! ```
//!
//! Pinned, reading where the threads went:
//!
//! ```no_run
//! use burn_accelerate::threads::StepThreadsConfig;
//!
//! fn main() -> Result<(), burn_accelerate::AccelerateError> {
//!     let threads = StepThreadsConfig::new().with_pin(true).install()?;
//!     println!("{} threads on CPUs {:?}", threads.count(), threads.cpus());
//!     Ok(())
//! }
//! ```

mod affinity;
mod cores;

use std::sync::mpsc;
use std::time::Duration;

use burn::config::Config;

use crate::AccelerateError;
use crate::distributed::ProcessState;
use cores::{TooManyProcesses, TooManyThreads};

/// How long the pool's threads may take to start and pin themselves.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The pool the training step computes on: its size, and whether each thread is pinned to a CPU
/// of its own. [`install`](Self::install) builds it, with the calling thread as its first
/// thread; see the [module](self) for what that changes.
#[derive(Config, Debug, PartialEq, Eq)]
pub struct StepThreadsConfig {
    /// Threads in all, the calling one included. `None`: `RAYON_NUM_THREADS` where set, else
    /// one per CPU of this process's share when pinned, one per logical CPU when not.
    pub threads: Option<usize>,
    /// Pin each thread to a CPU of its own, from this process's share of the machine (Linux).
    #[config(default = false)]
    pub pin: bool,
}

/// The pool [`StepThreadsConfig::install`] built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepThreads {
    count: usize,
    cpus: Option<Vec<usize>>,
}

impl StepThreads {
    /// Its threads, the calling one included.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The CPU each thread is pinned to, the calling thread's first; `None` when unpinned.
    pub fn cpus(&self) -> Option<&[usize]> {
        self.cpus.as_deref()
    }
}

impl StepThreadsConfig {
    /// Builds rayon's global pool with the calling thread as its first thread, pinning each
    /// thread first where asked.
    ///
    /// # Errors
    ///
    /// - [`AccelerateError::InvalidConfig`] for `threads: Some(0)`.
    /// - [`AccelerateError::ThreadPool`] where the global pool exists already: a parallel op
    ///   ran first (in this thread or another), or this was called before.
    /// - [`AccelerateError::ThreadPinning`] when pinning, for more threads than CPUs in this
    ///   process's share, more processes on the machine than CPUs, or a system that refuses
    ///   (or, off Linux, lacks) thread affinity.
    /// - [`AccelerateError::Distributed`] when pinning under a launcher whose variables
    ///   (`LOCAL_RANK`, ...) do not make sense.
    pub fn install(&self) -> Result<StepThreads, AccelerateError> {
        if self.threads == Some(0) {
            return Err(AccelerateError::InvalidConfig {
                field: "threads",
                value: "0".into(),
                fix: "give at least 1 (the calling thread), or None for rayon's default",
            });
        }
        let builder = rayon::ThreadPoolBuilder::new().use_current_thread();
        if !self.pin {
            builder
                .num_threads(self.threads.unwrap_or(0))
                .build_global()
                .map_err(pool_error)?;
            return Ok(StepThreads {
                count: rayon::current_num_threads(),
                cpus: None,
            });
        }
        let allowed = affinity::allowed_cpus().map_err(|reason| unpinnable(reason, no_pin()))?;
        let cpus = self.pinned_cpus(&allowed)?;
        let mask = allowed.iter().map(|cpu| cpu.id).collect::<Vec<_>>();
        build_pinned(builder, &cpus, &mask)?;
        Ok(StepThreads {
            count: cpus.len(),
            cpus: Some(cpus),
        })
    }

    // Each thread's CPU: this process's share of `cpus`, the CPUs it may run on, one per
    // thread.
    fn pinned_cpus(&self, cpus: &[cores::Cpu]) -> Result<Vec<usize>, AccelerateError> {
        let process = ProcessState::from_env()?;
        // mpirun and srun give each process CPUs of its own (as OpenMP programs under them
        // expect): its mask is its share. Under torchrun and ours, and under an mpirun told
        // not to bind (whose processes may each run on every CPU of the machine), the
        // processes split them.
        let unbound = affinity::online_cpus() == Some(cpus.len());
        let (index, count) = match process.bound_by_launcher() && !unbound {
            true => (0, 1),
            false => (process.local_process_index(), process.local_num_processes()),
        };
        let share = cores::process_share(cpus, index, count).map_err(
            |TooManyProcesses { processes, cpus }| {
                unpinnable(
                    format!(
                        "{processes} processes on this machine share the {cpus} CPUs it may run \
                         on"
                    ),
                    format!("run at most {cpus} processes per machine, or {}", no_pin()),
                )
            },
        )?;
        let threads = self
            .threads
            .map(|threads| (threads, "the config's `threads`"))
            .or_else(|| rayon_num_threads().map(|threads| (threads, "RAYON_NUM_THREADS")));
        let Some((threads, asked_by)) = threads else {
            return Ok(share);
        };
        cores::thread_cpus(&share, threads).map_err(|TooManyThreads { threads, cpus }| {
            unpinnable(
                format!(
                    "{threads} threads asked for (by {asked_by}) and {cpus} CPUs in this \
                     process's share (local process {index} of {count})"
                ),
                format!("ask for at most {cpus} threads, or {}", no_pin()),
            )
        })
    }
}

// Pins the calling thread, builds the pool (whose threads pin themselves as they start), and
// waits for every thread to say it is pinned; `original`, the calling thread's mask, is put
// back where no pool was built.
fn build_pinned(
    builder: rayon::ThreadPoolBuilder,
    cpus: &[usize],
    original: &[usize],
) -> Result<(), AccelerateError> {
    let unpinned = |reason| unpinnable(reason, no_pin());
    affinity::pin_current(cpus[0]).map_err(unpinned)?;
    let (sender, started) = mpsc::channel();
    let worker_cpus = cpus.to_vec();
    let built = builder
        .num_threads(cpus.len())
        .start_handler(move |index| {
            // The receiver is gone only after install returned an error for an earlier thread.
            let _ = sender.send((index, affinity::pin_current(worker_cpus[index])));
        })
        .build_global();
    if let Err(error) = built {
        // Nothing was built: the calling thread runs where it ran before.
        let _ = affinity::restore(original);
        return Err(pool_error(error));
    }
    for _ in 1..cpus.len() {
        match started.recv_timeout(START_TIMEOUT) {
            Ok((_, Ok(()))) => {}
            Ok((index, Err(reason))) => {
                return Err(unpinned(format!(
                    "thread {index} of the pool: {reason} (the pool is built, that thread \
                     unpinned)"
                )));
            }
            Err(_) => {
                return Err(unpinned(format!(
                    "the pool's threads did not all start within {START_TIMEOUT:?}"
                )));
            }
        }
    }
    Ok(())
}

// Rayon's own reading of RAYON_NUM_THREADS: a positive count, anything else ignored.
fn rayon_num_threads() -> Option<usize> {
    std::env::var("RAYON_NUM_THREADS")
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|&threads| threads > 0)
}

fn no_pin() -> String {
    "leave `pin` off".into()
}

fn unpinnable(reason: String, fix: String) -> AccelerateError {
    AccelerateError::ThreadPinning { reason, fix }
}

fn pool_error(error: rayon::ThreadPoolBuildError) -> AccelerateError {
    AccelerateError::ThreadPool {
        reason: error.to_string(),
    }
}

/// Runs `work`, a training loop, on the first thread of a rayon pool of its own, with as many
/// threads as rayon's global pool; the calling thread waits for it. Where the calling thread
/// is a pool's thread already ([`use_current_thread`], [`StepThreadsConfig::install`], or
/// inside a pool), `work` runs right here.
///
/// It gives a program that never called [`use_current_thread`] what that call gives (see the
/// [module](self)): the thread that runs the steps computes its share of each parallel op
/// instead of handing it over and sleeping. `with_accelerate` runs its `fit` through it. A
/// pool of its own, not the global one, because a thread of the global pool that waits
/// inside a parallel op runs whatever other job the pool holds, and another training loop
/// (tests run several at once) would then run on the same thread, inside this one's op,
/// sharing its thread-local state. Flex's and this crate's parallel ops run on the pool of
/// the thread that calls them, so the loop's ops stay on its pool.
///
/// ```
/// let sum: u64 = burn_accelerate::threads::run_on_step_pool(|| (1..=10).sum());
/// assert_eq!(sum, 55);
/// ```
pub fn run_on_step_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return work();
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("burn-accelerate-step-{i}"))
        .build();
    match pool {
        Ok(pool) => pool.install(work),
        // No threads to be had: the loop runs as it would have without this.
        Err(err) => {
            log::warn!("burn-accelerate: training on the calling thread: {err}");
            work()
        }
    }
}

/// Makes the calling thread the first thread of rayon's global pool, with `threads` in all,
/// this one included (`None`: rayon's default, `RAYON_NUM_THREADS` where set, else one per
/// logical CPU), unpinned. See the [module](self) for what it changes, and
/// [`StepThreadsConfig`] to pin the threads too.
///
/// # Errors
///
/// - [`AccelerateError::InvalidConfig`] for `Some(0)`.
/// - [`AccelerateError::ThreadPool`] where the global pool exists already: a parallel op ran
///   first (in this thread or another), or this was called before.
pub fn use_current_thread(threads: Option<usize>) -> Result<(), AccelerateError> {
    StepThreadsConfig {
        threads,
        pin: false,
    }
    .install()
    .map(|_| ())
}
