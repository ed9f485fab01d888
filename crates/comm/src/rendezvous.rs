//! Where the processes of a run meet: the rendezvous's address and waits ([`Rendezvous`]),
//! serving it ([`serve_rendezvous`], what `burn-accelerate launch` runs on the main machine),
//! and which start of the run a process belongs to ([`restart_count`]).

use std::time::Duration;

use crate::engine;
use crate::error::DistributedError;
use crate::secret::{self, RunSecret};

/// Where the processes of a run meet, and how long they wait for each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// Host of the rendezvous (the main machine).
    pub main_addr: String,
    /// Its port.
    pub main_port: u16,
    /// The port this process accepts its peers' tensors on.
    pub data_port: u16,
    /// The host the others reach this process at (`None`: found from the route to
    /// `main_addr`).
    pub node_host: Option<String>,
    /// How long any wait on the other processes may last.
    pub timeout: Duration,
    /// How long a process may be silent (no heartbeat) before the run fails.
    pub liveness: Duration,
    /// Whether the launcher hosts the rendezvous (otherwise rank 0 does).
    pub hosted_by_launcher: bool,
    /// The run's secret (`None`: none given, and not under torchrun; joining then fails).
    pub secret: Option<RunSecret>,
}

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
/// (`burn-accelerate launch --max-restarts`, or torchrun's), from [`env::RESTART_COUNT`](crate::env::RESTART_COUNT) or
/// torchrun's [`env::TORCHRUN_RESTART_COUNT`](crate::env::TORCHRUN_RESTART_COUNT); 0 when neither is set.
///
/// # Errors
/// [`DistributedError::InvalidVariable`] for a value that is not a whole number.
pub fn restart_count() -> Result<u64, DistributedError> {
    secret::restart_count(&|name: &str| std::env::var(name).ok())
}

/// The rendezvous [`serve_rendezvous`] started: it moves the run on to its next attempt.
#[derive(Clone)]
pub struct RendezvousHost(pub(crate) engine::tcp::rendezvous::Host);

impl RendezvousHost {
    /// The port it listens on: the one [`serve_rendezvous`] was given, or the system's pick
    /// when that was 0 (a run of one machine, whose processes are told it).
    pub fn port(&self) -> u16 {
        self.0.port()
    }

    /// Hears only the processes of attempt `attempt` from now on (0: the run's first start,
    /// `n` after `n` restarts, as [`env::RESTART_COUNT`](crate::env::RESTART_COUNT) numbers them): those of an earlier
    /// attempt, waiting or still to come, are refused, so that a process left over from a
    /// stopped attempt can never take a place in the restarted run.
    pub fn begin_attempt(&self, attempt: u64) {
        self.0.begin_attempt(attempt);
    }
}
