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

use burn::backend::Wgpu;
use burn::backend::wgpu::WgpuDevice;
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

fn main() -> Result<(), AccelerateError> {
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
    placement::set_colocate_inputs(true);

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
