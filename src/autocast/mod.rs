//! Autocast: which precision ops run in, decided per op class and per thread.
//!
//! The state is two-level, like PyTorch's: a process-wide default (read by every thread,
//! including the worker threads of Burn's multi-device training loop) and thread-local
//! overrides set by RAII guards, the Rust form of `with torch.autocast(...)`. A guard restores
//! what was there before when it drops, also while a panic unwinds.
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
mod ops;
mod plan;
mod policy;
mod small_ops;
mod tally;

pub use crate::Precision;
pub use config::{Autocast, AutocastConfig, AutocastScope};
pub use ops::Op;
pub use plan::{CastInput, CastPlan};
pub use policy::{
    OpClass, OpClasses, OpClassesGuard, op_class, reset_op_classes, scope_op_classes, set_op_class,
};
pub use small_ops::{
    HOST_CPU_MIN_HALF_FLOPS, SmallOps, SmallOpsGuard, applies_to, estimated_flops, scope_small_ops,
    set_small_ops, small_ops,
};
pub use tally::{LowerOpTally, thread_tally};

use core::cell::Cell;
use core::marker::PhantomData;
use std::sync::atomic::{AtomicU8, Ordering};

// 0: autocast off; otherwise `Precision::code`.
static DEFAULT: AtomicU8 = AtomicU8::new(0);

// The thread's override: INHERIT follows DEFAULT, 0 is "off here", else a precision code.
const INHERIT: u8 = u8::MAX;

thread_local! {
    static SCOPE: Cell<u8> = const { Cell::new(INHERIT) };
}

/// The precision autocast lowers to on this thread right now, `None` when it is off.
///
/// `Some(Precision::F32)` is reported as `None`: full precision lowers nothing.
#[inline]
pub fn current() -> Option<Precision> {
    let scoped = SCOPE.with(Cell::get);
    let code = if scoped == INHERIT {
        DEFAULT.load(Ordering::Relaxed)
    } else {
        scoped
    };
    Precision::from_code(code).filter(|p| p.is_mixed())
}

/// Sets the process-wide precision every thread without a guard uses (`None` turns it off).
///
/// This is what the `Accelerator` and the training hook set, so that the worker threads of
/// Burn's multi-device loop autocast too. It does not check the device: use
/// [`AutocastConfig::init`](crate::AutocastConfig::init) for that.
pub fn set_default(precision: Option<Precision>) {
    DEFAULT.store(precision.map_or(0, Precision::code), Ordering::Relaxed);
}

/// The process-wide precision set by [`set_default`].
pub fn default_precision() -> Option<Precision> {
    Precision::from_code(DEFAULT.load(Ordering::Relaxed)).filter(|p| p.is_mixed())
}

/// Turns autocast on for this thread until the guard drops.
#[must_use = "autocast is only on while the guard lives"]
pub fn enable(precision: Precision) -> AutocastGuard {
    AutocastGuard::set(precision.code())
}

/// Turns autocast off for this thread until the guard drops (`torch.autocast(enabled=False)`).
#[must_use = "autocast is only off while the guard lives"]
pub fn disable() -> AutocastGuard {
    AutocastGuard::set(0)
}

/// Restores this thread's previous autocast state when dropped.
///
/// Guards are tied to the thread that made them (not `Send`): a precision set on one thread
/// never leaks into another.
#[derive(Debug)]
pub struct AutocastGuard {
    previous: u8,
    _not_send: PhantomData<*const ()>,
}

impl AutocastGuard {
    fn set(code: u8) -> Self {
        let previous = SCOPE.with(|s| s.replace(code));
        AutocastGuard {
            previous,
            _not_send: PhantomData,
        }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        SCOPE.with(|s| s.set(self.previous));
    }
}

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
