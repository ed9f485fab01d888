//! The handshake every connection starts with, to the rendezvous and between processes: a
//! challenge-response on the run's secret (HMAC-SHA256), both ways, before anything else is
//! read. The secret never crosses the wire; the accepting side's challenge is fresh for every
//! connection, so a recorded handshake cannot be replayed; tags are compared in constant time
//! (`hmac`'s `verify_slice`).
//!
//! ```text
//! accepting side                              connecting side
//!   challenge: "BACC", nonce_a (32)   ──▶
//!                                     ◀──  hello: "BAC2", 1 (its byte order), rank, lane,
//!                                                 run, nonce_c (32),
//!                                                 HMAC(secret, "client" nonce_a nonce_c hello)
//!   proof: HMAC(secret, "server" nonce_c nonce_a)  ──▶
//! ```
//!
//! A stranger (no secret, a wrong one, a replayed hello, junk, or silence) is dropped before it
//! can take a rank, change the world size or deliver a value; the run goes on.

use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::RunSecret;
use crate::engine::Lane;

/// How long a new connection may take over its side of the handshake.
pub(crate) const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

const CHALLENGE: &[u8; 4] = b"BACC";
const HELLO: &[u8; 4] = b"BAC2";
const NONCE: usize = 32;
const TAG: usize = 32;
const CHALLENGE_LEN: usize = 4 + NONCE;
const HELLO_LEN: usize = 24 + NONCE + TAG;

/// What the accepting side sends in place of its proof to a connection it drops because
/// newer ones are waiting for their handshakes ([`pending`](super::pending)): the dialer
/// tries again. No HMAC output is these bytes but by a 2^-256 chance.
pub(crate) const BUSY: [u8; TAG] = *b"BACB: too many handshakes; again";

/// How a connecting side's handshake ended, when the other side did not refuse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Connected {
    /// Both sides proved they know the secret.
    Proved,
    /// The other side had too many handshakes in progress and dropped this one: try again.
    Busy,
}

/// Who connects, for which lane, in which run (0 before the rendezvous gave it one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) rank: u32,
    pub(crate) lane: Lane,
    pub(crate) run: u64,
}

impl Hello {
    fn fields(self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..4].copy_from_slice(HELLO);
        // `1` in the sender's byte order: a machine of the other order, whose values would be
        // read wrong, is told apart.
        b[4..8].copy_from_slice(&1u32.to_ne_bytes());
        b[8..12].copy_from_slice(&self.rank.to_ne_bytes());
        b[12..16].copy_from_slice(&self.lane.to_ne_bytes());
        b[16..24].copy_from_slice(&self.run.to_ne_bytes());
        b
    }

    fn parse(b: &[u8]) -> Result<Self, String> {
        if &b[..4] != HELLO {
            return Err("it is not a burn-accelerate process of this version".into());
        }
        if b[4..8] != 1u32.to_ne_bytes() {
            return Err(
                "its machine has the other byte order: a run's machines must share it".into(),
            );
        }
        let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Ok(Self {
            rank: u32_at(8),
            lane: u32_at(12),
            run: u64::from_ne_bytes(b[16..24].try_into().expect("8 bytes")),
        })
    }
}

fn mac(secret: &RunSecret, parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.key()).expect("HMAC takes any key");
    for part in parts {
        mac.update(part);
    }
    mac
}

fn nonce() -> Result<[u8; NONCE], String> {
    let mut nonce = [0u8; NONCE];
    getrandom::fill(&mut nonce).map_err(|e| format!("no random bytes for a nonce: {e}"))?;
    Ok(nonce)
}

/// The accepting side: challenges the connection and returns who it proved to be.
pub(crate) async fn accept<R, W>(
    reader: &mut R,
    writer: &mut W,
    secret: &RunSecret,
) -> Result<Hello, String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    verify(reader, writer, secret).await?.prove(writer).await
}

