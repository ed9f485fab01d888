//! The sharded loader: one Burn [`DataLoader`] per process, over a shared dataset and batcher.

use std::cell::Cell;
use std::hash::{BuildHasher, RandomState};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;

use super::config::DataLoaderConfig;
use super::dispatch::{Dispatch, IndexedSource};
use super::epoch::{Epoch, stream_len};
use super::error::DataLoaderError;
use super::observer::LoaderObserver;
use super::prefetch::{Pipeline, Produce, Threading};
use super::processes::{self, Build, MakeReader};
use super::run::EpochRun;
use super::shard::{ShardPlan, ShardSpec, Sharding, seeded_permutation};
use super::state::{LoaderState, Tracker};

/// Where a dispatched shard of an indexed dataset gets its slices.
type ShardDispatch<I> = Arc<dyn Dispatch<Epoch, Vec<I>>>;

/// Builds the [`ShardLoader`]s of a [`DataLoaderConfig`] over a Burn [`Dataset`] and
/// [`Batcher`]: one per process, process `i` creating its batches on device `i`.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::data::dataloader::batcher::Batcher;
/// use burn::data::dataloader::DataLoader;
/// use burn::data::dataset::InMemDataset;
/// use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
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
/// let dataset = InMemDataset::new((0..5).collect::<Vec<usize>>());
/// let builder = ShardLoaderBuilder::new(DataLoaderConfig::new(2), dataset, Ids);
/// let shards = builder.build(&[Default::default(), Default::default()])?;
/// // The uneven tail is padded from the start, so both processes take two steps.
/// assert_eq!(shards[0].iter().collect::<Vec<_>>(), vec![vec![0, 1], vec![4, 0]]);
/// assert_eq!(shards[1].iter().collect::<Vec<_>>(), vec![vec![2, 3], vec![1, 2]]);
/// # }
/// # Ok::<(), burn_accelerate::data::DataLoaderError>(())
/// ```
pub struct ShardLoaderBuilder<B: Backend, I, O> {
    config: DataLoaderConfig,
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    observer: Option<Arc<dyn LoaderObserver>>,
}

impl<B, I, O> ShardLoaderBuilder<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// A builder for `config` over `dataset` and `batcher`.
    pub fn new<D, Bt>(config: DataLoaderConfig, dataset: D, batcher: Bt) -> Self
    where
        D: Dataset<I> + 'static,
        Bt: Batcher<B, I, O> + 'static,
    {
        Self {
            config,
            dataset: Arc::new(dataset),
            batcher: Arc::new(batcher),
            observer: None,
        }
    }

    /// Reports every loader's epochs to `observer` (see [`LoaderObserver`]).
    #[must_use]
    pub fn observer(mut self, observer: Arc<dyn LoaderObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The configuration the loaders are built from.
    pub fn config(&self) -> &DataLoaderConfig {
        &self.config
    }

    /// One loader per device: `devices.len()` processes, process `i` on `devices[i]`. Under
    /// `dispatch_batches` they share one reader; with `shuffle` they share one seed.
    ///
    /// In a run of several processes (`burn-accelerate launch`, see
    /// [`ProcessState`](crate::distributed::ProcessState)), this process's loader for its one
    /// device instead, as [`build_for`](Self::build_for) gives it: a script written for one
    /// process shards its data unchanged.
    ///
    /// # Errors
    ///
    /// A [`DataLoaderError`] for an invalid configuration, [`ShardError::ZeroProcesses`]
    /// (wrapped) for no devices; [`DataLoaderError::DevicesPerProcess`] for several devices in
    /// a run of several processes; [`DataLoaderError::Distributed`] for a bad launch
    /// environment.
    ///
    /// [`ShardError::ZeroProcesses`]: super::shard::ShardError::ZeroProcesses
    pub fn build(
        &self,
        devices: &[B::Device],
    ) -> Result<Vec<ShardLoader<B, I, O>>, DataLoaderError> {
        processes::build(self, devices)
    }

    /// The loader of process `process_index` alone, out of `num_processes`: what each rank
    /// builds under data-parallel training across OS processes.
    ///
    /// Under `dispatch_batches` this loader reads its own slice of each global batch (the
    /// items a dispatcher would send it, tail included): for process 0 to read alone and send
    /// the others theirs, use [`build_dispatching`](Self::build_dispatching).
    ///
    /// # Errors
    ///
    /// A [`DataLoaderError`] for an invalid configuration;
    /// [`DataLoaderError::MissingDataSeed`] for `shuffle` over several processes without a
    /// `data_seed`, since separately built processes could not agree on a random one.
    pub fn build_process(
        &self,
        num_processes: usize,
        process_index: usize,
        device: B::Device,
    ) -> Result<ShardLoader<B, I, O>, DataLoaderError> {
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
    ) -> Result<ShardLoader<B, I, O>, DataLoaderError> {
        processes::build_for(self, state, device)
    }

    /// [`build_for`](Self::build_for), and under `dispatch_batches` in a run of several
    /// processes, only process 0 reads the dataset: it sends every other process its slice of
    /// each global batch (Accelerate's `DataLoaderDispatcher`), so items must be serde
    /// values; int and bool fields arrive exactly. Without `dispatch_batches`, or on one
    /// process, the same as `build_for`.
    ///
    /// Every process must build its dispatching loaders in the same order (each gets a stream
    /// of its own between the processes), and iterate the same epochs: process 0 reads a
    /// step when its own iterator (or its prefetch) gets there.
    ///
    /// # Errors
    ///
    /// As [`build_process`](Self::build_process); [`DataLoaderError::Distributed`] when the
    /// process group cannot be joined.
    pub fn build_dispatching(
        &self,
        state: &crate::distributed::ProcessState,
        device: B::Device,
    ) -> Result<ShardLoader<B, I, O>, DataLoaderError>
    where
        I: serde::Serialize + serde::de::DeserializeOwned,
    {
        processes::build_dispatching(self, state, device)
    }
}

