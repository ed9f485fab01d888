//! Settings a thread holds for a while over the process's, the Rust form of
//! `with torch.autocast(...)`: one shape for every such setting (the small-op rule, the half
//! path, op classes, the placement switches, the fp8 recipe, the gradient sync's layout).
//!
//! Each setting is a thread-local slot, `None` meaning "the process's". Entering a
//! [`ThreadScope`] puts a value in the slot; dropping it puts back what was there, also while
//! a panic unwinds, so scopes nest. A scope is tied to its thread (not `Send`): a value given
//! to one thread never leaks into another.
//!
//! Why a process value stays beside the thread's: Burn's backend ops are free functions with
//! no context to carry a setting in, so the decorator can only read ambient state; threads
//! the crate does not start (a user's own workers) read the process's.

use core::cell::Cell;
use core::fmt;
use core::marker::PhantomData;
use std::thread::LocalKey;

/// A thread's slot for one setting: `None` follows the process's.
pub(crate) type Slot<T> = LocalKey<Cell<Option<T>>>;

/// This thread's value of the setting in `slot`, `None` when it has none of its own.
#[inline]
pub(crate) fn thread_value<T: Copy + 'static>(slot: &'static Slot<T>) -> Option<T> {
    slot.with(Cell::get)
}

/// Restores this thread's previous value of one setting when dropped; tied to its thread.
///
/// Returned by the `scope_*` functions ([`autocast::scope_small_ops`](crate::autocast::scope_small_ops),
/// [`capability::scope_half_path`](crate::capability::scope_half_path),
/// [`autocast::scope_op_classes`](crate::autocast::scope_op_classes),
/// [`placement::scope_device_moves`](crate::placement::scope_device_moves),
/// [`placement::scope_colocate_inputs`](crate::placement::scope_colocate_inputs),
/// [`fp8::scope_recipe`](crate::fp8::scope_recipe),
/// [`distributed::scope_sync_layout`](crate::distributed::scope_sync_layout)) and held by an
/// entered [`Autocast`](crate::Autocast).
#[must_use = "the setting is only this thread's while the scope lives"]
pub struct ThreadScope<T: Copy + 'static> {
    slot: &'static Slot<T>,
    previous: Option<T>,
    _not_send: PhantomData<*const ()>,
}

impl<T: Copy + 'static> ThreadScope<T> {
    /// Gives this thread `value` in `slot` until the scope drops.
    pub(crate) fn enter(slot: &'static Slot<T>, value: T) -> Self {
        ThreadScope {
            slot,
            previous: slot.with(|s| s.replace(Some(value))),
            _not_send: PhantomData,
        }
    }

    /// Replaces this thread's value while the scope lives (what it restores is unchanged).
    pub(crate) fn set(&self, value: T) {
        self.slot.with(|s| s.set(Some(value)));
    }
}

impl<T: Copy + 'static> Drop for ThreadScope<T> {
    fn drop(&mut self) {
        self.slot.with(|s| s.set(self.previous));
    }
}

impl<T: Copy + fmt::Debug + 'static> fmt::Debug for ThreadScope<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadScope")
            .field("value", &thread_value(self.slot))
            .field("previous", &self.previous)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static SLOT: Cell<Option<u32>> = const { Cell::new(None) };
    }

    #[test]
    fn scopes_nest_and_stay_on_their_thread() {
        assert_eq!(thread_value(&SLOT), None);
        let outer = ThreadScope::enter(&SLOT, 1);
        {
            let _inner = ThreadScope::enter(&SLOT, 2);
            assert_eq!(thread_value(&SLOT), Some(2));
            assert_eq!(
                std::thread::spawn(|| thread_value(&SLOT)).join().unwrap(),
                None
            );
        }
        assert_eq!(thread_value(&SLOT), Some(1));
        drop(outer);
        assert_eq!(thread_value(&SLOT), None);
    }

    #[test]
    fn a_value_set_within_a_scope_still_restores_the_one_before() {
        let scope = ThreadScope::enter(&SLOT, 1);
        scope.set(3);
        assert_eq!(thread_value(&SLOT), Some(3));
        drop(scope);
        assert_eq!(thread_value(&SLOT), None);
    }

    #[test]
    fn a_panic_restores_the_previous_value() {
        let caught = std::panic::catch_unwind(|| {
            let _scope = ThreadScope::enter(&SLOT, 7);
            panic!("unwinds through the scope");
        });
        assert!(caught.is_err());
        assert_eq!(thread_value(&SLOT), None);
    }
}
