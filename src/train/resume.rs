//! The strategy's own checkpoints, and resuming from them without code of the user's.
//!
//! With [`AccelerateStrategy::with_checkpoint_dir`], the main process writes, after each epoch, a
//! crash-safe checkpoint into the directory ([`crate::checkpoint`]): the model's, the optimizer's
//! (whole, under ZeRO) and the scheduler's records, in full precision
//! (`accelerate-<epoch>-{model,optim,scheduler}.mpk`, Burn's `NamedMpk` format), and the strategy's
//! state beside them (`accelerate-<epoch>.json`: the loss scale, the gradient state, the loaders'
//! positions). With `CheckpointLayout::Sharded` at ZeRO stages 1 to 3 on several processes, each
//! process writes its partition's model and optimizer files instead
//! (`{model,optimizer}-<epoch>.shard-R-of-W.mpk`, through [`crate::checkpoint::sharded`], the
//! `Accelerator`'s writer) and the main process the scheduler's record and the state; on resume
//! each process reads, as the `Accelerator`'s does (`sharded::resume_reads`), the model files
//! holding its partition's parameters at ZeRO stage 3 (each sent to every process, which keeps its
//! slice: the model comes back released, and the fit keeps it so from its start) and every model
//! file at other stages (each parameter from the one that holds it), and the optimizer files
//! holding its partition's state at stages 1 and 2 (every one otherwise, at stage 3 too: it keeps a
//! slice of every parameter's state), which the fit then splits for this run's processes and stage
//! as a consolidated checkpoint's. They are the strategy's and not Burn's checkpointer's because
//! Burn's `FileCheckpointer` writes in place, on threads of its own, with nothing that says when a
//! file is whole: a crash in the middle leaves a torn file under its final name.
//!
//! What a checkpoint holds and the order it is read back in are the same as for the
//! `Accelerator`'s ([`crate::checkpoint::contents`]); this module is the strategy's adapter:
//! Burn's `Learner` gives its optimizer's and scheduler's records only to a checkpointer, and
//! the strategy reaches them through one ([`super::tap`]).
//!
//! When a training starts, the main process picks the newest checkpoint whose files verify
//! (passing over, with a warning, damaged newer ones), tells the others which, and every
//! process reads and checks that one (or takes the copy `try_with_checkpoint_dir` read and
//! verified, when it is that one: its files are not read twice, and its state, not the file
//! on disk, gives the loss scale and the loaders' positions), then loads it through Burn's own
//! resume path (`LearningCheckpointer::load_checkpoint`, what
//! `SupervisedTraining::checkpoint(epoch)` runs), then trains from the next epoch. The steps
//! taken after that checkpoint by the run that stopped are redone: the loaders' saved positions
//! and seeds give the same batches in the same order, so they are the same steps, and the run
//! ends where an uninterrupted one does, bit for bit.

use std::path::Path;
use std::sync::PoisonError;

use burn::module::Module;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Learner, LearnerOptimizerRecord, LearnerSchedulerRecord, LearningComponentsTypes,
    TrainingBackend, TrainingComponents,
};

use super::checkpoint::burn_keeps;
use super::tap::{self, RecordTap};
use super::{AccelerateCheckpoint, AccelerateStrategy, fail};
use crate::AccelerateError;
use crate::checkpoint::contents::{self, Records, Resume};
use crate::checkpoint::records::{Scheme, record_error};
use crate::checkpoint::{CheckpointDir, LoadedCheckpoint, Manifest, sharded};
use crate::zero::ParamStateRecord;

/// How the strategy keeps and uses its checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ResumeSettings {
    /// Resume from the newest complete checkpoint when none is asked for.
    pub(super) auto: bool,
    /// Checkpoints kept.
    pub(super) keep: usize,
}

impl Default for ResumeSettings {
    fn default() -> Self {
        Self {
            auto: true,
            keep: 2,
        }
    }
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    /// Resumes from the newest complete checkpoint in the checkpoint directory when the
    /// training starts (the default), or starts afresh every time (`false`). Either way, a
    /// training given Burn's `.checkpoint(epoch)` resumes from that epoch.
    pub fn with_auto_resume(mut self, auto: bool) -> Self {
        self.resume.auto = auto;
        self
    }

