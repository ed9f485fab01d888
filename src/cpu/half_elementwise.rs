//! Add, subtract, multiply and divide of half tensors on Flex, by another of the same shape or
//! by a scalar.
//!
//! Flex 0.21 computes these for bf16 and f16 one element at a time on one thread, each value
//! widened with a scalar conversion, the f32 op, the result rounded back (`binary_op` and
//! `scalar_op` in `burn-flex-0.21.0/src/ops/binary.rs`). A transformer's bf16 step spends about a
//! tenth of its time there: dropout (`x * mask`, then `* (1 / keep)`), the attention scores'
//! `/ sqrt(d)`, and their backward passes. Here the same arithmetic runs in blocks on
//! [`half_kernels`](super::half_kernels)' vectorised conversions, on every core.
//!
//! Each value is widened to f32, takes the same f32 op (a scalar rounded to the dtype and
//! widened first, as Flex does) and is rounded once to nearest even, as `half`'s `from_f32`
//! rounds it: the bits are Flex's, so the decorator takes these with or without autocast. The
//! result is written in place in the left operand's buffer where nothing else holds it (as Flex
//! does), else into a new one.
//!
//! Taken for two tensors of one half dtype and one shape, both contiguous, or one contiguous
//! half tensor and a scalar. Anything else is Flex's own: broadcast shapes, strided views,
//! mixed dtypes, f32 and f64. On `Autodiff<Flex>` the nodes below give Burn's own gradients bit
//! for bit (the same ops in the same order, each on these kernels), and a call the kernels do
//! not take gets Burn's own node.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::DType;
use burn_backend::Scalar;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;

use super::half_kernels::{Half, fits, map, with_half, zip};

type Tracked = FloatTensor<Autodiff<Flex>>;

/// Whether the kernels take `lhs` and `rhs`: one half dtype, one shape, both contiguous.
fn takes_pair(lhs: &FlexTensor, rhs: &FlexTensor) -> bool {
    matches!(lhs.dtype(), DType::BF16 | DType::F16)
        && lhs.dtype() == rhs.dtype()
        && lhs.layout().shape() == rhs.layout().shape()
        && fits(lhs)
        && fits(rhs)
}

/// Whether the kernels take `tensor` with a scalar: a contiguous half tensor.
fn takes_one(tensor: &FlexTensor) -> bool {
    matches!(tensor.dtype(), DType::BF16 | DType::F16) && fits(tensor)
}

// Which operand's NaN a result is where both are NaN. Rust leaves it to the compiler (x86
// returns its first operand's, and an add or a multiply may be commuted): Flex's compiled
// loops return the right operand's for bf16 add and mul, and the left one's for the rest
// (tested below), so the kernels pick it explicitly rather than leave it to how their own
// loops compile. Widened NaNs are already quiet, as the hardware's result would be.
#[derive(Clone, Copy)]
enum NanFrom {
    Left,
    Right,
}

impl NanFrom {
    // Flex's for a binary op on `dtype` (`commutes`: add and mul).
    fn of_flex(dtype: DType, commutes: bool) -> Self {
        match commutes && dtype == DType::BF16 {
            true => Self::Right,
            false => Self::Left,
        }
    }
}

/// `op(lhs, rhs)` value by value, in place in `lhs`'s buffer where it is not shared; `flex`
/// (Flex's own op) where the kernels do not take the operands.
#[inline(always)]
fn binary_op(
    lhs: FlexTensor,
    rhs: FlexTensor,
    op: impl Fn(f32, f32) -> f32 + Sync + Copy,
    commutes: bool,
    flex: fn(FlexTensor, FlexTensor) -> FlexTensor,
) -> FlexTensor {
    if takes_pair(&lhs, &rhs) {
        let nan = NanFrom::of_flex(lhs.dtype(), commutes);
        // `zip` writes into its second operand: `lhs`, the left operand of `op`.
        with_half!(lhs.dtype(), H => return match nan {
            NanFrom::Left => zip::<H>(&rhs, lhs, move |r, l| if l.is_nan() { l } else { op(l, r) }),
            NanFrom::Right => zip::<H>(&rhs, lhs, move |r, l| if r.is_nan() { r } else { op(l, r) }),
        }, _ => {});
    }
    flex(lhs, rhs)
}

