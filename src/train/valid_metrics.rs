//! Validation metrics combined across processes, as Accelerate's `gather_for_metrics` combines
//! what each process evaluated.
//!
//! Every process validates its own whole batches of the validation loader
//! ([`BatchSplit`](crate::data::BatchSplit)), and Burn's event processor computes each
//! batch's metric entries there, as it would on one process (the same batches, so the same
//! entries). Burn reads a metric's epoch value back from its metric logger: the mean of the
//! epoch's entries weighted by their item counts (`NumericMetricsAggregate` in burn-train
//! 0.21); early stopping, the metric-based checkpointing strategies and the learner summary
//! all read it there. So the strategy registers a [`ProcessMetricLogger`] as the run's metric
//! logger on every process: it passes the training entries on as they come, and holds the
//! validation entries back until the epoch's validation is over on every process; then
//! [`ProcessMetrics::combine`] gathers every process's entries and logs all of them, in process
//! order (which is the single-process batch order), on every process. Every process's store
//! then holds the entries one process validating everything would have logged, and Burn's
//! epoch values, early stopping and checkpoint choice are the same on every process.
//!
//! Every entry Burn logs combines this way, numeric or not, as long as a batch's entry
//! depends on that batch alone, which is true of Burn's own metrics (loss, accuracy, top-k
//! accuracy, perplexity, CER, WER, ...). A metric whose entry carries state from the batches
//! before it (a running value computed by the metric itself) would log each process's own
//! running values: the logger cannot tell it apart. What does not pass through the logger is
//! Burn's renderer's live view, which shows this process's batches while they run.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, NumericMetricUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricEntry, MetricId, NumericEntry, SerializedEntry};
use serde::{Deserialize, Serialize};

use crate::distributed::{DistributedError, ProcessGroup};

/// One entry of a validation batch, as it travels between processes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Entry {
    /// The metric's name (its id in Burn 0.21, and the same on every process).
    metric: String,
    /// What a renderer shows.
    formatted: String,
    /// What a logger writes (a numeric metric's `value,count`).
    serialized: String,
    /// Whether it came from a numeric metric.
    numeric: bool,
}

/// What a validation epoch's entries came to, this process's and the combined ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Combined {
    /// This process's batches (metric updates).
    pub(super) own_batches: usize,
    /// All processes' batches.
    pub(super) batches: usize,
}

struct Shared {
    /// The logger the combined entries go to: Burn's file logger of the artifact directory
    /// on the main process, an in-memory one elsewhere.
    inner: Box<dyn MetricLogger>,
    names: HashMap<MetricId, String>,
    ids: HashMap<String, MetricId>,
    /// This process's validation updates of the epoch, held back, with the epoch the store
    /// logged them under.
    held: Vec<(usize, MetricsUpdate)>,
    /// The validation epoch's end, held back until its entries are logged.
    held_end: Option<EpochSummary>,
    /// The epoch Burn's store logs the next validation entries under (it counts them apart
    /// from the training's, from 1).
    valid_epoch: usize,
}

/// The handle the strategy combines the validation metrics with; the logger it registers
/// shares it.
#[derive(Clone)]
pub(super) struct ProcessMetrics {
    shared: Arc<Mutex<Shared>>,
}

impl ProcessMetrics {
    /// Combined entries go to `inner`.
    pub(super) fn new(inner: Box<dyn MetricLogger>) -> Self {
        Self {
            shared: Arc::new(Mutex::new(Shared {
                inner,
                names: HashMap::new(),
                ids: HashMap::new(),
                held: Vec::new(),
                held_end: None,
                valid_epoch: 1,
            })),
        }
    }

