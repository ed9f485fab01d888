//! Liveness and aborts: what ends a run's collectives on every process when one process
//! freezes, dies or fails, instead of leaving the others waiting for the collective timeout.
//!
//! Each process keeps a control connection with each of its two ring neighbours, apart from the
//! data. A task of the network runtime (not the training loop, so a long validation on one
//! process trips nothing) sends a heartbeat on each every [`heartbeat_every`] of the liveness
//! timeout, and a watcher per connection expects a frame within the timeout:
//! - a neighbour silent longer than that (stopped, swapping, or behind a cut link) fails the
//!   run's collectives here with [`DistributedError::PeerSilent`];
//! - the first failure of any kind here (that, a collective's own error, a timeout) is sent to
//!   both neighbours as an abort, which each passes on to its other neighbour: the failure
//!   travels the ring both ways, past a dead or cut-off process, and every pending and later
//!   collective on every process fails with it ([`DistributedError::Aborted`] naming the
//!   process that found it).
//!
//! A neighbour's control connection that ends (it exited) fails the collectives only after the
//! liveness timeout: the pending collective learns what happened from its own connections at
//! once, and a process that ends normally after the run's last collective, while this one is
//! still reading its last bytes, must not fail it.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncRead;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Mutex, watch};

use super::frame::{self, Fingerprint, FrameHeader, Op, ReadError};
use super::link::Raw;
use super::rendezvous::Peer;
use super::ring::Failure;
use crate::element::Element;
use crate::error::DistributedError;

/// The most bytes of an abort's reason read.
const REASON_LIMIT: u64 = 64 << 10;

