//! Places a small multi-layer model over two devices under a byte budget, runs it, and prints
//! where every parameter ended up.
//!
//! The two devices are `WgpuDevice::Cpu` and `WgpuDevice::DefaultDevice`: on a machine with a
//! GPU they are the CPU adapter and the GPU; on lavapipe (Mesa's CPU Vulkan driver) they are
//! two distinct Burn devices on one CPU. Burn 0.21's wgpu has no device-to-device copy, so
//! every crossing goes through the host.
//!
//! ```text
//! cargo run --example placement --features wgpu
//! ```
//!
//! It needs a Vulkan driver with a CPU adapter: Mesa's lavapipe (Debian and Ubuntu:
//! `apt-get install mesa-vulkan-drivers`), beside a GPU's own driver if there is one. Without
//! one it says so and exits with status 1, before wgpu is asked for a device.

use std::process::ExitCode;

use burn::backend::Wgpu;
use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::cubecl::Runtime;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_accelerate::placement::{self, human_bytes};
use burn_accelerate::{AccelerateError, Accelerated};

#[derive(Module, Debug)]
struct Block<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

#[derive(Module, Debug)]
struct Net<B: Backend> {
    embed: Linear<B>,
    blocks: Vec<Block<B>>,
    head: Linear<B>,
}

impl<B: Backend> Net<B> {
    fn new(depth: usize, device: &B::Device) -> Self {
        let block = || Block {
            fc1: LinearConfig::new(32, 32).init(device),
            fc2: LinearConfig::new(32, 32).init(device),
            act: Relu::new(),
        };
        Net {
            embed: LinearConfig::new(16, 32).init(device),
            blocks: (0..depth).map(|_| block()).collect(),
            head: LinearConfig::new(32, 4).init(device),
        }
    }

    // An ordinary forward pass: with the co-locate rule on, `Accelerated<B>` moves each
    // layer's input to the layer's device. Without the decorator, wrap each input in
    // `placement::to_device_of(x, &layer)` instead.
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut h = self.embed.forward(x);
        for block in &self.blocks {
            h = block
                .act
                .forward(block.fc2.forward(block.act.forward(block.fc1.forward(h))));
        }
        self.head.forward(h)
    }
}

// The adapter kinds of cubecl's device ids (`WgpuRuntime::enumerate_devices`): 3 is a CPU
// adapter, 4 any adapter (what `WgpuDevice::DefaultDevice` picks from).
const CPU_ADAPTER: u16 = 3;
const ANY_ADAPTER: u16 = 4;

// Why this machine cannot run the example, if it cannot: wgpu's Vulkan instance (the graphics
// API Burn's `Wgpu` takes on Linux) lists no CPU adapter, so that cubecl would panic on the
// first tensor ("No CPU device found, adapters []"). Listing the adapters opens no device.
fn missing_driver() -> Option<String> {
    let api = AutoGraphicsApi::backend();
    let cpu = WgpuRuntime::enumerate_devices(CPU_ADAPTER, &api).len();
    if cpu > 0 {
        return None;
    }
    let any = WgpuRuntime::enumerate_devices(ANY_ADAPTER, &api).len();
    let found = match any {
        0 => format!("no {api:?} driver: wgpu finds no {api:?} adapter"),
        n => format!("{n} {api:?} adapter(s), none of them a CPU one"),
    };
    // Either variable, when set, is the only place the Vulkan loader looks for drivers.
    let overridden = ["VK_DRIVER_FILES", "VK_ICD_FILENAMES"]
        .into_iter()
        .filter_map(|var| {
            std::env::var(var)
                .ok()
                .map(|value| format!("{var}={value}"))
        })
        .map(|set| format!("\n\n({set} is set: the Vulkan loader looks only there.)"))
        .collect::<String>();
    Some(format!(
        "this example places a model over wgpu's CPU adapter and its default one, and this \
         machine has {found}.\nInstall Mesa's CPU Vulkan driver (lavapipe); on Debian or \
         Ubuntu:\n\n    apt-get install mesa-vulkan-drivers{overridden}"
    ))
}

fn main() -> ExitCode {
    if let Some(why) = missing_driver() {
        eprintln!("placement: {why}");
        return ExitCode::FAILURE;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("placement: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), AccelerateError> {
    type B = Accelerated<Wgpu>;
    let (first, second) = (WgpuDevice::Cpu, WgpuDevice::DefaultDevice);

    // Built lazily on the first device: nothing is allocated until placed.
    let net = Net::<B>::new(4, &first);
    let total = placement::report(&net).total_bytes();

    // The first device may hold only about half of the model.
    let budgets = [(first.clone(), total / 2), (second.clone(), total)];
    let map = placement::infer_device_map(&net, &budgets, &["Block"])?;
    println!("device map ({} of parameters):\n{map}", human_bytes(total));

    let net = map.placement_within(&net, &budgets)?.apply(net);
    let _colocate = placement::scope_colocate_inputs(true);

    let x = Tensor::<B, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &first);
    let y = net.forward(x);
    println!("output {:?} on {:?}\n", y.dims(), y.device());
    print!("{}", placement::report(&net));

    // A spread model cannot be trained data-parallel: say so before training starts.
    if let Err(err) = placement::check_data_parallel(&net, &[first, second]) {
        println!("\ndata-parallel training refused: {err}");
    }
    Ok(())
}
