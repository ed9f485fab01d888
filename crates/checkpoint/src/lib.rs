//! Checkpoints a crash cannot corrupt: the files of a checkpoint are written under a temporary
//! name, flushed to the disk and renamed into place, and only then is the checkpoint listed in
//! the directory's manifest ([`MANIFEST`], itself replaced the same way), with each file's
//! length and SHA-256. A process killed while it writes leaves the last listed checkpoint
//! whole; one read back is checked against the manifest first, and a damaged one (a truncated
//! or altered file) is passed over, with a warning, for the one before it.
//!
//! [`CheckpointDir`] is the whole protocol for any loop, with no Burn in it (bytes and files);
//! burn-accelerate's `Accelerator` writes its state, a model's and an optimizer's records
//! through it (`Accelerator::save_checkpoint`) and reads the newest complete checkpoint back
//! (`Accelerator::resume`); `with_accelerate` keeps its checkpoints with it
//! (`AccelerateStrategy::with_checkpoint_dir`) and resumes from the newest complete one by
//! itself. The pieces are plain functions over plain values ([`FileDigest`], [`Manifest`]),
//! tested on their own. Every failure is a [`CheckpointError`] naming the file.
//!
//! Only one process may write a directory (the main process, in a run of several); the others
//! read only what the manifest lists, which is never a file still being written.
//!
//! ```
//! use burn_accelerate_checkpoint::CheckpointDir;
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
//! # Ok::<(), burn_accelerate_checkpoint::CheckpointError>(())
//! ```
//!
//! # Test hook
//!
//! `BURN_ACCELERATE_TEST_CRASH_WRITING=RESTART:FILE` (for tests only: it kills the process)
//! makes the writer of the attempt whose restart count is `RESTART` (0: the first start, see
//! [`restart_count`](burn_accelerate_comm::restart_count)) write half of `FILE`
//! under its temporary name and then kill its own process with `SIGKILL`: how the tests show
//! that a crash in the middle of a checkpoint leaves the previous one to resume from.

pub mod verify;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What went wrong with a checkpoint directory: the file, and why, in words that say what to
/// do (burn-accelerate shows it as `AccelerateError::Checkpoint`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("accelerate checkpoint state {path}: {reason}")]
pub struct CheckpointError {
    /// The file or directory.
    pub path: String,
    /// Why, and what to do.
    pub reason: String,
}

/// The manifest's name in a checkpoint directory: the list of complete checkpoints.
pub const MANIFEST: &str = "accelerate-checkpoints.json";

/// The suffix of a file while it is written (before its rename).
pub const PARTIAL: &str = ".partial";

/// The manifest's format.
const VERSION: u32 = 1;

/// The test hook's variable (see the [module docs](self)).
pub const CRASH_WRITING: &str = "BURN_ACCELERATE_TEST_CRASH_WRITING";

/// One file of a checkpoint as it was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Its name in the checkpoint directory.
    pub name: String,
    /// Its length in bytes.
    pub size: u64,
    /// Its SHA-256, in lowercase hex.
    pub sha256: String,
}

impl FileDigest {
    /// The digest of `bytes`, written as `name`.
    pub fn of(name: impl Into<String>, bytes: &[u8]) -> Self {
        Self {
            name: name.into(),
            size: bytes.len() as u64,
            sha256: hex(&Sha256::digest(bytes)),
        }
    }

    /// Whether `bytes` (read back) are what was written: the length first (a truncated file
    /// says so), then the checksum.
    ///
    /// # Errors
    /// What differs, in words.
    pub fn check(&self, bytes: &[u8]) -> Result<(), String> {
        if bytes.len() as u64 != self.size {
            return Err(format!(
                "{} is {} bytes long, but {} were written",
                self.name,
                bytes.len(),
                self.size
            ));
        }
        self.check_sha256(&hex(&Sha256::digest(bytes)))
    }

    // Whether `sha256` (of the file read back, at its listed length) is the one written.
    fn check_sha256(&self, sha256: &str) -> Result<(), String> {
        if sha256 != self.sha256 {
            return Err(format!(
                "{} does not hold what was written (SHA-256 {sha256}, {} was written)",
                self.name, self.sha256
            ));
        }
        Ok(())
    }
}

/// One complete checkpoint: its number (an epoch, or a step of a hand-written loop) and its
/// files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEntry {
    /// The epoch (or step) it was taken after.
    pub epoch: usize,
    /// Its files, as written.
    pub files: Vec<FileDigest>,
}

impl CheckpointEntry {
    /// The file named `name`, if the checkpoint has it.
    pub fn file(&self, name: &str) -> Option<&FileDigest> {
        self.files.iter().find(|f| f.name == name)
    }
}

/// The list of a directory's complete checkpoints, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Its format.
    pub version: u32,
    /// The checkpoints, by increasing epoch.
    pub checkpoints: Vec<CheckpointEntry>,
}

impl Default for Manifest {
    fn default() -> Self {
        Self {
            version: VERSION,
            checkpoints: Vec::new(),
        }
    }
}

/// Which checkpoint [`Manifest::newest_complete`] chose, and why it passed over the newer ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice<T> {
    /// The newest that verified, and what verifying it gave.
    pub chosen: Option<(usize, T)>,
    /// The newer ones that did not, newest first, and why.
    pub rejected: Vec<(usize, String)>,
}

