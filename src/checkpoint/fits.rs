//! Whether a checkpoint's model record fits this model: every parameter the model has, under
//! the same path and of the same shape (issue 49). Burn's `load_record` checks neither: a
//! record of another model loads, and fails later, inside a forward pass, with a shape error
//! that names no parameter; a record lacking an optional parameter (a bias) silently removes
//! it from the model. (A record's parameters that the model lacks are dropped by Burn's
//! `load_record` before they can be seen; they change nothing in the model.)

use burn::module::Module;
use burn::tensor::backend::Backend;

use super::LoadedCheckpoint;
use super::records::{self, record_error};
use crate::AccelerateError;
use crate::placement::walk::walk;
use crate::record_bytes::Shapes;

/// Every parameter of a module, by its path (`encoder.layers.0.weight`) with its shape, sorted
/// by path: the placement walk's, which reads lazy parameters without creating them.
fn shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    let mut found: Vec<_> = walk::<B, M>(module)
        .params
        .into_iter()
        .map(|param| (param.path, param.shape))
        .collect();
    found.sort();
    found
}

/// Whether the model files of a sharded checkpoint (`files`, process `R`'s at `R`, of
/// `loaded`, whose directory is `dir`) are one partition of `model`, as a resume reads them:
/// each lists every parameter of `model` under its path (Burn decodes it as `model`'s
/// record), and each float parameter is held whole, of its shape, by the file of the process
/// the partition over `files.len()` processes gives it to ([`crate::zero::partition`], as the
/// processes that wrote them computed it), and with no elements by every other (int and bool
/// parameters, which the partition does not split, of their shape wherever they are held).
/// Only the shapes are read
/// (the record walk), no tensor is built; a file `loaded` verified without keeping it is read
/// from `dir` for its shapes and dropped, and checked against the digest it verified with
/// ([`LoadedCheckpoint::bytes`]): one file's bytes at a time (issue 48).
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming the file (by its name in the checkpoint) and the
/// first parameter, in the model's visiting order, that it lacks, holds in another shape, or
/// holds though another process's file does; or the file that is not read back, changed
/// since it was verified, or does not walk as a record.
pub(crate) fn check_shards<B: Backend, M: Module<B>>(
    dir: &std::path::Path,
    loaded: &LoadedCheckpoint,
    files: &[String],
    model: &M,
) -> Result<(), AccelerateError> {
    let params = walk::<B, M>(model).params;
    let floats: Vec<usize> = params
        .iter()
        .filter(|param| param.kind == crate::placement::walk::ParamKind::Float)
        .map(|param| param.shape.iter().product())
        .collect();
    let mut owners = crate::zero::partition(&floats, files.len()).into_iter();
    let record_shapes = Shapes::of_model::<B, M>(model);
    let mut held = Vec::with_capacity(files.len());
    for (rank, name) in files.iter().enumerate() {
        let bytes = loaded
            .bytes(dir, name)
            .map_err(|err| record_error(name, records::changed_after_start_up(&err.reason)))?
            .ok_or_else(|| {
                record_error(
                    name,
                    format!(
                        "process {rank}'s model file of the sharded checkpoint is not read \
                         back: the checkpoint is incomplete"
                    ),
                )
            })?;
        let shapes = crate::record_bytes::parameter_shapes(&bytes, &record_shapes)
            .map_err(|reason| record_error(name, reason))?;
        held.push(shapes);
    }
    let world = files.len();
    for param in &params {
        let owner = (param.kind == crate::placement::walk::ParamKind::Float)
            .then(|| owners.next())
            .flatten();
        let (path, model_shape) = (&param.path, &param.shape);
        for (rank, (name, shapes)) in files.iter().zip(&held).enumerate() {
            let refuse = |what: String| {
                Err(record_error(
                    name,
                    format!(
                        "parameter `{path}` {what}: the checkpoint is of another model (resume \
                         with the model that saved it, or start without this checkpoint \
                         directory)"
                    ),
                ))
            };
            let Some(shape) = shapes.get(path) else {
                return refuse(format!("(shape {model_shape:?}) is not in the record"));
            };
            let placeholder = shape.len() == model_shape.len() && shape.iter().all(|&d| d == 0);
            let misshapen =
                || format!("has shape {shape:?} in the record, {model_shape:?} in the model");
            match owner {
                Some(owner) if owner == rank && shape != model_shape && placeholder => {
                    return refuse(format!(
                        "(shape {model_shape:?}) has no elements here, where the partition of \
                         {world} processes puts it: the files are not one partition of this model"
                    ));
                }
                Some(owner) if owner != rank && !placeholder && shape == model_shape => {
                    return refuse(format!(
                        "is held here, and the partition of {world} processes gives it to {}: \
                         the files are not one partition of this model",
                        files[owner]
                    ));
                }
                Some(owner) if owner != rank && !placeholder => return refuse(misshapen()),
                Some(owner) if owner != rank => {}
                _ if shape != model_shape => return refuse(misshapen()),
                _ => {}
            }
        }
    }
    Ok(())
}