/// A connection that proved it knows the run's secret, not yet sent this side's proof: its
/// handshake ends, and it may send, once [`prove`](Self::prove) has sent it.
pub(crate) struct Verified {
    /// Who it proved to be.
    pub(crate) hello: Hello,
    proof: [u8; TAG],
}

impl Verified {
    /// Sends this side's proof, ending the handshake.
    pub(crate) async fn prove<W: AsyncWrite + Unpin>(
        self,
        writer: &mut W,
    ) -> Result<Hello, String> {
        writer
            .write_all(&self.proof)
            .await
            .map_err(|e| format!("it left before the proof ({e})"))?;
        Ok(self.hello)
    }
}

/// The accepting side's first part: challenges the connection and checks its answer.
pub(crate) async fn verify<R, W>(
    reader: &mut R,
    writer: &mut W,
    secret: &RunSecret,
) -> Result<Verified, String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let ours = nonce()?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    challenge[..4].copy_from_slice(CHALLENGE);
    challenge[4..].copy_from_slice(&ours);
    writer
        .write_all(&challenge)
        .await
        .map_err(|e| format!("it left before the challenge ({e})"))?;
    let mut hello = [0u8; HELLO_LEN];
    reader
        .read_exact(&mut hello)
        .await
        .map_err(|e| format!("it did not answer the challenge ({e})"))?;
    let parsed = Hello::parse(&hello[..24])?;
    let theirs = &hello[24..24 + NONCE];
    mac(secret, &[b"client", &ours, theirs, &hello[..24]])
        .verify_slice(&hello[24 + NONCE..])
        .map_err(|_| {
            format!(
                "it (claiming rank {}) does not know the run's secret",
                parsed.rank
            )
        })?;
    let proof = mac(secret, &[b"server", theirs, &ours])
        .finalize()
        .into_bytes()
        .into();
    Ok(Verified {
        hello: parsed,
        proof,
    })
}

/// The connecting side: answers the challenge as `hello` and checks that the other side,
/// too, knows the secret; a busy listener ([`try_connect`]'s [`Connected::Busy`]) is an error
/// here.
#[cfg(test)]
pub(crate) async fn connect<R, W>(
    reader: &mut R,
    writer: &mut W,
    secret: &RunSecret,
    hello: Hello,
) -> Result<(), String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match try_connect(reader, writer, secret, hello).await? {
        Connected::Proved => Ok(()),
        Connected::Busy => Err(BUSY_REASON.into()),
    }
}

/// Why a dialer that kept finding the listener busy gave up.
pub(crate) const BUSY_REASON: &str = "it had too many connections in their handshake (a flood \
     of connections that never answer?) every time this process tried";

/// [`connect`], telling a listener that dropped this connection for newer ones
/// ([`Connected::Busy`]: try again) from one that refused it.
pub(crate) async fn try_connect<R, W>(
    reader: &mut R,
    writer: &mut W,
    secret: &RunSecret,
    hello: Hello,
) -> Result<Connected, String>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut challenge = [0u8; CHALLENGE_LEN];
    reader
        .read_exact(&mut challenge)
        .await
        .map_err(|e| format!("no challenge came ({e})"))?;
    if &challenge[..4] != CHALLENGE {
        return Err("what answers there is not a burn-accelerate process".into());
    }
    let theirs = &challenge[4..];
    let ours = nonce()?;
    let fields = hello.fields();
    let tag = mac(secret, &[b"client", theirs, &ours, &fields])
        .finalize()
        .into_bytes();
    let mut answer = Vec::with_capacity(HELLO_LEN);
    answer.extend_from_slice(&fields);
    answer.extend_from_slice(&ours);
    answer.extend_from_slice(&tag);
    writer
        .write_all(&answer)
        .await
        .map_err(|e| format!("it closed the connection ({e})"))?;
    let mut proof = [0u8; TAG];
    reader.read_exact(&mut proof).await.map_err(|_| {
        "it refused this process: do all processes have the same run secret \
         (BURN_ACCELERATE_SECRET, the launcher's --secret-file)?"
            .to_string()
    })?;
    if proof == BUSY {
        return Ok(Connected::Busy);
    }
    mac(secret, &[b"server", &ours, theirs])
        .verify_slice(&proof)
        .map_err(|_| "what answers there does not know the run's secret".to_string())?;
    Ok(Connected::Proved)
}

