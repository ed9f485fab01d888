//! The strategy's one way to a Burn `Learner`'s optimizer and scheduler records, through Burn's
//! `LearningCheckpointer`: reading them ([`RecordTap`]) and loading a checkpoint's
//! ([`restoring`]).
//!
//! Burn 0.21's `Learner` keeps its optimizer and scheduler private
//! (`burn-train-0.21.0/src/learner/base.rs`): it takes records (`load_optim`,
//! `load_scheduler`), but only its `LearningCheckpointer` reads them back
//! (`LearningCheckpointer::checkpoint` calls `optim.to_record()` and
//! `lr_scheduler.to_record()`, and hands them to its checkpointers). So the tap is a
//! `LearningCheckpointer` of its own whose optimizer and scheduler checkpointers hand each record
//! over a channel instead of writing it, and whose model checkpointer drops its record (the model
//! is the learner's `model()`).
//!
//! Both uses read through the one tap of a fit: sharded training (ZeRO) reads the optimizer's
//! record to keep this process's part of it (a partition's, or slices) and to gather the whole of
//! it for a checkpoint (`fit`, `checkpoint`), and the main process's own checkpoints read both
//! records to write them (`resume`). Each read takes both records, so that neither channel keeps a
//! record for the next read.
//!
//! The resume loads the records it read and checked through Burn's own resume path
//! (`LearningCheckpointer::load_checkpoint`, what `SupervisedTraining::checkpoint(epoch)` runs),
//! given a checkpointer that restores them.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Mutex, PoisonError};

use burn::record::Record;
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Learner, LearnerModelRecord, LearnerOptimizerRecord, LearnerSchedulerRecord,
    LearningCheckpointer, LearningComponentsTypes,
};

use crate::AccelerateError;
use crate::checkpoint::records::record_error;

/// Reads a `Learner`'s optimizer and scheduler records (their tensors are shared, not copied).
pub(super) struct RecordTap<LC: LearningComponentsTypes> {
    checkpointer: LearningCheckpointer<LC>,
    optimizer: Receiver<LearnerOptimizerRecord<LC>>,
    scheduler: Receiver<LearnerSchedulerRecord<LC>>,
}

impl<LC: LearningComponentsTypes> RecordTap<LC> {
    pub(super) fn new() -> Self {
        let (optimizer_sender, optimizer) = channel();
        let (scheduler_sender, scheduler) = channel();
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(Discard),
            AsyncCheckpointer::new(Hand(Mutex::new(optimizer_sender))),
            AsyncCheckpointer::new(Hand(Mutex::new(scheduler_sender))),
            Box::new(Always),
        );
        Self {
            checkpointer,
            optimizer,
            scheduler,
        }
    }

    /// The learner's optimizer and scheduler records now.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when a checkpointer's thread has ended (a panic there).
    pub(super) fn records(
        &mut self,
        learner: &Learner<LC>,
        store: &EventStoreClient,
    ) -> Result<(LearnerOptimizerRecord<LC>, LearnerSchedulerRecord<LC>), AccelerateError> {
        // The epoch is only a file name to a checkpointer; these write no file. A channel ends
        // when its checkpointer's thread does: the wait cannot outlive it.
        self.checkpointer.checkpoint(learner, 0, store);
        let gone = |_| record_error("the learner's records", "their reader's thread ended");
        Ok((
            self.optimizer.recv().map_err(gone)?,
            self.scheduler.recv().map_err(gone)?,
        ))
    }

    /// The learner's optimizer record now (see [`Self::records`]).
    ///
    /// # Errors
    /// As [`Self::records`].
    pub(super) fn optimizer(
        &mut self,
        learner: &Learner<LC>,
        store: &EventStoreClient,
    ) -> Result<LearnerOptimizerRecord<LC>, AccelerateError> {
        self.records(learner, store).map(|(optimizer, _)| optimizer)
    }
}

/// A `LearningCheckpointer` whose `load_checkpoint` loads these records (read and checked
/// already) into a learner, once, and that writes nothing.
pub(super) fn restoring<LC: LearningComponentsTypes>(
    model: LearnerModelRecord<LC>,
    optimizer: LearnerOptimizerRecord<LC>,
    scheduler: LearnerSchedulerRecord<LC>,
) -> LearningCheckpointer<LC> {
    LearningCheckpointer::new(
        AsyncCheckpointer::new(Restore::new(model)),
        AsyncCheckpointer::new(Restore::new(optimizer)),
        AsyncCheckpointer::new(Restore::new(scheduler)),
        Box::new(Always),
    )
}

// What the tap's checkpointers say when asked to restore: they keep nothing to restore.
fn keeps_no(epoch: usize) -> CheckpointerError {
    CheckpointerError::Unknown(format!("the record tap keeps no epoch {epoch}"))
}

// Hands each record saved to it over the channel.
struct Hand<R>(Mutex<Sender<R>>);

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for Hand<R> {
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let sender = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        sender
            .send(record)
            .map_err(|_| CheckpointerError::Unknown("the tap was dropped".into()))
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, epoch: usize, _device: &B::Device) -> Result<R, CheckpointerError> {
        Err(keeps_no(epoch))
    }
}

// Restores one record, once, and writes nothing.
struct Restore<R>(Mutex<Option<R>>);

impl<R> Restore<R> {
    fn new(record: R) -> Self {
        Self(Mutex::new(Some(record)))
    }
}

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for Restore<R> {
    fn save(&self, _epoch: usize, _record: R) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, epoch: usize, _device: &B::Device) -> Result<R, CheckpointerError> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| {
                CheckpointerError::Unknown(format!("epoch {epoch}'s record was restored already"))
            })
    }
}

// Drops what is saved to it.
struct Discard;

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for Discard {
    fn save(&self, _epoch: usize, _record: R) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, epoch: usize, _device: &B::Device) -> Result<R, CheckpointerError> {
        Err(keeps_no(epoch))
    }
}

// Saves at every call.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(
        &mut self,
        _epoch: usize,
        _store: &EventStoreClient,
    ) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}
