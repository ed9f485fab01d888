//! What the strategy saves beside Burn's checkpoint of an epoch, and restores from it: the
//! loss scale, the gradient-state position and the loaders' positions, in the state file both
//! entry points share ([`crate::checkpoint::CheckpointState`]), restored in their one order.

use super::fit::Core;
use super::*;
use crate::checkpoint::CheckpointLayout;
use crate::checkpoint::records::{Scheme, record_error};
use crate::gradient_state::GradientStateSnapshot;

/// The state file of `with_accelerate`'s checkpoints (`accelerate-<epoch>.json`), which Burn's
/// own checkpoints of an epoch also read: the one state file of both entry points.
pub use crate::checkpoint::CheckpointState as AccelerateCheckpoint;
pub(super) use crate::checkpoint::LoaderPosition;

impl AccelerateCheckpoint {
    /// The file that holds epoch `epoch`'s state in `dir`.
    pub fn path(dir: &Path, epoch: usize) -> PathBuf {
        dir.join(Scheme::Strategy.names(epoch).state)
    }

    /// Writes it for `epoch` into `dir`.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when the file cannot be written.
    pub fn save_epoch(&self, dir: &Path, epoch: usize) -> Result<(), AccelerateError> {
        let path = Self::path(dir, epoch);
        std::fs::create_dir_all(dir).map_err(|e| record_error(&path.display().to_string(), e))?;
        // Written aside and renamed, so that no process reads half of it; a checkpoint of the
        // strategy's that lists it is told what it holds now.
        let bytes = self.to_json();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let digest = crate::checkpoint::write_atomic(dir, name.as_deref().unwrap_or(""), &bytes)?;
        crate::checkpoint::Manifest::read(dir)?
            .relisted(epoch, digest)
            .map_or(Ok(()), |manifest| manifest.write(dir))
    }

    /// Deletes the files in `dir` of the epochs before `latest` whose model checkpoint Burn's
    /// checkpointing strategy has deleted from `dir`, unless a checkpoint of the strategy's own
    /// lists them. Does nothing unless `dir` holds Burn's model checkpoint of `latest`
    /// (`model-<latest>.*`): in any other directory there is no way to tell which epochs Burn
    /// kept.
    pub fn prune(dir: &Path, latest: usize) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let names: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        let has_model = |epoch: usize| names.iter().any(|n| is_burns_model(n, epoch));
        if !has_model(latest) {
            return;
        }
        let listed: Vec<usize> = crate::checkpoint::Manifest::read(dir)
            .map(|m| m.checkpoints.iter().map(|c| c.epoch).collect())
            .unwrap_or_default();
        for name in &names {
            if let Some(epoch) = Scheme::Strategy.state_number(name)
                && epoch < latest
                && !has_model(epoch)
                && !listed.contains(&epoch)
            {
                let _ = std::fs::remove_file(dir.join(name));
            }
        }
    }

    /// Reads epoch `epoch`'s state from `dir`; `None` when there is no such file.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when the file exists but cannot be read or parsed.
    pub fn load_epoch(dir: &Path, epoch: usize) -> Result<Option<Self>, AccelerateError> {
        let path = Self::path(dir, epoch);
        if !path.exists() {
            return Ok(None);
        }
        let bytes =
            std::fs::read(&path).map_err(|e| record_error(&path.display().to_string(), e))?;
        Self::from_json(&bytes, &path.display().to_string()).map(Some)
    }
}

/// Whether `name` is a file of Burn's checkpointer's model record of `epoch` (its
/// `FileCheckpointer` names it `model-<epoch>`, and its recorder adds an extension): the epochs
/// Burn keeps decide which strategy-state files stay beside its files.
pub(super) fn is_burns_model(name: &str, epoch: usize) -> bool {
    // A process's file of a sharded checkpoint (`model-N.shard-R-of-W.mpk`) is the strategy's.
    name.starts_with(&format!("model-{epoch}."))
        && crate::checkpoint::sharded::parse_shard_name(name).is_none()
}

