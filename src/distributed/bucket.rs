//! How the gradient sync cuts a model into buckets, and what it counts: the pieces both of
//! its paths (the generic one in [`gradients`](super::gradients), Flex's in `flex_sync`)
//! stand on, kept below both so that neither reaches into the other.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::AutodiffBackend;

/// The most values one collective call carries (25 MiB of f32, DDP's default bucket); a
/// larger parameter travels alone.
pub const BUCKET_VALUES: usize = 25 * 1024 * 1024 / 4;

/// The backend the gradients live on.
pub(crate) type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// The values of a tensor of `dims`.
pub(crate) fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Consecutive runs of parameters of `sizes` values, of at most [`BUCKET_VALUES`] values each
/// (a larger parameter alone): the buckets, the same on every process and for either path.
pub(crate) fn bucket_ranges(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && size + n > BUCKET_VALUES {
            ranges.push(start..i);
            (start, size) = (i, 0);
        }
        size += n;
    }
    if start < sizes.len() {
        ranges.push(start..sizes.len());
    }
    ranges
}

static COPIED: AtomicU64 = AtomicU64::new(0);

/// How many values the gradient syncs of this process have copied on the host so far
/// (flattening a view, packing into and unpacking out of a bucket, downloading a buffer that
/// something else still holds, copying a gradient or parameter that is not its own; ZeRO's
/// reduce-scatter and sharing are counted on Flex's path only), besides the sockets' own
/// copies: read it before and after a step to count the step's.
pub fn sync_copied_values() -> u64 {
    COPIED.load(Ordering::Relaxed)
}

/// Counts `values` copied on the host by a sync.
pub(crate) fn count_copied(values: usize) {
    COPIED.fetch_add(values as u64, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_at_most_bucket_values_and_a_large_parameter_alone() {
        let small = BUCKET_VALUES / 4;
        let sizes = [small, small, small, BUCKET_VALUES * 2, small, small];
        assert_eq!(bucket_ranges(&sizes), vec![0..3, 3..4, 4..6]);
        assert_eq!(bucket_ranges(&[]), Vec::<std::ops::Range<usize>>::new());
    }
}
