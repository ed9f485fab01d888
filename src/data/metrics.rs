//! Evaluation without double counting: dropping the padded duplicates of the last gathered
//! batch, as Accelerate's `gather_for_metrics` does.
//!
//! With `even_batches` (and under dispatch) the last step is padded with items from the start
//! of the data so every process has a batch. Gathering that step from all processes, in
//! process order, puts the real items first and the duplicates last, so dropping
//! [`ShardPlan::last_step_padding`](super::shard::ShardPlan::last_step_padding) items from the
//! end leaves every sample counted once. The number to drop is known to every process
//! without communication: [`ShardLoader::last_step_padding`](super::ShardLoader::last_step_padding),
//! or [`ShardIter::metrics_padding`](super::ShardIter::metrics_padding), which is 0 on every
//! batch but the last.

pub use crate::distributed::padding::{drop_padding, drop_padding_tensor};

/// Concatenates one step's per-process outputs, in process order, and drops `padding`
/// duplicates from the end (never more than there are).
///
/// ```
/// use burn_accelerate::data::gather_for_metrics;
///
/// // 5 samples, batch 2, 2 processes: the last step is [4, 0] + [1, 2]; only 4 is real.
/// let last_step = vec![vec![4, 0], vec![1, 2]];
/// assert_eq!(gather_for_metrics(last_step, 3), vec![4]);
/// ```
pub fn gather_for_metrics<T>(per_process: Vec<Vec<T>>, padding: usize) -> Vec<T> {
    drop_padding(per_process.into_iter().flatten().collect(), padding)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::shard::{ShardOptions, ShardPlan, ShardSpec, Sharding};

    #[test]
    fn gathered_last_steps_keep_each_sample_once() {
        for n in 1..30 {
            for (np, bs, split, sharding) in [
                (2, 2, false, Sharding::BatchSampler),
                (3, 4, false, Sharding::BatchSampler),
                (4, 8, true, Sharding::BatchSampler),
                (2, 2, false, Sharding::Dispatch),
                (4, 2, false, Sharding::Dispatch),
                (3, 6, true, Sharding::Dispatch),
            ] {
                let plans: Vec<ShardPlan> = (0..np)
                    .map(|p| {
                        let spec = ShardSpec::new(ShardOptions {
                            num_processes: np,
                            process_index: p,
                            batch_size: bs,
                            split_batches: split,
                            ..ShardOptions::default()
                        })
                        .unwrap();
                        ShardPlan::new(n, &spec, sharding).unwrap()
                    })
                    .collect();
                let mut seen: Vec<usize> = Vec::new();
                let steps = plans[0].num_batches();
                for step in 0..steps {
                    let per_process = plans.iter().map(|p| p.batch(step).unwrap()).collect();
                    let padding = if step + 1 == steps {
                        plans[0].last_step_padding()
                    } else {
                        0
                    };
                    seen.extend(gather_for_metrics(per_process, padding));
                }
                seen.sort_unstable();
                assert_eq!(
                    seen,
                    (0..n).collect::<Vec<_>>(),
                    "n={n} np={np} {sharding:?}"
                );
            }
        }
    }

    #[test]
    fn padding_larger_than_the_batch_empties_it() {
        assert_eq!(drop_padding(vec![1, 2], 5), Vec::<i32>::new());
    }
}
