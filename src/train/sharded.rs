//! Reading the optimizer state out of Burn's `Learner`, for sharded training's checkpoints.
//!
//! Burn 0.21's `Learner` keeps its optimizer private (`burn-train-0.21.0/src/learner/base.rs`):
//! it can be given a record (`load_optim`), and only its `LearningCheckpointer` reads one
//! back. So the tap is a `LearningCheckpointer` of its own whose optimizer checkpointer hands
//! the record over a channel instead of writing it, and whose model and scheduler
//! checkpointers drop theirs. The same pieces read the records of the strategy's own
//! checkpoints (`resume`).

use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender, channel};

use burn::record::Record;
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerOptimizerRecord, LearningCheckpointer, LearningComponentsTypes};

/// Reads a `Learner`'s optimizer record.
pub(super) struct OptimizerTap<LC: LearningComponentsTypes> {
    checkpointer: LearningCheckpointer<LC>,
    records: Receiver<LearnerOptimizerRecord<LC>>,
}

impl<LC: LearningComponentsTypes> OptimizerTap<LC> {
    pub(super) fn new() -> Self {
        let (sender, records) = channel();
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(Discard),
            AsyncCheckpointer::new(Hand(Mutex::new(sender))),
            AsyncCheckpointer::new(Discard),
            Box::new(Always),
        );
        Self {
            checkpointer,
            records,
        }
    }

    /// The learner's optimizer record (tensors are shared, not copied).
    pub(super) fn record(
        &mut self,
        learner: &Learner<LC>,
        store: &EventStoreClient,
    ) -> LearnerOptimizerRecord<LC> {
        // The epoch is only a file name to a checkpointer; these write no file.
        self.checkpointer.checkpoint(learner, 0, store);
        self.records
            .recv()
            .expect("the tap's checkpointer thread lives as long as the tap")
    }
}

// What the tap's checkpointers say when asked to restore: they keep nothing to restore.
fn keeps_no(epoch: usize) -> CheckpointerError {
    CheckpointerError::Unknown(format!("the optimizer tap keeps no epoch {epoch}"))
}

// Hands each record saved to it over the channel.
pub(super) struct Hand<R>(pub(super) Mutex<Sender<R>>);

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for Hand<R> {
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let sender = self.0.lock().unwrap_or_else(|e| e.into_inner());
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

// Drops what is saved to it.
pub(super) struct Discard;

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
pub(super) struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(
        &mut self,
        _epoch: usize,
        _store: &EventStoreClient,
    ) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}
