//! Per-tensor scaling state: what each fp8 tensor's scale and amax history are, which tensor
//! an autocast call is, and the training they belong to.
//!
//! The recipe and the state are settings of the [`Context`]: a training's context
//! ([`Autocast::context`](crate::Autocast::context)) holds a state of its own, which every
//! thread that enters it shares (the worker threads of Burn's multi-device loop, whose amaxes
//! meet in one history as Transformer Engine's global fp8 state manager has them meet), and
//! [`step`] on such a thread follows the context's recipe. Two fp8 trainings on two threads,
//! each in its own context, never touch each other's histories. Threads that entered no
//! training's context share the process's state. Burn's autodiff runs the backward pass on the
//! thread that calls `backward`, so the gradients' amaxes land in the same context.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::{Deserialize, Serialize};

use super::format::Fp8Format;
use super::recipe::{DelayedScaling, ScalingState};
use crate::AccelerateError;
use crate::context::{self, Context, ContextGuard, Setting, Slot};
use crate::op_table::Op;

/// The pass a scaled tensor belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Pass {
    /// An input of a lower-class op, rounded to E4M3.
    #[serde(rename = "forward")]
    Forward,
    /// The gradient of such an input under [`Fp8Mode::Hybrid`](super::Fp8Mode::Hybrid),
    /// rounded to E5M2.
    #[serde(rename = "backward")]
    Backward,
}

impl Pass {
    /// The format tensors of this pass are rounded to.
    pub const fn format(self) -> Fp8Format {
        match self {
            Pass::Forward => Fp8Format::E4M3,
            Pass::Backward => Fp8Format::E5M2,
        }
    }
}

/// Which "tensor" a scale belongs to.
///
/// Burn's tensor primitives have no stable identity, so a tensor is named by where it is used:
/// the `call`-th call of `op` on its thread since the last [`step`](super::step), its `input`-th
/// required float input (0 for `x`, 1 for `weight` in `linear`), and the pass. A model that
/// runs the same ops in the same order every step (any model without data-dependent control
/// flow) gives every layer input the same key every step, which is what Transformer Engine's
/// per-module scaling state amounts to. Worker threads running the same model share keys, so
/// their amaxes meet in one history, as Transformer Engine's amax reduction across
/// data-parallel ranks does.
///
/// ```
/// use burn_accelerate::autocast::Op;
/// use burn_accelerate::fp8::{Pass, TensorKey};
///
/// // The weight of the second linear layer a forward pass runs.
/// let key = TensorKey { op: Op::Linear, call: 1, input: 1, pass: Pass::Forward };
/// assert_eq!(key.to_string(), "linear#1.1/forward");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorKey {
    /// The op the tensor is an input of.
    pub op: Op,
    /// Which call of `op` since the step began (0-based, per thread).
    pub call: u32,
    /// Which of the op's required float inputs (0-based).
    pub input: u32,
    /// Forward input, or its gradient.
    pub pass: Pass,
}

impl core::fmt::Display for TensorKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let pass = match self.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        };
        write!(
            f,
            "{}#{}.{}/{pass}",
            self.op.method(),
            self.call,
            self.input
        )
    }
}

/// The delayed-scaling state of every fp8 tensor: the recipe, and a [`ScalingState`] per
/// [`TensorKey`]. Checkpoint it with serde (see [`state`](super::state) and
/// [`load_state`](super::load_state)).
///
/// ```
/// use burn_accelerate::autocast::Op;
/// use burn_accelerate::fp8::{DelayedScaling, Fp8State, Pass, TensorKey};
///
/// let mut state = Fp8State::new(DelayedScaling::default())?;
/// let key = TensorKey { op: Op::Matmul, call: 0, input: 0, pass: Pass::Forward };
/// assert_eq!(state.scale(&key), 1.0);
/// state.observe(key, 3.5);
/// state.step();
/// assert_eq!(state.scale(&key), 128.0); // 448 / 3.5
/// # Ok::<(), burn_accelerate::AccelerateError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Fp8State {
    recipe: DelayedScaling,
    steps: u64,
    #[serde(with = "entries")]
    tensors: BTreeMap<TensorKey, ScalingState>,
}

impl Fp8State {
    /// An empty state under `recipe`.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidFp8Recipe`] when the recipe does not validate.
    pub fn new(recipe: DelayedScaling) -> Result<Self, AccelerateError> {
        recipe.validate()?;
        Ok(Fp8State {
            recipe,
            ..Fp8State::default()
        })
    }

    /// The recipe the scales follow.
    pub fn recipe(&self) -> DelayedScaling {
        self.recipe
    }

    /// Changes the recipe for the steps to come; the histories are kept (a shorter window
    /// drops their oldest amaxes at the next step).
    ///
    /// # Errors
    /// [`AccelerateError::InvalidFp8Recipe`] when the recipe does not validate.
    pub fn set_recipe(&mut self, recipe: DelayedScaling) -> Result<(), AccelerateError> {
        recipe.validate()?;
        self.recipe = recipe;
        Ok(())
    }

