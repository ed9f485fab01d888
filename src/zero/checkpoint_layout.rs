//! How a sharded run's checkpoint is laid out on disk: whole on the main process, or one part
//! per process. (Here, beside the stages, so that the accelerator's config names it without
//! importing the checkpoints, which import the accelerator; `checkpoint` re-exports it.)

use serde::{Deserialize, Serialize};

/// How [`Accelerator::save_checkpoint`](crate::Accelerator::save_checkpoint) and
/// `with_accelerate`'s own checkpoints (`AccelerateStrategy::with_checkpoint_dir`) write a
/// checkpoint of a sharded run (ZeRO stages 1 to 3 on several processes;
/// `AccelerateConfig::with_checkpoint_layout`). Both kinds resume at any stage on any number of
/// processes, and are crash-safe alike (listed once every file is whole on the disk). Burn's
/// own file checkpointer (`model-N.mpk`, `optim-N.mpk`, `scheduler-N.mpk`, written by Burn's
/// `Learner` when asked for) writes whole records either way.
///
/// ```
/// use burn_accelerate::AccelerateConfig;
/// use burn_accelerate::checkpoint::CheckpointLayout;
/// use burn_accelerate::zero::ZeroStage;
///
/// let config = AccelerateConfig::new()
///     .with_zero_stage(ZeroStage::Parameters)
///     .with_checkpoint_layout(CheckpointLayout::Sharded);
/// assert_eq!(config.checkpoint_layout, CheckpointLayout::Sharded);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CheckpointLayout {
    /// The model's record and the whole optimizer state, gathered on the main process, which
    /// writes them (FSDP's `FULL_STATE_DICT`, torch's `consolidate_state_dict`): the files a
    /// stage 0 run writes, which Burn loads without this crate. The main process holds the
    /// whole optimizer state (and at stage 3 the whole model) while it writes.
    #[default]
    Consolidated,
    /// Each process writes its own partition's parameters and optimizer state (at ZeRO stage 3,
    /// joined from every process's slices) (`model-N.shard-R-of-W.mpk`,
    /// `optimizer-N.shard-R-of-W.mpk`; FSDP's `SHARDED_STATE_DICT`, DeepSpeed's per-rank files),
    /// and the main process lists every process's files in the manifest once all are written: no
    /// process holds more than its partition to save. `with_accelerate`'s main process also writes
    /// the scheduler's record (`accelerate-N-scheduler.mpk`) and its state file
    /// (`accelerate-N.json`). At stage 0, or on one process, nothing is partitioned, and the
    /// checkpoint is consolidated.
    Sharded,
}