impl Manifest {
    /// Reads `dir`'s manifest; an empty one where there is none yet.
    ///
    /// # Errors
    /// [`CheckpointError`] when it exists but cannot be read or parsed (it is
    /// only ever replaced whole, so something else damaged it).
    pub fn read(dir: &Path) -> Result<Self, CheckpointError> {
        let path = dir.join(MANIFEST);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(checkpoint_error(&path, e.to_string())),
        };
        Self::from_json(&bytes, &path)
    }

    // The manifest `bytes` read from `path` (named in the errors), checked as [`read`] says:
    // the decoder itself, which the property tests run from memory.
    fn from_json(bytes: &[u8], path: &Path) -> Result<Self, CheckpointError> {
        let manifest: Self = serde_json::from_slice(bytes).map_err(|e| {
            checkpoint_error(
                path,
                format!(
                    "it cannot be parsed ({e}); it is only ever replaced whole, so something \
                     else wrote it: restore it, or delete it to start afresh"
                ),
            )
        })?;
        if manifest.version != VERSION {
            return Err(checkpoint_error(
                path,
                format!(
                    "it is of format {}, this build reads format {VERSION}",
                    manifest.version
                ),
            ));
        }
        // What `write` never writes, checked so that the checkpoint loaded and the entry that
        // names it are the same (issue 49: a manifest listing an epoch twice loaded one
        // entry's files under the other's).
        let damaged = |why: String| {
            checkpoint_error(
                path,
                format!("{why}; it is only ever replaced whole, so something else wrote it"),
            )
        };
        for pair in manifest.checkpoints.windows(2) {
            if pair[0].epoch >= pair[1].epoch {
                return Err(damaged(format!(
                    "it lists epoch {} after epoch {}",
                    pair[1].epoch, pair[0].epoch
                )));
            }
        }
        for entry in &manifest.checkpoints {
            let mut names: Vec<&str> = entry.files.iter().map(|f| f.name.as_str()).collect();
            names.sort_unstable();
            if let Some(twice) = names.windows(2).find(|w| w[0] == w[1]) {
                return Err(damaged(format!(
                    "it lists {} twice in the checkpoint of epoch {}",
                    twice[0], entry.epoch
                )));
            }
        }
        Ok(manifest)
    }

    /// Writes it into `dir` under a temporary name, flushed, then renamed over the old one.
    ///
    /// # Errors
    /// [`CheckpointError`] when the directory cannot be written.
    pub fn write(&self, dir: &Path) -> Result<(), CheckpointError> {
        let bytes = serde_json::to_vec_pretty(self).expect("a manifest serialises");
        write_atomic(dir, MANIFEST, &bytes).map(|_| ())
    }

    /// The manifest with `entry` listed (in place of an older entry of its epoch).
    pub fn with(mut self, entry: CheckpointEntry) -> Self {
        self.checkpoints.retain(|c| c.epoch != entry.epoch);
        let at = self.checkpoints.partition_point(|c| c.epoch < entry.epoch);
        self.checkpoints.insert(at, entry);
        self
    }

    /// The manifest with `file` in place of the file of its name in epoch `epoch`'s entry (a
    /// file rewritten on purpose, whole); `None` when that entry does not list it.
    pub fn relisted(mut self, epoch: usize, file: FileDigest) -> Option<Self> {
        let listed = self
            .checkpoints
            .iter_mut()
            .find(|c| c.epoch == epoch)?
            .files
            .iter_mut()
            .find(|f| f.name == file.name)?;
        *listed = file;
        Some(self)
    }

    /// The entry of epoch `epoch`.
    pub fn entry(&self, epoch: usize) -> Option<&CheckpointEntry> {
        self.checkpoints.iter().find(|c| c.epoch == epoch)
    }

    /// The newest checkpoint (of an epoch up to `at_most`) that `verify` accepts, and the
    /// newer ones it rejected, with why.
    pub fn newest_complete<T>(
        &self,
        at_most: Option<usize>,
        mut verify: impl FnMut(&CheckpointEntry) -> Result<T, String>,
    ) -> Choice<T> {
        let mut rejected = Vec::new();
        for entry in self.checkpoints.iter().rev() {
            if at_most.is_some_and(|limit| entry.epoch > limit) {
                continue;
            }
            match verify(entry) {
                Ok(value) => {
                    return Choice {
                        chosen: Some((entry.epoch, value)),
                        rejected,
                    };
                }
                Err(why) => rejected.push((entry.epoch, why)),
            }
        }
        Choice {
            chosen: None,
            rejected,
        }
    }

    /// Keeps the newest `keep` checkpoints (at least one) and returns the others, which it no
    /// longer lists.
    pub fn retain_last(&mut self, keep: usize) -> Vec<CheckpointEntry> {
        let drop = self.checkpoints.len().saturating_sub(keep.max(1));
        self.checkpoints.drain(..drop).collect()
    }
}

/// A checkpoint read back and verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedCheckpoint {
    /// The epoch (or step) it was taken after.
    pub epoch: usize,
    /// Its files' bytes, by name.
    pub files: BTreeMap<String, Vec<u8>>,
    /// The newer checkpoints passed over because they did not verify, newest first, and why
    /// (each was also logged as a warning).
    pub skipped: Vec<(usize, String)>,
    /// The checkpoint's files that were verified but not kept (streamed through the hash, not
    /// held: see [`CheckpointDir::load_newest_where`]), as they verified. They are read again
    /// only through [`bytes`](Self::bytes) and [`keep_also`](Self::keep_also), which check
    /// them against these digests: a file changed since is refused, never loaded unverified.
    pub unkept: Vec<FileDigest>,
}

