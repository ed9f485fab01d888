//! ZeRO stage 3's bounded convolutions (Burn's `nn::conv`: `conv1d`, `conv2d`, `conv3d` and
//! the three transposed ones), where autocast is off and the operands share a dtype: the
//! weight (and a registered bias) are gathered for the forward op alone and dropped when it
//! returns; the backward node keeps their placeholders and gathers the weight again for the
//! input's gradient, the one gradient that reads its values.
//!
//! The node is Burn's own (`burn-autodiff`'s `Conv2DWithBias` and its kin): the same inner
//! ops in the same order (the input's gradient, the weight's, the bias's), so stage 3 ends
//! bit for bit where stage 2 does. The weight's and the bias's gradients are given the
//! placeholders: Burn's defaults of `conv*_weight_backward` and `conv*_bias_backward` read
//! only their shape, dtype and device (a grouped convolution's zeros of the weight's shape),
//! and Flex and NdArray keep those defaults.
//!
//! Under bf16/f16 autocast on `Autodiff<Flex>` a `conv2d` gathers its parameters in the half
//! type (`half_conv`); other convolutions under autocast gather theirs whole (see the
//! [parent module](super)'s "Which ops hold the bound").

use std::marker::PhantomData;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn_backend::ops::{ConvOptions, ConvTransposeOptions};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};

use super::{Shard, Weight, anchored, count_dropped, counted, gather, shard_of};
use crate::hooks::{self, HookKind};

/// One kind of convolution: its options, its forward op and the three gradients of Burn's
/// node, by the inner backend's ops.
pub(super) trait Convolution: Send + Sync + 'static {
    type Options: Clone + core::fmt::Debug + Send + Sync + 'static;

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
     transposed: false) => {
        convolution!(@impl $kind, $options, $forward, $weight, $bias,
            |x, weight, grad, options| $x(x, weight, grad, options));
    };
    ($kind:ident, $options:ty, $forward:ident, $x:ident, $weight:ident, $bias:ident,
     transposed: true) => {
        convolution!(@impl $kind, $options, $forward, $weight, $bias,
            |_x, weight, grad, options| $x(weight, grad, options));
    };
    (@impl $kind:ident, $options:ty, $forward:ident, $weight:ident, $bias:ident,
     |$xa:ident, $wa:ident, $ga:ident, $oa:ident| $x:ident($($arg:ident),*)) => {
        pub(super) struct $kind;

        impl Convolution for $kind {
            type Options = $options;

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
    conv1d_weight_backward, conv1d_bias_backward, transposed: false);
convolution!(Conv2d, ConvOptions<2>, conv2d, conv2d_x_backward,
    conv2d_weight_backward, conv2d_bias_backward, transposed: false);
convolution!(Conv3d, ConvOptions<3>, conv3d, conv3d_x_backward,
    conv3d_weight_backward, conv3d_bias_backward, transposed: false);
convolution!(ConvTranspose1d, ConvTransposeOptions<1>, conv_transpose1d,
    conv_transpose1d_x_backward, conv_transpose1d_weight_backward,
    conv_transpose1d_bias_backward, transposed: true);
convolution!(ConvTranspose2d, ConvTransposeOptions<2>, conv_transpose2d,
    conv_transpose2d_x_backward, conv_transpose2d_weight_backward,
    conv_transpose2d_bias_backward, transposed: true);
convolution!(ConvTranspose3d, ConvTransposeOptions<3>, conv_transpose3d,
    conv_transpose3d_x_backward, conv_transpose3d_weight_backward,
    conv_transpose3d_bias_backward, transposed: true);

// The bounded convolution of kind `K` on a registered `Autodiff<B, C>`: the input, the
// weight's and the bias's anchors, their shards, the options.
type ConvHook<B, K> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    <K as Convolution>::Options,
) -> FloatTensor<B>;

// The bounded convolutions of kind `K`, per backend type.
struct ConvHooks<K>(PhantomData<K>);

