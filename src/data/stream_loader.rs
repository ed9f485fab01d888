//! The sharded loader over a stream: one Burn [`DataLoader`] per process, for data that
//! cannot be indexed (accelerate's `IterableDataset` path).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::tensor::backend::Backend;

use super::config::DataLoaderConfig;
use super::dispatch::{Dispatch, Dispatcher, StepSource};
use super::error::DataLoaderError;
use super::observer::LoaderObserver;
use super::prefetch::{Pipeline, Produce, Threading};
use super::processes::{self, Build, MakeReader};
use super::run::EpochRun;
use super::shard::{ShardError, ShardSpec, Sharding};
use super::state::{LoaderState, Tracker};

/// Where a shard of a stream gets its slices (its own reading, or a shared one).
type StreamDispatch<I> = Arc<dyn Dispatch<u64, Option<StreamSlice<I>>>>;
use super::stream::{StepReader, StreamEnd, StreamFactory, StreamSlice, StreamSource, stream_spec};

/// Builds the [`StreamLoader`]s of a [`DataLoaderConfig`] over a stream and a Burn
/// [`Batcher`]: one per process, process `i` creating its batches on device `i`.
///
/// The stream is made by a [`StreamFactory`], e.g. a closure `Fn(epoch) -> impl
/// IntoIterator`, called anew for every epoch. It is sharded as accelerate shards an
/// `IterableDataset`:
///
/// - without `dispatch_batches` (accelerate's `IterableDatasetShard`), every process reads the
///   whole stream in global batches of `total_batch_size` items and keeps its part of each.
///   The tail is always padded from the start of the stream (or dropped with `drop_last`):
///   `even_batches` has no effect, as in accelerate;
/// - with `dispatch_batches` (accelerate's `DataLoaderDispatcher`), the shards built together
///   share one reader, which pulls each global batch once and hands out the slices, with the
///   dispatcher's tail. (Shards built one per OS process with
///   [`build_process`](Self::build_process) or [`build_for`](Self::build_for) each read the
///   stream themselves; with [`build_dispatching`](Self::build_dispatching) process 0 reads
///   it alone and sends the others their slices.)
///
/// The batches are those of an indexed [`ShardLoader`](super::ShardLoader) over the same
/// items with `even_batches` on (or under `dispatch_batches`, any `even_batches`).
///
/// A stream has no indices to permute, so `shuffle` is refused
/// ([`DataLoaderError::ShuffledStream`]); shuffle inside the stream instead.
/// `use_seedable_sampler` has nothing to act on and is ignored, as accelerate ignores it
/// for a loader without a `RandomSampler`.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::data::dataloader::batcher::Batcher;
/// use burn::data::dataloader::DataLoader;
/// use burn_accelerate::data::{DataLoaderConfig, StreamLoaderBuilder};
/// type B = burn::backend::Flex;
///
/// #[derive(Clone)]
/// struct Ids;
/// impl Batcher<B, usize, Vec<usize>> for Ids {
///     fn batch(&self, items: Vec<usize>, _device: &burn::backend::flex::FlexDevice) -> Vec<usize> {
///         items
///     }
/// }
///
/// // Five items per epoch, read front to back (a file, a socket, a generator...).
/// let stream = |_epoch: u64| 0..5usize;
/// let config = DataLoaderConfig::new(2).with_dispatch_batches(true);
/// let shards = StreamLoaderBuilder::new(config, stream, Ids)
///     .build(&[Default::default(), Default::default()])?;
/// // Accelerate's dispatcher pads the short last global batch [4] with one item per process.
/// assert_eq!(shards[0].iter().collect::<Vec<_>>(), vec![vec![0, 1], vec![4]]);
/// assert_eq!(shards[1].iter().collect::<Vec<_>>(), vec![vec![2, 3], vec![0]]);
/// // After one epoch the length is known.
/// assert_eq!(shards[0].num_items(), 3);
/// # }
/// # Ok::<(), burn_accelerate::data::DataLoaderError>(())
/// ```
pub struct StreamLoaderBuilder<B: Backend, I, O> {
    config: DataLoaderConfig,
    factory: Arc<dyn StreamFactory<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    observer: Option<Arc<dyn LoaderObserver>>,
    len_hint: Option<usize>,
}