    /// Steps ended with [`step`](Self::step).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The scale `key` is quantized with in the current step (1 for a tensor not seen yet).
    pub fn scale(&self, key: &TensorKey) -> f32 {
        self.tensors.get(key).map_or(1.0, ScalingState::scale)
    }

    /// The state of one tensor, if it has been seen.
    pub fn tensor(&self, key: &TensorKey) -> Option<&ScalingState> {
        self.tensors.get(key)
    }

    /// Every tensor seen, in key order.
    pub fn tensors(&self) -> impl Iterator<Item = (&TensorKey, &ScalingState)> {
        self.tensors.iter()
    }

    /// Records an amax of `key` in the current step.
    pub fn observe(&mut self, key: TensorKey, amax: f32) {
        self.tensors.entry(key).or_default().observe(amax);
    }

    /// Ends the step for every tensor: new scales, rolled histories.
    pub fn step(&mut self) {
        let recipe = self.recipe;
        for (key, tensor) in &mut self.tensors {
            tensor.update(&recipe, key.pass.format());
        }
        self.steps += 1;
    }
}

// JSON maps want string keys; the state is saved as a list of (key, state) pairs instead.
mod entries {
    use super::{BTreeMap, ScalingState, TensorKey};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        map: &BTreeMap<TensorKey, ScalingState>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(map.iter())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<TensorKey, ScalingState>, D::Error> {
        Ok(Vec::<(TensorKey, ScalingState)>::deserialize(deserializer)?
            .into_iter()
            .collect())
    }
}

// An amax still on the device: reading it waits for the device, so it is read when the step
// ends (or when too many wait), not in the op that produced it.
pub(crate) type PendingAmax = Box<dyn FnOnce() -> f32 + Send>;

// Reading them early costs a device sync; letting them pile up forever costs memory when
// nobody calls `step`.
const MAX_PENDING: usize = 4096;

#[derive(Default)]
struct Registry {
    state: Fp8State,
    pending: Vec<(TensorKey, PendingAmax)>,
}

// One training's fp8 state: shared by the threads that enter its context.
struct Session {
    registry: Mutex<Registry>,
    // Bumped by every `step`: a thread whose call counters belong to an older epoch restarts
    // them.
    epoch: AtomicU64,
}

