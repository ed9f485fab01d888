//! Validation's division of a loader of the whole data set between processes.
//!
//! Accelerate's prepared evaluation loader gives each process its batches and
//! `gather_for_metrics` drops the items that even batches repeated. Burn's metrics are
//! computed per batch, on the batch's items, so a process can only hand on whole batches'
//! entries: here each process takes whole batches of the one-process order, none repeated and
//! none left out, and the entries of all processes together are the entries one process
//! validating everything makes (see `train::valid_metrics`).

/// One process's part of a validation loader of the whole data set: contiguous whole batches
/// of the single-process order (`batch_size` items each, the last one maybe shorter), in
/// process order; the first `num_batches % num_processes` processes take one batch more
/// (Accelerate's `BatchSamplerShard` without `even_batches` gives each process as many
/// batches, taken round-robin instead). Every item is read by exactly one process; a process
/// may get none when there are fewer batches than processes.
///
/// The fit's validation ([`AccelerateStrategy::prepare_valid_loader`]) divides a loader so;
/// an evaluation written by hand that takes the same part on each process combines to the
/// same sums.
///
/// ```
/// use burn_accelerate::data::BatchSplit;
///
/// // 13 items in batches of 4 ([0..4) [4..8) [8..12) [12..13)) over 2 processes.
/// let second = BatchSplit::of(13, 4, 2, 1).unwrap();
/// assert_eq!((second.start, second.end, second.batches), (8, 13, 2));
/// ```
///
/// [`AccelerateStrategy::prepare_valid_loader`]: crate::train::AccelerateStrategy::prepare_valid_loader
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSplit {
    /// The first item of this process's part.
    pub start: usize,
    /// One past its last item.
    pub end: usize,
    /// The batches it holds.
    pub batches: usize,
}

impl BatchSplit {
    /// Process `process_index`'s part of `num_items` items in batches of `batch_size` over
    /// `num_processes` processes; `None` for a zero batch size or process count, or an index
    /// out of range.
    pub fn of(
        num_items: usize,
        batch_size: usize,
        num_processes: usize,
        process_index: usize,
    ) -> Option<Self> {
        if batch_size == 0 || process_index >= num_processes {
            return None;
        }
        let num_batches = num_items.div_ceil(batch_size);
        let each = num_batches / num_processes;
        let extra = num_batches % num_processes;
        let first = process_index * each + process_index.min(extra);
        let batches = each + usize::from(process_index < extra);
        Some(Self {
            start: (first * batch_size).min(num_items),
            end: ((first + batches) * batch_size).min(num_items),
            batches,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::BatchSplit;

    fn parts(items: usize, batch: usize, processes: usize) -> Vec<(usize, usize, usize)> {
        (0..processes)
            .map(|p| {
                let s = BatchSplit::of(items, batch, processes, p).unwrap();
                (s.start, s.end, s.batches)
            })
            .collect()
    }

    #[test]
    fn whole_batches_in_process_order_with_the_remainder_to_the_first_processes() {
        // 13 items in batches of 4: [0..4) [4..8) [8..12) [12..13).
        assert_eq!(parts(13, 4, 2), [(0, 8, 2), (8, 13, 2)]);
        assert_eq!(parts(13, 4, 3), [(0, 8, 2), (8, 12, 1), (12, 13, 1)]);
        assert_eq!(parts(12, 4, 2), [(0, 8, 2), (8, 12, 1)]);
        // Fewer items than processes: the others get nothing.
        assert_eq!(parts(2, 4, 3), [(0, 2, 1), (2, 2, 0), (2, 2, 0)]);
        assert_eq!(parts(0, 4, 2), [(0, 0, 0), (0, 0, 0)]);
        assert_eq!(BatchSplit::of(4, 0, 2, 0), None);
        assert_eq!(BatchSplit::of(4, 2, 2, 2), None);
        assert_eq!(BatchSplit::of(4, 2, 0, 0), None);
    }

    // Against accelerate 1.16's `BatchSamplerShard` without even batches: every process gets as
    // many batches as Accelerate gives it, and the processes' batches together are the
    // sequential sampler's batches, each item once (what `gather_for_metrics` returns).
    #[test]
    fn each_process_gets_as_many_batches_as_accelerate_gives_it_and_all_batches_once() {
        let golden: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/golden/batch_sampler_shards.json"))
                .unwrap();
        let mut checked = 0;
        for case in golden["cases"].as_array().unwrap() {
            let flag = |name: &str| case[name].as_bool().unwrap();
            if flag("split_batches") || flag("even_batches") || flag("drop_last") {
                continue;
            }
            let Some(per_process) = case["per_process"].as_array() else {
                continue;
            };
            let number = |name: &str| case[name].as_u64().unwrap() as usize;
            let (items, batch, processes) = (
                number("dataset_len"),
                number("batch_size"),
                number("num_processes"),
            );
            let mut theirs: Vec<Vec<u64>> = Vec::new();
            let mut ours: Vec<Vec<u64>> = Vec::new();
            for (p, batches) in per_process.iter().enumerate() {
                let batches: Vec<Vec<u64>> = serde_json::from_value(batches.clone()).unwrap();
                let part = BatchSplit::of(items, batch, processes, p).unwrap();
                assert_eq!(part.batches, batches.len(), "{}", case["id"]);
                let own: Vec<u64> = (part.start as u64..part.end as u64).collect();
                ours.extend(own.chunks(batch).map(<[u64]>::to_vec));
                theirs.extend(batches);
            }
            theirs.sort();
            assert_eq!(ours, theirs, "{}", case["id"]);
            let flat: Vec<u64> = ours.concat();
            assert_eq!(
                flat,
                (0..items as u64).collect::<Vec<_>>(),
                "{}",
                case["id"]
            );
            checked += 1;
        }
        assert!(checked > 300, "{checked} cases");
    }
}
