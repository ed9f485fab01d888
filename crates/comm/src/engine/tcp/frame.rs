//! How bytes travel on a connection: a message of any length (64-bit) goes as a run of frames,
//! each a fixed header and at most one piece of the payload, so that neither side ever holds
//! more than a piece of it in flight and a receiver can start on the first piece while the
//! rest is on its way.
//!
//! Every frame names the collective it belongs to (its [`Fingerprint`]: operation, element and
//! count; its sequence number and step), so that processes making different calls are caught
//! at the first frame instead of mixing buffers, and says where its piece lies in the message,
//! so that a receiver checks the pieces come whole and in order. Values are in the machines'
//! byte order, which the handshake ([`auth`](super::auth)) checks is the same on both ends.

use std::io::IoSlice;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::element::Element;

/// The payload bytes a frame carries at most when this process sends.
pub(crate) const PIECE: usize = 1 << 20;

/// The largest piece a receiver accepts (a sender may use larger pieces than ours, up to
/// this); anything larger is a malformed frame, not a reason to allocate.
pub(crate) const MAX_PIECE: usize = 16 << 20;

/// The most a receiver reserves ahead of the bytes for a message whose header claims more:
/// past it, the buffer grows as pieces arrive, so that a header's `total` cannot make a
/// process allocate what was never sent (SECURITY.md).
pub(crate) const RESERVE_AHEAD: usize = 64 << 20;

/// Makes room in `buffer` for a message whose header claims `total` bytes: all of it up to
/// [`RESERVE_AHEAD`], the rest as it comes.
///
/// # Errors
/// What is wrong, in words: `total` is more than this machine can address, or the room
/// cannot be had.
pub(crate) fn reserve_claimed(buffer: &mut Vec<u8>, total: u64) -> Result<(), String> {
    let total = usize::try_from(total)
        .map_err(|_| format!("a message of {total} bytes, more than this machine addresses"))?;
    let ahead = total.min(RESERVE_AHEAD);
    buffer
        .try_reserve_exact(ahead)
        .map_err(|_| format!("no room for the first {ahead} bytes of a message of {total}"))
}

/// What a message is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Stream,
    Rendezvous,
    /// "Still here": sent back along the ring by a background task, whatever the training
    /// loop is doing.
    Heartbeat,
    /// "The run's collectives are over": the first failure, passed back along the ring.
    Abort,
}

impl Op {
    const ALL: [Op; 8] = [
        Op::AllReduce,
        Op::ReduceScatter,
        Op::AllGather,
        Op::Broadcast,
        Op::Stream,
        Op::Rendezvous,
        Op::Heartbeat,
        Op::Abort,
    ];

    fn code(self) -> u8 {
        Self::ALL.iter().position(|o| *o == self).expect("listed") as u8
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all-reduce",
            Op::ReduceScatter => "reduce-scatter",
            Op::AllGather => "all-gather",
            Op::Broadcast => "broadcast",
            Op::Stream => "stream message",
            Op::Rendezvous => "rendezvous message",
            Op::Heartbeat => "heartbeat",
            Op::Abort => "abort",
        }
    }
}

/// What every process must agree on for a collective: the operation, the element type and the
/// number of values (of the whole buffer; 0 where the sizes are not known up front).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    pub(crate) op: Op,
    pub(crate) element: Element,
    pub(crate) count: u64,
}

impl Fingerprint {
    /// The call for messages: `all-reduce #7 (10 f32 values)`.
    pub(crate) fn during(&self, seq: u64) -> String {
        let mut text = format!("{} #{seq}", self.op.name());
        if self.element != Element::Bytes {
            text += &format!(" ({} {} values)", self.count, self.element.name());
        } else if self.count != 0 {
            text += &format!(" ({} bytes)", self.count);
        }
        text
    }
}

