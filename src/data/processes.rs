//! The process dimension of building loaders, written once for the indexed and the stream
//! loaders: one loader per device of this process ([`build`]), the loader of one process of
//! a run ([`build_process`], [`build_for`]), and under `dispatch_batches` who reads: the
//! shards of one process share a [`Dispatcher`], and across processes
//! ([`build_dispatching`]) process 0 reads and sends ([`ProcessDispatch`]).
//!
//! A builder only says how the loaders of some processes are made from its source
//! ([`Build::build_with`]); everything else about processes is here.

use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::config::DataLoaderConfig;
use super::dispatch::{Dispatch, Dispatcher, StepSource};
use super::error::DataLoaderError;
use super::process_dispatch::ProcessDispatch;
use super::shard::ShardError;
use crate::distributed::ProcessState;

/// A dispatched shard's reader, over the steps of `S`.
pub(crate) type SharedReader<S> =
    Arc<dyn Dispatch<<S as StepSource>::Epoch, <S as StepSource>::Slice>>;

/// Makes the shared reader of the shards built together, from the source of every process's
/// steps and which processes are built here.
pub(crate) type MakeReader<'a, S> = Box<dyn FnOnce(S, Vec<bool>) -> SharedReader<S> + 'a>;

/// What a loader builder provides to be built for processes.
pub(crate) trait Build {
    /// The loader one process gets.
    type Loader;
    /// The device a loader makes its batches on.
    type Device;
    /// Where the steps come from under `dispatch_batches`.
    type Source: StepSource + 'static;

    /// The configuration.
    fn config(&self) -> &DataLoaderConfig;

    /// Whether the loaders draw a random order (so that separately built processes need a
    /// common `data_seed`).
    fn shuffles(&self) -> bool;

    /// The loaders of `processes` (index and device) out of `num_processes`; under
    /// `dispatch_batches`, their shared reader is made by `reader`.
    ///
    /// # Errors
    /// A [`DataLoaderError`] for an invalid configuration.
    fn build_with(
        &self,
        num_processes: usize,
        processes: Vec<(usize, Self::Device)>,
        reader: MakeReader<'_, Self::Source>,
    ) -> Result<Vec<Self::Loader>, DataLoaderError>;
}

// The shards of one process share one reader.
fn in_process<'a, S>() -> MakeReader<'a, S>
where
    S: StepSource + 'static,
    S::Cursor: Send + 'static,
    S::Slice: Send + 'static,
{
    Box::new(|source, registered| Arc::new(Dispatcher::new(source, registered)))
}

/// One loader per device: `devices.len()` processes, process `i` on `devices[i]`; in a run
/// of several processes (`burn-accelerate launch`), this process's loader, for its one
/// device, as [`build_for`] gives it: the same script shards its data unchanged.
pub(crate) fn build<L>(
    builder: &L,
    devices: &[L::Device],
) -> Result<Vec<L::Loader>, DataLoaderError>
where
    L: Build,
    L::Device: Clone,
    <L::Source as StepSource>::Cursor: Send + 'static,
    <L::Source as StepSource>::Slice: Send + 'static,
{
    let state = ProcessState::from_env()?;
    if state.is_distributed() {
        let [device] = devices else {
            return Err(DataLoaderError::DevicesPerProcess {
                devices: devices.len(),
                process: state.process_index(),
                num_processes: state.num_processes(),
            });
        };
        return Ok(vec![build_for(builder, &state, device.clone())?]);
    }
    let processes = devices.iter().cloned().enumerate().collect();
    builder.build_with(devices.len(), processes, in_process())
}

/// The loader of process `process_index` alone, out of `num_processes`.
pub(crate) fn build_process<L>(
    builder: &L,
    num_processes: usize,
    process_index: usize,
    device: L::Device,
) -> Result<L::Loader, DataLoaderError>
where
    L: Build,
    <L::Source as StepSource>::Cursor: Send + 'static,
    <L::Source as StepSource>::Slice: Send + 'static,
{
    check_seed(builder, num_processes, process_index)?;
    one(builder.build_with(num_processes, vec![(process_index, device)], in_process())?)
}

/// The loader of this process in the run `state` describes.
pub(crate) fn build_for<L>(
    builder: &L,
    state: &ProcessState,
    device: L::Device,
) -> Result<L::Loader, DataLoaderError>
where
    L: Build,
    <L::Source as StepSource>::Cursor: Send + 'static,
    <L::Source as StepSource>::Slice: Send + 'static,
{
    build_process(
        builder,
        state.num_processes(),
        state.process_index(),
        device,
    )
}

/// [`build_for`], with process 0 reading alone and sending the others their slices under
/// `dispatch_batches` in a run of several processes.
pub(crate) fn build_dispatching<L>(
    builder: &L,
    state: &ProcessState,
    device: L::Device,
) -> Result<L::Loader, DataLoaderError>
where
    L: Build,
    <L::Source as StepSource>::Cursor: Send + 'static,
    <L::Source as StepSource>::Slice: Send + Serialize + DeserializeOwned + 'static,
{
    if !(builder.config().dispatch_batches && state.is_distributed()) {
        return build_for(builder, state, device);
    }
    let (num_processes, process) = (state.num_processes(), state.process_index());
    // Checked before joining the group: a wrong configuration costs nothing.
    builder.config().shard_spec(num_processes, process)?;
    check_seed(builder, num_processes, process)?;
    let stream = state.group()?.stream();
    let reader: MakeReader<'_, L::Source> =
        Box::new(move |source, _| Arc::new(ProcessDispatch::new(stream, process, source)));
    one(builder.build_with(num_processes, vec![(process, device)], reader)?)
}

// Separately built processes cannot agree on a seed drawn at random.
fn check_seed<L: Build>(
    builder: &L,
    num_processes: usize,
    process: usize,
) -> Result<(), DataLoaderError> {
    let config = builder.config();
    if builder.shuffles() && config.data_seed.is_none() && num_processes > 1 {
        // Checked after the configuration itself, whose errors say more.
        config.shard_spec(num_processes, process)?;
        return Err(DataLoaderError::MissingDataSeed { num_processes });
    }
    Ok(())
}

fn one<T>(mut loaders: Vec<T>) -> Result<T, DataLoaderError> {
    loaders
        .pop()
        .ok_or(DataLoaderError::Shard(ShardError::ZeroProcesses))
}
