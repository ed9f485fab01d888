//! The fit: Burn's training loop run by the strategy, epoch by epoch, over the step core
//! (`crate::step`), on one device or data-parallel, on one process or several.

use super::*;

// The training step of a fit: its loss scale and window's gradients are carried across epochs
// (windows do cross epochs when `sync_with_dataloader` is off).
pub(super) type Core<LC> = StepCore<TrainingBackend<LC>>;

// Ends the fit where something it cannot go on without failed. Burn's
// `SupervisedLearningStrategy::fit` returns the model and the event processor, with no error
// channel (burn-train 0.21, `learner/supervised/strategies/base.rs`), and a fit that went on
// would train the wrong thing (a process that left would leave the others waiting, a resume
// from the wrong state would look like a good run): so it panics, with the reason, in this one
// place. What can be checked before the fit is checked by `AccelerateStrategy::new`,
// `data_parallel` and `prepare_loader`, which return typed errors.
pub(super) fn fail(what: &str, err: impl core::fmt::Display) -> ! {
    panic!("burn-accelerate: {what}: {err}")
}

// The gradient-accumulation window of a fit (see `AccelerateStrategy::accumulation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Accumulation {
    // Batches per window.
    pub(super) steps: usize,
    // Summed (Burn's `grads_accumulation`) rather than averaged (Accelerate's).
    pub(super) sums: bool,
}

// The batches of one training step: one per device whose shard still has one (index into the
// loaders), and the loaders' combined progress after handing them out.
pub(super) struct Step<LC: LearningComponentsTypes> {
    inputs: Vec<(usize, StepInput<LC>)>,
    progress: Progress,
}

