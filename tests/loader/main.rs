//! The sharded loader through its public API: agreement with the index plan, dispatch,
//! seeded order, prefetch, resume, the observer hook, Burn's `DataLoader` contract, errors.
#![cfg(any(feature = "flex", feature = "ndarray"))]

mod common;
mod golden;
mod props;
mod stream;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoader;
use burn::data::dataset::Dataset;
use burn_accelerate::data::shard::{
    ShardError, ShardOptions, ShardPlan, ShardSpec, epoch_seed, seeded_permutation,
};
use burn_accelerate::data::{
    DataLoaderConfig, DataLoaderError, LoaderObserver, LoaderState, ShardLoaderBuilder,
    gather_for_metrics,
};

use common::{B, Ids, Loader, builder, epoch, shards};

fn plan_of(config: &DataLoaderConfig, n: usize, np: usize, p: usize) -> ShardPlan {
    let spec = ShardSpec::new(ShardOptions {
        num_processes: np,
        process_index: p,
        batch_size: config.batch_size,
        split_batches: config.split_batches,
        even_batches: config.even_batches,
        drop_last: config.drop_last,
    })
    .unwrap();
    ShardPlan::new(n, &spec, config.sharding()).unwrap()
}

#[test]
fn loader_yields_the_plans_batches_in_the_epochs_order() {
    for n in [0, 1, 5, 13, 29] {
        for np in 1..=4 {
            for bs in 1..=3 {
                for (split, even, drop_last, dispatch, shuffle) in [
                    (false, true, false, false, false),
                    (false, false, false, false, true),
                    (false, true, true, false, false),
                    (false, true, false, true, false),
                    (false, true, false, true, true),
                    (true, true, false, false, false),
                    (true, true, false, true, true),
                ] {
                    let config = DataLoaderConfig::new(bs * if split { np } else { 1 })
                        .with_split_batches(split)
                        .with_even_batches(even)
                        .with_drop_last(drop_last)
                        .with_dispatch_batches(dispatch)
                        .with_shuffle(shuffle)
                        .with_use_seedable_sampler(true)
                        .with_data_seed(Some(11));
                    let loaders = shards(config.clone(), n, np);
                    let order = seeded_permutation(n, epoch_seed(11, 0));
                    for (p, loader) in loaders.iter().enumerate() {
                        let want: Vec<Vec<usize>> = plan_of(&config, n, np, p)
                            .iter()
                            .map(|b| {
                                b.into_iter()
                                    .map(|pos| if shuffle { order[pos] } else { pos })
                                    .collect()
                            })
                            .collect();
                        assert_eq!(epoch(loader), want, "n={n} np={np} p={p} {config}");
                        assert_eq!(loader.num_batches(), want.len());
                        assert_eq!(loader.num_items(), want.iter().map(Vec::len).sum::<usize>());
                    }
                }
            }
        }
    }
}

/// Counts every read, to see who touches the storage.
struct Counting {
    len: usize,
    reads: Arc<AtomicUsize>,
}

impl Dataset<usize> for Counting {
    fn get(&self, index: usize) -> Option<usize> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        (index < self.len).then_some(index)
    }
    fn len(&self) -> usize {
        self.len
    }
}

#[test]
fn dispatch_reads_each_global_batch_once_and_hands_out_the_plans_slices() {
    let (n, np) = (20, 3);
    let config = DataLoaderConfig::new(3)
        .with_dispatch_batches(true)
        .with_num_workers(2);
    for lockstep in [true, false] {
        let reads = Arc::new(AtomicUsize::new(0));
        let dataset = Counting {
            len: n,
            reads: reads.clone(),
        };
        let loaders = ShardLoaderBuilder::new(config.clone(), dataset, Ids)
            .build(&vec![Default::default(); np])
            .unwrap();
        let got: Vec<Vec<Vec<usize>>> = if lockstep {
            let mut iters: Vec<_> = loaders.iter().map(|l| l.iter()).collect();
            let mut out = vec![Vec::new(); np];
            while let Some(batch) = iters[0].next() {
                out[0].push(batch);
                for p in 1..np {
                    out[p].push(iters[p].next().unwrap());
                }
            }
            out
        } else {
            loaders.iter().map(epoch).collect()
        };
        for (p, batches) in got.iter().enumerate() {
            let plan = plan_of(&config, n, np, p);
            assert_eq!(batches, &plan.iter().collect::<Vec<_>>());
        }
        // Each step's distinct positions once: 20 items, and item 0 again for the padded tail.
        assert_eq!(reads.load(Ordering::Relaxed), n + 1, "lockstep={lockstep}");
    }
    // Without dispatch every shard reads its own padding.
    let reads = Arc::new(AtomicUsize::new(0));
    let dataset = Counting {
        len: n,
        reads: reads.clone(),
    };
    let loaders = ShardLoaderBuilder::new(DataLoaderConfig::new(3), dataset, Ids)
        .build(&vec![Default::default(); np])
        .unwrap();
    let items: usize = loaders.iter().map(|l| epoch(l).concat().len()).sum();
    assert_eq!(reads.load(Ordering::Relaxed), items);
    assert_eq!(items, 27);
}

