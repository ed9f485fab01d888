//! How values travel between processes: payloads (little-endian f32 values, or any bytes)
//! behind a short header that names the lane, the collective and its step, so that processes
//! calling collectives in different orders are caught instead of mixing buffers.

use std::borrow::Cow;

use bytes::{BufMut, Bytes, BytesMut};

/// The first message on a connection between two processes: who is calling, in which run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) rank: u32,
    pub(crate) run: u64,
}

const HELLO: &[u8; 4] = b"BAH1";

impl Hello {
    pub(crate) fn encode(self) -> Bytes {
        let mut b = BytesMut::with_capacity(16);
        b.put_slice(HELLO);
        b.put_u32_le(self.rank);
        b.put_u64_le(self.run);
        b.freeze()
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let rest = bytes.strip_prefix(HELLO)?;
        let rank = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?);
        let run = u64::from_le_bytes(rest.get(4..12)?.try_into().ok()?);
        Some(Self { rank, run })
    }
}

/// A stream of messages between two processes, ordered apart from the others'.
pub(crate) type Lane = u32;

/// The lane of the process group's collectives.
pub(crate) const COLLECTIVES: Lane = 0;

/// The header of a message: its lane, the collective's (or stream message's) number in this
/// process's sequence on that lane, the step within it, and the number of payload bytes that
/// follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) lane: Lane,
    pub(crate) seq: u64,
    pub(crate) step: u32,
    pub(crate) len: u32,
}

const HEADER: usize = 20;

/// The lane of a message, read without decoding the rest.
pub(crate) fn lane(bytes: &[u8]) -> Option<Lane> {
    Some(u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?))
}

/// A message of raw bytes with its header.
pub(crate) fn encode_bytes(lane: Lane, seq: u64, step: u32, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER + payload.len());
    b.put_u32_le(lane);
    b.put_u64_le(seq);
    b.put_u32_le(step);
    b.put_u32_le(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// A chunk of values with its header.
pub(crate) fn encode(lane: Lane, seq: u64, step: u32, values: &[f32]) -> Bytes {
    // On little-endian machines the values are already their wire bytes: one copy, not a
    // loop over values (a gradient bucket is megabytes).
    if cfg!(target_endian = "little") {
        return encode_bytes(lane, seq, step, bytemuck::cast_slice(values));
    }
    let le: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    encode_bytes(lane, seq, step, &le)
}

/// The header and the payload of a message; `None` when the bytes are not one.
pub(crate) fn decode(bytes: &[u8]) -> Option<(Header, &[u8])> {
    let header = Header {
        lane: lane(bytes)?,
        seq: u64::from_le_bytes(bytes.get(4..12)?.try_into().ok()?),
        step: u32::from_le_bytes(bytes.get(12..16)?.try_into().ok()?),
        len: u32::from_le_bytes(bytes.get(16..20)?.try_into().ok()?),
    };
    let payload = &bytes[HEADER..];
    (payload.len() == header.len as usize).then_some((header, payload))
}

/// The values of a chunk's payload; `None` when it is not a whole number of them. Borrowed
/// from the message where its alignment and the machine allow.
pub(crate) fn values(payload: &[u8]) -> Option<Cow<'_, [f32]>> {
    if !payload.len().is_multiple_of(4) {
        return None;
    }
    let borrowed = cfg!(target_endian = "little")
        .then(|| bytemuck::try_cast_slice::<u8, f32>(payload).ok())
        .flatten();
    Some(match borrowed {
        Some(values) => Cow::Borrowed(values),
        None => Cow::Owned(
            payload
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_and_hellos_round_trip() {
        let values = [1.5, -0.0, f32::INFINITY, f32::MIN_POSITIVE];
        let bytes = encode(3, 7, 2, &values);
        let (header, payload) = decode(&bytes).unwrap();
        assert_eq!(
            header,
            Header {
                lane: 3,
                seq: 7,
                step: 2,
                len: 16
            }
        );
        let got: Vec<u32> = self::values(payload)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got, values.map(f32::to_bits));
        assert!(decode(&bytes[..bytes.len() - 1]).is_none());
        let nan = encode(COLLECTIVES, 0, 0, &[f32::NAN]);
        assert!(self::values(decode(&nan).unwrap().1).unwrap()[0].is_nan());
        // A payload that is not 4-byte aligned in memory is read all the same.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&bytes);
        let got = self::values(decode(&shifted[1..]).unwrap().1).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            values.map(f32::to_bits)
        );

        assert!(self::values(&[0; 3]).is_none());
        let raw = encode_bytes(9, 1, 0, b"any bytes");
        assert_eq!(lane(&raw), Some(9));
        assert_eq!(decode(&raw).unwrap().1, b"any bytes");

        let hello = Hello {
            rank: 3,
            run: u64::MAX - 1,
        };
        assert_eq!(Hello::decode(&hello.encode()), Some(hello));
        assert_eq!(Hello::decode(&bytes), None);
    }
}
