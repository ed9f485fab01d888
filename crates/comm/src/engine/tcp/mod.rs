//! The built-in engine (gloo's role): plain TCP between the processes, with a framing of its
//! own ([`frame`]), one connection per neighbour and lane ([`link`]), a rendezvous
//! ([`rendezvous`]) and the ring's collectives ([`ring`], on [`schedule`]).
//!
//! ## Why not burn-communication's WebSocket layer
//!
//! Up to this engine the transport was burn-communication 0.21's WebSocket server and client.
//! Read at the pinned version, it cannot carry a model's gradients, nor be held to what a run
//! needs:
//! - its server (`burn-communication-0.21.0/src/websocket/server.rs`) upgrades connections with
//!   axum's `WebSocketUpgrade` defaults, which cap a frame at 16 MiB and a message at 64 MiB
//!   (`axum-0.8.9/src/extract/ws.rs`), with no way to change them: the receiver drops the
//!   connection past them, so a 16.8M-value gradient could not be all-reduced;
//! - it binds `0.0.0.0` (`format!("0.0.0.0:{}", self.port)`, same file), so a run of one
//!   machine would listen on every interface;
//! - a connection that ends without a close frame panics in its `recv` (`None => todo!()`,
//!   same file and `client.rs`);
//! - its client masks every frame it sends (tungstenite, as RFC 6455 requires of clients): a
//!   pass over every byte on each side, on top of the copies into and out of its messages.
//!
//! A TCP connection with a 44-byte header per megabyte piece has none of these: any length,
//! writes straight from the caller's buffer, reads straight into pieces that are added into
//! it, and every way a connection ends is told apart ([`frame::ReadError`]).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Runtime;
use tokio::sync::Mutex;

use super::{Engine, Lane, Tag};
use crate::element::Element;
use crate::env;
use crate::error::DistributedError;
use crate::rendezvous::Rendezvous;

mod auth;
mod control;
pub(crate) mod frame;
mod link;
mod pending;
pub(crate) mod rendezvous;
mod ring;
mod schedule;

pub use ring::sent_bytes;

use control::{Control, Roster};
use frame::{Fingerprint, Op, ReadError};
use link::{COLLECTIVES, CONTROL, DialError, Incoming, Links, Outgoing};
use rendezvous::Peer;
use ring::{Failure, Flow, Ring};

/// The built-in engine of one process.
pub struct TcpEngine {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Liveness, aborts, and who every process is.
    control: Arc<Control>,
    links: Arc<Links>,
    next: Arc<Mutex<Outgoing>>,
    prev: Arc<Mutex<Incoming>>,
    // Last, so that the connections' tasks end with it.
    runtime: Runtime,
}

