//! The processes of a sharded run train one model: each owns a partition of its parameters
//! (stages 1 and 2: [`Partition`](super::Partition)) or a slice of every one (stage 3:
//! [`slice_range`](super::slice_range)), computed by every process from its own copy, and the
//! collectives carry parameters and gradients by their place in the model's visiting order.
//! A process whose model differs (another width, another layer) would otherwise fail inside
//! the first reduce-scatter with buffer lengths that say nothing of the model, or, where the
//! lengths happen to agree, train on another process's bytes. So before the first partition
//! the processes compare the shapes of their parameters (as torch's DDP does when it is built,
//! `_verify_params_across_processes`), and a difference is an error naming the parameter.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use crate::distributed::{DistributedError, ProcessGroup};

/// Checks that every process of `group` holds a model whose float parameters have the shapes
/// of `module`'s, in its visiting order. Every process must call it at the same point: one
/// all-gather of a 64-bit fingerprint, and where the fingerprints differ, one of the shapes
/// themselves, to name the first difference. Reads no parameter's value (a ZeRO stage 3
/// parameter is not gathered).
///
/// # Errors
/// [`DistributedError::ModelMismatch`] naming the first process whose model differs from this
/// process's, and how: its number of parameters, or the first parameter (by place in the
/// visiting order) whose shape differs, with both shapes; what the all-gathers return.
pub fn check_same_model<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &ProcessGroup,
    module: &M,
) -> Result<(), DistributedError> {
    let shapes = shapes::<B, M>(module);
    let own = fingerprint(&shapes);
    let all = group.all_gather(&[own])?;
    if all.iter().all(|&f| f == own) {
        return Ok(());
    }
    // Every process saw the same fingerprints, so every process takes this branch.
    let encoded = encode(&shapes);
    let lengths = group.all_gather(&[encoded.len() as u64])?;
    let flat = group.all_gather(&encoded)?;
    let mut start = 0;
    for (rank, &length) in lengths.iter().enumerate() {
        let end = start + length as usize;
        let theirs = decode(&flat[start..end]);
        start = end;
        if let Some(detail) = difference(&theirs, &shapes) {
            return Err(DistributedError::ModelMismatch { rank, detail });
        }
    }
    // Equal shapes with unequal fingerprints cannot happen (the fingerprint is of the shapes).
    Ok(())
}

// Every float parameter's shape, in visiting order, read without its value.
fn shapes<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let dims: [usize; D] = param.lazy_shape().dims();
            self.0.push(dims.to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    shapes.0
}

// Each shape as its rank then its dimensions.
fn encode(shapes: &[Vec<usize>]) -> Vec<u64> {
    shapes
        .iter()
        .flat_map(|dims| std::iter::once(dims.len()).chain(dims.iter().copied()))
        .map(|v| v as u64)
        .collect()
}

fn decode(encoded: &[u64]) -> Vec<Vec<usize>> {
    let mut shapes = Vec::new();
    let mut rest = encoded;
    while let Some((&rank, tail)) = rest.split_first() {
        let rank = (rank as usize).min(tail.len());
        shapes.push(tail[..rank].iter().map(|&d| d as usize).collect());
        rest = &tail[rank..];
    }
    shapes
}

// FNV-1a over the encoded shapes: the same on every process whatever its build.
fn fingerprint(shapes: &[Vec<usize>]) -> u64 {
    encode(shapes)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
}

// How `theirs` differs from `ours`, from the other process's side; `None` when it does not.
fn difference(theirs: &[Vec<usize>], ours: &[Vec<usize>]) -> Option<String> {
    if let Some(place) = (0..theirs.len().min(ours.len())).find(|&i| theirs[i] != ours[i]) {
        return Some(format!(
            "its model's parameter #{place} (in visiting order) has shape {:?} where this \
             process's has {:?}",
            theirs[place], ours[place]
        ));
    }
    (theirs.len() != ours.len()).then(|| {
        format!(
            "its model has {} float parameters where this process's has {}",
            theirs.len(),
            ours.len()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // What another process sends is decoded without a panic, and never into more than
        // the values it sent (a rank near u64::MAX takes only what follows it).
        #[test]
        fn any_encoding_decodes_within_its_length(
            encoded in proptest::collection::vec(
                prop_oneof![0u64..6, any::<u64>(), Just(u64::MAX)], 0..64),
        ) {
            let shapes = decode(&encoded);
            // Each shape takes its rank's value and at most the values left after it.
            let taken: usize = shapes.iter().map(|dims| 1 + dims.len()).sum();
            prop_assert!(taken <= encoded.len());
        }

        #[test]
        fn any_shapes_round_trip(
            shapes in proptest::collection::vec(
                proptest::collection::vec(0usize..100_000, 0..5), 0..20),
        ) {
            prop_assert_eq!(decode(&encode(&shapes)), shapes);
        }
    }

    #[test]
    fn shapes_round_trip_and_differences_are_named() {
        let ours = vec![vec![8, 16], vec![16], vec![], vec![16, 4]];
        assert_eq!(decode(&encode(&ours)), ours);
        assert_eq!(difference(&ours, &ours), None);
        let wider = vec![vec![8, 17], vec![17], vec![], vec![17, 4]];
        assert_ne!(fingerprint(&wider), fingerprint(&ours));
        assert_eq!(
            difference(&wider, &ours).unwrap(),
            "its model's parameter #0 (in visiting order) has shape [8, 17] where this \
             process's has [8, 16]"
        );
        let fewer = &ours[..3];
        assert_ne!(fingerprint(fewer), fingerprint(&ours));
        assert_eq!(
            difference(fewer, &ours).unwrap(),
            "its model has 3 float parameters where this process's has 4"
        );
    }
}
