//! The context a training's ops and step read: one value that holds every setting the
//! zero-sized decorator cannot be handed, entered per thread by a guard.
//!
//! Burn's backend ops are free functions with no argument to carry a setting in, so
//! `Accelerated<B>` reads ambient state. That state is one [`Context`]: the autocast precision
//! and op classes, the small-op rule, the half path (which kernels run half-precision ops),
//! the placement switches, the fp8 recipe and the fp8 scaling state, the armed loss transform,
//! the gradient sync's layout. A thread reads the context it entered ([`Context::enter`], or
//! one of the `scope_*` functions, which enter the current context with one setting
//! changed); a thread that entered none reads the process's ([`Context::set_as_default`]),
//! which is how threads the crate does not start (a user's own workers) see a training's
//! settings. A training builds its context once ([`Autocast::context`](crate::Autocast::context))
//! and enters it on each thread that runs its steps, so two trainings in one process, on two
//! threads, never read each other's settings or fp8 state.
//!
//! Each setting is a plain value whose module says what it means and how it is read; this
//! module only stores them, one slot per kind (`Slot`), so that its arrows point nowhere
//! but down: the modules that define settings use it, it uses none of them.
//!
//! ```
//! use burn_accelerate::autocast::{self, SmallOps};
//! use burn_accelerate::{Context, Precision};
//!
//! let training = Context::current()
//!     .with_precision(Some(Precision::Bf16))
//!     .with_small_ops(SmallOps::Cast)?;
//! {
//!     let _entered = training.enter();
//!     assert_eq!(autocast::current(), Some(Precision::Bf16));
//!     assert_eq!(autocast::small_ops(), SmallOps::Cast);
//!     // Another thread reads the process's context.
//!     assert_eq!(std::thread::spawn(autocast::current).join().unwrap(), None);
//! }
//! assert_eq!(autocast::current(), None);
//! # Ok::<(), burn_accelerate::AccelerateError>(())
//! ```
//!
//! # What the process holds
//!
//! Besides the process's context, the crate's statics are caches, registries, counters and
//! one-time warnings; none is a setting a training chooses. Each, with why it is process-wide
//! or per thread: 20 in `src/`, which `grep -rn "^\s*static [A-Z_0-9]*\s*:" src` counts, and
//! `scripts/statics.py` (run by CI) keeps at 20 or fewer. The CPU kernels' own caches are in
//! crates/kernels, listed in its crate docs.
//!
//! | static | where | kind | why |
//! |---|---|---|---|
//! | `PROCESS` | `context` | the context | the process's context (for threads that entered none), its version, and the values shared by every context that sets none of a kind of state (the fp8 state of threads outside any training's context) |
//! | `THREAD` | `context` | the context | this thread's entered context, and the process's as it last read it |
//! | `ARMED_SCALE` | `scaler` | a guard's value | [`ArmedLossScale`](crate::ArmedLossScale): a user's own loop arms a scale for threads the crate does not start; kept beside the contexts so that a context entered meanwhile does not keep it after the guard drops |
//! | `CALLS` | `fp8::state` | counters | each thread numbers its fp8 op calls per step (tensors are named by call order), per fp8 state |
//! | `REGISTRY` | `hooks` | registry | per-backend functions registered by type, which Burn's traits leave no place for: fp8's casts, the staged moves, the CPU kernels' table, one table per kind |
//! | `PROBES`, `ON_THREAD` | `capability` | caches | what a device runs is a fact of the device, probed once: its capabilities, device counts, the f32 fallbacks taken, the panic hook that keeps probes quiet; per thread, the last answer and whether a probe runs |
//! | `SAID` | `warnings` | one-time warnings | each warning said once per process (per device, for the capability probe's) |
//! | `HOST_READS`, `TALLY` | `grads`, `autocast::tally` | counters | per thread, for tests, reports and benchmarks |
//! | `GLOBAL` | `gradient_state` | registry | Accelerate's `GradientState` singleton |
//! | `PLACEHOLDERS` | `backend::placeholder` | registry, counters | ZeRO stage 3's parameters held as placeholders, by autodiff node id, which the decorator's ops (seeing only primitives) resolve; the gathered bytes alive (tests, reports) |
//! | `JOINED` | `distributed::group` | registry | the process group a process joined (one per process, as torch.distributed's) |
//! | `COPIED`, `BUCKET` | `distributed` | counter, cache | values copied by the sync (benchmarks); the flat bucket reused across steps |
//! | `MOVED` | `data::loader` | hand-off | which share a loader holds, from Burn's `to_device` (which returns nothing else) to its caller on the same thread |
//! | `SCRATCH`, `PACKED` (2) | `cpu::low_gemm`, `bench_support` | caches | the matmul adapter's buffers (operands widened to f32, the bf16 GEMM's packed panels) reused across calls; the kernels' own (the CPU's instructions found once, the convolution's scratch: 6, `OnceLock`s and `thread_local`s) are `burn_accelerate_kernels`' |
//! | `STREAMS` | `cpu::counter_rng` | the RNG | Burn's `Backend::seed` is process-wide: the decorator's generator follows it |

