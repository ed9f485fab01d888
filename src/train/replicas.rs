//! Data-parallel training steps: one model replica per device, each stepping on a worker
//! thread of its own, as Burn 0.21's multi-device loop (`MultiDevicesTrainStep`) does.
//!
//! For each step, the calling thread hands every worker the current model (on the main
//! device) and that device's batch; the worker forks the model onto its device (the
//! "broadcast" of the updated parameters), runs the user's `TrainStep`, and brings the
//! gradients back to the main device before answering, so that the moves run in parallel.
//! The answers are returned in device order, so that summing them is deterministic.
//!
//! Each worker enters the fit's [`Context`] for its steps (its precision and small-op
//! rule are the training's, scoped to the threads that run it), and arms the step's loss
//! transform on its thread, so the user's `loss.backward()` there is divided and scaled as
//! on the main thread.
//!
//! Moves between two wgpu devices have no direct path in Burn 0.21: the replicas are forked
//! with [`placement::fork`], which stages the parameters through the host, and the gradients
//! (inner-backend tensors) come back through the decorator's host-staged moves.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use burn::tensor::Device;
use burn::tensor::backend::Backend;
use burn::train::{
    LearningComponentsTypes, TrainOutput, TrainStep, TrainingBackend, TrainingModel,
};

use crate::context::Context;
use crate::placement;
use crate::scaler::ThreadArmed;
use crate::step::LossTransform;

/// The input of one training step.
pub(crate) type StepInput<LC> = <TrainingModel<LC> as TrainStep>::Input;
/// The output of one training step, gradients included.
pub(crate) type StepOutput<LC> = TrainOutput<<TrainingModel<LC> as TrainStep>::Output>;

type Job<LC> = (TrainingModel<LC>, StepInput<LC>, LossTransform);
type Answer<LC> = (usize, Result<StepOutput<LC>, Box<dyn Any + Send>>);

/// The worker threads of a data-parallel training, one per device; the first device is the
/// main one, where gradients are combined and the optimizer steps.
pub(crate) struct DeviceWorkers<LC: LearningComponentsTypes> {
    main: Device<TrainingBackend<LC>>,
    inboxes: Vec<Sender<Job<LC>>>,
    answers: Receiver<Answer<LC>>,
    threads: Vec<JoinHandle<()>>,
}

impl<LC: LearningComponentsTypes> DeviceWorkers<LC> {
    /// Starts one worker per device of `devices` (the first is the main device).
    pub(crate) fn start(devices: &[Device<TrainingBackend<LC>>], context: &Context) -> Self {
        let main = devices[0].clone();
        let (reply, answers) = channel();
        let mut inboxes = Vec::with_capacity(devices.len());
        let mut threads = Vec::with_capacity(devices.len());
        for (index, device) in devices.iter().cloned().enumerate() {
            let (inbox, jobs) = channel::<Job<LC>>();
            let reply: Sender<Answer<LC>> = reply.clone();
            let main = main.clone();
            let context = context.clone();
            let thread = std::thread::Builder::new()
                .name(format!("burn-accelerate-device-{index}"))
                .spawn(move || {
                    let _autocast = context.enter();
                    for (model, input, transform) in jobs {
                        let output = catch_unwind(AssertUnwindSafe(|| {
                            // The user's `loss.backward()` runs here: arm this thread.
                            let _armed = ThreadArmed::arm(transform);
                            let replica = placement::fork(model, &device);
                            let mut output = replica.step(input);
                            if index != 0 {
                                output.grads = output.grads.to_device(&main, &replica);
                            }
                            // The step's work ran on this thread's stream, reading tensors the
                            // calling thread wrote and writing some it will read and free:
                            // finish it here, so nothing is still queued when they change hands
                            // (without this, runs on two wgpu devices differed now and then).
                            sync::<TrainingBackend<LC>>(&device);
                            if index != 0 {
                                sync::<TrainingBackend<LC>>(&main);
                            }
                            output
                        }));
                        if reply.send((index, output)).is_err() {
                            break;
                        }
                    }
                })
                .expect("burn-accelerate: cannot start a device worker thread");
            inboxes.push(inbox);
            threads.push(thread);
        }
        Self {
            main,
            inboxes,
            answers,
            threads,
        }
    }

    /// Runs one step: `inputs[i]` (if any) on device `i`, each on a replica of `model`.
    /// Returns the outputs in device order, their gradients on the main device.
    ///
    /// A panic in a step (the user's `TrainStep`, or the backend) is raised again here, on the
    /// calling thread, with its own message.
    pub(crate) fn step(
        &self,
        model: &TrainingModel<LC>,
        inputs: Vec<(usize, StepInput<LC>)>,
        transform: LossTransform,
    ) -> Vec<StepOutput<LC>> {
        // The optimizer's last writes to the model are queued on this thread's stream, and
        // may have gone in place into buffers that a worker's stream allocated: a worker
        // reading them would wait for that stream, not this one. Finish them first.
        sync::<TrainingBackend<LC>>(&self.main);
        let sent = inputs.len();
        for (index, input) in inputs {
            self.inboxes[index]
                .send((model.clone(), input, transform))
                .expect("burn-accelerate: a device worker stopped");
        }
        let mut outputs: Vec<(usize, StepOutput<LC>)> = Vec::with_capacity(sent);
        let mut panic = None;
        for _ in 0..sent {
            let (index, output) = self
                .answers
                .recv()
                .expect("burn-accelerate: a device worker stopped");
            match output {
                Ok(output) => outputs.push((index, output)),
                Err(payload) => panic = panic.or(Some(payload)),
            }
        }
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
        outputs.sort_by_key(|(index, _)| *index);
        outputs.into_iter().map(|(_, output)| output).collect()
    }
}

/// Waits for this thread's queued work on `device`; a backend error surfaces as a panic, as
/// the backend's own would at the next read.
fn sync<B: Backend>(device: &B::Device) {
    if let Err(err) = B::sync(device) {
        panic!("burn-accelerate: a device worker's step failed on {device:?}: {err:?}");
    }
}

impl<LC: LearningComponentsTypes> Drop for DeviceWorkers<LC> {
    fn drop(&mut self) {
        // Closing the inboxes ends the workers' loops.
        self.inboxes.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
