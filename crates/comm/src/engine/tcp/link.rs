//! The connections of one process: a listener its peers connect to, and one TCP connection
//! per (peer, lane) and direction, opened by the sending side when it first needs it. Lane 0
//! carries the collectives, which only ever send to the next process of the ring and receive
//! from the previous one; each stream (a dispatching loader's batches) has a lane of its own,
//! so that a reader that is behind never holds up the collectives.
//!
//! A connection's bytes are read by a task of its own into pieces from a small pool: a
//! receiver holds at most [`IN_FLIGHT`] pieces of each connection, and a sender that is
//! further ahead waits on TCP's flow control. The consumer takes whole, checked messages
//! piece by piece ([`Incoming::message`]), so a collective of any size works in bounded
//! memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::auth::{self, HANDSHAKE_WITHIN, Hello};
use super::frame::{self, Assembly, FrameHeader, ReadError};
use super::pending::{MAX_PENDING, Pending, Ticket};
use crate::RunSecret;

pub(crate) use crate::engine::Lane;

/// The collectives' lane.
pub(crate) const COLLECTIVES: Lane = 0;

/// The lane of heartbeats and aborts between ring neighbours ([`control`](super::control)):
/// a connection of its own, both ways, so that a heartbeat left unread when a process exits
/// (which makes the kernel reset the connection) never costs a collective's data.
pub(crate) const CONTROL: Lane = Lane::MAX;

/// Pieces of one connection a receiver holds at most.
pub(crate) const IN_FLIGHT: usize = 8;

/// A piece of a message, in a buffer that goes back to its connection's pool when dropped.
pub(crate) struct Piece {
    pub(crate) header: FrameHeader,
    data: Vec<u8>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
}

impl Piece {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Piece {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.data));
    }
}

/// A connection's piece buffers, reused: pieces are megabytes, and fresh ones would cost a
/// page fault per page every time.
#[derive(Default)]
struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Pool {
    fn take(&self) -> Vec<u8> {
        lock(&self.free).pop().unwrap_or_default()
    }

    fn put(&self, buffer: Vec<u8>) {
        if buffer.capacity() <= frame::PIECE {
            lock(&self.free).push(buffer);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The receiving end of a connection from one peer on one lane.
pub(crate) struct Incoming {
    pieces: mpsc::UnboundedReceiver<Result<Piece, ReadError>>,
    /// Why the connection ended, once it has: every later read reports it again.
    ended: Option<ReadError>,
}

/// One message being read, piece by piece.
pub(crate) struct Message<'a> {
    incoming: &'a mut Incoming,
    assembly: Assembly,
    first: Option<Piece>,
}

impl Incoming {
    async fn next(&mut self) -> Result<Piece, ReadError> {
        if let Some(ended) = &self.ended {
            return Err(ended.clone());
        }
        let outcome = self.pieces.recv().await.unwrap_or(Err(ReadError::Closed));
        if let Err(err) = &outcome {
            self.ended = Some(err.clone());
        }
        outcome
    }

    /// The next message: its first header (to check against what is expected), then its
    /// pieces from [`Message::next`].
    pub(crate) async fn message(&mut self) -> Result<Message<'_>, ReadError> {
        let first = self.next().await?;
        let assembly = Assembly::start(first.header).map_err(ReadError::Malformed)?;
        Ok(Message {
            incoming: self,
            assembly,
            first: Some(first),
        })
    }
}

impl Message<'_> {
    /// The message's first header: its fingerprint, tag and length.
    pub(crate) fn header(&self) -> &FrameHeader {
        &self.assembly.first
    }

    /// The next piece, `None` once the message is complete.
    pub(crate) async fn next(&mut self) -> Result<Option<Piece>, ReadError> {
        if let Some(first) = self.first.take() {
            return Ok(Some(first));
        }
        if self.assembly.complete() {
            return Ok(None);
        }
        let piece = self.incoming.next().await.map_err(ReadError::mid_message)?;
        self.assembly
            .accept(&piece.header)
            .map_err(ReadError::Malformed)?;
        Ok(Some(piece))
    }
}

/// The sending end of a connection to one peer on one lane.
pub(crate) struct Outgoing {
    pub(crate) writer: OwnedWriteHalf,
    // Kept open: dropping it would end the connection's other direction.
    _reader: OwnedReadHalf,
}

/// Why a connection to a peer could not be opened.
#[derive(Debug)]
pub(crate) enum DialError {
    /// Nothing answered at the address within the time.
    Unreachable(String),
    /// It answered, then closed the connection at once (another run, or a refusal).
    Refused(String),
}

type Key = (usize, Lane);

// Ends the handshake of `verified`, within the handshake's time.
async fn prove(verified: auth::Verified, writer: &mut OwnedWriteHalf) -> Result<(), String> {
    tokio::time::timeout(HANDSHAKE_WITHIN, verified.prove(writer))
        .await
        .map_err(|_| format!("it did not take the proof within {HANDSHAKE_WITHIN:?}"))?
        .map(drop)
}