    /// Keeps the newest `keep` checkpoints in the checkpoint directory (2 by default, as
    /// Burn's checkpointer; 0 is taken as 1). A damaged newest checkpoint falls back to an
    /// older one only while one is kept.
    pub fn with_checkpoints_kept(mut self, keep: usize) -> Self {
        self.resume.keep = keep.max(1);
        self
    }

    pub(super) fn checkpoints(&self, dir: &Path) -> CheckpointDir {
        CheckpointDir::new(dir).with_keep_last(self.resume.keep)
    }

    /// Writes epoch `epoch`'s crash-safe checkpoint into `dir` (the main process's part of a
    /// checkpoint: the learner holds the whole optimizer state here).
    pub(super) fn save_checkpoint(
        &self,
        dir: &Path,
        epoch: usize,
        learner: &Learner<LC>,
        tap: &mut RecordTap<LC>,
        state: &AccelerateCheckpoint,
        store: &EventStoreClient,
    ) -> Result<(), AccelerateError> {
        let (optim, scheduler) = tap.records(learner, store)?;
        let records =
            Records::encode::<TrainingBackend<LC>, _, _>(learner.model().into_record(), optim)?
                .with_scheduler::<TrainingBackend<LC>, _>(scheduler)?;
        contents::write(
            &self.checkpoints(dir),
            Scheme::Strategy,
            epoch,
            state,
            &records,
            &[],
            |name| burn_keeps(dir, name),
        )
    }

    /// Before Burn's `train` runs: the epoch the training resumes from, from the strategy's
    /// checkpoints, with its state (verified with the rest of the checkpoint) and `learner`
    /// loaded from it (through Burn's `load_checkpoint`); `None` to start afresh, or to let
    /// Burn load its own files (an epoch asked for with `.checkpoint(epoch)` that only Burn's
    /// checkpointer has). The checkpoint the start-up check verified, if any, is loaded from
    /// memory when it is the one picked.
    pub(super) fn resume_before_fit(
        &self,
        learner: Learner<LC>,
        components: &mut TrainingComponents<LC>,
    ) -> (Learner<LC>, Option<(usize, AccelerateCheckpoint)>)
    where
        LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
    {
        // Taken whatever happens: its bytes are not needed past the resume.
        let held = self
            .verified
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(dir) = &self.checkpoint_dir else {
            return (learner, None);
        };
        let asked = components.checkpoint;
        if asked.is_none() && !self.resume.auto {
            return (learner, None);
        }
        let checkpoints = self.checkpoints(dir);
        // The model is checked against the record (Burn's load_checkpoint loads a record of
        // another model without a word) and every record against what Burn would panic on,
        // before any of it is loaded. Of a sharded checkpoint (`CheckpointLayout::Sharded`)
        // each process reads the files the `Accelerator`'s resume reads (`sharded::resume_reads`):
        // at ZeRO stage 3 the model files holding its partition's parameters (each sent to
        // every process to slice: the model comes back released, as the fit keeps it from its
        // start), at other stages every model file; of the optimizer files those holding the
        // state of its partition at stages 1 and 2 (the fit keeps its partition's alone), every
        // one otherwise (at stage 3 the fit keeps its slice of every parameter's state).
        let model = learner.model();
        let group = self.group.as_ref();
        let (keep, shards_parameters) =
            sharded::resume_reads::<TrainingBackend<LC>, _>(&model, group, self.config.zero_stage);
        // The start-up check's copy holds files this process surely reads
        // (`sharded::kept_at_start_up`); any other is dropped before the records are decoded.
        let held = held.map(|mut held| {
            held.files.retain(|name, _| keep(name));
            held
        });
        let resumed = crate::checkpoint::agree_on_checkpoint_keeping(
            group,
            &checkpoints,
            held,
            |held| {
                self.choose(
                    &checkpoints,
                    asked,
                    components.checkpointer.is_some(),
                    held,
                    keep.clone(),
                )
            },
            keep.clone(),
        )
        .and_then(|loaded| match loaded {
            None => Ok(Resume::Fresh(model)),
            Some(loaded) if sharded::is_sharded(&loaded) => {
                // The strategy's scheme names a scheduler's record, written beside the shards.
                let name = Scheme::Strategy.names(loaded.epoch).scheduler;
                let scheduler = name
                    .as_deref()
                    .map(|name| {
                        crate::checkpoint::records::decode::<
                            TrainingBackend<LC>,
                            LearnerSchedulerRecord<LC>,
                        >(&loaded, name, &self.device)
                    })
                    .transpose()?;
                let mut read = sharded::read::<TrainingBackend<LC>, _, LearnerOptimizerRecord<LC>>(
                    loaded,
                    Scheme::Strategy,
                    model,
                    group,
                    shards_parameters,
                    &self.device,
                )?;
                if let Some(name) = &name {
                    read.files.remove(name);
                }
                Ok(Resume::From(contents::Contents {
                    number: read.number,
                    state: read.state,
                    model: read.model,
                    optimizer: read.optimizer,
                    scheduler,
                    files: read.files,
                }))
            }
            Some(loaded) => contents::read::<
                TrainingBackend<LC>,
                _,
                LearnerOptimizerRecord<LC>,
                LearnerSchedulerRecord<LC>,
            >(loaded, Scheme::Strategy, model, &self.device)
            .map(Resume::From),
        })
        .unwrap_or_else(|err| fail("cannot resume", err));
        let read = match resumed {
            Resume::Fresh(_) => return (learner, None),
            Resume::From(read) => read,
        };
        let epoch = read.number;
        // The strategy's scheme names a scheduler's record, which `read` decodes.
        let Some(scheduler) = read.scheduler else {
            fail(
                "cannot resume",
                record_error("the scheduler's record", "not read back"),
            )
        };
        let learner = tap::restoring::<LC>(read.model.into_record(), read.optimizer, scheduler)
            .load_checkpoint(learner, &self.device, epoch);
        // Burn must not load its own files over these.
        components.checkpoint = None;
        log::info!(
            "burn-accelerate: resuming from the checkpoint of epoch {epoch} in {} (restart \
             {}); the steps taken after it are redone",
            dir.display(),
            crate::distributed::restart_count().unwrap_or(0)
        );
        (learner, Some((epoch, read.state)))
    }