impl Session {
    fn new() -> Arc<Session> {
        Arc::new(Session {
            registry: Mutex::default(),
            epoch: AtomicU64::new(0),
        })
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// The fp8 state setting: the session the thread's context holds.
#[derive(Clone)]
struct State(Arc<Session>);

impl Setting for State {
    const SLOT: Slot = Slot::Fp8State;
    fn unset() -> Self {
        // The process's, for threads that entered no training's context.
        context::shared_unset(|| State(Session::new()))
    }
}

// The recipe setting: `None` follows the state's own.
#[derive(Debug, Clone, Copy)]
struct Recipe(Option<DelayedScaling>);

impl Setting for Recipe {
    const SLOT: Slot = Slot::Fp8Recipe;
    fn unset() -> Self {
        Recipe(None)
    }
}

impl Context {
    /// This context with `recipe` for the fp8 scales [`step`] sets.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidFp8Recipe`] when the recipe does not validate.
    pub fn with_fp8_recipe(self, recipe: DelayedScaling) -> Result<Context, AccelerateError> {
        recipe.validate()?;
        Ok(self.with_checked_fp8_recipe(recipe))
    }

    // For a recipe validated already (an `Autocast`'s, by `AutocastConfig::init`).
    pub(crate) fn with_checked_fp8_recipe(self, recipe: DelayedScaling) -> Context {
        self.with(Recipe(Some(recipe)))
    }

    /// This context with an fp8 state of its own, empty: a new training's, which no other
    /// context shares (contexts made from this one share it).
    pub fn with_new_fp8_state(self) -> Context {
        self.with(State(Session::new()))
    }
}

fn session() -> Arc<Session> {
    context::get::<State>().0
}

// This thread's call count of each op in one session's epoch.
struct Calls {
    // The session counted. Held weakly, which keeps its allocation (not the session) alive,
    // so that a later session is never taken for it at the same address.
    session: Weak<Session>,
    epoch: u64,
    counts: [u32; 64],
}

thread_local! {
    static CALLS: RefCell<Calls> = const {
        RefCell::new(Calls {
            session: Weak::new(),
            epoch: 0,
            counts: [0; 64],
        })
    };
}

/// The next call number of `op` on this thread in the current step.
pub(crate) fn next_call(op: Op) -> u32 {
    let session = session();
    let epoch = session.epoch.load(Ordering::Acquire);
    CALLS.with(|calls| {
        let mut calls = calls.borrow_mut();
        if !(Weak::as_ptr(&calls.session) == Arc::as_ptr(&session) && calls.epoch == epoch) {
            *calls = Calls {
                session: Arc::downgrade(&session),
                epoch,
                counts: [0; 64],
            };
        }
        let slot = &mut calls.counts[op as usize];
        let call = *slot;
        *slot = slot.saturating_add(1);
        call
    })
}

/// The scale `key` has in the current step.
pub(crate) fn scale_of(key: &TensorKey) -> f32 {
    session().registry().state.scale(key)
}

/// Queues an amax of `key`, read when the step ends.
pub(crate) fn record(key: TensorKey, amax: PendingAmax) {
    let session = session();
    let overflow = {
        let mut registry = session.registry();
        registry.pending.push((key, amax));
        (registry.pending.len() >= MAX_PENDING).then(|| std::mem::take(&mut registry.pending))
    };
    if let Some(pending) = overflow {
        resolve(&session, pending);
    }
}

// Reads queued amaxes (outside the lock: reading waits for the device) into the state.
fn resolve(session: &Session, pending: Vec<(TensorKey, PendingAmax)>) {
    let amaxes: Vec<(TensorKey, f32)> = pending.into_iter().map(|(k, read)| (k, read())).collect();
    let mut registry = session.registry();
    for (key, amax) in amaxes {
        registry.state.observe(key, amax);
    }
}

fn take_pending(session: &Session) -> Vec<(TensorKey, PendingAmax)> {
    std::mem::take(&mut session.registry().pending)
}

/// Ends an fp8 training step: reads the amaxes the step recorded, sets every tensor's scale
/// for the next step from its history, and restarts the call numbering that names tensors.
///
/// Call it once per training step, after the backward pass (next to the optimizer step), on
/// any thread. Without it no scale ever changes from 1. Evaluation passes in between also
/// record amaxes and number calls: run them after a `step` so their keys match the model's.
///
/// ```
/// use burn_accelerate::fp8;
///
/// fp8::step();
/// assert!(fp8::state().steps() >= 1);
/// ```
pub fn step() {
    let session = session();
    resolve(&session, take_pending(&session));
    let mut registry = session.registry();
    if let Recipe(Some(recipe)) = context::get::<Recipe>() {
        // Validated when set.
        let _ = registry.state.set_recipe(recipe);
    }
    registry.state.step();
    drop(registry);
    session.epoch.fetch_add(1, Ordering::AcqRel);
}

/// A copy of this thread's fp8 state, its context's (amaxes still on the device are read
/// first), for inspection or a checkpoint.
///
/// ```
/// use burn_accelerate::fp8;
///
/// let json = serde_json::to_string(&fp8::state()).unwrap();
/// let restored: fp8::Fp8State = serde_json::from_str(&json).unwrap();
/// fp8::load_state(restored);
/// ```
pub fn state() -> Fp8State {
    let session = session();
    resolve(&session, take_pending(&session));
    session.registry().state.clone()
}

/// Replaces this thread's fp8 state, its context's (a checkpoint's), dropping amaxes not yet
/// read, and restarts call numbering.
pub fn load_state(state: Fp8State) {
    let session = session();
    let dropped = {
        let mut registry = session.registry();
        registry.state = state;
        std::mem::take(&mut registry.pending)
    };
    drop(dropped);
    session.epoch.fetch_add(1, Ordering::AcqRel);
}

/// Forgets every tensor's scale and history, keeping the recipe.
pub fn reset() {
    let recipe = recipe();
    load_state(Fp8State {
        recipe,
        ..Fp8State::default()
    });
}

/// The recipe [`step`] follows on this thread: its context's ([`scope_recipe`], an entered
/// fp8 autocast's, [`Context::with_fp8_recipe`]), else its fp8 state's.
pub fn recipe() -> DelayedScaling {
    context::get::<Recipe>()
        .0
        .unwrap_or_else(|| session().registry().state.recipe())
}

/// Gives this thread `recipe` until the scope drops: the scales [`step`] sets on this thread
/// follow it. An entered fp8 [`Autocast`](crate::Autocast) does this with its configuration's
/// `fp8_recipe`.
///
/// ```
/// use burn_accelerate::fp8::{self, DelayedScaling};
///
/// let short = DelayedScaling::default().with_amax_history_len(2);
/// {
///     let _recipe = fp8::scope_recipe(short).unwrap();
///     assert_eq!(fp8::recipe(), short);
///     assert_eq!(std::thread::spawn(fp8::recipe).join().unwrap(), DelayedScaling::default());
/// }
/// assert_eq!(fp8::recipe(), DelayedScaling::default());
/// ```
///
/// # Errors
/// [`AccelerateError::InvalidFp8Recipe`] when the recipe does not validate.
pub fn scope_recipe(recipe: DelayedScaling) -> Result<ContextGuard, AccelerateError> {
    Ok(Context::current().with_fp8_recipe(recipe)?.enter())
}
