//! One training script on one process, on several processes of a machine, or on several
//! machines, as Accelerate's `accelerate launch` gives PyTorch scripts.
//!
//! - [`ProcessState`]: Accelerate's `PartialState`, read from the environment that
//!   `burn-accelerate launch`, torchrun, `srun` or `mpirun` sets ([`mod@env`] names the
//!   variables); with none set, a single process.
//! - `wait_for_everyone`, `main_process_first`, `local_main_process_first` (a panic inside the
//!   latter two fails the waiting processes rather than releasing them).
//! - [`ProcessGroup`]: the run's collectives on flat buffers of any size and element type
//!   ([`Reducible`]): `all_reduce`, `reduce_scatter`, `all_gather` (and in place), `barrier`;
//!   joined on first use. Every wait has the run's timeout, and a process that exits, freezes,
//!   is cut off or fails ends every process's collectives with an error that says which and
//!   what became of it ([`DistributedError`]) instead of hanging them.
//! - [`all_reduce_gradients`]: the mean of a model's gradients over the processes, in a few
//!   flat buckets; the [`Accelerator`](crate::Accelerator) and the training strategy call it
//!   at every synchronising step, and never while accumulating (Accelerate's `no_sync`). On
//!   Flex each gradient is reduced where it lies, keeping its layout ([`SyncLayout`]).
//! - Accelerate's collectives on tensors, as methods of [`ProcessGroup`]: `gather`,
//!   `gather_for_metrics`, `reduce`, `broadcast`, `broadcast_object`, `pad_across_processes`,
//!   and `all_reduce_tensor` / `reduce_scatter_tensor` (any dtype, exactly).
//! - [`RunSecret`]: what every connection of a run proves it knows.
//! - [`set_seed`]: Accelerate's `set_seed(seed, device_specific)`.
//!
//! The layers, bottom up: the engine that carries bytes (the built-in TCP transport: framing,
//! connections, handshake, rendezvous, liveness, the ring; or MPI with the `mpi` feature),
//! [`ProcessGroup`] (numbering, means, typed buffers), the tensor collectives, the gradient
//! sync. [`ProcessState`] reads the layout from the environment and does no I/O (but for the
//! note `from_env` prints in a Slurm allocation that is not an `srun` step).
//!
//! ```text
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --batch-size 32
//! ```

pub(crate) mod bucket;
mod collectives;
mod element;
mod engine;
pub mod env;
mod error;
#[cfg(feature = "flex")]
pub(crate) mod flex_sync;
#[cfg(feature = "flex")]
mod grad_layout;
pub(crate) mod gradients;
mod group;
mod guard;
pub mod membership;
mod secret;
mod seed;
mod state;

pub use element::{Element, Reducible};
pub use error::DistributedError;
pub use gradients::{
    BUCKET_VALUES, SyncLayout, all_reduce_gradients, scope_sync_layout, sync_copied_values,
};
pub(crate) use group::Stream;
pub use group::{ProcessGroup, ReduceOp, shard_counts};
pub use guard::FirstGuard;
pub use secret::RunSecret;
pub use seed::{seed_for, set_seed};
pub use state::{ProcessState, Rendezvous};

/// Serves the rendezvous (the run's orchestrator) on `host:port` until the process ends: what
/// `burn-accelerate launch` runs on the main machine. Only processes that prove they know
/// `secret`, and are of its attempt ([`RunSecret::attempt`], until
/// [`RendezvousHost::begin_attempt`]), are heard. Rounds of arrivals time out `timeout` after
/// their first arrival.
///
/// # Errors
/// [`DistributedError::PortUnavailable`] when `port` is taken, or `host` is not this
/// machine's.
pub fn serve_rendezvous(
    host: &str,
    port: u16,
    timeout: std::time::Duration,
    secret: RunSecret,
    runtime: &tokio::runtime::Handle,
) -> Result<RendezvousHost, DistributedError> {
    engine::tcp::rendezvous::serve(host, port, timeout, secret, runtime).map(RendezvousHost)
}

/// Which start of the run this process belongs to: 0 at the first, `n` after `n` restarts
/// (`burn-accelerate launch --max-restarts`, or torchrun's), from [`env::RESTART_COUNT`] or
/// torchrun's [`env::TORCHRUN_RESTART_COUNT`]; 0 when neither is set.
///
/// # Errors
/// [`DistributedError::InvalidVariable`] for a value that is not a whole number.
pub fn restart_count() -> Result<u64, DistributedError> {
    secret::restart_count(&|name: &str| std::env::var(name).ok())
}

/// The rendezvous [`serve_rendezvous`] started: it moves the run on to its next attempt.
#[derive(Clone)]
pub struct RendezvousHost(engine::tcp::rendezvous::Host);

impl RendezvousHost {
    /// Hears only the processes of attempt `attempt` from now on (0: the run's first start,
    /// `n` after `n` restarts, as [`env::RESTART_COUNT`] numbers them): those of an earlier
    /// attempt, waiting or still to come, are refused, so that a process left over from a
    /// stopped attempt can never take a place in the restarted run.
    pub fn begin_attempt(&self, attempt: u64) {
        self.0.begin_attempt(attempt);
    }
}