impl<B, I, O> StreamLoaderBuilder<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// A builder for `config` over the streams `factory` makes and `batcher`.
    pub fn new<F, Bt>(config: DataLoaderConfig, factory: F, batcher: Bt) -> Self
    where
        F: StreamFactory<I> + 'static,
        Bt: Batcher<B, I, O> + 'static,
    {
        Self {
            config,
            factory: Arc::new(factory),
            batcher: Arc::new(batcher),
            observer: None,
            len_hint: None,
        }
    }

    /// Reports every loader's epochs to `observer` (see [`LoaderObserver`]).
    #[must_use]
    pub fn observer(mut self, observer: Arc<dyn LoaderObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The number of items the stream is expected to hold (a `__len__`), used for
    /// [`DataLoader::num_items`] until a whole epoch has measured it.
    #[must_use]
    pub fn len_hint(mut self, stream_len: usize) -> Self {
        self.len_hint = Some(stream_len);
        self
    }

    /// The configuration the loaders are built from.
    pub fn config(&self) -> &DataLoaderConfig {
        &self.config
    }

    /// One loader per device: `devices.len()` processes, process `i` on `devices[i]`. Under
    /// `dispatch_batches` they share one reader. In a run of several processes, this
    /// process's loader for its one device, as [`build_for`](Self::build_for) gives it.
    ///
    /// # Errors
    ///
    /// A [`DataLoaderError`] for an invalid configuration (as for an indexed loader),
    /// [`DataLoaderError::ShuffledStream`] for `shuffle`;
    /// [`DataLoaderError::DevicesPerProcess`] for several devices in a run of several
    /// processes.
    pub fn build(
        &self,
        devices: &[B::Device],
    ) -> Result<Vec<StreamLoader<B, I, O>>, DataLoaderError> {
        processes::build(self, devices)
    }

    /// The loader of process `process_index` alone, out of `num_processes`: what each rank
    /// builds under data-parallel training across OS processes. It reads the stream itself,
    /// also under `dispatch_batches` (with the dispatcher's slices and tail).
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build).
    pub fn build_process(
        &self,
        num_processes: usize,
        process_index: usize,
        device: B::Device,
    ) -> Result<StreamLoader<B, I, O>, DataLoaderError> {
        processes::build_process(self, num_processes, process_index, device)
    }

    /// The loader of this process in the run `state` describes (see
    /// [`ProcessState::from_env`](crate::distributed::ProcessState::from_env)): what each
    /// process of a `burn-accelerate launch` builds; [`build_process`](Self::build_process)
    /// with the state's process count and index.
    ///
    /// # Errors
    ///
    /// As [`build_process`](Self::build_process).
    pub fn build_for(
        &self,
        state: &crate::distributed::ProcessState,
        device: B::Device,
    ) -> Result<StreamLoader<B, I, O>, DataLoaderError> {
        processes::build_for(self, state, device)
    }

    /// [`build_for`](Self::build_for), and under `dispatch_batches` in a run of several
    /// processes, only process 0 reads the stream: it sends every other process its slice of
    /// each global batch, the end of the stream with the last (items must be serde values;
    /// int and bool fields arrive exactly). Without `dispatch_batches`, or on one process,
    /// the same as `build_for`. As with
    /// [`ShardLoaderBuilder::build_dispatching`](super::ShardLoaderBuilder::build_dispatching),
    /// every process must build its dispatching loaders in the same order.
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build); [`DataLoaderError::Distributed`] when the process group
    /// cannot be joined.
    pub fn build_dispatching(
        &self,
        state: &crate::distributed::ProcessState,
        device: B::Device,
    ) -> Result<StreamLoader<B, I, O>, DataLoaderError>
    where
        I: serde::Serialize + serde::de::DeserializeOwned,
    {
        processes::build_dispatching(self, state, device)
    }
}

