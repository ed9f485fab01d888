//! `infer_device_map`: fill devices in module order under byte budgets.

use std::collections::VecDeque;

use burn::module::Module;
use burn::tensor::backend::Backend;

use super::map::unique_devices;
use super::walk::{Node, Walk, walk};
use super::{DeviceKey, DeviceMap, PlacementError};

/// A device map for `module` that fills `budgets`' devices in order, each up to its byte
/// budget, walking the submodules in module order, the way Accelerate's
/// `infer_auto_device_map` does.
///
/// Each top-level submodule goes whole onto the current device if it fits there. If it does
/// not, it is split into its own submodules (and parameters), which are placed the same way,
/// unless `no_split` lists it: then it moves whole to the next device. A single parameter is
/// never split. Devices are never revisited, so consecutive layers stay together and
/// activations cross devices as few times as the budgets allow. The map is then made as small
/// as it can be: a submodule whose parameters all landed on one device gets one entry.
///
/// `no_split` entries name submodules by path (`"blocks.0"`) or by their `#[derive(Module)]`
/// type name (`"Block"`, as Accelerate's `no_split_module_classes`).
///
/// Budgets count parameter bytes only (elements × element size, as the
/// [report](super::report) gives them): leave room for activations, gradients and optimizer
/// state yourself. Lazy parameters are not created. Unlike Accelerate there is no `"cpu"`
/// or `"disk"` offload tier: a module that fits nowhere is an error.
///
/// Errors: no devices ([`NoDevices`](PlacementError::NoDevices)), a device listed twice
/// ([`DuplicateDevice`](PlacementError::DuplicateDevice)), a `no_split` entry naming no
/// submodule ([`UnknownNoSplit`](PlacementError::UnknownNoSplit)), something that fits on no
/// device still open to it ([`DoesNotFit`](PlacementError::DoesNotFit)).
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::backend::Backend;
/// use burn_accelerate::placement::{self, DeviceKey};
///
/// #[derive(Module, Debug)]
/// struct Net<B: Backend> {
///     fc1: Linear<B>, // 4×8 + 8 floats: 160 bytes
///     fc2: Linear<B>, // 8×2 + 2 floats: 72 bytes
/// }
///
/// let device = Default::default();
/// let net = Net::<Flex> {
///     fc1: LinearConfig::new(4, 8).init(&device),
///     fc2: LinearConfig::new(8, 2).init(&device),
/// };
/// let map = placement::infer_device_map(&net, &[(device, 1024)], &[])?;
/// assert_eq!(map.device_for("fc2.weight"), Some(DeviceKey::of(&device)));
///
/// let err = placement::infer_device_map(&net, &[(device, 100)], &["Linear"]).unwrap_err();
/// assert!(matches!(err, placement::PlacementError::DoesNotFit { .. }));
/// # }
/// # Ok::<(), burn_accelerate::placement::PlacementError>(())
/// ```
pub fn infer_device_map<B: Backend, M: Module<B>>(
    module: &M,
    budgets: &[(B::Device, u64)],
    no_split: &[&str],
) -> Result<DeviceMap, PlacementError> {
    if budgets.is_empty() {
        return Err(PlacementError::NoDevices);
    }
    let devices = unique_devices::<B>(budgets)?;
    let keys: Vec<DeviceKey> = devices.iter().map(|(k, _)| *k).collect();
    let limits: Vec<u64> = budgets.iter().map(|(_, b)| *b).collect();
    infer_walk(&walk::<B, M>(module), &keys, &limits, no_split)
}

fn infer_walk<D>(
    walk: &Walk<D>,
    keys: &[DeviceKey],
    limits: &[u64],
    no_split: &[&str],
) -> Result<DeviceMap, PlacementError> {
    let named =
        |node: &Node, entry: &str| node.path == entry || node.type_name.as_deref() == Some(entry);
    for entry in no_split {
        if !walk.nodes.iter().any(|n| named(n, entry)) {
            return Err(PlacementError::UnknownNoSplit {
                entry: entry.to_string(),
                example: walk
                    .nodes
                    .get(1)
                    .map_or_else(String::new, |n| n.path.clone()),
            });
        }
    }
    let whole = |node: usize| no_split.iter().any(|e| named(&walk.nodes[node], e));

    let assigned = assign(walk, limits, keys, whole)?;
    let mut map = DeviceMap::new();
    emit(walk, 0, &assigned, keys, &mut map);
    Ok(map)
}

/// A unit of placement: a submodule, or a parameter visited directly under a submodule that
/// also has children (only a parameter that is the root module itself, in practice).
#[derive(Clone, Copy)]
enum Part {
    Node(usize),
    Param(usize),
}

fn parts<D>(walk: &Walk<D>, node: usize) -> Vec<Part> {
    let n = &walk.nodes[node];
    if n.children.is_empty() {
        return n.params.iter().map(|&p| Part::Param(p)).collect();
    }
    n.params
        .iter()
        .map(|&p| Part::Param(p))
        .chain(n.children.iter().map(|&c| Part::Node(c)))
        .collect()
}

