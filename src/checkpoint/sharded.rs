//! A sharded checkpoint ([`CheckpointLayout::Sharded`](super::CheckpointLayout::Sharded)): each
//! process writes its own partition's parameters and optimizer state ([`zero::partition`], at stage
//! 3 too) into the checkpoint directory, and the main process lists every process's files, with
//! their checksums, in one manifest entry once all are on the disk; and the resume, which
//! re-partitions them for any number of processes at any stage.
//!
//! # The files
//!
//! Process `R` of `W` writes `model-N.shard-R-of-W.mpk` (the model's record, Burn's `NamedMpk`,
//! each parameter of its partition with its save mapper applied, every other parameter a tensor of
//! no elements) and `optimizer-N.shard-R-of-W.mpk` (its optimizer state, keyed by each parameter's
//! place in the model's visiting order: ids are drawn per process). At stage 3, where each process
//! holds a slice of every parameter and of its state, each released parameter's slices go to the
//! process whose partition holds it, and the state's slices are joined there, so the files are
//! those stages 1 and 2 write. The main process writes the state file (the `Accelerator`'s
//! `accelerator-N.json`, `with_accelerate`'s `accelerate-N.json`) and the loop's own files
//! (`with_accelerate`'s scheduler record). Each file is written aside, flushed and renamed
//! ([`write_atomic`](super::write_atomic)); each process sends the main one its files' digests (or
//! why it could not write them), and the main process lists the checkpoint only when every process
//! wrote both of its files: a checkpoint missing a process's part is never listed, and the
//! processes all return the same error.
//!
//! # The resume
//!
//! The main process picks the newest checkpoint whose entry lists both files of every process (one
//! written otherwise is incomplete, passed over as a damaged one is) and whose files all verify.
//! Each process then reads only the files holding what it loads ([`keeps`], for both entry points):
//! of the optimizer state at stages 1 and 2 and of the parameters at stage 3, the files of the
//! saved processes whose partitions overlap its new one (on as many processes, its own); every file
//! of what it loads whole (at stage 3 every optimizer file: it keeps its slice of every parameter's
//! state). At stage 3 each process then sends the parameters of its partition to every process,
//! each keeping its slice. A parameter is taken from the file that holds it whole: no index is
//! needed. Before a run, `check_checkpoint_fits` checks the model files against the model from
//! their shapes ([`precheck_model`]).

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Shape, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::contents::Contents;
use super::records::{self, Scheme, record_error};
use super::{CheckpointDir, CheckpointEntry, CheckpointState, FileDigest, LoadedCheckpoint};
use crate::AccelerateError;
use crate::distributed::ProcessGroup;
use crate::zero::{self, ParamStateRecord, Partition};

/// What a shard file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The model's parameters.
    Model,
    /// The optimizer's state.
    Optimizer,
}

impl Part {
    fn prefix(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::Optimizer => "optimizer",
        }
    }
}

/// The name of process `rank`'s file of `part` in checkpoint `number`, of `world` processes.
pub(crate) fn shard_name(part: Part, number: usize, rank: usize, world: usize) -> String {
    format!("{}-{number}.shard-{rank}-of-{world}.mpk", part.prefix())
}

/// The part, checkpoint number, rank and number of processes of a shard file's `name`.
pub(crate) fn parse_shard_name(name: &str) -> Option<(Part, usize, usize, usize)> {
    let (part, rest) = [Part::Model, Part::Optimizer]
        .into_iter()
        .find_map(|part| Some((part, name.strip_prefix(part.prefix())?.strip_prefix('-')?)))?;
    let rest = rest.strip_suffix(".mpk")?;
    let (number, rest) = rest.split_once(".shard-")?;
    let (rank, world) = rest.split_once("-of-")?;
    let (number, rank, world) = (
        number.parse().ok()?,
        rank.parse().ok()?,
        world.parse().ok()?,
    );
    (rank < world).then_some((part, number, rank, world))
}