/// `op(x, s)` for every value `x` of `tensor`, `s` the scalar as Flex takes it: as f64, then
/// f32, rounded to the tensor's dtype and widened back.
#[inline(always)]
fn scalar_op(
    tensor: FlexTensor,
    scalar: Scalar,
    op: impl Fn(f32, f32) -> f32 + Sync + Copy,
    flex: fn(FlexTensor, Scalar) -> FlexTensor,
) -> FlexTensor {
    if takes_one(&tensor) {
        let wide = scalar.elem::<f64>() as f32;
        with_half!(tensor.dtype(), H => {
            let s = in_dtype::<H>(wide);
            // The tensor's NaN where both are NaN, as Flex's loop returns it (see `NanFrom`).
            return map::<H>(tensor, move |x| if x.is_nan() { x } else { op(x, s) });
        }, _ => {});
    }
    flex(tensor, scalar)
}

// `x` rounded to `H` and widened back, by the conversions the kernels round with (`half`'s).
fn in_dtype<H: Half>(x: f32) -> f32 {
    let mut h = [H::default()];
    H::round(&[x], &mut h);
    let mut wide = [0f32];
    H::widen(&h, &mut wide);
    wide[0]
}

/// `lhs + rhs`, with `Flex::float_add`'s values.
pub(crate) fn add(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    binary_op(lhs, rhs, |a, b| a + b, true, Flex::float_add)
}

/// `lhs - rhs`, with `Flex::float_sub`'s values.
pub(crate) fn sub(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    binary_op(lhs, rhs, |a, b| a - b, false, Flex::float_sub)
}

/// `lhs * rhs`, with `Flex::float_mul`'s values.
pub(crate) fn mul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    binary_op(lhs, rhs, |a, b| a * b, true, Flex::float_mul)
}

/// `lhs / rhs`, with `Flex::float_div`'s values.
pub(crate) fn div(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    binary_op(lhs, rhs, |a, b| a / b, false, Flex::float_div)
}

/// `lhs + rhs` of a scalar, with `Flex::float_add_scalar`'s values.
pub(crate) fn add_scalar(lhs: FlexTensor, rhs: Scalar) -> FlexTensor {
    scalar_op(lhs, rhs, |a, s| a + s, Flex::float_add_scalar)
}

/// `lhs - rhs` of a scalar, with `Flex::float_sub_scalar`'s values.
pub(crate) fn sub_scalar(lhs: FlexTensor, rhs: Scalar) -> FlexTensor {
    scalar_op(lhs, rhs, |a, s| a - s, Flex::float_sub_scalar)
}

/// `lhs * rhs` of a scalar, with `Flex::float_mul_scalar`'s values.
pub(crate) fn mul_scalar(lhs: FlexTensor, rhs: Scalar) -> FlexTensor {
    scalar_op(lhs, rhs, |a, s| a * s, Flex::float_mul_scalar)
}

/// `lhs / rhs` of a scalar, with `Flex::float_div_scalar`'s values.
pub(crate) fn div_scalar(lhs: FlexTensor, rhs: Scalar) -> FlexTensor {
    scalar_op(lhs, rhs, |a, s| a / s, Flex::float_div_scalar)
}

// Flex's `float_neg` (`-x` in f32, rounded) and `float_recip` (`1 / x`), for the backward
// passes of `sub` and `div`.
fn neg(tensor: FlexTensor) -> FlexTensor {
    match fits(&tensor) {
        true => {
            with_half!(tensor.dtype(), H => map::<H>(tensor, |x| -x), _ => Flex::float_neg(tensor))
        }
        false => Flex::float_neg(tensor),
    }
}

fn recip(tensor: FlexTensor) -> FlexTensor {
    match fits(&tensor) {
        true => {
            with_half!(tensor.dtype(), H => map::<H>(tensor, |x| 1.0 / x), _ => Flex::float_recip(tensor))
        }
        false => Flex::float_recip(tensor),
    }
}

/// [`add`] as a node of Burn's autodiff: the gradient passed on to both sides, as Burn's own
/// (whose reduction over broadcast dimensions has nothing to do for one shape). Operands the
/// kernels do not take get Burn's own node.
pub(crate) fn add_tracked(lhs: Tracked, rhs: Tracked) -> Tracked {
    if !takes_pair(&lhs.primitive, &rhs.primitive) {
        return Autodiff::<Flex>::float_add(lhs, rhs);
    }
    #[derive(Debug)]
    struct Add;

    impl Backward<Flex, 2> for Add {
        type State = ();

        fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            binary::<Flex, _, _>(ops.parents, ops.node, grads, |grad| grad, |grad| grad);
        }
    }

    Add.prepare::<NoCheckpointing>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateless(add(lhs.primitive, rhs.primitive))
}

