//! Properties of the loader over random configurations: up to 10,000 items, 1 to 16
//! shards, every flag. Case counts are bounded so the whole file runs in seconds.

use burn::data::dataloader::DataLoader;
use burn_accelerate::data::{DataLoaderConfig, gather_for_metrics};
use proptest::prelude::*;

use crate::common::{Loader, epoch, shards};

#[derive(Debug, Clone)]
struct Case {
    n: usize,
    np: usize,
    /// Per-process batch size.
    part: usize,
    split: bool,
    even: bool,
    drop_last: bool,
    dispatch: bool,
    shuffle: bool,
    seedable: bool,
    seed: u64,
    workers: usize,
    non_blocking: bool,
}

impl Case {
    fn config(&self) -> DataLoaderConfig {
        DataLoaderConfig::new(if self.split {
            self.part * self.np
        } else {
            self.part
        })
        .with_split_batches(self.split)
        .with_even_batches(self.even)
        .with_drop_last(self.drop_last)
        .with_dispatch_batches(self.dispatch)
        .with_shuffle(self.shuffle)
        .with_use_seedable_sampler(self.seedable)
        .with_data_seed(Some(self.seed))
        .with_num_workers(self.workers)
        .with_non_blocking(self.non_blocking)
        .with_prefetch(2)
    }

    fn total(&self) -> usize {
        self.part * self.np
    }

    fn loaders(&self) -> Vec<Loader> {
        shards(self.config(), self.n, self.np)
    }
}