// Whether `name` is the strategy state of an epoch whose model Burn's own checkpointer still
// keeps in `dir`: `.checkpoint(epoch)` through Burn's files needs it beside them.
pub(super) fn burn_keeps(dir: &Path, name: &str) -> bool {
    let Some(epoch) = Scheme::Strategy.state_number(name) else {
        return false;
    };
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| is_burns_model(&e.file_name().to_string_lossy(), epoch))
    })
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    // What goes beside Burn's checkpoint.
    pub(super) fn checkpoint(&self, loss_scale: LossScale) -> AccelerateCheckpoint {
        AccelerateCheckpoint {
            state: AcceleratorState {
                loss_scale,
                gradient_state: self.state.snapshot(),
            },
            loaders: self.positions.iter().map(|p| p.state()).collect(),
            num_processes: self.process.num_processes(),
        }
    }

    // The state of the checkpoint of `epoch`, restored as both entry points restore it
    // (`CheckpointState::restore`): the loss scale to go on with. `verified` is the state the
    // resume read with the rest of the strategy's own checkpoint, verified against its
    // manifest; without it (Burn's own checkpoint of an epoch), the state file beside Burn's
    // files, if any was saved.
    pub(super) fn restore(
        &self,
        epoch: usize,
        verified: Option<AccelerateCheckpoint>,
    ) -> Result<Option<LossScale>, AccelerateError> {
        let Some(dir) = &self.checkpoint_dir else {
            return Ok(None);
        };
        let saved = match verified {
            Some(saved) => saved,
            None => match AccelerateCheckpoint::load_epoch(dir, epoch)? {
                Some(saved) => saved,
                None => {
                    log::warn!(
                        "burn-accelerate: no {} to resume from: the loss scale restarts",
                        AccelerateCheckpoint::path(dir, epoch).display()
                    );
                    return Ok(None);
                }
            },
        };
        let loaders: Vec<&dyn LoaderPosition> = self.positions.iter().map(|p| &**p).collect();
        // The fit configured the gradient state with its window before this: a checkpoint of
        // another window is refused, as the `Accelerator`'s `load_state` refuses it.
        let position = |saved: &GradientStateSnapshot, scale: LossScale| {
            crate::step::check_accumulation(
                saved,
                self.state.num_steps(),
                self.state.sync_with_dataloader(),
            )?;
            crate::step::restore_position(&self.state, &self.initial_scale, saved, &scale)
        };
        saved
            .restore(self.process.num_processes(), position, &loaders)
            .map(Some)
    }
}