/// [`sub`] as a node of Burn's autodiff: the gradient passed on, negated for `rhs`.
pub(crate) fn sub_tracked(lhs: Tracked, rhs: Tracked) -> Tracked {
    if !takes_pair(&lhs.primitive, &rhs.primitive) {
        return Autodiff::<Flex>::float_sub(lhs, rhs);
    }
    #[derive(Debug)]
    struct Sub;

    impl Backward<Flex, 2> for Sub {
        type State = ();

        fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            binary::<Flex, _, _>(ops.parents, ops.node, grads, |grad| grad, neg);
        }
    }

    Sub.prepare::<NoCheckpointing>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateless(sub(lhs.primitive, rhs.primitive))
}

/// [`mul`] as a node of Burn's autodiff: `grad * rhs` for `lhs`, `grad * lhs` for `rhs`. Each
/// operand is kept only for the other's gradient: dropout's `x * mask` keeps the mask alone.
pub(crate) fn mul_tracked(lhs: Tracked, rhs: Tracked) -> Tracked {
    if !takes_pair(&lhs.primitive, &rhs.primitive) {
        return Autodiff::<Flex>::float_mul(lhs, rhs);
    }
    #[derive(Debug)]
    struct Mul;

    impl Backward<Flex, 2> for Mul {
        type State = (Option<FlexTensor>, Option<FlexTensor>);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (lhs, rhs) = ops.state;
            binary::<Flex, _, _>(
                ops.parents,
                ops.node,
                grads,
                |grad| mul(grad, rhs.expect("kept for lhs's gradient")),
                |grad| mul(grad, lhs.expect("kept for rhs's gradient")),
            );
        }
    }

    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    match Mul
        .prepare::<NoCheckpointing>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (
                rhs_tracked.then(|| lhs.primitive.clone()),
                lhs_tracked.then(|| rhs.primitive.clone()),
            );
            prep.finish(state, mul(lhs.primitive, rhs.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(mul(lhs.primitive, rhs.primitive)),
    }
}

/// [`div`] as a node of Burn's autodiff, computed as Burn's own is, one rounding an op:
/// `grad * recip(rhs)` for `lhs`, `grad * (-lhs / (rhs * rhs))` for `rhs`. `rhs` is kept for
/// either gradient, `lhs` for `rhs`'s only.
pub(crate) fn div_tracked(lhs: Tracked, rhs: Tracked) -> Tracked {
    if !takes_pair(&lhs.primitive, &rhs.primitive) {
        return Autodiff::<Flex>::float_div(lhs, rhs);
    }
    #[derive(Debug)]
    struct Div;

    impl Backward<Flex, 2> for Div {
        type State = (Option<FlexTensor>, FlexTensor);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (lhs, rhs) = ops.state;
            let rhs_for_lhs = rhs.clone();
            binary::<Flex, _, _>(
                ops.parents,
                ops.node,
                grads,
                |grad| mul(grad, recip(rhs_for_lhs)),
                |grad| {
                    let lhs = lhs.expect("kept for rhs's gradient");
                    // Burn's `powi_scalar(rhs, 2)` on Flex is `rhs * rhs`.
                    let square = mul(rhs.clone(), rhs);
                    mul(grad, div(neg(lhs), square))
                },
            );
        }
    }

    let rhs_tracked = rhs.is_tracked();
    match Div
        .prepare::<NoCheckpointing>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (
                rhs_tracked.then(|| lhs.primitive.clone()),
                rhs.primitive.clone(),
            );
            prep.finish(state, div(lhs.primitive, rhs.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(div(lhs.primitive, rhs.primitive)),
    }
}

/// A node whose gradient is the output's, unchanged: adding or subtracting a scalar.
#[derive(Debug)]
struct PassThrough;