/// Refuses files of the loop's own (`own`) named as a shard file. Every process calls it
/// before writing, so that all refuse alike.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the first such file.
pub(crate) fn refuse_shard_names(own: &[(&str, &[u8])]) -> Result<(), AccelerateError> {
    match own
        .iter()
        .find(|(name, _)| parse_shard_name(name).is_some())
    {
        Some((name, _)) => Err(record_error(
            name,
            "named as a process's file of a sharded checkpoint: give it another name",
        )),
        None => Ok(()),
    }
}

/// Whether checkpoint `entry` is whole as a sharded one: where it lists any shard file, it
/// lists both files of every process, of one number of processes. A consolidated checkpoint
/// (no shard file) passes.
///
/// # Errors
/// Which file is missing, in words.
pub(crate) fn complete(entry: &CheckpointEntry) -> Result<(), String> {
    let shards: Vec<(Part, usize, usize)> = entry
        .files
        .iter()
        .filter_map(|file| parse_shard_name(&file.name))
        .filter(|&(_, number, _, _)| number == entry.epoch)
        .map(|(part, _, rank, world)| (part, rank, world))
        .collect();
    let Some(&(_, _, world)) = shards.first() else {
        return Ok(());
    };
    for part in [Part::Model, Part::Optimizer] {
        for rank in 0..world {
            if !shards.contains(&(part, rank, world)) {
                return Err(format!(
                    "it lists no {}: process {rank}'s part of the sharded checkpoint is \
                     missing, so the checkpoint is incomplete",
                    shard_name(part, entry.epoch, rank, world)
                ));
            }
        }
    }
    if let Some((part, rank, other)) = shards.iter().find(|(_, _, w)| *w != world) {
        return Err(format!(
            "it lists {} beside files of {world} processes",
            shard_name(*part, entry.epoch, *rank, *other)
        ));
    }
    Ok(())
}

/// What a resume of `model` at ZeRO `stage` across `group` (none: one process) reads of a
/// checkpoint, for both entry points: the files ([`keeps`], for this process's rank and the
/// group's size) and whether the parameters are sharded (stage 3 on several processes: the
/// model files of its partition alone, and every optimizer file, each process keeping its
/// slice of every parameter, as [`read`] takes them).
pub(crate) fn resume_reads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    group: Option<&ProcessGroup>,
    stage: zero::ZeroStage,
) -> (impl Fn(&str) -> bool + Clone + use<B, M>, bool) {
    let (rank, world) = group.map_or((0, 1), |g| (g.rank(), g.world_size()));
    let (shards_state, shards_parameters) = read_by_partition(stage, zero::shards(stage, group));
    let keep = keeps::<B, M>(model, rank, world, shards_state, shards_parameters);
    (keep, shards_parameters)
}

/// Which parts of a sharded checkpoint a process resuming at `stage` reads by its partition
/// alone, where the stage shards anything across the processes (`shards`: `zero::shards`):
/// the optimizer state's (stages 1 and 2: each process steps its partition), the
/// parameters' (stage 3: each process loads its partition's parameters and sends each to
/// every process to slice). At stage 3 every optimizer file is read: each process keeps a
/// slice of every parameter's state. Where nothing is sharded, everything.
fn read_by_partition(stage: zero::ZeroStage, shards: bool) -> (bool, bool) {
    let shards_parameters = shards && stage.shards_parameters();
    (shards && !shards_parameters, shards_parameters)
}

