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
//! Every entry Burn logs combines this way as long as a batch's entry depends on that batch
//! alone, which is true of most of Burn's own metrics (loss, accuracy, top-k accuracy, CER,
//! WER, ...): their entries are the batch's value and item count, and the metric's own
//! running value is the item-weighted mean of its entries so far. Non-numeric entries (text,
//! which no epoch value is read from) are logged in process order, as one process would.
//!
//! A numeric metric whose epoch value cannot be rebuilt from its entries is **shown per
//! process**, and named once per run in a warning on the main process (and in
//! [`TrainingStats::valid_metrics_per_process`](super::TrainingStats::valid_metrics_per_process)):
//! each process's Burn metrics then hold only its own entries of that metric. The
//! decision (`Consistency`) reads, on each process, every numeric entry of the epoch with the
//! running value the metric itself reported with it:
//! - an entry that is not a number Burn can read back (`value` or `value,count`);
//! - a running value that is not the item-weighted mean of the entries so far (its count not
//!   their item count, or its value not their mean): the entry carries state from the batches
//!   before it, as gauges' do whose running value is the last reading (`CpuUse`, `CpuMemory`,
//!   `CpuTemperature`, which are each process's own anyway).
//!
//! Burn's `PerplexityMetric` carries state too (its entry is the epoch's perplexity so far,
//! with the epoch's tokens so far), but what it carries is known: where every process's
//! entries of it are its running values, they are rebuilt as one process's
//! (`rebuild_perplexity`), each process's batches' log-likelihoods and tokens summed on in
//! process order, and it is combined like the others.
//!
//! The processes exchange what they found, so every process shows the same metrics per
//! process. A process that validated one batch of such a metric cannot tell (its one entry is
//! its running value), so where every process has one batch, no process flags it.
//!
//! Why shown per process and not refused with an error: Burn's `MetricLogger` cannot return
//! one, a metric's definition does not say whether its entries carry state, and the evidence
//! comes after the first validation epoch, when refusing would throw the epoch's training
//! away. What does not pass through the logger is Burn's renderer's live view, which shows
//! this process's batches while they run.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
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

/// Why a validation metric's entries cannot be combined across processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(super) enum Uncombinable {
    /// An entry of a numeric metric that is not a number Burn can read back.
    NotNumeric,
    /// The metric's running value is not the item-weighted mean of its entries so far.
    CarriesState,
}

impl std::fmt::Display for Uncombinable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotNumeric => {
                "its entries are not numbers Burn can read back (`value` or `value,count`)"
            }
            Self::CarriesState => {
                "its running value is not the item-weighted mean of its entries, so an entry \
                 carries state from the batches before it"
            }
        })
    }
}

/// The decision whether a numeric metric's entries combine: fed, in order, this process's
/// entries of one validation epoch with the running value the metric reported with each.
#[derive(Default)]
pub(super) struct Consistency {
    /// Per metric: the sum of value × items and the items of its entries so far.
    sums: HashMap<String, (f64, usize)>,
    found: BTreeMap<String, Uncombinable>,
    /// Per metric: whether every entry so far was the metric's running value itself (the
    /// epoch's value so far, as Burn's perplexity logs it).
    cumulative: BTreeMap<String, bool>,
}

impl Consistency {
    /// Checks one entry of `metric`: `serialized`, what its logger writes, and `running`, the
    /// metric's own running value after it.
    pub(super) fn check(&mut self, metric: &str, serialized: &str, running: &NumericEntry) {
        if self.found.contains_key(metric) {
            return;
        }
        let Ok(entry) = NumericEntry::deserialize(serialized) else {
            self.found
                .insert(metric.to_string(), Uncombinable::NotNumeric);
            return;
        };
        let is_running = match (&entry, running) {
            (
                NumericEntry::Aggregated {
                    aggregated_value: value,
                    count,
                },
                NumericEntry::Aggregated {
                    aggregated_value: running,
                    count: running_count,
                },
            ) => count == running_count && value.to_bits() == running.to_bits(),
            _ => false,
        };
        *self.cumulative.entry(metric.to_string()).or_insert(true) &= is_running;
        let (sum, items) = self.sums.entry(metric.to_string()).or_default();
        let (value, count) = weighted(&entry);
        *sum += value * count as f64;
        *items += count;
        let mean = *sum / *items as f64;
        let consistent = match running {
            NumericEntry::Value(value) => same(*value, mean),
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => *count == *items && same(*aggregated_value, mean),
        };
        if !consistent {
            self.found
                .insert(metric.to_string(), Uncombinable::CarriesState);
        }
    }