/// `model` with the model record `name` of `loaded` loaded, once the record is found to hold
/// exactly `model`'s parameters, each of its shape ([`load_fitting`]).
///
/// The record's tensors are checked against the model's shapes before Burn builds them
/// (Burn's `from_item` panics on a tensor of another rank than its parameter's).
///
/// # Errors
/// As [`records::decode`]; [`AccelerateError::Checkpoint`] naming `name` and the first
/// parameter that the record lacks or holds in another shape (the model is then not loaded
/// half).
pub(crate) fn decode_model<B: Backend, M: Module<B>>(
    loaded: &LoadedCheckpoint,
    name: &str,
    model: M,
    device: &B::Device,
) -> Result<M, AccelerateError> {
    let shapes = Shapes::of_model::<B, M>(&model);
    let record =
        records::decode_checked::<B, M::Record>(loaded, name, &shapes, device).map_err(|err| {
            match missing_parameter(loaded, name, &shapes) {
                Some(reason) => record_error(name, reason),
                None => err,
            }
        })?;
    load_fitting::<B, M>(model, record, name)
}

// Why a model record that did not decode is not this model's, naming the first parameter of
// the model it lacks (a record of another module: serde's error names a module's field).
fn missing_parameter(loaded: &LoadedCheckpoint, name: &str, shapes: &Shapes) -> Option<String> {
    let (param, dims) = crate::record_bytes::first_missing(loaded.files.get(name)?, shapes)?;
    Some(format!(
        "parameter `{param}` (shape {dims:?}) is not in the record: the checkpoint is of \
         another model (resume with the model that saved it, or start without this \
         checkpoint directory)"
    ))
}

/// `model` with `record` (the checkpoint's file `what`) loaded, once the record has been found
/// to hold exactly `model`'s parameters, each of its shape.
///
/// # Errors
/// [`AccelerateError::Checkpoint`] naming `what` and the first parameter that the record lacks
/// or holds in another shape; `model` is not changed (it is dropped
/// with the error: nothing is loaded half).
pub(crate) fn load_fitting<B: Backend, M: Module<B>>(
    model: M,
    record: M::Record,
    what: &str,
) -> Result<M, AccelerateError> {
    let expected = shapes::<B, _>(&model);
    let loaded = model.load_record(record);
    let got = shapes::<B, _>(&loaded);
    if let Some(reason) = first_difference(&expected, &got) {
        return Err(record_error(
            what,
            format!(
                "{reason}: the checkpoint is of another model (resume with the model that saved \
                 it, or start without this checkpoint directory)"
            ),
        ));
    }
    Ok(loaded)
}

