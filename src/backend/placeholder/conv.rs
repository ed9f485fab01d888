//! ZeRO stage 3's bounded convolutions (Burn's `nn::conv`: `conv1d`, `conv2d`, `conv3d` and
//! the three transposed ones), where autocast is off and the operands share a dtype: the
//! weight (and a registered bias) are gathered for the forward op alone and dropped when it
//! returns; the backward node keeps their placeholders and gathers the weight again for the
//! input's gradient, the one gradient that reads its values.
//!
//! The node is Burn's own (`burn-autodiff`'s `Conv2DWithBias` and its kin): the same inner
//! ops in the same order (the input's gradient, the weight's, the bias's), so the op's values
//! and gradients are stage 2's bit for bit. The weight's and the bias's gradients are given the
//! placeholders: Burn's defaults of `conv*_weight_backward` and `conv*_bias_backward` read
//! only their shape, dtype and device (a grouped convolution's zeros of the weight's shape),
//! and Flex and NdArray keep those defaults.
//!
//! Under autocast (`autocast_dispatch`) the op's cast plan is decided once: parameters it
//! reads as they are take the path above on the cast input; f32 parameters it casts to
//! bf16/f16 are gathered in the half type (each process casts its slice with autocast's cast
//! and sends halves: the bits of the cast of the gathered value), for the same node on the half
//! operands with each parameter's gradient cast to f32 as its cast node's backward casts
//! it, or on `Autodiff<Flex>` for the crate's half convolution where autocast runs the op
//! there (`half_conv`: `conv2d`, and `conv1d` as a 2-D one). Under fp8, where the plan rounds
//! f32 operands and fp8's cast node is registered for the backend, the parameters are
//! gathered in f32 for the same node, the weight rounded by the op's own fp8 cast where it
//! is read (forward: its amax recorded; backward: the same scale, nothing recorded) and its
//! gradient rounded as the cast node's backward rounds it (`fp8`'s `linear` does the same).
//! With parameters of another dtype the op runs its own path, the parameters gathered whole.

use std::marker::PhantomData;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::ops::{ConvOptions, ConvTransposeOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, TensorMetadata};

use super::{
    Half, Shard, Weight, anchors, count_dropped, gather_in, resolve, resolve_opt, shard_of,
    to_param,
};
use crate::autocast::{CastInput, CastPlan, InputRounding, Op};
use crate::hooks::{self, HookKind};

/// One kind of convolution: its options, its forward op and the three gradients of Burn's
/// node, by the inner backend's ops.
pub(super) trait Convolution: Send + Sync + 'static {
    type Options: Clone + core::fmt::Debug + Send + Sync + 'static;

    /// The op autocast's table and plan know it by.
    const OP: Op;

    /// The options' groups (a grouped convolution's weight gradient starts from zeros of the
    /// weight's dtype).
    fn groups(options: &Self::Options) -> usize;

    /// The op's own path under autocast once its inputs are cast (`crate::backend::forward`'s:
    /// `lowered` where the crate has a half kernel for it, else `B`'s op).
    fn own<B: Backend>(
        plan: &CastPlan,
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
        options: Self::Options,
    ) -> FloatTensor<B>;

    /// The op on the crate's half convolution with the parameters gathered in `dtype`, where
    /// `own` would run it there (the inputs back otherwise): `x` cast, the parameters' anchors.
    #[allow(clippy::too_many_arguments)]
    fn on_half_kernel<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
        weight_shard: Arc<dyn Shard>,
        bias_shard: Option<Arc<dyn Shard>>,
        options: Self::Options,
        dtype: FloatDType,
    ) -> Result<FloatTensor<B>, ConvInputs<B, Self::Options>> {
        let _ = (weight_shard, bias_shard, dtype);
        Err((x, weight, bias, options))
    }

    fn forward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
        options: Self::Options,
    ) -> FloatTensor<B>;

    fn x_backward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        grad: FloatTensor<B>,
        options: Self::Options,
    ) -> FloatTensor<B>;

    fn weight_backward<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        grad: FloatTensor<B>,
        options: Self::Options,
    ) -> FloatTensor<B>;

    fn bias_backward<B: Backend>(
        x: FloatTensor<B>,
        bias: FloatTensor<B>,
        grad: FloatTensor<B>,
    ) -> FloatTensor<B>;
}