use core::any::Any;
use core::fmt;
use core::marker::PhantomData;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

/// The kinds of setting a context holds, one slot each. The settings themselves live in the
/// modules that give them meaning (named here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// `autocast`: the precision ops lower to.
    Precision,
    /// `autocast::policy`: the op classes overridden.
    OpClasses,
    /// `autocast::small_ops`: the small-op rule.
    SmallOps,
    /// `capability`: the half path.
    HalfPath,
    /// `device_moves`: how tensors cross devices.
    DeviceMoves,
    /// `device_moves`: the co-locate rule.
    ColocateInputs,
    /// `fp8::state`: the recipe the scales follow.
    Fp8Recipe,
    /// `fp8::state`: the amax histories and scales.
    Fp8State,
    /// `scaler`: the loss transform `backward` applies.
    LossTransform,
    /// `distributed::gradients`: the gradient sync's layout.
    SyncLayout,
}

const SLOTS: usize = Slot::SyncLayout as usize + 1;

/// A value a [`Context`] holds in its slot: each kind says which slot is its and what holds
/// where a context has none set.
pub(crate) trait Setting: Any + Clone + Send + Sync {
    /// The slot this kind of setting lives in.
    const SLOT: Slot;

    /// The value in force where no context set one.
    fn unset() -> Self;
}

/// Every setting the decorator's ops and the training step read, as one value.
///
/// Cheap to clone (each setting is shared); changing one (the `with_*` methods, defined beside
/// each setting) makes a new context and leaves the old one as it was. Enter it on a thread
/// with [`enter`](Self::enter), make it the process's with
/// [`set_as_default`](Self::set_as_default). See the [module docs](self).
#[derive(Clone, Default)]
pub struct Context {
    values: [Option<Arc<dyn Any + Send + Sync>>; SLOTS],
}

impl Context {
    /// A context with nothing set: autocast off, every setting at its default.
    pub fn new() -> Self {
        Self::default()
    }

    /// The context this thread reads now: the one it entered, else the process's.
    pub fn current() -> Context {
        with_current(Context::clone)
    }

    /// The process's context, which threads that entered none read.
    pub fn process() -> Context {
        process_context().as_ref().clone()
    }

    /// Makes this the context of this thread until the guard drops; the one before comes
    /// back then, also while a panic unwinds. Guards nest; they are tied to their thread.
    #[must_use = "the context is only this thread's while the guard lives"]
    pub fn enter(&self) -> ContextGuard {
        ContextGuard {
            previous: replace_entered(Some(Arc::new(self.clone()))),
            _not_send: PhantomData,
        }
    }

