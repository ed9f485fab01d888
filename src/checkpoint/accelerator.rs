//! A hand-written loop's checkpoint through the [`Accelerator`]: its state, the model's and
//! the optimizer's records, written crash-safely by [`CheckpointDir`] (Accelerate's
//! `save_state` / `load_state`), and read back, newest complete first, when the program starts
//! again: a loop that calls [`Accelerator::resume`] before its first step goes on after a
//! restart (`burn-accelerate launch --max-restarts`) with no code of its own for it.
//!
//! What a restart redoes: the steps after the last checkpoint. The checkpoint is numbered by
//! what the loop passes (its step or epoch); the loop skips what that number says is done (with
//! the crate's loaders, `ShardLoader::state` / `load_state` carry their position: save it as
//! one more file of the checkpoint).

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;

use super::contents::{self, Records, Resume};
use super::records::Scheme;
use super::{
    CheckpointDir, CheckpointLayout, CheckpointState, agree_on_checkpoint_keeping, sharded,
};
use crate::zero::ParamStateRecord;
use crate::{AccelerateError, Accelerator, AcceleratorState};

/// What [`Accelerator::resume`] found: the checkpoint's number, and the model and optimizer
/// with its records loaded (as given when there was none).
pub struct Resumed<M, O> {
    /// The number of the checkpoint resumed from (the step or epoch the loop saved it as);
    /// `None` when the directory held none, and the loop starts afresh.
    pub from: Option<usize>,
    /// The model, with the checkpoint's parameters.
    pub model: M,
    /// The optimizer, with the checkpoint's state (this process's part of it when the
    /// optimizer state is sharded).
    pub optimizer: O,
    /// The loop's own files of the checkpoint
    /// ([`save_checkpoint_with`](Accelerator::save_checkpoint_with)), by name, verified.
    pub files: std::collections::BTreeMap<String, Vec<u8>>,
}