// A convolution (`transposed: false`) or a transposed one, whose input's gradient reads no
// input (Burn's `conv_transpose*_x_backward(weight, grad, options)`).
macro_rules! convolution {
    ($kind:ident, $options:ty, $forward:ident, $x:ident, $weight:ident, $bias:ident,
     transposed: false, own: $own:expr $(, kernel: $kernel:ident)?) => {
        convolution!(@impl $kind, $options, $forward, $weight, $bias, $own, [$($kernel)?],
            |x, weight, grad, options| $x(x, weight, grad, options));
    };
    ($kind:ident, $options:ty, $forward:ident, $x:ident, $weight:ident, $bias:ident,
     transposed: true, own: $own:expr) => {
        convolution!(@impl $kind, $options, $forward, $weight, $bias, $own, [],
            |_x, weight, grad, options| $x(weight, grad, options));
    };
    (@kernel []) => {};
    (@kernel [$kernel:ident]) => {
        fn on_half_kernel<B: Backend>(
            x: FloatTensor<B>,
            weight: FloatTensor<B>,
            bias: Option<FloatTensor<B>>,
            weight_shard: Arc<dyn Shard>,
            bias_shard: Option<Arc<dyn Shard>>,
            options: Self::Options,
            dtype: FloatDType,
        ) -> Result<FloatTensor<B>, ConvInputs<B, Self::Options>> {
            half_kernel::$kernel::<B>(x, weight, bias, weight_shard, bias_shard, options, dtype)
        }
    };
    (@impl $kind:ident, $options:ty, $forward:ident, $weight:ident, $bias:ident, $own:expr,
     [$($kernel:ident)?], |$xa:ident, $wa:ident, $ga:ident, $oa:ident| $x:ident($($arg:ident),*)) => {
        pub(super) struct $kind;

        impl Convolution for $kind {
            type Options = $options;

            const OP: Op = Op::$kind;

            fn groups(options: &Self::Options) -> usize {
                options.groups
            }

            fn own<B: Backend>(
                plan: &CastPlan,
                x: FloatTensor<B>,
                weight: FloatTensor<B>,
                bias: Option<FloatTensor<B>>,
                options: Self::Options,
            ) -> FloatTensor<B> {
                ($own)(plan, x, weight, bias, options)
            }

            convolution!(@kernel [$($kernel)?]);

            fn forward<B: Backend>(
                x: FloatTensor<B>,
                weight: FloatTensor<B>,
                bias: Option<FloatTensor<B>>,
                options: Self::Options,
            ) -> FloatTensor<B> {
                B::$forward(x, weight, bias, options)
            }

            fn x_backward<B: Backend>(
                $xa: FloatTensor<B>,
                $wa: FloatTensor<B>,
                $ga: FloatTensor<B>,
                $oa: Self::Options,
            ) -> FloatTensor<B> {
                B::$x($($arg),*)
            }

            fn weight_backward<B: Backend>(
                x: FloatTensor<B>,
                weight: FloatTensor<B>,
                grad: FloatTensor<B>,
                options: Self::Options,
            ) -> FloatTensor<B> {
                B::$weight(x, weight, grad, options)
            }

            fn bias_backward<B: Backend>(
                x: FloatTensor<B>,
                bias: FloatTensor<B>,
                grad: FloatTensor<B>,
            ) -> FloatTensor<B> {
                B::$bias(x, bias, grad)
            }
        }
    };
}

convolution!(Conv1d, ConvOptions<1>, conv1d, conv1d_x_backward,
    conv1d_weight_backward, conv1d_bias_backward, transposed: false,
    own: |plan: &CastPlan, x, w, b, o| crate::backend::lowered::conv1d::<B>(plan, x, w, b, o),
    kernel: conv1d);
convolution!(Conv2d, ConvOptions<2>, conv2d, conv2d_x_backward,
    conv2d_weight_backward, conv2d_bias_backward, transposed: false,
    own: |plan: &CastPlan, x, w, b, o| crate::backend::lowered::conv2d::<B>(plan, x, w, b, o),
    kernel: conv2d);
convolution!(Conv3d, ConvOptions<3>, conv3d, conv3d_x_backward,
    conv3d_weight_backward, conv3d_bias_backward, transposed: false,
    own: |_: &CastPlan, x, w, b, o| B::conv3d(x, w, b, o));