impl Backward<Flex, 1> for PassThrough {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

/// [`add_scalar`] as a node of Burn's autodiff (the gradient passed on).
pub(crate) fn add_scalar_tracked(lhs: Tracked, rhs: Scalar) -> Tracked {
    if !takes_one(&lhs.primitive) {
        return Autodiff::<Flex>::float_add_scalar(lhs, rhs);
    }
    PassThrough
        .prepare::<NoCheckpointing>([lhs.node.clone()])
        .compute_bound()
        .stateless(add_scalar(lhs.primitive, rhs))
}

/// [`sub_scalar`] as a node of Burn's autodiff (the gradient passed on).
pub(crate) fn sub_scalar_tracked(lhs: Tracked, rhs: Scalar) -> Tracked {
    if !takes_one(&lhs.primitive) {
        return Autodiff::<Flex>::float_sub_scalar(lhs, rhs);
    }
    PassThrough
        .prepare::<NoCheckpointing>([lhs.node.clone()])
        .compute_bound()
        .stateless(sub_scalar(lhs.primitive, rhs))
}

/// A node whose gradient is the output's times a scalar, as Burn's `float_mul_scalar` of it.
#[derive(Debug)]
struct TimesScalar;

impl Backward<Flex, 1> for TimesScalar {
    type State = Scalar;

    fn backward(self, ops: Ops<Scalar, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let factor = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
            mul_scalar(grad, factor)
        });
    }
}

