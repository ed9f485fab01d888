//! Placement over two real devices: `WgpuDevice::Cpu` and `WgpuDevice::DefaultDevice` are
//! distinct Burn devices on lavapipe (Mesa's CPU Vulkan driver). Burn 0.21 has no
//! device-to-device copy between them, so every move here goes through the host.
#![cfg(feature = "wgpu")]

mod suite;

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_accelerate::Accelerated;
use burn_accelerate::placement::{
    self, DeviceKey, DeviceMap, PlacementError, check_data_parallel, device_of, infer_device_map,
    verify_device_map,
};
use suite::models::Stack;
use suite::{normal_input, rel_err, twins};

const CPU: WgpuDevice = WgpuDevice::Cpu;
const GPU: WgpuDevice = WgpuDevice::DefaultDevice;
const A: DeviceKey = DeviceKey::new(3, 0);
const B: DeviceKey = DeviceKey::new(4, 0);

/// `Stack::new(4, 8, 2, 3)` on the default device: embed 160 bytes, blocks of 576, head 72.
fn stack<Be: burn::tensor::backend::Backend<Device = WgpuDevice>>() -> Stack<Be> {
    Stack::new(4, 8, 2, 3, &GPU)
}

/// 1100 bytes on the Cpu device: embed, blocks.0 and (when it may be split) blocks.1.fc1.
fn budgets() -> [(WgpuDevice, u64); 2] {
    [(CPU, 1100), (GPU, 4096)]
}

fn entries(map: &DeviceMap) -> Vec<(&str, DeviceKey)> {
    map.entries().collect()
}

fn placed_map() -> DeviceMap {
    infer_device_map(&stack::<Wgpu>(), &budgets(), &["Block"]).unwrap()
}

#[test]
fn keys_are_burns_device_ids() {
    assert_eq!(DeviceKey::of(&CPU), A);
    assert_eq!(DeviceKey::of(&GPU), B);
}

#[test]
fn infer_fills_devices_in_order_under_budgets_and_keeps_no_split_whole() {
    let model = stack::<Wgpu>();

    let split = infer_device_map(&model, &budgets(), &[]).unwrap();
    assert_eq!(
        entries(&split),
        vec![
            ("embed", A),
            ("blocks.0", A),
            ("blocks.1.fc1", A),
            ("blocks.1.fc2", B),
            ("blocks.2", B),
            ("head", B),
        ]
    );
    let totals = split.placement_within(&model, &budgets()).unwrap();
    let bytes: Vec<(DeviceKey, u64)> = totals
        .totals()
        .iter()
        .map(|t| (t.device, t.bytes))
        .collect();
    assert_eq!(bytes, vec![(A, 160 + 576 + 288), (B, 288 + 576 + 72)]);

    for no_split in [&["Block"][..], &["blocks.1"][..]] {
        let whole = infer_device_map(&model, &budgets(), no_split).unwrap();
        assert_eq!(
            entries(&whole),
            vec![
                ("embed", A),
                ("blocks.0", A),
                ("blocks.1", B),
                ("blocks.2", B),
                ("head", B)
            ],
            "{no_split:?}"
        );
        let totals = whole.placement_within(&model, &budgets()).unwrap();
        let bytes: Vec<u64> = totals.totals().iter().map(|t| t.bytes).collect();
        assert_eq!(bytes, vec![160 + 576, 2 * 576 + 72]);
    }

    // Planning allocated nothing.
    assert!(!model.embed.weight.is_initialized());
    assert!(!model.blocks[2].fc2.weight.is_initialized());
}

#[test]
fn applied_map_moves_parameters_and_the_report_shows_it() {
    let model = stack::<Wgpu>();
    assert!(!verify_device_map(&model));
    let placement = placed_map().placement(&model, &[CPU, GPU]).unwrap();
    let placed = placement.apply(model);

    assert!(verify_device_map(&placed));
    let report = placement::report(&placed);
    for p in &report.params {
        let want = if p.path.starts_with("embed") || p.path.starts_with("blocks.0") {
            A
        } else {
            B
        };
        assert_eq!(p.device, want, "{}", p.path);
        assert_eq!(p.dtype, DType::F32, "{}", p.path);
        assert!(p.initialized, "{}", p.path);
    }
    let totals: Vec<(DeviceKey, &str, usize, u64)> = report
        .devices
        .iter()
        .map(|d| (d.device, d.label.as_str(), d.params, d.bytes))
        .collect();
    assert_eq!(
        totals,
        vec![(A, "Cpu", 6, 736), (B, "DefaultDevice", 10, 1224)]
    );
    let table = report.to_string();
    let tail = "\
device             params  bytes
3:0 Cpu                 6    736  (736 B)
4:0 DefaultDevice      10   1224  (1.2 KiB)
total                  16   1960  (1.9 KiB)
";
    assert!(table.ends_with(tail), "{table}");
    assert!(
        table.contains("blocks.1.fc1.weight  4:0 DefaultDevice  f32    [8, 8]    256"),
        "{table}"
    );

    assert_eq!(device_of(&placed.embed), Some(CPU));
    assert_eq!(device_of(&placed.blocks[1]), Some(GPU));
}

