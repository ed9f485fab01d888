//! Device maps: which device each submodule's parameters live on, checked and applied.

use core::fmt;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::key::describe;
use super::moves::relocate;
use super::report::DeviceTotal;
use super::walk::{Walk, walk};
use super::{DeviceKey, PlacementError};

/// Module path prefix → device, like Accelerate's `device_map`.
///
/// A parameter lives on the device of the longest entry that is a prefix of its path, whole
/// path components only: `"fc1"` covers `"fc1.weight"` but not `"fc10.weight"`, and `""`
/// covers everything. Entries keep their order (module order, from
/// [`infer_device_map`](super::infer_device_map)); serialised, a map is a JSON object from
/// prefix to [`DeviceKey`].
///
/// ```
/// use burn_accelerate::placement::{DeviceKey, DeviceMap};
///
/// let cpu = DeviceKey::new(3, 0);
/// let gpu = DeviceKey::new(4, 0);
/// let map = DeviceMap::new().with("", cpu).with("blocks.1", gpu);
/// assert_eq!(map.device_for("blocks.1.fc.weight"), Some(gpu));
/// assert_eq!(map.device_for("blocks.10.fc.weight"), Some(cpu));
///
/// let json = serde_json::to_string(&map).unwrap();
/// assert_eq!(json, r#"{"":"3:0","blocks.1":"4:0"}"#);
/// assert_eq!(serde_json::from_str::<DeviceMap>(&json).unwrap(), map);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceMap {
    entries: Vec<(String, DeviceKey)>,
}

/// Whether `prefix` covers `path`, on whole path components.
pub(crate) fn covers(prefix: &str, path: &str) -> bool {
    prefix.is_empty()
        || path == prefix
        || (path.starts_with(prefix) && path.as_bytes().get(prefix.len()) == Some(&b'.'))
}