// Draws the next step's batches; `None` when every loader's epoch is over.
pub(super) fn next_step<LC: LearningComponentsTypes>(
    iterators: &mut [Box<dyn DataLoaderIterator<StepInput<LC>> + '_>],
) -> Option<Step<LC>> {
    let mut inputs = Vec::with_capacity(iterators.len());
    let mut progress = Progress::new(0, 0);
    for (index, iterator) in iterators.iter_mut().enumerate() {
        if let Some(input) = iterator.next() {
            inputs.push((index, input));
        }
        let p = iterator.progress();
        progress.items_processed += p.items_processed;
        progress.items_total += p.items_total;
    }
    (!inputs.is_empty()).then_some(Step { inputs, progress })
}

impl<LC: LearningComponentsTypes> AccelerateStrategy<LC> {
    #[allow(clippy::too_many_arguments)] // the pieces of Burn's loop, as its own epoch takes
    fn train_epoch(
        &self,
        learner: &mut Learner<LC>,
        loaders: &[TrainLoader<LC>],
        workers: Option<&DeviceWorkers<LC>>,
        global_progress: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
        core: &mut Core<LC>,
        armed: &ThreadArmed,
    ) -> EpochReport {
        let epoch = global_progress.items_processed;
        let mut report = EpochReport {
            epoch,
            ..EpochReport::default()
        };
        let mut iterators: Vec<_> = loaders.iter().map(|loader| loader.iter()).collect();
        let loader = self.state.begin_dataloader();
        let mut iteration = 0;
        let mut next = next_step::<LC>(&mut iterators);
        while let Some(step) = next.take() {
            report.batches += 1;
            // One step of look-ahead, as Accelerate's loader: the last step must be known
            // before its accumulate decision, so that it completes the window.
            next = next_step::<LC>(&mut iterators);
            if next.is_none() {
                loader.set_end_of_dataloader(None);
            }
            let batch = self.state.accumulate();
            // The learner's own parameters (a clone shares their values): the user's
            // `loss.backward()` runs through the step core's backward pass, as the
            // `Accelerator`'s does (at ZeRO stage 3, each gradient reduce-scattered in it).
            let model: TrainingModel<LC> = learner.model();
            let items: Vec<_> = match workers {
                Some(workers) => workers
                    .step(&model, step.inputs, core.loss_transform())
                    .into_iter()
                    .map(|output| {
                        core.add_gradients(&model, output.grads);
                        output.item
                    })
                    .collect(),
                None => step
                    .inputs
                    .into_iter()
                    .map(|(_, input)| {
                        core.backward_pass(&model, || {
                            let output = learner.train_step(input);
                            (output.grads, output.item)
                        })
                    })
                    .collect(),
            };
            // One forward and backward pass on every device is one pass of fp8's recipe
            // (replicas record their amaxes under the same keys, and the history keeps the
            // largest, as Transformer Engine reduces amaxes over the data-parallel group).
            core.end_pass();

            if batch.sync_gradients() {
                let slices = core
                    .sharded()
                    .is_some_and(|(_, stage)| stage.shards_parameters());
                let stepped = core.step(model, |model, grads| {
                    if slices {
                        // The learner's optimizer steps the model it holds: at stage 3, this
                        // process's slices.
                        learner.load_model(model.into_record());
                    }
                    learner.lr_step();
                    learner.optimizer_step(grads);
                    (learner.model(), learner.lr_current())
                });
                let (model, outcome) = stepped.unwrap_or_else(|err| fail("cannot step", err));
                // The next batches' losses at the adjusted scale.
                armed.set(core.loss_transform());
                if core.sharded().is_some() {
                    // Every parameter as its owner stepped it (at stage 3, released again after
                    // each process stepped its slices).
                    learner.load_model(model.into_record());
                }
                {
                    // Live values for the metrics; the epoch's report lands at its end.
                    let mut stats = self.report.lock();
                    stats.loss_scale = *core.loss_scale();
                    stats.skipped_live += usize::from(outcome == StepOutcome::SkippedOverflow);
                }
                match outcome {
                    StepOutcome::SkippedOverflow => report.skipped_steps += 1,
                    StepOutcome::Applied { .. } => {
                        report.scheduler_steps += 1;
                        report.optimizer_steps += 1;
                    }
                    StepOutcome::Accumulating => {}
                }
            }
            drop(batch);

            for item in items {
                iteration += 1;
                let item = TrainingItem::new(
                    item,
                    step.progress.clone(),
                    global_progress.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                );
                processor.process_train(LearnerEvent::ProcessedItem(item));
            }
            if interrupter.should_stop() {
                break;
            }
        }
        drop(loader);
        report.loss_scale = core.loss_scale().loss_scale();
        processor.process_train(LearnerEvent::EndEpoch(epoch));
        report
    }

    // Validates this process's part of the validation loader, under the fit's autocast (the
    // training's precision, as Accelerate's prepared model evaluates); returns the batches and
    // items it evaluated.
    fn valid_epoch(
        &self,
        learner: &Learner<LC>,
        dataloader: &ValidLoader<LC>,
        global_progress: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &Interrupter,
    ) -> (usize, usize) {
        let epoch = global_progress.items_processed;
        let model = learner.model().valid();
        let mut iterator = dataloader.iter();
        let mut iteration = 0;
        let mut items = 0;
        while let Some(item) = iterator.next() {
            let progress = iterator.progress();
            items = progress.items_processed;
            iteration += 1;
            let item = TrainingItem::new(
                model.step(item),
                progress,
                global_progress.clone(),
                Some(iteration),
                None,
            );
            processor.process_valid(LearnerEvent::ProcessedItem(item));
            if interrupter.should_stop() {
                break;
            }
        }
        processor.process_valid(LearnerEvent::EndEpoch(epoch));
        (iteration, items)
    }

    // Waits until Burn's store holds this process's validation entries of the epoch (Burn's
    // processor hands them on asynchronously: early stopping and the checkpointing strategy
    // would read, and Burn's store cache, a part of the epoch), then, on several processes,
    // combines every process's (`valid_metrics`); returns the batches of all processes and
    // the metrics shown per process.
    fn combine_valid_metrics(
        &self,
        own_batches: usize,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        store: &EventStoreClient,
    ) -> (usize, Vec<String>) {
        flush_events::<LC>(processor, store);
        let (Some(metrics), Some(group)) = (&self.valid_metrics, &self.group) else {
            return (own_batches, Vec::new());
        };
        let combined = metrics
            .combine(group)
            .unwrap_or_else(|err| fail("cannot combine the validation metrics", err));
        (combined.batches, combined.per_process)
    }
}

impl<LC> SupervisedLearningStrategy<LC> for AccelerateStrategy<LC>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    /// Burn's own `train`, without the summary on processes other than the main one: it reads
    /// the metric logs of the artifact directory, which only the main process writes (see
    /// [`WithAccelerate::with_accelerate`]), while the main process may still be writing them.
    fn train(
        &self,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut training_components: TrainingComponents<LC>,
    ) -> LearningResult<<LC as LearningComponentsTypes>::InferenceModel> {
        if !self.process.is_main_process() && training_components.summary.take().is_some() {
            log::info!(
                "burn-accelerate: process {} of {}: no learner summary here (the main process \
                 makes it from the metric logs it alone writes)",
                self.process.process_index(),
                self.process.num_processes()
            );
        }
        let (learner, resumed) = self.resume_before_fit(learner, &mut training_components);
        self.report.lock().resumed_from = resumed
            .as_ref()
            .map(|(epoch, _)| *epoch)
            .or(training_components.checkpoint);
        BurnTrain(self, Mutex::new(resumed)).train(
            learner,
            dataloader_train,
            dataloader_valid,
            training_components,
        )
    }

    fn fit(
        &self,
        training_components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        // Burn calls `fit` on the builder's thread, outside rayon's pool: on a pool's thread
        // the steps' parallel ops are computed there too (`threads::run_on_step_pool`).
        on_step_thread(|| {
            self.fit_here(
                training_components,
                learner,
                dataloader_train,
                dataloader_valid,
                starting_epoch,
                None,
            )
        })
    }
}