impl<B, I, O> Build for ShardLoaderBuilder<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    type Loader = ShardLoader<B, I, O>;
    type Device = B::Device;
    type Source = IndexedSource<I>;

    fn config(&self) -> &DataLoaderConfig {
        &self.config
    }

    fn shuffles(&self) -> bool {
        self.config.shuffle
    }

    fn build_with(
        &self,
        num_processes: usize,
        processes: Vec<(usize, B::Device)>,
        reader: MakeReader<'_, IndexedSource<I>>,
    ) -> Result<Vec<ShardLoader<B, I, O>>, DataLoaderError> {
        let first = processes.first().map_or(0, |(p, _)| *p);
        let spec = self.config.shard_spec(num_processes, first)?;
        let sharding = self.config.sharding();
        let len = self.dataset.len();
        let plans = (0..num_processes)
            .map(|p| Ok(ShardPlan::new(len, &spec.with_process_index(p)?, sharding)?))
            .collect::<Result<Vec<_>, DataLoaderError>>()?;
        let seed = self.config.data_seed.unwrap_or_else(random_seed);
        let dispatcher = (sharding == Sharding::Dispatch).then(|| {
            let mut registered = vec![false; num_processes];
            for (p, _) in &processes {
                registered[*p] = true;
            }
            reader(
                IndexedSource::new(Arc::clone(&self.dataset), plans.clone()),
                registered,
            )
        });
        let orders = OrderCache::default();
        let threading = Threading::of(&self.config);
        Ok(processes
            .into_iter()
            .map(|(p, device)| ShardLoader {
                dataset: Arc::clone(&self.dataset),
                batcher: Arc::clone(&self.batcher),
                dispatcher: dispatcher.clone(),
                plan: plans[p],
                shuffle: self.config.shuffle,
                seedable: self.config.use_seedable_sampler,
                threading,
                window: None,
                device,
                tracker: Tracker::new(seed),
                orders: orders.clone(),
                observer: self.observer.clone(),
            })
            .collect())
    }
}

/// A seed no two runs are likely to share, from the standard library's per-process random
/// hasher keys (no dependency needed for one number).
fn random_seed() -> u64 {
    RandomState::new().hash_one(std::process::id())
}

/// The permutation of the current epoch, computed once for all shards of a builder.
#[derive(Clone, Default)]
struct OrderCache(Arc<Mutex<Option<SeededOrder>>>);