#[test]
fn placed_forward_equals_unplaced() {
    let reference = stack::<Wgpu>();
    let x = normal_input::<Wgpu, 2>([3, 4], &CPU);
    let want = reference
        .forward(Tensor::from_data(x.to_data(), &GPU))
        .into_data();

    // The helper, on plain wgpu: `to_device_of` stages each move through the host.
    let map = placed_map();
    let placed = map
        .placement(&reference, &[CPU, GPU])
        .unwrap()
        .apply(reference.clone());
    let got = placed.forward_placed(x.clone());
    assert_eq!(got.device(), GPU);
    let err = rel_err(got.into_data(), want.clone());
    assert!(err <= 1e-5, "helper: {err}");

    // The decorator's co-locate rule: the unchanged `forward` runs placed.
    let (_, accelerated) = twins(reference, stack::<Accelerated<Wgpu>>(), &GPU);
    let accelerated = map
        .placement(&accelerated, &[CPU, GPU])
        .unwrap()
        .apply(accelerated);
    assert!(verify_device_map(&accelerated));
    let _colocate = placement::scope_colocate_inputs(true);
    let got = accelerated.forward(Tensor::from_data(x.into_data(), &CPU));
    assert_eq!(got.device(), GPU);
    let err = rel_err(got.into_data(), want);
    assert!(err <= 1e-5, "co-locate: {err}");
}

#[test]
fn decorator_stages_moves_through_the_host() {
    type Acc = Accelerated<Wgpu>;
    let floats = TensorData::from([[1.5f32, -2.0], [0.25, 8.0]]);
    let x = Tensor::<Acc, 2>::from_data(floats.clone(), &CPU);
    let moved = x.to_device(&GPU);
    assert_eq!(moved.device(), GPU);
    moved.to_data().assert_eq(&floats, true);
    let back = moved.to_device(&CPU);
    assert_eq!(back.device(), CPU);
    back.into_data().assert_eq(&floats, true);

    let half = Tensor::<Acc, 2>::from_data(floats.clone(), &CPU).cast(DType::F16);
    let moved = half.to_device(&GPU);
    assert_eq!((moved.device(), moved.dtype()), (GPU, DType::F16));
    moved
        .into_data()
        .assert_eq(&floats.clone().convert_dtype(DType::F16), true);

    let ints = Tensor::<Acc, 1, Int>::from_ints([3, -1, 7], &CPU).to_device(&GPU);
    assert_eq!(ints.device(), GPU);
    assert_eq!(ints.into_data().to_vec::<i32>().unwrap(), vec![3, -1, 7]);

    let bools = Tensor::<Acc, 1, Bool>::from_bool(TensorData::from([true, false, true]), &CPU)
        .to_device(&GPU);
    assert_eq!(bools.device(), GPU);
    // wgpu stores bools as u32: read them back through ints.
    assert_eq!(
        bools.int().into_data().to_vec::<i32>().unwrap(),
        vec![1, 0, 1]
    );
}

#[test]
fn data_parallel_over_a_spread_model_is_refused() {
    let model = stack::<Wgpu>();
    assert!(check_data_parallel(&model, &[CPU, GPU]).is_ok()); // whole on one device
    let placed = placed_map()
        .placement(&model, &[CPU, GPU])
        .unwrap()
        .apply(model);
    assert!(check_data_parallel(&placed, &[GPU]).is_ok()); // one device: not data-parallel

    let err = check_data_parallel(&placed, &[CPU, GPU]).unwrap_err();
    assert_eq!(
        err,
        PlacementError::SpreadForDataParallel {
            devices: vec![
                "3:0 Cpu: embed.weight, embed.bias, blocks.0.fc1.weight, …".into(),
                "4:0 DefaultDevice: blocks.1.fc1.weight, blocks.1.fc1.bias, blocks.1.fc2.weight, …"
                    .into(),
            ],
            workers: "2 devices (3:0 Cpu, 4:0 DefaultDevice)".into(),
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("live on 2 devices")
            && message.contains("data-parallel over 2 devices")
            && message.contains("DeviceMap::single"),
        "{message}"
    );

    // Gathering it on one device makes it acceptable again.
    let gathered = DeviceMap::single(B)
        .placement(&placed, &[CPU, GPU])
        .unwrap()
        .apply(placed);
    assert!(!verify_device_map(&gathered));
    assert!(check_data_parallel(&gathered, &[CPU, GPU]).is_ok());
}

#[test]
fn map_errors_on_two_devices() {
    let model = stack::<Wgpu>();

    let err = DeviceMap::single(A)
        .placement_within(&model, &[(CPU, 1000), (GPU, 4096)])
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::OverBudget {
            key: A,
            label: "Cpu".into(),
            needed: 1960,
            budget: 1000,
            over: 960,
            largest: "\"\" (1960)".into(),
        }
    );

    let discrete = DeviceKey::of(&WgpuDevice::DiscreteGpu(0));
    let err = DeviceMap::single(A)
        .with("head", discrete)
        .placement(&model, &[CPU, GPU])
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::UnknownDevice {
            prefix: "head".into(),
            key: discrete,
            known: "3:0 Cpu, 4:0 DefaultDevice".into(),
        }
    );

    let err = DeviceMap::new()
        .with("embed", A)
        .with("blocks", B)
        .placement(&model, &[CPU, GPU])
        .unwrap_err();
    assert_eq!(
        err,
        PlacementError::Unplaced {
            paths: vec!["head.weight".into(), "head.bias".into()]
        }
    );

    // blocks.0 (576, whole) fits neither what is left of the Cpu budget nor the other one.
    let err = infer_device_map(&model, &[(CPU, 500), (GPU, 500)], &["Block"]).unwrap_err();
    assert_eq!(
        err,
        PlacementError::DoesNotFit {
            path: "blocks.0".into(),
            bytes: 576,
            kept_whole: true,
            no_split: true,
            from: A,
            left: "3:0: 340, 4:0: 500".into(),
        }
    );
    assert!(!model.embed.weight.is_initialized());
}