#[test]
fn seeded_order_is_shared_reproducible_and_new_each_epoch() {
    let config = DataLoaderConfig::new(4)
        .with_shuffle(true)
        .with_use_seedable_sampler(true)
        .with_data_seed(Some(7));
    let a = shards(config.clone(), 64, 2);
    let b = shards(config.clone(), 64, 2);
    let epochs_a: Vec<Vec<Vec<Vec<usize>>>> =
        (0..3).map(|_| a.iter().map(epoch).collect()).collect();
    for (e, shards_a) in epochs_a.iter().enumerate() {
        // Both processes cut the same permutation: together they cover every item once.
        let mut all = shards_a.concat().concat();
        all.sort_unstable();
        assert_eq!(all, (0..64).collect::<Vec<_>>(), "epoch {e}");
        let rebuilt: Vec<_> = b.iter().map(epoch).collect();
        assert_eq!(&rebuilt, shards_a, "a rebuild reproduces epoch {e}");
    }
    assert_ne!(epochs_a[0], epochs_a[1]);
    assert_ne!(epochs_a[1], epochs_a[2]);
    // set_epoch jumps straight to an epoch's order.
    let c = shards(config.clone(), 64, 2);
    for loader in &c {
        loader.set_epoch(2);
    }
    assert_eq!(c.iter().map(epoch).collect::<Vec<_>>(), epochs_a[2]);
    assert_eq!(c[0].epoch(), 3);
    // The order is data_seed + epoch: epoch 1 with seed 7 is epoch 0 with seed 8.
    let d = shards(config.with_data_seed(Some(8)), 64, 2);
    assert_eq!(d.iter().map(epoch).collect::<Vec<_>>(), epochs_a[1]);
}

#[test]
fn non_seedable_order_advances_per_epoch_and_is_reproducible_from_data_seed() {
    let config = DataLoaderConfig::new(4)
        .with_shuffle(true)
        .with_data_seed(Some(7));
    let a = shards(config.clone(), 40, 2);
    let b = shards(config, 40, 2);
    let first: Vec<_> = a.iter().map(epoch).collect();
    let second: Vec<_> = a.iter().map(epoch).collect();
    assert_ne!(first, second);
    assert_eq!(b.iter().map(epoch).collect::<Vec<_>>(), first);
    assert_eq!(b.iter().map(epoch).collect::<Vec<_>>(), second);
    let mut all = first.concat().concat();
    all.sort_unstable();
    assert_eq!(all, (0..40).collect::<Vec<_>>());
}

#[test]
fn every_threading_mode_yields_the_same_epochs() {
    let base = DataLoaderConfig::new(3)
        .with_shuffle(true)
        .with_data_seed(Some(3));
    let reference: Vec<Vec<Vec<usize>>> = {
        let loaders = shards(base.clone(), 50, 2);
        (0..2)
            .flat_map(|_| loaders.iter().map(epoch).collect::<Vec<_>>())
            .collect()
    };
    for (workers, non_blocking, prefetch) in
        [(0, true, 1), (1, false, 1), (2, true, 2), (3, false, 4)]
    {
        for dispatch in [false, true] {
            let config = base
                .clone()
                .with_num_workers(workers)
                .with_non_blocking(non_blocking)
                .with_prefetch(prefetch)
                .with_dispatch_batches(dispatch);
            let loaders = shards(config.clone(), 50, 2);
            let got: Vec<_> = (0..2)
                .flat_map(|_| loaders.iter().map(epoch).collect::<Vec<_>>())
                .collect();
            if dispatch {
                // 50 = 8 steps of 6 + 2: the tails differ, the rest agrees.
                for (g, r) in got.iter().zip(&reference) {
                    assert_eq!(g[..8], r[..8], "{config}");
                }
            } else {
                assert_eq!(got, reference, "{config}");
            }
        }
    }
}