    /// The metrics whose every entry was the metric's running value.
    pub(super) fn cumulative(&self) -> BTreeSet<String> {
        self.cumulative
            .iter()
            .filter(|(_, every)| **every)
            .map(|(metric, _)| metric.clone())
            .collect()
    }

    /// The metrics found uncombinable, by name.
    pub(super) fn found(self) -> BTreeMap<String, Uncombinable> {
        self.found
    }
}

// An entry's value and the items it stands for, as Burn's epoch aggregate weighs it (a plain
// value counts once).
fn weighted(entry: &NumericEntry) -> (f64, usize) {
    match entry {
        NumericEntry::Value(v) => (*v, 1),
        NumericEntry::Aggregated {
            aggregated_value,
            count,
        } => (*aggregated_value, *count),
    }
}

// Equal but for the last bits: a metric that sums its entries in another order may round
// apart (the metrics of Burn's `NumericMetricState` compute the very same sums).
fn same(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

/// What one process sends at a validation epoch's end: its batches' entries, and the metrics
/// whose entries it found uncombinable.
#[derive(Debug, Serialize, Deserialize)]
struct ProcessEntries {
    batches: Vec<Vec<Entry>>,
    uncombinable: BTreeMap<String, Uncombinable>,
    /// The metrics whose every entry of this process was the metric's running value.
    cumulative: BTreeSet<String>,
}

/// The name of Burn's `PerplexityMetric`, whose entries are rebuilt rather than shown per
/// process: its entry is the epoch's perplexity so far, `exp(nll so far / tokens so far)`,
/// with the tokens so far (burn-train 0.21, src/metric/perplexity.rs, `PerplexityState`).
const PERPLEXITY: &str = "Perplexity";

// Rewrites the processes' cumulative entries of Burn's perplexity, `metric`, as the entries
// one process would have logged over all batches in process order: each process's entries
// give its batches' negative log-likelihoods and tokens (the differences of `ln(value) ×
// tokens` and of the tokens), which are summed on across processes. Returns false, the
// entries untouched, where an entry is not a finite cumulative perplexity.
fn rebuild_perplexity(processes: &mut [ProcessEntries], metric: &str) -> bool {
    let mut rewritten = Vec::new();
    let (mut nll, mut tokens) = (0.0_f64, 0_usize);
    for (p, process) in processes.iter().enumerate() {
        let (mut own_nll, mut own_tokens) = (0.0_f64, 0_usize);
        for (b, batch) in process.batches.iter().enumerate() {
            for (i, entry) in batch.iter().enumerate() {
                if entry.metric != metric || !entry.numeric {
                    continue;
                }
                let Ok(NumericEntry::Aggregated {
                    aggregated_value,
                    count,
                }) = NumericEntry::deserialize(&entry.serialized)
                else {
                    return false;
                };
                if !(aggregated_value.is_finite() && aggregated_value > 0.0) || count < own_tokens {
                    return false;
                }
                let so_far = aggregated_value.ln() * count as f64;
                nll += so_far - own_nll;
                tokens += count - own_tokens;
                (own_nll, own_tokens) = (so_far, count);
                let value = (nll / tokens as f64).exp();
                let combined = NumericEntry::Aggregated {
                    aggregated_value: value,
                    count: tokens,
                };
                rewritten.push((p, b, i, combined.serialize()));
            }
        }
    }
    for (p, b, i, serialized) in rewritten {
        processes[p].batches[b][i].serialized = serialized;
    }
    true
}

/// What a validation epoch's entries came to, this process's and the combined ones.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Combined {
    /// This process's batches (metric updates).
    pub(super) own_batches: usize,
    /// All processes' batches.
    pub(super) batches: usize,
    /// The metrics shown per process so far in the run (their entries could not be
    /// combined), by name.
    pub(super) per_process: Vec<String>,
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
    /// The metrics shown per process, once found uncombinable on any process (for the rest
    /// of the run, and named once).
    per_process: BTreeMap<String, Uncombinable>,
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
                per_process: BTreeMap::new(),
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
            let (uncombinable, cumulative) = shared.consistency(&held);
            let batches: Vec<Vec<Entry>> = held
                .into_iter()
                .map(|(_, update)| shared.entries(update))
                .collect();
            (
                ProcessEntries {
                    batches,
                    uncombinable,
                    cumulative,
                },
                epoch,
            )
        };
        let own_batches = own.batches.len();
        // Outside the lock: Burn's store thread logs through it meanwhile.
        let mut all = group.all_gather_object(&own)?;
        let mut shared = self.lock();
        let mut found: BTreeMap<String, Uncombinable> = all
            .iter()
            .flat_map(|process| process.uncombinable.clone())
            .collect();
        // Burn's perplexity is rebuilt where every process's entries of it are its running
        // values (even where no process had two batches to tell by).
        let logs = |process: &ProcessEntries| {
            process
                .batches
                .iter()
                .flatten()
                .any(|e| e.metric == PERPLEXITY)
        };
        if all.iter().any(logs)
            && all
                .iter()
                .filter(|p| logs(p))
                .all(|p| p.cumulative.contains(PERPLEXITY))
            && !shared.per_process.contains_key(PERPLEXITY)
            && rebuild_perplexity(&mut all, PERPLEXITY)
        {
            found.remove(PERPLEXITY);
        }
        for (metric, why) in found {
            if shared.per_process.contains_key(&metric) {
                continue;
            }
            if group.rank() == 0 {
                log::warn!(
                    "burn-accelerate: validation metric {metric:?} cannot be combined across \
                     processes ({why}): from this epoch on, each process's Burn metrics show \
                     that process's own validation batches for it, not the whole validation \
                     set's (a metric whose entries are each batch's value and item count, as \
                     Burn's `NumericMetricState` writes them, combines)"
                );
            }
            shared.per_process.insert(metric, why);
        }
        let this = group.rank();
        let per_process: HashSet<String> = shared.per_process.keys().cloned().collect();
        let mut running = Running::default();
        let mut batches = 0;
        for (process, entries) in all.into_iter().enumerate() {
            for mut update in entries.batches {
                batches += 1;
                if process != this {
                    update.retain(|entry| !per_process.contains(&entry.metric));
                }
                let update = shared.update(update, &mut running);
                shared.inner.log(update, epoch, &Split::Valid);
            }
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
            per_process: shared.per_process.keys().cloned().collect(),
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
    // Which of this process's numeric metrics of the epoch cannot be combined.
    // Also the metrics whose every entry was their running value.
    fn consistency(
        &self,
        held: &[(usize, MetricsUpdate)],
    ) -> (BTreeMap<String, Uncombinable>, BTreeSet<String>) {
        let mut consistency = Consistency::default();
        for (_, update) in held {
            for numeric in &update.entries_numeric {
                consistency.check(
                    &self.name(&numeric.entry.metric_id),
                    &numeric.entry.serialized_entry.serialized,
                    &numeric.running_entry,
                );
            }
        }
        let cumulative = consistency.cumulative();
        (consistency.found(), cumulative)
    }

    fn name(&self, id: &MetricId) -> String {
        self.names
            .get(id)
            .cloned()
            .unwrap_or_else(|| format!("{id:?}"))
    }

    // An update's entries, by metric name.
    fn entries(&self, update: MetricsUpdate) -> Vec<Entry> {
        let name = |id: &MetricId| self.name(id);
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

    fn aggregated(value: f64, count: usize) -> NumericEntry {
        NumericEntry::Aggregated {
            aggregated_value: value,
            count,
        }
    }

    // A batch's loss entry, with the metric's running value after it (as Burn's processor
    // reports it).
    fn loss_then(value: f64, count: usize, running: NumericEntry) -> MetricsUpdate {
        let entry = aggregated(value, count);
        MetricsUpdate::new(
            Vec::new(),
            vec![NumericMetricUpdate::new(
                MetricEntry::new(
                    MetricId::new(Arc::new("Loss".into())),
                    SerializedEntry::new(format!("{value}"), entry.serialize()),
                ),
                entry,
                running,
            )],
        )
    }

    // An epoch's first batch: its running value is its own.
    fn loss(value: f64, count: usize) -> MetricsUpdate {
        loss_then(value, count, aggregated(value, count))
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
        logger.log(loss_then(4.0, 2, aggregated(2.0, 6)), 1, &Split::Valid);
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
                batches: 2,
                per_process: Vec::new(),
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

    // Burn's own metrics, fed batches and asked for their running values, as Burn's processor
    // does (`MetricWrapper::update`).
    #[cfg(feature = "flex")]
    fn checked<M>(metric: &mut M, inputs: &[M::Input]) -> BTreeMap<String, Uncombinable>
    where
        M: burn::train::metric::Metric + burn::train::metric::Numeric,
    {
        use burn::data::dataloader::Progress;
        use burn::train::metric::MetricMetadata;
        let metadata = MetricMetadata {
            progress: Progress::new(1, 1),
            global_progress: Progress::new(1, 1),
            iteration: Some(1),
            lr: None,
        };
        let mut consistency = Consistency::default();
        for input in inputs {
            let entry = metric.update(input, &metadata);
            consistency.check(&metric.name(), &entry.serialized, &metric.running_value());
        }
        consistency.found()
    }

    #[cfg(feature = "flex")]
    #[test]
    fn burns_per_batch_metrics_combine_and_its_perplexity_does_not() {
        use burn::backend::Flex;
        use burn::tensor::{Int, Tensor};
        use burn::train::metric::{AccuracyInput, AccuracyMetric, LossInput, LossMetric};
        use burn::train::metric::{PerplexityInput, PerplexityMetric};
        type B = Flex;
        let device = Default::default();
        // Three batches of 4, 4 and 2 items over 3 classes.
        let outputs: Vec<Tensor<B, 2>> = [
            vec![
                0.1f32, 2.0, -1.0, 1.5, 0.2, 0.3, -0.5, 0.5, 2.5, 1.0, 1.0, 0.0,
            ],
            vec![0.3, -2.0, 1.0, 0.5, 1.2, 0.1, 2.5, 0.5, -1.0, 0.0, 0.0, 3.0],
            vec![1.0, 0.5, 0.2, -0.3, 0.7, 0.9],
        ]
        .into_iter()
        .map(|v| {
            let rows = v.len() / 3;
            Tensor::<B, 1>::from_floats(v.as_slice(), &device).reshape([rows, 3])
        })
        .collect();
        let targets: Vec<Tensor<B, 1, Int>> = [vec![1, 0, 2, 0], vec![2, 1, 0, 2], vec![0, 2]]
            .into_iter()
            .map(|t| Tensor::from_ints(t.as_slice(), &device))
            .collect();
        let losses: Vec<LossInput<B>> = [0.5f32, 1.25, 0.75]
            .into_iter()
            .map(|l| LossInput::new(Tensor::from_floats([l], &device)))
            .collect();
        assert!(checked(&mut LossMetric::<B>::new(), &losses).is_empty());
        let accuracy: Vec<AccuracyInput<B>> = outputs
            .iter()
            .zip(&targets)
            .map(|(o, t)| AccuracyInput::new(o.clone(), t.clone()))
            .collect();
        assert!(checked(&mut AccuracyMetric::<B>::new(), &accuracy).is_empty());
        let perplexity: Vec<PerplexityInput<B>> = outputs
            .iter()
            .zip(&targets)
            .map(|(o, t)| PerplexityInput::new(o.clone(), t.clone()))
            .collect();
        let found = checked(&mut PerplexityMetric::<B>::new(), &perplexity);
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            [("Perplexity".to_string(), Uncombinable::CarriesState)]
        );
        // One batch alone cannot tell.
        assert!(checked(&mut PerplexityMetric::<B>::new(), &perplexity[..1]).is_empty());

        // Its entries on one process, and on two (the first batch, then the other two),
        // rebuilt: the same, but for the rounding of ln and exp.
        let logged = |inputs: &[PerplexityInput<B>]| -> Vec<Entry> {
            use burn::data::dataloader::Progress;
            use burn::train::metric::{Metric, MetricMetadata, Numeric};
            let metadata = MetricMetadata {
                progress: Progress::new(1, 1),
                global_progress: Progress::new(1, 1),
                iteration: Some(1),
                lr: None,
            };
            let mut metric = PerplexityMetric::<B>::new();
            inputs
                .iter()
                .map(|input| {
                    let entry = metric.update(input, &metadata);
                    assert_eq!(entry.serialized, metric.running_value().serialize());
                    Entry {
                        metric: PERPLEXITY.into(),
                        formatted: entry.formatted,
                        serialized: entry.serialized,
                        numeric: true,
                    }
                })
                .collect()
        };
        let one = logged(&perplexity);
        let process = |entries: Vec<Entry>| ProcessEntries {
            batches: entries.into_iter().map(|e| vec![e]).collect(),
            uncombinable: BTreeMap::new(),
            cumulative: BTreeSet::from([PERPLEXITY.to_string()]),
        };
        let mut two = [
            process(logged(&perplexity[..1])),
            process(logged(&perplexity[1..])),
        ];
        assert!(rebuild_perplexity(&mut two, PERPLEXITY));
        let rebuilt: Vec<Entry> = two.into_iter().flat_map(|p| p.batches).flatten().collect();
        assert_eq!(rebuilt.len(), one.len());
        for (got, want) in rebuilt.iter().zip(&one) {
            let (got, want) = (
                NumericEntry::deserialize(&got.serialized).unwrap(),
                NumericEntry::deserialize(&want.serialized).unwrap(),
            );
            assert_eq!(weighted(&got).1, weighted(&want).1, "tokens");
            let (got, want) = (got.current(), want.current());
            assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
        }
    }

    #[test]
    fn entries_that_are_not_numbers_or_carry_state_are_found_by_name() {
        let mut consistency = Consistency::default();
        // Per-batch entries whose running value is their item-weighted mean.
        consistency.check("Loss", "0.5,4", &aggregated(0.5, 4));
        consistency.check("Loss", "2,2", &aggregated(1.0, 6));
        // A gauge: its running value is its last reading, not the mean of its readings.
        consistency.check("Gauge", "10", &NumericEntry::Value(10.0));
        consistency.check("Gauge", "20", &NumericEntry::Value(20.0));
        // Readings that agree cannot tell.
        consistency.check("Steady", "3", &NumericEntry::Value(3.0));
        consistency.check("Steady", "3", &NumericEntry::Value(3.0));
        // A running value whose count is not the entries' items.
        consistency.check("Running", "1,4", &aggregated(1.0, 4));
        consistency.check("Running", "1,8", &aggregated(1.0, 8));
        consistency.check("Text", "high", &NumericEntry::Value(1.0));
        // NaN losses stay a value like any other.
        consistency.check("Nan", "NaN,2", &aggregated(f64::NAN, 2));
        let found: Vec<(String, Uncombinable)> = consistency.found().into_iter().collect();
        assert_eq!(
            found,
            [
                ("Gauge".to_string(), Uncombinable::CarriesState),
                ("Running".to_string(), Uncombinable::CarriesState),
                ("Text".to_string(), Uncombinable::NotNumeric),
            ]
        );
    }

    #[test]
    fn a_metric_found_uncombinable_is_named_for_the_rest_of_the_run() {
        let metrics = ProcessMetrics::new(Box::new(InMemoryMetricLogger::new()));
        let mut logger = metrics.logger();
        logger.log_metric_definition(definition("Loss"));
        // Cumulative entries, as Burn's perplexity logs them: (value so far, items so far),
        // its running value the entry itself.
        logger.log(loss(2.0, 4), 1, &Split::Valid);
        logger.log(loss(3.0, 8), 1, &Split::Valid);
        let group = crate::distributed::ProcessState::single().group().unwrap();
        assert_eq!(metrics.combine(&group).unwrap().per_process, ["Loss"]);
        // This process's own entries are still logged.
        assert_eq!(
            logger.read_numeric("Loss", 1, &Split::Valid).unwrap().len(),
            2
        );
        // An epoch without batches keeps the finding.
        assert_eq!(metrics.combine(&group).unwrap().per_process, ["Loss"]);
    }
}
