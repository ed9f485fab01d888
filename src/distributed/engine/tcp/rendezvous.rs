//! The rendezvous (the run's orchestrator): every process tells it where it accepts
//! connections, and once all have come, each gets the table of everyone's address, process id
//! and machine. Hosted by the launcher on the main machine, or by rank 0 when the processes
//! were started otherwise (as torch's TCP store is).
//!
//! Its messages are JSON in the transport's own frames. A round waits at most the run's
//! timeout from its first arrival, then tells every waiting process which ranks never came.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::auth::{self, HANDSHAKE_WITHIN, Hello};
use super::frame::{self, Fingerprint, Op};
use crate::distributed::RunSecret;
use crate::distributed::element::Element;
use crate::distributed::error::DistributedError;

/// The longest rendezvous message read (a table of thousands of processes fits).
const MESSAGE_LIMIT: u64 = 16 << 20;

/// How long a connection to the rendezvous may take to say why it came.
const ARRIVAL_WITHIN: Duration = Duration::from_secs(10);

/// The lane a handshake with the rendezvous names.
const LANE: u32 = u32::MAX - 1;

const FINGERPRINT: Fingerprint = Fingerprint {
    op: Op::Rendezvous,
    element: Element::Bytes,
    count: 0,
};

/// Where a process is, and which it is: what its peers need to reach it and, when a
/// connection ends, to tell whether it exited.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Peer {
    /// `host:port` it accepts connections on.
    pub(crate) address: String,
    /// Its process id.
    pub(crate) pid: u32,
    /// Its machine (the boot id where there is one, else the host name).
    pub(crate) machine: String,
    /// Its machine's host name, for messages.
    pub(crate) host: String,
}

/// What a process says when it arrives.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Arrival {
    rank: usize,
    world_size: usize,
    peer: Peer,
}

/// What it is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Answer {
    /// Everyone came: who they are, by rank, and the run's number.
    Table { run: u64, peers: Vec<Peer> },
    /// This process cannot take part.
    Refused(String),
}

/// The processes that have come in the round in progress.
#[derive(Default)]
struct Round {
    number: u64,
    world_size: Option<usize>,
    waiting: BTreeMap<usize, (Peer, oneshot::Sender<Answer>)>,
}

impl Round {
    // Answers everyone waiting and starts the next round.
    fn close(&mut self, answer: impl Fn(&BTreeMap<usize, Peer>) -> Answer) {
        let waiting = std::mem::take(&mut self.waiting);
        let came = waiting
            .iter()
            .map(|(rank, (peer, _))| (*rank, peer.clone()))
            .collect();
        let answer = answer(&came);
        for (_, (_, reply)) in waiting {
            let _ = reply.send(answer.clone());
        }
        self.world_size = None;
        self.number += 1;
    }
}

/// Starts the rendezvous on `host:port` on `runtime`; it serves until the process ends, to
/// processes that prove they know `secret`. Rounds time out `timeout` after their first
/// arrival.
///
/// # Errors
/// [`DistributedError::PortUnavailable`] when the port cannot be listened on.
pub(crate) fn serve(
    host: &str,
    port: u16,
    timeout: Duration,
    secret: RunSecret,
    runtime: &Handle,
) -> Result<(), DistributedError> {
    let listener = runtime
        .block_on(TcpListener::bind((host, port)))
        .map_err(|e| DistributedError::PortUnavailable {
            port,
            purpose: "the rendezvous",
            variable: crate::distributed::env::MASTER_PORT,
            reason: format!("{e} (listening on {host})"),
        })?;
    let round = Arc::new(Mutex::new(Round::default()));
    let secret = Arc::new(secret);
    let handle = runtime.clone();
    runtime.spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    log::warn!("burn-accelerate: accepting at the rendezvous: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let round = Arc::clone(&round);
            let handle = handle.clone();
            let secret = Arc::clone(&secret);
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let (mut reader, mut writer) = stream.into_split();
                let handshake = auth::accept(&mut reader, &mut writer, &secret);
                match tokio::time::timeout(HANDSHAKE_WITHIN, handshake).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(why)) => {
                        log::warn!("burn-accelerate: the rendezvous refused a connection: {why}");
                        return;
                    }
                    Err(_) => return,
                }
                let read = frame::read_message(&mut reader, MESSAGE_LIMIT);
                let Ok(Ok((_, message))) = tokio::time::timeout(ARRIVAL_WITHIN, read).await else {
                    return;
                };
                let answer = match serde_json::from_slice::<Arrival>(&message) {
                    Ok(arrival) => arrive(&round, arrival, timeout, &handle).await,
                    Err(err) => Answer::Refused(format!("not a rendezvous message: {err}")),
                };
                let bytes = serde_json::to_vec(&answer).expect("answers serialise");
                let _ = frame::write_message(&mut writer, FINGERPRINT, 0, 0, &bytes, frame::PIECE)
                    .await;
            });
        }
    });
    Ok(())
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
        if let Some((_, earlier)) = r.waiting.insert(arrival.rank, (arrival.peer, reply)) {
            let _ = earlier.send(Answer::Refused(format!(
                "another process came as rank {} too: every process needs its own RANK",
                arrival.rank
            )));
        }
        if r.waiting.len() == world {
            // A number no other run (nor an earlier round of this one) shares, so that a
            // process of another run that finds these ports is told apart.
            let run = RandomState::new().hash_one(r.number);
            r.close(|came| Answer::Table {
                run,
                peers: came.values().cloned().collect(),
            });
        }
    }
    answer
        .await
        .unwrap_or_else(|_| Answer::Refused("the rendezvous stopped".into()))
}