/// The device index of every parameter.
fn assign<D>(
    walk: &Walk<D>,
    limits: &[u64],
    keys: &[DeviceKey],
    whole: impl Fn(usize) -> bool,
) -> Result<Vec<usize>, PlacementError> {
    let mut device_of = vec![0usize; walk.params.len()];
    let mut used = vec![0u64; limits.len()];
    let mut current = 0;
    let mut queue: VecDeque<Part> = parts(walk, 0).into();

    while let Some(part) = queue.pop_front() {
        let (path, bytes) = match part {
            Part::Node(n) => (&walk.nodes[n].path, walk.nodes[n].bytes),
            Part::Param(p) => (&walk.params[p].path, walk.params[p].bytes),
        };
        if bytes == 0 {
            // Nothing to hold; a zero-sized parameter rides along on the current device.
            let mut under = Vec::new();
            match part {
                Part::Node(n) => walk.params_under(n, &mut under),
                Part::Param(p) => under.push(p),
            }
            under.iter().for_each(|&p| device_of[p] = current);
            continue;
        }
        let first_tried = current;
        loop {
            if used[current] + bytes <= limits[current] {
                let mut under = Vec::new();
                match part {
                    Part::Node(n) => walk.params_under(n, &mut under),
                    Part::Param(p) => under.push(p),
                }
                under.iter().for_each(|&p| device_of[p] = current);
                used[current] += bytes;
                break;
            }
            if let Part::Node(n) = part
                && !whole(n)
            {
                let inner = parts(walk, n);
                for p in inner.into_iter().rev() {
                    queue.push_front(p);
                }
                break;
            }
            if current + 1 == limits.len() {
                let no_split = matches!(part, Part::Node(n) if whole(n));
                let left: Vec<String> = (first_tried..limits.len())
                    .map(|d| format!("{}: {}", keys[d], limits[d].saturating_sub(used[d])))
                    .collect();
                return Err(PlacementError::DoesNotFit {
                    path: path.clone(),
                    bytes,
                    kept_whole: true,
                    no_split,
                    from: keys[first_tried],
                    left: left.join(", "),
                });
            }
            current += 1;
        }
    }
    Ok(device_of)
}

