//! The thread that runs a training step, made one of the CPU threads its ops compute on.
//!
//! Flex, the `gemm` crate and this crate's CPU kernels split their work over rayon's global
//! thread pool. Called from a thread outside that pool, such as a program's `main`, each
//! parallel op hands its work to the pool and sleeps until the pool's threads are done with
//! it: a sleeping worker woken, and the caller woken back, for every op, tens of times a
//! step. With [`use_current_thread`], the thread that runs the step is the pool's first
//! thread: it computes its share of each op itself, as an OpenMP program's main thread does
//! (PyTorch's CPU ops), and a step runs on as many threads as the pool has, not one more.
//!
//! On a 2-core virtual machine (AMD Zen 4), a bf16 step of the small conv net took 0.90× as
//! long, and one of the README's MLP 0.77–0.98× (the more the host is loaded, the more a
//! wake-up costs); Burn's LSTM, whose ops are too small to run in parallel, is unchanged
//! (BENCHMARKS.md, issue 28).
//!
//! It is a choice for the whole process, so the crate never makes it on its own: rayon's
//! global pool is built once, by whichever comes first, this call or the first parallel op.
//!
//! What it changes beyond speed:
//! - Call it on the thread that runs the training steps. `with_accelerate` and Burn's
//!   single-device training run them on the thread that calls `fit`; Burn's multi-device
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
//! ```no_run
//! fn main() -> Result<(), burn_accelerate::AccelerateError> {
//!     // First thing, before any op runs on Flex; `None`: RAYON_NUM_THREADS, else one
//!     // thread per core, this one included.
//!     burn_accelerate::threads::use_current_thread(None)?;
//!     // ... build the model and train on this thread.
//!     Ok(())
//! }
//! ```

use crate::AccelerateError;

/// Makes the calling thread the first thread of rayon's global pool, with `threads` in all,
/// this one included (`None`: rayon's default, `RAYON_NUM_THREADS` where set, else one per
/// logical CPU). See the [module](self) for what it changes.
///
/// # Errors
///
/// - [`AccelerateError::InvalidConfig`] for `Some(0)`.
/// - [`AccelerateError::ThreadPool`] where the global pool exists already: a parallel op ran
///   first (in this thread or another), or this was called before.
pub fn use_current_thread(threads: Option<usize>) -> Result<(), AccelerateError> {
    if threads == Some(0) {
        return Err(AccelerateError::InvalidConfig {
            field: "threads",
            value: "0".into(),
            fix: "give at least 1 (the calling thread), or None for rayon's default",
        });
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .use_current_thread()
        .build_global()
        .map_err(|error| AccelerateError::ThreadPool {
            reason: error.to_string(),
        })
}