convolution!(ConvTranspose1d, ConvTransposeOptions<1>, conv_transpose1d,
    conv_transpose1d_x_backward, conv_transpose1d_weight_backward,
    conv_transpose1d_bias_backward, transposed: true,
    own: |_: &CastPlan, x, w, b, o| B::conv_transpose1d(x, w, b, o));
convolution!(ConvTranspose2d, ConvTransposeOptions<2>, conv_transpose2d,
    conv_transpose2d_x_backward, conv_transpose2d_weight_backward,
    conv_transpose2d_bias_backward, transposed: true,
    own: |_: &CastPlan, x, w, b, o| B::conv_transpose2d(x, w, b, o));
convolution!(ConvTranspose3d, ConvTransposeOptions<3>, conv_transpose3d,
    conv_transpose3d_x_backward, conv_transpose3d_weight_backward,
    conv_transpose3d_bias_backward, transposed: true,
    own: |_: &CastPlan, x, w, b, o| B::conv_transpose3d(x, w, b, o));

// The bounded convolution of kind `K` on a registered `Autodiff<B, C>`: the input, the
// weight's and the bias's anchors, their shards, the options, and how the op reads the
// parameters.
type ConvHook<B, K> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    <K as Convolution>::Options,
    Reads,
) -> FloatTensor<B>;

// How a bounded convolution reads its parameters, which decides what is gathered.
#[derive(Clone, Copy)]
enum Reads {
    // As they are (autocast off, or a plan that leaves them alone).
    AsIs,
    // Cast to this half type by autocast: gathered in it (each process casts its slice and
    // sends halves).
    Half(FloatDType),
    // Under fp8 autocast: gathered in f32, the weight rounded by the op's own fp8 cast (its
    // key, scale and amax record) where the op reads it, the bias kept in f32 (as autocast
    // keeps it), and the weight's gradient rounded as the cast node's backward rounds it.
    Fp8(InputRounding),
}

impl Reads {
    // The half type the parameters are gathered in, if any.
    fn half(self) -> Option<FloatDType> {
        match self {
            Reads::Half(dtype) => Some(dtype),
            Reads::AsIs | Reads::Fp8(_) => None,
        }
    }
}

// The bounded convolutions of kind `K`, per backend type.
struct ConvHooks<K>(PhantomData<K>);

// The backends `super::register` registers: one list, the placeholders' own.
impl<K: Convolution> HookKind for ConvHooks<K> {
    fn register_known() {
        super::PlaceholderHooks::register_known();
    }
}

fn insert<B: Backend, C: CheckpointStrategy, K: Convolution>() {
    hooks::insert::<ConvHooks<K>, Autodiff<B, C>, _>(
        bounded::<B, C, K> as ConvHook<Autodiff<B, C>, K>,
    );
}

/// Registers the bounded convolutions for `Autodiff<B, C>` (`super::register`).
pub(super) fn register<B: Backend, C: CheckpointStrategy>() {
    insert::<B, C, Conv1d>();
    insert::<B, C, Conv2d>();
    insert::<B, C, Conv3d>();
    insert::<B, C, ConvTranspose1d>();
    insert::<B, C, ConvTranspose2d>();
    insert::<B, C, ConvTranspose3d>();
}

/// A convolution's inputs, given back where the bounded path does not apply.
pub(crate) type ConvInputs<B, O> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>, O);

// The convolution of kind `K` with the per-layer bound, where it applies: the weight is a
// registered parameter, `x` is not, and either autocast is off and the operands share a
// dtype, or autocast is on and the operands are on one device (`autocast_dispatch`).
// Otherwise the inputs back, for the op's usual path.
fn dispatch<B: Backend, K: Convolution>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: K::Options,
) -> Result<FloatTensor<B>, ConvInputs<B, K::Options>> {
    let Some(weight_shard) = shard_of::<B>(&weight) else {
        return Err((x, weight, bias, options));
    };
    let hook = hooks::get::<ConvHooks<K>, B, ConvHook<B, K>>();
    let (Some(hook), None) = (hook, shard_of::<B>(&x)) else {
        return Err((x, weight, bias, options));
    };
    if crate::autocast::current().is_some() {
        return autocast_dispatch::<B, K>(x, weight, bias, options, weight_shard, hook);
    }
    let same_dtype =
        weight.dtype() == x.dtype() && bias.as_ref().is_none_or(|b| b.dtype() == x.dtype());
    if !same_dtype {
        return Err((x, weight, bias, options));
    }
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
    Ok(hook(
        x,
        weight,
        bias,
        weight_shard,
        bias_shard,
        options,
        Reads::AsIs,
    ))
}

