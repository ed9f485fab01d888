//! The rendezvous (the run's orchestrator): every process tells it where it accepts tensors,
//! and once all have come, each gets the table of everyone's address. Hosted by the launcher on
//! the main machine, or by rank 0 when the processes were started otherwise (as torch's TCP
//! store is).
//!
//! It runs on burn-communication's WebSocket server and client, the transport burn-collective's
//! orchestrator uses. A round waits at most the run's timeout from its first arrival, then
//! tells every waiting process which ranks never came.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use burn_communication::websocket::{WsClient, WsServer};
use burn_communication::{CommunicationChannel, Message, ProtocolClient, ProtocolServer};
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::error::DistributedError;

const ROUTE: &str = "rendezvous";

/// What a process says when it arrives.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Arrival {
    rank: usize,
    world_size: usize,
    address: String,
}

/// What it is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Answer {
    /// Everyone came: their addresses by rank, and the run's number.
    Table { run: u64, addresses: Vec<String> },
    /// This process cannot take part.
    Refused(String),
}

/// The processes that have come in the round in progress.
#[derive(Default)]
struct Round {
    number: u64,
    world_size: Option<usize>,
    waiting: BTreeMap<usize, (String, oneshot::Sender<Answer>)>,
}

impl Round {
    // Answers everyone waiting and starts the next round.
    fn close(&mut self, answer: impl Fn(&BTreeMap<usize, String>) -> Answer) {
        let waiting = std::mem::take(&mut self.waiting);
        let addresses = waiting
            .iter()
            .map(|(rank, (address, _))| (*rank, address.clone()))
            .collect();
        let answer = answer(&addresses);
        for (_, (_, reply)) in waiting {
            let _ = reply.send(answer.clone());
        }
        self.world_size = None;
        self.number += 1;
    }
}

/// Starts the rendezvous on `port` (all interfaces) on `runtime`; it serves until the
/// process ends. Rounds time out `timeout` after their first arrival.
///
/// # Errors
/// [`DistributedError::PortUnavailable`] when the port cannot be listened on.
pub(crate) fn serve(
    port: u16,
    timeout: Duration,
    runtime: &Handle,
) -> Result<(), DistributedError> {
    let round = Arc::new(Mutex::new(Round::default()));
    let handle = runtime.clone();
    let server = WsServer::new(port).route(ROUTE, move |mut channel| {
        let round = Arc::clone(&round);
        let handle = handle.clone();
        async move {
            let Ok(Some(message)) = channel.recv().await else {
                return;
            };
            let answer = match serde_json::from_slice::<Arrival>(&message.data) {
                Ok(arrival) => arrive(&round, arrival, timeout, &handle).await,
                Err(err) => Answer::Refused(format!("not a rendezvous message: {err}")),
            };
            let bytes = serde_json::to_vec(&answer).expect("answers serialise");
            let _ = channel.send(Message::new(bytes.into())).await;
        }
    });
    serve_on(
        server,
        port,
        "the rendezvous",
        super::env::MASTER_PORT,
        runtime,
    )
}

async fn arrive(
    round: &Arc<Mutex<Round>>,
    arrival: Arrival,
    timeout: Duration,
    runtime: &Handle,
) -> Answer {
    let (reply, answer) = oneshot::channel();
    {
        let mut r = round.lock().unwrap_or_else(PoisonError::into_inner);
        let world = *r.world_size.get_or_insert(arrival.world_size);
        if arrival.world_size != world || arrival.rank >= world {
            return Answer::Refused(format!(
                "it is rank {} of {} but the processes already here are of a run of {world}: \
                 every process must have the same WORLD_SIZE",
                arrival.rank, arrival.world_size
            ));
        }
        if r.waiting.is_empty() {
            // The first arrival starts the round's clock.
            let number = r.number;
            let round = Arc::clone(round);
            runtime.spawn(async move {
                tokio::time::sleep(timeout).await;
                let mut r = round.lock().unwrap_or_else(PoisonError::into_inner);
                if r.number == number && !r.waiting.is_empty() {
                    let world = r.world_size.unwrap_or(0);
                    r.close(|came| {
                        let missing: Vec<usize> =
                            (0..world).filter(|rank| !came.contains_key(rank)).collect();
                        Answer::Refused(format!(
                            "ranks {missing:?} of {world} never came within {timeout:?}: were \
                             they started, with the same MASTER_ADDR and MASTER_PORT?"
                        ))
                    });
                }
            });
        }
        if let Some((_, earlier)) = r.waiting.insert(arrival.rank, (arrival.address, reply)) {
            let _ = earlier.send(Answer::Refused(format!(
                "another process came as rank {} too: every process needs its own RANK",
                arrival.rank
            )));
        }
        if r.waiting.len() == world {
            let run = r.number ^ (std::process::id() as u64) << 32;
            r.close(|came| Answer::Table {
                run,
                addresses: came.values().cloned().collect(),
            });
        }
    }
    answer
        .await
        .unwrap_or_else(|_| Answer::Refused("the rendezvous stopped".into()))
}