impl TcpEngine {
    /// Joins the run as `rank` of `world_size`: listens for peers, comes to the rendezvous
    /// (serving it first if this is rank 0 and no launcher does), and connects the ring.
    pub fn join(
        rank: usize,
        world_size: usize,
        rendezvous: &Rendezvous,
    ) -> Result<Self, DistributedError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("burn-accelerate-net")
            .enable_all()
            .build()
            .map_err(|e| DistributedError::Io {
                what: "starting the network runtime".into(),
                reason: e.to_string(),
            })?;
        let timeout = rendezvous.timeout;
        let secret = rendezvous
            .secret
            .clone()
            .ok_or(DistributedError::MissingVariable {
                name: env::SECRET,
                because: "every connection of a run proves it knows the run's secret",
                fix: "set it to the same text in every process (`burn-accelerate secret` \
                      writes one), or start the processes with `burn-accelerate launch`, which \
                      makes one",
            })?;
        if rank == 0 && !rendezvous.hosted_by_launcher {
            rendezvous::serve(
                &rendezvous.main_addr,
                rendezvous.main_port,
                timeout,
                secret.clone(),
                runtime.handle(),
            )?;
        }
        let host = match &rendezvous.node_host {
            Some(host) => host.clone(),
            None => route_to(&rendezvous.main_addr, rendezvous.main_port)?,
        };
        // Peers reach this process at `host`: listening there, not on every interface, keeps
        // a run of one machine on loopback.
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind((
                host.as_str(),
                rendezvous.data_port,
            )))
            .map_err(|e| DistributedError::PortUnavailable {
                port: rendezvous.data_port,
                purpose: "peer connections",
                variable: env::DATA_PORT,
                reason: format!("{e} (listening on {host})"),
            })?;
        // The port listened on: the one asked for, or the system's pick for port 0.
        let data_port = listener
            .local_addr()
            .map_err(|e| DistributedError::PortUnavailable {
                port: rendezvous.data_port,
                purpose: "peer connections",
                variable: env::DATA_PORT,
                reason: format!("{e} (listening on {host})"),
            })?
            .port();
        let machine = machine_id();
        let me = Peer {
            address: host_port(&host, data_port),
            pid: std::process::id(),
            machine: machine.clone(),
            host: host_name(),
        };
        let main = host_port(&rendezvous.main_addr, rendezvous.main_port);
        let (links, control, next, prev) = runtime.block_on(async {
            let links = Links::listen(listener, rank, world_size, secret.clone());
            let (run, peers) =
                rendezvous::join(&main, rank, world_size, me, &secret, timeout).await?;
            links.set_run(run);
            let next_rank = (rank + 1) % world_size;
            let prev_rank = (rank + world_size - 1) % world_size;
            let next_address = &peers[next_rank].address;
            let next = links
                .outgoing(next_rank, COLLECTIVES, next_address, timeout)
                .await
                .map_err(|e| dial_failed(next_rank, &peers[next_rank], e, timeout))?;
            let to_next = links
                .dial_raw(CONTROL, next_address, timeout)
                .await
                .map_err(|e| dial_failed(next_rank, &peers[next_rank], e, timeout))?;
            let never_connected = |what: &str| DistributedError::Timeout {
                what: format!("process {prev_rank}'s {what} connection"),
                after: timeout,
                hint: "it reached the rendezvous but never connected: is this machine \
                       reachable from its machine at the address it was given \
                       (BURN_ACCELERATE_NODE_HOST)?",
            };
            let prev = tokio::time::timeout(timeout, links.incoming(prev_rank, COLLECTIVES))
                .await
                .map_err(|_| never_connected("data"))?
                .map_err(|e| DistributedError::ConnectionFailed {
                    rank: prev_rank,
                    during: "joining".into(),
                    reason: format!("{e:?}"),
                })?;
            let from_prev = tokio::time::timeout(timeout, links.take_raw(prev_rank, CONTROL))
                .await
                .map_err(|_| never_connected("control"))?;
            let roster = Arc::new(Roster { peers, machine });
            let control = Control::start(
                rank,
                roster,
                rendezvous.liveness,
                vec![(next_rank, to_next), (prev_rank, from_prev)],
            );
            Ok::<_, DistributedError>((links, control, next, prev))
        })?;
        log::info!("burn-accelerate: joined the run as process {rank} of {world_size}");
        Ok(Self {
            rank,
            world_size,
            timeout,
            control,
            links,
            next,
            prev,
            runtime,
        })
    }

    fn ring(&self, fingerprint: Fingerprint, seq: u64) -> Ring<'_> {
        Ring {
            rank: self.rank,
            n: self.world_size,
            next: &self.next,
            prev: &self.prev,
            fingerprint,
            seq,
        }
    }

    // Runs a collective to its end, the run's timeout, or the run's failure anywhere; a
    // failure here names the process and what became of it, and ends the run's collectives on
    // every process.
    fn run<T>(
        &self,
        during: String,
        work: impl std::future::Future<Output = Flow<T>>,
    ) -> Result<T, DistributedError> {
        self.runtime.block_on(async {
            if let Some(err) = self.control.failure() {
                return Err(err);
            }
            tokio::select! {
                biased;
                outcome = tokio::time::timeout(self.timeout, work) => {
                    let err = match outcome {
                        Ok(Ok(value)) => return Ok(value),
                        Ok(Err((peer, failure))) => {
                            let err = self.control.roster.lost(peer, during, failure).await;
                            // A process that ended on purpose said why just before, on the
                            // control connection: that says more than its closed socket.
                            tokio::select! {
                                told = self.control.failed() => return Err(told),
                                () = tokio::time::sleep(Duration::from_millis(100)) => err,
                            }
                        }
                        Err(_) => DistributedError::Timeout {
                            what: during,
                            after: self.timeout,
                            hint: "another process did not reach the same collective: is one \
                                   stuck, or making other collective calls?",
                        },
                    };
                    // Told before returning: the caller may end the process on this error.
                    self.control.fail_now(err.clone()).await;
                    Err(err)
                }
                err = self.control.failed() => Err(err),
            }
        })
    }
}

impl Engine for TcpEngine {
    fn all_reduce(
        &self,
        seq: u64,
        element: Element,
        data: &mut [u8],
    ) -> Result<(), DistributedError> {
        let size = element.size();
        let count = data.len() / size;
        let n = self.world_size;
        let blocks = super::blocks(
            (0..n).map(|b| schedule::even_block(count, n, b).len()),
            size,
        );
        let fingerprint = Fingerprint {
            op: Op::AllReduce,
            element,
            count: count as u64,
        };
        let ring = self.ring(fingerprint, seq);
        self.run(fingerprint.during(seq), async {
            ring.reduce_scatter(element, data, &blocks).await?;
            ring.all_gather(data, &blocks, (n - 1) as u32).await
        })
    }

