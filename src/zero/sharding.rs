//! Sharded data parallel's arithmetic, as pure functions: which process owns which parameter
//! at stages 1 and 2 (its optimizer state and, at stage 2, its averaged gradient), and which
//! slice of every parameter each process holds at stage 3.
//!
//! At stages 1 and 2 parameters go whole to their owners, as torch's
//! `ZeroRedundancyOptimizer` places them: largest first, each to the process that owns the
//! fewest values so far (the lowest rank on a tie). At stage 3 every parameter is cut into
//! equal flat slices, one a process, as FSDP's `FULL_SHARD` cuts it. Every process computes
//! the same partition and the same slices from the same model, with no communication.

use serde::{Deserialize, Serialize};

/// How much of the training state each process keeps for the whole model, and how much only
/// for its own part of the parameters (its partition's parameters at stages 1 and 2, its
/// slice of every parameter at stage 3).
///
/// | stage | DeepSpeed | FSDP | each process keeps |
/// |---|---|---|---|
/// | [`None`](Self::None) | ZeRO stage 0 | `NO_SHARD` (DDP) | every gradient and optimizer state |
/// | [`OptimizerState`](Self::OptimizerState) | ZeRO stage 1 | — (torch's `ZeroRedundancyOptimizer`) | every gradient, its partition's optimizer state |
/// | [`Gradients`](Self::Gradients) | ZeRO stage 2 | `SHARD_GRAD_OP` | its partition's averaged gradients and optimizer state |
/// | [`Parameters`](Self::Parameters) | ZeRO stage 3 | `FULL_SHARD` | its slice of every parameter's averaged gradient and optimizer state, and between steps its slice of every parameter only |
///
/// At stages 0 to 2 parameters stay whole on every process. At stage 3 no process holds a
/// parameter whole between steps: it is gathered from every process's slice where an op uses
/// it (see [`release_parameters`](crate::zero::release_parameters) for what is and is not
/// bounded).
///
/// Where it runs: the [`Accelerator`](crate::Accelerator)'s hand-written loops and
/// `with_accelerate` (`AccelerateConfig::with_zero_stage`), across processes (a data-parallel
/// strategy over one process's devices refuses a stage). Each process's optimizer then holds its
/// own part's state only; checkpoints hold the whole state, merged on the main process
/// ([`consolidate_state`](crate::zero::consolidate_state); `with_accelerate` does it for Burn's
/// checkpoints, a hand-written loop calls `Accelerator::consolidate_optimizer_record`), so a run
/// resumes at any stage on any number of processes. At stage 3 a checkpoint's model record is
/// gathered on the main process too, parameter by parameter, from every process's slice
/// ([`gather_model_record`](crate::zero::gather_model_record); a hand-written loop calls
/// `Accelerator::consolidate_model_record`; `with_accelerate` does it for Burn's checkpoints and
/// its own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ZeroStage {
    /// Data parallel: every process steps the whole model.
    #[default]
    None,
    /// Each process steps its own partition of the parameters, and keeps optimizer state for
    /// it alone; gradients are averaged whole, the updated parameters shared back.
    OptimizerState,
    /// As [`OptimizerState`](Self::OptimizerState), with gradients reduce-scattered: each
    /// process keeps only its partition's averaged gradients.
    Gradients,
    /// Each process holds a flat 1/N slice of every parameter ([`slice_range`]: FSDP's
    /// `FULL_SHARD`), and keeps that slice's averaged gradient and optimizer state; between
    /// steps no process holds a parameter whole: each use by an op gathers every process's
    /// slice ([`release_parameters`](crate::zero::release_parameters)), and the optimizer
    /// steps the slices.
    /// Both entry points (the [`Accelerator`](crate::Accelerator), whose
    /// [`prepare_model`](crate::Accelerator::prepare_model) releases the model before its
    /// first step, and `with_accelerate`, whose fit releases it before its first forward
    /// pass, or [`AccelerateStrategy::prepare_model`](crate::train::AccelerateStrategy::prepare_model)
    /// before Burn's `launch`), checkpoints and restarts run it; see
    /// `docs/zero.md` for what is bounded.
    ///
    /// Clip by norm with the accelerator (`max_grad_norm`, `clip_grad_norm`: the global norm
    /// over every process's slices), not with an optimizer's own per-tensor clipping (Burn's
    /// `with_grad_clipping`), which would see each slice alone.
    Parameters,
}

impl ZeroStage {
    /// The stage's DeepSpeed number (0 to 3).
    pub fn number(self) -> u8 {
        match self {
            Self::None => 0,
            Self::OptimizerState => 1,
            Self::Gradients => 2,
            Self::Parameters => 3,
        }
    }

    /// The stage of DeepSpeed number `stage`, for a command line's `--zero-stage`.
    pub fn from_number(stage: u8) -> Option<Self> {
        [
            Self::None,
            Self::OptimizerState,
            Self::Gradients,
            Self::Parameters,
        ]
        .into_iter()
        .find(|s| s.number() == stage)
    }
}