/// Which files of a checkpoint process `rank` of `world` reads to resume `model` (every file
/// that is not a shard's; of the shard files, those holding what it loads), for both entry
/// points: a shard file of process `S` of `W` holds the parameters, and their optimizer state,
/// that the partition of `model` over `W` processes gives to `S` (the one the writers computed,
/// from the same model); this process loads of the optimizer state its own partition's where
/// the state is sharded (`shards_state`) and of the parameters its own partition's where they
/// are (`shards_parameters`: ZeRO stage 3, which sends each to every process to slice),
/// everything otherwise. So on as
/// many processes as saved, a process reads its own files; on another number, the files of the
/// processes whose partitions overlap its own. A process that loads no optimizer state at all
/// (it owns no parameter) reads process 0's optimizer file, for a record of the optimizer's
/// type to load, and keeps none of its state.
pub(crate) fn keeps<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    rank: usize,
    world: usize,
    shards_state: bool,
    shards_parameters: bool,
) -> impl Fn(&str) -> bool + Clone + use<B, M> {
    let sizes: std::sync::Arc<[usize]> = lazy_shapes::<B, M>(model)
        .into_iter()
        .map(|(_, shape)| shape.num_elements())
        .collect();
    let own: std::sync::Arc<[bool]> = zero::partition(&sizes, world)
        .into_iter()
        .map(|owner| owner == rank)
        .collect();
    move |name| match parse_shard_name(name) {
        None => true,
        Some((part, _, saved_rank, saved_world)) => {
            let sharded = match part {
                Part::Model => shards_parameters,
                Part::Optimizer => shards_state,
            };
            let wanted = |place: usize| !sharded || own[place];
            let holds_wanted = zero::partition(&sizes, saved_world)
                .into_iter()
                .enumerate()
                .any(|(place, owner)| owner == saved_rank && wanted(place));
            holds_wanted
                || (part == Part::Optimizer && saved_rank == 0 && !(0..own.len()).any(wanted))
        }
    }
}

/// Which files of the checkpoint it picks the start-up check (`precheck`) of process `rank` of
/// `world` keeps for the resume (issue 48): every file that is not a shard's (the state, the
/// loop's own files, a consolidated checkpoint's records), and of a sharded checkpoint only
/// the shard files the process surely reads whatever its model, which is not known yet: its
/// own (`*.shard-R-of-W.mpk`) where `world` is the number of processes that saved it, as the
/// partition is then computed over as many processes from the same model ([`keeps`]), and
/// none otherwise. The others are verified without being held, and read at the resume (or by
/// `check_checkpoint_fits`) only as they verified; a stage 3 process so never holds more of
/// the model and its optimizer state than its partition's at start-up.
pub(crate) fn kept_at_start_up(rank: usize, world: usize) -> impl Fn(&str) -> bool + Clone {
    move |name| match parse_shard_name(name) {
        None => true,
        Some((_, _, saved_rank, saved_world)) => saved_world == world && saved_rank == rank,
    }
}

/// The number of processes sharded checkpoint `loaded` was saved by (`None` for a
/// consolidated one), from its files held or verified without keeping them.
fn saved_world(loaded: &LoadedCheckpoint) -> Option<usize> {
    loaded.names().find_map(|name| {
        let (_, number, _, world) = parse_shard_name(name)?;
        (number == loaded.epoch).then_some(world)
    })
}

/// Whether `loaded` (checkpoint `loaded.epoch`) is a sharded checkpoint, from its files held
/// or verified without keeping them.
pub(crate) fn is_sharded(loaded: &LoadedCheckpoint) -> bool {
    loaded
        .names()
        .any(|name| parse_shard_name(name).is_some_and(|(_, number, _, _)| number == loaded.epoch))
}

/// The checkpoint a resume would choose in `dir`, checked before a run starts (issue 49) as
/// [`contents::precheck_loaded`](super::contents::precheck_loaded) says: the newest whose
/// files verify (a newer one that does not, or a sharded one missing a process's file, is
/// passed over with a warning, as at the resume); a sharded one is not looked for the model's
/// and the optimizer's records of its own. Of the files of the one picked, process `rank` of
/// `world` keeps those [`kept_at_start_up`] names; the others are streamed through the hash
/// and not held. `None` when none is listed.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the manifest (unreadable, or no listed checkpoint
/// verifies), or what [`contents::precheck_loaded`](super::contents::precheck_loaded) returns.
pub(crate) fn precheck(
    dir: &std::path::Path,
    scheme: Scheme,
    rank: usize,
    world: usize,
) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
    let keep = kept_at_start_up(rank, world);
    let Some(loaded) = CheckpointDir::new(dir).load_newest_where(None, complete, keep)? else {
        return Ok(None);
    };
    let records_listed = !is_sharded(&loaded);
    super::contents::precheck_loaded(dir, loaded, scheme, records_listed).map(Some)
}

