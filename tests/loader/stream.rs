//! The stream loader: the same batches as the indexed loader wherever accelerate's
//! `IterableDatasetShard` / `DataLoaderDispatcher` agree with its map-style sharding, one
//! reading of the stream under dispatch, the end known on the last batch, resume, errors.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::DataLoader;
use burn_accelerate::data::shard::ShardError;
use burn_accelerate::data::{DataLoaderConfig, DataLoaderError, StreamLoader, StreamLoaderBuilder};
use proptest::prelude::*;

use crate::Log;
use crate::common::{B, Ids, epoch, shards};

type Stream = StreamLoader<B, usize, Vec<usize>>;

fn stream_builder(config: DataLoaderConfig, n: usize) -> StreamLoaderBuilder<B, usize, Vec<usize>> {
    StreamLoaderBuilder::new(config, move |_epoch: u64| 0..n, Ids)
}

fn stream_shards(config: DataLoaderConfig, n: usize, np: usize) -> Vec<Stream> {
    stream_builder(config, n)
        .build(&vec![Default::default(); np])
        .expect("valid configuration")
}

fn stream_epoch(loader: &Stream) -> Vec<Vec<usize>> {
    loader.iter().collect()
}

/// Counts how often the stream is opened and how many items are pulled from it.
#[derive(Default)]
struct Reads {
    opened: AtomicUsize,
    pulled: AtomicUsize,
}

fn counted(config: DataLoaderConfig, n: usize, np: usize) -> (Arc<Reads>, Vec<Stream>) {
    let reads = Arc::new(Reads::default());
    let seen = Arc::clone(&reads);
    let factory = move |_epoch: u64| {
        seen.opened.fetch_add(1, Ordering::SeqCst);
        let pulled = Arc::clone(&seen);
        (0..n).inspect(move |_| {
            pulled.pulled.fetch_add(1, Ordering::SeqCst);
        })
    };
    let loaders = StreamLoaderBuilder::new(config, factory, Ids)
        .build(&vec![Default::default(); np])
        .unwrap();
    (reads, loaders)
}

#[derive(Debug, Clone)]
struct Case {
    n: usize,
    np: usize,
    part: usize,
    split: bool,
    even: bool,
    drop_last: bool,
    dispatch: bool,
    workers: usize,
    non_blocking: bool,
}

impl Case {
    fn config(&self) -> DataLoaderConfig {
        DataLoaderConfig::new(self.part * if self.split { self.np } else { 1 })
            .with_split_batches(self.split)
            .with_even_batches(self.even)
            .with_drop_last(self.drop_last)
            .with_dispatch_batches(self.dispatch)
            .with_num_workers(self.workers)
            .with_non_blocking(self.non_blocking)
    }
}

