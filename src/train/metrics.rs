//! The strategy's state as Burn metrics, shown by Burn's renderer and written by its loggers:
//! the loss scale in force and the optimizer steps skipped so far, each named with the
//! precision training runs in.
//!
//! ```text
//! let report = strategy.report();
//! SupervisedTraining::new(dir, train, valid)
//!     .metric_train_numeric(AccelerateMetric::loss_scale(&report))
//!     .metric_train_numeric(AccelerateMetric::skipped_steps(&report))
//!     .with_accelerate(strategy)
//! ```
//!
//! They read the [`TrainingReport`], which the loop updates at every optimizer step; Burn
//! computes metrics on its event-processing thread, so a value may trail the loop by a batch.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes,
    NumericEntry, SerializedEntry,
};
use burn::train::{ClassificationOutput, RegressionOutput};

use super::TrainingReport;

/// What an [`AccelerateMetric`] reads: nothing from the batch (the values live in the
/// [`TrainingReport`]). Burn's `ClassificationOutput` and `RegressionOutput` adapt to it; for
/// another output type, implement `Adaptor<AccelerateMetricInput>` returning this.
#[derive(Debug, Clone, Copy, Default)]
pub struct AccelerateMetricInput;

impl<B: Backend> Adaptor<AccelerateMetricInput> for ClassificationOutput<B> {
    fn adapt(&self) -> AccelerateMetricInput {
        AccelerateMetricInput
    }
}

impl<B: Backend> Adaptor<AccelerateMetricInput> for RegressionOutput<B> {
    fn adapt(&self) -> AccelerateMetricInput {
        AccelerateMetricInput
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    LossScale,
    SkippedSteps,
}

/// The loss scale or the skipped-step count of an accelerated training, as a Burn metric.
#[derive(Clone)]
pub struct AccelerateMetric {
    kind: Kind,
    name: MetricName,
    report: TrainingReport,
    state: NumericMetricState,
}

impl AccelerateMetric {
    fn new(kind: Kind, report: &TrainingReport) -> Self {
        let precision = report.stats().precision.short_name();
        let label = match kind {
            Kind::LossScale => "Loss Scale",
            Kind::SkippedSteps => "Skipped Steps",
        };
        Self {
            kind,
            name: Arc::new(format!("{label} [{precision}]")),
            report: report.clone(),
            state: NumericMetricState::default(),
        }
    }

    /// The loss scale in force (1 without loss scaling).
    pub fn loss_scale(report: &TrainingReport) -> Self {
        Self::new(Kind::LossScale, report)
    }

    /// Optimizer steps skipped on overflow since training started.
    pub fn skipped_steps(report: &TrainingReport) -> Self {
        Self::new(Kind::SkippedSteps, report)
    }
}

impl Metric for AccelerateMetric {
    type Input = AccelerateMetricInput;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn update(&mut self, _item: &Self::Input, _metadata: &MetricMetadata) -> SerializedEntry {
        let (value, precision) = {
            let stats = self.report.lock();
            match self.kind {
                Kind::LossScale => (f64::from(stats.loss_scale.loss_scale()), 0),
                Kind::SkippedSteps => (stats.skipped_live as f64, 0),
            }
        };
        self.state.update(
            value,
            1,
            FormatOptions::new(self.name.clone()).precision(precision),
        )
    }

    fn clear(&mut self) {
        self.state.reset();
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: self.kind == Kind::LossScale,
        }
        .into()
    }
}

impl Numeric for AccelerateMetric {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }

    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}