/// [`contents::precheck_model`](super::contents::precheck_model) of a checkpoint of either
/// layout: a sharded one's model files are checked to be one partition of `model`, each
/// parameter of its shape in its owner's file ([`fits::check_shards`](super::fits::check_shards)),
/// from their shapes alone (a file not held read from `dir`, one at a time).
///
/// # Errors
/// As [`contents::precheck_model`](super::contents::precheck_model), naming the process's
/// model file (its path in `dir`) and the parameter, for a sharded checkpoint.
pub(crate) fn precheck_model<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
    dir: &std::path::Path,
    loaded: &LoadedCheckpoint,
    scheme: Scheme,
    model: &M,
    device: &B::Device,
) -> Result<(), AccelerateError> {
    let Some(world) = saved_world(loaded) else {
        return super::contents::precheck_model::<B, M>(dir, loaded, scheme, model, device);
    };
    let files: Vec<String> = (0..world)
        .map(|rank| shard_name(Part::Model, loaded.epoch, rank, world))
        .collect();
    super::fits::check_shards::<B, M>(dir, loaded, &files, model).map_err(|err| match err {
        AccelerateError::Checkpoint { path, reason } => {
            record_error(&dir.join(path).display().to_string(), reason)
        }
        other => other,
    })
}

// What each process tells the main one once it wrote its files.
#[derive(Serialize, Deserialize)]
enum Written {
    Files(Vec<FileDigest>),
    Failed(String),
}

/// Writes checkpoint `number` of `dir` sharded: this process's partition of `model`'s
/// parameters and its optimizer state `optimizer` (this process's part), and on the main
/// process `state` (under `scheme`'s name: the `Accelerator`'s or `with_accelerate`'s) and
/// the loop's `own` files, listed once every process wrote its files; the files of dropped
/// checkpoints for which `spare` says so stay on disk. Every process of `group` must call it
/// at the same point, between steps. `sliced`: at ZeRO stage 3, the device on which the
/// processes' slices of the optimizer state are joined into each partition's whole.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] on every process when any process could not write its files
/// or the main one could not list them (the checkpoints listed before stay whole: the new one
/// is not listed); [`AccelerateError::Distributed`] when a process left.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write<B, M, R>(
    group: &ProcessGroup,
    dir: &CheckpointDir,
    number: usize,
    model: &M,
    optimizer: R,
    scheme: Scheme,
    state: &CheckpointState,
    own: &[(&str, &[u8])],
    spare: impl Fn(&str) -> bool,
    sliced: Option<&B::Device>,
) -> Result<(), AccelerateError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let (rank, world) = (group.rank(), group.world_size());
    let partition = Partition::of::<B, M>(model, world);
    // At stage 3 each process holds its slices of every parameter's state: the files hold
    // each partition's whole, as stages 1 and 2 write them.
    let optimizer = match sliced {
        Some(device) => zero::keyed_by_id::<B, M, R>(
            model,
            zero::own_whole_state::<B, M, R>(group, model, optimizer, &partition, device)?,
        )
        .map_err(|reason| AccelerateError::OptimizerState { reason })?,
        None => optimizer,
    };
    // The parameters each process writes, gathered to it where they are released (stage 3).
    let model_record = zero::own_model_record::<B, M>(model, &partition, rank, Some(group))?;
    let written =
        match write_own::<B, M, R>(dir, number, model, model_record, optimizer, rank, world) {
            Ok(files) => Written::Files(files),
            Err(err) => Written::Failed(format!("process {rank}: {err}")),
        };
    // Every process's files (torch's `all_gather_object`): the main one lists them all.
    let everyone = group.all_gather_object(&written)?;
    let failure = if rank == 0 {
        let mut files = Vec::new();
        let mut failures = Vec::new();
        for written in everyone {
            match written {
                Written::Files(own) => files.extend(own),
                Written::Failed(why) => failures.push(why),
            }
        }
        if failures.is_empty() {
            commit(dir, number, scheme, state, own, files, &spare).err()
        } else {
            Some(format!(
                "not listed, as a process could not write its part ({})",
                failures.join("; ")
            ))
        }
    } else {
        None
    };
    // Every process returns what the main one did: nobody goes on (and maybe fails, and
    // restarts) before the checkpoint is listed.
    match group.broadcast_object(&failure, 0)? {
        None => Ok(()),
        Some(reason) => Err(record_error(
            &dir.path().display().to_string(),
            format!("the sharded checkpoint {number}: {reason}"),
        )),
    }
}

