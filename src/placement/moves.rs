//! Moving tensors between devices: the policy, and the helper a placed model's `forward` uses.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Bool, Int, Tensor, TensorKind};

use crate::device_moves::stages_through_host;

/// `tensor` on `device`, moved the way [`DeviceMoves`](crate::placement::DeviceMoves) says.
///
/// A float tensor on an autodiff backend always takes the backend's own move, which records
/// the step that brings its gradient back; a plain trip through the host would silently cut
/// the graph. Under `Accelerated<Autodiff<B>>` that move is the decorator's, which stages it
/// through the host as a recorded op where `B` has no device-to-device copy (Burn 0.21's
/// wgpu), so a model placed over two wgpu devices trains; on a bare `Autodiff<Wgpu>`, Burn's
/// own move leaves the copy unwritten.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::tensor::Tensor;
/// use burn_accelerate::placement;
///
/// let device = Default::default();
/// let x = Tensor::<Flex, 1>::from_floats([1.0, 2.0], &device);
/// let y = placement::move_tensor(x.clone(), &device);
/// y.into_data().assert_eq(&x.into_data(), true);
/// # }
/// ```
pub fn move_tensor<B: Backend, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    K: TensorKind<B> + BasicOps<B>,
{
    if tensor.device() == *device {
        return tensor;
    }
    let tracked = tensor.dtype().is_float() && B::ad_enabled(device);
    if !tracked && stages_through_host::<B>(device) {
        staged(tensor, device)
    } else {
        tensor.to_device(device)
    }
}

/// `tensor` rebuilt on `device` from a host copy, keeping its dtype.
pub(crate) fn staged<B: Backend, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    K: TensorKind<B> + BasicOps<B>,
{
    let dtype = tensor.dtype();
    Tensor::from_data(tensor.into_data(), (device, dtype))
}

/// The device holding `module`'s first parameter; `None` for a module without parameters.
///
/// Lazy parameters are not created: their device is the one they will be created on.
pub fn device_of<B: Backend, M: Module<B>>(module: &M) -> Option<B::Device> {
    let mut first = FirstDevice::<B> { device: None };
    module.visit(&mut first);
    first.device
}

/// `tensor` moved to the device of `module`'s first parameter, for the `forward` of a model
/// whose submodules live on different devices (Burn has no forward hooks to do it for you).
///
/// A module without parameters leaves the tensor where it is. The move is [`move_tensor`]'s:
/// free when the tensor is already there, otherwise one device-to-device copy, or a read back
/// to the host (waiting for the source device) and an upload where the backend has no direct
/// copy. Costs also a walk over `module`'s parameters to find its device: call it on the
/// submodule about to run, not on the whole model.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Tensor, backend::Backend};
/// use burn_accelerate::placement::to_device_of;
///
/// struct TwoStage<B: Backend> {
///     first: Linear<B>,
///     second: Linear<B>,
/// }
///
/// impl<B: Backend> TwoStage<B> {
///     fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
///         let h = self.first.forward(to_device_of(x, &self.first));
///         self.second.forward(to_device_of(h, &self.second))
///     }
/// }
///
/// let device = Default::default();
/// let model = TwoStage::<Flex> {
///     first: LinearConfig::new(4, 8).init(&device),
///     second: LinearConfig::new(8, 2).init(&device),
/// };
/// assert_eq!(model.forward(Tensor::ones([3, 4], &device)).dims(), [3, 2]);
/// # }
/// ```
pub fn to_device_of<B: Backend, const D: usize, K, M: Module<B>>(
    tensor: Tensor<B, D, K>,
    module: &M,
) -> Tensor<B, D, K>
where
    K: TensorKind<B> + BasicOps<B>,
{
    match device_of(module) {
        Some(device) => move_tensor(tensor, &device),
        None => tensor,
    }
}

struct FirstDevice<B: Backend> {
    device: Option<B::Device>,
}

impl<B: Backend> ModuleVisitor<B> for FirstDevice<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.device.is_none() {
            self.device = Some(param.lazy_device());
        }
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
        if self.device.is_none() {
            self.device = Some(param.lazy_device());
        }
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
        if self.device.is_none() {
            self.device = Some(param.lazy_device());
        }
    }
}

/// `module` copied onto `device` as Burn's `Module::fork` does (every float parameter a fresh
/// autodiff leaf keeping its `require_grad`), with the copies staged through the host where
/// the backend has no device-to-device copy (see [`DeviceMoves`](crate::placement::DeviceMoves)).
///
/// Burn 0.21's own `fork` moves parameters with the backend's `to_device`, which on wgpu goes
/// through cubecl's collective copy; wgpu's server has none, so the copy fails on the device's
/// own thread and the caller gets a tensor whose contents were never written. A fork detaches
/// every parameter anyway, so going through the host cuts no graph.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::{Autodiff, Flex};
/// use burn::nn::LinearConfig;
/// use burn_accelerate::placement;
///
/// let device = Default::default();
/// let layer = LinearConfig::new(4, 2).init::<Autodiff<Flex>>(&device);
/// // Burn creates parameters lazily, and a clone of one never read draws its own values:
/// // read the original before comparing.
/// let weight = layer.weight.val();
/// let copy = placement::fork(layer, &device);
/// assert_eq!(copy.weight.val().into_data(), weight.into_data());
/// assert!(copy.weight.val().is_require_grad());
/// # }
/// ```
pub fn fork<B: Backend, M: Module<B>>(module: M, device: &B::Device) -> M {
    module.map(&mut Fork { device })
}

struct Fork<'a, B: Backend> {
    device: &'a B::Device,
}

impl<B: Backend> ModuleMapper<B> for Fork<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            relocate(tensor, self.device)
                .detach()
                .set_require_grad(require_grad)
        })
    }

    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        param.map(|tensor| relocate(tensor, self.device))
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        param.map(|tensor| relocate(tensor, self.device))
    }
}

/// `tensor` on `device`: staged or direct per the move policy. For parameters, which are
/// leaves: staging them cuts no graph even under autodiff.
pub(crate) fn relocate<B: Backend, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    K: TensorKind<B> + BasicOps<B>,
{
    if tensor.device() == *device {
        tensor
    } else if stages_through_host::<B>(device) {
        staged(tensor, device)
    } else {
        tensor.to_device(device)
    }
}
