//! Checkpoints a crash cannot corrupt: the files of a checkpoint are written under a temporary
//! name, flushed to the disk and renamed into place, and only then is the checkpoint listed in
//! the directory's manifest ([`MANIFEST`], itself replaced the same way), with each file's
//! length and SHA-256. A process killed while it writes leaves the last listed checkpoint
//! whole; one read back is checked against the manifest first, and a damaged one (a truncated
//! or altered file) is passed over, with a warning, for the one before it.
//!
//! The protocol is the crate `burn-accelerate-checkpoint`, which needs no Burn; this module
//! gives it this crate's error ([`AccelerateError::Checkpoint`]) and adds what needs Burn, once
//! for both entry points (`contents`: what a checkpoint holds and the order a run resumes from
//! it; [`CheckpointState`]: its state file): the
//! [`Accelerator`](crate::Accelerator) writes its state, a model's and an optimizer's records
//! through [`CheckpointDir`]
//! ([`Accelerator::save_checkpoint`](crate::Accelerator::save_checkpoint)) and reads the
//! newest complete checkpoint back ([`Accelerator::resume`](crate::Accelerator::resume));
//! `with_accelerate` keeps its checkpoints with it
//! ([`AccelerateStrategy::with_checkpoint_dir`](crate::train::AccelerateStrategy::with_checkpoint_dir))
//! and resumes from the newest complete one by itself.
//!
//! Only one process may write a directory (the main process, in a run of several); the others
//! read only what the manifest lists, which is never a file still being written.
//!
//! ```
//! use burn_accelerate::checkpoint::CheckpointDir;
//!
//! let dir = std::env::temp_dir().join(format!("ckpt-doc-{}", std::process::id()));
//! let checkpoints = CheckpointDir::new(&dir).with_keep_last(2);
//! for epoch in 1..=3 {
//!     checkpoints.save(epoch, &[("state.json", format!("{{\"epoch\":{epoch}}}").as_bytes())])?;
//! }
//! let newest = checkpoints.load_newest(None)?.expect("three were written");
//! assert_eq!(newest.epoch, 3);
//! assert_eq!(newest.files["state.json"], br#"{"epoch":3}"#);
//! // The first went: two are kept.
//! assert!(checkpoints.load(1).is_err());
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), burn_accelerate::AccelerateError>(())
//! ```

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

use burn_accelerate_checkpoint as files;
pub use burn_accelerate_checkpoint::{
    CRASH_WRITING, CheckpointEntry, CheckpointError, Choice, FileDigest, LoadedCheckpoint,
    MANIFEST, PARTIAL, parse_crash_writing, read_verified,
};

use crate::AccelerateError;

mod accelerator;
mod agree;
pub(crate) mod contents;
mod fits;
pub(crate) mod records;
pub(crate) mod sharded;
mod state;
pub use crate::zero::CheckpointLayout;
pub use accelerator::Resumed;
#[cfg(all(test, feature = "flex"))]
pub(crate) use agree::agree_on_checkpoint;
pub(crate) use agree::agree_on_checkpoint_keeping;
pub(crate) use fits::decode_model;
pub use state::CheckpointState;
pub(crate) use state::LoaderPosition;

/// The checkpoints of a directory: [`burn_accelerate_checkpoint::CheckpointDir`], failing with
/// [`AccelerateError::Checkpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointDir(files::CheckpointDir);

