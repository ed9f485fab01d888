//! Functions registered per backend type, for the ops that need the concrete
//! `Autodiff<B, C>` in hand to build a backward node (fp8's cast, the staged move), or that
//! run the crate's own kernels (the CPU kernels' table), while the decorator only sees a
//! generic `B: Backend`. Code that has the concrete type registers a function under its
//! `TypeId`; the decorator looks it up.
//!
//! One registry holds every kind of hook ([`HookKind`]), each kind a table keyed by backend
//! type, so that the process holds one registry rather than one per kind.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Once, PoisonError, RwLock};

/// One kind of hook (fp8's cast, the staged move, the CPU kernels), named by a marker type.
pub(crate) trait HookKind: 'static {
    /// Registers the hooks of the backends the crate knows (Burn's autodiff over each backend
    /// feature); run once, on the kind's first lookup.
    fn register_known();
}

// One kind's table, and whether the backends the crate knows have been registered in it.
struct Table {
    kind: TypeId,
    hooks: HashMap<TypeId, Box<dyn Any + Send + Sync>>,
    known: Arc<Once>,
}

// Every kind's table: a few kinds, each found by a scan.
static REGISTRY: RwLock<Vec<Table>> = RwLock::new(Vec::new());

// Runs `change` on kind `K`'s table, made empty if it has none yet.
fn change<K: HookKind, R>(change: impl FnOnce(&mut Table) -> R) -> R {
    let mut registry = REGISTRY.write().unwrap_or_else(PoisonError::into_inner);
    let kind = TypeId::of::<K>();
    let index = match registry.iter().position(|table| table.kind == kind) {
        Some(index) => index,
        None => {
            registry.push(Table {
                kind,
                hooks: HashMap::new(),
                known: Arc::new(Once::new()),
            });
            registry.len() - 1
        }
    };
    change(&mut registry[index])
}

/// What runs for each backend this crate has a feature for ([`each_backend`]): a kind's
/// registration of its hooks for Burn's autodiff (or the decorator) over it.
pub(crate) trait ForEachBackend {
    /// Runs for backend `B` (Burn's own, without autodiff).
    fn call<B: burn_backend::Backend>(&mut self);
}

/// Runs `f` for each backend this crate has a feature for (Flex, NdArray, wgpu, CUDA,
/// LibTorch): the one list the kinds that register for every backend read, so that a
/// backend feature added here reaches all of them.
pub(crate) fn each_backend(f: &mut impl ForEachBackend) {
    #[cfg(feature = "flex")]
    f.call::<burn::backend::Flex>();
    #[cfg(feature = "ndarray")]
    f.call::<burn::backend::NdArray>();
    #[cfg(feature = "wgpu")]
    f.call::<burn::backend::Wgpu>();
    #[cfg(feature = "cuda")]
    f.call::<burn::backend::Cuda>();
    #[cfg(feature = "tch")]
    f.call::<burn::backend::LibTorch>();
    let _ = f;
}

/// Registers `hook` of kind `K` for backend `B`, replacing any earlier one.
pub(crate) fn insert<K: HookKind, B: 'static, H: Any + Send + Sync>(hook: H) {
    change::<K, _>(|table| table.hooks.insert(TypeId::of::<B>(), Box::new(hook)));
}

/// The hook of kind `K` registered for backend `B`, if it has the type `H`. The kind's first
/// lookup registers the backends the crate knows ([`HookKind::register_known`]); lookups of
/// the kind on other threads wait for it.
pub(crate) fn get<K: HookKind, B: 'static, H: Any + Copy>() -> Option<H> {
    let kind = TypeId::of::<K>();
    let pending = {
        let registry = REGISTRY.read().unwrap_or_else(PoisonError::into_inner);
        match registry.iter().find(|table| table.kind == kind) {
            Some(table) if table.known.is_completed() => {
                return table
                    .hooks
                    .get(&TypeId::of::<B>())
                    .and_then(|hook| hook.downcast_ref::<H>().copied());
            }
            Some(table) => Some(table.known.clone()),
            None => None,
        }
    };
    // Registering inserts into the registry: the lock is not held meanwhile.
    let known = pending.unwrap_or_else(|| change::<K, _>(|table| table.known.clone()));
    known.call_once(K::register_known);
    get::<K, B, H>()
}

#[cfg(test)]
mod tests {
    use super::{HookKind, get, insert};

    struct Numbers;

    impl HookKind for Numbers {
        fn register_known() {
            insert::<Numbers, i8, fn() -> u32>(|| 7);
        }
    }

    struct Others;

    impl HookKind for Others {
        fn register_known() {}
    }

    #[test]
    fn hooks_are_found_by_backend_type_and_hook_type() {
        insert::<Numbers, u8, fn() -> u32>(|| 1);
        assert_eq!(get::<Numbers, u8, fn() -> u32>().map(|f| f()), Some(1));
        assert!(get::<Numbers, u16, fn() -> u32>().is_none());
        assert!(get::<Numbers, u8, fn() -> u64>().is_none());
        assert!(get::<Others, u8, fn() -> u32>().is_none());
        insert::<Numbers, u8, fn() -> u32>(|| 2);
        assert_eq!(get::<Numbers, u8, fn() -> u32>().map(|f| f()), Some(2));
        // The known backends were registered by the first lookup.
        assert_eq!(get::<Numbers, i8, fn() -> u32>().map(|f| f()), Some(7));
    }
}