/// A permutation and the seed it was drawn from.
type SeededOrder = (u64, Arc<[usize]>);

impl OrderCache {
    fn get(&self, len: usize, seed: u64) -> Arc<[usize]> {
        let mut cached = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match &*cached {
            Some((s, order)) if *s == seed && order.len() == len => Arc::clone(order),
            _ => {
                let order: Arc<[usize]> = seeded_permutation(len, seed).into();
                *cached = Some((seed, Arc::clone(&order)));
                order
            }
        }
    }
}

/// One process's share of the data, as a Burn [`DataLoader`].
///
/// Each [`iter`](DataLoader::iter) runs one epoch: the batches Accelerate's sharded loader
/// yields on this process (see [`shard`](super::shard) for the rules), in the epoch's order,
/// created by the batcher on this loader's device. A completed epoch advances the epoch
/// counter, which reshuffles the next one; an epoch broken off early does not.
///
/// Copies made by [`to_device`](DataLoader::to_device) share the epoch counter and position,
/// so the handle kept for checkpointing sees what the copy a trainer iterates does.
pub struct ShardLoader<B: Backend, I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<B, I, O>>,
    dispatcher: Option<ShardDispatch<I>>,
    plan: ShardPlan,
    shuffle: bool,
    seedable: bool,
    threading: Threading,
    /// Range of the flattened item stream a slice is restricted to; `None` for the shard.
    window: Option<Range<usize>>,
    device: B::Device,
    tracker: Tracker,
    orders: OrderCache,
    observer: Option<Arc<dyn LoaderObserver>>,
}

impl<B: Backend, I, O> Clone for ShardLoader<B, I, O> {
    fn clone(&self) -> Self {
        Self {
            dataset: Arc::clone(&self.dataset),
            batcher: Arc::clone(&self.batcher),
            dispatcher: self.dispatcher.clone(),
            plan: self.plan,
            shuffle: self.shuffle,
            seedable: self.seedable,
            threading: self.threading,
            window: self.window.clone(),
            device: self.device.clone(),
            tracker: self.tracker.clone(),
            orders: self.orders.clone(),
            observer: self.observer.clone(),
        }
    }
}

impl<B, I, O> ShardLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// Starts an epoch, like [`DataLoader::iter`], with the iterator's own type, which also
    /// tells whether the batch just handed out is the last and what the remainder is.
    pub fn shard_iter(&self) -> ShardIter<B, I, O> {
        let shape = self.epoch_shape(None, (0, None));
        let num_batches = shape.num_batches();
        let start = self.tracker.begin(self.shuffle, self.seedable, num_batches);
        let order = start
            .order_seed
            .map(|seed| self.orders.get(self.plan.dataset_len(), seed));
        let epoch = self.epoch_shape(order, (start.epoch, start.order_seed));
        let full = epoch.is_full();
        let dispatcher = self
            .dispatcher
            .clone()
            .filter(|_| full)
            .map(|hub| (hub, self.plan.spec().process_index()));
        let producer = Arc::new(Producer {
            epoch: epoch.clone(),
            dataset: Arc::clone(&self.dataset),
            dispatcher: dispatcher.clone(),
            first_step: start.start,
            batcher: Arc::clone(&self.batcher),
            device: self.device.clone(),
        });
        let key = epoch.key();
        let leave = dispatcher
            .map(|(hub, process)| Box::new(move || hub.leave(process, key)) as super::run::Leave);
        let run = EpochRun::begin(
            self.tracker.clone(),
            &start,
            self.observer.clone().filter(|_| full),
            leave,
        );
        ShardIter {
            pipeline: Pipeline::new(
                producer,
                start.start,
                num_batches,
                self.threading.on_device::<B>(&self.device),
            ),
            epoch,
            epoch_number: start.epoch,
            run,
            num_batches,
            last: None,
        }
    }
}

impl<B: Backend, I, O> ShardLoader<B, I, O> {
    fn epoch_shape(&self, order: Option<Arc<[usize]>>, key: super::epoch::EpochKey) -> Epoch {
        Epoch::new(self.plan, order, self.window.clone(), key)
    }

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

