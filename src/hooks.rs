//! Functions registered per backend type, for the ops that need the concrete
//! `Autodiff<B, C>` in hand to build a backward node (fp8's cast, the staged move), while the
//! decorator only sees a generic `B: Backend`. Code that has the concrete type registers a
//! function under its `TypeId`; the decorator looks it up.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Once, OnceLock, PoisonError, RwLock};

/// A table of hooks of one kind, keyed by backend type, with the hooks of the backends the
/// crate knows (Burn's autodiff over each backend feature) registered on the first lookup.
pub(crate) struct Hooks {
    table: OnceLock<RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>>>,
    known: Once,
    register_known: fn(),
}

impl Hooks {
    /// A table whose first lookup runs `register_known` once.
    pub(crate) const fn new(register_known: fn()) -> Self {
        Self {
            table: OnceLock::new(),
            known: Once::new(),
            register_known,
        }
    }

    fn table(&self) -> &RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>> {
        self.table.get_or_init(Default::default)
    }

    /// Registers `hook` for backend `B`, replacing any earlier one.
    pub(crate) fn insert<B: 'static, H: Any + Send + Sync>(&self, hook: H) {
        self.table()
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(TypeId::of::<B>(), Box::new(hook));
    }

    /// The hook registered for backend `B`, if it has the type `H`.
    pub(crate) fn get<B: 'static, H: Any + Copy>(&self) -> Option<H> {
        self.known.call_once(self.register_known);
        self.table()
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&TypeId::of::<B>())
            .and_then(|hook| hook.downcast_ref::<H>().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::Hooks;

    #[test]
    fn hooks_are_found_by_backend_type_and_hook_type() {
        static HOOKS: Hooks = Hooks::new(|| HOOKS.insert::<i8, fn() -> u32>(|| 7));
        HOOKS.insert::<u8, fn() -> u32>(|| 1);
        assert_eq!(HOOKS.get::<u8, fn() -> u32>().map(|f| f()), Some(1));
        assert!(HOOKS.get::<u16, fn() -> u32>().is_none());
        assert!(HOOKS.get::<u8, fn() -> u64>().is_none());
        HOOKS.insert::<u8, fn() -> u32>(|| 2);
        assert_eq!(HOOKS.get::<u8, fn() -> u32>().map(|f| f()), Some(2));
        // The known backends were registered by the first lookup.
        assert_eq!(HOOKS.get::<i8, fn() -> u32>().map(|f| f()), Some(7));
    }
}