/// This process's connections.
pub(crate) struct Links {
    rank: usize,
    world_size: usize,
    secret: RunSecret,
    run: watch::Sender<Option<u64>>,
    incoming: Mutex<IncomingTable>,
    arrived: Notify,
    outgoing: tokio::sync::Mutex<HashMap<Key, Arc<tokio::sync::Mutex<Outgoing>>>>,
}

/// Both halves of a connection, for whoever reads and writes it itself (the control lane).
pub(crate) type Raw = (OwnedReadHalf, OwnedWriteHalf);

#[derive(Default)]
struct IncomingTable {
    slots: HashMap<Key, Arc<tokio::sync::Mutex<Incoming>>>,
    raw: HashMap<Key, Raw>,
    /// Peers one of whose connections ended: waiting for another from them is pointless.
    gone: HashMap<usize, ReadError>,
}

impl Links {
    /// Starts listening on `listener` for the peers of rank `rank` of `world_size`, who prove
    /// they know `secret`; their connections are accepted once [`set_run`](Self::set_run)
    /// names the run.
    pub(crate) fn listen(
        listener: TcpListener,
        rank: usize,
        world_size: usize,
        secret: RunSecret,
    ) -> Arc<Self> {
        let links = Arc::new(Self {
            rank,
            world_size,
            secret,
            run: watch::Sender::new(None),
            incoming: Mutex::default(),
            arrived: Notify::new(),
            outgoing: tokio::sync::Mutex::default(),
        });
        let weak = Arc::downgrade(&links);
        let pending = Pending::new(MAX_PENDING);
        tokio::spawn(async move {
            loop {
                let (stream, from) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, say: wait rather than spin.
                        log::warn!("burn-accelerate: accepting a peer's connection: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let ticket = pending.admit().await;
                let Some(links) = weak.upgrade() else { return };
                tokio::spawn(async move {
                    if let Err(why) = links.accept(stream, ticket).await {
                        log::warn!("burn-accelerate: a connection from {from} was refused: {why}");
                    }
                });
            }
        });
        links
    }

    /// The run's number, from the rendezvous: connections of this run are accepted from now.
    pub(crate) fn set_run(&self, run: u64) {
        self.run.send_replace(Some(run));
    }

    fn run(&self) -> Option<u64> {
        *self.run.borrow()
    }

    async fn accept(
        self: Arc<Self>,
        stream: tokio::net::TcpStream,
        ticket: Ticket,
    ) -> Result<(), String> {
        let _ = stream.set_nodelay(true);
        let (mut reader, mut writer) = stream.into_split();
        let handshake = auth::verify(&mut reader, &mut writer, &self.secret);
        let Some(verified) = ticket
            .handshake(tokio::time::timeout(HANDSHAKE_WITHIN, handshake))
            .await
        else {
            auth::tell_busy(&writer);
            return Err(format!(
                "it was dropped for newer connections, {MAX_PENDING} of which were in their \
                 handshake"
            ));
        };
        let verified = verified.map_err(|_| {
            format!("it did not finish the handshake within {HANDSHAKE_WITHIN:?}")
        })??;
        let hello = verified.hello;
        let mut run = self.run.subscribe();
        let ours = tokio::time::timeout(HANDSHAKE_WITHIN, run.wait_for(Option::is_some))
            .await
            .map_err(|_| "it came before the rendezvous ended".to_string())?
            .map_err(|_| "this process is leaving".to_string())?
            .expect("waited for");
        if hello.run != ours {
            return Err(format!(
                "it is rank {} of another run (or of an earlier one)",
                hello.rank
            ));
        }
        let peer = hello.rank as usize;
        if peer >= self.world_size || peer == self.rank {
            return Err(format!("rank {peer} is not a peer of rank {}", self.rank));
        }
        let key = (peer, hello.lane);
        if hello.lane == CONTROL {
            // The control lane's halves go into the table whole, so it is proved first; its
            // waiter (`take_raw`) does not give up on a peer that is gone.
            prove(verified, &mut writer).await?;
            let mut table = lock(&self.incoming);
            if table.raw.contains_key(&key) {
                return Err(format!("rank {peer} connected twice on the control lane"));
            }
            table.raw.insert(key, (reader, writer));
            drop(table);
            self.arrived.notify_waiters();
            return Ok(());
        }
        let (sender, pieces) = mpsc::unbounded_channel();
        {
            let mut table = lock(&self.incoming);
            if table.slots.contains_key(&key) {
                return Err(format!(
                    "rank {peer} connected twice on lane {}",
                    hello.lane
                ));
            }
            let incoming = Incoming {
                pieces,
                ended: None,
            };
            table
                .slots
                .insert(key, Arc::new(tokio::sync::Mutex::new(incoming)));
        }
        self.arrived.notify_waiters();
        // Proved only once the connection is in the table: the peer may send on it, and then
        // exit, as soon as it has the proof. Proved first, a peer that sent its last message
        // and exited could end its other connections before this one was in the table, and
        // a `recv` waiting for this one took the peer for gone before its message was read
        // (a 4-process test under load).
        if let Err(why) = prove(verified, &mut writer).await {
            lock(&self.incoming).gone.insert(peer, ReadError::Closed);
            self.arrived.notify_waiters();
            return Err(why);
        }
        let end = read_pieces(reader, sender).await;
        drop(writer);
        if let Some(end) = end {
            lock(&self.incoming).gone.insert(peer, end);
            self.arrived.notify_waiters();
        }
        Ok(())
    }

    /// The connection from `peer` on `lane`, waiting for the peer to open it (or for a sign
    /// that it never will: another of its connections ended).
    pub(crate) async fn incoming(
        &self,
        peer: usize,
        lane: Lane,
    ) -> Result<Arc<tokio::sync::Mutex<Incoming>>, ReadError> {
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let table = lock(&self.incoming);
                if let Some(incoming) = table.slots.get(&(peer, lane)) {
                    return Ok(Arc::clone(incoming));
                }
                if let Some(end) = table.gone.get(&peer) {
                    return Err(end.clone());
                }
            }
            notified.await;
        }
    }

    /// Both halves of the connection `peer` opened on `lane` (the control lane), once it has.
    pub(crate) async fn take_raw(&self, peer: usize, lane: Lane) -> Raw {
        loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(raw) = lock(&self.incoming).raw.remove(&(peer, lane)) {
                return raw;
            }
            notified.await;
        }
    }

    /// A new connection on `lane` to the process at `address`, both halves for the caller.
    pub(crate) async fn dial_raw(
        &self,
        lane: Lane,
        address: &str,
        within: Duration,
    ) -> Result<Raw, DialError> {
        dial(address, self.hello(lane), &self.secret, within).await
    }

    fn hello(&self, lane: Lane) -> Hello {
        Hello {
            rank: self.rank as u32,
            lane,
            run: self
                .run()
                .expect("the rendezvous ended before any connection"),
        }
    }

    /// The connection to `peer` on `lane` at `address`, opened (and introduced) on first use.
    pub(crate) async fn outgoing(
        &self,
        peer: usize,
        lane: Lane,
        address: &str,
        within: Duration,
    ) -> Result<Arc<tokio::sync::Mutex<Outgoing>>, DialError> {
        let mut table = self.outgoing.lock().await;
        if let Some(link) = table.get(&(peer, lane)) {
            return Ok(Arc::clone(link));
        }
        let (reader, writer) = dial(address, self.hello(lane), &self.secret, within).await?;
        let link = Arc::new(tokio::sync::Mutex::new(Outgoing {
            writer,
            _reader: reader,
        }));
        table.insert((peer, lane), Arc::clone(&link));
        Ok(link)
    }
}

