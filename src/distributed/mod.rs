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
//! connections, handshake, rendezvous, liveness, the ring; or MPI with the `mpi` feature), in
//! the crate `burn-accelerate-comm`, which needs no Burn (re-exported here), then
//! [`ProcessGroup`] (numbering, means, typed buffers), the tensor collectives, the gradient
//! sync. [`ProcessState`] reads the layout from the environment and does no I/O (but for the
//! note `from_env` prints in a Slurm allocation that is not an `srun` step).
//!
//! ```text
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --batch-size 32
//! ```

pub(crate) mod bucket;
mod collectives;
mod dtype;
#[cfg(feature = "flex")]
pub(crate) mod flex_sync;
#[cfg(feature = "flex")]
mod grad_layout;
pub(crate) mod gradients;
mod group;
mod guard;
pub(crate) mod padding;
mod process_state;
mod seed;

// The layer below, which needs no Burn: the engines, the rendezvous, the elastic membership,
// the run's secret, the environment's names and the errors (crate burn-accelerate-comm). Its
// modules are named here as they were when they lived in this folder.
use burn_accelerate_comm::{element, engine, error};
pub use burn_accelerate_comm::{env, membership};

/// The bytes this process's collectives have sent over the built-in engine's ring since it
/// started (ZeRO's per-step traffic: read it before and after a step).
pub use burn_accelerate_comm::engine::sent_bytes;
pub use burn_accelerate_comm::{
    DistributedError, Element, ProcessLayout, Reducible, Rendezvous, RendezvousHost, RunSecret,
    restart_count, serve_rendezvous,
};
pub use dtype::ElementOf;
pub use gradients::{
    BUCKET_VALUES, SyncLayout, all_reduce_gradients, scope_sync_layout, sync_copied_values,
};
pub(crate) use group::Stream;
pub use group::{ProcessGroup, ReduceOp, shard_counts};
pub use guard::FirstGuard;
pub use process_state::ProcessState;
pub use seed::{seed_for, set_seed};