impl DeviceMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// The whole module on one device: `{"": key}`.
    ///
    /// ```
    /// use burn_accelerate::placement::{DeviceKey, DeviceMap};
    ///
    /// let map = DeviceMap::single(DeviceKey::new(0, 0));
    /// assert_eq!(map.device_for("anything.at.all"), Some(DeviceKey::new(0, 0)));
    /// ```
    pub fn single(key: DeviceKey) -> Self {
        Self::new().with("", key)
    }

    /// This map with `prefix` on `key` (replacing an entry for the same prefix in place).
    pub fn with(mut self, prefix: impl Into<String>, key: DeviceKey) -> Self {
        self.insert(prefix, key);
        self
    }

    /// Puts `prefix` on `key`; returns the device the prefix had, if it had one.
    pub fn insert(&mut self, prefix: impl Into<String>, key: DeviceKey) -> Option<DeviceKey> {
        let prefix = prefix.into();
        match self.entries.iter_mut().find(|(p, _)| *p == prefix) {
            Some((_, old)) => Some(core::mem::replace(old, key)),
            None => {
                self.entries.push((prefix, key));
                None
            }
        }
    }

    /// The entries, in order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, DeviceKey)> {
        self.entries.iter().map(|(p, k)| (p.as_str(), *k))
    }

    /// How many entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The devices the map uses, in order of first appearance.
    pub fn devices(&self) -> Vec<DeviceKey> {
        let mut keys = Vec::new();
        for (_, key) in &self.entries {
            if !keys.contains(key) {
                keys.push(*key);
            }
        }
        keys
    }

    /// The device of the parameter or submodule at `path`, if an entry covers it.
    pub fn device_for(&self, path: &str) -> Option<DeviceKey> {
        self.entry_for(path).map(|i| self.entries[i].1)
    }

    fn entry_for(&self, path: &str) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, (prefix, _))| covers(prefix, path))
            .max_by_key(|(_, (prefix, _))| prefix.len())
            .map(|(i, _)| i)
    }

    /// Checks this map against `module` and the `devices` on offer, and gives the
    /// [`Placement`] that applies it.
    ///
    /// Errors: an entry naming a device not in `devices`
    /// ([`UnknownDevice`](PlacementError::UnknownDevice)), an entry (other than `""`) covering
    /// no parameter ([`UnmatchedEntry`](PlacementError::UnmatchedEntry)), parameters no entry
    /// covers ([`Unplaced`](PlacementError::Unplaced)). Nothing moves and no lazy parameter is
    /// created.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn::backend::Flex;
    /// use burn::nn::LinearConfig;
    /// use burn_accelerate::placement::{DeviceKey, DeviceMap, PlacementError};
    ///
    /// let device = Default::default();
    /// let layer = LinearConfig::new(4, 2).init::<Flex>(&device);
    ///
    /// let only_weight = DeviceMap::new().with("weight", DeviceKey::of(&device));
    /// let err = only_weight.placement(&layer, &[device]).unwrap_err();
    /// assert_eq!(err, PlacementError::Unplaced { paths: vec!["bias".into()] });
    ///
    /// let placement = DeviceMap::single(DeviceKey::of(&device)).placement(&layer, &[device])?;
    /// let layer = placement.apply(layer);
    /// # }
    /// # Ok::<(), burn_accelerate::placement::PlacementError>(())
    /// ```
    pub fn placement<B: Backend, M: Module<B>>(
        &self,
        module: &M,
        devices: &[B::Device],
    ) -> Result<Placement<B>, PlacementError> {
        let walk = walk::<B, M>(module);
        let devices = devices
            .iter()
            .map(|d| (DeviceKey::of(d), d.clone()))
            .collect();
        self.resolve(&walk, devices)
    }

    /// [`placement`](Self::placement), with a byte budget per device on top: a device the map
    /// fills past its budget is an [`OverBudget`](PlacementError::OverBudget) error naming the
    /// largest entries there. Listing a device twice is a
    /// [`DuplicateDevice`](PlacementError::DuplicateDevice) error.
    pub fn placement_within<B: Backend, M: Module<B>>(
        &self,
        module: &M,
        budgets: &[(B::Device, u64)],
    ) -> Result<Placement<B>, PlacementError> {
        let walk = walk::<B, M>(module);
        let devices = unique_devices::<B>(budgets)?;
        let placement = self.resolve(&walk, devices)?;
        for (device, budget) in budgets {
            let key = DeviceKey::of(device);
            let Some(total) = placement.totals.iter().find(|t| t.device == key) else {
                continue;
            };
            if total.bytes > *budget {
                return Err(PlacementError::OverBudget {
                    key,
                    label: total.label.clone(),
                    needed: total.bytes,
                    budget: *budget,
                    over: total.bytes - budget,
                    largest: self.largest_entries_on(&walk, key),
                });
            }
        }
        Ok(placement)
    }

    fn resolve<B: Backend>(
        &self,
        walk: &Walk<B::Device>,
        devices: Vec<(DeviceKey, B::Device)>,
    ) -> Result<Placement<B>, PlacementError> {
        for (prefix, key) in &self.entries {
            if !devices.iter().any(|(k, _)| k == key) {
                let known: Vec<String> = devices.iter().map(|(_, d)| describe(d)).collect();
                return Err(PlacementError::UnknownDevice {
                    prefix: prefix.clone(),
                    key: *key,
                    known: if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    },
                });
            }
            if !prefix.is_empty() && !walk.params.iter().any(|p| covers(prefix, &p.path)) {
                return Err(PlacementError::UnmatchedEntry {
                    prefix: prefix.clone(),
                    example: walk
                        .params
                        .first()
                        .map_or_else(String::new, |p| p.path.clone()),
                });
            }
        }
        let unplaced: Vec<String> = walk
            .params
            .iter()
            .filter(|p| self.device_for(&p.path).is_none())
            .map(|p| p.path.clone())
            .collect();
        if !unplaced.is_empty() {
            return Err(PlacementError::Unplaced { paths: unplaced });
        }

        let mut totals: Vec<DeviceTotal> = Vec::new();
        for param in &walk.params {
            let key = self
                .device_for(&param.path)
                .unwrap_or(DeviceKey::of(&param.device));
            match totals.iter_mut().find(|t| t.device == key) {
                Some(total) => {
                    total.params += 1;
                    total.bytes += param.bytes;
                }
                None => {
                    let label = devices
                        .iter()
                        .find(|(k, _)| *k == key)
                        .map_or_else(String::new, |(_, d)| format!("{d:?}"));
                    totals.push(DeviceTotal {
                        device: key,
                        label,
                        params: 1,
                        bytes: param.bytes,
                    });
                }
            }
        }
        Ok(Placement {
            map: self.clone(),
            devices,
            totals,
        })
    }

    /// The three entries putting the most bytes on `key`, as `prefix (bytes)`.
    fn largest_entries_on<D>(&self, walk: &Walk<D>, key: DeviceKey) -> String {
        let mut bytes = vec![0u64; self.entries.len()];
        for param in &walk.params {
            if let Some(i) = self.entry_for(&param.path) {
                bytes[i] += param.bytes;
            }
        }
        let mut on: Vec<(usize, u64)> = bytes
            .into_iter()
            .enumerate()
            .filter(|(i, b)| self.entries[*i].1 == key && *b > 0)
            .collect();
        on.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        on.iter()
            .take(3)
            .map(|(i, b)| format!("{:?} ({b})", self.entries[*i].0))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The devices of `budgets` with their keys, each once.
pub(crate) fn unique_devices<B: Backend>(
    budgets: &[(B::Device, u64)],
) -> Result<Vec<(DeviceKey, B::Device)>, PlacementError> {
    let mut devices: Vec<(DeviceKey, B::Device)> = Vec::with_capacity(budgets.len());
    for (device, _) in budgets {
        let key = DeviceKey::of(device);
        if devices.iter().any(|(k, _)| *k == key) {
            return Err(PlacementError::DuplicateDevice {
                key,
                label: format!("{device:?}"),
            });
        }
        devices.push((key, device.clone()));
    }
    Ok(devices)
}

impl fmt::Display for DeviceMap {
    /// One `prefix -> key` line per entry (`""` shown as `(all)`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (prefix, key) in &self.entries {
            let prefix = if prefix.is_empty() { "(all)" } else { prefix };
            writeln!(f, "{prefix} -> {key}")?;
        }
        Ok(())
    }
}

