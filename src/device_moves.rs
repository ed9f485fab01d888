//! How tensors cross devices and whether the decorator co-locates an op's inputs: two
//! settings of the thread's [`Context`], read by the decorator's `to_device` and its
//! forwarding (`backend::placement`) below the placement helpers that walk a model
//! ([`crate::placement`], which re-exports these).

use burn::tensor::backend::Backend;

use crate::context::{self, Context, ContextGuard, Setting, Slot};

/// How tensors cross from one device to another, in [`Placement::apply`](crate::placement::Placement),
/// [`move_tensor`](crate::placement::move_tensor) and the `Accelerated<B>` decorator's `to_device`.
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
    /// together with [`to_device_of`](crate::placement::to_device_of).
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
