//! Lower-class ops too small for the half type to pay: where autocast departs from PyTorch.
//!
//! PyTorch's autocast casts every lower-class op (matmul, linear, convolutions, attention) to
//! the half type, whatever its size. On a CPU that is a loss for small ones: the casts of the
//! f32 operands, the autodiff nodes that record them and the half-precision elementwise ops
//! downstream cost more than the half GEMM saves. An LSTM of hidden size 32–256 at batch 32
//! (products of 32 rows) trained 1.8–4.4× slower under bf16 autocast than in f32 on Flex
//! (BENCHMARKS.md, issue 28).
//!
//! So, by default ([`SmallOps::KeepF32`]), a lower-class op with a parameter (linear, the
//! convolutions, prelu: [`applies_to`]) whose work is below a threshold runs as an fp32-class
//! op does: its half inputs are cast up to f32 (f32 inputs are left
//! alone) and **its result is f32**, bit for bit the op's f32 result. Downstream ops see an
//! f32 tensor, as after any fp32-class op; a promote-class op that meets it and a half tensor
//! runs in f32. Numerically such ops are more precise than PyTorch's, never less: they stay
//! f32.
//!
//! A bare matmul and attention are cast whatever their size, as PyTorch does: their operands
//! are usually activations that earlier lower-class ops already made half (attention's
//! queries, keys and values), where keeping them in f32 would add casts instead of saving
//! them. (The training hook also recognises the decorator by the dtype of a tiny matmul under
//! autocast.)
//!
//! The work is the op's flops, estimated from its inputs' shapes ([`estimated_flops`]). The
//! threshold is fixed per kind of device, never timed, so that the same program makes the same
//! cast decisions on every start however busy the machine is: on the host's CPU
//! [`HOST_CPU_MIN_HALF_FLOPS`] (16.8 MFLOP, chosen from the measurements in its docs); on a
//! GPU (any backend that does not compute on the host's CPU) none, and every op is cast, as
//! PyTorch does: there small ops are cheap to cast and gain from the half-precision units. It
//! is a setting of the [`Context`](crate::Context) ([`Context::with_small_ops`],
//! [`scope_small_ops`], or [`AutocastConfig::small_ops`](crate::AutocastConfig));
//! [`SmallOps::Cast`] gives PyTorch's rule back and [`SmallOps::KeepF32Below`] sets a threshold
//! of one's own.
//!
//! ```
//! use burn_accelerate::autocast::{self, Op, SmallOps};
//!
//! // An LSTM gate's linear at batch 32, hidden 256: 8.4 MFLOP.
//! assert_eq!(autocast::estimated_flops(Op::Linear, &[&[32, 512], &[512, 256]]), Some(8_388_608));
//! let _rule = autocast::scope_small_ops(SmallOps::KeepF32Below { flops: 1_000_000 }).unwrap();
//! assert_eq!(autocast::small_ops(), SmallOps::KeepF32Below { flops: 1_000_000 });
//! ```

use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, TensorMetadata};
use serde::{Deserialize, Serialize};

use super::{CastInput, Op};
use crate::AccelerateError;
use crate::capability;
use crate::context::{self, Context, ContextGuard, Setting, Slot};

/// Defined with the probe that applies it to the host's CPU, re-exported here beside the rule.
pub use crate::capability::HOST_CPU_MIN_HALF_FLOPS;

/// Which lower-class ops autocast runs in the half type, by their size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum SmallOps {
    /// Every lower-class op runs in the half type, whatever its size: PyTorch's rule.
    Cast,
    /// Ops of less work than the device's threshold
    /// ([`Capabilities::min_half_flops`](crate::capability::Capabilities::min_half_flops):
    /// [`HOST_CPU_MIN_HALF_FLOPS`] on the host's CPU, none on an accelerator) run in f32 and
    /// return f32; the others in the half type (the default).
    #[default]
    KeepF32,
    /// Ops of fewer than `flops` ([`estimated_flops`]) run in f32 and return f32.
    KeepF32Below {
        /// The threshold, at least 1 (use [`SmallOps::Cast`] for none).
        flops: u64,
    },
}

impl SmallOps {
    /// Checks the rule's values.
    ///
    /// # Errors
    /// [`AccelerateError::InvalidConfig`] for `KeepF32Below { flops: 0 }`, which would keep
    /// nothing in f32 (say [`SmallOps::Cast`] for that).
    ///
    /// ```
    /// use burn_accelerate::AccelerateError;
    /// use burn_accelerate::autocast::SmallOps;
    ///
    /// let err = SmallOps::KeepF32Below { flops: 0 }.validate().unwrap_err();
    /// assert!(matches!(err, AccelerateError::InvalidConfig { field: "small_ops.flops", .. }));
    /// assert!(SmallOps::KeepF32Below { flops: 1 << 20 }.validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<(), AccelerateError> {
        match self {
            SmallOps::KeepF32Below { flops: 0 } => Err(AccelerateError::InvalidConfig {
                field: "small_ops.flops",
                value: "0".into(),
                fix: "a threshold of at least 1 flop, or SmallOps::Cast to cast every op",
            }),
            _ => Ok(()),
        }
    }
}