    // The main process's pick: the epoch asked for (`.checkpoint(epoch)`), else the newest
    // complete one; `None` to start afresh or to leave it to Burn's own files. `held`, the
    // checkpoint verified at start-up, is the newest complete one, and the one asked for when
    // its epoch is. Of the files of the one picked, those `keep` names are kept (the newest
    // complete one's are all verified first).
    fn choose(
        &self,
        checkpoints: &CheckpointDir,
        asked: Option<usize>,
        burn_has_files: bool,
        held: Option<LoadedCheckpoint>,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
        if let Some(held) = held.filter(|held| asked.is_none_or(|epoch| epoch == held.epoch)) {
            return Ok(Some(held));
        }
        let Some(epoch) = asked else {
            // A sharded checkpoint missing a process's file is passed over as a damaged one.
            return checkpoints.load_newest_where(None, sharded::complete, keep);
        };
        let listed = Manifest::read(checkpoints.path())?.entry(epoch).is_some();
        if !listed && burn_has_files {
            // An epoch written before the strategy kept checkpoints of its own.
            return Ok(None);
        }
        // Every file verified, as of the newest: a damaged one is refused here, on the main
        // process, whichever process would have read it.
        match checkpoints.load_verifying_all(epoch, keep) {
            Ok(loaded) => Ok(Some(loaded)),
            Err(err) if burn_has_files => {
                log::warn!(
                    "burn-accelerate: {err}: loading Burn's own checkpoint of epoch {epoch} \
                     instead, unverified"
                );
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::checkpoint::is_burns_model;

    #[test]
    fn burns_model_keeps_the_state_beside_it() {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-resume-spare-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model-3.mpk"), b"").unwrap();
        assert!(burn_keeps(&dir, "accelerate-3.json"));
        assert!(!burn_keeps(&dir, "accelerate-2.json"));
        assert!(!burn_keeps(&dir, "accelerate-3-model.mpk"));
        // A process's file of a sharded checkpoint is the strategy's, not Burn's.
        assert!(is_burns_model("model-3.mpk", 3));
        assert!(!is_burns_model("model-3.shard-0-of-2.mpk", 3));
        assert_eq!(
            Scheme::Strategy.names(3).state,
            AccelerateCheckpoint::path(&dir, 3)
                .file_name()
                .unwrap()
                .to_string_lossy()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
