//! The collectives over the ring of connections: each process sends only to the next process
//! and receives only from the previous one, following [`schedule`](super::schedule). Every
//! step sends one block while the block from the previous process arrives piece by piece and
//! is added (or copied) straight into the caller's buffer, so an all-reduce needs no scratch
//! beyond the connections' pieces.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Mutex;

use super::frame::{self, Fingerprint, FrameHeader, ReadError};
use super::link::{Incoming, Outgoing};
use super::schedule;
use crate::element::Element;

// The values' bytes this process has sent to the next one on the ring, since it started
// (frame headers and control messages not counted): what `sent_bytes` reads.
static SENT: AtomicU64 = AtomicU64::new(0);

/// The bytes of values this process's collectives have sent over the built-in engine's ring
/// since the process started: every block a reduce-scatter, all-gather or all-reduce step
/// sends, every piece of a broadcast sent or passed on. Frame headers and the connections'
/// control messages are not counted; an MPI engine's traffic is not either (MPI picks its own
/// schedule). Read it before and after a step for the step's traffic.
pub fn sent_bytes() -> u64 {
    SENT.load(Ordering::Relaxed)
}

fn count_sent(bytes: usize) {
    SENT.fetch_add(bytes as u64, Ordering::Relaxed);
}

/// Why a step failed, and with which process.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Reading from it: the connection ended, or brought something that is not a frame.
    Read(ReadError),
    /// Writing to it.
    Write(std::io::Error),
    /// It is in another collective, or has another size.
    Disagree(String),
}

pub(crate) type Flow<T> = Result<T, (usize, Failure)>;

/// One collective call over the ring.
pub(crate) struct Ring<'a> {
    pub(crate) rank: usize,
    pub(crate) n: usize,
    pub(crate) next: &'a Mutex<Outgoing>,
    pub(crate) prev: &'a Mutex<Incoming>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) seq: u64,
}

/// What a received block does to the one in the buffer.
#[derive(Clone, Copy)]
enum Combine {
    Add(Element),
    Replace,
}