#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl LoaderObserver for Log {
    fn begin(&self) {
        self.0.lock().unwrap().push("begin".into());
    }
    fn end_of_dataloader(&self, remainder: Option<usize>) {
        self.0.lock().unwrap().push(format!("eod {remainder:?}"));
    }
    fn end(&self) {
        self.0.lock().unwrap().push("end".into());
    }
}

#[test]
fn observer_sees_begin_end_of_dataloader_before_the_last_batch_and_end() {
    let log = Arc::new(Log::default());
    // 9 items, batch 5, 2 processes: one step of 10 slots, remainder 9 (accelerate's example).
    let loaders = builder(DataLoaderConfig::new(2).with_non_blocking(true), 9)
        .observer(log.clone())
        .build(&[Default::default(), Default::default()])
        .unwrap();
    let mut it = loaders[0].shard_iter();
    assert_eq!(log.take(), ["begin"]);
    assert_eq!(it.next(), Some(vec![0, 1]));
    assert!(!it.is_last_batch());
    assert_eq!(it.next(), Some(vec![4, 5]));
    assert!(log.take().is_empty());
    assert_eq!(it.next(), Some(vec![8, 0]));
    assert!(it.is_last_batch());
    assert_eq!(it.remainder(), Some(1));
    assert_eq!(
        log.take(),
        ["eod Some(1)"],
        "reported before the batch is used"
    );
    assert_eq!(it.next(), None);
    assert_eq!(log.take(), ["end"]);
    drop(it);
    assert!(log.take().is_empty(), "end is reported once");
    // Dropped early: end all the same.
    let mut it = loaders[1].shard_iter();
    it.next();
    drop(it);
    assert_eq!(log.take(), ["begin", "end"]);
    // drop_last: nothing padded, accelerate's -1.
    let log = Arc::new(Log::default());
    let loader = builder(DataLoaderConfig::new(2).with_drop_last(true), 5)
        .observer(log.clone())
        .build(&[Default::default()])
        .unwrap()
        .remove(0);
    assert_eq!(epoch(&loader).len(), 2);
    assert_eq!(log.take(), ["begin", "eod None", "end"]);
    // Empty epoch: begin and end only.
    let empty = builder(DataLoaderConfig::new(2), 0)
        .build(&[Default::default()])
        .unwrap()
        .remove(0)
        .with_observer(log.clone());
    assert!(epoch(&empty).is_empty());
    assert_eq!(log.take(), ["begin", "end"]);
}

#[test]
fn skip_first_batches_yields_the_rest_of_the_uninterrupted_epoch() {
    for config in [
        DataLoaderConfig::new(3),
        DataLoaderConfig::new(3)
            .with_shuffle(true)
            .with_data_seed(Some(5))
            .with_num_workers(2),
        DataLoaderConfig::new(4)
            .with_dispatch_batches(true)
            .with_non_blocking(true),
    ] {
        let full: Vec<_> = shards(config.clone(), 31, 2).iter().map(epoch).collect();
        for skip in 0..=7 {
            let loaders = shards(config.clone(), 31, 2);
            for loader in &loaders {
                loader.skip_first_batches(skip);
            }
            let rest: Vec<_> = loaders.iter().map(epoch).collect();
            for (p, batches) in rest.iter().enumerate() {
                assert_eq!(
                    batches[..],
                    full[p][skip.min(full[p].len())..],
                    "{config} {skip}"
                );
            }
            // The skip applies once; the next epoch is whole, and is epoch 1.
            assert_eq!(loaders[0].epoch(), 1);
            assert_eq!(epoch(&loaders[0]).len(), loaders[0].num_batches());
        }
    }
}