impl<K: Convolution> HookKind for ConvHooks<K> {
    fn register_known() {
        use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
        #[cfg(feature = "flex")]
        insert::<burn::backend::Flex, NoCheckpointing, K>();
        #[cfg(feature = "ndarray")]
        insert::<burn::backend::NdArray, NoCheckpointing, K>();
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
// registered parameter, `x` is not, autocast is off and the operands share a dtype.
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
    let same_dtype =
        weight.dtype() == x.dtype() && bias.as_ref().is_none_or(|b| b.dtype() == x.dtype());
    let applies = same_dtype && crate::autocast::current().is_none() && shard_of::<B>(&x).is_none();
    let hook = applies
        .then(hooks::get::<ConvHooks<K>, B, ConvHook<B, K>>)
        .flatten();
    let Some(hook) = hook else {
        return Err((x, weight, bias, options));
    };
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    // As `linear`'s: the anchors sit just above the input, so that they run right after
    // the convolution's backward.
    let weight = anchored::<B>(weight, Some(&x), weight_shard.clone());
    let bias = match (bias, &bias_shard) {
        (Some(bias), Some(shard)) => Some(anchored::<B>(bias, Some(&x), shard.clone())),
        (bias, _) => bias,
    };
    Ok(hook(x, weight, bias, weight_shard, bias_shard, options))
}

macro_rules! dispatchers {
    ($($name:ident: $kind:ident, $options:ty;)*) => {$(
        #[doc = concat!("`", stringify!($name), "(x, weight, bias, options)` with the")]
        /// per-layer bound, where it applies (a registered weight, autocast off, one dtype:
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
    conv3d: Conv3d, ConvOptions<3>;
    conv_transpose1d: ConvTranspose1d, ConvTransposeOptions<1>;
    conv_transpose2d: ConvTranspose2d, ConvTransposeOptions<2>;
    conv_transpose3d: ConvTranspose3d, ConvTransposeOptions<3>;
}

/// `conv2d(x, weight, bias, options)` with the per-layer bound, where it applies: a
/// registered weight and either autocast off and one dtype (see the module docs), or bf16/f16
/// autocast on `Autodiff<Flex>`, which runs the op on the crate's half convolution (the
/// parameters gathered in the half type: see `half_conv`). Otherwise the inputs back, for the
/// op's usual path.
pub(crate) fn conv2d<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
) -> Result<FloatTensor<B>, ConvInputs<B, ConvOptions<2>>> {
    #[cfg(feature = "flex")]
    if let Some(weight_shard) = shard_of::<B>(&weight)
        && let Some(crate::Precision::Bf16 | crate::Precision::F16) = crate::autocast::current()
        && shard_of::<B>(&x).is_none()
    {
        return super::half_conv::autocast_conv2d::<B>(x, weight, bias, options, weight_shard);
    }
    dispatch::<B, Conv2d>(x, weight, bias, options)
}

// Burn's convolution node's state, the weight kept as its placeholder (gathered again for
// the input's gradient) and the bias as its placeholder (the bias's gradient reads its
// shape alone).
struct ConvState<B: Backend, K: Convolution> {
    x: FloatTensor<B>,
    weight: Weight<B>,
    bias: Option<FloatTensor<B>>,
    options: K::Options,
}

impl<B: Backend, K: Convolution> Clone for ConvState<B, K> {
    fn clone(&self) -> Self {
        ConvState {
            x: self.x.clone(),
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            options: self.options.clone(),
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
    // by the same op on the same values (the weight gathered for the input's alone).
    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|parent| parent.map(|node| node.id));
        let ConvState {
            x,
            weight,
            bias,
            options,
        } = ops.state;
        if let Some(node) = parents[0] {
            let whole = gather::<B>(weight.shard.as_ref(), &weight.tensor);
            let bytes = counted(weight.shard.as_ref(), &weight.tensor);
            let grad = K::x_backward::<B>(x.clone(), whole, grad.clone(), options.clone());
            count_dropped(bytes);
            grads.register::<B>(node, grad);
        }
        if let Some(node) = parents[1] {
            let grad =
                K::weight_backward::<B>(x.clone(), weight.tensor, grad.clone(), options.clone());
            grads.register::<B>(node, grad);
        }
        if let (Some(Some(node)), Some(bias)) = (parents.get(2), bias) {
            grads.register::<B>(*node, K::bias_backward::<B>(x, bias, grad));
        }
    }
}

// Burn's convolution of kind `K` on `Autodiff<B, C>` with the weight (and a registered bias)
// gathered for the forward op alone, and a node that keeps their placeholders.
fn bounded<B: Backend, C: CheckpointStrategy, K: Convolution>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    options: K::Options,
) -> FloatTensor<Autodiff<B, C>> {
    let mut bytes = counted(weight_shard.as_ref(), &weight.primitive);
    let whole_weight = gather::<B>(weight_shard.as_ref(), &weight.primitive);
    let whole_bias = bias.as_ref().map(|bias| match &bias_shard {
        Some(shard) => {
            bytes += counted(shard.as_ref(), &bias.primitive);
            gather::<B>(shard.as_ref(), &bias.primitive)
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
