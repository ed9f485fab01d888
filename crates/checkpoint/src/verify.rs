//! What can be checked of a checkpoint directory before training starts, cheaply (issue 49):
//! its manifest parses, and some listed checkpoint has every file on disk at its listed
//! length. A program checks it where the directory is given, so that a damaged directory is a
//! typed error it prints in one line, not a panic inside a training loop that has no error
//! channel. The checksums are left to the load itself, which falls back past a checkpoint
//! that does not verify.

use std::path::Path;

use crate::{CheckpointError, MANIFEST, Manifest, checkpoint_error, listed_file};

/// The epoch of the newest checkpoint in `dir` whose files are all there at their listed
/// lengths; `None` when none is listed (a fresh run).
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("verify-doc-{}", std::process::id()));
/// // No directory yet: a fresh run.
/// assert_eq!(burn_accelerate_checkpoint::verify::precheck(&dir), Ok(None));
/// ```
///
/// # Errors
/// [`CheckpointError`] naming the manifest when it cannot be read or parsed, or when it lists
/// checkpoints and none has its files (each epoch's first missing or cut file, by name).
pub fn precheck(dir: &Path) -> Result<Option<usize>, CheckpointError> {
    let manifest = Manifest::read(dir)?;
    let mut missing = Vec::new();
    for entry in manifest.checkpoints.iter().rev() {
        let first_bad = entry
            .files
            .iter()
            .find_map(|file| listed_file(dir, file).err());
        match first_bad {
            None => return Ok(Some(entry.epoch)),
            Some(why) => missing.push(format!("epoch {}: {why}", entry.epoch)),
        }
    }
    if missing.is_empty() {
        return Ok(None);
    }
    Err(checkpoint_error(
        &dir.join(MANIFEST),
        format!(
            "no checkpoint it lists has its files ({}): restore them, or delete the directory \
             to start the run afresh",
            missing.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CheckpointEntry, FileDigest};

    #[test]
    fn the_newest_whole_checkpoint_is_found_and_a_damaged_directory_named() {
        let dir = std::env::temp_dir().join(format!("verify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(precheck(&dir), Ok(None));
        std::fs::create_dir_all(&dir).unwrap();
        let entry = |epoch: usize| CheckpointEntry {
            epoch,
            files: vec![FileDigest::of(format!("m-{epoch}"), &[1, 2, 3])],
        };
        Manifest::default()
            .with(entry(1))
            .with(entry(2))
            .write(&dir)
            .unwrap();
        std::fs::write(dir.join("m-1"), [1, 2, 3]).unwrap();
        std::fs::write(dir.join("m-2"), [1]).unwrap();
        // Epoch 2's file is cut: epoch 1 is the one a resume will load.
        assert_eq!(precheck(&dir), Ok(Some(1)));
        std::fs::remove_file(dir.join("m-1")).unwrap();
        let err = precheck(&dir).unwrap_err();
        assert!(err.path.ends_with(MANIFEST), "{err}");
        assert!(
            err.reason
                .contains("epoch 2: m-2 is 1 bytes long, but 3 were written")
                && err.reason.contains("epoch 1: m-1 cannot be read"),
            "{err}"
        );
        std::fs::write(dir.join(MANIFEST), b"{\"version\":").unwrap();
        let err = precheck(&dir).unwrap_err();
        assert!(err.reason.contains("cannot be parsed"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