    /// This process's sharding settings.
    pub fn spec(&self) -> &ShardSpec {
        self.plan.spec()
    }

    /// The index arithmetic of one epoch on this process (over sampler positions).
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// Batches one epoch yields, skipped ones included.
    pub fn num_batches(&self) -> usize {
        self.epoch_shape(None, (0, None)).num_batches()
    }

    /// Accelerate's `remainder` for this loader (see [`ShardPlan::remainder`]); `None` for a
    /// slice.
    pub fn remainder(&self) -> Option<usize> {
        self.window
            .is_none()
            .then(|| self.plan.remainder())
            .flatten()
    }

    /// How many items to drop from the end of the gathered last step (see
    /// [`gather_for_metrics`](super::gather_for_metrics)); 0 for a slice.
    pub fn last_step_padding(&self) -> usize {
        if self.window.is_none() {
            self.plan.last_step_padding()
        } else {
            0
        }
    }

    /// The epoch the next iterator runs (or the one in progress).
    pub fn epoch(&self) -> u64 {
        self.tracker.state().epoch
    }

    /// Sets the epoch the next iterator runs, which selects its shuffled order under the
    /// seedable sampler (Accelerate's `set_epoch`). Setting the current epoch again changes
    /// nothing, so a restored position survives the usual `set_epoch` at the top of a loop.
    pub fn set_epoch(&self, epoch: u64) {
        self.tracker.set_epoch(epoch);
    }

    /// Makes the next iterator start after its first `num_batches` batches, yielding exactly
    /// what an uninterrupted epoch yields from there (Accelerate's `skip_first_batches`).
    /// Applies once; the epochs after it are whole.
    pub fn skip_first_batches(&self, num_batches: usize) {
        self.tracker.skip_first_batches(num_batches);
    }

    /// Where this loader is, for a checkpoint.
    pub fn state(&self) -> LoaderState {
        self.tracker.state()
    }

    /// Restores a checkpointed position: the next iterator resumes the saved epoch where it
    /// stopped, in the same order.
    ///
    /// # Errors
    ///
    /// [`DataLoaderError::ResumePastEnd`] when the position is beyond this loader's epoch,
    /// i.e. the state was saved with another dataset or configuration.
    pub fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError> {
        self.tracker.load(state, self.num_batches())
    }
}

impl<B, I, O> DataLoader<B, O> for ShardLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        Box::new(self.shard_iter())
    }

    /// Items one epoch yields on this process, padding included (a skip does not change it;
    /// progress starts past the skipped items).
    fn num_items(&self) -> usize {
        self.epoch_shape(None, (0, None)).num_items()
    }

    /// Also records, on the calling thread, that a per-process loader was moved: the
    /// `with_accelerate` strategy must not shard it again (see
    /// [`AccelerateStrategy::prepare_loader`](crate::train::AccelerateStrategy::prepare_loader)).
    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        mark_moved(ProcessShare {
            num_processes: Some(self.spec().num_processes()),
            process_index: self.spec().process_index(),
        });
        let mut loader = self.clone();
        loader.device = device.clone();
        Arc::new(loader)
    }

    /// Items `start..end` of this shard's epoch stream, batched again by the process batch
    /// size. A slice reads the dataset itself (even under dispatch), keeps its own epoch
    /// counter from the current one, and reports to no observer.
    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        let current = self.window.clone().unwrap_or(0..stream_len(&self.plan));
        let lo = current.start.saturating_add(start).min(current.end);
        let hi = current.start.saturating_add(end).clamp(lo, current.end);
        let mut loader = self.clone();
        loader.window = Some(lo..hi);
        loader.dispatcher = None;
        loader.observer = None;
        loader.tracker = self.tracker.fork();
        Arc::new(loader)
    }
}

/// Makes the batches of one epoch; shared with the prefetch threads.
struct Producer<B: Backend, I, O> {
    epoch: Epoch,
    dataset: Arc<dyn Dataset<I>>,
    dispatcher: Option<(ShardDispatch<I>, usize)>,
    /// The step this epoch's iterator began at.
    first_step: usize,
    batcher: Arc<dyn Batcher<B, I, O>>,
    device: B::Device,
}