    /// The metric logger to register with Burn's builder.
    pub(super) fn logger(&self) -> ProcessMetricLogger {
        ProcessMetricLogger {
            shared: self.shared.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while logging leaves the entries as they were: still usable.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gathers the validation epoch's entries of every process and logs them all, in process
    /// order, then the epoch's end. Every process calls it once per validation epoch, after
    /// Burn's store has received the epoch's events (`fit::flush_events`).
    ///
    /// # Errors
    /// A failed collective.
    pub(super) fn combine(&self, group: &ProcessGroup) -> Result<Combined, DistributedError> {
        let (own, epoch) = {
            let mut shared = self.lock();
            let held = std::mem::take(&mut shared.held);
            let epoch = held.first().map_or(shared.valid_epoch, |(epoch, _)| *epoch);
            let own: Vec<Vec<Entry>> = held
                .into_iter()
                .map(|(_, update)| shared.entries(update))
                .collect();
            (own, epoch)
        };
        let own_batches = own.len();
        // Outside the lock: Burn's store thread logs through it meanwhile.
        let all = group.all_gather_object(&own)?;
        let mut shared = self.lock();
        let mut running = Running::default();
        let mut batches = 0;
        for update in all.into_iter().flatten() {
            batches += 1;
            let update = shared.update(update, &mut running);
            shared.inner.log(update, epoch, &Split::Valid);
        }
        let end = shared
            .held_end
            .take()
            .unwrap_or_else(|| EpochSummary::new(epoch, Split::Valid));
        shared.valid_epoch = end.epoch_number + 1;
        shared.inner.log_epoch_summary(end);
        Ok(Combined {
            own_batches,
            batches,
        })
    }
}

// The mean of the combined numeric entries so far, per metric (the update's running value).
#[derive(Default)]
struct Running(HashMap<String, (f64, usize)>);

impl Running {
    fn add(&mut self, metric: &str, entry: &NumericEntry) -> NumericEntry {
        let (value, count) = match entry {
            NumericEntry::Value(v) => (*v, 1),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (*aggregated_value, *count),
        };
        let (sum, total) = self.0.entry(metric.to_string()).or_default();
        *sum += value * count as f64;
        *total += count;
        NumericEntry::Aggregated {
            aggregated_value: *sum / (*total).max(1) as f64,
            count: *total,
        }
    }
}

impl Shared {
    // An update's entries, by metric name.
    fn entries(&self, update: MetricsUpdate) -> Vec<Entry> {
        let name = |id: &MetricId| {
            self.names
                .get(id)
                .cloned()
                .unwrap_or_else(|| format!("{id:?}"))
        };
        let plain = update.entries.into_iter().map(|e| Entry {
            metric: name(&e.metric_id),
            formatted: e.serialized_entry.formatted,
            serialized: e.serialized_entry.serialized,
            numeric: false,
        });
        let numeric = update.entries_numeric.into_iter().map(|n| Entry {
            metric: name(&n.entry.metric_id),
            formatted: n.entry.serialized_entry.formatted,
            serialized: n.entry.serialized_entry.serialized,
            numeric: true,
        });
        plain.chain(numeric).collect()
    }

    // A gathered batch's entries as Burn's update, with this process's metric ids.
    fn update(&self, entries: Vec<Entry>, running: &mut Running) -> MetricsUpdate {
        let mut update = MetricsUpdate::new(Vec::new(), Vec::new());
        for entry in entries {
            let Some(id) = self.ids.get(&entry.metric) else {
                // Every process registers the same metrics: one this process lacks is logged
                // by the process that has it.
                log::warn!(
                    "burn-accelerate: validation metric {:?} of another process is not one of \
                     this process's metrics: its entries are left out here",
                    entry.metric
                );
                continue;
            };
            let metric_entry = MetricEntry::new(
                id.clone(),
                SerializedEntry::new(entry.formatted, entry.serialized),
            );
            if !entry.numeric {
                update.entries.push(metric_entry);
                continue;
            }
            match NumericEntry::deserialize(&metric_entry.serialized_entry.serialized) {
                Ok(numeric) => {
                    let running_entry = running.add(&entry.metric, &numeric);
                    update.entries_numeric.push(NumericMetricUpdate::new(
                        metric_entry,
                        numeric,
                        running_entry,
                    ));
                }
                // Logged as it came: Burn's reader reports it as it would its own.
                Err(_) => update.entries.push(metric_entry),
            }
        }
        update
    }
}

/// Burn's metric logger of a training on several processes: the training's entries go to the
/// logger of this process ([`AccelerateStrategy`](super::AccelerateStrategy)'s choice: Burn's
/// files in the artifact directory on the main process, memory elsewhere) as they come, and
/// the validation's once every process's are there, so that every process's Burn metrics hold
/// the entries of all processes' validation batches (see
/// [`WithAccelerate::with_accelerate`](super::WithAccelerate::with_accelerate)). Registered by
/// `with_accelerate` on several processes; not constructed by hand.
pub struct ProcessMetricLogger {
    shared: Arc<Mutex<Shared>>,
}

impl ProcessMetricLogger {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MetricLogger for ProcessMetricLogger {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        let mut shared = self.lock();
        match split {
            Split::Valid => shared.held.push((epoch, update)),
            _ => shared.inner.log(update, epoch, split),
        }
    }

    fn read_numeric(
        &mut self,
        name: &str,
        epoch: usize,
        split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        self.lock().inner.read_numeric(name, epoch, split)
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        let mut shared = self.lock();
        shared
            .names
            .insert(definition.metric_id.clone(), definition.name.clone());
        shared
            .ids
            .insert(definition.name.clone(), definition.metric_id.clone());
        shared.inner.log_metric_definition(definition);
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        let mut shared = self.lock();
        match summary.split {
            Split::Valid => shared.held_end = Some(summary),
            _ => shared.inner.log_epoch_summary(summary),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::train::logger::InMemoryMetricLogger;
    use burn::train::metric::{MetricAttributes, NumericAttributes};

    fn definition(name: &str) -> MetricDefinition {
        MetricDefinition {
            metric_id: MetricId::new(Arc::new(name.to_string())),
            name: name.to_string(),
            description: None,
            attributes: MetricAttributes::Numeric(NumericAttributes {
                unit: None,
                higher_is_better: false,
            }),
        }
    }

    fn loss(value: f64, count: usize) -> MetricsUpdate {
        let entry = NumericEntry::Aggregated {
            aggregated_value: value,
            count,
        };
        MetricsUpdate::new(
            Vec::new(),
            vec![NumericMetricUpdate::new(
                MetricEntry::new(
                    MetricId::new(Arc::new("Loss".into())),
                    SerializedEntry::new(format!("{value}"), entry.serialize()),
                ),
                entry.clone(),
                entry,
            )],
        )
    }

    fn mean(entries: &[NumericEntry]) -> f64 {
        let (sum, count) = entries.iter().fold((0.0, 0), |(s, n), e| match e {
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (s + aggregated_value * *count as f64, n + count),
            NumericEntry::Value(v) => (s + v, n + 1),
        });
        sum / count as f64
    }

    #[test]
    fn validation_entries_wait_for_the_combination_and_training_entries_do_not() {
        let metrics = ProcessMetrics::new(Box::new(InMemoryMetricLogger::new()));
        let mut logger = metrics.logger();
        logger.log_metric_definition(definition("Loss"));
        logger.log(loss(9.0, 4), 1, &Split::Train);
        logger.log(loss(1.0, 4), 1, &Split::Valid);
        logger.log(loss(4.0, 2), 1, &Split::Valid);
        logger.log_epoch_summary(EpochSummary::new(1, Split::Valid));
        assert_eq!(
            logger.read_numeric("Loss", 1, &Split::Train).unwrap().len(),
            1
        );
        // Held back: a query now would read (and Burn's store would cache) a partial value.
        assert!(
            logger
                .read_numeric("Loss", 1, &Split::Valid)
                .unwrap()
                .is_empty()
        );

        let group = crate::distributed::ProcessState::single().group().unwrap();
        let combined = metrics.combine(&group).unwrap();
        assert_eq!(
            combined,
            Combined {
                own_batches: 2,
                batches: 2
            }
        );
        let valid = logger.read_numeric("Loss", 1, &Split::Valid).unwrap();
        assert_eq!(valid.len(), 2);
        assert_eq!(mean(&valid), 2.0);

        // The next epoch is logged under the next number, even where a process had no batch.
        logger.log_epoch_summary(EpochSummary::new(2, Split::Valid));
        assert_eq!(metrics.combine(&group).unwrap().batches, 0);
        assert_eq!(metrics.lock().valid_epoch, 3);
    }

    #[test]
    fn gathered_entries_keep_their_values_counts_and_kind() {
        let metrics = ProcessMetrics::new(Box::new(InMemoryMetricLogger::new()));
        let mut logger = metrics.logger();
        logger.log_metric_definition(definition("Loss"));
        let shared = metrics.lock();
        let entries = shared.entries(loss(0.25, 3));
        assert_eq!(entries[0].metric, "Loss");
        assert!(entries[0].numeric);
        let mut running = Running::default();
        let first = shared.update(entries.clone(), &mut running);
        let again = shared.update(entries, &mut running);
        let numeric = &first.entries_numeric[0].numeric_entry;
        assert_eq!(numeric.serialize(), "0.25,3");
        // The running value is the combined mean so far, over 6 items.
        assert_eq!(again.entries_numeric[0].running_entry.serialize(), "0.25,6");
        // An entry of a metric this process does not have is left out, not misnamed.
        let stranger = vec![Entry {
            metric: "Stranger".into(),
            formatted: "1".into(),
            serialized: "1".into(),
            numeric: true,
        }];
        let update = shared.update(stranger, &mut running);
        assert!(update.entries.is_empty() && update.entries_numeric.is_empty());
    }
}