/// A frame's header: the collective, and where its piece lies in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub(crate) fingerprint: Fingerprint,
    /// The collective's number in the sender's sequence (a stream's own tag for streams).
    pub(crate) seq: u64,
    /// The message's step within the collective.
    pub(crate) step: u32,
    /// The whole message's bytes.
    pub(crate) total: u64,
    /// Where this piece starts in the message.
    pub(crate) offset: u64,
    /// This piece's bytes.
    pub(crate) len: u32,
}

const MAGIC: u8 = 0xBA;
pub(crate) const HEADER: usize = 44;

impl FrameHeader {
    pub(crate) fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0] = MAGIC;
        b[1] = self.fingerprint.op.code();
        b[2] = self.fingerprint.element.code();
        b[4..8].copy_from_slice(&self.step.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.fingerprint.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.total.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..44].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The header in `bytes`, or what is wrong with it.
    pub(crate) fn decode(b: &[u8; HEADER]) -> Result<Self, String> {
        if b[0] != MAGIC {
            return Err(format!(
                "a frame does not start with the protocol's marker (byte {:#04x})",
                b[0]
            ));
        }
        let op = Op::ALL
            .get(usize::from(b[1]))
            .copied()
            .ok_or_else(|| format!("unknown operation code {}", b[1]))?;
        let element =
            Element::from_code(b[2]).ok_or_else(|| format!("unknown element code {}", b[2]))?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let header = Self {
            fingerprint: Fingerprint {
                op,
                element,
                count: u64_at(16),
            },
            step: u32_at(4),
            seq: u64_at(8),
            total: u64_at(24),
            offset: u64_at(32),
            len: u32_at(40),
        };
        if header.len as usize > MAX_PIECE {
            return Err(format!(
                "a piece of {} bytes (at most {MAX_PIECE} are accepted)",
                header.len
            ));
        }
        // An end past u64::MAX is past any message's (`None > Some(_)` would let it through).
        let end = header.offset.checked_add(u64::from(header.len));
        if end.is_none_or(|end| end > header.total) {
            return Err(format!(
                "a piece of {} bytes at {} in a message of {}",
                header.len, header.offset, header.total
            ));
        }
        Ok(header)
    }
}

/// The pieces a message of `total` bytes is cut into, as (offset, length): pieces of
/// `piece` bytes and a shorter last one; one empty piece for an empty message, so that it
/// still arrives.
pub(crate) fn pieces(total: u64, piece: usize) -> impl Iterator<Item = (u64, usize)> {
    let piece = piece.max(1) as u64;
    let count = total.div_ceil(piece).max(1);
    (0..count).map(move |i| {
        let offset = i * piece;
        (offset, (total - offset).min(piece) as usize)
    })
}

/// Checks that a message's pieces arrive whole and in order.
#[derive(Debug)]
pub(crate) struct Assembly {
    /// The message's first header (its fingerprint, tag and length).
    pub(crate) first: FrameHeader,
    received: u64,
}

impl Assembly {
    /// Starts a message with its first frame.
    pub(crate) fn start(first: FrameHeader) -> Result<Self, String> {
        let mut assembly = Self { first, received: 0 };
        assembly.accept(&first)?;
        Ok(assembly)
    }

    /// Takes the next frame of the message.
    pub(crate) fn accept(&mut self, header: &FrameHeader) -> Result<(), String> {
        let first = &self.first;
        if (header.fingerprint, header.seq, header.step, header.total)
            != (first.fingerprint, first.seq, first.step, first.total)
        {
            return Err(format!(
                "a piece of another message ({} step {}) inside {} step {}",
                header.fingerprint.during(header.seq),
                header.step,
                first.fingerprint.during(first.seq),
                first.step
            ));
        }
        if header.offset != self.received {
            return Err(format!(
                "a piece at byte {} where byte {} was next",
                header.offset, self.received
            ));
        }
        if header.len == 0 && header.total != 0 {
            return Err("an empty piece in a message that is not empty".into());
        }
        self.received += u64::from(header.len);
        Ok(())
    }

    /// Whether every byte has come.
    pub(crate) fn complete(&self) -> bool {
        self.received == self.first.total
    }
}

