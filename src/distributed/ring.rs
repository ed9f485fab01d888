//! The ring all-reduce's schedule as pure arithmetic: which chunk a rank sends and receives at
//! each step. The network code follows it; the tests here run it over in-memory ranks.
//!
//! A buffer of `len` values is cut into `n` chunks (one per rank, some empty when `len < n`).
//! In the reduce-scatter phase, at step `s` rank `r` sends its partial sum of chunk
//! `r - s` to rank `r + 1` and adds what rank `r - 1` sends (chunk `r - s - 1`); after `n - 1`
//! steps rank `r` holds the complete sum of chunk `r + 1`. In the all-gather phase it passes
//! complete chunks on the same way, so every rank ends with every chunk, and with the same bits:
//! each chunk is summed once, by one chain of ranks, then copied. Each rank sends and receives
//! `2 (n - 1) / n` of the buffer, whatever `n`.
//!
//! The chain of a chunk is fixed by the ranks alone, so a run's sums are the same from one
//! run to the next (a resumed run reproduces the uninterrupted one bit for bit).

use std::ops::Range;

/// The values of chunk `chunk` of a `len`-long buffer cut into `n` chunks.
pub(crate) fn chunk(len: usize, n: usize, chunk: usize) -> Range<usize> {
    let bound = |c: usize| (c as u128 * len as u128 / n as u128) as usize;
    bound(chunk)..bound(chunk + 1)
}

/// The phase of the ring a step belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Received values are added to the rank's own.
    ReduceScatter,
    /// Received values replace the rank's own.
    AllGather,
}

/// What rank `rank` of `n` does at step `step` (`0..n-1`) of `phase`: the chunk it sends to
/// `rank + 1` and the chunk it receives from `rank - 1`.
pub(crate) fn exchange(phase: Phase, rank: usize, n: usize, step: usize) -> (usize, usize) {
    let back = |k: usize| (rank + 2 * n - k) % n;
    match phase {
        Phase::ReduceScatter => (back(step), back(step + 1)),
        Phase::AllGather => ((rank + 1 + 2 * n - step) % n, back(step)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Runs the schedule over in-memory ranks, as the network does (every send of a step is
    // received in the same step).
    fn ring_sum(buffers: &mut [Vec<f32>]) {
        let n = buffers.len();
        let len = buffers[0].len();
        for phase in [Phase::ReduceScatter, Phase::AllGather] {
            for step in 0..n.saturating_sub(1) {
                let sent: Vec<Vec<f32>> = (0..n)
                    .map(|r| buffers[r][chunk(len, n, exchange(phase, r, n, step).0)].to_vec())
                    .collect();
                for (r, buffer) in buffers.iter_mut().enumerate() {
                    let from = (r + n - 1) % n;
                    let (sent_chunk, _) = exchange(phase, from, n, step);
                    let (_, recv_chunk) = exchange(phase, r, n, step);
                    assert_eq!(sent_chunk, recv_chunk, "rank {r} step {step} {phase:?}");
                    let range = chunk(len, n, recv_chunk);
                    for (own, got) in buffer[range].iter_mut().zip(&sent[from]) {
                        *own = match phase {
                            Phase::ReduceScatter => *own + got,
                            Phase::AllGather => *got,
                        };
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_tile_the_buffer() {
        for n in 1..9 {
            for len in [0, 1, 3, 7, 8, 100] {
                let ranges: Vec<_> = (0..n).map(|c| chunk(len, n, c)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[n - 1].end, len);
                assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn every_rank_ends_with_the_same_complete_sum() {
        for n in 1..7 {
            for len in [0, 1, 2, 5, 6, 37] {
                let mut buffers: Vec<Vec<f32>> = (0..n)
                    .map(|r| (0..len).map(|i| (r * 1000 + i) as f32).collect())
                    .collect();
                let expected: Vec<f32> = (0..len)
                    .map(|i| (0..n).map(|r| (r * 1000 + i) as f32).sum())
                    .collect();
                ring_sum(&mut buffers);
                for (r, buffer) in buffers.iter().enumerate() {
                    assert_eq!(buffer, &expected, "n={n} len={len} rank={r}");
                }
            }
        }
    }

    #[test]
    fn ranks_agree_to_the_bit_where_the_order_of_sums_matters() {
        // Values whose sum depends on the order of additions in f32.
        let n: i32 = 4;
        let mut buffers: Vec<Vec<f32>> = (0..n)
            .map(|r| (0..9).map(|i| 1e8_f32.powi((r + i) % 3) / 3.0).collect())
            .collect();
        ring_sum(&mut buffers);
        for buffer in &buffers[1..] {
            let bits = |b: &[f32]| b.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(buffer), bits(&buffers[0]));
        }
    }
}
