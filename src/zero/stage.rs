//! What each ZeRO stage changes in a step, answered in one place: the step core asks the stage
//! these questions and never matches on it, and the entry points ask the step core, so a stage
//! is added here and in the collectives it needs, without touching the step's flow, the
//! [`Accelerator`](crate::Accelerator) or `with_accelerate`.
//!
//! Stage 3 ([`ZeroStage::Parameters`]) answers as stage 2 does for the gradients and the
//! optimizer state (each process's part is its slice of every parameter instead of its
//! partition's parameters), and adds the parameters' own questions: they are released after
//! the step instead of shared, and gathered from every process's slice where the model is
//! needed whole.

use super::sharding::ZeroStage;

impl ZeroStage {
    /// Whether the optimizer state is split among the processes: each steps its own part (its
    /// partition's parameters at stages 1 and 2, its slice of every parameter at stage 3), and
    /// a checkpoint's optimizer record is consolidated on the main process.
    pub(crate) fn partitions_state(self) -> bool {
        !matches!(self, Self::None)
    }

    /// Whether the window's sync leaves each process its own part of the averaged gradients
    /// only (a reduce-scatter: its partition's at stage 2, its slice of each at stage 3) rather
    /// than all of them (an all-reduce): then a gradient norm sums every process's part, and an
    /// overflow in any part skips the step everywhere.
    pub(crate) fn scatters_gradients(self) -> bool {
        matches!(self, Self::Gradients | Self::Parameters)
    }

    /// Whether the parameters stay sharded between steps: after the step each process keeps
    /// its slice of every parameter and releases the parameters (gathered again at their use,
    /// [`release_parameters`](super::release_parameters)) instead of receiving every updated
    /// parameter from its owner.
    pub(crate) fn shards_parameters(self) -> bool {
        matches!(self, Self::Parameters)
    }

    /// Whether the model is gathered from the processes' slices where it is needed whole: a
    /// checkpoint's record on the main process ([`gather_model_record`](super::gather_model_record)),
    /// the model a training hands back ([`gather_model`](super::gather_model)); otherwise
    /// every process holds it whole already.
    pub(crate) fn gathers_whole_model(self) -> bool {
        self.shards_parameters()
    }

    /// Whether the optimizer is given this process's partition's gradients out of whole ones
    /// (so that it keeps state for its partition alone).
    pub(crate) fn drops_others_gradients(self) -> bool {
        matches!(self, Self::OptimizerState)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_answers_as_its_table_row_says() {
        let answers = |s: ZeroStage| {
            (
                s.partitions_state(),
                s.scatters_gradients(),
                s.drops_others_gradients(),
                s.shards_parameters(),
                s.gathers_whole_model(),
            )
        };
        assert_eq!(
            answers(ZeroStage::None),
            (false, false, false, false, false)
        );
        assert_eq!(
            answers(ZeroStage::OptimizerState),
            (true, false, true, false, false)
        );
        assert_eq!(
            answers(ZeroStage::Gradients),
            (true, true, false, false, false)
        );
        assert_eq!(
            answers(ZeroStage::Parameters),
            (true, true, false, true, true)
        );
    }
}
