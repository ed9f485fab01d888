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