// Under autocast: the op's own path (`crate::backend::forward`'s: the cast plan, decided
// once, the casts, `K::own`) with the parameters gathered for the op alone, in the dtype the
// op reads them in. Where the plan reads them as they are (an fp32-class or small op of f32
// parameters), the bounded path of autocast off on the cast input; under fp8, gathered in
// f32 and the weight rounded by its cast where the node reads it; where it casts f32
// parameters to bf16/f16, gathered in the half type (each process casts its slice), on
// the crate's half convolution where `K::own` runs it there, else on `B`'s op as Burn's node;
// otherwise (parameters of another dtype, a bias that is no parameter under fp8) the op's
// own path with the parameters gathered whole, as every op without a bound reads them.
fn autocast_dispatch<B: Backend, K: Convolution>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: K::Options,
    weight_shard: Arc<dyn Shard>,
    hook: ConvHook<B, K>,
) -> Result<FloatTensor<B>, ConvInputs<B, K::Options>> {
    let device = B::float_device(&x);
    let one_device = B::float_device(&weight) == device
        && bias.as_ref().is_none_or(|b| B::float_device(b) == device);
    if !one_device {
        // The op's path co-locates them first.
        return Err((x, weight, bias, options));
    }
    let plan = CastPlan::new::<B>(
        K::OP,
        &[
            CastInput::One(&x),
            CastInput::One(&weight),
            CastInput::Maybe(&bias),
        ],
    );
    let x = plan.cast_at::<B>(0, x);
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    let read_as_is = |t: &FloatTensor<B>| {
        t.dtype() == x.dtype()
            && plan
                .target()
                .is_none_or(|target| t.dtype() == DType::from(target))
    };
    let unregistered_bias = bias.is_some() && bias_shard.is_none();
    if !plan.rounds_to_fp8() && read_as_is(&weight) && bias.as_ref().is_none_or(read_as_is) {
        let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
        return Ok(hook(
            x,
            weight,
            bias,
            weight_shard,
            bias_shard,
            options,
            Reads::AsIs,
        ));
    }
    // fp8 (where its cast node is registered for `B`, as stage 2 rounds through it): the
    // plan rounds the f32 operands in f32, the input by its own cast above, the weight here
    // where the op reads it; a bias that is no parameter keeps the op's own path.
    let operands: Vec<&FloatTensor<B>> = [Some(&x), Some(&weight), bias.as_ref()]
        .into_iter()
        .flatten()
        .collect();
    if super::fp8::applies::<B>()
        && super::fp8::rounds_f32::<B>(&plan, &operands)
        && !unregistered_bias
        && let Some(rounding) = plan.fp8_rounding(1)
    {
        let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
        return Ok(hook(
            x,
            weight,
            bias,
            weight_shard,
            bias_shard,
            options,
            Reads::Fp8(rounding),
        ));
    }
    let half = plan
        .target()
        .filter(|t| matches!(t, FloatDType::BF16 | FloatDType::F16))
        .filter(|t| x.dtype() == DType::from(*t));
    let f32_params =
        weight.dtype() == DType::F32 && bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
    if let Some(dtype) = half
        && f32_params
        && !plan.rounds_to_fp8()
    {
        // A bias that is no parameter is cast by the plan, as the op's own path casts it.
        let bias = match unregistered_bias {
            true => plan.cast_opt::<B>(bias),
            false => bias,
        };
        let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
        let (x, weight, bias, options) = match K::on_half_kernel::<B>(
            x,
            weight,
            bias,
            weight_shard.clone(),
            bias_shard.clone(),
            options,
            dtype,
        ) {
            Ok(output) => return Ok(output),
            Err(inputs) => inputs,
        };
        return Ok(hook(
            x,
            weight,
            bias,
            weight_shard,
            bias_shard,
            options,
            Reads::Half(dtype),
        ));
    }
    let weight = plan.cast_at::<B>(1, resolve::<B>(weight));
    let bias = plan.cast_opt::<B>(resolve_opt::<B>(bias));
    Ok(K::own::<B>(&plan, x, weight, bias, options))
}