impl<B, I, O> Build for StreamLoaderBuilder<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    type Loader = StreamLoader<B, I, O>;
    type Device = B::Device;
    type Source = StreamSource<I>;

    fn config(&self) -> &DataLoaderConfig {
        &self.config
    }

    // A stream cannot be shuffled at all (refused when built).
    fn shuffles(&self) -> bool {
        false
    }

    fn build_with(
        &self,
        num_processes: usize,
        processes: Vec<(usize, B::Device)>,
        shared_reader: MakeReader<'_, StreamSource<I>>,
    ) -> Result<Vec<StreamLoader<B, I, O>>, DataLoaderError> {
        let first = processes.first().map_or(0, |(p, _)| *p);
        let spec = self.config.shard_spec(num_processes, first)?;
        if self.config.shuffle {
            return Err(DataLoaderError::ShuffledStream);
        }
        let sharding = self.config.sharding();
        let specs = (0..num_processes)
            .map(|p| Ok(stream_spec(spec.with_process_index(p)?)))
            .collect::<Result<Vec<ShardSpec>, ShardError>>()?;
        let source = StreamSource::new(Arc::clone(&self.factory), specs, sharding);
        let flags = |registered: &[usize]| {
            let mut flags = vec![false; num_processes];
            for &p in registered {
                flags[p] = true;
            }
            flags
        };
        let all: Vec<usize> = processes.iter().map(|(p, _)| *p).collect();
        let shared =
            (sharding == Sharding::Dispatch).then(|| shared_reader(source.clone(), flags(&all)));
        // Without dispatch every process reads the stream itself.
        let own =
            |p: usize| Arc::new(Dispatcher::new(source.clone(), flags(&[p]))) as StreamDispatch<I>;
        let threading = Threading::of(&self.config);
        Ok(processes
            .into_iter()
            .map(|(p, device)| StreamLoader {
                hub: shared.clone().unwrap_or_else(|| own(p)),
                source: source.clone(),
                process: p,
                part: spec.process_batch_size(),
                batcher: Arc::clone(&self.batcher),
                threading,
                window: None,
                device,
                // Recorded in the state only; a stream is never permuted.
                tracker: Tracker::new(self.config.data_seed.unwrap_or(0)),
                stream_len: Arc::new(Mutex::new(self.len_hint)),
                observer: self.observer.clone(),
            })
            .collect())
    }
}

/// One process's share of a stream, as a Burn [`DataLoader`].
///
/// Each [`iter`](DataLoader::iter) runs one epoch: it opens the epoch's stream and yields the
/// batches accelerate's sharded loader yields on this process (see [`StreamLoaderBuilder`]).
/// A completed epoch advances the epoch counter; one broken off early does not.
///
/// What a stream cannot know:
/// - its length, until it ends. [`num_items`](DataLoader::num_items) is the number of items
///   this process yields over a stream of the length the last completed epoch measured, or,
///   before one has, of [`StreamLoaderBuilder::len_hint`], or 0. Burn's
///   `split_dataloader` cuts a loader by `num_items`, so give a hint before handing an
///   unread stream to it;
/// - its end, before reading it: every process reads one global batch ahead, so the last
///   batch is known as the last when it is handed out (for `end_of_dataloader`, and the
///   `remainder`, which is the real one, where accelerate reports `-1` for a stream without a
///   length);
/// - a position without reading up to it: resuming with
///   [`skip_first_batches`](Self::skip_first_batches) or [`load_state`](Self::load_state)
///   reads and discards the skipped batches, as accelerate does on a stream, and a position
///   past the end yields an empty epoch rather than an error.
pub struct StreamLoader<B: Backend, I, O> {
    hub: StreamDispatch<I>,
    source: StreamSource<I>,
    process: usize,
    /// Items in every batch of this process but the last.
    part: usize,
    batcher: Arc<dyn Batcher<B, I, O>>,
    threading: Threading,
    /// Range of this process's item stream a slice is restricted to; `None` for the shard.
    window: Option<Range<usize>>,
    device: B::Device,
    tracker: Tracker,
    /// Items in the stream: measured by the last completed epoch, or the hint.
    stream_len: Arc<Mutex<Option<usize>>>,
    observer: Option<Arc<dyn LoaderObserver>>,
}

impl<B: Backend, I, O> Clone for StreamLoader<B, I, O> {
    fn clone(&self) -> Self {
        Self {
            hub: Arc::clone(&self.hub),
            source: self.source.clone(),
            process: self.process,
            part: self.part,
            batcher: Arc::clone(&self.batcher),
            threading: self.threading,
            window: self.window.clone(),
            device: self.device.clone(),
            tracker: self.tracker.clone(),
            stream_len: Arc::clone(&self.stream_len),
            observer: self.observer.clone(),
        }
    }
}

