//! Placement on single-device backends (Flex, NdArray): exact reports, the seed's
//! `verify_device_map` semantics, device maps and every error path they can reach with one
//! device. Two real devices are in `placement_wgpu.rs`.
#![cfg(any(feature = "flex", feature = "ndarray"))]

mod suite;

use burn::nn::Relu;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_accelerate::placement::{
    self, DeviceKey, DeviceMap, ParamKind, PlacementError, check_data_parallel, device_of,
    infer_device_map, verify_device_map,
};
use burn_accelerate::{AccelerateError, Accelerated};
use suite::models::{Mlp, Stack};
use suite::{normal_input, rel_err, twins};

/// `Stack::new(4, 8, 2, 2)`: embed 160 bytes, two blocks of 576, head 72.
const STACK_BYTES: u64 = 160 + 2 * 576 + 72;

fn stack<B: Backend>(device: &B::Device) -> Stack<B> {
    Stack::new(4, 8, 2, 2, device)
}

fn stack_paths() -> Vec<String> {
    let mut paths = vec!["embed.weight".to_string(), "embed.bias".to_string()];
    for b in 0..2 {
        for l in ["fc1", "fc2"] {
            paths.push(format!("blocks.{b}.{l}.weight"));
            paths.push(format!("blocks.{b}.{l}.bias"));
        }
    }
    paths.extend(["head.weight".to_string(), "head.bias".to_string()]);
    paths
}

fn report_is_exact<B: Backend>(device: &B::Device) {
    let key = DeviceKey::of(device);
    let model = stack::<B>(device);
    let _ = model.forward(Tensor::ones([1, 4], device)); // create the lazy parameters
    let report = placement::report(&model);

    let paths: Vec<&str> = report.params.iter().map(|p| p.path.as_str()).collect();
    assert_eq!(paths, stack_paths());
    let shapes: Vec<Vec<usize>> = report.params.iter().map(|p| p.shape.clone()).collect();
    let mut want = vec![vec![4, 8], vec![8]];
    for _ in 0..4 {
        want.extend([vec![8, 8], vec![8]]);
    }
    want.extend([vec![8, 2], vec![2]]);
    assert_eq!(shapes, want);
    for p in &report.params {
        assert_eq!(p.device, key, "{}", p.path);
        assert_eq!(p.dtype, DType::F32, "{}", p.path);
        assert_eq!(p.kind, ParamKind::Float, "{}", p.path);
        assert_eq!(p.bytes, 4 * p.shape.iter().product::<usize>() as u64);
        assert!(p.initialized, "{}", p.path);
    }
    assert_eq!(report.devices.len(), 1);
    let total = &report.devices[0];
    assert_eq!(total.device, key);
    assert_eq!(total.label, format!("{device:?}"));
    assert_eq!((total.params, total.bytes), (12, STACK_BYTES));
    assert_eq!(report.total_bytes(), STACK_BYTES);
    assert_eq!(report.params_on(key).count(), 12);
    assert!(!report.is_spread());
}

fn display_is_a_table<B: Backend>(device: &B::Device) {
    let model = Mlp::<B>::new(2, 3, 1, device);
    let _ = model.forward(Tensor::ones([1, 2], device));
    let label = format!("{} {device:?}", DeviceKey::of(device));
    let pad = " ".repeat(label.len().saturating_sub(6));
    let col = label.len().max(6);
    let row = |path: &str, shape: &str, bytes: u64| {
        format!("{path:<10}  {label:<col$}  f32    {shape:<6}  {bytes:>5}\n")
    };
    let want = format!(
        "parameter   device{pad}  dtype  shape   bytes\n{}{}{}{}\ndevice{pad}  params  bytes\n{label:<col$}       4     52  (52 B)\n",
        row("fc1.weight", "[2, 3]", 24),
        row("fc1.bias", "[3]", 12),
        row("fc2.weight", "[3, 1]", 12),
        row("fc2.bias", "[1]", 4),
    );
    assert_eq!(placement::report(&model).to_string(), want);
}

