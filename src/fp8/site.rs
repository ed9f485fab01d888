//! Where an autocast fp8 cast happens: the op call it belongs to, the casts of that call's
//! inputs (keyed for their amax histories), and applying one through the autodiff node.
//!
//! Kept apart from [`cast`](super::cast), whose values the autodiff node is built from: the
//! dependencies run one way, site → autodiff → cast.

use burn_backend::Backend;
use burn_backend::tensor::FloatTensor;

use super::autodiff;
use super::cast::{Fp8Cast, Quantizer};
use super::format::Fp8Mode;
use super::state::{self, Pass, TensorKey};
use crate::op_table::Op;

/// Where an autocast fp8 cast happens: the op call it belongs to, decided once per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fp8Site {
    mode: Fp8Mode,
    op: Op,
    call: u32,
}

impl Fp8Site {
    /// Numbers a new call of `op` under `mode`.
    pub(crate) fn new(mode: Fp8Mode, op: Op) -> Self {
        Fp8Site {
            mode,
            op,
            call: state::next_call(op),
        }
    }

    /// The cast of the op's `input`-th required float input, with the current scales.
    pub(crate) fn cast(&self, input: u32) -> Fp8Cast {
        let key = |pass| TensorKey {
            op: self.op,
            call: self.call,
            input,
            pass,
        };
        let quantizer = |pass: Pass| {
            let key = key(pass);
            Quantizer::new(pass.format(), state::scale_of(&key)).recording(key)
        };
        debug_assert_eq!(self.mode.forward_format(), Pass::Forward.format());
        Fp8Cast {
            forward: quantizer(Pass::Forward),
            backward: self.mode.backward_format().map(|format| {
                debug_assert_eq!(format, Pass::Backward.format());
                quantizer(Pass::Backward)
            }),
        }
    }

    /// Applies the cast of input `input` to `tensor`, with its backward where `B` records one.
    pub(crate) fn apply<B: Backend>(&self, input: u32, tensor: FloatTensor<B>) -> FloatTensor<B> {
        autodiff::fp8_cast::<B>(tensor, self.cast(input))
    }
}