// Reads frames into pieces until the connection ends, and says how it ended (`None`: its
// reader left first).
async fn read_pieces(
    mut reader: OwnedReadHalf,
    sender: mpsc::UnboundedSender<Result<Piece, ReadError>>,
) -> Option<ReadError> {
    let pool = Arc::new(Pool::default());
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let read = async {
            let header = frame::read_header(&mut reader).await?;
            let permit = Arc::clone(&permits)
                .acquire_owned()
                .await
                .expect("never closed");
            let mut data = pool.take();
            frame::read_piece(&mut reader, &header, &mut data).await?;
            Ok::<_, ReadError>(Piece {
                header,
                data,
                pool: Arc::clone(&pool),
                _permit: permit,
            })
        };
        match read.await {
            Ok(piece) => {
                if sender.send(Ok(piece)).is_err() {
                    return None;
                }
            }
            Err(err) => {
                let _ = sender.send(Err(err.clone()));
                return Some(err);
            }
        }
    }
}

async fn dial(
    address: &str,
    hello: Hello,
    secret: &RunSecret,
    within: Duration,
) -> Result<Raw, DialError> {
    let deadline = tokio::time::Instant::now() + within;
    let mut last = String::from("no attempt");
    loop {
        match tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect(address)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                let (mut reader, mut writer) = stream.into_split();
                let handshake = auth::try_connect(&mut reader, &mut writer, secret, hello);
                return match tokio::time::timeout(HANDSHAKE_WITHIN, handshake).await {
                    Ok(Ok(auth::Connected::Proved)) => Ok((reader, writer)),
                    // Too many handshakes in progress there (a flood): again, within `within`.
                    Ok(Ok(auth::Connected::Busy)) => {
                        last = auth::BUSY_REASON.to_string();
                        if tokio::time::Instant::now() >= deadline {
                            return Err(DialError::Unreachable(last));
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Ok(Err(why)) => Err(DialError::Refused(why)),
                    Err(_) => Err(DialError::Refused(format!(
                        "it did not finish the handshake within {HANDSHAKE_WITHIN:?}"
                    ))),
                };
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(DialError::Unreachable(last));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