impl LoadedCheckpoint {
    /// The names of every file of the checkpoint that was verified: those held in
    /// [`files`](Self::files), then those [`unkept`](Self::unkept).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.files
            .keys()
            .map(String::as_str)
            .chain(self.unkept.iter().map(|file| file.name.as_str()))
    }

    /// The bytes of file `name`: held, or read from `dir` (the checkpoint's directory) and
    /// checked against the digest it verified with when it was not kept; `None` when no file
    /// of that name was verified. A file read here is not kept: one file's bytes at a time.
    ///
    /// # Errors
    /// [`CheckpointError`] naming the file's path when it cannot be read or no longer holds
    /// what was verified.
    pub fn bytes(&self, dir: &Path, name: &str) -> Result<Option<Cow<'_, [u8]>>, CheckpointError> {
        if let Some(bytes) = self.files.get(name) {
            return Ok(Some(Cow::Borrowed(bytes)));
        }
        let Some(file) = self.unkept.iter().find(|file| file.name == name) else {
            return Ok(None);
        };
        read_again(dir, file).map(|bytes| Some(Cow::Owned(bytes)))
    }

    /// Reads from `dir` (the checkpoint's directory) into [`files`](Self::files) the files
    /// not kept that `keep` names, each checked against the digest it verified with: what a
    /// process needs of a checkpoint verified without keeping it, when it loads it.
    ///
    /// # Errors
    /// [`CheckpointError`] naming the first file's path that cannot be read or no longer
    /// holds what was verified (the files read before it are kept).
    pub fn keep_also(
        &mut self,
        dir: &Path,
        keep: impl Fn(&str) -> bool,
    ) -> Result<(), CheckpointError> {
        let (wanted, unkept): (Vec<FileDigest>, Vec<FileDigest>) = std::mem::take(&mut self.unkept)
            .into_iter()
            .partition(|file| keep(&file.name));
        self.unkept = unkept;
        let mut wanted = wanted.into_iter();
        while let Some(file) = wanted.next() {
            match read_again(dir, &file) {
                Ok(bytes) => {
                    self.files.insert(file.name, bytes);
                }
                Err(err) => {
                    self.unkept.push(file);
                    self.unkept.extend(wanted);
                    return Err(err);
                }
            }
        }
        Ok(())
    }
}

// `file`, verified before and not kept, read from `dir` and checked against its digest again.
fn read_again(dir: &Path, file: &FileDigest) -> Result<Vec<u8>, CheckpointError> {
    read_verified(dir, file).map_err(|why| {
        checkpoint_error(
            &dir.join(&file.name),
            format!("{why}: it changed after the checkpoint was verified, and is not loaded"),
        )
    })
}

/// A directory of crash-safe checkpoints (see the [module docs](self)), keeping the newest
/// few.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointDir {
    dir: PathBuf,
    keep: usize,
}

impl CheckpointDir {
    /// The checkpoints in `dir` (made when the first is saved), keeping the newest 2.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            keep: 2,
        }
    }

    /// Keeps the newest `keep` checkpoints (0 is taken as 1: the newest is never deleted).
    pub fn with_keep_last(mut self, keep: usize) -> Self {
        self.keep = keep.max(1);
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes the checkpoint of `epoch` (`files`: names in the directory and contents), lists
    /// it, and deletes the files of the checkpoints beyond the newest kept.
    ///
    /// # Errors
    /// [`CheckpointError`] when a file or the manifest cannot be written (the
    /// checkpoints listed before are then still whole).
    pub fn save(
        &self,
        epoch: usize,
        files: &[(&str, &[u8])],
    ) -> Result<CheckpointEntry, CheckpointError> {
        self.save_sparing(epoch, files, |_| false)
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
    ) -> Result<CheckpointEntry, CheckpointError> {
        self.save_with_written(epoch, files, Vec::new(), spare)
    }

    /// [`save_sparing`](Self::save_sparing), listing with `files` the files `written` that
    /// other processes wrote into the directory already ([`write_atomic`], each flushed and
    /// renamed: a sharded checkpoint's partitions). The checkpoint is listed once, whole, by
    /// this process alone, after every file of it is on the disk.
    ///
    /// # Errors
    /// As [`save`](Self::save); a name of `written` that is not a plain name in the directory,
    /// or also one of `files`.
    pub fn save_with_written(
        &self,
        epoch: usize,
        files: &[(&str, &[u8])],
        written: Vec<FileDigest>,
        spare: impl Fn(&str) -> bool,
    ) -> Result<CheckpointEntry, CheckpointError> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| checkpoint_error(&self.dir, e.to_string()))?;
        for file in &written {
            plain_name(file).map_err(|why| checkpoint_error(&self.dir, why))?;
            if files.iter().any(|(name, _)| *name == file.name) {
                return Err(checkpoint_error(
                    &self.dir.join(&file.name),
                    "written by another process and given to write again".into(),
                ));
            }
        }
        let mut digests = Vec::with_capacity(files.len() + written.len());
        for (name, bytes) in files {
            digests.push(write_atomic(&self.dir, name, bytes)?);
        }
        digests.extend(written);
        let entry = CheckpointEntry {
            epoch,
            files: digests,
        };
        // Listed only once every file is whole on the disk: a crash before this line leaves
        // the manifest as it was.
        let mut manifest = Manifest::read(&self.dir)?.with(entry.clone());
        let dropped = manifest.retain_last(self.keep);
        manifest.write(&self.dir)?;
        let listed: Vec<&str> = manifest
            .checkpoints
            .iter()
            .flat_map(|c| c.files.iter().map(|f| f.name.as_str()))
            .collect();
        for file in dropped.iter().flat_map(|c| &c.files) {
            if !listed.contains(&file.name.as_str()) && !spare(&file.name) {
                let _ = std::fs::remove_file(self.dir.join(&file.name));
            }
        }
        Ok(entry)
    }

    /// The newest listed checkpoint (of an epoch up to `at_most`) whose files verify, read
    /// back; newer ones that do not are passed over with a warning. `None` when none is
    /// listed.
    ///
    /// # Errors
    /// [`CheckpointError`] when the manifest cannot be read, or when checkpoints
    /// are listed but none verifies (a run must not silently start over).
    pub fn load_newest(
        &self,
        at_most: Option<usize>,
    ) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
        self.load_newest_where(at_most, |_| Ok(()), |_| true)
    }

    /// [`load_newest`](Self::load_newest), where a checkpoint is whole only when `complete`
    /// accepts its entry too (a sharded checkpoint lists every process's files) and every
    /// file verifies; of the chosen one, only the files `keep` names are kept in memory (the
    /// others are streamed through the hash in chunks and not kept, and listed in
    /// [`LoadedCheckpoint::unkept`]: a process of a sharded run keeps its own partition's).
    /// At most the kept files and one chunk are held.
    ///
    /// # Errors
    /// As [`load_newest`](Self::load_newest).
    pub fn load_newest_where(
        &self,
        at_most: Option<usize>,
        complete: impl Fn(&CheckpointEntry) -> Result<(), String>,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Option<LoadedCheckpoint>, CheckpointError> {
        let manifest = Manifest::read(&self.dir)?;
        let choice = manifest.newest_complete(at_most, |entry| {
            complete(entry)?;
            read_entry(&self.dir, entry, &keep)
        });
        for (epoch, why) in &choice.rejected {
            log::warn!(
                "burn-accelerate: the checkpoint of epoch {epoch} in {} is damaged ({why}): \
                 passed over for an older one",
                self.dir.display()
            );
        }
        match choice.chosen {
            Some((epoch, (files, unkept))) => Ok(Some(LoadedCheckpoint {
                epoch,
                files,
                skipped: choice.rejected,
                unkept,
            })),
            None if choice.rejected.is_empty() => Ok(None),
            None => Err(none_whole(&self.dir, &choice.rejected)),
        }
    }

    /// The checkpoint of `epoch`, read back and verified.
    ///
    /// # Errors
    /// [`CheckpointError`] when it is not listed or does not verify.
    pub fn load(&self, epoch: usize) -> Result<LoadedCheckpoint, CheckpointError> {
        self.load_keeping(epoch, |_| true)
    }

    /// The files of the checkpoint of `epoch` that `keep` names, read back and verified (the
    /// others are not read: a process resuming from the checkpoint another process chose and
    /// verified whole).
    ///
    /// # Errors
    /// [`CheckpointError`] when it is not listed or a file kept does not verify.
    pub fn load_keeping(
        &self,
        epoch: usize,
        keep: impl Fn(&str) -> bool,
    ) -> Result<LoadedCheckpoint, CheckpointError> {
        let mut entry = self.listed(epoch)?;
        entry.files.retain(|file| keep(&file.name));
        self.read_listed(&entry, |_| true)
    }

    /// The checkpoint of `epoch`, every file verified as [`load`](Self::load) verifies it, of
    /// which only those `keep` names are kept in memory: the others are streamed through the
    /// hash and listed in [`LoadedCheckpoint::unkept`] (a main process resuming from an epoch
    /// asked for, which verifies the files the other processes read).
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn load_verifying_all(
        &self,
        epoch: usize,
        keep: impl Fn(&str) -> bool,
    ) -> Result<LoadedCheckpoint, CheckpointError> {
        self.read_listed(&self.listed(epoch)?, keep)
    }

    // The manifest's entry of `epoch`.
    fn listed(&self, epoch: usize) -> Result<CheckpointEntry, CheckpointError> {
        let manifest = Manifest::read(&self.dir)?;
        manifest.entry(epoch).cloned().ok_or_else(|| {
            let listed: Vec<usize> = manifest.checkpoints.iter().map(|c| c.epoch).collect();
            checkpoint_error(
                &self.dir.join(MANIFEST),
                format!(
                    "it lists no checkpoint of epoch {epoch} (it lists {listed:?}): is this the \
                     directory the run writes (the same for every process)?"
                ),
            )
        })
    }

    // The files of `entry` verified, those `keep` names kept.
    fn read_listed(
        &self,
        entry: &CheckpointEntry,
        keep: impl Fn(&str) -> bool,
    ) -> Result<LoadedCheckpoint, CheckpointError> {
        let epoch = entry.epoch;
        let (files, unkept) = read_entry(&self.dir, entry, keep).map_err(|why| {
            checkpoint_error(
                &self.dir.join(MANIFEST),
                format!("the checkpoint of epoch {epoch}: {why}"),
            )
        })?;
        Ok(LoadedCheckpoint {
            epoch,
            files,
            skipped: Vec::new(),
            unkept,
        })
    }
}

