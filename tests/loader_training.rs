//! A shard loader as the training (and validation) loader of Burn's own
//! `SupervisedTraining`, on one device, for two epochs of a tiny regression.
#![cfg(feature = "flex")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::data::dataset::InMemDataset;
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn::train::renderer::CliMetricsRenderer;
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_accelerate::data::{DataLoaderConfig, LoaderObserver, ShardLoaderBuilder};

type Train = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Model<B: Backend> {
    fc: Linear<B>,
}

#[derive(Debug, Clone)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 2>,
}

impl<B: Backend> Model<B> {
    fn regression(&self, batch: Batch<B>) -> RegressionOutput<B> {
        let output = self.fc.forward(batch.x);
        let loss = MseLoss::new().forward(output.clone(), batch.y.clone(), Reduction::Mean);
        RegressionOutput {
            loss,
            output,
            targets: batch.y,
        }
    }
}

impl<B: AutodiffBackend> TrainStep for Model<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
        let item = self.regression(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Model<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: Batch<B>) -> RegressionOutput<B> {
        self.regression(batch)
    }
}

/// `(x, y)` pairs into `[n, 1]` tensors on the loader's device.
#[derive(Clone)]
struct Pairs;

impl<B: Backend> Batcher<B, (f32, f32), Batch<B>> for Pairs {
    fn batch(&self, items: Vec<(f32, f32)>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let (x, y): (Vec<f32>, Vec<f32>) = items.into_iter().unzip();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, 1]), device),
            y: Tensor::from_data(TensorData::new(y, [n, 1]), device),
        }
    }
}

#[derive(Default)]
struct Epochs {
    ends: AtomicUsize,
    last_batches: AtomicUsize,
}

impl LoaderObserver for Epochs {
    fn begin(&self) {}
    fn end_of_dataloader(&self, _remainder: Option<usize>) {
        self.last_batches.fetch_add(1, Ordering::SeqCst);
    }
    fn end(&self) {
        self.ends.fetch_add(1, Ordering::SeqCst);
    }
}

fn loss(model: &Model<Flex>) -> f32 {
    let batch =
        Batcher::<Flex, _, _>::batch(&Pairs, data(64).iter().collect(), &Default::default());
    model.regression(batch).loss.into_scalar()
}

fn data(n: usize) -> InMemDataset<(f32, f32)> {
    #[allow(clippy::cast_precision_loss)] // small integers
    let items = (0..n)
        .map(|i| {
            let x = i as f32 / n as f32;
            (x, 2.0 * x + 1.0)
        })
        .collect();
    InMemDataset::new(items)
}

#[test]
fn shard_loader_trains_a_model_with_supervised_training() {
    let device = Default::default();
    let observed = Arc::new(Epochs::default());
    let config = DataLoaderConfig::new(8)
        .with_shuffle(true)
        .with_use_seedable_sampler(true)
        .with_data_seed(Some(3))
        .with_non_blocking(true);
    let train = ShardLoaderBuilder::<Train, _, _>::new(config.clone(), data(64), Pairs)
        .observer(observed.clone())
        .build(std::slice::from_ref(&device))
        .unwrap()
        .remove(0);
    let valid = ShardLoaderBuilder::<Flex, _, _>::new(config, data(16), Pairs)
        .build(std::slice::from_ref(&device))
        .unwrap()
        .remove(0);

    Train::seed(&device, 7);
    let model = Model::<Train> {
        fc: LinearConfig::new(1, 1).init(&device),
    };
    let before = model.valid();
    let learner = Learner::new(model, SgdConfig::new().init(), 0.1);
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-loader-training-{}",
        std::process::id()
    ));
    let result = SupervisedTraining::new(&dir, Arc::new(train.clone()), Arc::new(valid))
        .num_epochs(2)
        .renderer(CliMetricsRenderer::new())
        .with_application_logger(None)
        .launch(learner);
    let _ = std::fs::remove_dir_all(&dir);

    // Two whole epochs went through the loader: reported, and counted on the kept handle.
    assert_eq!(observed.last_batches.load(Ordering::SeqCst), 2);
    assert_eq!(observed.ends.load(Ordering::SeqCst), 2);
    assert_eq!(train.epoch(), 2);
    assert_eq!(train.state().position, 0);
    // And the model learned from them.
    assert!(
        loss(&result.model) < loss(&before),
        "loss {} after training, {} before",
        loss(&result.model),
        loss(&before)
    );
}
