//! Op classes and the run-time overrides of the op table's defaults.

use serde::{Deserialize, Serialize};

use crate::context::{self, Context, ContextGuard, Setting, Slot};
use crate::op_table::{Op, OpClass};

/// Overrides of the op table's classes, as a value: what an [`AutocastConfig`](crate::AutocastConfig)
/// or [`AccelerateConfig`](crate::AccelerateConfig) carries for the threads that run its
/// training, and what [`scope_op_classes`] gives one thread. Ops it does not name keep the
/// class in force.
///
/// ```
/// use burn_accelerate::autocast::{Op, OpClass, OpClasses};
///
/// // Keep softmax in whatever dtype its input has, as PyTorch's CPU autocast does.
/// let classes = OpClasses::new().with(Op::Softmax, OpClass::Passthrough);
/// assert_eq!(classes.get(Op::Softmax), Some(OpClass::Passthrough));
/// assert_eq!(classes.get(Op::Matmul), None);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "Vec<(Op, OpClass)>", into = "Vec<(Op, OpClass)>")]
pub struct OpClasses {
    // One slot per op, 0 meaning "not overridden here": a fixed array keeps the value `Copy`,
    // so a thread reads it without a lock or a reference count.
    codes: [u8; SLOTS],
}

const SLOTS: usize = 64;
const _: () = assert!(Op::ALL.len() <= SLOTS, "grow SLOTS");

impl OpClasses {
    /// No overrides.
    pub const fn new() -> Self {
        OpClasses { codes: [0; SLOTS] }
    }

    /// These overrides with `op` given `class`.
    #[must_use]
    pub const fn with(mut self, op: Op, class: OpClass) -> Self {
        self.codes[op as usize] = class.code();
        self
    }

    /// The class these overrides give `op`, `None` when they leave it alone.
    #[inline]
    pub fn get(&self, op: Op) -> Option<OpClass> {
        OpClass::from_code(self.codes[op as usize])
    }

    /// Whether these override nothing.
    pub fn is_empty(&self) -> bool {
        self.codes.iter().all(|&c| c == 0)
    }

    /// The overridden ops and their classes, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (Op, OpClass)> + '_ {
        Op::ALL
            .iter()
            .filter_map(|&op| self.get(op).map(|class| (op, class)))
    }

    // `self`'s overrides over `base`'s.
    fn over(mut self, base: OpClasses) -> OpClasses {
        for (mine, theirs) in self.codes.iter_mut().zip(base.codes) {
            if *mine == 0 {
                *mine = theirs;
            }
        }
        self
    }
}

impl Default for OpClasses {
    fn default() -> Self {
        OpClasses::new()
    }
}

impl core::fmt::Debug for OpClasses {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl From<Vec<(Op, OpClass)>> for OpClasses {
    fn from(pairs: Vec<(Op, OpClass)>) -> Self {
        pairs
            .into_iter()
            .fold(OpClasses::new(), |classes, (op, class)| {
                classes.with(op, class)
            })
    }
}

impl From<OpClasses> for Vec<(Op, OpClass)> {
    fn from(classes: OpClasses) -> Self {
        classes.iter().collect()
    }
}

impl Setting for OpClasses {
    const SLOT: Slot = Slot::OpClasses;
    fn unset() -> Self {
        OpClasses::new()
    }
}

impl Context {
    /// This context with `classes` over the overrides it already has.
    pub fn with_op_classes(self, classes: OpClasses) -> Context {
        let merged = classes.over(self.get::<OpClasses>());
        self.with(merged)
    }

    /// The class `op` has in this context: its override, else the table's default.
    #[inline]
    pub fn op_class(&self, op: Op) -> OpClass {
        self.get::<OpClasses>()
            .get(op)
            .unwrap_or(op.default_class())
    }

    /// This context with every op at its table's class (no override).
    pub fn without_op_classes(self) -> Context {
        self.with(OpClasses::new())
    }
}

/// The class `op` has now on this thread: its context's override ([`scope_op_classes`], an
/// entered autocast whose configuration set op classes, or [`Context::with_op_classes`]),
/// else the table's default.
#[inline]
pub fn op_class(op: Op) -> OpClass {
    context::with_current(|context| context.op_class(op))
}

/// Gives this thread `classes` over the overrides it already has, until the scope drops; other
/// threads keep theirs. An entered [`Autocast`](crate::Autocast) whose configuration set op
/// classes does the same.
///
/// ```
/// use burn_accelerate::autocast::{self, Op, OpClass, OpClasses};
///
/// {
///     let _scope = autocast::scope_op_classes(OpClasses::new().with(Op::Exp, OpClass::Lower));
///     assert_eq!(autocast::op_class(Op::Exp), OpClass::Lower);
///     let other = std::thread::spawn(|| autocast::op_class(Op::Exp)).join().unwrap();
///     assert_eq!(other, OpClass::Fp32);
/// }
/// assert_eq!(autocast::op_class(Op::Exp), OpClass::Fp32);
/// ```
pub fn scope_op_classes(classes: OpClasses) -> OpClassesGuard {
    Context::current().with_op_classes(classes).enter()
}

/// Restores this thread's previous op classes when dropped ([`scope_op_classes`]); tied to
/// its thread.
pub type OpClassesGuard = ContextGuard;