fn lazy_parameters_are_reported_without_being_created<B: Backend>(device: &B::Device) {
    let model = stack::<B>(device);
    let lazy = placement::report(&model);
    assert!(lazy.params.iter().all(|p| !p.initialized));
    assert!(lazy.to_string().contains("(lazy)"), "{lazy}");
    infer_device_map(&model, &[(device.clone(), 1 << 20)], &["Block"]).unwrap();
    assert!(!verify_device_map(&model));
    assert_eq!(device_of(&model), Some(device.clone()));
    assert!(!model.embed.weight.is_initialized());
    assert!(!model.head.bias.as_ref().unwrap().is_initialized());

    let _ = model.forward(Tensor::ones([1, 4], device));
    let created = placement::report(&model);
    assert!(created.params.iter().all(|p| p.initialized));
    assert_eq!(created.devices, lazy.devices);
    for (c, l) in created.params.iter().zip(&lazy.params) {
        assert_eq!(
            (&c.path, c.device, c.dtype, &c.shape, c.bytes),
            (&l.path, l.device, l.dtype, &l.shape, l.bytes)
        );
    }
}

fn verify_device_map_is_false_on_one_device<B: Backend>(device: &B::Device) {
    assert!(!verify_device_map(&stack::<B>(device)));
    assert!(!verify_device_map::<B, _>(&Relu::new())); // no parameters: lives nowhere
    assert_eq!(device_of::<B, _>(&Relu::new()), None);
    assert!(placement::report::<B, _>(&Relu::new()).params.is_empty());
}

fn infer_and_apply_on_one_device<B: Backend>(device: &B::Device) {
    let key = DeviceKey::of(device);
    let model = stack::<B>(device);
    let x = normal_input::<B, 2>([3, 4], device);
    let before = model.forward(x.clone());

    // Exactly the model's bytes fit; the map is then one catch-all entry.
    let budgets = [(device.clone(), STACK_BYTES)];
    let map = infer_device_map(&model, &budgets, &[]).unwrap();
    assert_eq!(map, DeviceMap::single(key));
    let placement = map.placement_within(&model, &budgets).unwrap();
    assert_eq!(placement.totals().len(), 1);
    assert_eq!(placement.totals()[0].bytes, STACK_BYTES);
    assert_eq!(placement.device_for("head.bias"), Some(device));

    let report_before = placement::report(&model);
    let placed = placement.apply(model);
    assert_eq!(placement::report(&placed), report_before);
    placed
        .forward(x.clone())
        .into_data()
        .assert_eq(&before.clone().into_data(), true);
    placed
        .forward_placed(x)
        .into_data()
        .assert_eq(&before.into_data(), true);
    assert!(check_data_parallel(&placed, &[device.clone(), device.clone()]).is_ok());
    assert!(check_data_parallel(&placed, &[]).is_ok());
}

fn colocate_rule_changes_nothing_on_one_device<B: Backend>(device: &B::Device) {
    let (reference, model) = twins(stack::<B>(device), stack::<Accelerated<B>>(device), device);
    let x = normal_input::<B, 2>([3, 4], device);
    let want = reference.forward(x.clone());
    let got = {
        let _colocate = placement::scope_colocate_inputs(true);
        model.forward(Tensor::from_data(x.into_data(), device))
    };
    assert!(rel_err(got.into_data(), want.into_data()) <= 1e-6);
}

