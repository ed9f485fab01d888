//! The files of a checkpoint of either entry point, once: what they are named, how a record
//! becomes bytes and back, and the error for one that cannot.
//!
//! The [`Accelerator`](crate::Accelerator) and `with_accelerate` name their files differently
//! (each scheme is read by checkpoints written before, so each stays), but both write records
//! in Burn's `NamedMpk` format in full precision (Burn's `CompactRecorder` stores f16, and a
//! resumed run must end where the uninterrupted one does, bit for bit).

use burn::record::{BurnMetadata, BurnRecordNoItem, Record, Recorder};
use burn::tensor::backend::Backend;

use super::LoadedCheckpoint;
use crate::AccelerateError;
use crate::record_bytes::{Shapes, build, check_tensors};

pub(crate) use crate::record_bytes::Bytes;
#[cfg(all(test, feature = "flex"))]
pub(crate) use crate::record_bytes::from_bytes;

/// Which entry point's names a checkpoint's files have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// A hand-written loop's: `accelerator-N.json`, `model-N.mpk`, `optimizer-N.mpk`.
    Accelerator,
    /// `with_accelerate`'s: `accelerate-N.json` (which Burn's own checkpoints of epoch `N`
    /// also read), `accelerate-N-model.mpk`, `accelerate-N-optim.mpk`,
    /// `accelerate-N-scheduler.mpk`.
    Strategy,
}

/// The names of one checkpoint's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileNames {
    /// The loss scale and gradient-state position (JSON).
    pub state: String,
    /// The model's record.
    pub model: String,
    /// The optimizer's record.
    pub optimizer: String,
    /// The learning-rate scheduler's record, where the scheme keeps one.
    pub scheduler: Option<String>,
}

impl Scheme {
    /// The names of checkpoint `number`'s files.
    pub(crate) fn names(self, number: usize) -> FileNames {
        match self {
            Self::Accelerator => FileNames {
                state: format!("accelerator-{number}.json"),
                model: format!("model-{number}.mpk"),
                optimizer: format!("optimizer-{number}.mpk"),
                scheduler: None,
            },
            Self::Strategy => FileNames {
                state: format!("accelerate-{number}.json"),
                model: format!("accelerate-{number}-model.mpk"),
                optimizer: format!("accelerate-{number}-optim.mpk"),
                scheduler: Some(format!("accelerate-{number}-scheduler.mpk")),
            },
        }
    }

    /// The number of the checkpoint whose state file `name` is, if it is one.
    pub(crate) fn state_number(self, name: &str) -> Option<usize> {
        let (prefix, suffix) = match self {
            Self::Accelerator => ("accelerator-", ".json"),
            Self::Strategy => ("accelerate-", ".json"),
        };
        name.strip_prefix(prefix)?
            .strip_suffix(suffix)?
            .parse()
            .ok()
    }
}

impl FileNames {
    /// Every name, the scheduler's where there is one.
    pub(crate) fn all(&self) -> impl Iterator<Item = &str> {
        [&self.state, &self.model, &self.optimizer]
            .into_iter()
            .chain(&self.scheduler)
            .map(String::as_str)
    }

    /// Whether `name` is one of these.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.all().any(|own| own == name)
    }
}

/// A checkpoint's record (or file) `what` that cannot be written or read, and why.
pub(crate) fn record_error(what: &str, err: impl std::fmt::Display) -> AccelerateError {
    AccelerateError::Checkpoint {
        path: what.into(),
        reason: err.to_string(),
    }
}

/// Why a file of a checkpoint the start-up check verified without keeping it
/// ([`LoadedCheckpoint::unkept`]) is not loaded when it is needed: `reason`, the checkpoint
/// crate's (it no longer holds what verified), said in the run's terms.
pub(crate) fn changed_after_start_up(reason: &str) -> String {
    format!(
        "verified by the start-up check (`try_with_checkpoint_dir`), {reason}; restore it, or \
         start the run again to check the directory anew"
    )
}

/// `record` as a checkpoint's bytes; `what` names it in the error.
pub(crate) fn encode<B: Backend, R: Record<B>>(
    record: R,
    what: &str,
) -> Result<Vec<u8>, AccelerateError> {
    Recorder::<B>::record(&Bytes::default(), record, ()).map_err(|e| record_error(what, e))
}

/// The record `name` of `loaded`, on `device`.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming `name`: a record written by another version of Burn
/// (or with other precision settings) than this build's, whatever else it holds, or one that
/// does not decode as `R`.
pub(crate) fn decode<B: Backend, R: Record<B>>(
    loaded: &LoadedCheckpoint,
    name: &str,
    device: &B::Device,
) -> Result<R, AccelerateError> {
    decode_checked(loaded, name, &Shapes::default(), device)
}