// Burn's default `SupervisedLearningStrategy::train` around the strategy's `fit` (an
// overriding `train` cannot call the default it overrides).
// With the epoch the strategy resumed from itself and that checkpoint's state, read and
// verified with it (Burn's `train` then starts at epoch 1); taken by the one `fit`.
struct BurnTrain<'a, S>(&'a S, Mutex<Option<(usize, AccelerateCheckpoint)>>);

impl<LC> SupervisedLearningStrategy<LC> for BurnTrain<'_, AccelerateStrategy<LC>>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    fn fit(
        &self,
        training_components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let resumed = self.1.lock().unwrap_or_else(PoisonError::into_inner).take();
        let (starting_epoch, state) = match resumed {
            Some((epoch, state)) => (epoch + 1, Some(state)),
            None => (starting_epoch, None),
        };
        on_step_thread(|| {
            self.0.fit_here(
                training_components,
                learner,
                dataloader_train,
                dataloader_valid,
                starting_epoch,
                state,
            )
        })
    }
}

// Waits until Burn's event processor has handed the fit's events to the event store, and the
// store has written them to the metric logs: Burn's `train` makes its summary from the log
// files as soon as `fit` returns (Burn's own strategies do not wait, and their summaries can
// miss the last validation epoch).
fn flush_events<LC: LearningComponentsTypes>(
    processor: &mut SupervisedTrainingEventProcessor<LC>,
    store: &EventStoreClient,
) {
    // The processor's worker takes one event at a time from a channel that holds one, and a
    // validation `Start` does nothing there (burn-train 0.21): once the second is in the
    // channel, the worker took the first, so it had processed every event before it.
    processor.process_valid(LearnerEvent::Start);
    processor.process_valid(LearnerEvent::Start);
    // The store handles its messages in order, and this query (of no metric: nothing read,
    // nothing cached) answers after the events sent before it, among them each epoch's end,
    // which closes its log files and joins their writers.
    let _ = store.find_metric("burn-accelerate flush", 1, Aggregate::Mean, &Split::Valid);
}

