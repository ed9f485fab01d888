//! The rendezvous (the run's orchestrator): every process tells it where it accepts
//! connections, and once all have come, each gets the table of everyone's address, process id
//! and machine. Hosted by the launcher on the main machine, or by rank 0 when the processes
//! were started otherwise (as torch's TCP store is).
//!
//! Its messages are JSON in the transport's own frames. A round waits at most the run's
//! timeout from its first arrival, then tells every waiting process which ranks never came.
//!
//! A restarted run (`burn-accelerate launch --max-restarts`, torchrun's restarts) is a new
//! attempt: the handshake's `run` field carries the arriving process's attempt (authenticated
//! by the run's secret, as the rest of its hello), and the rendezvous hears only its current
//! attempt's processes. One of an earlier attempt that is still alive is refused (it can never
//! take a place in the restarted run); one of a later attempt (another machine's launcher
//! restarted first) is told to come back, until this machine's launcher starts that attempt
//! too, or its own timeout.
//!
//! The same listener takes the control connections of the other machines' launchers in an
//! elastic run (`--num-machines MIN:MAX`, see [`membership`](crate::membership)):
//! they name their own lane in the same authenticated handshake, so the main machine listens
//! on no port beyond the rendezvous's.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};

use super::auth::{self, HANDSHAKE_WITHIN, Hello};
use super::frame::{self, Fingerprint, Op};
use super::pending::{MAX_PENDING, Pending};
use crate::RunSecret;
use crate::element::Element;
use crate::error::DistributedError;

/// The longest rendezvous message read (a table of thousands of processes fits).
const MESSAGE_LIMIT: u64 = 16 << 20;

/// How long a connection to the rendezvous may take to say why it came.
const ARRIVAL_WITHIN: Duration = Duration::from_secs(10);

/// How many of the ranks that never came a timed-out round names.
const MISSING_LISTED: usize = 16;

/// The lane a handshake with the rendezvous names.
const LANE: u32 = u32::MAX - 1;

/// The lane a launcher's control connection names in its handshake.
const CONTROL_LANE: u32 = u32::MAX - 2;

/// A launcher's control connection, handshake done: the machine it says it is (its
/// `--machine-rank`), and its two halves.
pub(crate) type ControlStream = (u32, OwnedReadHalf, OwnedWriteHalf);

/// What machine 0's launcher says on a control connection (`membership`'s protocol; `P`
/// is the plan of an attempt).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum ToMember<P> {
    /// Start this machine's processes for the attempt.
    Attempt(P),
    /// Stop the processes of this attempt.
    Stop { attempt: u64 },
    /// The run is over.
    Finished { ok: bool, why: String },
    /// This launcher cannot take part: why.
    Refused(String),
    /// A heartbeat.
    Alive,
}

/// What another machine's launcher says on its control connection (`S`: the run's shape, as
/// it sees it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum ToCoordinator<S> {
    /// Who it is: its first message.
    Hello(S),
    /// Its processes of `attempt` ended (`ok`: all succeeded).
    Ended {
        attempt: u64,
        ok: bool,
        what: String,
    },
    /// A heartbeat.
    Alive,
}

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
    /// It is of a later attempt than the rendezvous's (which is this one): come back.
    Later(u64),
}

/// The processes that have come in the round in progress.
#[derive(Default)]
struct Round {
    number: u64,
    /// The attempt of the run whose processes are heard (0: the first start).
    attempt: u64,
    world_size: Option<usize>,
    waiting: BTreeMap<usize, (Peer, oneshot::Sender<Answer>)>,
}

/// A rendezvous this process serves: what starts the run's next attempt.
#[derive(Clone)]
pub(crate) struct Host {
    // The port it listens on (the system's pick when asked for port 0).
    port: u16,
    round: Arc<Mutex<Round>>,
    control: Arc<Mutex<Option<mpsc::UnboundedSender<ControlStream>>>>,
}

impl Host {
    /// The port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// From now on, the launchers' control connections come out of the receiver (until then,
    /// and once it is dropped, they are closed after their handshake).
    pub(crate) fn control_connections(&self) -> mpsc::UnboundedReceiver<ControlStream> {
        let (sender, receiver) = mpsc::unbounded_channel();
        *self.control.lock().unwrap_or_else(PoisonError::into_inner) = Some(sender);
        receiver
    }

    /// From now on hears only the processes of attempt `attempt`; those of the round in
    /// progress (an earlier attempt's) are refused.
    pub(crate) fn begin_attempt(&self, attempt: u64) {
        let mut r = self.round.lock().unwrap_or_else(PoisonError::into_inner);
        let earlier = r.attempt;
        r.attempt = attempt;
        if !r.waiting.is_empty() {
            r.close(|_| {
                Answer::Refused(format!(
                    "the run's attempt {} ended and attempt {} began while this process waited",
                    earlier + 1,
                    attempt + 1
                ))
            });
        }
    }
}