macro_rules! dispatchers {
    ($($name:ident: $kind:ident, $options:ty;)*) => {$(
        #[doc = concat!("`", stringify!($name), "(x, weight, bias, options)` with the")]
        /// per-layer bound, where it applies (a registered weight and input that is not one:
        /// see the module docs); otherwise the inputs back, for the op's usual path.
        pub(crate) fn $name<B: Backend>(
            x: FloatTensor<B>,
            weight: FloatTensor<B>,
            bias: Option<FloatTensor<B>>,
            options: $options,
        ) -> Result<FloatTensor<B>, ConvInputs<B, $options>> {
            dispatch::<B, $kind>(x, weight, bias, options)
        }
    )*};
}

dispatchers! {
    conv1d: Conv1d, ConvOptions<1>;
    conv2d: Conv2d, ConvOptions<2>;
    conv3d: Conv3d, ConvOptions<3>;
    conv_transpose1d: ConvTranspose1d, ConvTransposeOptions<1>;
    conv_transpose2d: ConvTranspose2d, ConvTransposeOptions<2>;
    conv_transpose3d: ConvTranspose3d, ConvTransposeOptions<3>;
}

// The crate's half convolution under autocast (`half_conv`, `Autodiff<Flex>`), where
// `lowered` would run the op on it.
mod half_kernel {
    use std::sync::Arc;

    use burn_backend::ops::ConvOptions;
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, FloatDType};

    use super::{ConvInputs, Shard};

    pub(super) fn conv2d<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
        weight_shard: Arc<dyn Shard>,
        bias_shard: Option<Arc<dyn Shard>>,
        options: ConvOptions<2>,
        dtype: FloatDType,
    ) -> Result<FloatTensor<B>, ConvInputs<B, ConvOptions<2>>> {
        #[cfg(feature = "flex")]
        return super::super::half_conv::conv2d::<B>(
            x,
            weight,
            bias,
            weight_shard,
            bias_shard,
            options,
            dtype,
        );
        #[cfg(not(feature = "flex"))]
        {
            let _ = (weight_shard, bias_shard, dtype);
            Err((x, weight, bias, options))
        }
    }

    pub(super) fn conv1d<B: Backend>(
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
        weight_shard: Arc<dyn Shard>,
        bias_shard: Option<Arc<dyn Shard>>,
        options: ConvOptions<1>,
        dtype: FloatDType,
    ) -> Result<FloatTensor<B>, ConvInputs<B, ConvOptions<1>>> {
        #[cfg(feature = "flex")]
        return super::super::half_conv::conv1d::<B>(
            x,
            weight,
            bias,
            weight_shard,
            bias_shard,
            options,
            dtype,
        );
        #[cfg(not(feature = "flex"))]
        {
            let _ = (weight_shard, bias_shard, dtype);
            Err((x, weight, bias, options))
        }
    }
}

// Burn's convolution node's state, the weight kept as its placeholder (gathered again for
// the input's gradient) and the bias as its placeholder (the bias's gradient reads its
// shape alone); under autocast the half type the parameters were gathered in.
struct ConvState<B: Backend, K: Convolution> {
    x: FloatTensor<B>,
    weight: Weight<B>,
    bias: Option<FloatTensor<B>>,
    options: K::Options,
    half: Option<Half>,
    // Under fp8: the weight's rounding (gathered again and rounded for the input's gradient,
    // its gradient rounded as its cast node's backward rounds it).
    fp8: Option<InputRounding>,
}

impl<B: Backend, K: Convolution> Clone for ConvState<B, K> {
    fn clone(&self) -> Self {
        ConvState {
            x: self.x.clone(),
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            options: self.options.clone(),
            half: self.half,
            fp8: self.fp8,
        }
    }
}

impl<B: Backend, K: Convolution> core::fmt::Debug for ConvState<B, K> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("ConvState")
    }
}

// The node, over `[x, weight]` or `[x, weight, bias]`.
struct BoundedConv<K>(PhantomData<K>);

impl<K> core::fmt::Debug for BoundedConv<K> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("BoundedConv")
    }
}

