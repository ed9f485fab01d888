//! The fp8 cast's backward: a straight-through node on Burn's autodiff backend, reached from
//! the backend-generic decorator through a registry of hooks.
//!
//! `Accelerated<B>` only knows `B: Backend`, and a custom backward node can only be built
//! with the concrete `Autodiff<B, C>` in hand. Rust has no specialization, so the decorator
//! looks up, by `TypeId`, a function registered for its inner backend by code that did have
//! the concrete type: [`register`] (bounded by [`Fp8Differentiable`]), called for Burn's own
//! autodiff backends automatically. The lookup happens only under fp8 autocast; the bound is
//! added nowhere else, so `Accelerated<B>` stays a decorator for every `B: Backend`.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, get_device_settings};

use super::cast::{Fp8Cast, Quantizer};
use crate::Accelerated;
use crate::hooks::{self, HookKind};

/// A backend whose autodiff graph an fp8 cast can add its own node to: the forward pass
/// rounds, the backward pass passes the gradient straight through (E4M3) or rounds it to E5M2
/// (HYBRID).
///
/// Implemented for `Autodiff<B, C>` and for `Accelerated<B>` over such a backend. Autocast
/// finds it through [`register`]; Burn's autodiff over the backends this crate has features
/// for (`Autodiff<Flex>`, `Autodiff<NdArray>`, `Autodiff<Wgpu>`, `Autodiff<Cuda>`,
/// `Autodiff<LibTorch>`, default checkpointing) is registered without asking.
pub trait Fp8Differentiable: Backend {
    /// Applies `cast` to `tensor`: the forward quantizer now, the backward one (if any) to
    /// the gradient when the graph is differentiated.
    fn fp8_cast(tensor: FloatTensor<Self>, cast: Fp8Cast) -> FloatTensor<Self>;

    /// Makes [`fp8_cast`](Self::fp8_cast) the cast autocast uses for this backend.
    fn register_fp8() {
        insert::<Self>();
    }
}

impl<B: Backend, C: CheckpointStrategy> Fp8Differentiable for Autodiff<B, C> {
    fn fp8_cast(tensor: FloatTensor<Self>, cast: Fp8Cast) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Fp8Qdq;

        impl<B: Backend> Backward<B, 1> for Fp8Qdq {
            type State = Option<Quantizer>;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let backward = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |grad| match backward {
                    Some(quantizer) => quantizer.apply::<B>(grad),
                    None => grad,
                });
            }
        }

        let node = tensor.node.clone();
        // Rounded on the inner backend: nothing of the rounding itself is recorded.
        let output = cast.forward.apply::<B>(tensor.primitive);
        match Fp8Qdq.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(cast.backward, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

impl<B: Fp8Differentiable> Fp8Differentiable for Accelerated<B> {
    fn fp8_cast(tensor: FloatTensor<Self>, cast: Fp8Cast) -> FloatTensor<Self> {
        B::fp8_cast(tensor, cast)
    }

    // The decorator looks up its inner backend; `AutocastConfig::init` looks up the type it
    // was given, which is usually the decorator.
    fn register_fp8() {
        B::register_fp8();
        insert::<Self>();
    }
}

/// Lets autocast give fp8 casts on `B` their own backward node.
///
/// Needed only for an autodiff backend this crate does not register itself, such as
/// `Autodiff<Flex, BalancedCheckpointing>`; without it, fp8 on such a backend falls back to
/// a straight-through estimate built from `B`'s own ops, which cannot round gradients (so
/// HYBRID acts as E4M3) and is logged once.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
/// use burn::backend::{Autodiff, Flex};
/// use burn_accelerate::{Accelerated, fp8};
///
/// fp8::register::<Accelerated<Autodiff<Flex, BalancedCheckpointing>>>();
/// assert!(fp8::is_registered::<Accelerated<Autodiff<Flex, BalancedCheckpointing>>>());
/// # }
/// ```
pub fn register<B: Fp8Differentiable>() {
    B::register_fp8();
}

/// Whether `B` has a registered fp8 cast (Burn's autodiff backends over this crate's backend
/// features are registered on first use).
pub fn is_registered<B: Backend>() -> bool {
    hook::<B>().is_some()
}

/// Whether fp8 autocast on `B` would fall back to the straight-through estimate: `B` records
/// gradients on `device` and has no registered cast.
pub fn needs_registration<B: Backend>(device: &B::Device) -> bool {
    B::ad_enabled(device) && !is_registered::<B>()
}

type Hook<B> = fn(FloatTensor<B>, Fp8Cast) -> FloatTensor<B>;

// The hooks' kind in the crate's registry.
struct Fp8Casts;

impl HookKind for Fp8Casts {
    fn register_known() {
        register_known();
    }
}

fn insert<B: Fp8Differentiable>() {
    let hook: Hook<B> = B::fp8_cast;
    hooks::insert::<Fp8Casts, B, _>(hook);
}

fn hook<B: Backend>() -> Option<Hook<B>> {
    hooks::get::<Fp8Casts, B, Hook<B>>()
}

// Burn's own autodiff backends under the decorator, for every backend feature this crate was
// built with.
fn register_known() {
    struct Register;
    impl crate::hooks::ForEachBackend for Register {
        fn call<B: Backend>(&mut self) {
            register::<Accelerated<Autodiff<B>>>();
        }
    }
    crate::hooks::each_backend(&mut Register);
}

/// Applies an fp8 cast on any backend: through the registered node where there is one,
/// directly where `B` records no gradients, else as a straight-through estimate.
pub(crate) fn fp8_cast<B: Backend>(tensor: FloatTensor<B>, cast: Fp8Cast) -> FloatTensor<B> {
    if let Some(hook) = hook::<B>() {
        return hook(tensor, cast);
    }
    let device = B::float_device(&tensor);
    if !B::ad_enabled(&device) {
        return cast.forward.apply::<B>(tensor);
    }
    straight_through::<B>(tensor, cast, &device)
}

// `x + detach(q - x)`: the value of `q`, the gradient of `x`. The difference is exact while
// `q` is within a factor of two of `x` (Sterbenz), which rounding guarantees; saturated and
// infinite elements, where it is not, take `q` itself (and no gradient, as a clamp would give).
fn straight_through<B: Backend>(
    tensor: FloatTensor<B>,
    cast: Fp8Cast,
    device: &B::Device,
) -> FloatTensor<B> {
    crate::warnings::once("fp8 straight-through estimate", (), || {
        log::warn!(
            "burn-accelerate fp8: {} has no registered fp8 cast (see `fp8::register`): using a \
             straight-through estimate, which leaves gradients unrounded",
            B::name(device)
        )
    });
    let bools = get_device_settings::<B>(device).bool_dtype;
    let detached = B::float_detach(tensor.clone());
    let rounded = cast.forward.apply::<B>(detached.clone());
    let delta = B::float_sub(rounded.clone(), detached.clone());
    let estimate = B::float_add(tensor, delta);
    let limit = cast.forward.format.max_finite() / cast.forward.scale;
    let saturated = B::float_greater_equal_elem(B::float_abs(detached), limit.into(), bools);
    B::float_mask_where(estimate, saturated, rounded)
}