// Why a process of attempt `theirs` is refused by a rendezvous at attempt `ours` (earlier).
fn stale(theirs: u64, ours: u64) -> String {
    format!(
        "it belongs to attempt {} of the run ({}={theirs}), which is over: the run was \
         restarted and is at attempt {} now. A process left over from an earlier attempt \
         cannot join a later one: stop it",
        theirs + 1,
        crate::env::RESTART_COUNT,
        ours + 1
    )
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

/// Starts the rendezvous on `host:port` (port 0: one the system picks, [`Host::port`]) on
/// `runtime`; it serves until the process ends, to
/// processes that prove they know `secret` and are of its attempt (`secret`'s, until
/// [`Host::begin_attempt`]). Rounds time out `timeout` after their first arrival.
///
/// # Errors
/// [`DistributedError::PortUnavailable`] when the port cannot be listened on.
pub(crate) fn serve(
    host: &str,
    port: u16,
    timeout: Duration,
    secret: RunSecret,
    runtime: &Handle,
) -> Result<Host, DistributedError> {
    let listener = runtime
        .block_on(TcpListener::bind((host, port)))
        .map_err(|e| DistributedError::PortUnavailable {
            port,
            purpose: "the rendezvous",
            variable: crate::env::MASTER_PORT,
            reason: format!("{e} (listening on {host})"),
        })?;
    let listening = listener
        .local_addr()
        .map_err(|e| DistributedError::PortUnavailable {
            port,
            purpose: "the rendezvous",
            variable: crate::env::MASTER_PORT,
            reason: format!("{e} (listening on {host})"),
        })?
        .port();
    let round = Arc::new(Mutex::new(Round {
        attempt: secret.attempt(),
        ..Round::default()
    }));
    let served = Host {
        port: listening,
        round: Arc::clone(&round),
        control: Arc::default(),
    };
    let control = Arc::clone(&served.control);
    let secret = Arc::new(secret);
    let handle = runtime.clone();
    let pending = Pending::new(MAX_PENDING);
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
            let control = Arc::clone(&control);
            let ticket = pending.admit().await;
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let (mut reader, mut writer) = stream.into_split();
                let handshake = auth::accept(&mut reader, &mut writer, &secret);
                let handshake = tokio::time::timeout(HANDSHAKE_WITHIN, handshake);
                let hello = match ticket.handshake(handshake).await {
                    Some(Ok(Ok(hello))) => hello,
                    Some(Ok(Err(why))) => {
                        log::warn!("burn-accelerate: the rendezvous refused a connection: {why}");
                        return;
                    }
                    Some(Err(_)) => return,
                    None => {
                        auth::tell_busy(&writer);
                        return;
                    }
                };
                if hello.lane == CONTROL_LANE {
                    let sink = control
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    match sink {
                        Some(sink) => {
                            let _ = sink.send((hello.rank, reader, writer));
                        }
                        None => {
                            let why = format!(
                                "machine 0's launcher runs a fixed number of machines, this \
                                 one (machine {}) an elastic run: give every launcher the same \
                                 --num-machines",
                                hello.rank
                            );
                            log::warn!("burn-accelerate: refused a launcher: {why}");
                            let refused = ToMember::<()>::Refused(why);
                            let _ = control_send(&mut writer, &refused).await;
                        }
                    }
                    return;
                }
                // On the rendezvous's lane, the hello's `run` is the arriving process's attempt.
                let attempt = hello.run;
                let read = frame::read_message(&mut reader, MESSAGE_LIMIT);
                let Ok(Ok((_, message))) = tokio::time::timeout(ARRIVAL_WITHIN, read).await else {
                    return;
                };
                let answer = match serde_json::from_slice::<Arrival>(&message) {
                    Ok(arrival) => arrive(&round, arrival, attempt, timeout, &handle).await,
                    Err(err) => Answer::Refused(format!("not a rendezvous message: {err}")),
                };
                let bytes = serde_json::to_vec(&answer).expect("answers serialise");
                let _ = frame::write_message(&mut writer, FINGERPRINT, 0, 0, &bytes, frame::PIECE)
                    .await;
            });
        }
    });
    Ok(served)
}

