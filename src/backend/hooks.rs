//! Functions registered per backend type, for the ops that need the concrete
//! `Autodiff<B, C>` in hand to build a backward node (fp8's cast, the staged move), while the
//! decorator only sees a generic `B: Backend`. Code that has the concrete type registers a
//! function under its `TypeId`; the decorator looks it up.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{OnceLock, PoisonError, RwLock};

/// A table of hooks of one kind, keyed by backend type.
pub(crate) struct Hooks(OnceLock<RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>>>);

impl Hooks {
    pub(crate) const fn new() -> Self {
        Self(OnceLock::new())
    }

    fn table(&self) -> &RwLock<HashMap<TypeId, Box<dyn Any + Send + Sync>>> {
        self.0.get_or_init(Default::default)
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
        static HOOKS: Hooks = Hooks::new();
        HOOKS.insert::<u8, fn() -> u32>(|| 1);
        assert_eq!(HOOKS.get::<u8, fn() -> u32>().map(|f| f()), Some(1));
        assert!(HOOKS.get::<u16, fn() -> u32>().is_none());
        assert!(HOOKS.get::<u8, fn() -> u64>().is_none());
        HOOKS.insert::<u8, fn() -> u32>(|| 2);
        assert_eq!(HOOKS.get::<u8, fn() -> u32>().map(|f| f()), Some(2));
    }
}
