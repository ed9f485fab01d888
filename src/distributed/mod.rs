//! One training script on one process, on several processes of a machine, or on several
//! machines, as Accelerate's `accelerate launch` gives PyTorch scripts.
//!
//! - [`ProcessState`]: Accelerate's `PartialState`, read from the environment that
//!   `burn-accelerate launch` (or torchrun) sets ([`mod@env`] names the variables); with none
//!   set, a single process. `wait_for_everyone`, `main_process_first`,
//!   `local_main_process_first`.
//! - [`ProcessGroup`]: the run's collectives (all-reduce, barrier), joined on first use; every
//!   wait has the run's timeout, and a process that exits or crashes fails the others'
//!   collectives at once ([`DistributedError::PeerLost`]) instead of hanging them.
//! - [`all_reduce_gradients`]: the mean of a model's gradients over the processes, in a few
//!   flat buckets; the [`Accelerator`](crate::Accelerator) and the training strategy call it
//!   at every synchronising step, and never while accumulating (Accelerate's `no_sync`).
//! - Accelerate's collectives on tensors, as methods of [`ProcessGroup`]: `gather`,
//!   `gather_for_metrics`, `reduce`, `broadcast`, `broadcast_object`, `pad_across_processes`
//!   (any dtype, exactly).
//! - [`set_seed`]: Accelerate's `set_seed(seed, device_specific)`.
//!
//! The transport is burn-communication's WebSocket layer (see [`ProcessGroup`] for why not
//! burn-collective's global all-reduce at the pinned 0.21).
//!
//! ```text
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --batch-size 32
//! ```

mod collectives;
pub mod env;
mod error;
mod gradients;
mod group;
mod mesh;
mod rendezvous;
mod ring;
mod seed;
mod state;
mod wire;

pub use error::DistributedError;
pub use gradients::{BUCKET_VALUES, all_reduce_gradients};
pub(crate) use group::Stream;
pub use group::{ProcessGroup, ReduceOp};
pub use seed::{seed_for, set_seed};
pub use state::{FirstGuard, ProcessState, Rendezvous};

/// Serves the rendezvous (the run's orchestrator) on `port` until the process ends: what
/// `burn-accelerate launch` runs on the main machine. Rounds of arrivals time out `timeout`
/// after their first arrival.
///
/// # Errors
/// [`DistributedError::PortUnavailable`] when `port` is taken.
pub fn serve_rendezvous(
    port: u16,
    timeout: std::time::Duration,
    runtime: &tokio::runtime::Handle,
) -> Result<(), DistributedError> {
    rendezvous::serve(port, timeout, runtime)
}

/// burn-communication's server installs a global tracing subscriber that prints every INFO
/// event (each tensor download) to stdout, the first time one starts. A silent one set first
/// keeps a run's output the script's own; a subscriber the user installed earlier stays.
fn quiet_transport_logs() {
    let _ = tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default());
}