impl<B, I, O> Produce for Producer<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    type Items = Vec<I>;
    type Batch = O;

    fn read(&self, index: usize) -> Option<Vec<I>> {
        match &self.dispatcher {
            Some((hub, process)) => hub.take(*process, &self.epoch, index, self.first_step),
            None => Some(self.epoch.read(self.dataset.as_ref(), index)),
        }
    }

    fn batch(&self, items: Vec<I>) -> O {
        self.batcher.batch(items, &self.device)
    }
}

/// One epoch of a [`ShardLoader`]; Burn's [`DataLoaderIterator`] plus where the epoch stands.
///
/// Dropping it early stops its prefetch threads (joining them) and reports
/// [`LoaderObserver::end`].
pub struct ShardIter<B: Backend, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    pipeline: Pipeline<Producer<B, I, O>>,
    epoch: Epoch,
    epoch_number: u64,
    run: EpochRun,
    num_batches: usize,
    /// Index of the batch handed out last.
    last: Option<usize>,
}

impl<B, I, O> ShardIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    /// The epoch this iterator runs.
    pub fn epoch(&self) -> u64 {
        self.epoch_number
    }

    /// Batches of the epoch behind (skipped ones included): the index of the next batch.
    pub fn position(&self) -> usize {
        self.pipeline.position()
    }

    /// Batches in the whole epoch, skipped ones included.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// Whether the batch handed out last is the last of the epoch (Accelerate's
    /// `end_of_dataloader`).
    pub fn is_last_batch(&self) -> bool {
        self.last.is_some_and(|index| index + 1 == self.num_batches)
    }

    /// Accelerate's `remainder` for this epoch (see [`ShardPlan::remainder`]); `None` for a
    /// slice.
    pub fn remainder(&self) -> Option<usize> {
        self.epoch
            .is_full()
            .then(|| self.epoch.plan().remainder())
            .flatten()
    }

    /// How many items to drop from the end of the gathered batch just handed out: the last
    /// step's padding on the last batch, 0 on every other (see
    /// [`gather_for_metrics`](super::gather_for_metrics)).
    pub fn metrics_padding(&self) -> usize {
        if self.is_last_batch() && self.epoch.is_full() {
            self.epoch.plan().last_step_padding()
        } else {
            0
        }
    }

    fn close(&mut self) {
        let pipeline = &mut self.pipeline;
        self.run.close(|| pipeline.shutdown());
    }
}

impl<B, I, O> Iterator for ShardIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    type Item = O;

    fn next(&mut self) -> Option<O> {
        if self.run.is_closed() {
            return None;
        }
        let Some(batch) = self.pipeline.next() else {
            if self.pipeline.position() >= self.num_batches {
                // An epoch with nothing (left) to yield is complete as soon as it starts.
                self.run.complete();
            }
            self.close();
            return None;
        };
        let index = self.pipeline.position() - 1;
        self.last = Some(index);
        if index + 1 == self.num_batches {
            let remainder = self.remainder();
            self.run.last_batch(remainder);
        } else {
            self.run.yielded(index + 1);
        }
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.run.is_closed() {
            0
        } else {
            self.num_batches - self.pipeline.position()
        };
        (left, Some(left))
    }
}

impl<B, I, O> DataLoaderIterator<O> for ShardIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn progress(&self) -> Progress {
        Progress::new(
            self.epoch.items_before(self.pipeline.position()),
            self.epoch.num_items(),
        )
    }
}

impl<B, I, O> Drop for ShardIter<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn drop(&mut self) {
        self.close();
    }
}

// ---------------------------------------------------------------------------------------
// The crate's per-process loaders told apart from any other `DataLoader`.
//
// Burn hands a training strategy its loader as `Arc<dyn DataLoader<B, O>>`, a trait with no
// `Any` to downcast through; but every loader implements `to_device`, and a strategy moves
// its training loader to its device anyway. The crate's per-process loaders (`ShardLoader`,
// `StreamLoader`, and the `ProcessSlice` the strategy makes of anyone else's) record on the
// calling thread which process's data they hold when they are moved; a wrapper that forwards
// `to_device` to one of them is per-process too, and records the same.

