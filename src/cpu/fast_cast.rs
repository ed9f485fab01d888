//! Autocast's casts between f32 and the half types on Flex, whose own cast is slow.
//!
//! Flex 0.21 casts through an f64 copy of every value (`float_cast` in
//! `burn-flex-0.21.0/src/ops/float.rs`), about 2 ns per element: on the benchmark MLP the casts
//! autocast inserts cost a third of a bf16 step. The kernels' `Half` conversions do the same
//! rounding (round to nearest even, from the exact value) in one vectorised pass. Casting through f64 first would change nothing, an f32 being exact in f64,
//! but `half` 2.7.1's f64 conversions drop the f64's low 32 mantissa bits before they round
//! (`f64_to_bf16` in `half-2.7.1/src/bfloat/convert.rs`, `f64_to_f16_fallback` in
//! `src/binary16/arch.rs`): where an f32 lies just past a tie by its last three mantissa bits
//! only (`0x7DA0_8005`, say), Flex rounds it as the tie, to even, and this cast rounds it up,
//! as torch, ml_dtypes and `half`'s own f32 conversions do. Every other value gets Flex's bits.
//!
//! Like fp8's cast, a replacement under autodiff needs a backward node, built with the
//! concrete `Autodiff<B, C>` in hand: [`convert_tracked`] for `Autodiff<Flex>`, [`convert`]
//! for Flex. Every other backend keeps its own cast.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Bytes, DType};
use burn_backend::FloatDType;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use half::{bf16, f16};

use burn_accelerate_kernels::half::{rounded, widened_in_tasks};

/// The cast, with the kernels' `Half` conversions between f32 and the half types, and Flex's own
/// for everything else.
pub(crate) fn convert(tensor: FlexTensor, dtype: FloatDType) -> FlexTensor {
    let (from, to) = (tensor.dtype(), DType::from(dtype));
    if from == to {
        return tensor;
    }
    let tensor = tensor.to_contiguous();
    let shape = tensor.layout().shape().clone();
    let bytes = match (from, to) {
        (DType::F32, DType::BF16) => Bytes::from_elems(rounded::<bf16>(tensor.storage())),
        (DType::F32, DType::F16) => Bytes::from_elems(rounded::<f16>(tensor.storage())),
        (DType::BF16, DType::F32) => Bytes::from_elems(widened_in_tasks::<bf16>(tensor.storage())),
        (DType::F16, DType::F32) => Bytes::from_elems(widened_in_tasks::<f16>(tensor.storage())),
        _ => return Flex::float_cast(tensor, dtype),
    };
    FlexTensor::new(bytes, Layout::contiguous(shape), to)
}

/// The cast as a node of Burn's autodiff: the gradient comes back cast to the input's
/// dtype, as Burn's own `float_cast` node does.
pub(crate) fn convert_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    dtype: FloatDType,
) -> FloatTensor<Autodiff<Flex>> {
    #[derive(Debug)]
    struct Cast;

    impl Backward<Flex, 1> for Cast {
        type State = FloatDType;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let input_dtype = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
                convert(grad, input_dtype)
            });
        }
    }

    let input_dtype = FloatDType::from(tensor.primitive.dtype());
    if input_dtype == dtype {
        return tensor;
    }
    let node = tensor.node.clone();
    let output = convert(tensor.primitive, dtype);
    match Cast
        .prepare::<NoCheckpointing>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(input_dtype, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Every f32 bit pattern class: normals, subnormals, ties, overflow to inf, NaN; more
    // than three of the kernels' parallel tasks.
    fn values() -> Vec<f32> {
        let mut v: Vec<f32> = (0..200_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .collect();
        v.extend([
            0.0,
            -0.0,
            1.0 + f32::EPSILON,
            65504.0,
            65520.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        v
    }

    fn bits(t: FlexTensor) -> Vec<u8> {
        t.into_data().bytes.to_vec()
    }

    // The cast of f32 values to the half type `dtype` as bits, one value at a time by
    // `half`'s f32 conversion: round to nearest even from the exact value.
    fn rounded(values: &[f32], dtype: FloatDType) -> Vec<u8> {
        let bits: Vec<u16> = match dtype {
            FloatDType::BF16 => values
                .iter()
                .map(|v| bf16::from_f32(*v).to_bits())
                .collect(),
            _ => values.iter().map(|v| f16::from_f32(*v).to_bits()).collect(),
        };
        bytemuck::cast_slice(&bits).to_vec()
    }

    // The values whose last three mantissa bits `half`'s f64 conversions read (see the
    // module docs): those bits all zero.
    fn flex_rounds_right(v: f32) -> bool {
        v.to_bits() & 0b111 == 0
    }

    #[test]
    fn the_fast_cast_rounds_to_nearest_even_and_gives_flexs_bits_where_flex_does() {
        let v = values();
        let n = v.len();
        let t = FlexTensor::from_data(burn::tensor::TensorData::new(v.clone(), [n]));
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            let fast = convert(t.clone(), dtype);
            let own = Flex::float_cast(t.clone(), dtype);
            assert_eq!(fast.dtype(), own.dtype());
            let (fast_bits, own_bits) = (bits(fast.clone()), bits(own.clone()));
            assert_eq!(fast_bits, rounded(&v, dtype), "f32 -> {dtype:?}");
            for (i, x) in v.iter().enumerate().filter(|(_, x)| flex_rounds_right(**x)) {
                let at = 2 * i..2 * i + 2;
                assert_eq!(
                    fast_bits[at.clone()],
                    own_bits[at],
                    "f32 {x:e} -> {dtype:?}"
                );
            }
            // Widening is exact: the same half values give Flex's bits.
            let back = convert(fast.clone(), FloatDType::F32);
            let own_back = Flex::float_cast(fast, FloatDType::F32);
            assert_eq!(bits(back), bits(own_back), "{dtype:?} -> f32");
        }
    }

    #[test]
    fn flex_rounds_a_value_just_past_a_tie_as_the_tie() {
        // The upper half 0x7DA0, the lower 0x8005: past the tie by its last bits only.
        let x = f32::from_bits(0x7DA0_8005);
        let t = FlexTensor::from_data(burn::tensor::TensorData::new(vec![x], [1]));
        let fast = convert(t.clone(), FloatDType::BF16);
        let own = Flex::float_cast(t, FloatDType::BF16);
        assert_eq!(
            bits(fast),
            0x7DA1u16.to_le_bytes(),
            "rounded up, to nearest"
        );
        assert_eq!(
            bits(own),
            0x7DA0u16.to_le_bytes(),
            "Flex's: as the tie, to even"
        );
    }
}
