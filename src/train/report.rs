//! What an accelerated training reports: its precision, loss scale and step counts, per
//! epoch, readable while Burn's loop runs.

use super::*;

/// What an accelerated training did, per epoch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpochReport {
    /// The epoch (1-based, as Burn counts).
    pub epoch: usize,
    /// Training steps taken: one batch on every device (whose shard still had one).
    pub batches: usize,
    /// Optimizer steps applied.
    pub optimizer_steps: usize,
    /// Learning-rate scheduler steps taken.
    pub scheduler_steps: usize,
    /// Optimizer steps skipped because the scaled gradients overflowed.
    pub skipped_steps: usize,
    /// The loss scale at the end of the epoch (1 without loss scaling).
    pub loss_scale: f32,
    /// Validation batches this process evaluated (its part of the validation loader on
    /// several processes; 0 where the epoch did not validate).
    pub valid_batches: usize,
    /// Validation items this process evaluated.
    pub valid_items: usize,
    /// Validation batches of all processes together, whose metric entries every process's
    /// Burn metrics hold (on one process, this process's).
    pub valid_batches_combined: usize,
}

/// What an accelerated training did so far: precision, loss scale and step counts.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingStats {
    /// The precision asked for.
    pub requested: Precision,
    /// The precision the ops ran in (f32 after a fallback).
    pub precision: Precision,
    /// Whether the device could not run `requested` and f32 was used instead.
    pub fell_back: bool,
    /// The loss scale in force (after the last optimizer step).
    pub loss_scale: LossScale,
    /// Every epoch trained, in order.
    pub epochs: Vec<EpochReport>,
    /// The lower-class ops of the training and validation steps (on the thread that runs
    /// them: the main device's) by what they ran in: half type, or f32 and why; set when the
    /// fit ends.
    pub lower_ops: LowerOpTally,
    /// The lower-class ops of the validation alone (a part of `lower_ops`): validation runs
    /// in the training's precision, as Accelerate's prepared model evaluates under autocast.
    pub valid_lower_ops: LowerOpTally,
    /// Processes the validation was divided between (each evaluated its own batches, and the
    /// metrics were combined).
    pub valid_processes: usize,
    /// Validation metrics shown per process, by name: on several processes, those whose
    /// epoch value cannot be rebuilt from the processes' entries (an entry that carries state
    /// from the batches before it, or one that is not a number; Burn's `PerplexityMetric`,
    /// whose state is known, is rebuilt and combined). Each process's Burn metrics hold its
    /// own entries of these; every other metric is combined. A warning names each once.
    pub valid_metrics_per_process: Vec<String>,
    /// The epoch whose checkpoint this training resumed from (`None`: it started afresh).
    pub resumed_from: Option<usize>,
    // Skipped steps so far, the current epoch included (for the live metric).
    pub(super) skipped_live: usize,
}

impl TrainingStats {
    /// Optimizer steps skipped on overflow, over all epochs.
    pub fn skipped_steps(&self) -> usize {
        self.epochs.iter().map(|e| e.skipped_steps).sum()
    }

    /// Optimizer steps applied, over all epochs.
    pub fn optimizer_steps(&self) -> usize {
        self.epochs.iter().map(|e| e.optimizer_steps).sum()
    }

    /// How the validation ran, for a summary line: `valid_precision=<p> valid_processes=<n>
    /// valid_half_ops=<n>/<all>` (the precision is the training's: validation runs under its
    /// autocast; the ops say how many of validation's lower-class ops ran in the half type).
    pub fn validation_summary(&self) -> String {
        format!(
            "valid_precision={} valid_processes={} valid_half_ops={}/{}",
            self.precision.short_name(),
            self.valid_processes,
            self.valid_lower_ops.half_ops,
            self.valid_lower_ops.ops(),
        )
    }
}

/// A handle on an [`AccelerateStrategy`]'s [`TrainingStats`], readable during and after
/// training (the strategy itself moves into Burn's builder).
#[derive(Debug, Clone)]
pub struct TrainingReport {
    pub(super) inner: Arc<Mutex<TrainingStats>>,
    // Each validation phase's wall time, apart from the statistics, which compare equal
    // between runs that did the same.
    pub(super) valid_seconds: Arc<Mutex<Vec<f64>>>,
}

impl TrainingReport {
    /// A copy of the statistics now.
    pub fn stats(&self) -> TrainingStats {
        self.lock().clone()
    }

    /// The wall time of each epoch's validation phase on this process, in seconds, in epoch
    /// order: its batches, waiting for Burn's metric processing, and the combination of the
    /// processes' metrics (which waits for the slowest process).
    pub fn valid_seconds(&self) -> Vec<f64> {
        self.valid_seconds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, TrainingStats> {
        // The stats are plain counters: a panic elsewhere leaves them usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