impl Serialize for DeviceMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.entries.len()))?;
        for (prefix, key) in &self.entries {
            map.serialize_entry(prefix, key)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for DeviceMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor;

        impl<'de> Visitor<'de> for MapVisitor {
            type Value = DeviceMap;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from module path prefix to device key (\"<type>:<index>\")")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<DeviceMap, A::Error> {
                let mut map = DeviceMap::new();
                while let Some((prefix, key)) = access.next_entry::<String, DeviceKey>()? {
                    if map.insert(prefix.clone(), key).is_some() {
                        return Err(serde::de::Error::custom(format!(
                            "device map lists {prefix:?} twice: keep one entry per prefix"
                        )));
                    }
                }
                Ok(map)
            }
        }

        deserializer.deserialize_map(MapVisitor)
    }
}

/// A [`DeviceMap`] checked against a module and resolved to devices: [`apply`](Self::apply)
/// moves the module's parameters.
///
/// Made by [`DeviceMap::placement`] or [`DeviceMap::placement_within`].
#[derive(Debug, Clone)]
pub struct Placement<B: Backend> {
    map: DeviceMap,
    devices: Vec<(DeviceKey, B::Device)>,
    totals: Vec<DeviceTotal>,
}

impl<B: Backend> Placement<B> {
    /// The map this placement applies.
    pub fn map(&self) -> &DeviceMap {
        &self.map
    }

    /// What each device will hold once applied, in order of first appearance.
    pub fn totals(&self) -> &[DeviceTotal] {
        &self.totals
    }

    /// The device the parameter or submodule at `path` goes to.
    pub fn device_for(&self, path: &str) -> Option<&B::Device> {
        let key = self.map.device_for(path)?;
        self.devices.iter().find(|(k, _)| *k == key).map(|(_, d)| d)
    }