/// Which process's data one of the crate's per-process loaders holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessShare {
    /// Processes the data was divided between; `None` where the loader does not say.
    pub(crate) num_processes: Option<usize>,
    /// The process whose share it is.
    pub(crate) process_index: usize,
}

thread_local! {
    // The share of the last per-process loader moved on this thread since the last
    // `move_and_identify`.
    static MOVED: Cell<Option<ProcessShare>> = const { Cell::new(None) };
}

/// Records that one of the crate's per-process loaders holding `share` is being moved with
/// `to_device` on this thread.
pub(crate) fn mark_moved(share: ProcessShare) {
    MOVED.with(|moved| moved.set(Some(share)));
}

/// `loader` moved to `device`, and the process share it holds when it is one of the crate's
/// per-process loaders (`None`: a loader of the whole data set, Burn's `DataLoaderBuilder`'s
/// for one).
pub(crate) fn move_and_identify<B: Backend, O>(
    loader: &Arc<dyn DataLoader<B, O>>,
    device: &B::Device,
) -> (Arc<dyn DataLoader<B, O>>, Option<ProcessShare>) {
    MOVED.with(Cell::take);
    let moved = loader.to_device(device);
    (moved, MOVED.with(Cell::take))
}

/// One process's part of a loader of the whole data set, as Burn's multi-device loop splits
/// one (`split_dataloader`), except that every process gets the same number of items, so that
/// every process runs the same number of steps (a process with one step more would wait for
/// the others in its gradient all-reduce forever).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EvenSplit {
    /// The first item of this process's part.
    pub(crate) start: usize,
    /// One past its last item.
    pub(crate) end: usize,
    /// Items at the end of the data set no process reads (fewer than the processes).
    pub(crate) dropped: usize,
}

impl EvenSplit {
    /// Process `process_index`'s contiguous part of `num_items` items over `num_processes`,
    /// in process order, `num_items / num_processes` items each; `None` when there are fewer
    /// items than processes.
    pub(crate) fn of(num_items: usize, num_processes: usize, process_index: usize) -> Option<Self> {
        let each = num_items.checked_div(num_processes)?;
        if each == 0 || process_index >= num_processes {
            return None;
        }
        let start = process_index * each;
        Some(Self {
            start,
            end: start + each,
            dropped: num_items - each * num_processes,
        })
    }
}

/// The part of another loader one process reads: its [`DataLoader::slice`], which records
/// itself as per-process when moved, so that it is not sliced again.
pub(crate) struct ProcessSlice<B: Backend, O> {
    inner: Arc<dyn DataLoader<B, O>>,
    share: ProcessShare,
}

impl<B: Backend, O> ProcessSlice<B, O> {
    /// `inner`, already sliced, as the part of the process `share` names.
    pub(crate) fn new(inner: Arc<dyn DataLoader<B, O>>, share: ProcessShare) -> Self {
        Self { inner, share }
    }
}

impl<B: Backend, O: 'static> DataLoader<B, O> for ProcessSlice<B, O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        self.inner.iter()
    }

    fn num_items(&self) -> usize {
        self.inner.num_items()
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        let inner = self.inner.to_device(device);
        mark_moved(self.share);
        Arc::new(Self::new(inner, self.share))
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(Self::new(self.inner.slice(start, end), self.share))
    }
}

#[cfg(test)]
mod tests {
    use super::EvenSplit;

    #[test]
    fn every_process_gets_as_many_items_in_order_and_the_rest_is_dropped() {
        let parts: Vec<_> = (0..3).map(|p| EvenSplit::of(11, 3, p).unwrap()).collect();
        let ranges: Vec<_> = parts.iter().map(|s| (s.start, s.end)).collect();
        assert_eq!(ranges, [(0, 3), (3, 6), (6, 9)]);
        assert!(parts.iter().all(|s| s.dropped == 2));
        assert_eq!(
            EvenSplit::of(8, 2, 1),
            Some(EvenSplit {
                start: 4,
                end: 8,
                dropped: 0
            })
        );
        assert_eq!(EvenSplit::of(1, 2, 0), None);
        assert_eq!(EvenSplit::of(4, 0, 0), None);
        assert_eq!(EvenSplit::of(4, 2, 2), None);
    }
}