impl Setting for SmallOps {
    const SLOT: Slot = Slot::SmallOps;
    fn unset() -> Self {
        SmallOps::KeepF32
    }
}

impl Context {
    /// This context with `rule` deciding which lower-class ops run in the half type by their
    /// size.
    ///
    /// # Errors
    /// As [`SmallOps::validate`].
    pub fn with_small_ops(self, rule: SmallOps) -> Result<Context, AccelerateError> {
        rule.validate()?;
        Ok(self.with(rule))
    }

    /// The small-op rule of this context ([`SmallOps::KeepF32`] unless set).
    pub fn small_ops(&self) -> SmallOps {
        self.get::<SmallOps>()
    }
}

/// The rule in force on this thread: its context's ([`SmallOps::KeepF32`] unless set).
pub fn small_ops() -> SmallOps {
    context::with_current(Context::small_ops)
}

/// Gives this thread `rule` until the scope drops, whatever the process's is (the
/// small-op half of `with torch.autocast(...)`'s scope; an entered
/// [`Autocast`](crate::Autocast) with `small_ops` set does the same).
///
/// ```
/// use burn_accelerate::autocast::{self, SmallOps};
///
/// let before = autocast::small_ops();
/// {
///     let _cast = autocast::scope_small_ops(SmallOps::Cast).unwrap();
///     assert_eq!(autocast::small_ops(), SmallOps::Cast);
///     // Another thread keeps the process's rule.
///     assert_eq!(std::thread::spawn(autocast::small_ops).join().unwrap(), before);
/// }
/// assert_eq!(autocast::small_ops(), before);
/// ```
///
/// # Errors
/// As [`SmallOps::validate`].
pub fn scope_small_ops(rule: SmallOps) -> Result<SmallOpsGuard, AccelerateError> {
    rule.validate()?;
    Ok(context::scope(rule))
}

/// Restores this thread's previous small-op rule when dropped ([`scope_small_ops`]); tied to
/// its thread.
pub type SmallOpsGuard = ContextGuard;

/// The flops (two per multiply-add) of one call of lower-class `op` on inputs of these shapes,
/// its required float inputs in signature order (no bias); `None` for shapes it cannot read.
///
/// - matmul `[…, m, k] × […, k, n]`: `2·batch·m·k·n` (batch: the broadcast leading dims);
/// - linear `[…, k]` by `[k, n]`: `2·rows·k·n`;
/// - convolution `[N, C, spatial…]` by `[O, C/g, kernel…]`: `2·N·O·(C/g)·∏kernel·∏spatial`,
///   the output taken as large as the input (stride 1: an upper bound for larger strides);
/// - transposed convolution `[N, C, spatial…]` by `[C, O/g, kernel…]`:
///   `2·N·C·(O/g)·∏kernel·∏spatial`;
/// - attention `[b, h, s, d]`, `[b, h, t, d]`, `[b, h, t, e]`: `2·b·h·s·t·(d + e)`;
/// - prelu: its input's element count (elementwise work).
pub fn estimated_flops(op: Op, shapes: &[&[usize]]) -> Option<u64> {
    let prod = |dims: &[usize]| {
        dims.iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
    };
    let mul = |factors: &[u64]| factors.iter().fold(2u64, |acc, &f| acc.saturating_mul(f));
    match op {
        Op::Matmul => {
            let (a, b) = (*shapes.first()?, *shapes.get(1)?);
            let (ra, rb) = (a.len(), b.len());
            if ra < 2 || rb < 2 {
                return None;
            }
            let (m, k, n) = (a[ra - 2], a[ra - 1], b[rb - 1]);
            let lead = ra.max(rb) - 2;
            let dim = |s: &[usize], i: usize| {
                let pad = lead + 2 - s.len();
                if i < pad { 1 } else { s[i - pad] }
            };
            let batch = (0..lead).fold(1u64, |acc, i| {
                acc.saturating_mul(dim(a, i).max(dim(b, i)) as u64)
            });
            Some(mul(&[batch, m as u64, k as u64, n as u64]))
        }
        Op::Linear => {
            let (x, w) = (shapes.first()?, shapes.get(1)?);
            let k = *x.last()?;
            let rows = prod(&x[..x.len() - 1]);
            Some(mul(&[rows, k as u64, *w.last()? as u64]))
        }
        // A transposed convolution's weight is `[in, out / groups, k...]`, a convolution's
        // `[out, in / groups, k...]`: the same product either way.
        Op::Conv1d
        | Op::Conv2d
        | Op::Conv3d
        | Op::DeformConv2d
        | Op::ConvTranspose1d
        | Op::ConvTranspose2d
        | Op::ConvTranspose3d => {
            let (x, w) = (shapes.first()?, shapes.get(1)?);
            if x.len() < 3 || w.len() != x.len() {
                return None;
            }
            Some(mul(&[
                x[0] as u64,
                w[0] as u64,
                w[1] as u64,
                prod(&w[2..]),
                prod(&x[2..]),
            ]))
        }
        Op::Attention => {
            let (q, k, v) = (shapes.first()?, shapes.get(1)?, shapes.get(2)?);
            let (rq, rk) = (q.len(), k.len());
            if rq < 2 || rk < 2 || v.is_empty() {
                return None;
            }
            let (s, d, t, e) = (q[rq - 2], q[rq - 1], k[rk - 2], *v.last()?);
            Some(mul(&[
                prod(&q[..rq - 2]),
                s as u64,
                t as u64,
                (d + e) as u64,
            ]))
        }
        Op::Prelu => Some(prod(shapes.first()?)),
        _ => None,
    }
}