    /// Makes this the process's context, which every thread that entered none reads, and
    /// returns the one before. The one process-wide setting of the crate: prefer
    /// [`enter`](Self::enter) on the threads that run a training (a default outlives the
    /// training that set it); this remains for threads the crate does not start.
    ///
    /// ```
    /// use burn_accelerate::capability::{self, HalfPath};
    /// use burn_accelerate::Context;
    ///
    /// let before = Context::process().with_half_path(HalfPath::Widened).set_as_default();
    /// assert_eq!(std::thread::spawn(capability::half_path).join().unwrap(), HalfPath::Widened);
    /// before.set_as_default();
    /// ```
    pub fn set_as_default(self) -> Context {
        let mut process = PROCESS
            .context
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let previous = process.replace(Arc::new(self));
        PROCESS.generation.fetch_add(1, Ordering::Release);
        previous.map_or_else(Context::new, |p| p.as_ref().clone())
    }

    /// This context's value of setting `S`, or the value in force where none is set.
    pub(crate) fn get<S: Setting>(&self) -> S {
        self.values[S::SLOT as usize]
            .as_ref()
            .and_then(|value| value.downcast_ref::<S>())
            .cloned()
            .unwrap_or_else(S::unset)
    }

    /// This context with setting `S` set to `value`.
    pub(crate) fn with<S: Setting>(mut self, value: S) -> Context {
        self.values[S::SLOT as usize] = Some(Arc::new(value));
        self
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let set: Vec<&str> = self
            .values
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_some())
            .map(|(i, _)| SLOT_NAMES[i])
            .collect();
        f.debug_struct("Context").field("set", &set).finish()
    }
}

const SLOT_NAMES: [&str; SLOTS] = [
    "precision",
    "op_classes",
    "small_ops",
    "half_path",
    "device_moves",
    "colocate_inputs",
    "fp8_recipe",
    "fp8_state",
    "loss_transform",
    "sync_layout",
];

/// Restores this thread's previous context when dropped ([`Context::enter`] and the `scope_*`
/// functions); tied to its thread (not `Send`).
#[must_use = "the context is only this thread's while the guard lives"]
pub struct ContextGuard {
    previous: Option<Arc<Context>>,
    _not_send: PhantomData<*const ()>,
}

impl ContextGuard {
    /// Sets `S` to `value` in this thread's context while the guard lives (what it restores
    /// is unchanged). Meant for the innermost guard: a guard entered after this one restores
    /// the value from before the change when it drops.
    pub(crate) fn set<S: Setting>(&self, value: S) {
        let changed = Context::current().with(value);
        replace_entered(Some(Arc::new(changed)));
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        replace_entered(self.previous.take());
    }
}

impl fmt::Debug for ContextGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextGuard")
            .field("current", &Context::current())
            .finish()
    }
}

/// Enters the current context with `S` set to `value`, until the guard drops.
pub(crate) fn scope<S: Setting>(value: S) -> ContextGuard {
    Context::current().with(value).enter()
}

/// This thread's value of setting `S` (its entered context's, else the process's): one
/// thread-local read, and one atomic load where it entered none.
#[inline]
pub(crate) fn get<S: Setting>() -> S {
    with_current(Context::get::<S>)
}

/// Runs `read` on the context this thread reads now, without cloning it: the decorator's one
/// read per op.
#[inline]
pub(crate) fn with_current<R>(read: impl FnOnce(&Context) -> R) -> R {
    match entered() {
        Some(context) => read(&context),
        None => read(&process_context()),
    }
}

// The process's side: the context threads that entered none read, and the values shared by
// every context that sets none of a kind of state ([`shared_unset`]).
struct Process {
    context: RwLock<Option<Arc<Context>>>,
    // Bumped by every `set_as_default`, so that a thread re-reads `context` only after a change.
    generation: AtomicU64,
    shared: [OnceLock<Box<dyn Any + Send + Sync>>; SLOTS],
}

static PROCESS: Process = Process {
    context: RwLock::new(None),
    generation: AtomicU64::new(0),
    shared: [const { OnceLock::new() }; SLOTS],
};

// A thread's side: the context it entered, and the process's as it last read it, with its
// generation.
struct ThisThread {
    context: RefCell<Option<Arc<Context>>>,
    seen: RefCell<(u64, Option<Arc<Context>>)>,
}

thread_local! {
    static THREAD: ThisThread = const {
        ThisThread {
            context: RefCell::new(None),
            seen: RefCell::new((u64::MAX, None)),
        }
    };
}

