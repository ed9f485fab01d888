//! Strided views read out in order on every core: a view's values copied to contiguous memory,
//! and values filled through a mask read by its own (broadcast) strides. Each output row (a run
//! of the last dimension) is found once, then read as a run; the output is written in tasks on
//! rayon's threads. Strides count elements from the buffer's start; negative ones (flipped
//! views) are not taken.

use crate::half::filled;

/// The dimensions of a view of `shape` with `strides` without those of size 1, adjacent ones
/// merged where they lie contiguous: (sizes, strides), outermost first. `None` for a negative
/// stride.
pub fn collapsed(shape: &[usize], strides: &[isize]) -> Option<(Vec<usize>, Vec<usize>)> {
    let (mut sizes, mut merged): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
    for (&size, &stride) in shape.iter().zip(strides) {
        let stride = usize::try_from(stride).ok()?;
        if size == 1 {
            continue;
        }
        match (sizes.last_mut(), merged.last()) {
            (Some(outer), Some(&outer_stride)) if outer_stride == stride * size => {
                *outer *= size;
                *merged.last_mut().expect("pushed with its size") = stride;
            }
            _ => {
                sizes.push(size);
                merged.push(stride);
            }
        }
    }
    Some((sizes, merged))
}

/// Where row `row` (a run of the last dimension) of a view of `sizes` and `strides` starts,
/// from `start`.
fn row_start(start: usize, sizes: &[usize], strides: &[usize], mut row: usize) -> usize {
    let mut offset = start;
    for d in (0..sizes.len() - 1).rev() {
        offset += (row % sizes[d]) * strides[d];
        row /= sizes[d];
    }
    offset
}

/// The values of the view of `src` from `start` with `sizes` and `strides` (at least one
/// dimension), in order.
pub fn copy<T: bytemuck::Pod + Send + Sync>(
    src: &[T],
    start: usize,
    sizes: &[usize],
    strides: &[usize],
) -> Vec<T> {
    let rank = sizes.len();
    let (last, last_stride) = (sizes[rank - 1], strides[rank - 1]);
    let len: usize = sizes.iter().product();
    filled::<T>(len, |begin, block| {
        let (mut row, mut col) = (begin / last, begin % last);
        let mut done = 0;
        while done < block.len() {
            let run = (last - col).min(block.len() - done);
            let from = row_start(start, sizes, strides, row) + col * last_stride;
            let dst = &mut block[done..done + run];
            match last_stride {
                1 => dst.copy_from_slice(&src[from..from + run]),
                s => dst
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = src[from + i * s]),
            }
            done += run;
            (row, col) = (row + 1, 0);
        }
    })
}

/// The strides along each dimension of `shape` of a mask of `mask_shape` and `mask_strides`
/// broadcast to it (0 along a broadcast dimension), or `None` where it does not broadcast.
pub fn broadcast_strides(
    shape: &[usize],
    mask_shape: &[usize],
    mask_strides: &[isize],
) -> Option<Vec<usize>> {
    let rank = shape.len();
    let lead = rank.checked_sub(mask_shape.len())?;
    (0..rank)
        .map(|d| {
            let Some(m) = d.checked_sub(lead) else {
                return Some(0);
            };
            match (mask_shape[m], mask_strides[m]) {
                (n, s) if n == shape[d] && shape[d] > 1 => usize::try_from(s).ok(),
                (1, _) => Some(0),
                (n, _) if n == shape[d] => Some(0),
                _ => None,
            }
        })
        .collect()
}

/// `values` (contiguous, of `shape`, at least one dimension) with `value` where the mask is
/// set: the mask's bytes `mask` read from `mask_start` by `mask_strides` along each dimension
/// of `shape` (see [`broadcast_strides`]), nonzero for set.
///
/// Taken a run of the last dimension at a time, as [`copy`] takes its rows: an attention
/// mask's row lies contiguous (or is one byte broadcast along it), and choosing value by value
/// with an index computed and checked for each was most of a transformer's mask fills.
pub fn masked_fill<T: bytemuck::Pod + Send + Sync>(
    values: &[T],
    shape: &[usize],
    (mask, mask_start, mask_strides): (&[u8], usize, &[usize]),
    value: T,
) -> Vec<T> {
    let rank = shape.len();
    let last = shape[rank - 1];
    let last_stride = mask_strides[rank - 1];
    filled::<T>(values.len(), |begin, block| {
        let (mut row, mut col) = (begin / last, begin % last);
        let mut done = 0;
        while done < block.len() {
            let run = (last - col).min(block.len() - done);
            let from = row_start(mask_start, shape, mask_strides, row) + col * last_stride;
            let dst = &mut block[done..done + run];
            let src = &values[begin + done..][..run];
            match last_stride {
                0 if mask[from] != 0 => dst.fill(value),
                0 => dst.copy_from_slice(src),
                1 => select(dst, src, mask[from..from + run].iter(), value),
                s => select(dst, src, mask[from..].iter().step_by(s), value),
            }
            done += run;
            (row, col) = (row + 1, 0);
        }
    })
}

// `value` where `set` is nonzero, `src`'s own value elsewhere, into `dst` (all as long): a
// branch-free select, which the compiler vectorises where `set` is a contiguous run.
fn select<'a, T: bytemuck::Pod>(
    dst: &mut [T],
    src: &[T],
    set: impl Iterator<Item = &'a u8>,
    value: T,
) {
    for ((dst, &src), &set) in dst.iter_mut().zip(src).zip(set) {
        *dst = if set != 0 { value } else { src };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The fill value by value, each mask byte found from its own index: what `masked_fill`
    // must equal.
    fn fill_by_index(values: &[u16], shape: &[usize], mask: (&[u8], usize, &[usize])) -> Vec<u16> {
        let (bytes, start, strides) = mask;
        (0..values.len())
            .map(|i| {
                let (mut rest, mut at) = (i, start);
                for d in (0..shape.len()).rev() {
                    at += (rest % shape[d]) * strides[d];
                    rest /= shape[d];
                }
                if bytes[at] != 0 { 0xFFFF } else { values[i] }
            })
            .collect()
    }

    #[test]
    fn runs_fill_as_index_by_index_for_every_mask_layout() {
        // (shape, mask strides): a causal mask broadcast over batch and heads, a mask row
        // broadcast along the last dimension (stride 0), a transposed mask (stride > 1), a
        // mask from an offset, and rows shorter and longer than a block of `filled`.
        let cases: [(&[usize], &[usize], usize); 6] = [
            (&[2, 3, 5, 5], &[0, 0, 5, 1], 0),
            (&[2, 3, 5, 7], &[0, 7, 1, 0], 0),
            (&[4, 6], &[1, 4], 0),
            (&[3, 300], &[300, 1], 11),
            (&[2, 2, 700], &[0, 700, 1], 3),
            (&[1], &[0], 2),
        ];
        for (shape, strides, start) in cases {
            let len: usize = shape.iter().product();
            let values: Vec<u16> = (0..len as u16).collect();
            let extent = start
                + shape
                    .iter()
                    .zip(strides)
                    .map(|(n, s)| (n - 1) * s)
                    .sum::<usize>()
                + 1;
            let bytes: Vec<u8> = (0..extent).map(|i| ((i * 7 + 3) % 5 < 2) as u8).collect();
            let mask = (&bytes[..], start, strides);
            assert_eq!(
                masked_fill(&values, shape, mask, 0xFFFF),
                fill_by_index(&values, shape, mask),
                "shape {shape:?}, mask strides {strides:?} from {start}"
            );
        }
    }
}