// `op(lhs, rhs)` recorded as a node whose backward multiplies by `factor`.
fn times_scalar_tracked(
    lhs: Tracked,
    rhs: Scalar,
    factor: Scalar,
    op: fn(FlexTensor, Scalar) -> FlexTensor,
) -> Tracked {
    match TimesScalar
        .prepare::<NoCheckpointing>([lhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(factor, op(lhs.primitive, rhs)),
        OpsKind::UnTracked(prep) => prep.finish(op(lhs.primitive, rhs)),
    }
}

/// [`mul_scalar`] as a node of Burn's autodiff: the gradient times the scalar.
pub(crate) fn mul_scalar_tracked(lhs: Tracked, rhs: Scalar) -> Tracked {
    if !takes_one(&lhs.primitive) {
        return Autodiff::<Flex>::float_mul_scalar(lhs, rhs);
    }
    times_scalar_tracked(lhs, rhs, rhs, mul_scalar)
}

/// [`div_scalar`] as a node of Burn's autodiff: the gradient times `1 / rhs`, taken in f32 as
/// Burn's own takes it.
pub(crate) fn div_scalar_tracked(lhs: Tracked, rhs: Scalar) -> Tracked {
    if !takes_one(&lhs.primitive) {
        return Autodiff::<Flex>::float_div_scalar(lhs, rhs);
    }
    let factor = Scalar::from(1.0 / rhs.elem::<f32>());
    times_scalar_tracked(lhs, rhs, factor, div_scalar)
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use half::{bf16, f16};

    use super::*;

    // Every bit pattern of a 16-bit type (zeros, subnormals, normals, the largest finite
    // values, infinities and NaNs of both signs), in the order of an odd `multiplier` (which
    // permutes them): with another multiplier each meets a variety of others, so that sums
    // and products tie, overflow, and underflow to subnormals and zero.
    fn patterns(dtype: DType, multiplier: u32) -> FlexTensor {
        let bits = (0..=u32::from(u16::MAX)).map(|i| (i.wrapping_mul(multiplier) & 0xFFFF) as u16);
        let data = match dtype {
            DType::BF16 => TensorData::new(bits.map(bf16::from_bits).collect(), [256, 256]),
            _ => TensorData::new(bits.map(f16::from_bits).collect(), [256, 256]),
        };
        FlexTensor::from_data(data)
    }

    fn bits(t: FlexTensor) -> Vec<u16> {
        bytemuck::pod_collect_to_vec(&t.into_data().bytes)
    }

    // The first value where `got` and `want` differ, with the operands' bits there.
    fn first_difference(got: &[u16], want: &[u16], operands: &[&[u16]]) -> Option<String> {
        let i = got.iter().zip(want).position(|(g, w)| g != w)?;
        let ops: Vec<String> = operands.iter().map(|o| format!("{:#06x}", o[i])).collect();
        Some(format!(
            "at {i}: {:#06x} for {:#06x}, operands {ops:?}",
            got[i], want[i]
        ))
    }

    type Pair = fn(FlexTensor, FlexTensor) -> FlexTensor;
    type WithScalar = fn(FlexTensor, Scalar) -> FlexTensor;

    const PAIRS: [(&str, Pair, Pair); 4] = [
        ("add", add, Flex::float_add),
        ("sub", sub, Flex::float_sub),
        ("mul", mul, Flex::float_mul),
        ("div", div, Flex::float_div),
    ];

    const SCALARS: [(&str, WithScalar, WithScalar); 4] = [
        ("add", add_scalar, Flex::float_add_scalar),
        ("sub", sub_scalar, Flex::float_sub_scalar),
        ("mul", mul_scalar, Flex::float_mul_scalar),
        ("div", div_scalar, Flex::float_div_scalar),
    ];

    #[test]
    fn every_pattern_against_others_gives_flexs_bits() {
        for dtype in [DType::BF16, DType::F16] {
            let lhs = patterns(dtype, 1);
            for multiplier in [40_503, 3, 0xFFFF] {
                let rhs = patterns(dtype, multiplier);
                for (name, ours, flex) in PAIRS {
                    let want = bits(flex(lhs.clone(), rhs.clone()));
                    let operands = [bits(lhs.clone()), bits(rhs.clone())];
                    let operands = [&operands[0][..], &operands[1][..]];
                    // Shared buffers (the clones) are written into new ones ...
                    let got = bits(ours(lhs.clone(), rhs.clone()));
                    let diff = first_difference(&got, &want, &operands);
                    assert!(diff.is_none(), "{dtype:?} {name} {multiplier}: {diff:?}");
                    // ... and an unshared left operand's in place, as Flex does.
                    let own = FlexTensor::from_data(lhs.clone().into_data());
                    let at = own.bytes().as_ptr();
                    let out = ours(own, rhs.clone());
                    assert_eq!(out.bytes().as_ptr(), at, "{name} in place");
                    let diff = first_difference(&bits(out), &want, &operands);
                    assert!(diff.is_none(), "{dtype:?} {name} in place: {diff:?}");
                }
            }
        }
    }

    #[test]
    fn ties_are_among_the_patterns() {
        // The sums of the patterns above include exact ties of bf16 rounding, so the tests
        // above check round-to-nearest-even and not just rounding to nearest.
        let ties = (0..=u16::MAX)
            .filter(|&i| {
                let a = bf16::from_bits(i).to_f32();
                let b = bf16::from_bits((u32::from(i).wrapping_mul(40_503) & 0xFFFF) as u16);
                let sum = a + b.to_f32();
                sum.is_finite() && sum.to_bits() & 0xFFFF == 0x8000
            })
            .count();
        assert!(ties > 100, "{ties}");
    }

    #[test]
    fn scalars_give_flexs_bits() {
        let scalars = [
            Scalar::from(1.11f64),
            Scalar::from(0.1f64),
            Scalar::from(-8.0f64),
            Scalar::from(3i64),
            Scalar::from(0.0f64),
            Scalar::from(-0.0f64),
            Scalar::from(1e-40f64),
            Scalar::from(1e300f64),
            Scalar::from(f64::INFINITY),
            Scalar::from(f64::NAN),
            // Ties of bf16 rounding: the scalar is rounded to the dtype first.
            Scalar::from(f64::from(f32::from_bits(0x3F80_8000))),
            Scalar::from(f64::from(f32::from_bits(0x3F81_8000))),
        ];
        for dtype in [DType::BF16, DType::F16] {
            let x = patterns(dtype, 1);
            for scalar in scalars {
                for (name, ours, flex) in SCALARS {
                    let want = bits(flex(x.clone(), scalar));
                    let got = bits(ours(x.clone(), scalar));
                    let diff = first_difference(&got, &want, &[&bits(x.clone())]);
                    assert!(diff.is_none(), "{dtype:?} {name} {scalar:?}: {diff:?}");
                }
            }
        }
    }

    #[test]
    fn what_the_kernels_do_not_take_is_flexs() {
        let x = patterns(DType::BF16, 1);
        let row = Flex::float_slice(x.clone(), &[burn::tensor::Slice::new(0, Some(1), 1)]);
        let transposed = Flex::float_swap_dims(x.clone(), 0, 1);
        let wide = Flex::float_cast(x.clone(), burn_backend::FloatDType::F32);
        assert!(!takes_pair(&x, &row) && !takes_pair(&transposed, &x));
        assert!(!takes_pair(&wide, &wide) && !takes_one(&wide) && !takes_one(&transposed));
        for (name, ours, flex) in PAIRS {
            for (a, b) in [
                (x.clone(), row.clone()),
                (transposed.clone(), x.clone()),
                (wide.clone(), wide.clone()),
            ] {
                assert_eq!(bits(ours(a.clone(), b.clone())), bits(flex(a, b)), "{name}");
            }
        }
    }
}
