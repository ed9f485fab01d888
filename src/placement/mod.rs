//! Placing a model over several devices: where its parameters live, device maps under memory
//! budgets, and the checks a training strategy needs.
//!
//! What Accelerate's big-model inference (`device_map`, `infer_auto_device_map`,
//! `verify_device_map`) does for PyTorch, for Burn modules:
//!
//! - [`report`]: every parameter's path (the names Burn's `ModuleVisitor` gives), device,
//!   dtype, shape and bytes, with totals per device; `Display` prints a table.
//! - [`verify_device_map`]: whether the parameters live on more than one device.
//! - [`DeviceMap`]: module path prefix → device, serialisable, checked against a module with
//!   [`DeviceMap::placement`] (or [`DeviceMap::placement_within`] byte budgets) and applied
//!   with [`Placement::apply`]; [`infer_device_map`] fills devices in module order under
//!   budgets, keeping `no_split` submodules whole.
//! - Running a placed model: Burn has no forward hooks, so activations are brought to the
//!   next submodule's device either in `forward` with [`to_device_of`], or with no change to
//!   `forward` by `Accelerated<B>`'s opt-in [co-locate rule](crate::Context::with_colocate_inputs).
//! - [`check_data_parallel`]: a spread model cannot be trained data-parallel; the error names
//!   its devices and a few parameters on each.
//!
//! # Naming devices
//!
//! A map names devices by [`DeviceKey`], Burn's own `DeviceId` written `"<type>:<index>"`
//! (`WgpuDevice::Cpu` is `"3:0"`, `WgpuDevice::DefaultDevice` `"4:0"`). A key resolves only
//! to a device the caller hands over, so an unknown key is an error, not a silent fallback.
//!
//! # What moving costs
//!
//! Placing a model moves each parameter once ([`Placement::apply`]). Running it moves
//! activations every time they cross to the next device: one device-to-device copy where the
//! backend has one, otherwise (Burn 0.21's wgpu, and every cubecl runtime but CUDA) a read
//! back to the host, which waits for the source device to finish, and an upload
//! ([`DeviceMoves`]). Inference crosses once per device boundary, so [`infer_device_map`]
//! fills devices in module order. Under autodiff a staged move is a recorded op of its own
//! (its gradient goes back through the host too), so a placed model trains under
//! `Accelerated<Autodiff<B>>` for the autodiff backends the crate knows; register others
//! with [`register_tracked_moves`]. Burn's bare `Autodiff<Wgpu>` takes wgpu's own move, which
//! leaves the copy unwritten.
//!
//! ```
//! # #[cfg(feature = "flex")] {
//! use burn::backend::Flex;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Tensor, backend::Backend};
//! use burn_accelerate::placement::{self, to_device_of};
//!
//! #[derive(Module, Debug)]
//! struct Net<B: Backend> {
//!     fc1: Linear<B>,
//!     fc2: Linear<B>,
//! }
//!
//! impl<B: Backend> Net<B> {
//!     fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
//!         let h = self.fc1.forward(to_device_of(x, &self.fc1));
//!         self.fc2.forward(to_device_of(h, &self.fc2))
//!     }
//! }
//!
//! let device = Default::default(); // with two devices, give each a budget
//! let net = Net::<Flex> {
//!     fc1: LinearConfig::new(4, 8).init(&device),
//!     fc2: LinearConfig::new(8, 2).init(&device),
//! };
//! let budgets = [(device, 1 << 20)];
//! let map = placement::infer_device_map(&net, &budgets, &[])?;
//! let net = map.placement_within(&net, &budgets)?.apply(net);
//! let y = net.forward(Tensor::ones([3, 4], &device));
//! println!("{}", placement::report(&net));
//! # }
//! # Ok::<(), burn_accelerate::placement::PlacementError>(())
//! ```

mod error;
mod infer;
mod key;
mod map;
mod moves;
mod report;
mod strategy;
pub(crate) mod walk;

pub use crate::backend::tracked_move::register as register_tracked_moves;
pub use crate::device_moves::{
    DeviceMoves, colocate_inputs, device_moves, scope_colocate_inputs, scope_device_moves,
    stages_through_host,
};
pub use error::PlacementError;
pub use infer::infer_device_map;
pub use key::DeviceKey;
pub use map::{DeviceMap, Placement};
pub use moves::{device_of, fork, move_tensor, to_device_of};
pub use report::{
    DeviceTotal, ParamPlacement, PlacementReport, human_bytes, report, verify_device_map,
};
pub use strategy::check_data_parallel;
pub use walk::ParamKind;