// This process's two files, written into `dir`.
fn write_own<B, M, R>(
    dir: &CheckpointDir,
    number: usize,
    model: &M,
    model_record: M::Record,
    optimizer: R,
    rank: usize,
    world: usize,
) -> Result<Vec<FileDigest>, AccelerateError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    R: ParamStateRecord<B>,
{
    let model_name = shard_name(Part::Model, number, rank, world);
    let optimizer_name = shard_name(Part::Optimizer, number, rank, world);
    let model_bytes = records::encode::<B, _>(model_record, &model_name)?;
    let optimizer_bytes = records::encode::<B, _>(
        zero::keyed_by_place::<B, M, R>(model, optimizer),
        &optimizer_name,
    )?;
    std::fs::create_dir_all(dir.path())
        .map_err(|e| record_error(&dir.path().display().to_string(), e))?;
    Ok(vec![
        super::write_atomic(dir.path(), &model_name, &model_bytes)?,
        super::write_atomic(dir.path(), &optimizer_name, &optimizer_bytes)?,
    ])
}

// The main process's part: the state and the loop's files written, and the checkpoint listed
// with every process's files.
fn commit(
    dir: &CheckpointDir,
    number: usize,
    scheme: Scheme,
    state: &CheckpointState,
    own: &[(&str, &[u8])],
    written: Vec<FileDigest>,
    spare: impl Fn(&str) -> bool,
) -> Result<(), String> {
    let names = scheme.names(number);
    let state = state.to_json();
    let mut files: Vec<(&str, &[u8])> = vec![(&names.state, &state)];
    files.extend_from_slice(own);
    dir.save_with_written(number, &files, written, spare)
        .map(|_| ())
        .map_err(|err| err.to_string())
}