impl<B, I, O> StreamLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// Starts an epoch, like [`DataLoader::iter`], with the iterator's own type, which also
    /// tells whether the batch just handed out is the last and what the remainder is.
    pub fn stream_iter(&self) -> StreamIter<B, I, O> {
        // A stream's epochs are never shuffled: no permutation, no order seed.
        let start = self.tracker.begin(false, false, usize::MAX);
        let reader = match &self.window {
            None => Reader::Shard(Arc::clone(&self.hub)),
            Some(window) => Reader::Window(Box::new(Mutex::new(Window::new(
                self.source.reader(start.epoch),
                self.source.clone(),
                self.process,
                self.part,
                window.clone(),
            )))),
        };
        let producer = Arc::new(StreamProducer {
            reader,
            process: self.process,
            epoch: start.epoch,
            first_step: start.start,
            batcher: Arc::clone(&self.batcher),
            device: self.device.clone(),
        });
        let leave = self.window.is_none().then(|| {
            let (hub, process, epoch) = (Arc::clone(&self.hub), self.process, start.epoch);
            Box::new(move || hub.leave(process, (epoch, None))) as super::run::Leave
        });
        let run = EpochRun::begin(
            self.tracker.clone(),
            &start,
            self.observer.clone().filter(|_| self.window.is_none()),
            leave,
        );
        StreamIter {
            pipeline: Pipeline::new(
                producer,
                start.start,
                usize::MAX,
                self.threading.on_device::<B>(&self.device),
            ),
            source: self.source.clone(),
            process: self.process,
            window_len: self.window.as_ref().map(ExactSizeIterator::len),
            epoch: start.epoch,
            run,
            stream_len: Arc::clone(&self.stream_len),
            expected_items: self.num_items(),
            part: self.part,
            items: start.start.saturating_mul(self.part),
            end: None,
        }
    }
}

impl<B: Backend, I, O> StreamLoader<B, I, O> {
    /// Reports this loader's epochs to `observer` instead of the builder's.
    #[must_use]
    pub fn with_observer(mut self, observer: Arc<dyn LoaderObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The device batches are created on.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// The number of items in the stream, once an epoch has measured it (or as hinted).
    pub fn stream_len(&self) -> Option<usize> {
        *self
            .stream_len
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The epoch the next iterator runs (or the one in progress).
    pub fn epoch(&self) -> u64 {
        self.tracker.state().epoch
    }

    /// Sets the epoch the next iterator runs: the stream factory is called with it.
    /// Setting the current epoch again changes nothing, so a restored position survives.
    pub fn set_epoch(&self, epoch: u64) {
        self.tracker.set_epoch(epoch);
    }

    /// Makes the next iterator start after its first `num_batches` batches, yielding exactly
    /// what an uninterrupted epoch yields from there (accelerate's `skip_first_batches`).
    /// The skipped part of the stream is read and discarded. Applies once.
    pub fn skip_first_batches(&self, num_batches: usize) {
        self.tracker.skip_first_batches(num_batches);
    }

    /// Where this loader is, for a checkpoint.
    pub fn state(&self) -> LoaderState {
        self.tracker.state()
    }

    /// Restores a checkpointed position: the next iterator resumes the saved epoch where it
    /// stopped.
    ///
    /// # Errors
    ///
    /// None today (a stream's length is not known, so a position past its end cannot be told
    /// from a valid one: that epoch comes out empty); the `Result` keeps the signature of
    /// [`ShardLoader::load_state`](super::ShardLoader::load_state).
    pub fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError> {
        self.tracker.load(state, usize::MAX)
    }
}

impl<B, I, O> DataLoader<B, O> for StreamLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        Box::new(self.stream_iter())
    }

    /// Items one epoch yields on this process, padding included, for a stream as long as
    /// the last completed epoch measured (or the hint); 0 while neither is known.
    fn num_items(&self) -> usize {
        let shard = self
            .stream_len()
            .map_or(0, |n| self.source.shard_items(self.process, n));
        match &self.window {
            None => shard,
            Some(window) => shard.min(window.end).saturating_sub(window.start),
        }
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        // Per-process already: the `with_accelerate` strategy must not shard it again.
        super::loader::mark_moved(super::loader::ProcessShare {
            num_processes: None,
            process_index: self.process,
        });
        let mut loader = self.clone();
        loader.device = device.clone();
        Arc::new(loader)
    }