#[cfg(feature = "flex")]
fn on_step_thread<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    crate::threads::run_on_step_pool(work)
}

// Without Flex, no CPU kernel of ours or the backend's runs on rayon's pool.
#[cfg(not(feature = "flex"))]
fn on_step_thread<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    work()
}

impl<LC> AccelerateStrategy<LC>
where
    LC: LearningComponentsTypes,
    LearnerOptimizerRecord<LC>: ParamStateRecord<TrainingBackend<LC>>,
{
    // The fit, on the thread that runs the steps.
    fn fit_here(
        &self,
        training_components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
        resumed_state: Option<AccelerateCheckpoint>,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        use burn::tensor::backend::DeviceOps;

        let tally_start = autocast::thread_tally();

        // Before anything process-wide is set.
        let accumulation = self.fit_window(training_components.grad_accumulation);
        let devices = self.devices();
        // Before the fork below would gather a spread model onto the main device.
        // `data_parallel` checked the model it was given; this catches a learner built around
        // another one.
        if let Err(err) = check_data_parallel(&learner.model(), &devices) {
            fail("cannot train data-parallel", err);
        }
        let loaders = self.fit_loaders(&dataloader_train, &devices);
        // This process's part of it, on several processes, when the metrics are combined.
        let dataloader_valid = if self.process.is_distributed() && self.valid_metrics.is_none() {
            // Installed without `with_accelerate` (`with_training_strategy`), so without the
            // logger that combines the processes' metrics: each validates everything rather
            // than report its own part's metrics as the run's.
            log::warn!(
                "burn-accelerate: the strategy was not installed with `with_accelerate`, so the \
                 validation metrics of the processes cannot be combined: every process \
                 validates the whole validation set"
            );
            dataloader_valid.to_device(self.device.inner())
        } else {
            self.valid_part(&dataloader_valid, self.device.inner())
        };
        // A model resumed from a sharded checkpoint at ZeRO stage 3 holds its slices alone
        // (every parameter a placeholder), read onto the main device as new leaves already:
        // Burn's fork would move and detach each placeholder, an op that gathers it whole.
        // So does a model released before Burn's `launch` (`AccelerateStrategy::prepare_model`).
        let released = crate::zero::holds_released::<TrainingBackend<LC>, _>(&learner.model());
        if !released {
            learner.fork(&self.device);
        }
        let mut event_processor = training_components.event_processor;
        let mut checkpointer = training_components.checkpointer;
        let mut early_stopping = training_components.early_stopping;
        let interrupter = &training_components.interrupter;

        // The fit's precision and small-op rule are this thread's (the steps and the
        // validation run here; device workers enter them on theirs), not the process's: a
        // training on another thread, or Burn's metric threads, keep their own.
        // The fit's own context: a training on another thread keeps its settings and fp8 state.
        let context = self.autocast.context();
        let _autocast = context.enter();
        let loss_scale = if starting_epoch > 1 {
            // Burn's `fit` has no error channel, and it panics itself on a checkpoint it
            // cannot load: a resumed run must not silently go on from the wrong state.
            match self.restore(starting_epoch - 1, resumed_state) {
                Ok(saved) => saved.unwrap_or(self.initial_scale),
                Err(err) => fail("cannot resume", err),
            }
        } else {
            self.initial_scale
        };
        // Each enters the fit's autocast on its own thread.
        let workers = (devices.len() > 1).then(|| DeviceWorkers::<LC>::start(&devices, &context));
        let mut core = self
            .fit_core(accumulation, loss_scale, loaders.len())
            .with_context(context.clone());
        // At ZeRO stage 3 across processes, every parameter is released (this process keeping
        // its slice) before the first forward pass, as the `Accelerator`'s `prepare_model`
        // releases it: the first window gathers per layer and reduces in backward as every
        // later one does, and the learner's model is never whole again. Burn's reload holds
        // the placeholders, as after each step (nothing is gathered). A model released already
        // (the strategy's `prepare_model`, or a sharded resume) is kept as it is.
        if core
            .sharded()
            .is_some_and(|(_, stage)| stage.shards_parameters())
        {
            let model = core.prepare_model(learner.model());
            if !released {
                learner.load_model(model.into_record());
            }
        }
        // The user's `TrainStep` calls `loss.backward()` itself: the decorator's backward
        // divides and scales its loss as the `Accelerator`'s `backward` would, on this thread.
        let armed = ThreadArmed::arm(core.loss_transform());
        // The learner's optimizer and scheduler records are read through it: sharded, to keep
        // this process's part of the optimizer state and to gather the whole of it for a
        // checkpoint; on the main process, to write the strategy's own checkpoints.
        let mut tap = (core.sharded().is_some()
            || (self.checkpoint_dir.is_some() && self.process.is_main_process()))
        .then(RecordTap::<LC>::new);
        // Sharded, this process's optimizer keeps its own part of the state only (its
        // partition's, or at stage 3 its slices; a resumed run's learner was just given the
        // whole state).
        if let (Some(_), Some(tap)) = (core.sharded(), tap.as_mut()) {
            let whole = tap
                .optimizer(&learner, &training_components.event_store)
                .unwrap_or_else(|err| fail("cannot read the optimizer state", err));
            let own = core
                .own_optimizer_record(&learner.model(), whole, &self.device)
                .unwrap_or_else(|err| fail("cannot keep this process's optimizer state", err));
            learner.load_optim(own);
        }
        for epoch in starting_epoch..=training_components.num_epochs {
            let progress = Progress {
                items_processed: epoch,
                items_total: training_components.num_epochs,
            };
            let report = self.train_epoch(
                &mut learner,
                &loaders,
                workers.as_ref(),
                &progress,
                &mut event_processor,
                interrupter,
                &mut core,
                &armed,
            );
            {
                let mut stats = self.report.lock();
                stats.epochs.push(report);
                stats.loss_scale = *core.loss_scale();
            }
            if interrupter.should_stop() {
                let reason = interrupter
                    .get_message()
                    .unwrap_or_else(|| String::from("reason unknown"));
                log::info!("Training interrupted: {reason}");
                break;
            }
            // Every process validates its own batches, and the metrics of all are combined
            // before anything reads them: checkpoint choice, early stopping.
            let tally = autocast::thread_tally();
            let valid_start = std::time::Instant::now();
            let (valid_batches, valid_items) = self.valid_epoch(
                &learner,
                &dataloader_valid,
                &progress,
                &mut event_processor,
                interrupter,
            );
            let valid_ops = autocast::thread_tally().since(&tally);
            let (combined, per_process) = self.combine_valid_metrics(
                valid_batches,
                &mut event_processor,
                &training_components.event_store,
            );
            let valid_seconds = valid_start.elapsed().as_secs_f64();
            {
                let mut stats = self.report.lock();
                stats.valid_processes = self.process.num_processes();
                stats.valid_metrics_per_process = per_process;
                stats.valid_lower_ops = stats.valid_lower_ops.plus(&valid_ops);
                if let Some(report) = stats.epochs.last_mut() {
                    report.valid_batches = valid_batches;
                    report.valid_items = valid_items;
                    report.valid_batches_combined = combined;
                }
            }
            self.report
                .valid_seconds
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(valid_seconds);
            self.checkpoint_epoch(
                epoch,
                &mut learner,
                &core,
                tap.as_mut(),
                checkpointer.as_mut(),
                &training_components.event_store,
            );
            if self.stops_early(
                epoch,
                early_stopping.as_mut(),
                &training_components.event_store,
            ) {
                break;
            }
        }
        // Once, however the epochs ended (an interrupt, early stopping).
        self.report.lock().lower_ops = autocast::thread_tally().since(&tally_start);
        // Whole on every process (at ZeRO stage 3, gathered from the slices): Burn's `train`
        // and the caller use it on one process alone (its summary, saving it).
        let model = core.whole_model(learner.model());
        if self.process.is_main_process() {
            flush_events::<LC>(&mut event_processor, &training_components.event_store);
        }
        (model, event_processor)
    }

    // The fit's accumulation window, the gradient state configured for it (at every fit, so
    // that a strategy fitted again without Burn's setting goes back to its own).
    fn fit_window(&self, burn: Option<usize>) -> Accumulation {
        let accumulation = self
            .accumulation(burn)
            .unwrap_or_else(|err| fail("cannot accumulate as asked", err));
        if accumulation.sums {
            log::info!(
                "burn-accelerate: Burn's grads_accumulation({}): the gradients of {0} batches \
                 are summed before each optimizer step, as Burn's loop sums them \
                 (`AccelerateConfig::gradient_accumulation_steps` would average them)",
                accumulation.steps
            );
        }
        if let Err(err) = self
            .state
            .configure(accumulation.steps, self.config.sync_with_dataloader)
        {
            fail("cannot accumulate as asked", err);
        }
        accumulation
    }

    // The loaders the fit trains on, one per device: the strategy's shards, or this process's
    // part of the builder's loader.
    fn fit_loaders(
        &self,
        dataloader_train: &TrainLoader<LC>,
        devices: &[Device<TrainingBackend<LC>>],
    ) -> Vec<TrainLoader<LC>> {
        match &self.shards {
            Some(shards) => {
                log::info!(
                    "burn-accelerate: training data-parallel on {devices:?}, from the \
                     strategy's shards (the builder's training loader is not read)"
                );
                shards.iter().map(|s| s.loader.clone()).collect()
            }
            None => vec![
                self.prepare_loader(dataloader_train)
                    .unwrap_or_else(|err| fail("cannot shard the training loader", err)),
            ],
        }
    }

    // The fit's training step, over `replicas` devices.
    fn fit_core(
        &self,
        accumulation: Accumulation,
        loss_scale: LossScale,
        replicas: usize,
    ) -> Core<LC> {
        let mut core = Core::<LC>::new(
            self.config.step_settings(),
            loss_scale,
            self.state.clone(),
            self.group.clone(),
        )
        .with_replicas(replicas);
        if accumulation.sums {
            core = core.summing_the_window();
        }
        if !self.divides_loss {
            core = core.dividing_the_window();
        }
        core
    }

    // Whether Burn's early stopping ends the fit after `epoch`. Every process asks its
    // strategy (each reads the combined validation metrics, so each strategy's state follows
    // the same values), and the main process's answer is every process's: a process going on
    // alone would wait for the others forever, so a difference (which would take a metric
    // that does not combine) must not stop one process without the others.
    fn stops_early(
        &self,
        epoch: usize,
        early_stopping: Option<&mut Box<dyn CloneEarlyStoppingStrategy>>,
        event_store: &EventStoreClient,
    ) -> bool {
        let Some(early_stopping) = early_stopping else {
            return false;
        };
        let stop = early_stopping.should_stop(epoch, event_store);
        let Some(group) = &self.group else {
            return stop;
        };
        let agreed = group
            .broadcast_object(&stop, 0)
            .unwrap_or_else(|err| fail("cannot agree on early stopping", err));
        if agreed != stop {
            log::warn!(
                "burn-accelerate: process {} of {}: its early stopping said {stop} after epoch \
                 {epoch}, the main process's {agreed}: every process follows the main one",
                self.process.process_index(),
                self.process.num_processes()
            );
        }
        agreed
    }
}
