//! The connections between the processes of a run: each process serves one WebSocket route
//! (burn-communication's server) where its peers open a connection each, and opens one to
//! every peer when it joins. Messages travel in lanes (the first bytes of each, see
//! [`wire`](super::wire)): lane 0 carries the group's collectives, other lanes streams that
//! must not be ordered with them (a dispatching loader's slices, read ahead on its own
//! threads). Messages from each peer on each lane queue up in an inbox of their own.
//!
//! A peer that exits or crashes drops its connection; its inboxes then close and whatever
//! waits on them fails with [`DistributedError::PeerLost`] at once, instead of waiting for
//! the timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use burn_communication::websocket::{WsClient, WsClientChannel, WsServer};
use burn_communication::{CommunicationChannel, Message, ProtocolClient, ProtocolServer};
use bytes::Bytes;
use tokio::runtime::Handle;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::error::DistributedError;
use super::wire::{self, Hello, Lane};

const ROUTE: &str = "peer";

/// This process's ends of its connections to the others.
pub(crate) struct Mesh {
    rank: usize,
    run: u64,
    addresses: Vec<String>,
    outgoing: Vec<tokio::sync::Mutex<Option<WsClientChannel>>>,
    inboxes: Arc<Mutex<Inboxes>>,
}

type Inbox = Arc<tokio::sync::Mutex<UnboundedReceiver<Bytes>>>;

/// An inbox's two ends: the sending one for the peer's connection (`None` once it is gone),
/// the receiving one for whoever reads the lane.
type Ends = (Option<UnboundedSender<Bytes>>, Inbox);

/// Every (peer, lane) inbox, made on first use by either end: the receiving end for whoever
/// reads the lane, the sending end for the peer's connection, held only while it lives.
struct Inboxes {
    boxes: HashMap<(usize, Lane), Ends>,
    /// Peers whose connection ended: their inboxes are closed, and so are new ones.
    gone: Vec<bool>,
    /// Peers connected now (a second connection from one is refused).
    connected: Vec<bool>,
}

impl Inboxes {
    fn entry(&mut self, peer: usize, lane: Lane) -> &mut Ends {
        let gone = self.gone[peer];
        self.boxes.entry((peer, lane)).or_insert_with(|| {
            let (sender, receiver) = unbounded_channel();
            // A closed inbox: its sending end is dropped at once.
            let sender = (!gone).then_some(sender);
            (sender, Arc::new(tokio::sync::Mutex::new(receiver)))
        })
    }

    // The peer's connection ended: close its inboxes.
    fn lose(&mut self, peer: usize) {
        self.gone[peer] = true;
        self.connected[peer] = false;
        for ((p, _), (sender, _)) in self.boxes.iter_mut() {
            if *p == peer {
                *sender = None;
            }
        }
    }
}

/// The server half, started before the rendezvous so that every address in the table already
/// answers.
pub(crate) struct Listening {
    inboxes: Arc<Mutex<Inboxes>>,
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
    let inboxes = Arc::new(Mutex::new(Inboxes {
        boxes: HashMap::new(),
        gone: vec![false; world_size],
        connected: vec![false; world_size],
    }));
    let run = Arc::new(Mutex::new(None));
    let server = WsServer::new(port).route(ROUTE, {
        let inboxes = Arc::clone(&inboxes);
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
            let peer = hello.rank as usize;
            {
                let mut boxes = inboxes.lock().unwrap_or_else(PoisonError::into_inner);
                if peer >= boxes.connected.len() || boxes.connected[peer] || boxes.gone[peer] {
                    log::warn!(
                        "burn-accelerate: rank {peer} connected twice, or is out of range; ignored"
                    );
                    return;
                }
                boxes.connected[peer] = true;
            }
            // Closes the peer's inboxes however this task ends: a connection that ends
            // without a close frame panics inside burn-communication's channel.
            struct Lose(Arc<Mutex<Inboxes>>, usize);
            impl Drop for Lose {
                fn drop(&mut self) {
                    self.0
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .lose(self.1);
                }
            }
            let _lose = Lose(Arc::clone(&inboxes), peer);
            while let Ok(Some(message)) = channel.recv().await {
                let Some(lane) = wire::lane(&message.data) else {
                    log::warn!("burn-accelerate: rank {peer} sent a message without a lane");
                    break;
                };
                let mut boxes = inboxes.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(sender) = &boxes.entry(peer, lane).0 {
                    // Nobody reads a lane whose reader is gone: dropping is right.
                    let _ = sender.send(message.data);
                }
            }
        }
    });
    super::rendezvous::serve_on(
        server,
        port,
        "peer connections",
        super::env::DATA_PORT,
        runtime,
    )?;
    Ok(Listening { inboxes, run })
}

impl Listening {
    /// The mesh of `rank`, once the rendezvous gave the run's number and addresses.
    pub(crate) fn connect(self, rank: usize, run: u64, addresses: Vec<String>) -> Mesh {
        *self.run.lock().unwrap_or_else(PoisonError::into_inner) = Some(run);
        Mesh {
            rank,
            run,
            outgoing: addresses
                .iter()
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            inboxes: self.inboxes,
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

    /// The next message from `peer` on `lane`.
    pub(crate) async fn recv(
        &self,
        peer: usize,
        lane: Lane,
        during: &str,
    ) -> Result<Bytes, DistributedError> {
        let inbox = Arc::clone(
            &self
                .inboxes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(peer, lane)
                .1,
        );
        let mut inbox = inbox.lock().await;
        inbox
            .recv()
            .await
            .ok_or_else(|| DistributedError::PeerLost {
                rank: peer,
                during: during.into(),
            })
    }
}
