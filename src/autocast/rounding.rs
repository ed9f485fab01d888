//! An fp8 rounding of one op input that the op applies itself, where it reads the input,
//! instead of autocast's cast node rounding it once before the op.

use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

use crate::fp8::{Fp8Cast, Quantizer};

/// Under fp8 autocast, the rounding of one of an op call's inputs: its fp8 cast's quantizers,
/// keyed for the input's amax histories ([`CastPlan::fp8_rounding`](super::CastPlan)). For an
/// op that rounds the input itself each time it reads it: ZeRO stage 3's bounded `linear` and
/// `matmul`, which gather a parameter for the op alone, and again in backward.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InputRounding(pub(super) Fp8Cast);

impl InputRounding {
    /// The input rounded as the cast node's forward rounds it: the input's amax recorded (once
    /// a pass, as the node records it), the current scale.
    pub(crate) fn forward<B: Backend>(&self, tensor: FloatTensor<B>) -> FloatTensor<B> {
        self.0.forward.apply::<B>(tensor)
    }

    /// The same rounding again (the same scale), recording nothing: a later read of the value
    /// [`forward`](Self::forward) rounded, the same bits.
    pub(crate) fn again<B: Backend>(&self, tensor: FloatTensor<B>) -> FloatTensor<B> {
        let forward = self.0.forward;
        Quantizer::new(forward.format, forward.scale).apply::<B>(tensor)
    }

    /// The input's gradient as the cast node's backward hands it on: rounded to E5M2 under
    /// HYBRID (its amax recorded), as it is under E4M3.
    pub(crate) fn gradient<B: Backend>(&self, grad: FloatTensor<B>) -> FloatTensor<B> {
        match self.0.backward {
            Some(quantizer) => quantizer.apply::<B>(grad),
            None => grad,
        }
    }
}

/// Whether autocast rounds fp8 inputs on `B` through fp8's own cast node (registered for `B`);
/// without it, through a straight-through estimate, whose gradients are not rounded.
pub(crate) fn rounds_through_node<B: Backend>() -> bool {
    crate::fp8::is_registered::<B>()
}