#[test]
fn a_restored_state_resumes_exactly_where_the_run_stopped() {
    for seedable in [true, false] {
        let config = DataLoaderConfig::new(4)
            .with_shuffle(true)
            .with_use_seedable_sampler(seedable)
            .with_data_seed(Some(99))
            .with_num_workers(1);
        // Uninterrupted: three epochs.
        let run = shards(config.clone(), 30, 1).remove(0);
        let uninterrupted: Vec<Vec<usize>> = (0..3).flat_map(|_| epoch(&run)).collect();
        // Interrupted in epoch 1 after 3 batches; the state goes through JSON.
        let first = shards(config.clone(), 30, 1).remove(0);
        let mut seen = epoch(&first);
        let mut it = first.iter();
        seen.extend(it.by_ref().take(3));
        drop(it);
        let saved = serde_json::to_string(&first.state()).unwrap();
        let state: LoaderState = serde_json::from_str(&saved).unwrap();
        assert_eq!((state.epoch, state.position), (1, 3));
        // A new process: fresh builder, restored state; the usual set_epoch keeps it.
        let resumed = shards(config, 30, 1).remove(0);
        resumed.load_state(state).unwrap();
        resumed.set_epoch(1);
        seen.extend(epoch(&resumed));
        seen.extend(epoch(&resumed));
        assert_eq!(seen, uninterrupted, "seedable={seedable}");
    }
}

#[test]
fn position_tracks_what_was_handed_out_not_what_was_prefetched() {
    let config = DataLoaderConfig::new(1)
        .with_num_workers(2)
        .with_non_blocking(true)
        .with_prefetch(4);
    let loader = shards(config, 100, 1).remove(0);
    let mut it = loader.iter();
    it.next();
    it.next();
    assert_eq!(loader.state().position, 2);
    assert_eq!(it.progress().items_processed, 2);
    assert_eq!(it.progress().items_total, 100);
    drop(it);
    // Broken off: the epoch is not complete, and a new iterator starts it again.
    assert_eq!(loader.epoch(), 0);
    assert_eq!(loader.iter().next(), Some(vec![0]));
}

#[test]
fn the_last_step_of_every_shard_gathers_to_each_sample_once() {
    for (dispatch, n) in [(false, 9), (false, 23), (true, 23), (true, 2)] {
        let config = DataLoaderConfig::new(2)
            .with_dispatch_batches(dispatch)
            .with_shuffle(true)
            .with_data_seed(Some(1));
        let loaders = shards(config, n, 4);
        let mut iters: Vec<_> = loaders.iter().map(|l| l.shard_iter()).collect();
        let mut seen = Vec::new();
        loop {
            let step: Vec<Option<Vec<usize>>> = iters.iter_mut().map(Iterator::next).collect();
            if step.iter().all(Option::is_none) {
                break;
            }
            let padding = iters[0].metrics_padding();
            assert_eq!(
                padding == 0,
                !iters[0].is_last_batch() || loaders[0].last_step_padding() == 0
            );
            seen.extend(gather_for_metrics(
                step.into_iter().flatten().collect(),
                padding,
            ));
        }
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..n).collect::<Vec<_>>(),
            "dispatch={dispatch} n={n}"
        );
    }
}

#[test]
fn to_device_copies_share_the_position_and_slices_rebatch_the_stream() {
    let loader = shards(DataLoaderConfig::new(3), 20, 2).remove(1);
    // Process 1 of 2, batch 3: [3,4,5] [9,10,11] [15,16,17] [1,2,3] (padded).
    let whole = epoch(&loader);
    let moved = loader.to_device(&Default::default());
    let mut it = moved.iter();
    it.next();
    assert_eq!(
        loader.state().position,
        1,
        "the kept handle sees the copy's progress"
    );
    drop(it);
    let stream = whole.concat();
    assert_eq!(loader.num_items(), stream.len());
    let slice = loader.slice(2, 9);
    assert_eq!(slice.num_items(), 7);
    let got: Vec<Vec<usize>> = slice.iter().collect();
    assert_eq!(
        got,
        stream[2..9]
            .chunks(3)
            .map(<[usize]>::to_vec)
            .collect::<Vec<_>>()
    );
    // Slices of slices stay inside their parent, out-of-range ends are clamped.
    let inner = slice.slice(5, 100);
    assert_eq!(
        inner.iter().collect::<Vec<_>>(),
        vec![stream[7..9].to_vec()]
    );
    assert_eq!(slice.slice(50, 60).num_items(), 0);
}