/// Reads sharded checkpoint `loaded` (its state file, named by `scheme`, and the shard files this
/// process kept: [`keeps`]) into `model` and an optimizer record keyed by `model`'s ids, for
/// process `rank` of `world`: where `shards_parameters` (stage 3 on several processes) only the
/// parameters of this process's partition are loaded, each sent to every process to keep its slice
/// (`zero::release_loaded`), and `model` comes back released (every parameter gathered from the
/// slices at its use, as after a step).
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the file that does not decode, or the parameter no
/// file holds (of its shape).
pub(crate) fn read<B, M, O>(
    mut loaded: LoadedCheckpoint,
    scheme: Scheme,
    model: M,
    group: Option<&ProcessGroup>,
    shards_parameters: bool,
    device: &B::Device,
) -> Result<Contents<M, O, ()>, AccelerateError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: ParamStateRecord<B>,
{
    let number = loaded.epoch;
    let names = scheme.names(number);
    let state = CheckpointState::from_json(&records::file(&loaded, &names.state)?, &names.state)?;
    let shard_files: Vec<(Part, String)> = loaded
        .files
        .keys()
        .filter_map(|name| {
            let (part, saved, _, _) = parse_shard_name(name)?;
            (saved == number).then(|| (part, name.clone()))
        })
        .collect();
    let (world, rank) = group.map_or((1, 0), |g| (g.world_size(), g.rank()));
    let partition = Partition::of::<B, M>(&model, world);
    let (ids, shapes): (Vec<ParamId>, Vec<Shape>) = lazy_shapes::<B, M>(&model).into_iter().unzip();
    let wanted: Vec<bool> = ids
        .iter()
        .map(|id| !shards_parameters || partition.owner(*id) == rank)
        .collect();

    // The parameters: each from the file that holds it whole.
    let mut values: Vec<Option<TensorData>> = vec![None; shapes.len()];
    for (_, name) in shard_files.iter().filter(|(part, _)| *part == Part::Model) {
        let record = records::decode::<B, M::Record>(&loaded, name, device)?;
        let bare = model.clone().map(&mut Bare).load_record(record);
        let mut collect = Collect {
            shapes: &shapes,
            wanted: &wanted,
            values: &mut values,
            place: 0,
        };
        bare.visit(&mut collect);
        loaded.files.remove(name);
    }
    if let Some(place) = (0..shapes.len()).find(|&p| wanted[p] && values[p].is_none()) {
        return Err(record_error(
            &names.state,
            format!(
                "no file of the sharded checkpoint {number} holds parameter #{place} (in the \
                 model's visiting order) of shape {:?}: the checkpoint is of another model",
                shapes[place]
            ),
        ));
    }
    let mut model = model.map(&mut Load {
        values: &mut values,
        place: 0,
        device,
    });

    // The optimizer's state: every part read, keyed by this model's ids again.
    let mut optimizer: Option<O> = None;
    for (_, name) in shard_files
        .iter()
        .filter(|(part, _)| *part == Part::Optimizer)
    {
        let part = records::decode::<B, O>(&loaded, name, device)?;
        let part = zero::keyed_by_id::<B, M, O>(&model, part).map_err(|e| record_error(name, e))?;
        optimizer = Some(match optimizer {
            Some(whole) => whole.merge(part),
            None => part,
        });
        loaded.files.remove(name);
    }
    let optimizer = optimizer.ok_or_else(|| {
        record_error(
            &names.state,
            "the sharded checkpoint lists no optimizer file this process reads",
        )
    })?;
    if let Some(group) = group.filter(|_| shards_parameters) {
        model = zero::release_loaded(group, model, &partition)?;
    }
    loaded.files.remove(&names.state);
    Ok(Contents {
        number,
        state,
        model,
        optimizer,
        scheduler: None,
        files: loaded.files,
    })
}

// Each float parameter's id and shape, in visiting order, without reading it.
fn lazy_shapes<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M) -> Vec<(ParamId, Shape)> {
    struct Shapes(Vec<(ParamId, Shape)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.id, param.lazy_shape()));
        }
    }
    let mut shapes = Shapes(Vec::new());
    model.visit(&mut shapes);
    shapes.0
}

// Every parameter a value of one element and no mappers, without reading it: what a shard's
// record is loaded into, so that its values are read as saved (the load mappers run once, on
// the model resumed). One element, not none: Burn loads no record into an optional module
// without parameters (`Option<Param>`'s `load_record` keeps a module whose count is 0).
struct Bare;

impl<B: AutodiffBackend> ModuleMapper<B> for Bare {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        Param::initialized(param.id, Tensor::empty([1; D], &param.lazy_device()))
    }
}

// Takes from a loaded shard each wanted parameter it holds whole (of the model's shape).
struct Collect<'a> {
    shapes: &'a [Shape],
    wanted: &'a [bool],
    values: &'a mut [Option<TensorData>],
    place: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let place = self.place;
        self.place += 1;
        let (Some(shape), Some(wanted)) = (self.shapes.get(place), self.wanted.get(place)) else {
            return;
        };
        if !*wanted || self.values[place].is_some() {
            return;
        }
        let value = param.val();
        if value.shape() == *shape {
            self.values[place] = Some(value.into_data());
        }
    }
}