impl<LC> AccelerateStrategy<LC>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    // Burn's checkpoint of an epoch (with Burn's file checkpointer), and the strategy's own
    // (with a checkpoint directory). With `CheckpointLayout::Sharded` at ZeRO stages 1 to 3
    // on several processes, the strategy's own is written first, by every process, each its
    // own partition's files (`crate::checkpoint::sharded`, as the `Accelerator` writes them).
    // Otherwise only the main process writes: sharded, it first gathers the whole optimizer
    // state (and at stage 3 the model), so that the checkpoint is the one a stage 0 run
    // writes (every process takes part in the gathering); Burn's own files are always whole.
    #[allow(clippy::too_many_arguments)] // the pieces of Burn's loop that a checkpoint reads
    pub(super) fn checkpoint_epoch(
        &self,
        epoch: usize,
        learner: &mut Learner<LC>,
        core: &Core<LC>,
        mut tap: Option<&mut RecordTap<LC>>,
        checkpointer: Option<&mut LearningCheckpointer<LC>>,
        event_store: &EventStoreClient,
    ) {
        let own_sharded =
            self.checkpoint_sharded(epoch, learner, core, tap.as_deref_mut(), event_store);
        let writes = checkpointer.is_some() || (self.checkpoint_dir.is_some() && !own_sharded);
        let own = match (core.sharded(), tap.as_deref_mut(), writes) {
            (Some(_), Some(tap), true) => {
                // Read twice: records need not be `Clone`, and their tensors are shared.
                let read = |tap: &mut RecordTap<LC>| {
                    tap.optimizer(learner, event_store)
                        .unwrap_or_else(|err| fail("cannot read the optimizer state", err))
                };
                let own = read(tap);
                let part = read(tap);
                let whole = core
                    .whole_optimizer_record(&learner.model(), part, &self.device)
                    .unwrap_or_else(|err| fail("cannot gather the optimizer state", err));
                if let Some(whole) = whole {
                    learner.load_optim(whole);
                }
                Some(own)
            }
            _ => None,
        };
        // At ZeRO stage 3 each process holds its slice of every parameter: the model's record
        // is gathered on the main process one parameter at a time (every process sends its
        // slices), and the main process's learner holds the whole model while Burn's
        // checkpointer and the strategy's own read it, then its released model again.
        let sharded = match (core.sharded(), writes) {
            (Some((_, stage)), true) if stage.gathers_whole_model() => core
                .whole_model_record(&learner.model())
                .unwrap_or_else(|err| fail("cannot gather the model", err))
                .map(|whole| {
                    let sharded = learner.model();
                    learner.load_model(whole);
                    sharded
                }),
            _ => None,
        };
        let main = self.process.is_main_process();
        if let (true, Some(checkpointer)) = (main, checkpointer) {
            checkpointer.checkpoint(learner, epoch, event_store);
        }
        if let (Some(dir), false) = (&self.checkpoint_dir, own_sharded) {
            // The main process writes it (its tap reads the learner's records); every process
            // waits for the write, as the `Accelerator`'s save does.
            let learner: &Learner<LC> = learner;
            let write = tap.filter(|_| main).map(|tap| {
                move || {
                    let state = self.checkpoint(*core.loss_scale());
                    self.save_checkpoint(dir, epoch, learner, tap, &state, event_store)
                }
            });
            let written = crate::checkpoint::contents::written_by_main(self.group.as_ref(), write);
            if let Err(err) = written {
                // The checkpoints listed before stay whole: a restart resumes from the newest.
                log::warn!(
                    "burn-accelerate: the checkpoint of epoch {epoch} was not written (a \
                     restart would resume from an earlier one): {err}"
                );
            }
        }
        if !main {
            return;
        }
        if let Some(sharded) = sharded {
            // The placeholders as they were, still registered: nothing is gathered.
            learner.load_model(crate::zero::held_record(sharded));
        }
        if let Some(own) = own {
            learner.load_optim(own);
        }
        if let Some(dir) = &self.checkpoint_dir {
            AccelerateCheckpoint::prune(dir, epoch);
        }
    }

    // The strategy's own checkpoint of `epoch`, sharded, where the layout asks for it and the
    // stage partitions anything over several processes: every process writes its partition's
    // parameters and optimizer state, and the main process the state and the scheduler's
    // record beside them. Whether it did (or tried: a failure is every process's, and is
    // logged); `false` leaves the strategy's checkpoint to the consolidated path.
    fn checkpoint_sharded(
        &self,
        epoch: usize,
        learner: &Learner<LC>,
        core: &Core<LC>,
        tap: Option<&mut RecordTap<LC>>,
        event_store: &EventStoreClient,
    ) -> bool {
        let (Some(dir), Some((group, _)), Some(tap), CheckpointLayout::Sharded) = (
            &self.checkpoint_dir,
            core.sharded(),
            tap,
            self.config.checkpoint_layout,
        ) else {
            return false;
        };
        let (optimizer, scheduler) = tap
            .records(learner, event_store)
            .unwrap_or_else(|err| fail("cannot read the optimizer state", err));
        let names = Scheme::Strategy.names(epoch);
        let scheduler_name = names.scheduler.unwrap_or_default();
        // Only the main process's files beside the shards are written.
        let scheduler = if self.process.is_main_process() {
            crate::checkpoint::records::encode::<TrainingBackend<LC>, _>(scheduler, &scheduler_name)
                .unwrap_or_else(|err| fail("cannot encode the scheduler's record", err))
        } else {
            Vec::new()
        };
        let state = self.checkpoint(*core.loss_scale());
        let written = crate::checkpoint::sharded::write::<TrainingBackend<LC>, _, _>(
            group,
            &self.checkpoints(dir),
            epoch,
            &learner.model(),
            optimizer,
            Scheme::Strategy,
            &state,
            &[(&scheduler_name, &scheduler)],
            |name| burn_keeps(dir, name),
            core.sharded()
                .is_some_and(|(_, stage)| stage.shards_parameters())
                .then_some(&self.device),
        );
        if let Err(err) = written {
            // The checkpoints listed before stay whole: a restart resumes from the newest.
            log::warn!(
                "burn-accelerate: the sharded checkpoint of epoch {epoch} was not written (a \
                 restart would resume from an earlier one): {err}"
            );
        }
        true
    }
}