fn map_errors_say_what_to_change<B: Backend>(device: &B::Device) {
    let key = DeviceKey::of(device);
    let label = format!("{device:?}");
    let model = stack::<B>(device);
    let devices = [device.clone()];

    let stranger = DeviceKey::new(9, 9);
    let err = DeviceMap::single(stranger)
        .placement(&model, &devices)
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::UnknownDevice {
            prefix: String::new(),
            key: stranger,
            known: format!("{key} {label}"),
        }
    );
    assert!(err.to_string().contains("use one of those keys"), "{err}");

    let err = DeviceMap::single(key)
        .with("blocks.7", key)
        .placement(&model, &devices)
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::UnmatchedEntry {
            prefix: "blocks.7".into(),
            example: "embed.weight".into()
        }
    );
    assert!(err.to_string().contains("fix the path"), "{err}");

    let err = DeviceMap::new()
        .with("embed", key)
        .with("blocks", key)
        .placement(&model, &devices)
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::Unplaced {
            paths: vec!["head.weight".into(), "head.bias".into()]
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("head.weight, head.bias")
            && message.contains("(e.g. \"head\")")
            && message.contains("catch-all"),
        "{message}"
    );

    let by_module = DeviceMap::new()
        .with("embed", key)
        .with("blocks", key)
        .with("head", key);
    let err = by_module
        .placement_within(&model, &[(device.clone(), 1000)])
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::OverBudget {
            key,
            label: label.clone(),
            needed: STACK_BYTES,
            budget: 1000,
            over: STACK_BYTES - 1000,
            largest: "\"blocks\" (1152), \"embed\" (160), \"head\" (72)".into(),
        }
    );
    assert!(err.to_string().contains("raise its budget"), "{err}");

    let twice = [(device.clone(), 1 << 20), (device.clone(), 1 << 20)];
    let duplicate = PlacementError::DuplicateDevice {
        key,
        label: label.clone(),
    };
    assert_eq!(
        by_module.placement_within(&model, &twice).unwrap_err(),
        duplicate
    );
    assert_eq!(
        infer_device_map(&model, &twice, &[]).unwrap_err(),
        duplicate
    );
    assert_eq!(
        infer_device_map(&model, &[], &[]).unwrap_err(),
        PlacementError::NoDevices
    );
    assert_eq!(
        infer_device_map(&model, &[(device.clone(), 1 << 20)], &["Blok"]).unwrap_err(),
        PlacementError::UnknownNoSplit {
            entry: "Blok".into(),
            example: "embed".into()
        }
    );

    // 1000 bytes: embed (160), blocks.0 (576), blocks.1.fc1.weight (256) fit; the bias not.
    let err = infer_device_map(&model, &[(device.clone(), 1000)], &[]).unwrap_err();
    assert_eq!(
        err,
        PlacementError::DoesNotFit {
            path: "blocks.1.fc1.bias".into(),
            bytes: 32,
            kept_whole: true,
            no_split: false,
            from: key,
            left: format!("{key}: 8"),
        }
    );
    let err = infer_device_map(&model, &[(device.clone(), 1000)], &["Block"]).unwrap_err();
    assert_eq!(
        err,
        PlacementError::DoesNotFit {
            path: "blocks.1".into(),
            bytes: 576,
            kept_whole: true,
            no_split: true,
            from: key,
            left: format!("{key}: 264"),
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("\"blocks.1\" needs 576 bytes kept whole")
            && message.contains("raise a budget, add a device, or take it out of no_split"),
        "{message}"
    );

    // The crate-wide error wraps it unchanged.
    let wrapped = AccelerateError::from(err.clone());
    assert_eq!(wrapped, AccelerateError::Placement(err.clone()));
    assert_eq!(wrapped.to_string(), err.to_string());

    // Nothing above created a parameter.
    assert!(!model.embed.weight.is_initialized());
}

macro_rules! single_device_suite {
    ($name:ident, $backend:ty, $device:expr) => {
        mod $name {
            type B = $backend;

            #[test]
            fn report_is_exact() {
                super::report_is_exact::<B>(&$device);
            }

            #[test]
            fn display_is_a_table() {
                super::display_is_a_table::<B>(&$device);
            }

            #[test]
            fn lazy_parameters_are_reported_without_being_created() {
                super::lazy_parameters_are_reported_without_being_created::<B>(&$device);
            }

            #[test]
            fn verify_device_map_is_false_on_one_device() {
                super::verify_device_map_is_false_on_one_device::<B>(&$device);
            }

            #[test]
            fn infer_and_apply_on_one_device() {
                super::infer_and_apply_on_one_device::<B>(&$device);
            }

            #[test]
            fn colocate_rule_changes_nothing_on_one_device() {
                super::colocate_rule_changes_nothing_on_one_device::<B>(&$device);
            }

            #[test]
            fn map_errors_say_what_to_change() {
                super::map_errors_say_what_to_change::<B>(&$device);
            }
        }
    };
}

#[cfg(feature = "flex")]
single_device_suite!(flex, burn::backend::Flex, Default::default());

#[cfg(feature = "ndarray")]
single_device_suite!(ndarray, burn::backend::NdArray, Default::default());