fn entered() -> Option<Arc<Context>> {
    THREAD.with(|thread| thread.context.borrow().clone())
}

fn replace_entered(context: Option<Arc<Context>>) -> Option<Arc<Context>> {
    THREAD.with(|thread| thread.context.replace(context))
}

fn process_context() -> Arc<Context> {
    let generation = PROCESS.generation.load(Ordering::Acquire);
    THREAD.with(|thread| {
        let mut seen = thread.seen.borrow_mut();
        if seen.0 != generation || seen.1.is_none() {
            let process = PROCESS
                .context
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            *seen = (generation, Some(process.clone().unwrap_or_default()));
        }
        seen.1.clone().unwrap_or_default()
    })
}

/// The value of `S` shared by every context, on every thread, that sets none: made by `make`
/// on first use and kept for the process. For a setting that is state rather than a choice
/// (the fp8 scaling state of threads that entered no training's context), whose unset value
/// must be one and the same everywhere. Kept per slot, as a context's values are: each slot
/// holds one type of setting.
pub(crate) fn shared_unset<S: Setting>(make: fn() -> S) -> S {
    PROCESS.shared[S::SLOT as usize]
        .get_or_init(|| Box::new(make()))
        .downcast_ref::<S>()
        .cloned()
        .unwrap_or_else(make)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Layout(u32);

    impl Setting for Layout {
        const SLOT: Slot = Slot::SyncLayout;
        fn unset() -> Self {
            Layout(0)
        }
    }

    #[test]
    fn guards_nest_restore_and_stay_on_their_thread() {
        assert_eq!(get::<Layout>(), Layout(0));
        let outer = scope(Layout(1));
        {
            let _inner = scope(Layout(2));
            assert_eq!(get::<Layout>(), Layout(2));
            assert_eq!(std::thread::spawn(get::<Layout>).join().unwrap(), Layout(0));
        }
        assert_eq!(get::<Layout>(), Layout(1));
        drop(outer);
        assert_eq!(get::<Layout>(), Layout(0));
    }

    #[test]
    fn a_value_set_within_a_guard_still_restores_the_one_before() {
        let guard = scope(Layout(1));
        guard.set(Layout(3));
        assert_eq!(get::<Layout>(), Layout(3));
        drop(guard);
        assert_eq!(get::<Layout>(), Layout(0));
    }

    #[test]
    fn a_panic_restores_the_previous_context() {
        let caught = std::panic::catch_unwind(|| {
            let _guard = scope(Layout(7));
            panic!("unwinds through the guard");
        });
        assert!(caught.is_err());
        assert_eq!(get::<Layout>(), Layout(0));
    }

    // State rather than a choice: one value, wherever none is set.
    #[derive(Clone)]
    struct Shared(Arc<()>);

    // A slot whose setting in the crate has no shared value (the slot's one type owns it).
    impl Setting for Shared {
        const SLOT: Slot = Slot::SyncLayout;
        fn unset() -> Self {
            shared_unset(|| Shared(Arc::new(())))
        }
    }

    #[test]
    fn a_shared_unset_value_is_one_for_every_context_and_thread() {
        let here = get::<Shared>().0;
        let _entered = Context::new().enter();
        assert!(Arc::ptr_eq(&get::<Shared>().0, &here));
        assert!(Arc::ptr_eq(&Context::new().get::<Shared>().0, &here));
        let there = std::thread::spawn(|| get::<Shared>().0).join().unwrap();
        assert!(Arc::ptr_eq(&there, &here));
        let own = Shared(Arc::new(()));
        assert!(!Arc::ptr_eq(
            &Context::new().with(own).get::<Shared>().0,
            &here
        ));
    }

    #[test]
    fn changing_a_context_leaves_the_one_it_came_from() {
        let a = Context::new().with(Layout(1));
        let b = a.clone().with(Layout(2));
        assert_eq!(a.get::<Layout>(), Layout(1));
        assert_eq!(b.get::<Layout>(), Layout(2));
        assert_eq!(Context::new().get::<Layout>(), Layout(0));
    }
}
