//! Moving tensors between devices: the policy, and the helper a placed model's `forward` uses.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Bool, Int, Tensor, TensorKind};

use crate::context::{self, Context, ContextGuard, Setting, Slot};

/// How tensors cross from one device to another, in [`Placement::apply`](super::Placement),
/// [`move_tensor`] and the `Accelerated<B>` decorator's `to_device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum DeviceMoves {
    /// Through the host where the backend is known to lack a device-to-device copy, directly
    /// elsewhere. In cubecl 0.10 only the CUDA runtime has one (`SERVER_COMM_ENABLED`); on the
    /// others (wgpu with Vulkan, Metal or WebGPU, HIP, cubecl's CPU) Burn's direct move panics
    /// (measured on wgpu), so moves there are staged.
    #[default]
    Auto,
    /// Always the backend's own move.
    Direct,
    /// Always through the host when the devices differ: a read back to host memory (which
    /// waits for the source device) and an upload to the target device.
    HostStaged,
}

impl Setting for DeviceMoves {
    const SLOT: Slot = Slot::DeviceMoves;
    fn unset() -> Self {
        DeviceMoves::Auto
    }
}

// The co-locate rule's setting (see `Context::with_colocate_inputs`).
#[derive(Debug, Clone, Copy)]
struct ColocateInputs(bool);

impl Setting for ColocateInputs {
    const SLOT: Slot = Slot::ColocateInputs;
    fn unset() -> Self {
        ColocateInputs(false)
    }
}

/// Sets how tensors cross devices on this thread until the scope drops; other threads keep
/// theirs.
///
/// ```
/// use burn_accelerate::placement::{self, DeviceMoves};
///
/// {
///     let _staged = placement::scope_device_moves(DeviceMoves::HostStaged);
///     assert_eq!(placement::device_moves(), DeviceMoves::HostStaged);
///     assert_eq!(std::thread::spawn(placement::device_moves).join().unwrap(), DeviceMoves::Auto);
/// }
/// assert_eq!(placement::device_moves(), DeviceMoves::Auto);
/// ```
pub fn scope_device_moves(moves: DeviceMoves) -> ContextGuard {
    context::scope(moves)
}

impl Context {
    /// This context with tensors crossing devices as `moves` says.
    pub fn with_device_moves(self, moves: DeviceMoves) -> Context {
        self.with(moves)
    }

    /// This context with the decorator's co-locate rule on or off.
    ///
    /// With the rule on, an op of the autocast table (matmul, linear, conv, add, cat, …) whose
    /// tensor inputs arrive on different devices first moves them all to the device of its last
    /// float input: in Burn's ops that is the weight or bias of `linear`/`conv*` and the
    /// right-hand side of `matmul`, so activations follow the weights and a placed model runs
    /// with an unchanged `forward`. Ops outside the table are not covered; bring their inputs
    /// together with [`to_device_of`].
    ///
    /// Cost: off (the default), one read of the thread's context per table op that takes
    /// several tensors; on, a device comparison per tensor input, plus the moves themselves
    /// (each a read back to the host and an upload where the move is [staged](DeviceMoves)).
    /// Only `Accelerated<B>` can apply the rule: a plain backend never sees it.
    ///
    /// ```
    /// use burn_accelerate::{placement, Context};
    ///
    /// let _on = Context::current().with_colocate_inputs(true).enter();
    /// assert!(placement::colocate_inputs());
    /// ```
    pub fn with_colocate_inputs(self, enabled: bool) -> Context {
        self.with(ColocateInputs(enabled))
    }
}

/// How tensors cross devices now on this thread: its context's ([`scope_device_moves`],
/// [`Context::with_device_moves`]).
pub fn device_moves() -> DeviceMoves {
    context::get::<DeviceMoves>()
}

/// Whether a move onto `device` goes through the host under the current [`DeviceMoves`].
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn_accelerate::placement;
///
/// assert!(!placement::stages_through_host::<Flex>(&Default::default()));
/// # }
/// ```
pub fn stages_through_host<B: Backend>(device: &B::Device) -> bool {
    match device_moves() {
        DeviceMoves::Direct => false,
        DeviceMoves::HostStaged => true,
        // Only asked when the devices differ, so the name lookup is dwarfed by the move.
        DeviceMoves::Auto => {
            let name = B::name(device);
            name.contains("cubecl<") && !name.contains("cuda")
        }
    }
}

/// Turns the decorator's co-locate rule on or off for this thread until the scope drops;
/// other threads keep theirs (see [`Context::with_colocate_inputs`] for the rule).
///
/// ```
/// use burn_accelerate::placement;
///
/// {
///     let _on = placement::scope_colocate_inputs(true);
///     assert!(placement::colocate_inputs());
///     assert!(!std::thread::spawn(placement::colocate_inputs).join().unwrap());
/// }
/// assert!(!placement::colocate_inputs());
/// ```
pub fn scope_colocate_inputs(enabled: bool) -> ContextGuard {
    context::scope(ColocateInputs(enabled))
}

/// Whether the co-locate rule is on for this thread: its context's
/// ([`scope_colocate_inputs`], [`Context::with_colocate_inputs`]).
#[inline]
pub fn colocate_inputs() -> bool {
    context::get::<ColocateInputs>().0
}

/// `tensor` on `device`, moved the way [`DeviceMoves`] says.
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
/// the backend has no device-to-device copy (see [`DeviceMoves`]).
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
