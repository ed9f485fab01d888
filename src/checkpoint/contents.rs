//! What one checkpoint holds, written and read back the same way by both entry points: the
//! state file ([`CheckpointState`]), the model's record, the optimizer's whole state (a ZeRO
//! run's consolidated first, by the caller), the scheduler's record where the entry point has
//! one, all under the entry point's names ([`Scheme`]), and files of the loop's own beside
//! them; and the order a run resumes from it: the main process picks the checkpoint and every
//! process loads that one, its state first, then the model (refused unless it fits), then the
//! optimizer's and the scheduler's records.
//!
//! The [`Accelerator`](crate::Accelerator) and `with_accelerate` differ only in how they reach
//! their model and optimizer (a loop's values, Burn's `Learner`), and in what they do with what
//! was read: they are adapters over [`write`] and [`resume`].

use std::collections::BTreeMap;

use burn::module::Module;
use burn::record::Record;
use burn::tensor::backend::Backend;

#[cfg(all(test, feature = "flex"))]
use super::agree_on_checkpoint;
use super::records::{self, Scheme, record_error};
use super::{CheckpointDir, CheckpointState, LoadedCheckpoint};
use crate::AccelerateError;
use crate::distributed::ProcessGroup;

/// A checkpoint's records, as bytes.
pub(crate) struct Records {
    model: Vec<u8>,
    optimizer: Vec<u8>,
    scheduler: Option<Vec<u8>>,
}

impl Records {
    /// The model's record and the optimizer's whole state, encoded.
    ///
    /// # Errors
    /// [`AccelerateError::Checkpoint`] naming the record that cannot be encoded.
    pub(crate) fn encode<B: Backend, R: Record<B>, O: Record<B>>(
        model: R,
        optimizer: O,
    ) -> Result<Self, AccelerateError> {
        Ok(Self {
            model: records::encode::<B, _>(model, "the model's record")?,
            optimizer: records::encode::<B, _>(optimizer, "the optimizer's record")?,
            scheduler: None,
        })
    }

    /// With the learning-rate scheduler's record too.
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    pub(crate) fn with_scheduler<B: Backend, S: Record<B>>(
        mut self,
        scheduler: S,
    ) -> Result<Self, AccelerateError> {
        self.scheduler = Some(records::encode::<B, _>(
            scheduler,
            "the scheduler's record",
        )?);
        Ok(self)
    }
}

/// Refuses files of the loop's own (`own`) named as one of checkpoint `number`'s own files.
/// Every process calls it before the checkpoint is gathered, so that all refuse alike.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the first such file.
pub(crate) fn refuse_own_names(
    scheme: Scheme,
    number: usize,
    own: &[(&str, &[u8])],
) -> Result<(), AccelerateError> {
    let names = scheme.names(number);
    match own.iter().find(|(name, _)| names.contains(name)) {
        Some((name, _)) => Err(record_error(
            name,
            "named as one of the accelerator's own files of the checkpoint: give it another \
             name",
        )),
        None => Ok(()),
    }
}

/// Writes checkpoint `number` into `checkpoints` (the main process alone calls it): `records`
/// and `state` under `scheme`'s names, with the loop's `own` files, keeping on disk the files
/// of dropped checkpoints for which `spare` says so.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] for a file of `own` named as one of the checkpoint's, a
/// scheduler's record given to a scheme that has none, or when a file cannot be written (the
/// checkpoints listed before stay whole).
pub(crate) fn write(
    checkpoints: &CheckpointDir,
    scheme: Scheme,
    number: usize,
    state: &CheckpointState,
    records: &Records,
    own: &[(&str, &[u8])],
    spare: impl Fn(&str) -> bool,
) -> Result<(), AccelerateError> {
    refuse_own_names(scheme, number, own)?;
    let names = scheme.names(number);
    let state = state.to_json();
    let mut files: Vec<(&str, &[u8])> = vec![
        (&names.model, &records.model),
        (&names.optimizer, &records.optimizer),
    ];
    match (&names.scheduler, &records.scheduler) {
        (Some(name), Some(record)) => files.push((name, record)),
        (None, None) | (Some(_), None) => {}
        (None, Some(_)) => {
            return Err(record_error(
                "the scheduler's record",
                "this entry point's checkpoints keep no scheduler",
            ));
        }
    }
    files.push((&names.state, &state));
    files.extend_from_slice(own);
    checkpoints.save_sparing(number, &files, spare)?;
    Ok(())
}

