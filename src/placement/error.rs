//! What can go wrong when placing a model, each message saying what to change.

use thiserror::Error;

use super::DeviceKey;

/// A device map or a placement request that cannot be honoured.
///
/// Every check runs before any parameter moves, so an error leaves the module where it was.
///
/// ```
/// use burn_accelerate::placement::{DeviceKey, PlacementError};
///
/// let err = "gpu0".parse::<DeviceKey>().unwrap_err();
/// assert!(matches!(err, PlacementError::InvalidDeviceKey { .. }));
/// assert!(err.to_string().contains("\"<type>:<index>\""));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// A device key that is not `<type>:<index>`.
    #[error(
        "{text:?} is not a device key: write it as \"<type>:<index>\" (Burn's `DeviceId`, \
         e.g. \"3:0\" for `WgpuDevice::Cpu`); `DeviceKey::of(&device)` gives a device's key"
    )]
    InvalidDeviceKey {
        /// The text that failed to parse.
        text: String,
    },

    /// A map entry names a device that is not among the devices offered.
    #[error(
        "device map entry {prefix:?} names device {key}, which is not among the devices given \
         ({known}): use one of those keys, or pass that device too"
    )]
    UnknownDevice {
        /// The entry's module path prefix.
        prefix: String,
        /// The key that matched no device.
        key: DeviceKey,
        /// The devices that were offered, as `key label`, comma-separated.
        known: String,
    },

    /// A map entry whose prefix matches no parameter of the module (a typo, usually).
    #[error(
        "device map entry {prefix:?} matches no parameter of the module: fix the path \
         (paths look like {example:?}) or remove the entry"
    )]
    UnmatchedEntry {
        /// The entry's module path prefix.
        prefix: String,
        /// A real parameter path, to compare with.
        example: String,
    },

    /// Parameters that no map entry covers.
    #[error(
        "{} parameter(s) are not covered by the device map ({}): add an entry for their \
         module (e.g. {:?}), or a catch-all entry \"\"",
        paths.len(),
        preview(paths),
        paths.first().map(|p| parent(p)).unwrap_or_default()
    )]
    Unplaced {
        /// Every parameter path without a device.
        paths: Vec<String>,
    },

    /// The parameters a map puts on a device exceed that device's budget.
    #[error(
        "device {key} ({label}) would hold {needed} bytes of parameters, {over} over its budget \
         of {budget} bytes (largest entries there: {largest}): raise its budget, or move one of \
         those entries to another device"
    )]
    OverBudget {
        /// The device over budget.
        key: DeviceKey,
        /// The device as Burn prints it.
        label: String,
        /// The bytes the map puts there.
        needed: u64,
        /// The device's budget in bytes.
        budget: u64,
        /// `needed - budget`.
        over: u64,
        /// The largest map entries on that device, as `prefix (bytes)`, comma-separated.
        largest: String,
    },

    /// `infer_device_map` was given no devices.
    #[error("no devices to place on: give at least one (device, byte budget) pair")]
    NoDevices,

    /// `infer_device_map` was given the same device twice.
    #[error(
        "device {key} ({label}) is listed twice in the budgets: give each device once, with \
         its whole budget"
    )]
    DuplicateDevice {
        /// The repeated device.
        key: DeviceKey,
        /// The device as Burn prints it.
        label: String,
    },

    /// A `no_split` entry that is neither a submodule path nor a module type name.
    #[error(
        "no_split entry {entry:?} names no submodule: give a module path (e.g. {example:?}) \
         or a module type name as `#[derive(Module)]` spells it (e.g. \"Linear\")"
    )]
    UnknownNoSplit {
        /// The entry.
        entry: String,
        /// A real submodule path, to compare with.
        example: String,
    },

    /// A module (or a single parameter) fits on none of the devices still open to it.
    #[error(
        "{path:?} needs {bytes} bytes{whole}, more than is left on any device from {from} on \
         (left: {left}): raise a budget, add a device{split}",
        path = if path.is_empty() { "the module" } else { path.as_str() },
        whole = if *kept_whole { " kept whole" } else { "" },
        split = if *no_split { ", or take it out of no_split" } else { "" }
    )]
    DoesNotFit {
        /// The submodule or parameter path (`""` for the whole module).
        path: String,
        /// Its size in bytes.
        bytes: u64,
        /// Whether it could not be split (a `no_split` module or a single parameter).
        kept_whole: bool,
        /// Whether it is kept whole because of `no_split`.
        no_split: bool,
        /// The first device it could still have gone to (devices fill in order).
        from: DeviceKey,
        /// The bytes left on each device from `from` on, as `key: bytes`, comma-separated.
        left: String,
    },

    /// A model spread over several devices, handed to a data-parallel strategy.
    #[error(
        "the model's parameters live on {} devices ({}), so it cannot be trained data-parallel \
         over {workers}: every worker needs a whole replica on its own device. Gather the model \
         on one device first (apply `DeviceMap::single(key)`, or `placement::fork`, which also \
         works where Burn's `Module::fork` leaves a wgpu copy unwritten), or train it with a \
         single-device strategy",
        devices.len(),
        devices.join("; ")
    )]
    SpreadForDataParallel {
        /// Each device the model uses, as `key label: a few parameter paths`.
        devices: Vec<String>,
        /// The strategy's devices, as `key label`, comma-separated.
        workers: String,
    },
}

/// At most five items, then how many more.
pub(crate) fn preview(items: &[String]) -> String {
    const SHOWN: usize = 5;
    let mut text = items
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > SHOWN {
        text.push_str(&format!(", and {} more", items.len() - SHOWN));
    }
    text
}

/// The module holding a parameter: `"fc3.weight"` → `"fc3"`.
fn parent(path: &str) -> String {
    path.rsplit_once('.')
        .map_or(path, |(module, _)| module)
        .to_string()
}