/// Writes a message: `payload` cut into pieces, each behind its header.
pub(crate) async fn write_message<W: AsyncWrite + Unpin>(
    writer: &mut W,
    fingerprint: Fingerprint,
    seq: u64,
    step: u32,
    payload: &[u8],
    piece: usize,
) -> std::io::Result<()> {
    let total = payload.len() as u64;
    for (offset, len) in pieces(total, piece) {
        let header = FrameHeader {
            fingerprint,
            seq,
            step,
            total,
            offset,
            len: len as u32,
        }
        .encode();
        let body = &payload[offset as usize..offset as usize + len];
        write_all_vectored(writer, &header, body).await?;
    }
    writer.flush().await
}

/// Writes one frame as it is (a piece passed on along a chain).
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    header: &FrameHeader,
    piece: &[u8],
) -> std::io::Result<()> {
    write_all_vectored(writer, &header.encode(), piece).await
}

/// Sends what [`write_frame`] left buffered.
pub(crate) async fn flush<W: AsyncWrite + Unpin>(writer: &mut W) -> std::io::Result<()> {
    writer.flush().await
}

// The header and the piece in as few system calls as the socket takes.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    writer: &mut W,
    header: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    let mut slices = [IoSlice::new(header), IoSlice::new(body)];
    let mut bufs: &mut [IoSlice<'_>] = &mut slices;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = writer.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// How reading a frame failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReadError {
    /// The connection ended cleanly between frames.
    Closed,
    /// It ended inside a frame.
    Truncated,
    /// The bytes are not a frame.
    Malformed(String),
    /// The operating system's error (a reset connection, say).
    Io(std::io::ErrorKind, String),
}

impl ReadError {
    /// The error where a message's next frame was expected: a clean end there still cuts it.
    pub(crate) fn mid_message(self) -> Self {
        match self {
            Self::Closed => Self::Truncated,
            other => other,
        }
    }
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Self::Truncated
        } else {
            Self::Io(e.kind(), e.to_string())
        }
    }
}

/// Reads the next frame's header: [`ReadError::Closed`] when the connection ended before it.
pub(crate) async fn read_header<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<FrameHeader, ReadError> {
    let mut bytes = [0u8; HEADER];
    let first = reader.read(&mut bytes).await?;
    if first == 0 {
        return Err(ReadError::Closed);
    }
    reader.read_exact(&mut bytes[first..]).await?;
    FrameHeader::decode(&bytes).map_err(ReadError::Malformed)
}

/// Reads a frame's piece into `buffer` (resized to it).
pub(crate) async fn read_piece<R: AsyncRead + Unpin>(
    reader: &mut R,
    header: &FrameHeader,
    buffer: &mut Vec<u8>,
) -> Result<(), ReadError> {
    let len = header.len as usize;
    if buffer.len() < len {
        buffer.resize(len, 0);
    }
    buffer.truncate(len);
    reader.read_exact(buffer).await?;
    Ok(())
}

/// Reads a whole message (for small ones: the rendezvous's); `limit` bounds its size.
pub(crate) async fn read_message<R: AsyncRead + Unpin>(
    reader: &mut R,
    limit: u64,
) -> Result<(FrameHeader, Vec<u8>), ReadError> {
    let header = read_header(reader).await?;
    let message = read_rest(reader, header, limit).await?;
    Ok((header, message))
}