#[test]
fn invalid_configurations_are_typed_errors_at_build_time() {
    let build = |config: DataLoaderConfig, np: usize| {
        builder(config, 10)
            .build(&vec![Default::default(); np])
            .map(|_| ())
    };
    assert_eq!(
        build(DataLoaderConfig::new(0), 1),
        Err(DataLoaderError::Shard(ShardError::ZeroBatchSize))
    );
    assert_eq!(
        build(DataLoaderConfig::new(2), 0),
        Err(DataLoaderError::Shard(ShardError::ZeroProcesses))
    );
    assert!(matches!(
        build(DataLoaderConfig::new(3).with_split_batches(true), 2),
        Err(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. }))
    ));
    assert!(matches!(
        build(
            DataLoaderConfig::new(2)
                .with_num_workers(2)
                .with_prefetch(0),
            1
        ),
        Err(DataLoaderError::ZeroPrefetch { .. })
    ));
    let b = builder(DataLoaderConfig::new(2), 10);
    assert!(matches!(
        b.build_process(2, 2, Default::default()),
        Err(DataLoaderError::Shard(
            ShardError::ProcessIndexOutOfRange { .. }
        ))
    ));
    let shuffled = builder(DataLoaderConfig::new(2).with_shuffle(true), 10);
    assert_eq!(
        shuffled.build_process(2, 0, Default::default()).map(|_| ()),
        Err(DataLoaderError::MissingDataSeed { num_processes: 2 })
    );
    assert!(shuffled.build_process(1, 0, Default::default()).is_ok());
    let loader: Loader = b.build_process(2, 1, Default::default()).unwrap();
    let mut state = loader.state();
    state.position = loader.num_batches() + 1;
    assert!(matches!(
        loader.load_state(state),
        Err(DataLoaderError::ResumePastEnd { .. })
    ));
    let msg = DataLoaderError::MissingDataSeed { num_processes: 2 }.to_string();
    assert!(msg.contains("set the same data_seed"), "{msg}");
}

#[test]
fn one_process_built_alone_matches_its_shard_of_a_full_build() {
    for dispatch in [false, true] {
        let config = DataLoaderConfig::new(3)
            .with_dispatch_batches(dispatch)
            .with_shuffle(true)
            .with_data_seed(Some(4));
        let all = shards(config.clone(), 25, 3);
        for (p, shard) in all.iter().enumerate() {
            let alone = builder(config.clone(), 25)
                .build_process(3, p, Default::default())
                .unwrap();
            assert_eq!(epoch(&alone), epoch(shard));
        }
    }
}

#[test]
fn loaders_are_burn_data_loaders() {
    fn takes(_: Arc<dyn DataLoader<B, Vec<usize>>>) {}
    takes(Arc::new(shards(DataLoaderConfig::new(2), 4, 1).remove(0)));
}

#[test]
fn a_gradient_state_observer_forces_the_sync_on_each_epochs_last_batch() {
    use burn_accelerate::GradientState;
    use burn_accelerate::data::GradientStateObserver;

    // 7 batches of 1 with accumulation over 3: windows [0,1,2] [3,4,5] [6], the last one
    // closed by the end of the data loader, as accelerate's sync_with_dataloader does.
    let state = GradientState::new();
    state.configure(3, true).unwrap();
    let loader = builder(DataLoaderConfig::new(1), 7)
        .observer(Arc::new(GradientStateObserver::new(state.clone())))
        .build(&[Default::default()])
        .unwrap()
        .remove(0);
    for _epoch in 0..2 {
        let mut syncs = Vec::new();
        for _batch in loader.iter() {
            assert!(state.in_dataloader());
            syncs.push(state.accumulate().sync_gradients());
        }
        assert_eq!(syncs, [false, false, true, false, false, true, true]);
        assert!(
            !state.in_dataloader(),
            "the epoch's end unregisters the loader"
        );
    }
}