// Burn's optimizers are not `Debug`: what was resumed from is what there is to show.
impl<M, O> std::fmt::Debug for Resumed<M, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resumed")
            .field("from", &self.from)
            .field("files", &self.files.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl<B: AutodiffBackend> Accelerator<B> {
    /// Saves the accelerator's [`state`](Self::state), `model` and `optimizer` as checkpoint
    /// `number` of `dir`, crash-safely (written aside, flushed, renamed, listed with
    /// checksums). Every process calls it at the same point (a sharded optimizer state is
    /// gathered first, and at ZeRO stage 3 the model's parameters, one at a time); the main
    /// process alone writes, and every process returns once the
    /// checkpoint is listed. Call it after an optimizer step, when the window is complete.
    ///
    /// With [`CheckpointLayout::Sharded`] (`AccelerateConfig::with_checkpoint_layout`), at
    /// ZeRO stages 1 to 3 on several processes, nothing is gathered on the main process: each
    /// process writes its own partition's parameters and optimizer state (at stage 3, joined
    /// from every process's slices), and the main process lists them all
    /// once every process wrote; [`resume`](Self::resume) reads them back for any number of
    /// processes at any stage.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn::backend::{Autodiff, Flex};
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn::optim::SgdConfig;
    /// use burn_accelerate::checkpoint::CheckpointDir;
    /// use burn_accelerate::{AccelerateConfig, Accelerator};
    ///
    /// type B = Autodiff<Flex>;
    /// let device = Default::default();
    /// let dir = std::env::temp_dir().join(format!("acc-ckpt-doc-{}", std::process::id()));
    /// let checkpoints = CheckpointDir::new(&dir).with_keep_last(2);
    /// let mut accelerator = Accelerator::<B>::new(AccelerateConfig::new(), &device)?;
    ///
    /// let model = LinearConfig::new(4, 2).init::<B>(&device);
    /// let optimizer = SgdConfig::new().init::<B, Linear<B>>();
    /// // At the start: the newest complete checkpoint, if a run before this one left one.
    /// let resumed = accelerator.resume(&checkpoints, model, optimizer)?;
    /// assert_eq!(resumed.from, None);
    /// let (model, optimizer) = (resumed.model, resumed.optimizer);
    /// // ... train; then, every so often:
    /// accelerator.save_checkpoint(&checkpoints, 1, &model, &optimizer)?;
    /// let again = accelerator.resume(&checkpoints, model, optimizer)?;
    /// assert_eq!(again.from, Some(1));
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # }
    /// # Ok::<(), burn_accelerate::AccelerateError>(())
    /// ```
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when a record cannot be written (the checkpoints listed
    /// before stay whole); [`AccelerateError::Distributed`] when a process left.
    pub fn save_checkpoint<M, O>(
        &self,
        dir: &CheckpointDir,
        number: usize,
        model: &M,
        optimizer: &O,
    ) -> Result<(), AccelerateError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        O::Record: ParamStateRecord<B>,
    {
        self.save_checkpoint_with(dir, number, model, optimizer, &[])
    }

    /// [`save_checkpoint`](Self::save_checkpoint) with files of the loop's own in the same
    /// checkpoint (a loader's position: `ShardLoader::state`, serialised), given back by
    /// [`resume`](Self::resume) in [`Resumed::files`]. Only the main process's are written.
    ///
    /// # Errors
    /// As [`save_checkpoint`](Self::save_checkpoint); [`AccelerateError::Checkpoint`] for a
    /// file named as one of the accelerator's own (`accelerator-N.json`, `model-N.mpk`,
    /// `optimizer-N.mpk`).
    pub fn save_checkpoint_with<M, O>(
        &self,
        dir: &CheckpointDir,
        number: usize,
        model: &M,
        optimizer: &O,
        files: &[(&str, &[u8])],
    ) -> Result<(), AccelerateError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        O::Record: ParamStateRecord<B>,
    {
        // On every process, before the gathering, so that all refuse alike.
        contents::refuse_own_names(Scheme::Accelerator, number, files)?;
        sharded::refuse_shard_names(files)?;
        let state = || CheckpointState {
            state: self.state(),
            loaders: Vec::new(),
            num_processes: self.process().num_processes(),
        };
        if self.config().checkpoint_layout == CheckpointLayout::Sharded
            && let Some(group) = self.sharded_group()
        {
            return sharded::write::<B, M, O::Record>(
                group,
                dir,
                number,
                model,
                optimizer.to_record(),
                Scheme::Accelerator,
                &state(),
                files,
                |_| false,
                self.config()
                    .zero_stage
                    .shards_parameters()
                    .then_some(self.device()),
            );
        }
        let whole = self.consolidate_optimizer_record(model, optimizer.to_record())?;
        // At ZeRO stage 3 every process takes part in gathering the model's record too.
        let model_record = self.consolidate_model_record(model)?;
        // Only the main process holds the whole records; every process waits for its write.
        let write = whole.zip(model_record).map(|(whole, model_record)| {
            move || {
                let records = Records::encode::<B, _, _>(model_record, whole)?;
                contents::write(
                    dir,
                    Scheme::Accelerator,
                    number,
                    &state(),
                    &records,
                    files,
                    |_| false,
                )
            }
        });
        contents::written_by_main(self.core_group(), write)
    }

    /// Loads the newest complete checkpoint of `dir` (passing over a damaged one, with a
    /// warning, for the one before it) into this accelerator, `model` and `optimizer`; gives
    /// them back as they are when `dir` holds none. The main process chooses the checkpoint
    /// and every process loads that one, so all resume alike. A sharded checkpoint
    /// ([`CheckpointLayout::Sharded`]) is re-partitioned for this run's processes and stage;
    /// one that lacks a process's file is passed over as a damaged one is. See
    /// [`save_checkpoint`](Self::save_checkpoint) for an example.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when checkpoints are listed but none verifies, or a
    /// record does not fit the model or optimizer; [`AccelerateError::StateMismatch`] when the
    /// checkpoint was saved with other accumulation or loss-scaling settings;
    /// [`AccelerateError::Distributed`] when a process left.
    pub fn resume<M, O>(
        &mut self,
        dir: &CheckpointDir,
        model: M,
        mut optimizer: O,
    ) -> Result<Resumed<M, O>, AccelerateError>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
        O::Record: ParamStateRecord<B>,
    {
        let device = self.device().clone();
        let group = self.core_group();
        // A sharded checkpoint's process reads the files holding its partition (of the
        // parameters at stage 3, of the optimizer state at stages 1 and 2; at stage 3 every
        // optimizer file, as it keeps a slice of every parameter's state); the main process
        // verifies every file of the one it picks (and that none is missing), and keeps those.
        let (keep, shards_parameters) =
            sharded::resume_reads::<B, M>(&model, group, self.config().zero_stage);
        let loaded = agree_on_checkpoint_keeping(
            group,
            dir,
            None,
            |_| dir.load_newest_where(None, sharded::complete, keep.clone()),
            keep.clone(),
        )?;
        let read = match loaded {
            Some(loaded) if sharded::is_sharded(&loaded) => {
                Resume::From(sharded::read::<B, M, O::Record>(
                    loaded,
                    Scheme::Accelerator,
                    model,
                    group,
                    shards_parameters,
                    &device,
                )?)
            }
            Some(loaded) => Resume::From(contents::read::<B, M, O::Record, ()>(
                loaded,
                Scheme::Accelerator,
                model,
                &device,
            )?),
            None => Resume::Fresh(model),
        };
        let read = match read {
            Resume::Fresh(model) => {
                return Ok(Resumed {
                    from: None,
                    model,
                    optimizer,
                    files: Default::default(),
                });
            }
            Resume::From(read) => read,
        };
        let own = self.shard_optimizer_record(&read.model, read.optimizer)?;
        optimizer = optimizer.load_record(own);
        // The state in the one order of both entry points; the position and loss scale as
        // `load_state` restores them, once it has checked the accumulation settings (the
        // loop's loaders are its own files of the checkpoint).
        let processes = self.process().num_processes();
        read.state.restore(
            processes,
            |gradient_state, loss_scale| {
                self.load_state(&AcceleratorState {
                    loss_scale,
                    gradient_state: *gradient_state,
                })
            },
            &[],
        )?;
        let (number, model) = (read.number, read.model);
        Ok(Resumed {
            from: Some(number),
            model,
            optimizer,
            files: read.files,
        })
    }
}

impl<B: AutodiffBackend> Accelerator<B> {
    // The process group, where the ZeRO stage partitions the optimizer state over several
    // processes (stages 1 to 3): what a sharded checkpoint splits.
    fn sharded_group(&self) -> Option<&crate::distributed::ProcessGroup> {
        let group = self.core_group()?;
        crate::zero::shards(self.config().zero_stage, Some(group)).then_some(group)
    }
}