/// Comes to the rendezvous at `main` (`host:port`) as `rank` of `world_size`; returns the
/// run's number and every process, by rank.
///
/// # Errors
/// [`DistributedError::Timeout`] when no rendezvous answers or not every process comes in
/// time; [`DistributedError::Rendezvous`] when it refuses this process.
pub(crate) async fn join(
    main: &str,
    rank: usize,
    world_size: usize,
    peer: Peer,
    secret: &RunSecret,
    timeout: Duration,
) -> Result<(u64, Vec<Peer>), DistributedError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let stream = loop {
        if let Ok(Ok(stream)) = tokio::time::timeout_at(deadline, TcpStream::connect(main)).await {
            break stream;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(DistributedError::Timeout {
                what: format!("the rendezvous at {main}"),
                after: timeout,
                hint: "nothing answers there: is the launcher (or rank 0) running, and are \
                       MASTER_ADDR and MASTER_PORT the same for every process?",
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    let refused = |reason: String| DistributedError::Rendezvous {
        address: main.to_string(),
        reason,
    };
    let hello = Hello {
        rank: rank as u32,
        lane: LANE,
        run: 0,
    };
    tokio::time::timeout(
        HANDSHAKE_WITHIN,
        auth::connect(&mut reader, &mut writer, secret, hello),
    )
    .await
    .map_err(|_| refused(format!("no handshake within {HANDSHAKE_WITHIN:?}")))?
    .map_err(refused)?;
    let arrival = Arrival {
        rank,
        world_size,
        peer,
    };
    let bytes = serde_json::to_vec(&arrival).expect("arrivals serialise");
    frame::write_message(&mut writer, FINGERPRINT, 0, 0, &bytes, frame::PIECE)
        .await
        .map_err(|e| refused(e.to_string()))?;
    // The rendezvous answers by its own clock; this one only guards against its loss.
    let answer = tokio::time::timeout_at(
        deadline + Duration::from_secs(10),
        frame::read_message(&mut reader, MESSAGE_LIMIT),
    )
    .await
    .map_err(|_| DistributedError::Timeout {
        what: format!("all {world_size} processes at the rendezvous {main}"),
        after: timeout,
        hint: "some processes never came",
    })?
    .map_err(|e| refused(format!("its answer did not arrive ({e:?})")))?;
    match serde_json::from_slice::<Answer>(&answer.1) {
        Ok(Answer::Table { run, peers }) if peers.len() == world_size => Ok((run, peers)),
        Ok(Answer::Table { peers, .. }) => Err(refused(format!(
            "it answered with {} processes where the run has {world_size}",
            peers.len()
        ))),
        Ok(Answer::Refused(reason)) => Err(refused(reason)),
        Err(err) => Err(refused(format!("unreadable answer: {err}"))),
    }
}