/// How often heartbeats go out: six per liveness timeout, at most every 5 s, so that a few
/// lost to a busy machine do not make a live process look silent.
pub(crate) fn heartbeat_every(liveness: Duration) -> Duration {
    (liveness / 6).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

fn fingerprint(op: Op) -> Fingerprint {
    Fingerprint {
        op,
        element: Element::Bytes,
        count: 0,
    }
}

/// Every process of the run, and this one's machine: what is needed to say what became of a
/// process whose connection ended.
pub(crate) struct Roster {
    pub(crate) peers: Vec<Peer>,
    pub(crate) machine: String,
}

impl Roster {
    /// Where process `rank` runs, for messages: `10.0.0.2:29502 (host node-2)`.
    pub(crate) fn place(&self, rank: usize) -> String {
        let peer = &self.peers[rank];
        format!("{} (host {})", peer.address, peer.host)
    }

    /// What became of process `peer`, whose connection failed with `failure` during `during`:
    /// a process of this machine that exited is named as such; otherwise what the connection
    /// showed.
    pub(crate) async fn lost(
        &self,
        peer: usize,
        during: String,
        failure: Failure,
    ) -> DistributedError {
        let ended = match failure {
            Failure::Disagree(detail) => {
                return DistributedError::Mismatch { rank: peer, detail };
            }
            Failure::Read(ReadError::Malformed(detail)) => {
                return DistributedError::Malformed { rank: peer, detail };
            }
            Failure::Read(ReadError::Closed) => "between messages".to_string(),
            Failure::Read(ReadError::Truncated) => "in the middle of a message".to_string(),
            Failure::Read(ReadError::Io(kind, reason))
                if kind != std::io::ErrorKind::ConnectionReset =>
            {
                return DistributedError::ConnectionFailed {
                    rank: peer,
                    during,
                    reason,
                };
            }
            Failure::Read(ReadError::Io(_, reason)) => reason,
            Failure::Write(e)
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return DistributedError::ConnectionFailed {
                    rank: peer,
                    during,
                    reason: e.to_string(),
                };
            }
            Failure::Write(e) => format!("while this process was sending: {e}"),
        };
        let info = &self.peers[peer];
        if info.machine != self.machine {
            let how = format!(
                "{ended}; it runs on another machine, at {}",
                self.place(peer)
            );
            return DistributedError::PeerClosed {
                rank: peer,
                during,
                how,
            };
        }
        // Its connections close as it exits, a moment before it is gone: give it that moment.
        for _ in 0..20 {
            if has_exited(info.pid) {
                return DistributedError::PeerExited {
                    rank: peer,
                    pid: info.pid,
                    during,
                };
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let how = format!("{ended}; it is still running, as pid {}", info.pid);
        DistributedError::PeerClosed {
            rank: peer,
            during,
            how,
        }
    }
}

/// The run's first failure as this process knows it, and its control connections.
pub(crate) struct Control {
    /// This process's rank.
    rank: usize,
    failed: watch::Sender<Option<DistributedError>>,
    /// Each neighbour's rank and the sending half of its control connection.
    neighbours: Vec<(usize, Mutex<OwnedWriteHalf>)>,
    pub(crate) roster: Arc<Roster>,
    liveness: Duration,
}

impl Control {
    /// Starts the heartbeats and the watchers on `links`, one control connection per
    /// neighbour (rank, both halves). Call it on the network runtime.
    pub(crate) fn start(
        rank: usize,
        roster: Arc<Roster>,
        liveness: Duration,
        links: Vec<(usize, Raw)>,
    ) -> Arc<Self> {
        let mut readers = Vec::new();
        let mut neighbours = Vec::new();
        for (rank, (reader, writer)) in links {
            readers.push((rank, reader));
            neighbours.push((rank, Mutex::new(writer)));
        }
        let control = Arc::new(Self {
            rank,
            failed: watch::Sender::new(None),
            neighbours,
            roster,
            liveness,
        });
        for (rank, reader) in readers {
            tokio::spawn(Arc::clone(&control).watch(rank, reader));
        }
        tokio::spawn(Arc::clone(&control).beat());
        control
    }

    /// The run's first failure, if there was one.
    pub(crate) fn failure(&self) -> Option<DistributedError> {
        self.failed.borrow().clone()
    }

    /// Waits for the run's first failure.
    pub(crate) async fn failed(&self) -> DistributedError {
        let mut failed = self.failed.subscribe();
        let failure = failed
            .wait_for(Option::is_some)
            .await
            .expect("the sender lives in self");
        failure.clone().expect("waited for")
    }

    /// Records `err` as the run's failure, if it is the first, and tells the neighbours (on a
    /// task of the network runtime: call it there).
    pub(crate) fn fail(self: &Arc<Self>, err: DistributedError) {
        let control = Arc::clone(self);
        tokio::spawn(async move { control.fail_now(err).await });
    }

    /// [`fail`](Self::fail), returning once the neighbours were told (or a second passed for
    /// each): for a process about to end.
    pub(crate) async fn fail_now(&self, err: DistributedError) {
        let first = self.failed.send_if_modified(|failed| {
            let first = failed.is_none();
            if first {
                *failed = Some(err.clone());
            }
            first
        });
        if !first {
            return;
        }
        let (origin, reason) = match &err {
            DistributedError::Aborted { rank, reason } => (*rank, reason.clone()),
            other => (self.rank, other.to_string()),
        };
        let mut payload = (origin as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(reason.as_bytes());
        for (_, writer) in &self.neighbours {
            let mut writer = writer.lock().await;
            // A neighbour that is gone or frozen must not hold up the other one.
            let send = frame::write_message(
                &mut *writer,
                fingerprint(Op::Abort),
                0,
                0,
                &payload,
                frame::PIECE,
            );
            let _ = tokio::time::timeout(Duration::from_secs(1), send).await;
        }
    }

    // Sends a heartbeat to each neighbour, until the run fails.
    async fn beat(self: Arc<Self>) {
        let every = heartbeat_every(self.liveness);
        let header = FrameHeader {
            fingerprint: fingerprint(Op::Heartbeat),
            seq: 0,
            step: 0,
            total: 0,
            offset: 0,
            len: 0,
        };
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while self.failure().is_none() {
            ticks.tick().await;
            for (_, writer) in &self.neighbours {
                let mut writer = writer.lock().await;
                let send = frame::write_frame(&mut *writer, &header, &[]);
                let _ = tokio::time::timeout(every, send).await;
            }
        }
    }

    // Expects a frame from neighbour `peer` within the liveness timeout, until the run fails.
    async fn watch(self: Arc<Self>, peer: usize, mut reader: OwnedReadHalf) {
        let socket = Socket::of(&reader);
        let err = loop {
            let read = read_control(&mut reader);
            tokio::pin!(read);
            let mut frame = tokio::time::timeout(self.liveness, &mut read).await;
            // The neighbour was silent only if nothing of it waits in the socket. Where this
            // process was the one frozen (`kill -STOP`), its runtime sees the timeout run out
            // as it continues, before the frames that came meanwhile (on SIGCONT its
            // `epoll_wait` returns EINTR, signal(7), without their events): it would blame
            // the neighbour whose heartbeats, and abort, wait unread.
            if frame.is_err() && socket.has_something() {
                frame = tokio::time::timeout(self.liveness, &mut read).await;
            }
            match frame {
                Ok(Ok(None)) => continue,
                Ok(Ok(Some((origin, reason)))) => {
                    break DistributedError::Aborted {
                        rank: origin,
                        reason,
                    };
                }
                Ok(Err(ReadError::Malformed(detail))) => {
                    break DistributedError::Malformed { rank: peer, detail };
                }
                Ok(Err(ended)) => {
                    tokio::select! {
                        _ = tokio::time::sleep(self.liveness) => {}
                        _ = self.failed() => return,
                    }
                    let during = "the run".to_string();
                    break self.roster.lost(peer, during, Failure::Read(ended)).await;
                }
                Err(_) => {
                    break DistributedError::PeerSilent {
                        rank: peer,
                        at: self.roster.place(peer),
                        after: self.liveness,
                    };
                }
            }
        };
        self.fail(err);
    }
}

/// A connection's socket, seen past the runtime: whether the kernel holds something for it
/// to read.
#[derive(Clone, Copy)]
struct Socket {
    #[cfg(unix)]
    fd: std::os::fd::RawFd,
}

impl Socket {
    fn of(reader: &OwnedReadHalf) -> Self {
        #[cfg(unix)]
        {
            use std::os::fd::AsRawFd;
            Self {
                fd: reader.as_ref().as_raw_fd(),
            }
        }
        #[cfg(not(unix))]
        {
            let _ = reader;
            Self {}
        }
    }

    /// Whether a read would not wait: bytes, the end of the connection, or its error (which
    /// the read then reports as the end). Without a look at the socket, `false`.
    fn has_something(self) -> bool {
        #[cfg(unix)]
        {
            use nix::sys::socket::{MsgFlags, recv};
            let peek = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
            recv(self.fd, &mut [0u8; 1], peek) != Err(nix::errno::Errno::EAGAIN)
        }
        #[cfg(not(unix))]
        {
            false
        }
    }
}

/// The next control frame: `None` for a heartbeat, the origin and reason of an abort.
async fn read_control<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Option<(usize, String)>, ReadError> {
    let header = frame::read_header(reader).await?;
    match header.fingerprint.op {
        Op::Heartbeat if header.total == 0 => Ok(None),
        Op::Abort => {
            let payload = frame::read_rest(reader, header, REASON_LIMIT).await?;
            let origin = payload
                .get(..4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
                .ok_or_else(|| ReadError::Malformed("an abort without its origin".into()))?;
            Ok(Some((
                origin,
                String::from_utf8_lossy(&payload[4..]).into_owned(),
            )))
        }
        _ => Err(ReadError::Malformed(format!(
            "a {} on the control connection",
            header.fingerprint.during(header.seq)
        ))),
    }
}

/// Whether process `pid` of this machine has exited (a zombie not yet reaped counts).
pub(crate) fn has_exited(pid: u32) -> bool {
    #[cfg(target_os = "linux")]
    {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the command's closing parenthesis.
            Ok(stat) => stat
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with(['Z', 'X'])),
            Err(_) => true,
        }
    }
    #[cfg(all(unix, not(target_os = "linux")))]
    {
        use nix::sys::signal::kill;
        use nix::unistd::Pid;
        kill(Pid::from_raw(pid as i32), None) == Err(nix::errno::Errno::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_come_several_times_per_timeout_and_at_most_every_5_s() {
        assert_eq!(
            heartbeat_every(Duration::from_secs(60)),
            Duration::from_secs(5)
        );
        assert_eq!(
            heartbeat_every(Duration::from_secs(3)),
            Duration::from_millis(500)
        );
        assert_eq!(
            heartbeat_every(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
    }

    #[test]
    fn a_running_process_has_not_exited_and_a_reaped_one_has() {
        assert!(!has_exited(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(has_exited(pid));
    }

    // The property test of issue 49 (SECURITY.md): whatever an authenticated neighbour sends
    // on the control connection, a heartbeat, an abort with its origin and a reason of at most
    // REASON_LIMIT bytes, or why not, within that bound.

    use proptest::prelude::*;

    use crate::fuzz;

    fn control_frames() -> impl Strategy<Value = Vec<u8>> {
        let frame = |op: Op, payload: &[u8]| {
            let mut wire = Vec::new();
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(frame::write_message(
                    &mut wire,
                    fingerprint(op),
                    0,
                    0,
                    payload,
                    16,
                ))
                .unwrap();
            wire
        };
        let mut abort = 3u32.to_le_bytes().to_vec();
        abort.extend_from_slice(b"rank 3 ran out of memory");
        fuzz::inputs(
            vec![frame(Op::Heartbeat, &[]), frame(Op::Abort, &abort)],
            256,
        )
    }

    fn control_frame_is_bounded(wire: Vec<u8>) -> Result<(), TestCaseError> {
        let (largest, read) = fuzz::largest_allocation(|| {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
                .block_on(read_control(&mut wire.as_slice()))
        });
        match read {
            Ok(Some((_, reason))) => prop_assert!(reason.len() as u64 <= REASON_LIMIT),
            Ok(None) => {}
            Err(ReadError::Malformed(why)) => prop_assert!(!why.is_empty()),
            Err(_) => {}
        }
        prop_assert!(largest <= 4 * REASON_LIMIT as usize, "{largest} bytes");
        Ok(())
    }

    #[test]
    fn any_control_frame_is_a_heartbeat_an_abort_or_says_why() {
        fuzz::check(2000, control_frames(), control_frame_is_bounded);
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_control_frames() {
        fuzz::long_run("control frames", control_frames(), control_frame_is_bounded);
    }
}