/// Comes to the rendezvous at `main` (`host:port`) as `rank` of `world_size`, reachable at
/// `address`; returns the run's number and every process's address, by rank.
///
/// # Errors
/// [`DistributedError::Timeout`] when no rendezvous answers or not every process comes in
/// time; [`DistributedError::Rendezvous`] when it refuses this process.
pub(crate) async fn join(
    main: &str,
    rank: usize,
    world_size: usize,
    address: String,
    timeout: Duration,
) -> Result<(u64, Vec<String>), DistributedError> {
    let url = format!("ws://{main}");
    let deadline = tokio::time::Instant::now() + timeout;
    let mut channel = loop {
        if let Some(channel) =
            WsClient::connect(url.parse().expect("any text is an address"), ROUTE).await
        {
            break channel;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(DistributedError::Timeout {
                what: format!("the rendezvous at {url}"),
                after: timeout,
                hint: "nothing answers there: is the launcher (or rank 0) running, and are \
                       MASTER_ADDR and MASTER_PORT the same for every process?",
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let arrival = Arrival {
        rank,
        world_size,
        address,
    };
    let bytes = serde_json::to_vec(&arrival).expect("arrivals serialise");
    let refused = |reason: String| DistributedError::Rendezvous {
        address: url.clone(),
        reason,
    };
    channel
        .send(Message::new(bytes.into()))
        .await
        .map_err(|e| refused(format!("{e:?}")))?;
    // The rendezvous answers by its own clock; this one only guards against its loss.
    let answer = tokio::time::timeout_at(deadline + Duration::from_secs(10), channel.recv())
        .await
        .map_err(|_| DistributedError::Timeout {
            what: format!("all {world_size} processes at the rendezvous {url}"),
            after: timeout,
            hint: "some processes never came",
        })?
        .map_err(|e| refused(format!("{e:?}")))?
        .ok_or_else(|| refused("it closed the connection".into()))?;
    match serde_json::from_slice::<Answer>(&answer.data) {
        Ok(Answer::Table { run, addresses }) => Ok((run, addresses)),
        Ok(Answer::Refused(reason)) => Err(refused(reason)),
        Err(err) => Err(refused(format!("unreadable answer: {err}"))),
    }
}

/// Starts `server` on `port` (all interfaces) on `runtime`, until the process ends.
///
/// # Errors
/// [`DistributedError::PortUnavailable`], naming `variable`, when the port is taken: checked
/// before starting, and again by waiting a moment for the server's own bind to fail (another
/// process may take the port in between; a server that never listened would leave the others
/// waiting for the whole timeout).
pub(crate) fn serve_on(
    server: WsServer,
    port: u16,
    purpose: &'static str,
    variable: &'static str,
    runtime: &Handle,
) -> Result<(), DistributedError> {
    let unavailable = |reason: String| DistributedError::PortUnavailable {
        port,
        purpose,
        variable,
        reason,
    };
    std::net::TcpListener::bind(("0.0.0.0", port))
        .map(drop)
        .map_err(|e| unavailable(e.to_string()))?;
    super::quiet_transport_logs();
    let (failed, failure) = std::sync::mpsc::channel();
    runtime.spawn(async move {
        let outcome = server.serve(std::future::pending()).await;
        if let Err(err) = &outcome {
            log::error!("burn-accelerate: {purpose} on port {port} stopped: {err:?}");
        }
        let _ = failed.send(outcome.map_err(|err| format!("{err:?}")));
    });
    match failure.recv_timeout(Duration::from_millis(100)) {
        Ok(Err(reason)) => Err(unavailable(reason)),
        _ => Ok(()),
    }
}