/// Whether the small-op rule may keep `op` in f32: the lower-class ops with a parameter (a
/// weight autocast casts on every call), not a bare matmul or attention.
///
/// ```
/// use burn_accelerate::autocast::{Op, applies_to};
///
/// assert!(applies_to(Op::Linear) && applies_to(Op::Conv2d));
/// assert!(!applies_to(Op::Matmul) && !applies_to(Op::Attention));
/// ```
pub fn applies_to(op: Op) -> bool {
    matches!(
        op,
        Op::Linear
            | Op::Conv1d
            | Op::Conv2d
            | Op::Conv3d
            | Op::ConvTranspose1d
            | Op::ConvTranspose2d
            | Op::ConvTranspose3d
            | Op::DeformConv2d
            | Op::Prelu
    )
}

/// Whether the rule in force keeps a call of lower-class `op` of `flops` work
/// ([`call_flops`]) in f32: its work is below the threshold (the device kind's, for
/// [`SmallOps::KeepF32`]).
#[inline]
pub(crate) fn keeps_f32<B: Backend>(
    rule: SmallOps,
    device: &B::Device,
    op: Op,
    flops: Option<u64>,
) -> bool {
    if !applies_to(op) {
        return false;
    }
    let threshold = match rule {
        SmallOps::Cast => return false,
        SmallOps::KeepF32 => match capability::probe::<B>(device).min_half_flops {
            Some(flops) => flops,
            None => return false,
        },
        SmallOps::KeepF32Below { flops } => flops,
    };
    flops.is_some_and(|flops| flops < threshold)
}

/// The flops of this call of lower-class `op` ([`estimated_flops`] of its required inputs'
/// shapes).
pub(crate) fn call_flops<B: Backend>(
    op: Op,
    inputs: &[CastInput<'_, FloatTensor<B>>],
) -> Option<u64> {
    // The required inputs, in order: an optional one (a bias) is not part of the shapes.
    let mut shapes: [Option<burn_backend::Shape>; 3] = [None, None, None];
    let mut count = 0;
    for input in inputs {
        if let CastInput::One(t) = input
            && count < shapes.len()
        {
            shapes[count] = Some(t.shape());
            count += 1;
        }
    }
    let dims: Vec<&[usize]> = shapes[..count]
        .iter()
        .flatten()
        .map(|s| s.as_slice())
        .collect();
    estimated_flops(op, &dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_of_each_op_family() {
        assert_eq!(
            estimated_flops(Op::Matmul, &[&[4, 5], &[5, 6]]),
            Some(2 * 4 * 5 * 6)
        );
        // Batches broadcast.
        assert_eq!(
            estimated_flops(Op::Matmul, &[&[3, 4, 5], &[1, 5, 6]]),
            Some(2 * 3 * 4 * 5 * 6)
        );
        assert_eq!(
            estimated_flops(Op::Matmul, &[&[4, 5], &[2, 5, 6]]),
            Some(2 * 2 * 4 * 5 * 6)
        );
        assert_eq!(estimated_flops(Op::Matmul, &[&[5], &[5, 6]]), None);
        assert_eq!(
            estimated_flops(Op::Linear, &[&[2, 3, 8], &[8, 16]]),
            Some(2 * 6 * 8 * 16)
        );
        // 32 images of 32×32, 3 → 32 channels, 3×3.
        assert_eq!(
            estimated_flops(Op::Conv2d, &[&[32, 3, 32, 32], &[32, 3, 3, 3]]),
            Some(2 * 32 * 32 * 3 * 9 * 1024)
        );
        assert_eq!(
            estimated_flops(Op::ConvTranspose1d, &[&[2, 4, 10], &[4, 8, 3]]),
            Some(2 * 2 * 4 * 8 * 3 * 10)
        );
        assert_eq!(
            estimated_flops(
                Op::Attention,
                &[&[2, 4, 16, 8], &[2, 4, 32, 8], &[2, 4, 32, 8]]
            ),
            Some(2 * 8 * 16 * 32 * 16)
        );
        assert_eq!(estimated_flops(Op::Prelu, &[&[3, 7], &[7]]), Some(21));
        assert_eq!(estimated_flops(Op::Exp, &[&[3, 7]]), None);
        // Saturates instead of overflowing.
        let huge = usize::MAX / 2;
        assert_eq!(
            estimated_flops(Op::Matmul, &[&[huge, huge], &[huge, huge]]),
            Some(u64::MAX)
        );
    }
}