    fn reduce_scatter(
        &self,
        seq: u64,
        element: Element,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Result<(), DistributedError> {
        let fingerprint = Fingerprint {
            op: Op::ReduceScatter,
            element,
            count: (data.len() / element.size()) as u64,
        };
        let ring = self.ring(fingerprint, seq);
        self.run(
            fingerprint.during(seq),
            ring.reduce_scatter(element, data, blocks),
        )
    }

    fn all_gather(
        &self,
        seq: u64,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Result<(), DistributedError> {
        let fingerprint = Fingerprint {
            op: Op::AllGather,
            element: Element::Bytes,
            count: data.len() as u64,
        };
        let ring = self.ring(fingerprint, seq);
        self.run(fingerprint.during(seq), ring.all_gather(data, blocks, 0))
    }

    fn broadcast(&self, seq: u64, root: usize, data: &mut Vec<u8>) -> Result<(), DistributedError> {
        let fingerprint = Fingerprint {
            op: Op::Broadcast,
            element: Element::Bytes,
            count: 0,
        };
        let ring = self.ring(fingerprint, seq);
        self.run(
            format!("{} from process {root}", fingerprint.during(seq)),
            ring.broadcast(root, data),
        )
    }

    fn send(
        &self,
        lane: Lane,
        to: usize,
        tag: Tag,
        payload: &[u8],
    ) -> Result<(), DistributedError> {
        // Named in its errors: a timeout says nothing of the process otherwise.
        let during = format!(
            "stream {lane}'s message {}.{} to process {to}",
            tag.0, tag.1
        );
        let peer = &self.control.roster.peers[to];
        let outgoing = self.runtime.block_on(async {
            self.links
                .outgoing(to, lane, &peer.address, self.timeout)
                .await
                .map_err(|e| dial_failed(to, peer, e, self.timeout))
        })?;
        self.run(during, async {
            let mut outgoing = outgoing.lock().await;
            frame::write_message(
                &mut outgoing.writer,
                STREAM,
                tag.0,
                tag.1,
                payload,
                frame::PIECE,
            )
            .await
            .map_err(|e| (to, Failure::Write(e)))
        })
    }

    fn recv(&self, lane: Lane, from: usize) -> Result<(Tag, Vec<u8>), DistributedError> {
        let during = format!("stream {lane}'s next message from process {from}");
        self.run(during, async {
            let incoming = self
                .links
                .incoming(from, lane)
                .await
                .map_err(|e| (from, Failure::Read(e)))?;
            let mut incoming = incoming.lock().await;
            let mut message = incoming
                .message()
                .await
                .map_err(|e| (from, Failure::Read(e)))?;
            let header = *message.header();
            if header.fingerprint != STREAM {
                let detail = format!(
                    "it sent {} on a stream",
                    header.fingerprint.during(header.seq)
                );
                return Err((from, Failure::Disagree(detail)));
            }
            let mut payload = Vec::new();
            frame::reserve_claimed(&mut payload, header.total).map_err(|why| {
                let detail = format!("a stream message: {why}");
                (from, Failure::Read(ReadError::Malformed(detail)))
            })?;
            while let Some(piece) = message.next().await.map_err(|e| (from, Failure::Read(e)))? {
                payload.extend_from_slice(piece.bytes());
            }
            Ok(((header.seq, header.step), payload))
        })
    }

    fn abort(&self, reason: String) {
        let err = DistributedError::Aborted {
            rank: self.rank,
            reason,
        };
        self.runtime.block_on(self.control.fail_now(err));
    }
}

const STREAM: Fingerprint = Fingerprint {
    op: Op::Stream,
    element: Element::Bytes,
    count: 0,
};

fn dial_failed(rank: usize, peer: &Peer, error: DialError, after: Duration) -> DistributedError {
    match error {
        DialError::Unreachable(reason) => DistributedError::Timeout {
            what: format!(
                "a connection to process {rank} at {} (last attempt: {reason})",
                peer.address
            ),
            after,
            hint: "it does not answer: is BURN_ACCELERATE_NODE_HOST reachable from here, or \
                   did it stop?",
        },
        DialError::Refused(reason) => DistributedError::ConnectionFailed {
            rank,
            during: "connecting".into(),
            reason,
        },
    }
}

/// `host:port`, with IPv6 hosts bracketed.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The address of the interface this machine reaches `main` through (no packet is sent:
/// connecting a UDP socket only picks the route).
fn route_to(main: &str, port: u16) -> Result<String, DistributedError> {
    let socket = std::net::UdpSocket::bind(("0.0.0.0", 0))
        .and_then(|s| s.connect((main, port)).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| DistributedError::InvalidVariable {
            name: env::MASTER_ADDR,
            value: main.to_string(),
            expected: format!(
                "a host this machine can reach ({e}); or set {} to this machine's address",
                env::NODE_HOST
            ),
        })?;
    Ok(socket.ip().to_string())
}

/// This machine's host name (for messages).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

/// This machine, as the processes of a run tell machines apart: the kernel's boot id where
/// there is one (containers and network namespaces of one host share it, and their process
/// ids), else the host name.
fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_ports() {
        assert_eq!(host_port("10.0.0.1", 80), "10.0.0.1:80");
        assert_eq!(host_port("::1", 80), "[::1]:80");
        assert_eq!(host_port("[::1]", 80), "[::1]:80");
        assert!(!machine_id().is_empty());
    }
}