/// A whole checkpoint's write, as both entry points end it: the main process runs `write`
/// (the others give `None`: they hold no whole record), and every process of `group` returns
/// its outcome: nobody goes on (and maybe fails, and restarts) before the checkpoint is
/// listed, and all fail alike when it is not. A sharded checkpoint ends the same way
/// ([`sharded::write`](super::sharded::write)). Every process of `group` must call it at the
/// same point.
///
/// # Errors
/// What `write` returned, on the main process; [`AccelerateError::Checkpoint`] with its
/// message on the others; [`AccelerateError::Distributed`] when a process left.
pub(crate) fn written_by_main(
    group: Option<&ProcessGroup>,
    write: Option<impl FnOnce() -> Result<(), AccelerateError>>,
) -> Result<(), AccelerateError> {
    let written = write.map_or(Ok(()), |write| write());
    let Some(group) = group else {
        return written;
    };
    let failure = written.as_ref().err().map(ToString::to_string);
    match (group.broadcast_object(&failure, 0)?, written) {
        (_, Err(own)) => Err(own),
        (None, Ok(())) => Ok(()),
        (Some(reason), Ok(())) => Err(record_error(
            "the main process's checkpoint",
            format!("not written: {reason}"),
        )),
    }
}

/// What a checkpoint held, read back and checked.
pub(crate) struct Contents<M, O, S> {
    /// The checkpoint's number (the step or epoch it was saved as).
    pub number: usize,
    /// Its state file.
    pub state: CheckpointState,
    /// The model given, with the checkpoint's parameters.
    pub model: M,
    /// The optimizer's whole state.
    pub optimizer: O,
    /// The scheduler's record, where the scheme keeps one.
    pub scheduler: Option<S>,
    /// The loop's own files, by name, verified.
    pub files: BTreeMap<String, Vec<u8>>,
}

/// Where a run goes on from.
pub(crate) enum Resume<M, O, S> {
    /// No checkpoint: the model, as given.
    Fresh(M),
    /// The checkpoint picked, read.
    From(Contents<M, O, S>),
}

/// The checkpoint every process of `group` resumes from (`pick`, on the main process:
/// [`agree_on_checkpoint`]), read with [`read`]; [`Resume::Fresh`] when there is none.
/// Every process must call it. (Both entry points agree with
/// [`agree_on_checkpoint_keeping`](super::agree_on_checkpoint_keeping) instead, keeping the
/// files `sharded::keeps` names, and read a sharded checkpoint with `sharded::read`;
/// `with_accelerate` starts from the checkpoint its start-up check held.)
///
/// # Errors
/// What [`agree_on_checkpoint`] and [`read`] return.
#[cfg(all(test, feature = "flex"))]
pub(crate) fn resume<B: Backend, M: Module<B>, O: Record<B>, S: Record<B>>(
    group: Option<&ProcessGroup>,
    checkpoints: &CheckpointDir,
    pick: impl FnOnce() -> Result<Option<LoadedCheckpoint>, AccelerateError>,
    scheme: Scheme,
    model: M,
    device: &B::Device,
) -> Result<Resume<M, O, S>, AccelerateError> {
    match agree_on_checkpoint(group, checkpoints, None, |_| pick())? {
        None => Ok(Resume::Fresh(model)),
        Some(loaded) => read(loaded, scheme, model, device).map(Resume::From),
    }
}

/// Reads `loaded` (its files named by `scheme`): the state first, then `model` with the
/// model's record (refused, naming the parameter, unless it fits), then the optimizer's and the
/// scheduler's records; what is left are the loop's own files.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the file that is missing, does not decode, or (the
/// model's) does not fit `model`.
pub(crate) fn read<B: Backend, M: Module<B>, O: Record<B>, S: Record<B>>(
    mut loaded: LoadedCheckpoint,
    scheme: Scheme,
    model: M,
    device: &B::Device,
) -> Result<Contents<M, O, S>, AccelerateError> {
    let number = loaded.epoch;
    let names = scheme.names(number);
    let state = CheckpointState::from_json(&records::file(&loaded, &names.state)?, &names.state)?;
    let model = super::decode_model::<B, M>(&loaded, &names.model, model, device)?;
    let optimizer = records::decode::<B, O>(&loaded, &names.optimizer, device)?;
    let scheduler = match &names.scheduler {
        Some(name) => Some(records::decode::<B, S>(&loaded, name, device)?),
        None => None,
    };
    for name in names.all() {
        loaded.files.remove(name);
    }
    Ok(Contents {
        number,
        state,
        model,
        optimizer,
        scheduler,
        files: loaded.files,
    })
}