// The error of a directory that lists checkpoints none of which verifies (`rejected`: each
// one's epoch and why), naming its manifest.
fn none_whole(dir: &Path, rejected: &[(usize, String)]) -> CheckpointError {
    let each: Vec<String> = rejected
        .iter()
        .map(|(epoch, why)| format!("epoch {epoch}: {why}"))
        .collect();
    checkpoint_error(
        &dir.join(MANIFEST),
        format!(
            "no checkpoint it lists is whole ({}): restore the files, or delete the directory \
             to start the run afresh",
            each.join("; ")
        ),
    )
}

// What `read_entry` gives: the files kept, by name, and the digests of those not kept.
type Verified = (BTreeMap<String, Vec<u8>>, Vec<FileDigest>);

// Every file of `entry` checked against what was written: those `keep` names read and kept,
// the others streamed through the hash and listed.
fn read_entry(
    dir: &Path,
    entry: &CheckpointEntry,
    keep: impl Fn(&str) -> bool,
) -> Result<Verified, String> {
    let mut files = BTreeMap::new();
    let mut unkept = Vec::new();
    for file in &entry.files {
        if keep(&file.name) {
            files.insert(file.name.clone(), read_verified(dir, file)?);
        } else {
            verify_streaming(dir, file)?;
            unkept.push(file.clone());
        }
    }
    Ok((files, unkept))
}

/// `file` of `dir` checked against its digest as [`read_verified`] checks it, copied through
/// the hash by `std::io::copy`'s small buffer and not kept: what verifying a file this process
/// does not load costs in memory is that buffer, whatever the file's size.
///
/// # Errors
/// Why it cannot be used, in words (as [`read_verified`]'s).
pub fn verify_streaming(dir: &Path, file: &FileDigest) -> Result<(), String> {
    let path = listed_file(dir, file)?;
    let unreadable = |e: std::io::Error| format!("{} cannot be read ({e})", file.name);
    let reader = std::fs::File::open(&path).map_err(unreadable)?;
    let mut hasher = Sha256::new();
    // One byte past the length written: a file grown since its length was checked is found
    // without reading more than was written.
    let len = std::io::copy(&mut reader.take(file.size + 1), &mut hasher).map_err(unreadable)?;
    if len != file.size {
        return Err(format!(
            "{} is {} bytes long, but {} were written",
            file.name,
            if len > file.size {
                format!("more than {}", file.size)
            } else {
                len.to_string()
            },
            file.size
        ));
    }
    file.check_sha256(&hex(&hasher.finalize()))
}