/// The smallest map giving every parameter its device: one entry per maximal submodule whose
/// parameters share a device.
fn emit<D>(
    walk: &Walk<D>,
    node: usize,
    assigned: &[usize],
    keys: &[DeviceKey],
    map: &mut DeviceMap,
) {
    let mut under = Vec::new();
    walk.params_under(node, &mut under);
    let Some(&first) = under.first() else {
        return;
    };
    let device = assigned[first];
    if under.iter().all(|&p| assigned[p] == device) {
        map.insert(walk.nodes[node].path.clone(), keys[device]);
        return;
    }
    for &p in &walk.nodes[node].params {
        map.insert(walk.params[p].path.clone(), keys[assigned[p]]);
    }
    for &child in &walk.nodes[node].children {
        emit(walk, child, assigned, keys, map);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::walk::{ParamInfo, ParamKind, join};
    use burn::tensor::DType;

    /// A walk shaped like Burn's: every path component a node, each parameter its own node.
    fn synthetic(params: &[(&str, u64)], types: &[(&str, &str)]) -> Walk<()> {
        let mut walk = Walk {
            params: Vec::new(),
            nodes: vec![Node {
                path: String::new(),
                type_name: None,
                children: Vec::new(),
                params: Vec::new(),
                bytes: 0,
            }],
        };
        for (path, bytes) in params {
            let mut node = 0;
            walk.nodes[0].bytes += bytes;
            for name in path.split('.') {
                let child_path = join(&walk.nodes[node].path, name);
                let found = walk.nodes[node]
                    .children
                    .iter()
                    .copied()
                    .find(|&c| walk.nodes[c].path == child_path);
                node = found.unwrap_or_else(|| {
                    let type_name = types
                        .iter()
                        .find(|(p, _)| *p == child_path)
                        .map(|(_, t)| t.to_string());
                    walk.nodes.push(Node {
                        path: child_path,
                        type_name,
                        children: Vec::new(),
                        params: Vec::new(),
                        bytes: 0,
                    });
                    let index = walk.nodes.len() - 1;
                    walk.nodes[node].children.push(index);
                    index
                });
                walk.nodes[node].bytes += bytes;
            }
            walk.nodes[node].params.push(walk.params.len());
            walk.params.push(ParamInfo {
                path: path.to_string(),
                kind: ParamKind::Float,
                device: (),
                dtype: DType::F32,
                shape: vec![*bytes as usize / 4],
                bytes: *bytes,
                initialized: true,
            });
        }
        walk
    }

    const A: DeviceKey = DeviceKey::new(3, 0);
    const B: DeviceKey = DeviceKey::new(4, 0);
    const C: DeviceKey = DeviceKey::new(0, 0);

    /// embed 100, blocks.{0,1,2}.{fc1,fc2} 50 each (100 per block), head 40: 440 bytes.
    fn model() -> Walk<()> {
        let mut params = vec![("embed.weight", 80), ("embed.bias", 20)];
        let names: Vec<String> = (0..3)
            .flat_map(|b| ["fc1", "fc2"].map(|l| format!("blocks.{b}.{l}.weight")))
            .collect();
        params.extend(names.iter().map(|n| (n.as_str(), 50)));
        params.push(("head.weight", 40));
        let types = [
            ("blocks.0", "Block"),
            ("blocks.1", "Block"),
            ("blocks.2", "Block"),
        ];
        synthetic(&params, &types)
    }

    fn entries(map: &DeviceMap) -> Vec<(String, DeviceKey)> {
        map.entries().map(|(p, k)| (p.to_string(), k)).collect()
    }

    fn e(path: &str, key: DeviceKey) -> (String, DeviceKey) {
        (path.to_string(), key)
    }

    #[test]
    fn everything_fits_on_the_first_device_as_one_entry() {
        let map = infer_walk(&model(), &[A, B], &[440, 1000], &[]).unwrap();
        assert_eq!(entries(&map), vec![e("", A)]);
    }

    #[test]
    fn splits_the_module_that_does_not_fit_and_fills_in_order() {
        // A holds embed (100) + blocks.0 (100) + blocks.1.fc1 (50) = 250 of 260.
        let map = infer_walk(&model(), &[A, B], &[260, 1000], &[]).unwrap();
        assert_eq!(
            entries(&map),
            vec![
                e("embed", A),
                e("blocks.0", A),
                e("blocks.1.fc1", A),
                e("blocks.1.fc2", B),
                e("blocks.2", B),
                e("head", B),
            ]
        );
    }

    #[test]
    fn no_split_keeps_a_module_whole_by_type_or_path() {
        for no_split in [&["Block"][..], &["blocks.1"][..]] {
            let map = infer_walk(&model(), &[A, B], &[260, 1000], no_split).unwrap();
            assert_eq!(
                entries(&map),
                vec![
                    e("embed", A),
                    e("blocks.0", A),
                    e("blocks.1", B),
                    e("blocks.2", B),
                    e("head", B)
                ],
                "{no_split:?}"
            );
        }
    }

    #[test]
    fn devices_are_never_revisited_and_budgets_hold() {
        // head (40) would fit back on A, but A is behind: module order is pipeline order.
        let walk = model();
        let map = infer_walk(&walk, &[A, B, C], &[190, 200, 200], &[]).unwrap();
        assert_eq!(
            entries(&map),
            vec![
                e("embed", A),
                e("blocks.0.fc1", A),
                e("blocks.0.fc2", B),
                e("blocks.1", B),
                e("blocks.2.fc1", B),
                e("blocks.2.fc2", C),
                e("head", C),
            ]
        );
        let mut used = [0u64; 3];
        for p in &walk.params {
            let key = map.device_for(&p.path).unwrap();
            used[[A, B, C].iter().position(|k| *k == key).unwrap()] += p.bytes;
        }
        assert_eq!(used, [150, 200, 90]);
    }

    #[test]
    fn a_module_that_fits_nowhere_is_an_error_naming_it() {
        let err = infer_walk(&model(), &[A, B], &[260, 150], &["Block"]).unwrap_err();
        assert_eq!(
            err,
            PlacementError::DoesNotFit {
                path: "blocks.2".into(),
                bytes: 100,
                kept_whole: true,
                no_split: true,
                from: B,
                left: "4:0: 50".into(),
            }
        );
        let message = err.to_string();
        assert!(message.contains("take it out of no_split"), "{message}");

        let err = infer_walk(&model(), &[A], &[70], &[]).unwrap_err();
        assert!(
            matches!(&err, PlacementError::DoesNotFit { path, bytes: 80, no_split: false, .. } if path == "embed.weight"),
            "{err:?}"
        );
        assert!(!err.to_string().contains("no_split"), "{err}");
    }

    #[test]
    fn unknown_no_split_entry_is_an_error() {
        let err = infer_walk(&model(), &[A], &[1000], &["blocks.9"]).unwrap_err();
        assert_eq!(
            err,
            PlacementError::UnknownNoSplit {
                entry: "blocks.9".into(),
                example: "embed".into()
            }
        );
    }

    #[test]
    fn zero_budget_devices_are_skipped_and_an_empty_module_maps_to_nothing() {
        let map = infer_walk(&model(), &[A, B], &[0, 1000], &[]).unwrap();
        assert_eq!(entries(&map), vec![e("", B)]);
        let empty = synthetic(&[], &[]);
        assert!(infer_walk(&empty, &[A], &[0], &[]).unwrap().is_empty());
    }
}