async fn arrive(
    round: &Arc<Mutex<Round>>,
    arrival: Arrival,
    attempt: u64,
    timeout: Duration,
    runtime: &Handle,
) -> Answer {
    let (reply, answer) = oneshot::channel();
    {
        let mut r = round.lock().unwrap_or_else(PoisonError::into_inner);
        // Checked under the lock that `begin_attempt` takes: no process of an attempt that
        // has ended can slip into the next one's round.
        if attempt < r.attempt {
            return Answer::Refused(stale(attempt, r.attempt));
        }
        if attempt > r.attempt {
            return Answer::Later(r.attempt);
        }
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
                        // The first few only: the world size is the arrivals' word, and
                        // listing all of 2^64 held this lock for ever (found by issue 49's
                        // review of the rendezvous).
                        let missing: Vec<usize> = (0..world)
                            .filter(|rank| !came.contains_key(rank))
                            .take(MISSING_LISTED)
                            .collect();
                        let more = world - came.len() - missing.len();
                        let more = if more > 0 {
                            format!(" (and {more} more)")
                        } else {
                            String::new()
                        };
                        Answer::Refused(format!(
                            "ranks {missing:?}{more} of {world} never came within {timeout:?}: \
                             were they started, with the same MASTER_ADDR and MASTER_PORT?"
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

/// Comes to the rendezvous at `main` (`host:port`) as `rank` of `world_size`, for the attempt
/// of the run `secret` admits to; returns the run's number and every process, by rank. A
/// rendezvous still at an earlier attempt is asked again until it starts this one (or
/// `timeout`).
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
    loop {
        match ask(main, rank, world_size, &peer, secret, timeout, deadline).await? {
            Answer::Later(at) if tokio::time::Instant::now() < deadline => {
                log::info!(
                    "burn-accelerate: the rendezvous at {main} is at attempt {} of the run, this \
                     process at attempt {}: asking again",
                    at + 1,
                    secret.attempt() + 1
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Answer::Later(at) => {
                return Err(DistributedError::Timeout {
                    what: format!(
                        "the rendezvous {main} (at attempt {} of the run) to start this \
                         process's attempt {}",
                        at + 1,
                        secret.attempt() + 1
                    ),
                    after: timeout,
                    hint: "it stayed at an earlier attempt: did the main machine's launcher \
                           restart the run too (--max-restarts)?",
                });
            }
            Answer::Table { run, peers } if peers.len() == world_size => return Ok((run, peers)),
            Answer::Table { peers, .. } => {
                return Err(DistributedError::Rendezvous {
                    address: main.to_string(),
                    reason: format!(
                        "it answered with {} processes where the run has {world_size}",
                        peers.len()
                    ),
                });
            }
            Answer::Refused(reason) => {
                return Err(DistributedError::Rendezvous {
                    address: main.to_string(),
                    reason,
                });
            }
        }
    }
}

// One arrival at the rendezvous, up to its answer.
async fn ask(
    main: &str,
    rank: usize,
    world_size: usize,
    peer: &Peer,
    secret: &RunSecret,
    timeout: Duration,
    deadline: tokio::time::Instant,
) -> Result<Answer, DistributedError> {
    let refused = |reason: String| DistributedError::Rendezvous {
        address: main.to_string(),
        reason,
    };
    let hello = Hello {
        rank: rank as u32,
        lane: LANE,
        run: secret.attempt(),
    };
    // Again while the rendezvous has too many handshakes in progress (a flood) to take this
    // one, within the rendezvous's timeout.
    let (mut reader, mut writer) = loop {
        let stream = loop {
            if let Ok(Ok(stream)) =
                tokio::time::timeout_at(deadline, TcpStream::connect(main)).await
            {
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
        let connected = tokio::time::timeout(
            HANDSHAKE_WITHIN,
            auth::try_connect(&mut reader, &mut writer, secret, hello),
        )
        .await
        .map_err(|_| refused(format!("no handshake within {HANDSHAKE_WITHIN:?}")))?
        .map_err(refused)?;
        match connected {
            auth::Connected::Proved => break (reader, writer),
            auth::Connected::Busy if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            auth::Connected::Busy => return Err(refused(auth::BUSY_REASON.into())),
        }
    };
    let arrival = Arrival {
        rank,
        world_size,
        peer: peer.clone(),
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
    serde_json::from_slice::<Answer>(&answer.1)
        .map_err(|err| refused(format!("unreadable answer: {err}")))
}

/// Opens a launcher's control connection to the main machine's launcher at `main`
/// (`host:port`, its rendezvous), as machine `machine`, proving it knows `secret`.
///
/// # Errors
/// Why not, in words: nothing answers there (within `within`), or the handshake failed.
pub(crate) async fn control_connect(
    main: &str,
    machine: u32,
    secret: &RunSecret,
    within: Duration,
) -> Result<(OwnedReadHalf, OwnedWriteHalf), String> {
    let deadline = tokio::time::Instant::now() + within;
    let hello = Hello {
        rank: machine,
        lane: CONTROL_LANE,
        run: 0,
    };
    // Again while the rendezvous is too busy with other handshakes to take this one.
    loop {
        let stream = tokio::time::timeout_at(deadline, TcpStream::connect(main))
            .await
            .map_err(|_| format!("no answer within {within:?}"))?
            .map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        let (mut reader, mut writer) = stream.into_split();
        let connected = tokio::time::timeout(
            HANDSHAKE_WITHIN,
            auth::try_connect(&mut reader, &mut writer, secret, hello),
        )
        .await
        .map_err(|_| format!("no handshake within {HANDSHAKE_WITHIN:?}"))??;
        match connected {
            auth::Connected::Proved => return Ok((reader, writer)),
            auth::Connected::Busy if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            auth::Connected::Busy => return Err(auth::BUSY_REASON.into()),
        }
    }
}

/// Sends one control message (JSON in the transport's frames).
pub(crate) async fn control_send<W: AsyncWrite + Unpin>(
    writer: &mut W,
    message: &impl Serialize,
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(message).expect("control messages serialise");
    frame::write_message(writer, FINGERPRINT, 0, 0, &bytes, frame::PIECE).await
}

/// Reads one control message.
///
/// # Errors
/// Why none came, in words: the connection ended, or what came is not a control message.
pub(crate) async fn control_read<R: AsyncRead + Unpin, T: DeserializeOwned>(
    reader: &mut R,
) -> Result<T, String> {
    let (_, bytes) = frame::read_message(reader, MESSAGE_LIMIT)
        .await
        .map_err(|e| match e {
            frame::ReadError::Closed => "the connection was closed".to_string(),
            other => format!("the connection broke ({other:?})"),
        })?;
    serde_json::from_slice(&bytes).map_err(|e| format!("not a control message: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> Peer {
        Peer {
            address: "127.0.0.1:1".into(),
            pid: std::process::id(),
            machine: "this".into(),
            host: "this".into(),
        }
    }

    #[test]
    fn only_the_current_attempts_processes_are_heard() {
        let runtime = crate::loopback::runtime();
        let port = crate::loopback::free_port();
        let secret = RunSecret::from_text("a test's secret");
        let wait = Duration::from_secs(20);
        let host = serve(
            "127.0.0.1",
            port,
            wait,
            secret.clone().for_attempt(1),
            runtime.handle(),
        )
        .unwrap();
        let main = format!("127.0.0.1:{port}");
        let join_as = |attempt: u64| {
            let (main, secret) = (main.clone(), secret.clone().for_attempt(attempt));
            runtime.spawn(async move { join(&main, 0, 1, peer(), &secret, wait).await })
        };

        // Left over from the first attempt: refused at once, saying so.
        let stale = runtime.block_on(join_as(0)).unwrap().unwrap_err();
        let said = stale.to_string();
        assert!(
            said.contains("belongs to attempt 1 of the run")
                && said.contains("is at attempt 2 now"),
            "{said}"
        );
        // The current attempt's process is heard.
        let (_, peers) = runtime.block_on(join_as(1)).unwrap().unwrap();
        assert_eq!(peers, [peer()]);
        // One of the next attempt (another machine restarted first) waits for it.
        let early = join_as(2);
        std::thread::sleep(Duration::from_millis(700));
        assert!(!early.is_finished());
        host.begin_attempt(2);
        let (_, peers) = runtime.block_on(early).unwrap().unwrap();
        assert_eq!(peers, [peer()]);
        let stale = runtime.block_on(join_as(1)).unwrap().unwrap_err();
        assert!(stale.to_string().contains("at attempt 3 now"), "{stale}");
    }

    #[test]
    fn a_round_of_a_huge_world_times_out_naming_a_few_missing_ranks() {
        let runtime = crate::loopback::runtime();
        let port = crate::loopback::free_port();
        let secret = RunSecret::from_text("a test's secret");
        let wait = Duration::from_millis(300);
        let _host = serve("127.0.0.1", port, wait, secret.clone(), runtime.handle()).unwrap();
        let main = format!("127.0.0.1:{port}");
        let err = runtime
            .block_on(join(&main, 0, usize::MAX, peer(), &secret, wait))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ranks [1, 2,") && err.contains(&format!("{} more", usize::MAX - 17)),
            "{err}"
        );
    }

    #[test]
    fn a_flood_past_the_cap_pushes_out_the_oldest_and_a_real_process_still_joins() {
        use std::io::Read;

        let runtime = crate::loopback::runtime();
        let port = crate::loopback::free_port();
        let secret = RunSecret::from_text("a test's secret");
        let wait = Duration::from_secs(20);
        let _host = serve("127.0.0.1", port, wait, secret.clone(), runtime.handle()).unwrap();
        // Twice the cap of silent connections, each challenged, none answering.
        let mut silent: Vec<_> = (0..2 * MAX_PENDING)
            .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        // A real process arriving in the middle of the flood joins, within less than a silent
        // connection's handshake timeout.
        let main = format!("127.0.0.1:{port}");
        let within = HANDSHAKE_WITHIN / 2;
        let (_, peers) = runtime
            .block_on(join(&main, 0, 1, peer(), &secret, within))
            .unwrap();
        assert_eq!(peers, [peer()]);
        // The oldest were pushed out: challenged, then told to try again, then closed.
        let first = &mut silent[0];
        first.set_read_timeout(Some(wait)).unwrap();
        let mut heard = Vec::new();
        first.read_to_end(&mut heard).unwrap();
        assert_eq!(heard.len(), 36 + auth::BUSY.len(), "{heard:?}");
        assert!(heard.ends_with(&auth::BUSY));
        // The newest are still in their handshake (nothing more than the challenge).
        let last = silent.last_mut().unwrap();
        last.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut challenge = [0u8; 36];
        last.read_exact(&mut challenge).unwrap();
        assert!(last.read(&mut [0u8; 1]).is_err(), "the newest was dropped");
    }

    // The property tests of issue 49 (SECURITY.md): every message of the rendezvous and the
    // launchers' control connections, read from anything an authenticated peer could send.

    use proptest::prelude::*;
    use serde::de::DeserializeOwned;

    use crate::fuzz;
    use crate::membership::{AttemptPlan, Shape};

    fn framed(message: &impl Serialize) -> Vec<u8> {
        let mut wire = Vec::new();
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(control_send(&mut wire, message))
            .unwrap();
        wire
    }

    fn messages() -> impl Strategy<Value = Vec<u8>> {
        let shape = Shape {
            min: 1,
            max: 4,
            local: 2,
        };
        let plan = AttemptPlan {
            attempt: 3,
            machine_rank: 1,
            machines: vec![0, 2, 5],
        };
        fuzz::inputs(
            vec![
                framed(&Arrival {
                    rank: 1,
                    world_size: 4,
                    peer: peer(),
                }),
                framed(&Answer::Table {
                    run: 7,
                    peers: vec![peer(), peer()],
                }),
                framed(&Answer::Later(2)),
                framed(&ToCoordinator::Hello(shape)),
                framed(&ToCoordinator::<Shape>::Ended {
                    attempt: 1,
                    ok: false,
                    what: "rank 3 exited with 1".into(),
                }),
                framed(&ToMember::Attempt(plan)),
                framed(&ToMember::<AttemptPlan>::Finished {
                    ok: true,
                    why: String::new(),
                }),
            ],
            256,
        )
    }

    fn read_as<T: DeserializeOwned>(wire: &[u8]) -> (usize, Result<T, String>) {
        fuzz::largest_allocation(|| {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(control_read::<_, T>(&mut &wire[..]))
        })
    }

    fn every_message_type_reads_or_says_why(wire: Vec<u8>) -> Result<(), TestCaseError> {
        let results = [
            read_as::<Arrival>(&wire).map_err_only(),
            read_as::<Answer>(&wire).map_err_only(),
            read_as::<ToCoordinator<Shape>>(&wire).map_err_only(),
            read_as::<ToMember<AttemptPlan>>(&wire).map_err_only(),
        ];
        for (largest, error) in results {
            // A message is at most MESSAGE_LIMIT; the input here is far smaller.
            prop_assert!(largest <= MESSAGE_LIMIT as usize, "{largest} bytes");
            if let Some(why) = error {
                prop_assert!(!why.is_empty());
            }
        }
        Ok(())
    }

    trait ErrOnly {
        fn map_err_only(self) -> (usize, Option<String>);
    }

    impl<T> ErrOnly for (usize, Result<T, String>) {
        fn map_err_only(self) -> (usize, Option<String>) {
            (self.0, self.1.err())
        }
    }

    #[test]
    fn any_control_or_rendezvous_message_reads_or_says_why() {
        fuzz::check(2000, messages(), every_message_type_reads_or_says_why);
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_rendezvous_messages() {
        fuzz::long_run(
            "rendezvous and control messages",
            messages(),
            every_message_type_reads_or_says_why,
        );
    }
}
