//! The placement report: where every parameter of a module lives, and what it weighs.

use core::fmt;

use burn::module::Module;
use burn::tensor::DType;
use burn::tensor::backend::Backend;

use super::DeviceKey;
use super::walk::{ParamKind, walk};

/// One parameter: its path, device, dtype, shape and size.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamPlacement {
    /// The path Burn's `ModuleVisitor` gives it (`"fc1.weight"`).
    pub path: String,
    /// Float, int or bool.
    pub kind: ParamKind,
    /// The device it lives on.
    pub device: DeviceKey,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Elements × element size.
    pub bytes: u64,
    /// False for a parameter Burn has not created yet: its device and shape are the ones it
    /// will be created with and its dtype the device's default.
    pub initialized: bool,
}

/// What one device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTotal {
    /// The device's key.
    pub device: DeviceKey,
    /// The device as Burn's `Debug` prints it (`"Cpu"`, `"DefaultDevice"`).
    pub label: String,
    /// How many parameters live there.
    pub params: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// Where every parameter of a module lives: one row per parameter in module order, and
/// totals per device in the order the devices first appear.
///
/// `Display` prints it as a table.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::nn::LinearConfig;
/// use burn_accelerate::placement::{self, DeviceKey};
///
/// let layer = LinearConfig::new(4, 2).init::<Flex>(&Default::default());
/// let report = placement::report(&layer);
/// assert_eq!(report.params[0].path, "weight");
/// assert_eq!(report.params[0].shape, vec![4, 2]);
/// assert_eq!(report.total_bytes(), (8 + 2) * 4);
/// assert_eq!(report.devices[0].device, DeviceKey::new(0, 0));
/// assert!(!report.is_spread());
/// println!("{report}");
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlacementReport {
    /// Every parameter, in the order the module visits them.
    pub params: Vec<ParamPlacement>,
    /// Every device holding parameters, in order of first appearance.
    pub devices: Vec<DeviceTotal>,
}

/// The placement report of `module`. Parameters Burn has not created yet stay uncreated.
///
/// See [`PlacementReport`].
pub fn report<B: Backend, M: Module<B>>(module: &M) -> PlacementReport {
    let walk = walk::<B, M>(module);
    let mut report = PlacementReport::default();
    for param in walk.params {
        let key = DeviceKey::of(&param.device);
        match report.devices.iter_mut().find(|d| d.device == key) {
            Some(total) => {
                total.params += 1;
                total.bytes += param.bytes;
            }
            None => report.devices.push(DeviceTotal {
                device: key,
                label: format!("{:?}", param.device),
                params: 1,
                bytes: param.bytes,
            }),
        }
        report.params.push(ParamPlacement {
            path: param.path,
            kind: param.kind,
            device: key,
            dtype: param.dtype,
            shape: param.shape,
            bytes: param.bytes,
            initialized: param.initialized,
        });
    }
    report
}

/// Whether `module`'s parameters live on more than one device: the question Accelerate's
/// `verify_device_map` answers before data-parallel training, which needs a whole replica
/// per device.
///
/// A module without parameters lives nowhere and is not spread.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::nn::LinearConfig;
/// use burn_accelerate::placement::verify_device_map;
///
/// let layer = LinearConfig::new(4, 2).init::<Flex>(&Default::default());
/// assert!(!verify_device_map(&layer)); // one device
/// # }
/// ```
pub fn verify_device_map<B: Backend, M: Module<B>>(module: &M) -> bool {
    report(module).is_spread()
}

impl PlacementReport {
    /// Whether the parameters live on more than one device.
    pub fn is_spread(&self) -> bool {
        self.devices.len() > 1
    }

    /// All parameters' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.devices.iter().map(|d| d.bytes).sum()
    }

    /// The parameters on `device`, in module order.
    pub fn params_on(&self, device: DeviceKey) -> impl Iterator<Item = &ParamPlacement> {
        self.params.iter().filter(move |p| p.device == device)
    }

    /// The totals of `device`, if it holds parameters.
    pub fn device(&self, device: DeviceKey) -> Option<&DeviceTotal> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// Each device as `key label: path, path, …` with at most `per_device` paths, for
    /// messages that must name the offending parameters without listing them all.
    pub(crate) fn examples(&self, per_device: usize) -> Vec<String> {
        self.devices
            .iter()
            .map(|total| {
                let mut paths: Vec<&str> = self
                    .params_on(total.device)
                    .take(per_device)
                    .map(|p| p.path.as_str())
                    .collect();
                if total.params > per_device {
                    paths.push("…");
                }
                format!("{} {}: {}", total.device, total.label, paths.join(", "))
            })
            .collect()
    }
}

/// A byte count for people: `2704` → `"2.6 KiB"`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

fn shape_text(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// Columns padded to their widest cell; numbers right-aligned.
fn table(f: &mut fmt::Formatter<'_>, rows: &[Vec<String>], numeric: &[bool]) -> fmt::Result {
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let pad = widths[c] - cell.chars().count();
            if numeric[c] {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            }
        }
        writeln!(f, "{}", line.trim_end())?;
    }
    Ok(())
}

impl fmt::Display for PlacementReport {
    /// ```text
    /// parameter   device  dtype  shape     bytes
    /// fc1.weight  0:0 Cpu f32    [16, 32]   2048
    /// …
    ///
    /// device   params  bytes
    /// 0:0 Cpu       4   2704 (2.6 KiB)
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let label = |key: DeviceKey| {
            self.device(key)
                .map_or_else(|| key.to_string(), |d| format!("{} {}", d.device, d.label))
        };
        let mut rows = vec![vec![
            "parameter".to_string(),
            "device".to_string(),
            "dtype".to_string(),
            "shape".to_string(),
            "bytes".to_string(),
            String::new(),
        ]];
        for p in &self.params {
            rows.push(vec![
                p.path.clone(),
                label(p.device),
                dtype_name(p.dtype),
                shape_text(&p.shape),
                p.bytes.to_string(),
                if p.initialized { "" } else { "(lazy)" }.to_string(),
            ]);
        }
        table(f, &rows, &[false, false, false, false, true, false])?;
        writeln!(f)?;

        let mut rows = vec![vec![
            "device".to_string(),
            "params".to_string(),
            "bytes".to_string(),
            String::new(),
        ]];
        for d in &self.devices {
            rows.push(vec![
                label(d.device),
                d.params.to_string(),
                d.bytes.to_string(),
                format!("({})", human_bytes(d.bytes)),
            ]);
        }
        if self.devices.len() > 1 {
            let total = self.total_bytes();
            rows.push(vec![
                "total".to_string(),
                self.params.len().to_string(),
                total.to_string(),
                format!("({})", human_bytes(total)),
            ]);
        }
        table(f, &rows, &[false, true, true, false])?;
        if self.params.iter().any(|p| !p.initialized) {
            writeln!(
                f,
                "(lazy): not created yet; device and shape as it will be created, dtype the \
                 device's default"
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_picks_a_unit() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(2704), "2.6 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }
}