/// Tells a connection dropped for newer ones ([`pending`](super::pending)) to try again,
/// where its proof would come; never waits (a stranger that reads nothing is not waited
/// for).
pub(crate) fn tell_busy(writer: &tokio::net::tcp::OwnedWriteHalf) {
    let _ = writer.try_write(&BUSY);
}

#[cfg(test)]
mod tests {
    use tokio::io::duplex;

    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    const HI: Hello = Hello {
        rank: 3,
        lane: 7,
        run: u64::MAX - 1,
    };

    // Runs both sides over an in-memory pipe, with their own secrets.
    fn handshake(
        server: &RunSecret,
        client: &RunSecret,
    ) -> (Result<Hello, String>, Result<(), String>) {
        block_on(async {
            let (a, b) = duplex(1024);
            let (mut br, mut bw) = tokio::io::split(b);
            // The accepting side drops its connection once done, as a process does.
            let server = async move {
                let (mut ar, mut aw) = tokio::io::split(a);
                accept(&mut ar, &mut aw, server).await
            };
            tokio::join!(server, connect(&mut br, &mut bw, client, HI))
        })
    }

    #[test]
    fn both_sides_prove_the_secret() {
        let secret = RunSecret::from_text("s3cret");
        let (accepted, connected) = handshake(&secret, &secret);
        assert_eq!(accepted, Ok(HI));
        assert_eq!(connected, Ok(()));
    }

    #[test]
    fn a_listener_that_drops_the_connection_for_newer_ones_is_told_from_a_refusal() {
        let secret = RunSecret::from_text("s3cret");
        let mut busy = CHALLENGE.to_vec();
        busy.extend_from_slice(&[5; NONCE]);
        busy.extend_from_slice(&BUSY);
        let mut sink = Vec::new();
        let connected = block_on(try_connect(&mut busy.as_slice(), &mut sink, &secret, HI));
        assert_eq!(connected, Ok(Connected::Busy));
        let connected = block_on(connect(&mut busy.as_slice(), &mut sink, &secret, HI));
        assert!(connected.unwrap_err().contains("too many connections"));
    }

    #[test]
    fn a_wrong_secret_is_refused_on_both_sides() {
        let (accepted, connected) = handshake(
            &RunSecret::from_text("right"),
            &RunSecret::from_text("wrong"),
        );
        assert!(
            accepted
                .unwrap_err()
                .contains("does not know the run's secret")
        );
        assert!(connected.unwrap_err().contains("refused this process"));
    }