// What first differs between the model's parameters and the record's (both sorted by path).
fn first_difference(
    expected: &[(String, Vec<usize>)],
    got: &[(String, Vec<usize>)],
) -> Option<String> {
    for (name, dims) in expected {
        match got.binary_search_by(|(n, _)| n.cmp(name)) {
            Err(_) => {
                return Some(format!(
                    "parameter `{name}` (shape {dims:?}) is not in the record"
                ));
            }
            Ok(at) if &got[at].1 != dims => {
                return Some(format!(
                    "parameter `{name}` has shape {:?} in the record, {dims:?} in the model",
                    got[at].1
                ));
            }
            Ok(_) => {}
        }
    }
    None
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use burn::backend::Flex;
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    type B = Flex;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        first: Linear<B>,
        second: Linear<B>,
    }

    fn two(hidden: usize, bias: bool) -> Two<B> {
        let device = Default::default();
        Two {
            first: LinearConfig::new(3, hidden).init(&device),
            second: LinearConfig::new(hidden, 2).with_bias(bias).init(&device),
        }
    }

    fn reason(err: AccelerateError) -> String {
        match err {
            AccelerateError::Checkpoint { path, reason } => {
                assert_eq!(path, "model-1.mpk");
                reason
            }
            other => panic!("not a checkpoint error: {other}"),
        }
    }

    #[test]
    fn the_same_model_loads_its_own_record() {
        let saved = two(4, true);
        let weight = saved.second.weight.val();
        let loaded = load_fitting::<B, _>(two(4, true), saved.into_record(), "model-1.mpk")
            .expect("its own record");
        loaded
            .second
            .weight
            .val()
            .into_data()
            .assert_eq(&weight.into_data(), true);
    }

    #[test]
    fn another_shape_is_refused_naming_the_parameter() {
        let err = load_fitting::<B, _>(two(5, true), two(4, true).into_record(), "model-1.mpk")
            .unwrap_err();
        let reason = reason(err);
        assert!(
            reason.contains("parameter `first.bias` has shape [4] in the record, [5] in the model"),
            "{reason}"
        );
    }

    #[test]
    fn a_missing_parameter_is_refused_naming_it() {
        let err = load_fitting::<B, _>(two(4, true), two(4, false).into_record(), "model-1.mpk")
            .unwrap_err();
        let reason = reason(err);
        assert!(
            reason.contains("parameter `second.bias` (shape [2]) is not in the record"),
            "{reason}"
        );
    }

    type A = burn::backend::Autodiff<Flex>;

    fn two_on<K: Backend>(hidden: usize, bias: bool) -> Two<K> {
        let device = Default::default();
        Two {
            first: LinearConfig::new(3, hidden).init(&device),
            second: LinearConfig::new(hidden, 2).with_bias(bias).init(&device),
        }
    }

    // The directory of the checkpoints `shards` builds: none, as they hold every file.
    const HELD: &str = "";

    // `model`'s files of a sharded checkpoint over `world` processes, as `sharded::write`
    // writes them (each process's partition whole, the others' parameters of no elements).
    fn shards(model: &Two<A>, world: usize) -> (LoadedCheckpoint, Vec<String>) {
        let partition = crate::zero::Partition::of::<A, _>(model, world);
        let names: Vec<String> = (0..world)
            .map(|rank| format!("model-1.shard-{rank}-of-{world}.mpk"))
            .collect();
        let files = names
            .iter()
            .enumerate()
            .map(|(rank, name)| {
                let record =
                    crate::zero::own_model_record::<A, _>(model, &partition, rank, None).unwrap();
                (name.clone(), records::encode::<A, _>(record, name).unwrap())
            })
            .collect();
        let loaded = LoadedCheckpoint {
            epoch: 1,
            files,
            skipped: Vec::new(),
            unkept: Vec::new(),
        };
        (loaded, names)
    }

    fn refused(loaded: &LoadedCheckpoint, names: &[String], model: &Two<A>, file: &str) -> String {
        match check_shards::<A, _>(HELD.as_ref(), loaded, names, model) {
            Err(AccelerateError::Checkpoint { path, reason }) => {
                assert_eq!(path, file, "{reason}");
                reason
            }
            other => panic!("expected a checkpoint error naming {file}, got {other:?}"),
        }
    }

    // Issue 48: a sharded checkpoint's model files are checked against the model from their
    // shapes: the model that wrote them fits, on any number of processes.
    #[test]
    fn the_model_that_wrote_a_sharded_checkpoint_fits_it() {
        for world in [1, 2, 3, 5] {
            let model = two_on::<A>(4, true);
            let (loaded, names) = shards(&model, world);
            check_shards::<A, _>(HELD.as_ref(), &loaded, &names, &two_on::<A>(4, true))
                .unwrap_or_else(|err| panic!("{world} processes: {err}"));
        }
    }

    #[test]
    fn a_sharded_checkpoint_of_another_shape_is_refused_naming_the_parameter_and_file() {
        let (loaded, names) = shards(&two_on::<A>(4, true), 2);
        // `first.weight`, the largest, is process 0's.
        let reason = refused(&loaded, &names, &two_on::<A>(5, true), &names[0]);
        assert!(
            reason.contains(
                "parameter `first.weight` has shape [3, 4] in the record, [3, 5] in the model"
            ),
            "{reason}"
        );
    }

    #[test]
    fn a_sharded_checkpoint_lacking_a_parameter_is_refused_naming_it_and_the_file() {
        let (loaded, names) = shards(&two_on::<A>(4, false), 2);
        let reason = refused(&loaded, &names, &two_on::<A>(4, true), &names[0]);
        assert!(
            reason.contains("parameter `second.bias` (shape [2]) is not in the record"),
            "{reason}"
        );
    }

    #[test]
    fn a_sharded_checkpoint_missing_a_process_file_is_refused_naming_it() {
        let model = two_on::<A>(4, true);
        let (mut loaded, names) = shards(&model, 3);
        loaded.files.remove(&names[2]);
        let reason = refused(&loaded, &names, &model, &names[2]);
        assert!(reason.contains("process 2's model file"), "{reason}");
    }

    // Files that are not the model's partition over their number of processes (here two
    // processes' files under each other's names): what a resume reading only its own
    // partition's files would miss is refused, naming the file.
    #[test]
    fn sharded_files_of_another_partition_are_refused_naming_the_file() {
        let model = two_on::<A>(4, true);
        let (mut loaded, names) = shards(&model, 2);
        let zero = loaded.files.remove(&names[0]).unwrap();
        let one = loaded.files.insert(names[1].clone(), zero).unwrap();
        loaded.files.insert(names[0].clone(), one);
        let reason = refused(&loaded, &names, &model, &names[0]);
        assert!(
            reason.contains("parameter `first.weight` (shape [3, 4]) has no elements here"),
            "{reason}"
        );
        // A parameter held by two files.
        let (mut loaded, names) = shards(&model, 2);
        let whole = records::encode::<A, _>(model.clone().into_record(), "whole").unwrap();
        loaded.files.insert(names[1].clone(), whole);
        let reason = refused(&loaded, &names, &model, &names[1]);
        assert!(
            reason.contains("parameter `first.weight` is held here, and the partition of 2 processes gives it to model-1.shard-0-of-2.mpk"),
            "{reason}"
        );
    }

    #[derive(Module, Debug)]
    enum Head<B: Backend> {
        Linear(Linear<B>),
        Norm(burn::nn::LayerNorm<B>),
    }

    #[derive(Module, Debug)]
    struct Varied<B: Backend> {
        embedding: burn::nn::Embedding<B>,
        blocks: Vec<Linear<B>>,
        extra: Option<Linear<B>>,
        conv: burn::nn::conv::Conv2d<B>,
        batch_norm: burn::nn::BatchNorm<B>,
        heads: Vec<Head<B>>,
        pair: (Linear<B>, Linear<B>),
    }

    fn varied<K: Backend>() -> Varied<K> {
        let device = Default::default();
        Varied {
            embedding: burn::nn::EmbeddingConfig::new(7, 4).init(&device),
            blocks: vec![
                LinearConfig::new(4, 4).init(&device),
                LinearConfig::new(4, 3).with_bias(false).init(&device),
            ],
            extra: Some(LinearConfig::new(3, 2).init(&device)),
            conv: burn::nn::conv::Conv2dConfig::new([2, 3], [3, 3]).init(&device),
            batch_norm: burn::nn::BatchNormConfig::new(3).init(&device),
            heads: vec![
                Head::Linear(LinearConfig::new(3, 5).init(&device)),
                Head::Norm(burn::nn::LayerNormConfig::new(3).init(&device)),
            ],
            pair: (
                LinearConfig::new(2, 6).init(&device),
                LinearConfig::new(6, 1).init(&device),
            ),
        }
    }

    // The checks made on a model record's bytes before Burn builds it (ids, ranks, shapes
    // against the model's by path) refuse nothing a real record holds: a model of sequences,
    // options, enums, tuples and Burn's common modules reads back its own record, bit for bit.
    #[test]
    fn a_model_of_every_kind_of_module_reads_back_its_own_record() {
        let saved: Varied<B> = varied();
        let expected: Vec<_> = shapes::<B, _>(&saved);
        let bytes = super::records::encode::<B, _>(saved.into_record(), "a model").unwrap();
        let loaded = LoadedCheckpoint {
            epoch: 1,
            files: [("model-1.mpk".to_string(), bytes.clone())].into(),
            skipped: Vec::new(),
            unkept: Vec::new(),
        };
        let model = decode_model::<B, _>(&loaded, "model-1.mpk", varied(), &Default::default())
            .expect("its own record");
        assert_eq!(shapes::<B, _>(&model), expected);
        let again = super::records::encode::<B, _>(model.into_record(), "a model").unwrap();
        assert_eq!(again, bytes);
    }

    // A rank changed where the model's path runs through a sequence, an enum's variant and a
    // tuple: refused naming the parameter, before Burn would panic on it.
    #[test]
    fn a_rank_changed_deep_in_a_model_is_refused_naming_the_parameter() {
        for (dims, param) in [
            ([0x92u8, 0x04, 0x03], "blocks.1.weight"),
            ([0x92, 0x03, 0x05], "heads.0.Linear.weight"),
            ([0x92, 0x06, 0x01], "pair.1.weight"),
        ] {
            let mut bytes =
                super::records::encode::<B, _>(varied().into_record(), "a model").unwrap();
            let shape = [b"shape".as_slice(), &dims].concat();
            let at = bytes
                .windows(shape.len())
                .position(|w| w == shape)
                .expect("the weight's shape")
                + 5;
            let flat = u8::try_from(dims[1] as usize * dims[2] as usize).unwrap();
            bytes.splice(at..at + 3, [0x91, flat]);
            let loaded = LoadedCheckpoint {
                epoch: 1,
                files: [("model-1.mpk".to_string(), bytes)].into(),
                skipped: Vec::new(),
                unkept: Vec::new(),
            };
            let err = decode_model::<B, _>(&loaded, "model-1.mpk", varied(), &Default::default())
                .expect_err("a weight of rank 1");
            let reason = reason(err);
            assert!(
                reason.contains(&format!(
                    "parameter `{param}` has shape [{flat}] in the record"
                )),
                "{reason}"
            );
        }
    }

    // An optimizer's record of that model (states of ranks 1, 2 and 4, keyed by parameter
    // ids) passes the byte checks too, for Adam and for SGD with momentum.
    #[test]
    fn optimizer_records_of_every_rank_read_back() {
        use burn::backend::Autodiff;
        use burn::optim::{AdamConfig, GradientsParams, Optimizer, SgdConfig};
        use burn::tensor::{Int, Tensor};

        type A = Autodiff<Flex>;

        fn stepped<O: Optimizer<Varied<A>, A>>(mut optimizer: O) -> O::Record {
            let device = Default::default();
            let model: Varied<A> = varied();
            let ids = Tensor::<A, 2, Int>::from_ints([[1, 2, 3]], &device);
            let x = model.embedding.forward(ids).reshape([1, 1, 3, 4]);
            let x = model.conv.forward(x.repeat_dim(1, 2));
            let loss = model.batch_norm.forward(x).sum()
                + model.blocks[0]
                    .forward(Tensor::<A, 2>::ones([1, 4], &device))
                    .sum();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let _ = optimizer.step(1e-3, model, grads);
            optimizer.to_record()
        }

        let adam = stepped(AdamConfig::new().init::<A, Varied<A>>());
        let bytes = super::records::encode::<A, _>(adam, "adam").unwrap();
        let loaded = LoadedCheckpoint {
            epoch: 1,
            files: [("optimizer-1.mpk".to_string(), bytes)].into(),
            skipped: Vec::new(),
            unkept: Vec::new(),
        };
        let read = super::records::decode::<
            A,
            <burn::optim::adaptor::OptimizerAdaptor<burn::optim::Adam, Varied<A>, A> as Optimizer<
                Varied<A>,
                A,
            >>::Record,
        >(&loaded, "optimizer-1.mpk", &Default::default())
        .unwrap_or_else(|err| panic!("{err}"));
        assert!(read.len() >= 4, "{} states", read.len());

        let sgd = stepped(
            SgdConfig::new()
                .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
                .init::<A, Varied<A>>(),
        );
        let bytes = super::records::encode::<A, _>(sgd, "sgd").unwrap();
        let loaded = LoadedCheckpoint {
            epoch: 1,
            files: [("optimizer-1.mpk".to_string(), bytes)].into(),
            skipped: Vec::new(),
            unkept: Vec::new(),
        };
        let read = super::records::decode::<
            A,
            <burn::optim::adaptor::OptimizerAdaptor<burn::optim::Sgd<Flex>, Varied<A>, A> as Optimizer<
                Varied<A>,
                A,
            >>::Record,
        >(&loaded, "optimizer-1.mpk", &Default::default())
        .unwrap_or_else(|err| panic!("{err}"));
        assert!(read.len() >= 4, "{} states", read.len());
    }
}