/// The owner of each parameter at ZeRO stages 1 and 2 (and the process whose file holds it
/// in a sharded checkpoint, at every stage), for parameters of `sizes` values (in the model's
/// visiting order) over `processes` processes.
///
/// ```
/// use burn_accelerate::zero::partition;
/// // Largest first, each to the least-loaded process.
/// assert_eq!(partition(&[10, 40, 30, 20], 2), [0, 0, 1, 1]);
/// ```
pub fn partition(sizes: &[usize], processes: usize) -> Vec<usize> {
    let processes = processes.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    // Largest first; equal sizes in visiting order, so that every process agrees.
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; processes];
    let mut owners = vec![0; sizes.len()];
    for param in order {
        let owner = (0..processes)
            .min_by_key(|&p| (load[p], p))
            .expect("at least one process");
        owners[param] = owner;
        load[owner] += sizes[param];
    }
    owners
}

/// How many values each process holds of a parameter of `values` values sliced over
/// `processes` processes at ZeRO stage 3 (FSDP's flat slice): the parameter flattened, padded
/// with zeros to a multiple of `processes`, and cut into equal slices, so that every slice's
/// collective moves the same number of values (a parameter of fewer values than processes
/// still has a slice of one on every process).
///
/// ```
/// use burn_accelerate::zero::slice_len;
/// assert_eq!(slice_len(10, 4), 3); // 12 values with the padding, 3 a process
/// assert_eq!(slice_len(2, 4), 1);
/// assert_eq!(slice_len(0, 4), 0);
/// ```
pub fn slice_len(values: usize, processes: usize) -> usize {
    values.div_ceil(processes.max(1))
}

/// Which of the parameter's flat values process `rank`'s slice holds ([`slice_len`]); the
/// rest of the slice, up to its length, is padding.
///
/// ```
/// use burn_accelerate::zero::slice_range;
/// assert_eq!(slice_range(10, 4, 0), 0..3);
/// assert_eq!(slice_range(10, 4, 3), 9..10); // and two values of padding
/// assert_eq!(slice_range(2, 4, 3), 2..2); // padding only
/// ```
pub fn slice_range(values: usize, processes: usize, rank: usize) -> std::ops::Range<usize> {
    let len = slice_len(values, processes);
    let start = (rank * len).min(values);
    start..((rank + 1) * len).min(values)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn stages_have_deepspeed_s_numbers() {
        for n in 0..4 {
            assert_eq!(ZeroStage::from_number(n).unwrap().number(), n);
        }
        assert_eq!(ZeroStage::from_number(3), Some(ZeroStage::Parameters));
        assert_eq!(ZeroStage::from_number(4), None);
        assert_eq!(ZeroStage::default(), ZeroStage::None);
    }

    #[test]
    fn edge_cases() {
        assert!(partition(&[], 4).is_empty());
        assert_eq!(partition(&[5, 5, 5], 1), [0, 0, 0]);
        // More processes than parameters: some own nothing.
        assert_eq!(partition(&[3, 7], 4), [1, 0]);
        // Equal sizes go round the processes in visiting order.
        assert_eq!(partition(&[1, 1, 1, 1], 2), [0, 1, 0, 1]);
    }

    proptest! {
        #[test]
        fn slices_cover_every_value_once_in_order(
            values in 0usize..10_000,
            processes in 1usize..9,
        ) {
            let len = slice_len(values, processes);
            prop_assert!(len * processes >= values);
            prop_assert!(len * processes < values + processes);
            let mut next = 0;
            for rank in 0..processes {
                let range = slice_range(values, processes, rank);
                prop_assert_eq!(range.start, next);
                prop_assert!(range.len() <= len);
                next = range.end;
            }
            prop_assert_eq!(next, values);
        }
    }

    proptest! {
        #[test]
        fn every_parameter_has_one_owner_and_loads_are_balanced(
            sizes in proptest::collection::vec(0usize..10_000, 0..40),
            processes in 1usize..9,
        ) {
            let owners = partition(&sizes, processes);
            prop_assert_eq!(owners.len(), sizes.len());
            prop_assert!(owners.iter().all(|&o| o < processes));
            let mut load = vec![0usize; processes];
            for (size, owner) in sizes.iter().zip(&owners) {
                load[*owner] += size;
            }
            // Greedy largest-first: no process is ahead of another by more than the largest
            // parameter.
            let largest = sizes.iter().copied().max().unwrap_or(0);
            let (min, max) = (load.iter().min().unwrap(), load.iter().max().unwrap());
            prop_assert!(max - min <= largest, "{load:?}");
            // The same answer every time: every process computes it alone.
            prop_assert_eq!(partition(&sizes, processes), owners);
        }
    }
}
