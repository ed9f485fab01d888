//! The connections between the processes of a run: each process serves one WebSocket route
//! (burn-communication's server) where its peers open a connection each, and opens one to a
//! peer the first time it sends it something. Messages from each peer queue up in an inbox of
//! their own, drained by the collectives in order.
//!
//! A peer that exits or crashes drops its connection; its inbox then closes and the
//! collective waiting on it fails with [`DistributedError::PeerLost`] at once, instead of
//! waiting for the timeout.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use burn_communication::websocket::{WsClient, WsClientChannel, WsServer};
use burn_communication::{CommunicationChannel, Message, ProtocolClient, ProtocolServer};
use bytes::Bytes;
use tokio::runtime::Handle;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::error::DistributedError;
use super::wire::Hello;

const ROUTE: &str = "peer";

/// This process's ends of its connections to the others.
pub(crate) struct Mesh {
    rank: usize,
    run: u64,
    addresses: Vec<String>,
    outgoing: Vec<tokio::sync::Mutex<Option<WsClientChannel>>>,
    inboxes: Vec<tokio::sync::Mutex<UnboundedReceiver<Bytes>>>,
}

/// The inboxes' sending ends, waiting for their peer's connection: each is handed to the
/// connection of its peer, so that the inbox closes when that connection ends.
type Mailboxes = Arc<Mutex<Vec<Option<UnboundedSender<Bytes>>>>>;

/// The server half, started before the rendezvous so that every address in the table already
/// answers.
pub(crate) struct Listening {
    mailboxes: Mailboxes,
    inboxes: Vec<UnboundedReceiver<Bytes>>,
    run: Arc<Mutex<Option<u64>>>,
}

/// Serves the peer route on `port` for a run of `world_size` processes.
///
/// # Errors
/// [`DistributedError::PortUnavailable`] when the port cannot be listened on.
pub(crate) fn listen(
    port: u16,
    world_size: usize,
    runtime: &Handle,
) -> Result<Listening, DistributedError> {
    super::rendezvous::check_port_free(port, "peer connections", super::env::DATA_PORT)?;
    super::quiet_transport_logs();
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..world_size)
        .map(|_| unbounded_channel())
        .map(|(s, r)| (Some(s), r))
        .unzip();
    let mailboxes: Mailboxes = Arc::new(Mutex::new(senders));
    let run = Arc::new(Mutex::new(None));
    let server = WsServer::new(port).route(ROUTE, {
        let mailboxes = Arc::clone(&mailboxes);
        let run = Arc::clone(&run);
        move |mut channel| async move {
            let Ok(Some(first)) = channel.recv().await else {
                return;
            };
            let Some(hello) = Hello::decode(&first.data) else {
                log::warn!("burn-accelerate: a connection to the peer port did not say hello");
                return;
            };
            let ours = *run.lock().unwrap_or_else(PoisonError::into_inner);
            if ours.is_some_and(|r| r != hello.run) {
                log::warn!(
                    "burn-accelerate: a process of another run (rank {}) connected; ignored",
                    hello.rank
                );
                return;
            }
            let inbox = mailboxes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_mut(hello.rank as usize)
                .and_then(Option::take);
            let Some(inbox) = inbox else {
                log::warn!(
                    "burn-accelerate: rank {} connected twice, or is out of range; ignored",
                    hello.rank
                );
                return;
            };
            // Forwards until the peer goes; a connection that ends without a close frame
            // panics inside burn-communication's channel, which ends this task all the same,
            // and dropping `inbox` closes the peer's inbox either way.
            while let Ok(Some(message)) = channel.recv().await {
                if inbox.send(message.data).is_err() {
                    break;
                }
            }
        }
    });
    runtime.spawn(async move {
        if let Err(err) = server.serve(std::future::pending()).await {
            log::error!("burn-accelerate: the peer server on port {port} stopped: {err:?}");
        }
    });
    Ok(Listening {
        mailboxes,
        inboxes,
        run,
    })
}

impl Listening {
    /// The mesh of `rank`, once the rendezvous gave the run's number and addresses.
    pub(crate) fn connect(self, rank: usize, run: u64, addresses: Vec<String>) -> Mesh {
        *self.run.lock().unwrap_or_else(PoisonError::into_inner) = Some(run);
        // Our own inbox is never connected.
        drop(
            self.mailboxes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_mut(rank)
                .and_then(Option::take),
        );
        Mesh {
            rank,
            run,
            outgoing: addresses
                .iter()
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            inboxes: self
                .inboxes
                .into_iter()
                .map(tokio::sync::Mutex::new)
                .collect(),
            addresses,
        }
    }
}

impl Mesh {
    /// Sends `bytes` to `peer`, connecting first if this is the first message to it.
    pub(crate) async fn send(
        &self,
        peer: usize,
        bytes: Bytes,
        during: &str,
        timeout: Duration,
    ) -> Result<(), DistributedError> {
        let mut outgoing = self.outgoing[peer].lock().await;
        if outgoing.is_none() {
            *outgoing = Some(self.open(peer, timeout).await?);
        }
        let channel = outgoing.as_mut().expect("opened above");
        channel
            .send(Message::new(bytes))
            .await
            .map_err(|_| DistributedError::PeerLost {
                rank: peer,
                during: during.into(),
            })
    }

    async fn open(
        &self,
        peer: usize,
        timeout: Duration,
    ) -> Result<WsClientChannel, DistributedError> {
        let address = &self.addresses[peer];
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let parsed = address.parse().expect("any text is an address");
            if let Some(mut channel) = WsClient::connect(parsed, ROUTE).await {
                let hello = Hello {
                    rank: self.rank as u32,
                    run: self.run,
                };
                if channel.send(Message::new(hello.encode())).await.is_ok() {
                    return Ok(channel);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(DistributedError::Timeout {
                    what: format!("a connection to process {peer} at {address}"),
                    after: timeout,
                    hint: "it does not answer: is BURN_ACCELERATE_NODE_HOST reachable from here, \
                           or did it stop?",
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The next message from `peer`.
    pub(crate) async fn recv(&self, peer: usize, during: &str) -> Result<Bytes, DistributedError> {
        self.inboxes[peer]
            .lock()
            .await
            .recv()
            .await
            .ok_or_else(|| DistributedError::PeerLost {
                rank: peer,
                during: during.into(),
            })
    }
}
