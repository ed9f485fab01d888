//! Warnings said once per process: each is named, and said once for each detail it is given
//! (a warning about one device is said again for another).
//!
//! ```ignore
//! warnings::once("no staged move", (), || log::error!("..."));
//! warnings::once("slow precision", (device_key, precision), || log::warn!("..."));
//! ```

use std::any::Any;
use std::collections::HashSet;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};

// Each warning's name, with the set of details (of the type its callers give) it was said for.
static SAID: Mutex<Vec<(&'static str, Box<dyn Any + Send>)>> = Mutex::new(Vec::new());

/// Runs `say` the first time this process sees `warning` with `detail`, and returns whether
/// it did. `say` runs outside the lock, so it may log, or record what it said, freely.
pub(crate) fn once<D: Eq + Hash + Send + 'static>(
    warning: &'static str,
    detail: D,
    say: impl FnOnce(),
) -> bool {
    let first = {
        let mut said = SAID.lock().unwrap_or_else(PoisonError::into_inner);
        let index = match said
            .iter()
            .position(|(name, details)| *name == warning && details.is::<HashSet<D>>())
        {
            Some(index) => index,
            None => {
                said.push((warning, Box::new(HashSet::<D>::new())));
                said.len() - 1
            }
        };
        said[index]
            .1
            .downcast_mut::<HashSet<D>>()
            .is_some_and(|details| details.insert(detail))
    };
    if first {
        say();
    }
    first
}

#[cfg(test)]
mod tests {
    use super::once;

    #[test]
    fn each_warning_is_said_once_per_detail() {
        let mut said = Vec::new();
        for (warning, detail) in [("a", 1), ("a", 1), ("a", 2), ("b", 1), ("b", 1)] {
            once(warning, detail, || said.push((warning, detail)));
        }
        assert_eq!(said, [("a", 1), ("a", 2), ("b", 1)]);
        assert!(!once("a", 1, || unreachable!("said already")));
        // The same name with details of another type is another warning.
        assert!(once("a", "one", || {}));
    }
}