/// `file`'s path in `dir`, once it is known to be a plain name there whose file on disk has
/// the listed length: what can be checked without reading it.
///
/// # Errors
/// Why not, in words naming the file.
pub(crate) fn listed_file(dir: &Path, file: &FileDigest) -> Result<PathBuf, String> {
    plain_name(file)?;
    let path = dir.join(&file.name);
    // The length first: a file longer than listed is refused before it is read, so that
    // neither the manifest's sizes nor the file's make the process read more than was
    // written (issue 49).
    let len = std::fs::metadata(&path)
        .map_err(|e| format!("{} cannot be read ({e})", file.name))?
        .len();
    if len != file.size {
        return Err(format!(
            "{} is {len} bytes long, but {} were written",
            file.name, file.size
        ));
    }
    Ok(path)
}

// A manifest names files of its own directory only: no `..`, no absolute path, which would
// read a file outside it (issue 49).
fn plain_name(file: &FileDigest) -> Result<(), String> {
    let mut parts = Path::new(&file.name).components();
    if !matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    ) {
        return Err(format!(
            "{:?} is not the name of a file in the checkpoint directory",
            file.name
        ));
    }
    Ok(())
}

/// `file` read from `dir` and checked against its digest.
///
/// # Errors
/// Why it cannot be used, in words.
pub fn read_verified(dir: &Path, file: &FileDigest) -> Result<Vec<u8>, String> {
    let path = listed_file(dir, file)?;
    let bytes = std::fs::read(&path).map_err(|e| format!("{} cannot be read ({e})", file.name))?;
    file.check(&bytes)?;
    Ok(bytes)
}

/// Writes `bytes` as `dir/name` so that no reader, and no crash, ever sees part of them: into
/// `name` + [`PARTIAL`], flushed to the disk, renamed over `name`, and the rename flushed.
/// Returns what was written.
///
/// # Errors
/// [`CheckpointError`] when the directory cannot be written.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<FileDigest, CheckpointError> {
    let path = dir.join(name);
    let partial = dir.join(format!("{name}{PARTIAL}"));
    let io = |e: std::io::Error| checkpoint_error(&path, e.to_string());
    let mut file = std::fs::File::create(&partial).map_err(io)?;
    if crash_here(name) {
        // The test hook: half the file, on the disk, and the process gone.
        let _ = file.write_all(&bytes[..bytes.len() / 2]);
        let _ = file.sync_all();
        kill_this_process();
    }
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    std::fs::rename(&partial, &path).map_err(io)?;
    sync_dir(dir).map_err(io)?;
    Ok(FileDigest::of(name, bytes))
}

// The rename is the directory's: without flushing it, a power loss may undo it.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// The restart count and file named by the test hook's value `RESTART:FILE`.
pub fn parse_crash_writing(value: &str) -> Option<(u64, &str)> {
    let (restart, file) = value.trim().split_once(':')?;
    let restart = restart.trim().parse().ok()?;
    let file = file.trim();
    (!file.is_empty()).then_some((restart, file))
}

// Whether the test hook asks this process to die writing `name`.
fn crash_here(name: &str) -> bool {
    let Ok(value) = std::env::var(CRASH_WRITING) else {
        return false;
    };
    let Some((restart, file)) = parse_crash_writing(&value) else {
        log::warn!("burn-accelerate: {CRASH_WRITING}={value:?} is not RESTART:FILE; ignored");
        return false;
    };
    file == name && burn_accelerate_comm::restart_count().is_ok_and(|r| r == restart)
}