fn cases() -> impl Strategy<Value = Case> {
    (
        // Small datasets hit the degenerate tails; large ones the 10,000-item bound.
        prop_oneof![0..=40usize, 0..=10_000usize],
        1..=16usize,
        prop_oneof![1..=4usize, 1..=64usize],
        any::<[bool; 7]>(),
        any::<u64>(),
        0..=2usize,
    )
        .prop_map(|(n, np, part, flags, seed, workers)| {
            let [
                split,
                even,
                drop_last,
                dispatch,
                shuffle,
                seedable,
                non_blocking,
            ] = flags;
            Case {
                n,
                np,
                part,
                split,
                even,
                drop_last,
                dispatch,
                shuffle,
                seedable,
                seed,
                workers,
                non_blocking,
            }
        })
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Every shard's epoch, step by step: `steps[s][p]` is process p's batch s (if it has one).
fn steps(loaders: &[Loader]) -> Vec<Vec<Vec<usize>>> {
    let epochs: Vec<_> = loaders.iter().map(epoch).collect();
    let count = epochs.iter().map(Vec::len).max().unwrap_or(0);
    (0..count)
        .map(|s| epochs.iter().filter_map(|e| e.get(s).cloned()).collect())
        .collect()
}

proptest! {
    #![proptest_config(config())]

    /// Without drop_last every item is covered exactly once once the padding is dropped (so
    /// the padding is the only duplication, and shards are disjoint before it); with it, no
    /// item repeats and only the incomplete tail is missing.
    #[test]
    fn items_are_covered_once_apart_from_the_padding(case in cases()) {
        let loaders = case.loaders();
        let steps = steps(&loaders);
        let padding = loaders[0].last_step_padding();
        let mut real = Vec::new();
        for (s, step) in steps.iter().enumerate() {
            let last = s + 1 == steps.len();
            if !last {
                // Before the tail, shards are disjoint and nothing repeats.
                let mut items = step.concat();
                let len = items.len();
                items.sort_unstable();
                items.dedup();
                prop_assert_eq!(items.len(), len, "step {} repeats an item", s);
            }
            real.extend(gather_for_metrics(step.clone(), if last { padding } else { 0 }));
        }
        let yielded: usize = steps.iter().map(|s| s.concat().len()).sum();
        prop_assert_eq!(yielded, loaders.iter().map(DataLoader::num_items).sum::<usize>());
        let kept = real.len();
        real.sort_unstable();
        real.dedup();
        prop_assert_eq!(real.len(), kept, "a real item repeats");
        if case.drop_last {
            prop_assert_eq!(kept, case.n / case.total() * case.total());
        } else {
            prop_assert_eq!(real, (0..case.n).collect::<Vec<_>>());
        }
    }

    /// even_batches (and dispatch, and drop_last) give every process the same number of
    /// batches; the batch sampler's even batches are also all full.
    #[test]
    fn even_batches_give_equal_batch_counts(case in cases()) {
        let loaders = case.loaders();
        let epochs: Vec<_> = loaders.iter().map(epoch).collect();
        for (loader, e) in loaders.iter().zip(&epochs) {
            prop_assert_eq!(loader.num_batches(), e.len());
        }
        if case.even || case.dispatch || case.drop_last {
            let counts: Vec<usize> = epochs.iter().map(Vec::len).collect();
            prop_assert!(counts.windows(2).all(|w| w[0] == w[1]), "{:?}", counts);
        }
        if (case.even || case.drop_last) && !case.dispatch && case.n > 0 {
            prop_assert!(epochs.iter().flatten().all(|b| b.len() == case.part));
        }
    }

    /// The seeded order depends only on the seed and the epoch: a second build reproduces
    /// every epoch, set_epoch jumps to one, and epochs differ.
    #[test]
    fn seeded_order_is_deterministic(case in cases()) {
        let case = Case { shuffle: true, workers: 0, ..case };
        let a = case.loaders();
        let b = case.loaders();
        let a0: Vec<_> = a.iter().map(epoch).collect();
        let a1: Vec<_> = a.iter().map(epoch).collect();
        prop_assert_eq!(&b.iter().map(epoch).collect::<Vec<_>>(), &a0);
        if case.seedable {
            let c = case.loaders();
            for loader in &c {
                loader.set_epoch(1);
            }
            prop_assert_eq!(&c.iter().map(epoch).collect::<Vec<_>>(), &a1);
        } else {
            prop_assert_eq!(&b.iter().map(epoch).collect::<Vec<_>>(), &a1);
        }
        // Two permutations of 20 or more distinct items agreeing everywhere would be a broken
        // shuffle. (Counting yielded items instead would also count padding: one item
        // repeated on 16 processes is the same in every order.)
        if case.n >= 20 && a0.concat().concat().len() >= 20 {
            prop_assert_ne!(a0, a1);
        }
    }

    /// Restoring a state saved after k batches of epoch 1, or skipping k batches, yields
    /// exactly the rest of the uninterrupted epoch.
    #[test]
    fn resume_is_equivalent_to_an_uninterrupted_epoch(case in cases(), k in 0..40usize, pick in 0..16usize) {
        let p = pick % case.np;
        let run = case.loaders().swap_remove(p);
        let _ = epoch(&run);
        let uninterrupted = epoch(&run);
        let next_epoch = epoch(&run);

        let first = case.loaders().swap_remove(p);
        let _ = epoch(&first);
        let mut it = DataLoader::iter(&first);
        let head: Vec<_> = it.by_ref().take(k).collect();
        drop(it);
        let k = head.len();
        prop_assert_eq!(&head[..], &uninterrupted[..k]);
        let resumed = case.loaders().swap_remove(p);
        resumed.load_state(first.state()).unwrap();
        let rest = epoch(&resumed);
        if k < uninterrupted.len() {
            prop_assert_eq!(&rest[..], &uninterrupted[k..]);
        } else {
            // Handing out the last batch completes the epoch: the state is the next one's.
            prop_assert_eq!(&rest, &next_epoch);
        }

        let skipping = case.loaders().swap_remove(p);
        skipping.set_epoch(1);
        skipping.skip_first_batches(k);
        if case.seedable || !case.shuffle {
            prop_assert_eq!(&epoch(&skipping)[..], &uninterrupted[k..]);
        }
    }

    /// Dispatch and non-dispatch hand out the same batches wherever accelerate's do: always
    /// with drop_last, and whenever the data fills whole steps.
    #[test]
    fn dispatch_agrees_with_the_batch_sampler_where_accelerate_does(case in cases()) {
        if case.drop_last || case.n % case.total() == 0 {
            let dispatched: Vec<_> = Case { dispatch: true, ..case.clone() }
                .loaders().iter().map(epoch).collect();
            let sampled: Vec<_> = Case { dispatch: false, ..case }
                .loaders().iter().map(epoch).collect();
            prop_assert_eq!(dispatched, sampled);
        }
    }
}
