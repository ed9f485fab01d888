//! What can go wrong when several processes train together. Each message says what to change.

use std::time::Duration;

use thiserror::Error;

/// A bad launch environment, a rendezvous that did not complete, or a collective that failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// A variable the others imply is not set.
    #[error("environment variable {name} is not set but {because}: {fix}")]
    MissingVariable {
        /// The variable.
        name: &'static str,
        /// Why it is needed.
        because: &'static str,
        /// What to change, for the launcher that started the process.
        fix: &'static str,
    },

    /// A variable whose value cannot be used.
    #[error("environment variable {name}={value:?} is invalid: {expected}")]
    InvalidVariable {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        expected: String,
    },

    /// The launcher's own arguments do not describe a run.
    #[error("invalid launch: {0}")]
    InvalidLaunch(String),

    /// A port this process must listen on is taken.
    #[error(
        "cannot listen on port {port} ({purpose}): {reason}. Pick a free port ({variable} / \
         the launcher's --main-process-port)"
    )]
    PortUnavailable {
        /// The port.
        port: u16,
        /// What it is for.
        purpose: &'static str,
        /// Which setting chooses it.
        variable: &'static str,
        /// The operating system's answer.
        reason: String,
    },

    /// A wait on the other processes ran out of time.
    #[error(
        "timed out after {after:?} waiting for {what}: {hint} (the limit is \
         BURN_ACCELERATE_TIMEOUT seconds, or the launcher's --timeout)"
    )]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long was waited.
        after: Duration,
        /// The likely cause.
        hint: &'static str,
    },

    /// Another process of this machine exited while this one waited on it.
    #[error(
        "process {rank} (pid {pid}, on this machine) exited during {during}: its own output \
         says why (and the launcher reports its exit status); every process must take part \
         in every collective"
    )]
    PeerExited {
        /// The rank that exited.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// The collective in progress.
        during: String,
    },

    /// Another process closed its connection to this one: it exited (on another machine,
    /// where this one cannot tell), or left the collective after an error of its own.
    #[error(
        "process {rank} closed its connection during {during} ({how}): its own output says \
         why it stopped; every process must take part in every collective"
    )]
    PeerClosed {
        /// The rank that closed.
        rank: usize,
        /// The collective in progress.
        during: String,
        /// What is known of it (still running, on another machine, mid-message).
        how: String,
    },

    /// A neighbour of this process on the ring sent nothing, not even a heartbeat, for the
    /// liveness timeout: it is frozen, or its machine cannot be reached.
    #[error(
        "process {rank} at {at} has sent nothing for {after:?}, not even a heartbeat: it is \
         frozen (stopped, swapping, stuck in the kernel) or its machine cannot be reached \
         (the limit is BURN_ACCELERATE_LIVENESS_TIMEOUT seconds, or the launcher's \
         --liveness-timeout)"
    )]
    PeerSilent {
        /// The silent rank.
        rank: usize,
        /// Where it runs (address and host name).
        at: String,
        /// How long it was silent.
        after: Duration,
    },

    /// Another process found a failure that ends the run's collectives, and told the others.
    #[error("process {rank} ended the run's collectives: {reason}")]
    Aborted {
        /// The process that found the failure.
        rank: usize,
        /// Its error.
        reason: String,
    },

    /// A connection to another process failed in the operating system (reset, unreachable).
    #[error("the connection to process {rank} failed during {during}: {reason}")]
    ConnectionFailed {
        /// The other rank.
        rank: usize,
        /// The collective in progress.
        during: String,
        /// The operating system's error.
        reason: String,
    },

    /// Another process (or something on its port) sent bytes that are not this crate's
    /// messages.
    #[error(
        "process {rank} sent a malformed message: {detail}. Are both processes built from \
         the same version of burn-accelerate?"
    )]
    Malformed {
        /// The other rank.
        rank: usize,
        /// What is wrong.
        detail: String,
    },

    /// A data loader that dispatches batches from process 0 (`dispatch_batches` across
    /// processes) did not get its batch: process 0 exited, closed its connection, fell silent
    /// or timed out, or sent bytes that are not the loader's items (`reason`). The loader's
    /// epoch ended there, and every later one ends at once.
    #[error(
        "dispatch_batches across processes: {reason}; this process's loader ended its epoch \
         there, without the batches still due"
    )]
    Dispatch {
        /// What went wrong with process 0 or its batch.
        reason: Box<DistributedError>,
    },

    /// The processes called collectives in different orders or with different sizes.
    #[error(
        "process {rank} disagrees on the collective in progress: {detail}. Every process must \
         make the same collective calls in the same order, with buffers of the same length"
    )]
    Mismatch {
        /// The other rank.
        rank: usize,
        /// What differs.
        detail: String,
    },

    /// The processes built different models: the shapes of their parameters differ (a sharded
    /// run checks them before its first partition).
    #[error(
        "process {rank}'s model differs from this process's: {detail}. Every process must \
         build the same model (the same layers, in the same order, of the same sizes)"
    )]
    ModelMismatch {
        /// The other rank.
        rank: usize,
        /// The first difference.
        detail: String,
    },

    /// The rendezvous refused this process (a world size or rank that does not fit the
    /// others').
    #[error("rendezvous at {address} refused this process: {reason}")]
    Rendezvous {
        /// The rendezvous (orchestrator) address.
        address: String,
        /// Why.
        reason: String,
    },

    /// An MPI call failed (the `mpi` engine), with MPI's own message.
    #[error("{call} failed (MPI error {code}): {message}")]
    Mpi {
        /// The MPI function.
        call: &'static str,
        /// Its error code.
        code: i32,
        /// MPI's description of it.
        message: String,
    },

    /// The environment says MPI started this process, but this build has no MPI engine (and
    /// no `MASTER_ADDR` says where the built-in engine's processes meet).
    #[error(
        "this process was started by MPI ({launcher}) but this program was built without MPI: \
         build it with `--features mpi`, or set MASTER_ADDR, MASTER_PORT and \
         BURN_ACCELERATE_SECRET for the built-in engine {}",
        where_to_set(launcher)
    )]
    MpiNotBuilt {
        /// The variable that shows the MPI launch.
        launcher: &'static str,
    },

    /// `BURN_ACCELERATE_ENGINE=mpi` asks for MPI, but the process was not started as an MPI
    /// process (no MPI launcher's variables).
    #[error(
        "BURN_ACCELERATE_ENGINE=mpi, but {launcher} did not start this process with MPI's \
         wiring ({missing} is not set): {fix}"
    )]
    MpiNotLaunched {
        /// The launcher that started it.
        launcher: &'static str,
        /// The variable an MPI launch would have set.
        missing: &'static str,
        /// What to change.
        fix: &'static str,
    },

    /// A collective called with arguments that cannot work, whatever the other processes do.
    #[error("invalid collective call: {0}")]
    InvalidCall(String),

    /// An earlier collective failed; the group cannot be used any more.
    #[error("an earlier collective failed ({0}); the process group is unusable, end the run")]
    Broken(String),

    /// A process group for another process layout is already joined in this process.
    #[error(
        "this process already joined a process group as rank {joined_rank} of {joined_world}; \
         it cannot join again as rank {rank} of {world}"
    )]
    AlreadyJoined {
        /// The rank joined before.
        joined_rank: usize,
        /// The world size joined before.
        joined_world: usize,
        /// The rank asked for now.
        rank: usize,
        /// The world size asked for now.
        world: usize,
    },

    /// An operating-system failure (starting the runtime, spawning a process).
    #[error("{what}: {reason}")]
    Io {
        /// What was attempted.
        what: String,
        /// The error.
        reason: String,
    },
}

// Where the built-in engine's variables go, for a program that MPI's launcher started.
fn where_to_set(launcher: &str) -> &'static str {
    if launcher == super::env::PMIX_RANK {
        "(export them in the job script before `srun`)"
    } else {
        "(or start it with `burn-accelerate launch`, which sets them)"
    }
}