/// The record `name` of `loaded`, on `device`, its tensors checked against `shapes` (a
/// model's parameters, [`Shapes::of_model`]) besides what [`decode`] checks.
///
/// # Errors
/// As [`decode`]; a tensor of another shape than its parameter's.
pub(crate) fn decode_checked<B: Backend, R: Record<B>>(
    loaded: &LoadedCheckpoint,
    name: &str,
    shapes: &Shapes,
    device: &B::Device,
) -> Result<R, AccelerateError> {
    let mut bytes = file(loaded, name)?;
    // First, so that no decoder recurses into a record nested too deep.
    check_tensors(&bytes, shapes).map_err(|reason| record_error(name, reason))?;
    check_metadata::<B>(&mut bytes, name)?;
    build::<B, R>(bytes, device).map_err(|reason| record_error(name, reason))
}

// Burn's recorder compares a record's metadata with its own only once the record fails to
// decode; a record of another Burn version that happens to decode would load. The metadata
// is read first (the item is skipped, not kept) and must be what this build writes.
fn check_metadata<B: Backend>(bytes: &mut Vec<u8>, name: &str) -> Result<(), AccelerateError> {
    let recorder = Bytes::default();
    let saved: BurnRecordNoItem = Recorder::<B>::load_item(&recorder, bytes)
        .map_err(|e| record_error(name, format!("not a Burn record: {e}")))?;
    let mut ours = encode::<B, ()>((), "an empty record")?;
    let ours: BurnRecordNoItem = Recorder::<B>::load_item(&recorder, &mut ours)
        .map_err(|e| record_error("an empty record", e))?;
    let differs = |what: &str, saved: &str, ours: &str| {
        (saved != ours).then(|| format!("{what} {saved:?} where this build has {ours:?}"))
    };
    let (
        BurnMetadata {
            float,
            int,
            format,
            version,
            ..
        },
        ours,
    ) = (&saved.metadata, &ours.metadata);
    let differences: Vec<String> = [
        differs("Burn version", version, &ours.version),
        differs("record format", format, &ours.format),
        differs("float type", float, &ours.float),
        differs("int type", int, &ours.int),
    ]
    .into_iter()
    .flatten()
    .collect();
    if differences.is_empty() {
        return Ok(());
    }
    Err(record_error(
        name,
        format!(
            "written with {}: resume with the build that wrote it, or start without this \
             checkpoint directory",
            differences.join(", ")
        ),
    ))
}

/// The bytes of file `name` of `loaded`.
pub(crate) fn file(loaded: &LoadedCheckpoint, name: &str) -> Result<Vec<u8>, AccelerateError> {
    loaded.files.get(name).cloned().ok_or_else(|| {
        record_error(
            name,
            "listed in the checkpoint's manifest, but not read back",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_scheme_names_and_reads_back_its_state_file() {
        let ours = Scheme::Accelerator.names(3);
        assert_eq!(
            ours.all().collect::<Vec<_>>(),
            ["accelerator-3.json", "model-3.mpk", "optimizer-3.mpk"]
        );
        let strategy = Scheme::Strategy.names(3);
        assert_eq!(
            strategy.all().collect::<Vec<_>>(),
            [
                "accelerate-3.json",
                "accelerate-3-model.mpk",
                "accelerate-3-optim.mpk",
                "accelerate-3-scheduler.mpk"
            ]
        );
        for scheme in [Scheme::Accelerator, Scheme::Strategy] {
            assert_eq!(scheme.state_number(&scheme.names(12).state), Some(12));
            assert_eq!(scheme.state_number(&scheme.names(12).model), None);
        }
        assert_eq!(Scheme::Strategy.state_number("accelerate-x.json"), None);
        assert!(strategy.contains("accelerate-3-optim.mpk"));
        assert!(!strategy.contains("optimizer-3.mpk"));
    }

    #[test]
    fn a_file_the_manifest_lists_but_that_was_not_read_is_an_error_naming_it() {
        let loaded = LoadedCheckpoint {
            epoch: 1,
            files: Default::default(),
            skipped: Vec::new(),
            unkept: Vec::new(),
        };
        let err = file(&loaded, "model-1.mpk").unwrap_err();
        assert!(
            matches!(&err, AccelerateError::Checkpoint { path, .. } if path == "model-1.mpk"),
            "{err}"
        );
    }
}
