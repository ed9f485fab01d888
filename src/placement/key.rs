//! How a device map names a device: Burn's own `DeviceId`, written `"<type>:<index>"`.

use core::fmt;
use core::str::FromStr;

use burn_backend::{DeviceId, DeviceOps};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::PlacementError;

/// A device's name in a [`DeviceMap`](super::DeviceMap) and a
/// [`PlacementReport`](super::PlacementReport): Burn's `DeviceId` (`type_id`, `index_id`),
/// written and serialised as `"<type>:<index>"`.
///
/// Burn's backends already give every device this pair, it survives a round trip through a
/// file, and it is the same for `B`, `Autodiff<B>` and `Accelerated<B>`. Some keys:
///
/// | device | key |
/// |---|---|
/// | `WgpuDevice::DiscreteGpu(n)` | `0:n` |
/// | `WgpuDevice::IntegratedGpu(n)` | `1:n` |
/// | `WgpuDevice::Cpu` | `3:0` |
/// | `WgpuDevice::DefaultDevice` | `4:0` |
/// | `CudaDevice { index: n }` | `0:n` |
/// | Flex, NdArray (one device each) | `0:0` |
///
/// A key is resolved against devices the caller hands over (those in the budgets, or the
/// device list given to [`DeviceMap::placement`](super::DeviceMap::placement)), never made
/// into a device on its own: Burn's `from_id` turns any id into *some* device (wgpu falls back
/// to the default one), so a typo would silently land on the wrong device instead of being an
/// error.
///
/// ```
/// use burn_accelerate::placement::DeviceKey;
///
/// let key: DeviceKey = "3:0".parse()?;
/// assert_eq!((key.type_id, key.index), (3, 0));
/// assert_eq!(key.to_string(), "3:0");
/// assert_eq!(serde_json::to_string(&key).unwrap(), "\"3:0\"");
/// # #[cfg(feature = "flex")]
/// assert_eq!(DeviceKey::of(&burn::backend::flex::FlexDevice), DeviceKey::new(0, 0));
/// # Ok::<(), burn_accelerate::placement::PlacementError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceKey {
    /// Which kind of device, as the backend numbers them.
    pub type_id: u16,
    /// Which device of that kind.
    pub index: u16,
}

impl DeviceKey {
    /// The key for `type_id` and `index`.
    pub const fn new(type_id: u16, index: u16) -> Self {
        DeviceKey { type_id, index }
    }

    /// The key of a Burn device.
    pub fn of<D: DeviceOps>(device: &D) -> Self {
        Self::from(device.id())
    }
}

impl From<DeviceId> for DeviceKey {
    fn from(id: DeviceId) -> Self {
        DeviceKey::new(id.type_id, id.index_id)
    }
}

impl fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.type_id, self.index)
    }
}

impl FromStr for DeviceKey {
    type Err = PlacementError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = || PlacementError::InvalidDeviceKey {
            text: text.to_string(),
        };
        let (type_id, index) = text.trim().split_once(':').ok_or_else(invalid)?;
        Ok(DeviceKey::new(
            type_id.parse().map_err(|_| invalid())?,
            index.parse().map_err(|_| invalid())?,
        ))
    }
}

impl Serialize for DeviceKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A device as the report shows it: its key, then Burn's `Debug` name (`3:0 Cpu`).
pub(crate) fn describe<D: DeviceOps>(device: &D) -> String {
    format!("{} {device:?}", DeviceKey::of(device))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_and_print_back() {
        for text in ["0:0", "3:0", "4:0", "0:7", "65535:65535"] {
            assert_eq!(text.parse::<DeviceKey>().unwrap().to_string(), text);
        }
        assert_eq!(" 3:1 ".parse::<DeviceKey>().unwrap(), DeviceKey::new(3, 1));
        for bad in [
            "", "3", "3:", ":0", "a:0", "3:0:1", "65536:0", "-1:0", "cpu",
        ] {
            assert_eq!(
                bad.parse::<DeviceKey>(),
                Err(PlacementError::InvalidDeviceKey {
                    text: bad.to_string()
                }),
                "{bad:?}"
            );
        }
    }
}
