//! The seam where an engine plugs in under the collectives, as torch.distributed's backends
//! (gloo, MPI, NCCL) plug in under its `ProcessGroup`.
//!
//! An [`Engine`] moves bytes between the processes of a run: the raw collectives on byte
//! buffers whose values it is told the [`Element`] of, and point-to-point messages on lanes.
//! Everything above it (numbering and fingerprinting the calls, means, typed and tensor
//! collectives, the gradient sync) is the same for every engine, in
//! `ProcessGroup` (burn-accelerate's `distributed` module). Byte buffers (not generic values) keep the trait a
//! trait object, and map one to one onto MPI's `(buffer, count, datatype)` calls.
//!
//! Engines here: [`TcpEngine`], the built-in transport (gloo's role), and `MpiEngine` (feature `mpi`),
//! over the cluster's MPI.

use std::ops::Range;

use super::element::Element;
use super::error::DistributedError;

#[cfg(feature = "mpi")]
mod mpi;
pub(crate) mod tcp;

#[cfg(feature = "mpi")]
pub use mpi::MpiEngine;
pub use tcp::{TcpEngine, sent_bytes};

/// A stream of point-to-point messages between two processes (the collectives have lane 0).
pub type Lane = u32;

/// A point-to-point message's tag, checked by its receiver: (number, step).
pub type Tag = (u64, u32);

/// What carries the bytes of a run of several processes. Every method is a collective call:
/// every process makes the same calls, in the same order, with the same `seq` (the call's
/// number in the run) and, where it says so, the same sizes.
pub trait Engine: Send + Sync {
    /// Sums `data`, values of `element`, over the processes, in place. Every process ends
    /// with the same bits.
    fn all_reduce(
        &self,
        seq: u64,
        element: Element,
        data: &mut [u8],
    ) -> Result<(), DistributedError>;

    /// Sums `data` over the processes block by block: afterwards `data[blocks[rank]]` holds
    /// the sum of every process's values there; the rest of `data` is left as scratch.
    /// `blocks` tile `data` in rank order, the same on every process.
    fn reduce_scatter(
        &self,
        seq: u64,
        element: Element,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Result<(), DistributedError>;

    /// Fills every block of `data` with its process's: this process's bytes are in
    /// `data[blocks[rank]]`. `blocks` tile `data` in rank order, the same on every process.
    fn all_gather(
        &self,
        seq: u64,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Result<(), DistributedError>;

    /// Replaces `data` by process `root`'s, on every process.
    fn broadcast(&self, seq: u64, root: usize, data: &mut Vec<u8>) -> Result<(), DistributedError>;

    /// Sends `payload` to process `to` on `lane`, in order with the lane's other messages.
    fn send(&self, lane: Lane, to: usize, tag: Tag, payload: &[u8])
    -> Result<(), DistributedError>;

    /// The next message from process `from` on `lane`, with its tag.
    fn recv(&self, lane: Lane, from: usize) -> Result<(Tag, Vec<u8>), DistributedError>;

    /// Ends the run's collectives on every process with `reason`, from this process (one that
    /// failed where the others must not go on waiting for it, or go on without it). Returns
    /// once the others were told, or after a bounded wait.
    fn abort(&self, reason: String);
}

/// The byte ranges of blocks of `counts` values of `size` bytes each, in order.
pub fn blocks(counts: impl IntoIterator<Item = usize>, size: usize) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .into_iter()
        .map(|count| {
            let block = start..start + count * size;
            start = block.end;
            block
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn blocks_follow_the_counts() {
        assert_eq!(super::blocks([2, 0, 3], 4), [0..8, 8..8, 8..20]);
        assert!(super::blocks([], 4).is_empty());
    }
}
