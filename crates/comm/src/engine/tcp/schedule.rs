//! The ring's schedule as pure arithmetic: which block a rank sends to the next rank and which
//! it receives from the previous one at each step. The network code follows it; the tests here
//! run it over in-memory ranks.
//!
//! A buffer is cut into `n` blocks, block `b` belonging to rank `b`.
//! - **Reduce-scatter** (`n - 1` steps): at step `s` rank `r` sends its partial sum of block
//!   `r - s - 1` and adds what it receives into block `r - s - 2`. Block `b` is summed along one
//!   chain, ranks `b + 1, b + 2, …, b` in turn, and ends complete on its own rank.
//! - **All-gather** (`n - 1` steps): at step `s` rank `r` passes on block `r - s` and receives
//!   block `r - s - 1`, so every rank ends with every block.
//!
//! An all-reduce is the two in turn: each rank sends and receives `2 (n - 1) / n` of the
//! buffer whatever `n`, and every rank ends with the same bits, since each block is summed
//! once, in an order fixed by the ranks alone (a resumed run reproduces the uninterrupted one).

use std::ops::Range;

/// Block `block` of `len` values cut as evenly as possible into `n` (some empty when
/// `len < n`).
pub(crate) fn even_block(len: usize, n: usize, block: usize) -> Range<usize> {
    let bound = |b: usize| (b as u128 * len as u128 / n as u128) as usize;
    bound(block)..bound(block + 1)
}

/// Rank `rank` of `n` at reduce-scatter step `step`: (the block it sends, the block it adds
/// into).
pub(crate) fn reduce_scatter_step(rank: usize, n: usize, step: usize) -> (usize, usize) {
    (back(rank, n, step + 1), back(rank, n, step + 2))
}

/// Rank `rank` of `n` at all-gather step `step`: (the block it sends, the block it receives).
pub(crate) fn all_gather_step(rank: usize, n: usize, step: usize) -> (usize, usize) {
    (back(rank, n, step), back(rank, n, step + 1))
}

// The rank `k` places before `rank` on the ring.
fn back(rank: usize, n: usize, k: usize) -> usize {
    (rank + n - k % n) % n
}

#[cfg(test)]
mod tests {
    use super::*;

    // Runs the schedule over in-memory ranks as the network does: each step's sends are all
    // received in that step, from the previous rank.
    fn run(buffers: &mut [Vec<i64>], reduce: bool, gather: bool) {
        let n = buffers.len();
        let len = buffers[0].len();
        let phases = [reduce, gather];
        for adds in [true, false]
            .into_iter()
            .filter(|adds| phases[usize::from(!adds)])
        {
            let step_of = if adds {
                reduce_scatter_step
            } else {
                all_gather_step
            };
            for step in 0..n - 1 {
                let sent: Vec<Vec<i64>> = (0..n)
                    .map(|r| buffers[r][even_block(len, n, step_of(r, n, step).0)].to_vec())
                    .collect();
                for (r, buffer) in buffers.iter_mut().enumerate() {
                    let from = (r + n - 1) % n;
                    let (block, into) = (step_of(from, n, step).0, step_of(r, n, step).1);
                    assert_eq!(
                        block, into,
                        "rank {r} step {step}: sent and received differ"
                    );
                    for (own, got) in buffer[even_block(len, n, into)].iter_mut().zip(&sent[from]) {
                        *own = if adds { *own + got } else { *got };
                    }
                }
            }
        }
    }

    fn buffers(n: usize, len: usize) -> Vec<Vec<i64>> {
        (0..n)
            .map(|r| (0..len).map(|i| (r * 1000 + i) as i64).collect())
            .collect()
    }

    fn sums(n: usize, len: usize) -> Vec<i64> {
        (0..len)
            .map(|i| (0..n).map(|r| (r * 1000 + i) as i64).sum())
            .collect()
    }

    #[test]
    fn blocks_tile_the_buffer() {
        for n in 1..9 {
            for len in [0, 1, 3, 7, 8, 100] {
                let blocks: Vec<_> = (0..n).map(|b| even_block(len, n, b)).collect();
                assert_eq!(blocks[0].start, 0);
                assert_eq!(blocks[n - 1].end, len);
                assert!(blocks.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn reduce_scatter_leaves_each_rank_its_own_block_summed() {
        for n in 2..8 {
            for len in [0, 1, 2, 5, 6, 37] {
                let mut b = buffers(n, len);
                run(&mut b, true, false);
                let expected = sums(n, len);
                for (r, buffer) in b.iter().enumerate() {
                    let own = even_block(len, n, r);
                    assert_eq!(
                        buffer[own.clone()],
                        expected[own],
                        "n={n} len={len} rank={r}"
                    );
                }
            }
        }
    }

    #[test]
    fn all_gather_gives_every_rank_every_block() {
        for n in 2..8 {
            let len = 23;
            // Rank r holds only its own block.
            let mut b: Vec<Vec<i64>> = (0..n)
                .map(|r| {
                    let mut v = vec![-1; len];
                    for i in even_block(len, n, r) {
                        v[i] = i as i64;
                    }
                    v
                })
                .collect();
            run(&mut b, false, true);
            for buffer in &b {
                assert_eq!(buffer, &(0..len as i64).collect::<Vec<_>>(), "n={n}");
            }
        }
    }

    #[test]
    fn all_reduce_ends_with_the_same_bits_everywhere() {
        for n in 2..8 {
            for len in [0, 1, 5, 37] {
                let mut b = buffers(n, len);
                run(&mut b, true, true);
                for buffer in &b {
                    assert_eq!(buffer, &sums(n, len), "n={n} len={len}");
                }
            }
        }
    }
}