impl Ring<'_> {
    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.n
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.n - 1) % self.n
    }

    /// Sums block `b` of `data` over the processes onto rank `b` (see
    /// [`schedule::reduce_scatter_step`]).
    pub(crate) async fn reduce_scatter(
        &self,
        element: Element,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Flow<()> {
        for step in 0..self.n - 1 {
            let (send, receive) = schedule::reduce_scatter_step(self.rank, self.n, step);
            let (send, receive) = (blocks[send].clone(), blocks[receive].clone());
            self.exchange(step as u32, data, send, receive, Combine::Add(element))
                .await?;
        }
        Ok(())
    }

    /// Passes every rank's block round the ring (see [`schedule::all_gather_step`]); steps
    /// are numbered from `first_step`.
    pub(crate) async fn all_gather(
        &self,
        data: &mut [u8],
        blocks: &[Range<usize>],
        first_step: u32,
    ) -> Flow<()> {
        for step in 0..self.n - 1 {
            let (send, receive) = schedule::all_gather_step(self.rank, self.n, step);
            let (send, receive) = (blocks[send].clone(), blocks[receive].clone());
            self.exchange(
                first_step + step as u32,
                data,
                send,
                receive,
                Combine::Replace,
            )
            .await?;
        }
        Ok(())
    }

    /// `root`'s bytes along the ring: each process passes every piece on as it arrives, so the
    /// chain is pipelined, not a whole message per hop. The last process then tells the root
    /// it is done (an empty message, closing the ring), so that the root's call, too, ends
    /// only once every process has the bytes, or fails with the others.
    pub(crate) async fn broadcast(&self, root: usize, data: &mut Vec<u8>) -> Flow<()> {
        if self.rank == root {
            self.send(0, data).await?;
            return self.receive(1, &mut [], Combine::Replace).await;
        }
        let last = self.next_rank() == root;
        let prev = self.prev_rank();
        let mut incoming = self.prev.lock().await;
        let mut message = incoming.message().await.map_err(read(prev))?;
        self.check(message.header(), 0, None)?;
        let total = message.header().total;
        data.clear();
        frame::reserve_claimed(data, total).map_err(|why| {
            let detail = format!("this process cannot hold a broadcast: {why}");
            (prev, Failure::Disagree(detail))
        })?;
        let mut next = if !last {
            Some(self.next.lock().await)
        } else {
            None
        };
        while let Some(piece) = message.next().await.map_err(read(prev))? {
            data.extend_from_slice(piece.bytes());
            if let Some(next) = &mut next {
                frame::write_frame(&mut next.writer, &piece.header, piece.bytes())
                    .await
                    .map_err(write(self.next_rank()))?;
                count_sent(piece.bytes().len());
            }
        }
        if let Some(next) = &mut next {
            frame::flush(&mut next.writer)
                .await
                .map_err(write(self.next_rank()))?;
        }
        drop(next);
        if last {
            self.send(1, &[]).await?;
        }
        Ok(())
    }

    // One step: sends `data[send]` to the next process while the previous one's block arrives
    // into `data[receive]`. The first failure ends the step.
    async fn exchange(
        &self,
        step: u32,
        data: &mut [u8],
        send: Range<usize>,
        receive: Range<usize>,
        combine: Combine,
    ) -> Flow<()> {
        let (send, receive) = disjoint(data, send, receive);
        tokio::try_join!(self.send(step, send), self.receive(step, receive, combine))?;
        Ok(())
    }

    async fn send(&self, step: u32, bytes: &[u8]) -> Flow<()> {
        let mut next = self.next.lock().await;
        frame::write_message(
            &mut next.writer,
            self.fingerprint,
            self.seq,
            step,
            bytes,
            frame::PIECE,
        )
        .await
        .map_err(write(self.next_rank()))?;
        count_sent(bytes.len());
        Ok(())
    }

    async fn receive(&self, step: u32, into: &mut [u8], combine: Combine) -> Flow<()> {
        let prev = self.prev_rank();
        let mut incoming = self.prev.lock().await;
        let mut message = incoming.message().await.map_err(read(prev))?;
        self.check(message.header(), step, Some(into.len()))?;
        let size = match combine {
            Combine::Add(element) => element.size(),
            Combine::Replace => 1,
        };
        while let Some(piece) = message.next().await.map_err(read(prev))? {
            let (at, bytes) = (piece.header.offset as usize, piece.bytes());
            if !(at.is_multiple_of(size) && bytes.len().is_multiple_of(size)) {
                let detail = format!("a piece at byte {at} of {} splits a value", bytes.len());
                return Err((prev, Failure::Read(ReadError::Malformed(detail))));
            }
            let target = &mut into[at..at + bytes.len()];
            match combine {
                Combine::Add(element) => element.add_assign(target, bytes),
                Combine::Replace => target.copy_from_slice(bytes),
            }
        }
        Ok(())
    }

    // The first frame of a message from the previous process must be this collective's step
    // `step`, `len` bytes long where the length is known.
    fn check(&self, header: &FrameHeader, step: u32, len: Option<usize>) -> Flow<()> {
        let ours = (self.fingerprint, self.seq, step);
        let theirs = (header.fingerprint, header.seq, header.step);
        let disagree = |detail: String| Err((self.prev_rank(), Failure::Disagree(detail)));
        if ours != theirs {
            return disagree(format!(
                "it is at {} step {}, this process at {} step {step}",
                header.fingerprint.during(header.seq),
                header.step,
                self.fingerprint.during(self.seq)
            ));
        }
        match len {
            Some(len) if header.total != len as u64 => disagree(format!(
                "its block of step {step} of {} has {} bytes where this process's has {len} \
                 (buffers of different lengths)",
                self.fingerprint.during(self.seq),
                header.total
            )),
            _ => Ok(()),
        }
    }
}

fn read(peer: usize) -> impl Fn(ReadError) -> (usize, Failure) {
    move |e| (peer, Failure::Read(e))
}

fn write(peer: usize) -> impl Fn(std::io::Error) -> (usize, Failure) {
    move |e| (peer, Failure::Write(e))
}

/// `data[a]` to read and `data[b]` to write, two ranges that do not overlap.
fn disjoint(data: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "{a:?} and {b:?} overlap"
    );
    if a.end <= b.start {
        let (low, high) = data.split_at_mut(b.start);
        (&low[a], &mut high[..b.end - b.start])
    } else {
        let (low, high) = data.split_at_mut(a.start);
        (&high[..a.end - a.start], &mut low[b])
    }
}

#[cfg(test)]
mod tests {
    use super::disjoint;

    #[test]
    fn disjoint_ranges_either_way_round() {
        let mut data: Vec<u8> = (0..10).collect();
        let (a, b) = disjoint(&mut data, 1..3, 5..8);
        assert_eq!(a, [1, 2]);
        b.fill(0);
        let (a, b) = disjoint(&mut data, 6..9, 0..2);
        assert_eq!(a, [0, 0, 8]);
        assert_eq!(b, [0, 1]);
        let (a, b) = disjoint(&mut data, 3..3, 3..4);
        assert!(a.is_empty() && b == [3]);
    }
}