impl CheckpointDir {
    /// The checkpoints in `dir` (made when the first is saved), keeping the newest 2.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self(files::CheckpointDir::new(dir))
    }

    /// Keeps the newest `keep` checkpoints (0 is taken as 1: the newest is never deleted).
    pub fn with_keep_last(self, keep: usize) -> Self {
        Self(self.0.with_keep_last(keep))
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// Writes the checkpoint of `epoch` (`files`: names in the directory and contents), lists
    /// it, and deletes the files of the checkpoints beyond the newest kept.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when a file or the manifest cannot be written (the
    /// checkpoints listed before are then still whole).
    pub fn save(
        &self,
        epoch: usize,
        files: &[(&str, &[u8])],
    ) -> Result<CheckpointEntry, AccelerateError> {
        Ok(self.0.save(epoch, files)?)
    }

    /// [`save`](Self::save), keeping on disk the files of dropped checkpoints for which
    /// `spare` says so (they are no longer listed).
    ///
    /// # Errors
    /// As [`save`](Self::save).
    pub fn save_sparing(
        &self,
        epoch: usize,
        files: &[(&str, &[u8])],
        spare: impl Fn(&str) -> bool,
    ) -> Result<CheckpointEntry, AccelerateError> {
        Ok(self.0.save_sparing(epoch, files, spare)?)
    }

    /// The newest listed checkpoint (of an epoch up to `at_most`) whose files verify, read
    /// back; newer ones that do not are passed over with a warning. `None` when none is
    /// listed.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when the manifest cannot be read, or when checkpoints
    /// are listed but none verifies (a run must not silently start over).
    pub fn load_newest(
        &self,
        at_most: Option<usize>,
    ) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
        Ok(self.0.load_newest(at_most)?)
    }

    /// The checkpoint of `epoch`, read back and verified.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when it is not listed or does not verify.
    pub fn load(&self, epoch: usize) -> Result<LoadedCheckpoint, AccelerateError> {
        Ok(self.0.load(epoch)?)
    }

    /// [`save_sparing`](Self::save_sparing), listing with `files` the files `written` that
    /// other processes wrote already: see
    /// [`burn_accelerate_checkpoint::CheckpointDir::save_with_written`].
    ///
    /// # Errors
    /// As [`save`](Self::save).
    pub(crate) fn save_with_written(
        &self,
        epoch: usize,
        files: &[(&str, &[u8])],
        written: Vec<FileDigest>,
        spare: impl Fn(&str) -> bool,
    ) -> Result<CheckpointEntry, AccelerateError> {
        Ok(self.0.save_with_written(epoch, files, written, spare)?)
    }

    /// [`load_newest`](Self::load_newest) with a check of completeness and a choice of the
    /// files kept: see [`burn_accelerate_checkpoint::CheckpointDir::load_newest_where`].
    ///
    /// # Errors
    /// As [`load_newest`](Self::load_newest).
    pub(crate) fn load_newest_where(
        &self,
        at_most: Option<usize>,
        complete: impl Fn(&CheckpointEntry) -> Result<(), String>,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Option<LoadedCheckpoint>, AccelerateError> {
        Ok(self.0.load_newest_where(at_most, complete, keep)?)
    }

    /// The checkpoint of `epoch`, every file verified, only those `keep` names kept in
    /// memory: see [`burn_accelerate_checkpoint::CheckpointDir::load_verifying_all`].
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub(crate) fn load_verifying_all(
        &self,
        epoch: usize,
        keep: impl Fn(&str) -> bool,
    ) -> Result<LoadedCheckpoint, AccelerateError> {
        Ok(self.0.load_verifying_all(epoch, keep)?)
    }

    /// The files of the checkpoint of `epoch` that `keep` names, read back and verified.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub(crate) fn load_keeping(
        &self,
        epoch: usize,
        keep: impl Fn(&str) -> bool,
    ) -> Result<LoadedCheckpoint, AccelerateError> {
        Ok(self.0.load_keeping(epoch, keep)?)
    }
}

/// A directory's manifest: [`burn_accelerate_checkpoint::Manifest`] (its fields and queries
/// through `Deref`), read and written with [`AccelerateError::Checkpoint`] as the failure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest(files::Manifest);

impl Manifest {
    /// The manifest of `dir` (an empty one when there is none yet).
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when it exists but cannot be read or parsed.
    pub fn read(dir: &Path) -> Result<Self, AccelerateError> {
        Ok(Self(files::Manifest::read(dir)?))
    }

    /// Writes it into `dir` under a temporary name, flushed, then renamed over the old one.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] when the directory cannot be written.
    pub fn write(&self, dir: &Path) -> Result<(), AccelerateError> {
        Ok(self.0.write(dir)?)
    }

    /// The manifest with `entry` listed (in place of an older entry of its epoch).
    pub fn with(self, entry: CheckpointEntry) -> Self {
        Self(self.0.with(entry))
    }

    /// The manifest with `file` in place of the file of its name in epoch `epoch`'s entry (a
    /// file rewritten on purpose, whole); `None` when that entry does not list it.
    pub fn relisted(self, epoch: usize, file: FileDigest) -> Option<Self> {
        self.0.relisted(epoch, file).map(Self)
    }
}

impl Deref for Manifest {
    type Target = files::Manifest;

    fn deref(&self) -> &files::Manifest {
        &self.0
    }
}

impl DerefMut for Manifest {
    fn deref_mut(&mut self) -> &mut files::Manifest {
        &mut self.0
    }
}

/// Writes `bytes` as `dir/name` so that no reader, and no crash, ever sees part of them
/// ([`burn_accelerate_checkpoint::write_atomic`]). Returns what was written.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] when the directory cannot be written.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<FileDigest, AccelerateError> {
    Ok(files::write_atomic(dir, name, bytes)?)
}