    /// `module` with every parameter on its mapped device.
    ///
    /// A parameter already there is left alone. A moved float parameter starts a fresh
    /// autodiff graph and keeps its `require_grad`, as with Burn's `Module::fork`, so the
    /// placed model trains like any other. Moves follow [`DeviceMoves`](super::DeviceMoves):
    /// through the host where the backend has no device-to-device copy (Burn 0.21's wgpu);
    /// that is a one-time cost of a read back and an upload per moved parameter. A lazy
    /// parameter is created on its own device, then moved, one at a time.
    ///
    /// Parameters of a module other than the one this placement was checked against go where
    /// the map says, and stay put where it says nothing.
    pub fn apply<M: Module<B>>(&self, module: M) -> M {
        module.map(&mut Mover {
            placement: self,
            path: Vec::new(),
        })
    }
}

struct Mover<'a, B: Backend> {
    placement: &'a Placement<B>,
    path: Vec<String>,
}

impl<B: Backend> Mover<'_, B> {
    fn target(&self) -> Option<B::Device> {
        self.placement.device_for(&self.path.join(".")).cloned()
    }
}

impl<B: Backend> ModuleMapper<B> for Mover<'_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(device) = self.target() else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let tensor = if tensor.device() == device {
            tensor
        } else {
            let require_grad = tensor.is_require_grad();
            relocate(tensor, &device)
                .detach()
                .set_require_grad(require_grad)
        };
        Param::from_mapped_value(id, tensor, mapper)
    }

    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        let Some(device) = self.target() else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let tensor = if tensor.device() == device {
            tensor
        } else {
            relocate(tensor, &device)
        };
        Param::from_mapped_value(id, tensor, mapper)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        let Some(device) = self.target() else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let tensor = if tensor.device() == device {
            tensor
        } else {
            relocate(tensor, &device)
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_cover_whole_components() {
        assert!(covers("", "a.b"));
        assert!(covers("", ""));
        assert!(covers("fc1", "fc1"));
        assert!(covers("fc1", "fc1.weight"));
        assert!(!covers("fc1", "fc10.weight"));
        assert!(!covers("fc1.weight", "fc1"));
        assert!(covers("blocks.1", "blocks.1.fc.bias"));
        assert!(!covers("blocks.1", "blocks.10.fc.bias"));
    }

    #[test]
    fn longest_prefix_wins_and_insert_replaces_in_place() {
        let (a, b, c) = (
            DeviceKey::new(0, 0),
            DeviceKey::new(0, 1),
            DeviceKey::new(0, 2),
        );
        let mut map = DeviceMap::new().with("", a).with("x", b).with("x.y", c);
        assert_eq!(map.device_for("z"), Some(a));
        assert_eq!(map.device_for("x.z"), Some(b));
        assert_eq!(map.device_for("x.y.w"), Some(c));
        assert_eq!(map.insert("x", a), Some(b));
        assert_eq!(
            map.entries().map(|(p, _)| p).collect::<Vec<_>>(),
            ["", "x", "x.y"]
        );
        assert_eq!(map.devices(), vec![a, c]);
        assert_eq!(DeviceMap::new().device_for("x"), None);
    }

    #[test]
    fn serde_keeps_order_and_rejects_duplicates_and_bad_keys() {
        let map = DeviceMap::new()
            .with("layers.10", DeviceKey::new(4, 0))
            .with("layers.2", DeviceKey::new(3, 0));
        let json = serde_json::to_string(&map).unwrap();
        assert_eq!(json, r#"{"layers.10":"4:0","layers.2":"3:0"}"#);
        assert_eq!(serde_json::from_str::<DeviceMap>(&json).unwrap(), map);

        let dup = serde_json::from_str::<DeviceMap>(r#"{"a":"0:0","a":"0:1"}"#).unwrap_err();
        assert!(dup.to_string().contains("twice"), "{dup}");
        let bad = serde_json::from_str::<DeviceMap>(r#"{"a":"cuda:0"}"#).unwrap_err();
        assert!(bad.to_string().contains("<type>:<index>"), "{bad}");
    }
}
