//! Autocast: which precision ops run in, decided per op class and per thread.
//!
//! The precision is a setting of the [`Context`] the thread reads: the one it
//! entered, else the process's (read by every thread, including the worker threads of Burn's
//! multi-device training loop). RAII guards, the Rust form of `with torch.autocast(...)`,
//! enter the current context with the precision changed and restore what was there before
//! when they drop, also while a panic unwinds.
//!
//! ```
//! use burn_accelerate::autocast::{self, Precision};
//!
//! assert_eq!(autocast::current(), None);
//! {
//!     let _bf16 = autocast::enable(Precision::Bf16);
//!     assert_eq!(autocast::current(), Some(Precision::Bf16));
//!     {
//!         let _off = autocast::disable(); // like torch.autocast(enabled=False)
//!         assert_eq!(autocast::current(), None);
//!     }
//!     assert_eq!(autocast::current(), Some(Precision::Bf16));
//! }
//! assert_eq!(autocast::current(), None);
//! ```

mod config;
mod plan;
mod policy;
mod rounding;
mod small_ops;
mod tally;

pub use crate::Precision;
pub use crate::op_table::{Op, OpClass};
pub use config::{Autocast, AutocastConfig, AutocastScope};
pub use plan::{CastInput, CastPlan};
pub use policy::{OpClasses, OpClassesGuard, op_class, scope_op_classes};
pub(crate) use rounding::{InputRounding, rounds_through_node};
pub use small_ops::{
    HOST_CPU_MIN_HALF_FLOPS, SmallOps, SmallOpsGuard, applies_to, estimated_flops, scope_small_ops,
    small_ops,
};
pub(crate) use tally::record_crate_kernel;
pub use tally::{LowerOpTally, thread_tally};

use crate::context::{self, Context, ContextGuard, Setting, Slot};

// The precision autocast lowers to (`None`: off), as a context setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Lowering(Option<Precision>);

impl Setting for Lowering {
    const SLOT: Slot = Slot::Precision;
    fn unset() -> Self {
        Lowering(None)
    }
}

/// The precision autocast lowers to on this thread right now, `None` when it is off.
///
/// `Some(Precision::F32)` is reported as `None`: full precision lowers nothing.
#[inline]
pub fn current() -> Option<Precision> {
    context::get::<Lowering>().0.filter(|p| p.is_mixed())
}

/// The precision of the process's context ([`Context::set_as_default`]), which threads that
/// entered no context of their own run in.
pub fn default_precision() -> Option<Precision> {
    Context::process().precision()
}

impl Context {
    /// This context with autocast lowering to `precision` (`None`: off). It does not check the
    /// device: [`AutocastConfig::init`](crate::AutocastConfig::init) does.
    pub fn with_precision(self, precision: Option<Precision>) -> Context {
        self.with(Lowering(precision))
    }

    /// The precision this context lowers to, `None` when autocast is off in it.
    pub fn precision(&self) -> Option<Precision> {
        self.get::<Lowering>().0.filter(|p| p.is_mixed())
    }
}

/// Turns autocast on for this thread until the guard drops.
#[must_use = "autocast is only on while the guard lives"]
pub fn enable(precision: Precision) -> AutocastGuard {
    context::scope(Lowering(Some(precision)))
}

/// Turns autocast off for this thread until the guard drops (`torch.autocast(enabled=False)`).
#[must_use = "autocast is only off while the guard lives"]
pub fn disable() -> AutocastGuard {
    context::scope(Lowering(None))
}

/// Restores this thread's previous autocast state when dropped; tied to the thread that made
/// it (not `Send`): a precision set on one thread never leaks into another.
pub type AutocastGuard = ContextGuard;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_nest_and_restore() {
        assert_eq!(current(), None);
        let outer = enable(Precision::F16);
        let inner = enable(Precision::Bf16);
        assert_eq!(current(), Some(Precision::Bf16));
        drop(inner);
        assert_eq!(current(), Some(Precision::F16));
        drop(outer);
        assert_eq!(current(), None);
    }

    #[test]
    fn full_precision_guard_reads_as_off() {
        let _g = enable(Precision::F32);
        assert_eq!(current(), None);
    }
}