    /// Items `start..end` of this process's epoch stream, batched again by the process batch
    /// size. A slice reads the stream itself (even under dispatch), keeps its own epoch
    /// counter from the current one, and reports to no observer.
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let current = self.window.clone().unwrap_or(0..usize::MAX);
        let lo = current.start.saturating_add(start).min(current.end);
        let hi = current.start.saturating_add(end).clamp(lo, current.end);
        let mut loader = self.clone();
        loader.window = Some(lo..hi);
        loader.observer = None;
        loader.tracker = self.tracker.fork();
        Arc::new(loader)
    }
}

/// Where a producer gets its slices.
enum Reader<I> {
    /// The shard's reader (shared by all shards under dispatch).
    Shard(StreamDispatch<I>),
    /// A slice's own reading of the shard's items.
    Window(Box<Mutex<Window<I>>>),
}

/// A window of one process's item stream, batched again.
struct Window<I> {
    reader: StepReader<I>,
    source: StreamSource<I>,
    process: usize,
    part: usize,
    range: Range<usize>,
    /// Items of the shard's stream read but not yet batched, and the index of the first.
    buffer: VecDeque<I>,
    buffer_start: usize,
    /// The shard's stream has ended (its last slice is in `buffer`).
    exhausted: bool,
    /// Batches made but not yet asked for (prefetch workers ask out of order).
    ready: BTreeMap<usize, Option<StreamSlice<I>>>,
    next_batch: usize,
}

impl<I: Clone + Send> Window<I> {
    fn new(
        reader: StepReader<I>,
        source: StreamSource<I>,
        process: usize,
        part: usize,
        range: Range<usize>,
    ) -> Self {
        Self {
            reader,
            source,
            process,
            part,
            range,
            buffer: VecDeque::new(),
            buffer_start: 0,
            exhausted: false,
            ready: BTreeMap::new(),
            next_batch: 0,
        }
    }

    /// Reads the shard's next slice into the buffer; `false` once there is none.
    fn fill(&mut self) -> bool {
        if self.exhausted {
            return false;
        }
        let step = self.reader.position();
        let slice = self
            .source
            .read_step(&mut self.reader, &0, step, &[self.process])
            .pop()
            .flatten();
        let Some(slice) = slice else {
            self.exhausted = true;
            return false;
        };
        self.exhausted = slice.end.is_some();
        self.buffer.extend(slice.items);
        true
    }

    /// Batch `index` of the window (`None` past its end).
    fn batch(&mut self, index: usize) -> Option<StreamSlice<I>> {
        while self.next_batch <= index {
            let batch = self.make();
            self.ready.insert(self.next_batch, batch);
            self.next_batch += 1;
        }
        self.ready.remove(&index).flatten()
    }

    fn make(&mut self) -> Option<StreamSlice<I>> {
        let lo = self
            .range
            .start
            .saturating_add(self.next_batch.saturating_mul(self.part));
        let hi = lo.saturating_add(self.part).min(self.range.end);
        if lo >= hi {
            return None;
        }
        // Pass over what lies before the window, then gather up to `hi`.
        while self.buffer_start + self.buffer.len() < hi && self.fill() {}
        let skip = lo.saturating_sub(self.buffer_start).min(self.buffer.len());
        self.buffer.drain(..skip);
        self.buffer_start += skip;
        let take = (hi - self.buffer_start.max(lo)).min(self.buffer.len());
        let items: Vec<I> = self.buffer.drain(..take).collect();
        self.buffer_start += take;
        if items.is_empty() {
            return None;
        }
        // Last when the window is done, or nothing follows in the shard's stream.
        let last = self.buffer_start >= self.range.end || {
            while self.buffer.is_empty() && self.fill() {}
            self.buffer.is_empty()
        };
        Some(StreamSlice {
            items,
            end: last.then_some(StreamEnd {
                stream_len: 0,
                remainder: None,
                padding: 0,
            }),
        })
    }
}

/// Makes the batches of one epoch; shared with the prefetch threads.
struct StreamProducer<B: Backend, I, O> {
    reader: Reader<I>,
    process: usize,
    epoch: u64,
    /// The step this epoch's iterator began at.
    first_step: usize,
    batcher: Arc<dyn Batcher<B, I, O>>,
    device: B::Device,
}