impl<B: Backend, K: Convolution, const N: usize> Backward<B, N> for BoundedConv<K> {
    type State = ConvState<B, K>;

    // Burn's backward: the input's gradient, the weight's, the bias's, in this order, each
    // by the same op on the same values (the weight gathered for the input's alone). Under
    // autocast each parameter's gradient is then cast to f32 as its cast node's backward
    // casts it.
    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|parent| parent.map(|node| node.id));
        let ConvState {
            x,
            weight,
            bias,
            options,
            half,
            fp8,
        } = ops.state;
        let dtype = half.map(|h| h.dtype);
        // A grouped convolution's weight gradient starts from zeros of the weight's dtype:
        // under autocast the half one, so it reads the gathered halves.
        let grouped_half = half.is_some() && K::groups(&options) > 1 && parents[1].is_some();
        let whole = (parents[0].is_some() || grouped_half).then(|| {
            let (whole, bytes) = gather_in::<B>(weight.shard.as_ref(), &weight.tensor, dtype);
            match fp8 {
                // The forward's rounding again (its scale), recording nothing.
                Some(rounding) => (rounding.again::<B>(whole), bytes),
                None => (whole, bytes),
            }
        });
        let weight_to_param = |grad: FloatTensor<B>| match fp8 {
            Some(rounding) => rounding.gradient::<B>(grad),
            None => to_param::<B>(dtype, grad),
        };
        if let (Some(node), Some((whole, _))) = (parents[0], &whole) {
            let grad = K::x_backward::<B>(x.clone(), whole.clone(), grad.clone(), options.clone());
            grads.register::<B>(node, grad);
        }
        if let Some(node) = parents[1] {
            let read = match (grouped_half, &whole) {
                (true, Some((whole, _))) => whole.clone(),
                _ => weight.tensor,
            };
            let grad = K::weight_backward::<B>(x.clone(), read, grad.clone(), options.clone());
            grads.register::<B>(node, weight_to_param(grad));
        }
        if let Some((_, bytes)) = whole {
            count_dropped(bytes);
        }
        if let (Some(Some(node)), Some(bias)) = (parents.get(2), bias) {
            let grad = K::bias_backward::<B>(x, bias, grad);
            let grad = match half {
                Some(Half {
                    bias_registered: false,
                    ..
                }) => grad,
                _ => to_param::<B>(dtype, grad),
            };
            grads.register::<B>(*node, grad);
        }
    }
}

// Burn's convolution of kind `K` on `Autodiff<B, C>` with the weight (and a registered bias)
// gathered for the forward op alone, in `half` where given, and a node that keeps their
// placeholders.
fn bounded<B: Backend, C: CheckpointStrategy, K: Convolution>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    options: K::Options,
    reads: Reads,
) -> FloatTensor<Autodiff<B, C>> {
    let half = reads.half();
    let fp8 = match reads {
        Reads::Fp8(rounding) => Some(rounding),
        Reads::AsIs | Reads::Half(_) => None,
    };
    let (whole_weight, mut bytes) = gather_in::<B>(weight_shard.as_ref(), &weight.primitive, half);
    // Under fp8 the weight's cast node's forward: its amax recorded, the current scale.
    let whole_weight = match fp8 {
        Some(rounding) => rounding.forward::<B>(whole_weight),
        None => whole_weight,
    };
    let whole_bias = bias.as_ref().map(|bias| match &bias_shard {
        Some(shard) => {
            let (whole, counted) = gather_in::<B>(shard.as_ref(), &bias.primitive, half);
            bytes += counted;
            whole
        }
        None => bias.primitive.clone(),
    });
    let output = K::forward::<B>(
        x.primitive.clone(),
        whole_weight,
        whole_bias,
        options.clone(),
    );
    count_dropped(bytes);
    let state = ConvState::<B, K> {
        x: x.primitive.clone(),
        weight: Weight {
            tensor: weight.primitive.clone(),
            shard: weight_shard,
        },
        bias: bias.as_ref().map(|bias| bias.primitive.clone()),
        options,
        half: half.map(|dtype| Half {
            dtype,
            bias_registered: bias_shard.is_some(),
        }),
        fp8,
    };
    let node = BoundedConv::<K>(PhantomData);
    match bias {
        Some(bias) => match node
            .prepare::<C>([x.node.clone(), weight.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match node
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    }
}
