//! What the strategy saves beside Burn's checkpoint of an epoch, and restores from it: the
//! loss scale, the gradient-state position and the loaders' positions.

use super::fit::Core;
use super::*;
use crate::checkpoint::records::Scheme;

// A loader whose epoch and position a checkpoint holds, whatever its item types. Copies of a
// `ShardLoader` share its position, so the strategy's copy sees what Burn's copy iterates.
pub(super) trait LoaderPosition: Send + Sync {
    fn state(&self) -> LoaderState;
    fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError>;
}

impl<B, I, O> LoaderPosition for ShardLoader<B, I, O>
where
    B: Backend,
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn state(&self) -> LoaderState {
        ShardLoader::state(self)
    }

    fn load_state(&self, state: LoaderState) -> Result<(), DataLoaderError> {
        ShardLoader::load_state(self, state)
    }
}

/// The loss scale, gradient-state position and loader positions saved beside Burn's
/// checkpoint of an epoch (`accelerate-<epoch>.json`), so that a run resumed with
/// `.checkpoint(epoch)` goes on with the scale the interrupted run had reached (instead of
/// overflowing again from the initial one) and with the shuffled order it would have seen.
#[derive(Config, Debug)]
pub struct AccelerateCheckpoint {
    /// The saved state.
    pub state: AcceleratorState,
    /// Where each checkpointed loader was (epoch, position, seeds), in device order; empty
    /// when the strategy tracked none, or in a file written before loaders were saved. With
    /// several processes, the main process's (the others are at the same epoch and position).
    #[config(default = "Vec::new()")]
    pub loaders: Vec<LoaderState>,
    /// The number of processes of the run that wrote it.
    #[config(default = 1)]
    pub num_processes: usize,
}

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
        std::fs::create_dir_all(dir).map_err(|e| AccelerateError::Checkpoint {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        // Written aside and renamed, so that no process reads half of it; a checkpoint of the
        // strategy's that lists it is told what it holds now.
        let bytes = serde_json::to_vec_pretty(self).expect("the strategy's state serialises");
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
        let has_model = |epoch: usize| {
            let prefix = format!("model-{epoch}.");
            names.iter().any(|n| n.starts_with(&prefix))
        };
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
        Self::load(&path)
            .map(Some)
            .map_err(|e| AccelerateError::Checkpoint {
                path: path.display().to_string(),
                reason: e.to_string(),
            })
    }
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

    // The saved loaders' positions restored into the tracked ones.
    pub(super) fn restore_loaders(&self, saved: &[LoaderState]) -> Result<(), AccelerateError> {
        if self.positions.is_empty() {
            if !saved.is_empty() {
                log::warn!(
                    "burn-accelerate: the checkpoint holds {} loader positions but the strategy \
                     tracks no loader: the training loader starts its own first epoch's order \
                     (pass it to `with_checkpointed_loader` to resume where it was)",
                    saved.len()
                );
            }
            return Ok(());
        }
        if saved.is_empty() {
            log::warn!(
                "burn-accelerate: the checkpoint holds no loader position: the loaders restart \
                 at their first epoch's order"
            );
            return Ok(());
        }
        if saved.len() != self.positions.len() {
            return Err(AccelerateError::StateMismatch {
                what: "checkpointed loaders",
                saved: format!("{} loader positions", saved.len()),
                current: format!("{} loaders", self.positions.len()),
            });
        }
        for (position, state) in self.positions.iter().zip(saved) {
            position.load_state(*state)?;
        }
        Ok(())
    }

    // The state Burn's checkpoint of `epoch` was saved with, if any was.
    pub(super) fn restore(&self, epoch: usize) -> Result<Option<LossScale>, AccelerateError> {
        let Some(dir) = &self.checkpoint_dir else {
            return Ok(None);
        };
        let Some(saved) = AccelerateCheckpoint::load_epoch(dir, epoch)? else {
            log::warn!(
                "burn-accelerate: no {} to resume from: the loss scale restarts",
                AccelerateCheckpoint::path(dir, epoch).display()
            );
            return Ok(None);
        };
        let processes = self.process.num_processes();
        if saved.num_processes != processes {
            // Burn checkpoints at the end of an epoch, where every shard's position is 0: the
            // next epoch's order depends on the seed and the epoch only, and the loaders built
            // for this run shard it anew. A position inside an epoch has no such mapping.
            if let Some(inside) = saved.loaders.iter().find(|l| l.position != 0) {
                return Err(AccelerateError::StateMismatch {
                    what: "number of processes",
                    saved: format!(
                        "{} processes, {} batches into epoch {}",
                        saved.num_processes, inside.position, inside.epoch
                    ),
                    current: format!("{processes} processes"),
                });
            }
            log::info!(
                "burn-accelerate: resuming a run of {} processes on {processes}: the data is \
                 sharded anew from the next epoch",
                saved.num_processes
            );
        }
        crate::step::restore_position(
            &self.state,
            &self.initial_scale,
            &saved.state.gradient_state,
            &saved.state.loss_scale,
        )?;
        self.restore_loaders(&saved.loaders)?;
        Ok(Some(saved.state.loss_scale))
    }
}

impl<LC> AccelerateStrategy<LC>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    // Burn's checkpoint of an epoch (with Burn's file checkpointer), and the strategy's own
    // (with a checkpoint directory). Only the main process writes: every process holds the
    // same model, and they share the directory. Sharded, it first gathers the whole optimizer
    // state, so that the checkpoint is the one a stage 0 run writes (every process takes part
    // in the gathering).
    #[allow(clippy::too_many_arguments)] // the pieces of Burn's loop that a checkpoint reads
    pub(super) fn checkpoint_epoch(
        &self,
        epoch: usize,
        learner: &mut Learner<LC>,
        core: &Core<LC>,
        tap: Option<&mut OptimizerTap<LC>>,
        checkpointer: Option<&mut LearningCheckpointer<LC>>,
        records: Option<&mut resume::LearnerTap<LC>>,
        event_store: &EventStoreClient,
    ) {
        let writes = checkpointer.is_some() || self.checkpoint_dir.is_some();
        let own = match (core.sharded(), tap, writes) {
            (Some(_), Some(tap), true) => {
                // Read twice: records need not be `Clone`, and their tensors are shared.
                let own = tap.record(learner, event_store);
                let part = tap.record(learner, event_store);
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
        if !self.process.is_main_process() {
            return;
        }
        if let Some(checkpointer) = checkpointer {
            checkpointer.checkpoint(learner, epoch, event_store);
        }
        if let (Some(dir), Some(records)) = (&self.checkpoint_dir, records) {
            let state = self.checkpoint(*core.loss_scale());
            if let Err(err) =
                self.save_checkpoint(dir, epoch, learner, records, &state, event_store)
            {
                // The checkpoints listed before stay whole: a restart resumes from the newest.
                log::warn!(
                    "burn-accelerate: the checkpoint of epoch {epoch} was not written (a \
                     restart would resume from an earlier one): {err}"
                );
            }
        }
        if let Some(own) = own {
            learner.load_optim(own);
        }
        if let Some(dir) = &self.checkpoint_dir {
            AccelerateCheckpoint::prune(dir, epoch);
        }
    }
}