/// A batch and, on the last one, what the end of the stream told.
struct StreamBatch<O> {
    batch: O,
    end: Option<StreamEnd>,
}

impl<B, I, O> Produce for StreamProducer<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    type Items = Option<StreamSlice<I>>;
    type Batch = Option<StreamBatch<O>>;

    fn read(&self, index: usize) -> Option<Option<StreamSlice<I>>> {
        match &self.reader {
            Reader::Shard(hub) => hub.take(self.process, &self.epoch, index, self.first_step),
            Reader::Window(window) => Some(
                window
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .batch(index),
            ),
        }
    }

    fn batch(&self, items: Option<StreamSlice<I>>) -> Option<StreamBatch<O>> {
        items.map(|slice| StreamBatch {
            batch: self.batcher.batch(slice.items, &self.device),
            end: slice.end,
        })
    }

    fn ends(&self, items: &Option<StreamSlice<I>>) -> bool {
        items.as_ref().is_none_or(|slice| slice.end.is_some())
    }
}

/// One epoch of a [`StreamLoader`]; Burn's [`DataLoaderIterator`] plus where the epoch
/// stands.
///
/// Dropping it early stops its prefetch threads (joining them) and reports
/// [`LoaderObserver::end`].
pub struct StreamIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    pipeline: Pipeline<StreamProducer<B, I, O>>,
    source: StreamSource<I>,
    process: usize,
    /// The length of a slice's window; `None` for a shard.
    window_len: Option<usize>,
    epoch: u64,
    run: EpochRun,
    stream_len: Arc<Mutex<Option<usize>>>,
    /// `num_items` when the epoch started, for progress.
    expected_items: usize,
    part: usize,
    /// Items of the epoch behind (skipped ones included).
    items: usize,
    /// Set once the last batch has been handed out.
    end: Option<StreamEnd>,
}

impl<B, I, O> StreamIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// The epoch this iterator runs.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the epoch behind (skipped ones included): the index of the next batch.
    pub fn position(&self) -> usize {
        self.pipeline.position()
    }

    /// Whether the batch handed out last is the last of the epoch (accelerate's
    /// `end_of_dataloader`).
    pub fn is_last_batch(&self) -> bool {
        self.end.is_some()
    }

    /// Accelerate's `remainder`, known with the last batch (`None` before it, for a slice,
    /// and with `drop_last`).
    pub fn remainder(&self) -> Option<usize> {
        self.end.and_then(|end| end.remainder)
    }

    /// How many items to drop from the end of the gathered batch just handed out: the last
    /// step's padding on the last batch, 0 on every other (see
    /// [`gather_for_metrics`](super::gather_for_metrics)).
    pub fn metrics_padding(&self) -> usize {
        self.end.map_or(0, |end| end.padding)
    }

    fn close(&mut self) {
        let pipeline = &mut self.pipeline;
        self.run.close(|| pipeline.shutdown());
    }
}

impl<B, I, O> Iterator for StreamIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    type Item = O;

    fn next(&mut self) -> Option<O> {
        if self.run.is_complete() {
            self.close();
        }
        if self.run.is_closed() {
            return None;
        }
        let Some(Some(batch)) = self.pipeline.next() else {
            // The stream ended before this batch (an empty stream, or a skip past its end).
            self.run.complete();
            self.close();
            return None;
        };
        let position = self.pipeline.position();
        self.items = self.items.saturating_add(self.part);
        match batch.end {
            Some(end) => {
                self.items = match self.window_len {
                    None => {
                        *self
                            .stream_len
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner) = Some(end.stream_len);
                        self.source.shard_items(self.process, end.stream_len)
                    }
                    Some(len) => self.items.min(len),
                };
                self.end = Some(end);
                self.run.last_batch(end.remainder);
            }
            None => self.run.yielded(position),
        }
        Some(batch.batch)
    }
}

impl<B, I, O> DataLoaderIterator<O> for StreamIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// Items behind (every batch but the last is full, so this is exact), out of
    /// `num_items` as it stood when the epoch started, or more once more are behind.
    fn progress(&self) -> Progress {
        Progress::new(self.items, self.expected_items.max(self.items))
    }
}

impl<B, I, O> Drop for StreamIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn drop(&mut self) {
        self.close();
    }
}
