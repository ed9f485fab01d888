//! What can be checked of a checkpoint directory before training starts, without the model
//! (issue 49): its manifest parses, and the checkpoint a resume would choose has every file at
//! its listed length and checksum, chosen as [`CheckpointDir::load_newest`] chooses (a newer
//! one that does not verify is passed over for the one before). A program checks it where the
//! directory is given, so that a damaged directory is a typed error it prints in one line, not
//! a panic inside a training loop that has no error channel. What needs the model (the
//! records' parameters and shapes) is left to the load itself.
//!
//! [`CheckpointDir::load_newest`]: crate::CheckpointDir::load_newest

use std::path::Path;

use crate::{CheckpointEntry, CheckpointError, Manifest, none_whole, verify_streaming};

/// The newest checkpoint in `dir` whose files all verify (length and SHA-256), as a resume
/// would choose it; `None` when none is listed (a fresh run). Each file is streamed through
/// the hash in turn ([`verify_streaming`]): none is held.
///
/// ```
/// # let dir = std::env::temp_dir().join(format!("verify-doc-{}", std::process::id()));
/// // No directory yet: a fresh run.
/// assert_eq!(burn_accelerate_checkpoint::verify::precheck(&dir), Ok(None));
/// ```
///
/// # Errors
/// [`CheckpointError`] naming the manifest when it cannot be read or parsed, or when it lists
/// checkpoints and none verifies (each epoch's first missing, cut or altered file, by name).
pub fn precheck(dir: &Path) -> Result<Option<CheckpointEntry>, CheckpointError> {
    let manifest = Manifest::read(dir)?;
    let choice = manifest.newest_complete(None, |entry| {
        entry
            .files
            .iter()
            .try_for_each(|file| verify_streaming(dir, file))
    });
    match choice.chosen {
        Some((epoch, ())) => Ok(manifest.entry(epoch).cloned()),
        None if choice.rejected.is_empty() => Ok(None),
        None => Err(none_whole(dir, &choice.rejected)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FileDigest, MANIFEST};

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
        assert_eq!(precheck(&dir).map(|e| e.map(|e| e.epoch)), Ok(Some(1)));
        // Its file altered at the same length: passed over too.
        std::fs::write(dir.join("m-2"), [1, 2, 4]).unwrap();
        assert_eq!(precheck(&dir).map(|e| e.map(|e| e.epoch)), Ok(Some(1)));
        std::fs::remove_file(dir.join("m-1")).unwrap();
        let err = precheck(&dir).unwrap_err();
        assert!(err.path.ends_with(MANIFEST), "{err}");
        assert!(
            err.reason
                .contains("epoch 2: m-2 does not hold what was written")
                && err.reason.contains("epoch 1: m-1 cannot be read"),
            "{err}"
        );
        std::fs::write(dir.join(MANIFEST), b"{\"version\":").unwrap();
        let err = precheck(&dir).unwrap_err();
        assert!(err.reason.contains("cannot be parsed"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