#[test]
fn serialised_map_places_the_same() {
    let map = placed_map();
    let json = serde_json::to_string(&map).unwrap();
    assert_eq!(
        json,
        r#"{"embed":"3:0","blocks.0":"3:0","blocks.1":"4:0","blocks.2":"4:0","head":"4:0"}"#
    );
    let back: DeviceMap = serde_json::from_str(&json).unwrap();
    assert_eq!(back, map);
}

#[test]
fn autodiff_model_places_with_fresh_trainable_leaves() {
    let model = stack::<Autodiff<Wgpu>>();
    let placed = placed_map()
        .placement(&model, &[CPU, GPU])
        .unwrap()
        .apply(model);
    assert!(verify_device_map(&placed));
    assert_eq!(placed.embed.weight.val().device(), CPU);
    assert!(placed.embed.weight.val().is_require_grad());
    assert!(placed.head.weight.val().is_require_grad());
    assert!(check_data_parallel(&placed, &[CPU, GPU]).is_err());
}

// A model placed over two devices trains under autodiff: `Accelerated<Autodiff<B>>` stages
// each move through the host as a recorded op, so every gradient comes back on its
// parameter's device and equals the one of the same model on one device.
#[test]
fn a_placed_model_backpropagates_through_staged_moves() {
    type Train = Accelerated<Autodiff<Wgpu>>;
    let (reference, placed) = twins(stack::<Autodiff<Wgpu>>(), stack::<Train>(), &GPU);
    let placed = placed_map()
        .placement(&placed, &[CPU, GPU])
        .unwrap()
        .apply(placed);
    assert_eq!(placed.embed.weight.val().device(), CPU);
    assert_eq!(placed.head.weight.val().device(), GPU);
    let x = normal_input::<Wgpu, 2>([3, 4], &CPU).into_data();

    let want = reference
        .forward(Tensor::from_data(x.clone(), &GPU))
        .powi_scalar(2)
        .mean()
        .backward();
    let got = placed
        .forward_placed(Tensor::from_data(x, &CPU))
        .powi_scalar(2)
        .mean()
        .backward();

    let pairs = [
        (
            "embed.weight",
            placed.embed.weight.grad(&got),
            reference.embed.weight.grad(&want),
        ),
        (
            "blocks.0.fc1.weight",
            placed.blocks[0].fc1.weight.grad(&got),
            reference.blocks[0].fc1.weight.grad(&want),
        ),
        (
            "blocks.1.fc2.weight",
            placed.blocks[1].fc2.weight.grad(&got),
            reference.blocks[1].fc2.weight.grad(&want),
        ),
        (
            "head.weight",
            placed.head.weight.grad(&got),
            reference.head.weight.grad(&want),
        ),
    ];
    let devices = [CPU, CPU, GPU, GPU];
    for ((name, got, want), device) in pairs.into_iter().zip(devices) {
        let (got, want) = (got.expect(name), want.expect(name));
        assert_eq!(got.device(), device, "{name}");
        let err = rel_err(got.into_data(), want.into_data());
        assert!(err <= 1e-5, "{name}: relative error {err}");
    }
    let bias = placed.embed.bias.as_ref().unwrap().grad(&got).unwrap();
    let want_bias = reference.embed.bias.as_ref().unwrap().grad(&want).unwrap();
    assert_eq!(bias.device(), CPU);
    assert!(rel_err(bias.into_data(), want_bias.into_data()) <= 1e-5);
}