fn kill_this_process() -> ! {
    #[cfg(unix)]
    {
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
    std::process::abort()
}

fn checkpoint_error(path: &Path, reason: String) -> CheckpointError {
    CheckpointError {
        path: path.display().to_string(),
        reason,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// The decoders' property-test kit, shared with the comm crate's tests (issue 49).
#[cfg(test)]
#[path = "../../comm/src/fuzz.rs"]
#[allow(dead_code)]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "burn-accelerate-checkpoint-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn entry(epoch: usize) -> CheckpointEntry {
        CheckpointEntry {
            epoch,
            files: vec![FileDigest::of(format!("m-{epoch}"), &[epoch as u8])],
        }
    }

    #[test]
    fn a_digest_tells_a_truncated_file_from_an_altered_one() {
        let digest = FileDigest::of("model", b"abcdef");
        assert_eq!(digest.size, 6);
        // SHA-256("abcdef"), as `sha256sum` prints it.
        assert_eq!(
            digest.sha256,
            "bef57ec7f53a6d40beb640a780a639c83bc29ac8a9816f1fc6c5c6dcd93c4721"
        );
        assert_eq!(digest.check(b"abcdef"), Ok(()));
        let short = digest.check(b"abc").unwrap_err();
        assert!(
            short.contains("3 bytes long, but 6 were written"),
            "{short}"
        );
        let altered = digest.check(b"abcdeF").unwrap_err();
        assert!(
            altered.contains("does not hold what was written"),
            "{altered}"
        );
    }

    #[test]
    fn entries_are_listed_in_order_once_per_epoch_and_the_oldest_go_first() {
        let manifest = Manifest::default()
            .with(entry(3))
            .with(entry(1))
            .with(entry(2));
        let epochs = |m: &Manifest| m.checkpoints.iter().map(|c| c.epoch).collect::<Vec<_>>();
        assert_eq!(epochs(&manifest), [1, 2, 3]);
        // Epoch 2 written again (a resumed run redoing it) replaces the first writing.
        let mut again = entry(2);
        again.files[0] = FileDigest::of("m-2", b"redone");
        let mut manifest = manifest.with(again.clone());
        assert_eq!(epochs(&manifest), [1, 2, 3]);
        assert_eq!(manifest.entry(2), Some(&again));
        let dropped = manifest.retain_last(2);
        assert_eq!(dropped, [entry(1)]);
        assert_eq!(epochs(&manifest), [2, 3]);
        // Never the newest.
        assert_eq!(manifest.retain_last(0).len(), 1);
        assert_eq!(epochs(&manifest), [3]);
    }

    #[test]
    fn the_newest_checkpoint_that_verifies_is_chosen_and_the_others_say_why() {
        let manifest = (1..=4).fold(Manifest::default(), |m, e| m.with(entry(e)));
        let choice = manifest.newest_complete(None, |entry| match entry.epoch {
            4 => Err("torn".to_string()),
            3 => Err("short".to_string()),
            epoch => Ok(epoch * 10),
        });
        assert_eq!(choice.chosen, Some((2, 20)));
        assert_eq!(
            choice.rejected,
            [(4, "torn".to_string()), (3, "short".to_string())]
        );
        // Up to an epoch asked for: newer ones are not considered, nor reported.
        let choice = manifest.newest_complete(Some(2), |entry| Ok::<_, String>(entry.epoch));
        assert_eq!((choice.chosen, choice.rejected), (Some((2, 2)), vec![]));
        let none = manifest.newest_complete(None, |_| Err::<(), _>("gone".to_string()));
        assert_eq!(none.chosen, None);
        assert_eq!(none.rejected.len(), 4);
    }

    #[test]
    fn a_damaged_newest_checkpoint_falls_back_to_the_one_before() {
        let dir = scratch("fallback");
        let checkpoints = CheckpointDir::new(&dir).with_keep_last(3);
        for epoch in 1..=3 {
            let model = vec![epoch as u8; 1000];
            checkpoints
                .save(
                    epoch,
                    &[(&format!("model-{epoch}"), &model), ("common", b"x")],
                )
                .unwrap();
        }
        // No partial file is left behind, and the manifest lists all three.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(!names.iter().any(|n| n.ends_with(PARTIAL)), "{names:?}");
        assert_eq!(Manifest::read(&dir).unwrap().checkpoints.len(), 3);

        // Epoch 3's model truncated, as a crash of the disk (not of the writer) would leave it.
        std::fs::write(dir.join("model-3"), [3u8; 10]).unwrap();
        let loaded = checkpoints.load_newest(None).unwrap().unwrap();
        assert_eq!(loaded.epoch, 2);
        assert_eq!(loaded.files["model-2"], vec![2u8; 1000]);
        assert_eq!(loaded.skipped.len(), 1);
        assert!(
            loaded.skipped[0]
                .1
                .contains("model-3 is 10 bytes long, but 1000"),
            "{:?}",
            loaded.skipped
        );
        assert!(checkpoints.load(3).is_err());

        // Every one damaged: an error that says what to do, never a silent fresh start.
        std::fs::write(dir.join("common"), b"y").unwrap();
        let err = checkpoints.load_newest(None).unwrap_err().to_string();
        assert!(
            err.contains("no checkpoint it lists is whole") && err.contains("delete"),
            "{err}"
        );
        // Nothing listed: nothing to resume from.
        let empty = CheckpointDir::new(scratch("empty"));
        assert_eq!(empty.load_newest(None).unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_of_dropped_checkpoints_go_unless_spared() {
        let dir = scratch("retain");
        let checkpoints = CheckpointDir::new(&dir);
        for epoch in 1..=3 {
            checkpoints
                .save_sparing(
                    epoch,
                    &[(&format!("a-{epoch}"), b"a"), (&format!("b-{epoch}"), b"b")],
                    |name| name.starts_with("b-"),
                )
                .unwrap();
        }
        let present = |name: &str| dir.join(name).exists();
        assert!(!present("a-1") && present("b-1"));
        assert!(present("a-2") && present("a-3"));
        let listed: Vec<usize> = Manifest::read(&dir)
            .unwrap()
            .checkpoints
            .iter()
            .map(|c| c.epoch)
            .collect();
        assert_eq!(listed, [2, 3]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_garbled_manifest_is_an_error_not_an_empty_list() {
        let dir = scratch("garbled");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(MANIFEST), b"{\"version\":1,\"checkp").unwrap();
        let err = Manifest::read(&dir).unwrap_err().to_string();
        assert!(err.contains("cannot be parsed"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_crash_hook_names_an_attempt_and_a_file() {
        assert_eq!(
            parse_crash_writing("1:accelerate-2-optim.mpk"),
            Some((1, "accelerate-2-optim.mpk"))
        );
        assert_eq!(parse_crash_writing(" 0 : m "), Some((0, "m")));
        assert_eq!(parse_crash_writing("m"), None);
        assert_eq!(parse_crash_writing("x:m"), None);
        assert_eq!(parse_crash_writing("0:"), None);
    }

    // The property tests of issue 49 (SECURITY.md): a manifest damaged in any way is refused
    // naming it, or lists checkpoints that are read back verified or passed over saying why.

    use proptest::prelude::*;

    use crate::fuzz;

    fn manifests() -> impl Strategy<Value = Vec<u8>> {
        let manifest = Manifest::default()
            .with(entry(1))
            .with(entry(2))
            .with(CheckpointEntry {
                epoch: 3,
                files: vec![
                    FileDigest::of("m-3", &[3; 40]),
                    FileDigest::of("s-3", b"{}"),
                ],
            });
        let valid = serde_json::to_vec_pretty(&manifest).unwrap();
        fuzz::inputs(vec![valid], 512)
    }

    fn damaged_manifest_is_named(dir: &Path, bytes: Vec<u8>) -> Result<(), TestCaseError> {
        std::fs::write(dir.join(MANIFEST), &bytes).unwrap();
        let (largest, loaded) =
            fuzz::largest_allocation(|| CheckpointDir::new(dir).load_newest(None));
        match loaded {
            Ok(Some(found)) => {
                let manifest = Manifest::read(dir).unwrap();
                let entry = manifest.entry(found.epoch).unwrap();
                for file in &entry.files {
                    prop_assert_eq!(Ok(()), file.check(&found.files[&file.name]));
                }
            }
            Ok(None) => {}
            Err(err) => {
                prop_assert!(err.path.ends_with(MANIFEST), "{}", err.path);
                prop_assert!(!err.reason.is_empty());
            }
        }
        // The files written are 40 bytes at most; the manifest 1 KiB.
        prop_assert!(largest < 1 << 16, "{largest} bytes");
        Ok(())
    }

    // The files of `with_checkpoints`, by name.
    fn checkpoint_files() -> BTreeMap<String, Vec<u8>> {
        [("m-1", vec![1]), ("m-2", vec![2]), ("m-3", vec![3; 40])]
            .into_iter()
            .chain([("s-3", b"{}".to_vec())])
            .map(|(name, bytes)| (name.to_string(), bytes))
            .collect()
    }

    // `damaged_manifest_is_named` without the disk: the manifest decoded from `bytes` and its
    // newest whole checkpoint chosen over `files`, each checked as `read_verified` checks the
    // file it reads (its name, then its length and SHA-256). The long run's, which reaches
    // 10^6 cases where a file written and a directory read per case did not.
    fn damaged_manifest_is_named_in_memory(
        files: &BTreeMap<String, Vec<u8>>,
        bytes: Vec<u8>,
    ) -> Result<(), TestCaseError> {
        let path = Path::new("memory").join(MANIFEST);
        let verify = |entry: &CheckpointEntry| {
            entry.files.iter().try_for_each(|file| {
                plain_name(file)?;
                let held = files
                    .get(&file.name)
                    .ok_or_else(|| format!("{} cannot be read (not found)", file.name))?;
                file.check(held)
            })
        };
        let (largest, decoded) = fuzz::largest_allocation(|| {
            Manifest::from_json(&bytes, &path).map(|manifest| {
                let choice = manifest.newest_complete(None, verify);
                (manifest, choice)
            })
        });
        match decoded {
            Ok((manifest, choice)) => {
                if let Some((epoch, ())) = choice.chosen {
                    // The chosen one is listed, newer than every one passed over.
                    prop_assert!(manifest.entry(epoch).is_some());
                    prop_assert!(choice.rejected.iter().all(|(e, _)| *e > epoch));
                }
                prop_assert!(choice.rejected.iter().all(|(_, why)| !why.is_empty()));
            }
            Err(err) => {
                prop_assert!(err.path.ends_with(MANIFEST), "{}", err.path);
                prop_assert!(!err.reason.is_empty());
            }
        }
        // The files are 40 bytes at most; the manifest 1 KiB.
        prop_assert!(largest < 1 << 16, "{largest} bytes");
        Ok(())
    }

    // A checkpoint of files several processes wrote: listed once with all of them; one whose
    // entry the check refuses, or one of whose files is damaged, is passed over; a process
    // keeps only the files it names.
    #[test]
    fn files_written_by_others_are_listed_checked_and_kept_as_asked() {
        let dir = scratch("written");
        let checkpoints = CheckpointDir::new(&dir).with_keep_last(3);
        std::fs::create_dir_all(&dir).unwrap();
        for epoch in [1, 2] {
            let others = vec![
                write_atomic(&dir, &format!("part-{epoch}-1"), b"one").unwrap(),
                write_atomic(&dir, &format!("part-{epoch}-2"), b"two").unwrap(),
            ];
            let state = format!("state-{epoch}");
            let entry = checkpoints
                .save_with_written(epoch, &[(&state, b"s")], others, |_| false)
                .unwrap();
            let names: Vec<&str> = entry.files.iter().map(|f| f.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    state.as_str(),
                    &format!("part-{epoch}-1"),
                    &format!("part-{epoch}-2")
                ]
            );
        }
        let own_part = |name: &str| !name.starts_with("part") || name.ends_with("-1");
        let newest = checkpoints
            .load_newest_where(None, |_| Ok(()), own_part)
            .unwrap()
            .unwrap();
        assert_eq!(newest.epoch, 2);
        assert_eq!(
            newest.files.keys().collect::<Vec<_>>(),
            ["part-2-1", "state-2"]
        );
        // Refused by the check: the one before.
        let older = checkpoints
            .load_newest_where(
                None,
                |entry| match entry.epoch {
                    2 => Err("incomplete".into()),
                    _ => Ok(()),
                },
                |_| true,
            )
            .unwrap()
            .unwrap();
        assert_eq!((older.epoch, older.skipped.len()), (1, 1));
        // A file not kept is still verified: damaged, the checkpoint is passed over.
        std::fs::write(dir.join("part-2-2"), b"TWO").unwrap();
        let older = checkpoints
            .load_newest_where(None, |_| Ok(()), own_part)
            .unwrap()
            .unwrap();
        assert_eq!(older.epoch, 1);
        // Another process reads only what it keeps, of the checkpoint chosen.
        let kept = checkpoints.load_keeping(2, own_part).unwrap();
        assert_eq!(
            kept.files.keys().collect::<Vec<_>>(),
            ["part-2-1", "state-2"]
        );
        // A file written by another process is not also written by this one.
        let twice = checkpoints
            .save_with_written(3, &[("x", b"x")], vec![FileDigest::of("x", b"x")], |_| {
                false
            })
            .unwrap_err();
        assert!(twice.reason.contains("another process"), "{twice}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    // Issue 48: a file not kept is verified without being held (a chunk at a time), and a
    // damaged one is still found and its checkpoint passed over; read when it is needed, it
    // is checked against the digest it verified with, and refused, by its path, when it
    // changed since (even relisted in the manifest with its new checksum).
    #[test]
    fn files_not_kept_are_verified_unheld_and_read_back_only_as_they_verified() {
        let dir = scratch("unkept");
        let checkpoints = CheckpointDir::new(&dir).with_keep_last(3);
        // 4 MiB, of other bytes in each epoch.
        let big = |epoch: u8| -> Vec<u8> { (0..4u32 << 20).map(|i| i as u8 ^ epoch).collect() };
        for epoch in [1, 2] {
            let (name, small) = (format!("big-{epoch}"), format!("small-{epoch}"));
            checkpoints
                .save(epoch, &[(&name, &big(epoch as u8)), (&small, b"s")])
                .unwrap();
        }
        let small_only = |name: &str| name.starts_with("small");
        let load = || checkpoints.load_newest_where(None, |_| Ok(()), small_only);
        let (largest, loaded) = fuzz::largest_allocation(load);
        let mut loaded = loaded.unwrap().unwrap();
        assert!(largest < 1 << 20, "{largest} bytes held at once");
        assert_eq!(loaded.epoch, 2);
        assert_eq!(loaded.files.keys().collect::<Vec<_>>(), ["small-2"]);
        assert_eq!(loaded.unkept, [FileDigest::of("big-2", &big(2))]);
        assert_eq!(loaded.names().collect::<Vec<_>>(), ["small-2", "big-2"]);
        let bytes = loaded.bytes(&dir, "big-2").unwrap().unwrap();
        assert!(bytes[..] == big(2)[..]);
        drop(bytes);
        assert_eq!(loaded.bytes(&dir, "big-1").unwrap(), None);

        // Damaged: at its length, cut, grown. The checkpoint is passed over, naming it.
        let mut altered = big(2);
        altered[12345] ^= 1;
        let damages = [
            (altered.clone(), "big-2 does not hold what was written"),
            (big(2)[..100].to_vec(), "big-2 is 100 bytes long"),
            ([big(2), vec![0]].concat(), "big-2 is 4194305 bytes long"),
        ];
        for (damaged, why) in &damages {
            std::fs::write(dir.join("big-2"), damaged).unwrap();
            let older = load().unwrap().unwrap();
            assert_eq!(older.epoch, 1, "{why}");
            assert_eq!(older.unkept, [FileDigest::of("big-1", &big(1))]);
            assert!(older.skipped[0].1.contains(why), "{:?}", older.skipped);
            // And the copy verified before reads it no more.
            let err = loaded.bytes(&dir, "big-2").unwrap_err();
            assert_eq!(Path::new(&err.path), dir.join("big-2"), "{err}");
            assert!(
                err.reason.contains(why)
                    && err
                        .reason
                        .contains("changed after the checkpoint was verified"),
                "{err}"
            );
            assert!(loaded.keep_also(&dir, |_| true).is_err());
            assert_eq!((loaded.files.len(), loaded.unkept.len()), (1, 1));
        }
        // Relisted with its new checksum: still not what was verified.
        std::fs::write(dir.join("big-2"), &altered).unwrap();
        let listed = Manifest::read(&dir).unwrap();
        listed
            .clone()
            .relisted(2, FileDigest::of("big-2", &altered))
            .unwrap()
            .write(&dir)
            .unwrap();
        assert!(loaded.keep_also(&dir, |_| true).is_err());
        // Restored: kept when asked for, as written.
        listed.write(&dir).unwrap();
        std::fs::write(dir.join("big-2"), big(2)).unwrap();
        loaded.keep_also(&dir, |name| name != "small-2").unwrap();
        assert!(loaded.unkept.is_empty());
        assert!(loaded.files["big-2"] == big(2));
        // An epoch asked for: every file verified, the unkept ones streamed.
        let load_2 = || checkpoints.load_verifying_all(2, small_only);
        let (largest, asked) = fuzz::largest_allocation(load_2);
        let asked = asked.unwrap();
        assert!(largest < 1 << 20, "{largest} bytes held at once");
        assert_eq!(asked.unkept, [FileDigest::of("big-2", &big(2))]);
        assert_eq!(asked.files.keys().collect::<Vec<_>>(), ["small-2"]);
        // The start-up check's verification streams too.
        std::fs::write(dir.join("big-2"), &altered).unwrap();
        let why = load_2().unwrap_err().reason;
        assert!(
            why.contains("big-2 does not hold what was written"),
            "{why}"
        );
        let (largest, chosen) = fuzz::largest_allocation(|| verify::precheck(&dir));
        assert_eq!(chosen.unwrap().map(|entry| entry.epoch), Some(1));
        assert!(largest < 1 << 20, "{largest} bytes held at once");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn with_checkpoints(name: &str) -> PathBuf {
        let dir = scratch(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, bytes) in checkpoint_files() {
            std::fs::write(dir.join(file), bytes).unwrap();
        }
        dir
    }

    #[test]
    fn any_damaged_manifest_is_refused_by_name_or_verified() {
        let dir = with_checkpoints("fuzz");
        fuzz::check(1500, manifests(), |b| damaged_manifest_is_named(&dir, b));
        std::fs::remove_dir_all(&dir).unwrap();
        // The long run's property, from memory.
        let files = checkpoint_files();
        fuzz::check(5000, manifests(), |b| {
            damaged_manifest_is_named_in_memory(&files, b)
        });
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_manifest() {
        let files = checkpoint_files();
        fuzz::long_run("checkpoint manifest", manifests(), |b| {
            damaged_manifest_is_named_in_memory(&files, b)
        });
    }

    #[test]
    fn a_manifest_naming_a_file_outside_its_directory_twice_or_too_large_is_refused() {
        let dir = with_checkpoints("outside");
        for name in ["../m-1", "/etc/hostname", "a/b", "", "."] {
            let file = FileDigest {
                name: name.into(),
                size: 1,
                sha256: String::new(),
            };
            let why = read_verified(&dir, &file).unwrap_err();
            assert!(why.contains("not the name of a file"), "{name}: {why}");
        }
        let mut twice = Manifest::default().with(entry(1));
        twice.checkpoints.push(entry(1));
        twice.write(&dir).unwrap();
        let why = Manifest::read(&dir).unwrap_err().reason;
        assert!(why.contains("epoch 1 after epoch 1"), "{why}");
        let mut doubled = entry(2);
        doubled.files.push(doubled.files[0].clone());
        Manifest::default().with(doubled).write(&dir).unwrap();
        let why = Manifest::read(&dir).unwrap_err().reason;
        assert!(why.contains("m-2 twice"), "{why}");
        let huge = FileDigest {
            size: 1 << 40,
            ..FileDigest::of("m-3", &[3; 40])
        };
        let (largest, read) = fuzz::largest_allocation(|| read_verified(&dir, &huge));
        assert!(read.unwrap_err().contains("40 bytes long"));
        assert!(largest < 1 << 16, "{largest}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