    #[test]
    fn a_replayed_hello_and_junk_are_refused() {
        let secret = RunSecret::from_text("s3cret");
        block_on(async {
            // Record a client's hello to one challenge...
            let (a, b) = duplex(1024);
            let (mut ar, mut aw) = tokio::io::split(a);
            let (mut br, mut bw) = tokio::io::split(b);
            let (accepted, _) = tokio::join!(
                accept(&mut ar, &mut aw, &secret),
                connect(&mut br, &mut bw, &secret, HI)
            );
            accepted.unwrap();
            let mut recorded = Vec::new();
            {
                let (a, b) = duplex(1024);
                let (mut ar, mut aw) = tokio::io::split(a);
                let (mut br, mut bw) = tokio::io::split(b);
                let server = accept(&mut ar, &mut aw, &secret);
                let client = async {
                    let mut challenge = [0u8; CHALLENGE_LEN];
                    br.read_exact(&mut challenge).await.unwrap();
                    let fields = HI.fields();
                    let ours = [7u8; NONCE];
                    let tag = mac(&secret, &[b"client", &challenge[4..], &ours, &fields])
                        .finalize()
                        .into_bytes();
                    recorded.extend_from_slice(&fields);
                    recorded.extend_from_slice(&ours);
                    recorded.extend_from_slice(&tag);
                    bw.write_all(&recorded).await.unwrap();
                };
                let (accepted, ()) = tokio::join!(server, client);
                accepted.unwrap();
            }
            // ...and play it to another: its challenge is fresh, so the tag no longer fits.
            let (a, b) = duplex(1024);
            let (mut ar, mut aw) = tokio::io::split(a);
            let (mut br, mut bw) = tokio::io::split(b);
            let replay = async {
                let mut challenge = [0u8; CHALLENGE_LEN];
                br.read_exact(&mut challenge).await.unwrap();
                bw.write_all(&recorded).await.unwrap();
            };
            let (accepted, ()) = tokio::join!(accept(&mut ar, &mut aw, &secret), replay);
            assert!(
                accepted
                    .unwrap_err()
                    .contains("does not know the run's secret")
            );

            // Junk of the right length.
            let (a, b) = duplex(1024);
            let (mut ar, mut aw) = tokio::io::split(a);
            let (mut br, mut bw) = tokio::io::split(b);
            let junk = async {
                let mut challenge = [0u8; CHALLENGE_LEN];
                br.read_exact(&mut challenge).await.unwrap();
                bw.write_all(&[0x41; HELLO_LEN]).await.unwrap();
            };
            let (accepted, ()) = tokio::join!(accept(&mut ar, &mut aw, &secret), junk);
            assert!(
                accepted
                    .unwrap_err()
                    .contains("not a burn-accelerate process")
            );
        });
    }

    #[test]
    fn the_byte_order_is_checked() {
        let mut fields = HI.fields();
        assert_eq!(Hello::parse(&fields), Ok(HI));
        fields[4..8].copy_from_slice(&1u32.swap_bytes().to_ne_bytes());
        assert!(Hello::parse(&fields).unwrap_err().contains("byte order"));
    }

    // The property tests of issue 49 (SECURITY.md): whatever a stranger sends before the
    // handshake ends, each side reads a fixed number of bytes into a buffer on its stack,
    // allocates nothing of its size, and refuses it saying why.

    use proptest::prelude::*;

    use crate::fuzz;

    const CI_CASES: u32 = 2000;

    fn hellos() -> impl Strategy<Value = Vec<u8>> {
        let mut valid = HI.fields().to_vec();
        valid.extend_from_slice(&[7; NONCE + TAG]);
        let mut challenge = CHALLENGE.to_vec();
        challenge.extend_from_slice(&[9; NONCE + TAG]);
        fuzz::inputs(vec![valid, challenge], 3 * HELLO_LEN)
    }

    // `bytes` as what comes to either side: refused, with a reason, within a small allocation.
    fn stranger_is_refused(bytes: Vec<u8>) -> Result<(), TestCaseError> {
        let secret = RunSecret::from_text("the run's");
        let (largest, (accepted, connected)) = fuzz::largest_allocation(|| {
            block_on(async {
                let mut sink = Vec::new();
                let accepted = accept(&mut bytes.as_slice(), &mut sink, &secret).await;
                let mut sink = Vec::new();
                let connected = connect(&mut bytes.as_slice(), &mut sink, &secret, HI).await;
                (accepted, connected)
            })
        });
        prop_assert!(accepted.is_err_and(|why| !why.is_empty()));
        prop_assert!(connected.is_err_and(|why| !why.is_empty()));
        prop_assert!(largest < 1 << 16, "{largest} bytes");
        Ok(())
    }

    #[test]
    fn any_bytes_from_a_stranger_are_refused_at_the_handshake() {
        fuzz::check(CI_CASES, hellos(), stranger_is_refused);
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_handshake() {
        fuzz::long_run("handshake", hellos(), stranger_is_refused);
    }
}
