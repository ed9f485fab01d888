//! Which checkpoint a run resumes from, for both entry points: the main process picks, and
//! every process loads its pick (each choosing for itself could start processes from
//! different checkpoints, when one is written or damaged while they look).

use super::{CheckpointDir, LoadedCheckpoint};
use crate::AccelerateError;
use crate::distributed::ProcessGroup;

/// The checkpoint every process of `group` (one process: `None`) resumes from, read back;
/// `None` to start afresh. `pick` runs on the main process alone, given `held`; the others are
/// told its number and read that checkpoint of `checkpoints`, unless `held` is that one.
/// `held` is a checkpoint this process read and verified already (the start-up check's):
/// nothing is read or hashed twice. Every process must call it.
///
/// # Errors
/// What `pick` returns; [`AccelerateError::Distributed`] when the processes cannot agree;
/// [`AccelerateError::Checkpoint`] when a process cannot read the checkpoint picked.
// Both entry points agree keeping only the files a process reads
// ([`agree_on_checkpoint_keeping`]); this is the tests' whole-checkpoint form.
#[cfg(test)]
pub(crate) fn agree_on_checkpoint(
    group: Option<&ProcessGroup>,
    checkpoints: &CheckpointDir,
    held: Option<LoadedCheckpoint>,
    pick: impl FnOnce(Option<LoadedCheckpoint>) -> Result<Option<LoadedCheckpoint>, AccelerateError>,
) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
    agree_on_checkpoint_keeping(group, checkpoints, held, pick, |_| true)
}

/// [`agree_on_checkpoint`], where the processes other than the main one read (and verify)
/// only the files of the picked checkpoint that `keep` names: the main process's `pick`
/// verified them all (a sharded checkpoint's process reads its own partition's). A checkpoint
/// verified without keeping every file `keep` names (`held`, the start-up check's, which keeps
/// of a sharded checkpoint only the shard files this process surely reads) has those files
/// read now, each checked against the digest it verified with
/// ([`LoadedCheckpoint::keep_also`]).
///
/// # Errors
/// As [`agree_on_checkpoint`]; [`AccelerateError::Checkpoint`] naming a file `keep` names
/// that changed after it was verified (it is not loaded).
pub(crate) fn agree_on_checkpoint_keeping(
    group: Option<&ProcessGroup>,
    checkpoints: &CheckpointDir,
    held: Option<LoadedCheckpoint>,
    pick: impl FnOnce(Option<LoadedCheckpoint>) -> Result<Option<LoadedCheckpoint>, AccelerateError>,
    keep: impl Fn(&str) -> bool,
) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
    let rank = group.map_or(0, ProcessGroup::rank);
    let (picked, held) = if rank == 0 {
        (pick(held)?, None)
    } else {
        (None, held)
    };
    let number = picked.as_ref().map(|loaded| loaded.epoch);
    let number = match group {
        Some(group) => group.broadcast_object(&number, 0)?,
        None => number,
    };
    let Some(number) = number else {
        return Ok(None);
    };
    let mut loaded =
        match (picked, held) {
            (Some(loaded), _) => loaded,
            (None, Some(held)) if held.epoch == number => held,
            (None, _) => checkpoints.load_keeping(number, &keep).map_err(|err| {
                AccelerateError::Checkpoint {
                    path: checkpoints.path().display().to_string(),
                    reason: format!(
                        "process {rank} cannot read checkpoint {number}, which the main process \
                     resumes from (every process needs the same checkpoint directory): {err}"
                    ),
                }
            })?,
        };
    loaded
        .keep_also(checkpoints.path(), &keep)
        .map_err(|err| AccelerateError::Checkpoint {
            path: err.path,
            reason: format!(
                "process {rank}: {}",
                super::records::changed_after_start_up(&err.reason)
            ),
        })?;
    Ok(Some(loaded))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_loads_what_it_picks_or_starts_afresh() {
        let dir = std::env::temp_dir().join(format!("agree-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let checkpoints = CheckpointDir::new(&dir);
        let none = agree_on_checkpoint(None, &checkpoints, None, |_| checkpoints.load_newest(None));
        assert!(none.unwrap().is_none());
        checkpoints.save(4, &[("a", b"four")]).unwrap();
        let loaded =
            agree_on_checkpoint(None, &checkpoints, None, |_| checkpoints.load_newest(None))
                .unwrap()
                .unwrap();
        assert_eq!(
            (loaded.epoch, loaded.files["a"].as_slice()),
            (4, &b"four"[..])
        );
        let err = agree_on_checkpoint(None, &checkpoints, None, |_| checkpoints.load(9).map(Some))
            .unwrap_err();
        assert!(matches!(err, AccelerateError::Checkpoint { .. }), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
