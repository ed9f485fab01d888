//! What can go wrong when several processes train together. Each message says what to change.

use std::time::Duration;

use thiserror::Error;

/// A bad launch environment, a rendezvous that did not complete, or a collective that failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DistributedError {
    /// A variable the others imply is not set.
    #[error(
        "environment variable {name} is not set but {because}: start the processes with \
         `burn-accelerate launch` (or torchrun), which sets all of them"
    )]
    MissingVariable {
        /// The variable.
        name: &'static str,
        /// Why it is needed.
        because: &'static str,
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

    /// Another process stopped answering: it exited, crashed or closed its connection.
    #[error(
        "process {rank} left the run during {during}: it exited or crashed (its own output \
         says why); every process must take part in every collective"
    )]
    PeerLost {
        /// The rank that left.
        rank: usize,
        /// The collective in progress.
        during: String,
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

    /// The rendezvous refused this process (a world size or rank that does not fit the
    /// others').
    #[error("rendezvous at {address} refused this process: {reason}")]
    Rendezvous {
        /// The rendezvous (orchestrator) address.
        address: String,
        /// Why.
        reason: String,
    },

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