// Loads each collected value into its parameter (with the model's load mapper), leaving the
// others as they are (released right after, at stage 3).
struct Load<'a, B: AutodiffBackend> {
    values: &'a mut [Option<TensorData>],
    place: usize,
    device: &'a B::Device,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Load<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let place = self.place;
        self.place += 1;
        match self.values.get_mut(place).and_then(Option::take) {
            Some(data) => {
                let id = param.id;
                param.transform_for_load(Tensor::from_data(data, self.device), id)
            }
            None => param,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(epoch: usize, names: &[String]) -> CheckpointEntry {
        CheckpointEntry {
            epoch,
            files: names
                .iter()
                .map(|n| FileDigest::of(n.clone(), b""))
                .collect(),
        }
    }

    #[test]
    fn shard_names_read_back_and_other_names_are_not_shards() {
        let name = shard_name(Part::Optimizer, 12, 1, 3);
        assert_eq!(name, "optimizer-12.shard-1-of-3.mpk");
        assert_eq!(parse_shard_name(&name), Some((Part::Optimizer, 12, 1, 3)));
        assert_eq!(
            parse_shard_name(&shard_name(Part::Model, 0, 0, 1)),
            Some((Part::Model, 0, 0, 1))
        );
        for other in [
            "model-12.mpk",
            "accelerator-12.json",
            "model-12.shard-3-of-3.mpk",
            "model-x.shard-0-of-1.mpk",
            "loader.json",
        ] {
            assert_eq!(parse_shard_name(other), None, "{other}");
        }
        let own: &[(&str, &[u8])] = &[("model-3.shard-0-of-2.mpk", b"")];
        assert!(refuse_shard_names(own).is_err());
        assert!(refuse_shard_names(&[("loader.json", b"")]).is_ok());
    }

    #[test]
    fn a_sharded_checkpoint_missing_a_process_file_is_incomplete() {
        let all: Vec<String> = [Part::Model, Part::Optimizer]
            .into_iter()
            .flat_map(|part| (0..3).map(move |rank| shard_name(part, 4, rank, 3)))
            .chain(["accelerator-4.json".to_string()])
            .collect();
        assert_eq!(complete(&entry(4, &all)), Ok(()));
        assert_eq!(
            complete(&entry(4, &["model-4.mpk".to_string()])),
            Ok(()),
            "a consolidated one"
        );
        let without: Vec<String> = all
            .iter()
            .filter(|n| **n != shard_name(Part::Optimizer, 4, 2, 3))
            .cloned()
            .collect();
        let err = complete(&entry(4, &without)).unwrap_err();
        assert!(
            err.contains("optimizer-4.shard-2-of-3.mpk") && err.contains("incomplete"),
            "{err}"
        );
        let mut mixed = all.clone();
        mixed.push(shard_name(Part::Model, 4, 0, 2));
        assert!(complete(&entry(4, &mixed)).is_err());
    }

    // Issue 48: the start-up check keeps a process's own shard files on as many processes as
    // saved them, none on another number, and every other file.
    #[test]
    fn the_start_up_check_keeps_a_process_own_shards_on_as_many_processes_alone() {
        let shards = |keep: &dyn Fn(&str) -> bool| -> Vec<String> {
            [Part::Model, Part::Optimizer]
                .into_iter()
                .flat_map(|part| (0..2).map(move |rank| shard_name(part, 3, rank, 2)))
                .filter(|name| keep(name))
                .collect()
        };
        let keep = kept_at_start_up(1, 2);
        assert_eq!(
            shards(&keep),
            [
                shard_name(Part::Model, 3, 1, 2),
                shard_name(Part::Optimizer, 3, 1, 2)
            ]
        );
        for other in [kept_at_start_up(0, 3), kept_at_start_up(0, 1)] {
            assert!(shards(&other).is_empty());
            assert!(other("accelerate-3.json") && other("accelerate-3-scheduler.mpk"));
            assert!(other("accelerate-3-model.mpk") && other("model-3.mpk"));
        }
    }

    // Parameters of 10, 40, 30 and 20 values: over 2 processes [0, 0, 1, 1], over 3
    // [2, 0, 1, 2] (`zero::partition`, largest first to the least loaded).
    #[cfg(feature = "flex")]
    fn four_parameters() -> Vec<Param<Tensor<burn::backend::Autodiff<burn::backend::Flex>, 1>>> {
        [10, 40, 30, 20]
            .into_iter()
            .map(|n| Param::from_tensor(Tensor::zeros([n], &Default::default())))
            .collect()
    }

    #[cfg(feature = "flex")]
    #[test]
    fn a_process_reads_the_files_that_hold_its_partition() {
        type B = burn::backend::Autodiff<burn::backend::Flex>;
        let model = four_parameters();
        let model_file = |rank: usize, world: usize| shard_name(Part::Model, 1, rank, world);
        let optimizer = |rank: usize, world: usize| shard_name(Part::Optimizer, 1, rank, world);
        let read = |keep: &dyn Fn(&str) -> bool, name: fn(usize, usize) -> String| {
            (0..2).filter(|&r| keep(&name(r, 2))).collect::<Vec<_>>()
        };
        // Both parts by partition, on as many processes: its own files alone.
        let keep = keeps::<B, _>(&model, 1, 2, true, true);
        assert_eq!(read(&keep, model_file), [1]);
        assert_eq!(read(&keep, optimizer), [1]);
        assert!(keep("accelerator-1.json") && keep("loader.json"));
        // Stages 1 and 2: every model file (the parameters are whole on every process).
        let keep = keeps::<B, _>(&model, 1, 2, true, false);
        assert_eq!(read(&keep, model_file), [0, 1]);
        assert_eq!(read(&keep, optimizer), [1]);
        // Saved on 2, resumed on 3 with both parts by partition: process 0 owns the 40 (saved
        // by process 0), process 1 the 30 (saved by process 1), process 2 the 10 and the 20
        // (one each).
        for (rank, files) in [(0, vec![0usize]), (1, vec![1]), (2, vec![0, 1])] {
            let keep = keeps::<B, _>(&model, rank, 3, true, true);
            assert_eq!(read(&keep, model_file), files, "process {rank} of 3");
            assert_eq!(read(&keep, optimizer), files, "process {rank} of 3");
            let keep = keeps::<B, _>(&model, rank, 3, true, false);
            assert_eq!(read(&keep, model_file), [0, 1], "process {rank} of 3");
        }
        // Stage 0, or one process: everything.
        for keep in [
            keeps::<B, _>(&model, 0, 2, false, false),
            keeps::<B, _>(&model, 0, 1, true, true),
        ] {
            assert_eq!(read(&keep, model_file), [0, 1]);
            assert_eq!(read(&keep, optimizer), [0, 1]);
        }
        // Which parts each stage reads by partition: at stage 3 the parameters' alone (every
        // optimizer file: each process keeps a slice of every parameter's state).
        use crate::zero::ZeroStage;
        assert_eq!(read_by_partition(ZeroStage::None, false), (false, false));
        assert_eq!(
            read_by_partition(ZeroStage::OptimizerState, true),
            (true, false)
        );
        assert_eq!(read_by_partition(ZeroStage::Gradients, true), (true, false));
        assert_eq!(
            read_by_partition(ZeroStage::Parameters, true),
            (false, true)
        );
        assert_eq!(
            read_by_partition(ZeroStage::Parameters, false),
            (false, false)
        );
        let keep = keeps::<B, _>(&model, 1, 2, false, true);
        assert_eq!(read(&keep, model_file), [1]);
        assert_eq!(read(&keep, optimizer), [0, 1]);
        // A process owning no parameter (5 processes, 4 parameters): no model file, and
        // process 0's optimizer file alone, for a record to load.
        let keep = keeps::<B, _>(&model, 4, 5, true, true);
        assert_eq!(read(&keep, model_file), Vec::<usize>::new());
        assert_eq!(read(&keep, optimizer), [0]);
    }
}