/// What [`read`] checks that needs no model, before a run starts (issue 49), of `loaded`, the
/// checkpoint a resume would choose in `dir` (the newest whose files verify, length and
/// SHA-256: `sharded::precheck` picks it): that it lists every file `scheme` names (where
/// `records_listed` is `false`, a sharded checkpoint, whose processes' files hold the model's
/// and the optimizer's records, those two are not looked for), and that its state file
/// decodes. Returns it, read and verified, for the resume to load without reading and hashing
/// its files again.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the manifest (a file not listed) or the state file
/// (one that does not decode), which the resume would fail on as well.
pub(crate) fn precheck_loaded(
    dir: &std::path::Path,
    loaded: LoadedCheckpoint,
    scheme: Scheme,
    records_listed: bool,
) -> Result<LoadedCheckpoint, AccelerateError> {
    let names = scheme.names(loaded.epoch);
    let read = |name: &&str| records_listed || (*name != names.model && *name != names.optimizer);
    if let Some(absent) = names
        .all()
        .filter(read)
        .find(|name| !loaded.files.contains_key(*name))
    {
        return Err(record_error(
            &dir.join(super::MANIFEST).display().to_string(),
            format!(
                "the checkpoint of epoch {} does not list {absent}, which a resume reads; it is \
                 only ever replaced whole, so something else wrote it: restore it, or delete \
                 the directory to start afresh",
                loaded.epoch
            ),
        ));
    }
    let path = dir.join(&names.state).display().to_string();
    CheckpointState::from_json(&loaded.files[&names.state], &path).map_err(|err| match err {
        AccelerateError::Checkpoint { path, reason } => record_error(
            &path,
            format!(
                "it verifies against the manifest, but is not a checkpoint state ({reason}): \
                 it was written by something else; restore it, or delete the directory to \
                 start afresh"
            ),
        ),
        other => other,
    })?;
    Ok(loaded)
}

/// What [`read`] checks with the model, before a run starts (issue 49): that the model's
/// record of `loaded` (a checkpoint of `dir`, `sharded::precheck`'s) holds exactly `model`'s
/// parameters, each under its path and of its shape. It is decoded and loaded into a copy of
/// `model`, which is dropped: `model`'s lazy parameters stay uninitialised.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the record's path in `dir` and the first parameter
/// that it lacks or holds in another shape, or why it does not decode as `model`'s record.
pub(crate) fn precheck_model<B: Backend, M: Module<B>>(
    dir: &std::path::Path,
    loaded: &LoadedCheckpoint,
    scheme: Scheme,
    model: &M,
    device: &B::Device,
) -> Result<(), AccelerateError> {
    let name = scheme.names(loaded.epoch).model;
    match super::decode_model::<B, M>(loaded, &name, model.clone(), device) {
        Ok(_) => Ok(()),
        Err(AccelerateError::Checkpoint { path, reason }) if path == name => {
            Err(record_error(&dir.join(&name).display().to_string(), reason))
        }
        Err(other) => Err(other),
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};

    use super::*;
    use crate::AcceleratorState;

    type B = Flex;

    fn state() -> CheckpointState {
        CheckpointState {
            state: AcceleratorState {
                loss_scale: Default::default(),
                gradient_state: crate::GradientState::new().snapshot(),
            },
            loaders: Vec::new(),
            num_processes: 1,
        }
    }

    // What one scheme writes, it reads back: the state, the model's parameters, the records,
    // and the loop's own files apart.
    #[test]
    fn each_scheme_reads_back_what_it_wrote() {
        let device = Default::default();
        for scheme in [Scheme::Accelerator, Scheme::Strategy] {
            let dir =
                std::env::temp_dir().join(format!("contents-{scheme:?}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let checkpoints = CheckpointDir::new(&dir);
            let saved: Linear<B> = LinearConfig::new(3, 2).init(&device);
            // Read first: a lazy parameter's clone would be initialised on its own.
            let weight = saved.weight.val().into_data();
            let mut records = Records::encode::<B, _, _>(saved.into_record(), 7u32).unwrap();
            if scheme == Scheme::Strategy {
                records = records.with_scheduler::<B, _>(0.5f64).unwrap();
            }
            let own: &[(&str, &[u8])] = &[("loader.json", b"{}")];
            write(&checkpoints, scheme, 3, &state(), &records, own, |_| false).unwrap();
            let err = write(
                &checkpoints,
                scheme,
                4,
                &state(),
                &records,
                &[(&scheme.names(4).model, b"")],
                |_| false,
            )
            .unwrap_err();
            assert!(err.to_string().contains("give it another name"), "{err}");

            let fresh: Linear<B> = LinearConfig::new(3, 2).init(&device);
            let read = match resume::<B, _, u32, f64>(
                None,
                &checkpoints,
                || checkpoints.load_newest(None),
                scheme,
                fresh,
                &device,
            )
            .unwrap()
            {
                Resume::From(read) => read,
                Resume::Fresh(_) => panic!("checkpoint 3 was written"),
            };
            assert_eq!(read.number, 3);
            assert_eq!(read.optimizer, 7);
            assert_eq!(read.scheduler, (scheme == Scheme::Strategy).then_some(0.5));
            assert_eq!(read.files.keys().collect::<Vec<_>>(), ["loader.json"]);
            read.model.weight.val().into_data().assert_eq(&weight, true);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