fn cases() -> impl Strategy<Value = Case> {
    (
        0..=60usize,
        1..=6usize,
        1..=5usize,
        any::<[bool; 5]>(),
        0..=2usize,
    )
        .prop_map(
            |(n, np, part, [split, even, drop_last, dispatch, non_blocking], workers)| Case {
                n,
                np,
                part,
                split,
                even,
                drop_last,
                dispatch,
                workers,
                non_blocking,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Accelerate shards a stream and a map-style dataset alike under dispatch, and without
    /// it whenever the batch sampler pads (`even_batches`) or nothing is padded
    /// (`drop_last`); `IterableDatasetShard` has no `even_batches = false`. There the stream
    /// loader yields the indexed loader's batches, reports the same end, and then knows the
    /// indexed loader's `num_items`.
    #[test]
    fn a_stream_yields_the_indexed_loaders_batches(case in cases()) {
        let config = case.config();
        let streams = stream_shards(config.clone(), case.n, case.np);
        // Where accelerate's map-style sharding differs (no padding with even_batches off),
        // the stream keeps IterableDatasetShard's padding: compare with even_batches on.
        let indexed = shards(config.clone().with_even_batches(true), case.n, case.np);
        for (stream, indexed) in streams.iter().zip(&indexed) {
            let mut it = stream.stream_iter();
            let mut got = Vec::new();
            let mut last_seen = false;
            while let Some(batch) = it.next() {
                prop_assert!(!last_seen, "a batch after the last one");
                last_seen = it.is_last_batch();
                if last_seen {
                    prop_assert_eq!(it.remainder(), indexed.remainder());
                    prop_assert_eq!(it.metrics_padding(), indexed.last_step_padding());
                }
                got.push(batch);
            }
            prop_assert_eq!(last_seen, !got.is_empty());
            prop_assert_eq!(&got, &epoch(indexed), "{}", config);
            prop_assert_eq!(stream.num_items(), indexed.num_items());
            prop_assert_eq!(stream.epoch(), 1);
        }
    }

    /// Resuming at any batch yields the rest of the uninterrupted epoch, whether by
    /// `skip_first_batches` or by restoring a saved state into a fresh loader.
    #[test]
    fn resuming_yields_the_rest_of_the_epoch(case in cases(), stop in 0..12usize) {
        let config = case.config();
        let full: Vec<_> = stream_shards(config.clone(), case.n, case.np).iter().map(stream_epoch).collect();
        let skipped = stream_shards(config.clone(), case.n, case.np);
        let interrupted = stream_shards(config.clone(), case.n, case.np);
        let states: Vec<_> = interrupted
            .iter()
            .map(|loader| {
                let mut it = loader.iter();
                for _ in 0..stop {
                    it.next();
                }
                drop(it);
                loader.state()
            })
            .collect();
        let restored = stream_shards(config.clone(), case.n, case.np);
        for p in 0..case.np {
            let want = &full[p][stop.min(full[p].len())..];
            skipped[p].skip_first_batches(stop);
            prop_assert_eq!(&stream_epoch(&skipped[p])[..], want);
            restored[p].load_state(states[p]).unwrap();
            // A run stopped after the last batch saved the start of the next epoch.
            let resumed = if stop >= full[p].len() { &full[p][..] } else { want };
            prop_assert_eq!(&stream_epoch(&restored[p])[..], resumed, "{}", config);
            // The next epoch is whole again.
            prop_assert_eq!(&stream_epoch(&restored[p]), &full[p]);
        }
    }
}

#[test]
fn golden_iterable_shards_through_the_stream_loader() {
    crate::golden::run_with(
        "iterable_dataset_shards.json",
        false,
        "per_process",
        "error",
        |config, n, np| {
            let loaders = stream_builder(config, n).build(&vec![Default::default(); np])?;
            // The golden file lists each process's items, not its batches.
            let items: Vec<Vec<usize>> = loaders.iter().map(|l| stream_epoch(l).concat()).collect();
            Ok(serde_json::json!(items))
        },
    );
}

#[test]
fn golden_dispatch_cases_through_the_stream_loader() {
    crate::golden::run_with(
        "dispatch_batches.json",
        true,
        "per_process",
        "error",
        |config, n, np| {
            let loaders = stream_builder(config, n).build(&vec![Default::default(); np])?;
            Ok(serde_json::json!(
                loaders.iter().map(stream_epoch).collect::<Vec<_>>()
            ))
        },
    );
}

#[test]
fn dispatch_reads_the_stream_once_per_epoch_and_each_process_reads_its_own_otherwise() {
    let config = DataLoaderConfig::new(2).with_dispatch_batches(true);
    let (reads, loaders) = counted(config.clone(), 23, 3);
    for _ in 0..2 {
        // Lockstep, as a multi-device step runs them.
        let mut its: Vec<_> = loaders.iter().map(|l| l.stream_iter()).collect();
        let mut got = vec![Vec::new(); 3];
        loop {
            let batches: Vec<_> = its.iter_mut().map(Iterator::next).collect();
            if batches.iter().all(Option::is_none) {
                break;
            }
            for (p, batch) in batches.into_iter().enumerate() {
                got[p].extend(batch);
            }
        }
        let indexed: Vec<_> = shards(config.clone(), 23, 3).iter().map(epoch).collect();
        assert_eq!(got, indexed);
    }
    assert_eq!(
        reads.opened.load(Ordering::SeqCst),
        2,
        "one reading per epoch"
    );
    assert_eq!(
        reads.pulled.load(Ordering::SeqCst),
        2 * 23,
        "every item once"
    );

    let (reads, loaders) = counted(config.with_dispatch_batches(false), 23, 3);
    for loader in &loaders {
        stream_epoch(loader);
    }
    assert_eq!(
        reads.opened.load(Ordering::SeqCst),
        3,
        "IterableDatasetShard: one per process"
    );
    assert_eq!(reads.pulled.load(Ordering::SeqCst), 3 * 23);
}

#[test]
fn each_epoch_opens_the_stream_of_that_epoch() {
    let loader = StreamLoaderBuilder::<B, usize, Vec<usize>>::new(
        DataLoaderConfig::new(2),
        |epoch: u64| (0..3).map(move |i| 10 * epoch as usize + i),
        Ids,
    )
    .build(&[Default::default()])
    .unwrap()
    .remove(0);
    assert_eq!(stream_epoch(&loader), vec![vec![0, 1], vec![2, 0]]);
    assert_eq!(stream_epoch(&loader), vec![vec![10, 11], vec![12, 10]]);
    loader.set_epoch(5);
    assert_eq!(stream_epoch(&loader), vec![vec![50, 51], vec![52, 50]]);
}

#[test]
fn observer_sees_the_end_before_the_last_batch_of_a_stream() {
    let log = Arc::new(Log::default());
    // 9 items, batch 2, 2 processes: the last step has 1 real item (remainder 1).
    let loaders = stream_builder(DataLoaderConfig::new(2).with_non_blocking(true), 9)
        .observer(log.clone())
        .build(&[Default::default(), Default::default()])
        .unwrap();
    let mut it = loaders[0].stream_iter();
    assert_eq!(log.take(), ["begin"]);
    assert_eq!(it.next(), Some(vec![0, 1]));
    assert_eq!(it.next(), Some(vec![4, 5]));
    assert!(!it.is_last_batch() && log.take().is_empty());
    assert_eq!(it.next(), Some(vec![8, 0]));
    assert!(it.is_last_batch());
    assert_eq!(log.take(), ["eod Some(1)"]);
    assert_eq!(it.next(), None);
    assert_eq!(log.take(), ["end"]);
    // An empty stream: begin and end only.
    let empty = stream_builder(DataLoaderConfig::new(2), 0)
        .observer(log.clone())
        .build(&[Default::default()])
        .unwrap();
    assert!(stream_epoch(&empty[0]).is_empty());
    assert_eq!(log.take(), ["begin", "end"]);
    assert_eq!(empty[0].epoch(), 1, "an empty epoch is complete");
}

#[test]
fn num_items_is_the_hint_until_an_epoch_measures_the_stream() {
    let config = DataLoaderConfig::new(4);
    let unknown = stream_shards(config.clone(), 10, 2);
    assert_eq!(unknown[1].num_items(), 0);
    assert_eq!(unknown[1].stream_len(), None);
    let hinted = stream_builder(config.clone(), 10)
        .len_hint(10)
        .build(&[Default::default(), Default::default()])
        .unwrap();
    assert_eq!(hinted[1].num_items(), 8, "two steps of 4 per process");
    stream_epoch(&unknown[1]);
    assert_eq!(unknown[1].stream_len(), Some(10));
    assert_eq!(unknown[1].num_items(), 8);
    // Progress counts the batches behind, out of the estimate.
    let mut it = hinted[0].iter();
    it.next();
    let progress = it.progress();
    assert_eq!((progress.items_processed, progress.items_total), (4, 8));
}

#[test]
fn slices_rebatch_the_shards_stream_like_the_indexed_loaders() {
    for config in [
        DataLoaderConfig::new(3),
        DataLoaderConfig::new(3)
            .with_dispatch_batches(true)
            .with_num_workers(2),
    ] {
        let stream = stream_shards(config.clone(), 17, 2);
        let indexed = shards(config.clone(), 17, 2);
        for (s, i) in stream.iter().zip(&indexed) {
            let len = i.num_items();
            for (start, end) in [(0, len), (1, 5), (4, len), (2, 2), (len, len + 3)] {
                let got: Vec<_> = s.slice(start, end).iter().collect();
                let want: Vec<_> = i.slice(start, end).iter().collect();
                assert_eq!(got, want, "{config} {start}..{end}");
            }
        }
    }
}

#[test]
fn invalid_stream_configurations_are_typed_errors_at_build_time() {
    let build = |config: DataLoaderConfig, np: usize| {
        stream_builder(config, 5)
            .build(&vec![Default::default(); np])
            .err()
    };
    assert_eq!(
        build(DataLoaderConfig::new(2).with_shuffle(true), 1),
        Some(DataLoaderError::ShuffledStream)
    );
    assert!(
        build(DataLoaderConfig::new(2).with_shuffle(true), 1)
            .unwrap()
            .to_string()
            .contains("set shuffle = false")
    );
    assert_eq!(
        build(DataLoaderConfig::new(0), 1),
        Some(DataLoaderError::Shard(ShardError::ZeroBatchSize))
    );
    assert_eq!(
        build(DataLoaderConfig::new(2), 0),
        Some(DataLoaderError::Shard(ShardError::ZeroProcesses))
    );
    assert!(matches!(
        build(DataLoaderConfig::new(3).with_split_batches(true), 2),
        Some(DataLoaderError::Shard(ShardError::IndivisibleSplit { .. }))
    ));
    assert!(matches!(
        build(
            DataLoaderConfig::new(2)
                .with_num_workers(1)
                .with_prefetch(0),
            1
        ),
        Some(DataLoaderError::ZeroPrefetch { .. })
    ));
    assert!(matches!(
        stream_builder(DataLoaderConfig::new(2), 5).build_process(2, 2, Default::default()),
        Err(DataLoaderError::Shard(
            ShardError::ProcessIndexOutOfRange { .. }
        ))
    ));
    // The seedable sampler has nothing to act on without shuffle, as in accelerate.
    assert!(build(DataLoaderConfig::new(2).with_use_seedable_sampler(true), 2).is_none());
}

#[test]
fn a_process_built_alone_reads_its_own_dispatch_slices() {
    let config = DataLoaderConfig::new(2).with_dispatch_batches(true);
    let together: Vec<_> = stream_shards(config.clone(), 7, 3)
        .iter()
        .map(stream_epoch)
        .collect();
    for (p, want) in together.iter().enumerate() {
        let alone = stream_builder(config.clone(), 7)
            .build_process(3, p, Default::default())
            .unwrap();
        assert_eq!(&stream_epoch(&alone), want);
    }
}

#[test]
fn a_shard_that_rejoins_an_epoch_behind_the_shared_reader_reads_alone() {
    let config = DataLoaderConfig::new(2).with_dispatch_batches(true);
    let loaders = stream_shards(config.clone(), 19, 2);
    let want: Vec<_> = shards(config, 19, 2).iter().map(epoch).collect();
    let mut first = loaders[0].stream_iter();
    let mut second = loaders[1].stream_iter();
    assert_eq!(first.next().as_ref(), want[0].first());
    assert_eq!(second.next().as_ref(), want[1].first());
    drop(second);
    // Process 1 restarts the same epoch while process 0 is two steps further on.
    first.next();
    first.next();
    assert_eq!(stream_epoch(&loaders[1]), want[1]);
    let rest: Vec<_> = first.collect();
    assert_eq!(rest, want[0][3..]);
}