/// The whole payload of the message whose first header, `first`, was just read (for small
/// ones); `limit` bounds its size.
pub(crate) async fn read_rest<R: AsyncRead + Unpin>(
    reader: &mut R,
    first: FrameHeader,
    limit: u64,
) -> Result<Vec<u8>, ReadError> {
    if first.total > limit {
        return Err(ReadError::Malformed(format!(
            "a message of {} bytes where at most {limit} are expected",
            first.total
        )));
    }
    let mut assembly = Assembly::start(first).map_err(ReadError::Malformed)?;
    let mut message = Vec::with_capacity(first.total as usize);
    let mut piece = Vec::new();
    read_piece(reader, &first, &mut piece).await?;
    message.extend_from_slice(&piece);
    while !assembly.complete() {
        let next = read_header(reader).await.map_err(ReadError::mid_message)?;
        assembly.accept(&next).map_err(ReadError::Malformed)?;
        read_piece(reader, &next, &mut piece).await?;
        message.extend_from_slice(&piece);
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::ReadBuf;

    use super::*;

    fn fingerprint() -> Fingerprint {
        Fingerprint {
            op: Op::AllGather,
            element: Element::Bytes,
            count: 0,
        }
    }

    fn header(total: u64, offset: u64, len: u32) -> FrameHeader {
        FrameHeader {
            fingerprint: Fingerprint {
                op: Op::ReduceScatter,
                element: Element::BF16,
                count: u64::MAX,
            },
            seq: u64::MAX - 3,
            step: u32::MAX,
            total,
            offset,
            len,
        }
    }

    #[test]
    fn headers_round_trip_at_the_32_bit_boundaries() {
        let four_gib = 1u64 << 32;
        for total in [0, 1, four_gib - 1, four_gib, four_gib + 1, u64::MAX] {
            for (offset, len) in [(0, 0), (total.saturating_sub(1), 1), (total / 2, 0)] {
                let len = len.min(total - offset) as u32;
                let h = header(total, offset, len);
                assert_eq!(FrameHeader::decode(&h.encode()), Ok(h), "{total} {offset}");
            }
        }
        let at_boundary = header(four_gib + 5, four_gib, 5);
        assert_eq!(
            FrameHeader::decode(&at_boundary.encode()).unwrap().offset,
            four_gib
        );
    }

    #[test]
    fn bad_headers_are_refused_with_what_is_wrong() {
        let good = header(10, 0, 10).encode();
        let mut bad = good;
        bad[0] = b'G';
        assert!(FrameHeader::decode(&bad).unwrap_err().contains("marker"));
        let mut bad = good;
        bad[1] = 200;
        assert!(FrameHeader::decode(&bad).unwrap_err().contains("operation"));
        let mut bad = good;
        bad[2] = 200;
        assert!(FrameHeader::decode(&bad).unwrap_err().contains("element"));
        let too_big = header(1 << 30, 0, MAX_PIECE as u32 + 1).encode();
        assert!(
            FrameHeader::decode(&too_big)
                .unwrap_err()
                .contains("at most")
        );
        // Found by the property test: an end past u64::MAX was taken for one inside.
        let wrapping = header(10, u64::MAX - 1, 4).encode();
        assert!(
            FrameHeader::decode(&wrapping)
                .unwrap_err()
                .contains("in a message of 10")
        );
        let past_end = header(10, 8, 4).encode();
        assert!(
            FrameHeader::decode(&past_end)
                .unwrap_err()
                .contains("in a message of 10")
        );
    }

    #[test]
    fn pieces_tile_every_length_including_zero_and_past_4_gib() {
        assert_eq!(pieces(0, 4).collect::<Vec<_>>(), [(0, 0)]);
        for piece in [1, 3, 4, 7] {
            for total in 1..30u64 {
                let all: Vec<_> = pieces(total, piece).collect();
                assert_eq!(all[0].0, 0);
                assert!(all.windows(2).all(|w| w[0].0 + w[0].1 as u64 == w[1].0));
                let last = all.last().unwrap();
                assert_eq!(last.0 + last.1 as u64, total);
                assert!(all.iter().all(|(_, l)| *l >= 1 && *l <= piece));
            }
        }
        let total = (1u64 << 32) + 3;
        let all: Vec<_> = pieces(total, PIECE).collect();
        assert_eq!(all.len(), (1 << 32) / PIECE + 1);
        assert_eq!(*all.last().unwrap(), (1 << 32, 3));
        assert_eq!(pieces(u32::MAX as u64, PIECE).last().unwrap().1, PIECE - 1);
    }

    #[test]
    fn an_assembly_takes_only_the_next_piece_of_its_own_message() {
        let mut a = Assembly::start(header(10, 0, 4)).unwrap();
        assert!(!a.complete());
        assert!(
            a.accept(&header(10, 6, 4))
                .unwrap_err()
                .contains("byte 4 was next")
        );
        let mut other = header(10, 4, 4);
        other.seq += 1;
        assert!(a.accept(&other).unwrap_err().contains("another message"));
        a.accept(&header(10, 4, 6)).unwrap();
        assert!(a.complete());
        assert!(Assembly::start(header(0, 0, 0)).unwrap().complete());
        assert!(Assembly::start(header(10, 0, 0)).is_err());
        assert!(Assembly::start(header(10, 2, 8)).is_err());
    }

    /// Hands out its bytes in two reads, split at `at`, then one byte at a time: every way a
    /// socket may cut a frame.
    struct Split {
        bytes: Vec<u8>,
        at: usize,
        pos: usize,
    }

    impl AsyncRead for Split {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let end = if self.pos < self.at {
                self.at
            } else {
                self.pos + 1
            }
            .min(self.bytes.len());
            let n = (end - self.pos).min(buf.remaining());
            let pos = self.pos;
            buf.put_slice(&self.bytes[pos..pos + n]);
            self.pos += n;
            Poll::Ready(Ok(()))
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn encoded(payload: &[u8], piece: usize) -> Vec<u8> {
        let mut wire = Vec::new();
        block_on(write_message(
            &mut wire,
            fingerprint(),
            9,
            2,
            payload,
            piece,
        ))
        .unwrap();
        wire
    }

    #[test]
    fn a_message_reads_back_whatever_the_split_of_the_bytes() {
        let payload: Vec<u8> = (0..23u8).collect();
        for piece in [1, 5, 23, 64] {
            let wire = encoded(&payload, piece);
            assert_eq!(
                wire.len(),
                payload.len() + HEADER * payload.len().div_ceil(piece)
            );
            for at in 0..=wire.len() {
                let mut reader = Split {
                    bytes: wire.clone(),
                    at,
                    pos: 0,
                };
                let (header, got) = block_on(read_message(&mut reader, 1 << 20)).unwrap();
                assert_eq!(got, payload, "piece {piece}, split at {at}");
                assert_eq!((header.seq, header.step, header.total), (9, 2, 23));
                // Nothing after it: the next read is a clean close.
                assert_eq!(
                    block_on(read_header(&mut reader)).unwrap_err(),
                    ReadError::Closed
                );
            }
        }
    }

    #[test]
    fn an_empty_message_is_one_frame_and_a_cut_one_is_truncated() {
        let wire = encoded(&[], PIECE);
        assert_eq!(wire.len(), HEADER);
        let (header, got) = block_on(read_message(&mut wire.as_slice(), 0)).unwrap();
        assert!(got.is_empty() && header.total == 0);

        let wire = encoded(&[7; 10], 4);
        for cut in 1..wire.len() {
            let err = block_on(read_message(&mut &wire[..cut], 100)).unwrap_err();
            assert_eq!(err, ReadError::Truncated, "cut at {cut}");
        }
        let err = block_on(read_message(&mut wire.as_slice(), 9)).unwrap_err();
        assert!(matches!(err, ReadError::Malformed(m) if m.contains("at most 9")));
    }

    // The property tests of issue 49 (SECURITY.md): every input a peer could send.

    use proptest::prelude::*;

    use crate::fuzz;

    const CI_CASES: u32 = 3000;
    const LIMIT: u64 = 1 << 12;

    fn valid_wires() -> Vec<Vec<u8>> {
        let mut wires = vec![encoded(&[], PIECE), encoded(&[1; 10], 4)];
        wires.push(encoded(&(0..200u8).collect::<Vec<_>>(), 64));
        wires.push(header(1 << 40, 0, 8).encode().to_vec());
        wires
    }

    fn headers() -> impl Strategy<Value = [u8; HEADER]> {
        fuzz::inputs(valid_wires(), 2 * HEADER).prop_map(|mut bytes| {
            bytes.resize(HEADER, 0);
            bytes.try_into().expect("resized")
        })
    }

    fn decoded_header_is_consistent(bytes: [u8; HEADER]) -> Result<(), TestCaseError> {
        match FrameHeader::decode(&bytes) {
            Ok(h) => {
                prop_assert!(h.len as usize <= MAX_PIECE);
                prop_assert!(
                    h.offset
                        .checked_add(u64::from(h.len))
                        .is_some_and(|e| e <= h.total)
                );
                prop_assert_eq!(&h.encode()[..3], &bytes[..3]);
                prop_assert_eq!(&h.encode()[4..], &bytes[4..]);
            }
            Err(why) => prop_assert!(!why.is_empty()),
        }
        Ok(())
    }

    // A message from `wire` never panics, never allocates past its limit or a piece, and ends
    // (a slice cannot block): a whole message of at most LIMIT bytes, or why not.
    fn message_is_bounded(wire: Vec<u8>) -> Result<(), TestCaseError> {
        let (largest, read) =
            fuzz::largest_allocation(|| block_on(read_message(&mut wire.as_slice(), LIMIT)));
        match read {
            Ok((h, payload)) => {
                prop_assert_eq!(payload.len() as u64, h.total);
                prop_assert!(h.total <= LIMIT);
            }
            Err(ReadError::Malformed(why)) => prop_assert!(!why.is_empty()),
            Err(_) => {}
        }
        prop_assert!(largest <= MAX_PIECE + (1 << 16), "{largest} bytes");
        Ok(())
    }

    #[test]
    fn any_header_decodes_or_says_what_is_wrong() {
        fuzz::check(CI_CASES, headers(), decoded_header_is_consistent);
    }

    #[test]
    fn any_bytes_read_as_a_bounded_message_or_an_error() {
        fuzz::check(
            CI_CASES,
            fuzz::inputs(valid_wires(), 4 * HEADER),
            message_is_bounded,
        );
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_frame_header() {
        fuzz::long_run("frame header", headers(), decoded_header_is_consistent);
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_frame_message() {
        fuzz::long_run(
            "framed message",
            fuzz::inputs(valid_wires(), 4 * HEADER),
            message_is_bounded,
        );
    }

    #[test]
    fn a_claim_of_2_pow_40_bytes_allocates_at_most_the_bound() {
        // A small message's reader refuses it before allocating.
        let wire = header(1 << 40, 0, 8).encode();
        let (largest, read) =
            fuzz::largest_allocation(|| block_on(read_message(&mut wire.as_slice(), LIMIT)));
        assert!(
            matches!(&read, Err(ReadError::Malformed(m)) if m.contains("at most 4096")),
            "{read:?}"
        );
        assert!(largest < 1 << 16, "{largest}");
        // A stream's or a broadcast's reserves RESERVE_AHEAD, then grows with what arrives.
        let mut buffer = Vec::new();
        let (largest, reserved) =
            fuzz::largest_allocation(|| reserve_claimed(&mut buffer, 1 << 40));
        assert_eq!(reserved, Ok(()));
        assert!(largest <= RESERVE_AHEAD, "{largest}");
        assert_eq!(buffer.capacity(), RESERVE_AHEAD);
        let small = reserve_claimed(&mut Vec::new(), 10);
        assert_eq!(small, Ok(()));
        // A piece is refused past MAX_PIECE whatever the message.
        let wire = header(u64::MAX, 0, u32::MAX).encode();
        let (largest, read) =
            fuzz::largest_allocation(|| block_on(read_message(&mut wire.as_slice(), u64::MAX)));
        assert!(matches!(read, Err(ReadError::Malformed(_))), "{read:?}");
        assert!(largest < 1 << 16, "{largest}");
    }
}
