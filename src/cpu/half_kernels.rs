//! Flex's half tensors handed to the elementwise kernels of
//! `burn_accelerate_kernels::half`, and their results wrapped back: the type bound, the dtype
//! dispatch and the choice between writing in place and into a new buffer.
//!
//! The kernels do each value's arithmetic as Flex does (widened to f32, one f32 op, rounded
//! once), so the bits are Flex's own: tested against Flex below.

use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::{Bytes, Element};
use burn_accelerate_kernels::half as kernels;

pub(crate) use burn_accelerate_kernels::half::{
    TASK, add_row, add_widened, in_row_tasks, round_add_row, widen_in_tasks, widened,
};

/// A half type Flex stores (bf16 or f16): one the kernels compute on, and one Flex's tensors
/// hold.
pub(crate) trait Half: kernels::Half + Element {}

impl<H: kernels::Half + Element> Half for H {}

/// Runs `$body` with `$h` the half type of `$dtype`, or evaluates `$otherwise` for any other.
macro_rules! with_half {
    ($dtype:expr, $h:ident => $body:expr, _ => $otherwise:expr) => {
        match $dtype {
            ::burn::tensor::DType::BF16 => {
                type $h = ::half::bf16;
                $body
            }
            ::burn::tensor::DType::F16 => {
                type $h = ::half::f16;
                $body
            }
            _ => $otherwise,
        }
    };
}
pub(crate) use with_half;

// The values of a contiguous tensor, in order; `None` for strided views.
fn values<H: Half>(t: &FlexTensor) -> Option<&[H]> {
    t.as_slice::<H>()
}

// The values of a contiguous tensor whose buffer nothing else holds, for writing in place.
fn values_mut<H: Half>(t: &mut FlexTensor) -> Option<&mut [H]> {
    let (start, end) = t.layout().contiguous_offsets()?;
    t.try_storage_mut::<H>()
        .map(|storage| &mut storage[start..end])
}

fn output<H: Half>(values: Vec<u16>, layout: Layout) -> FlexTensor {
    FlexTensor::new(Bytes::from_elems(values), layout, H::dtype())
}

/// Whether the kernels take `t`: a tensor whose values lie contiguous, in order. The caller
/// hands any other to Flex.
pub(crate) fn fits(t: &FlexTensor) -> bool {
    t.layout().is_contiguous()
}

/// `f` of every value of a half tensor that [`fits`], in its dtype: in place where nothing
/// else holds its buffer (as Flex's own unary ops do), else into a new one.
pub(crate) fn map<H: Half>(mut t: FlexTensor, f: impl Fn(f32) -> f32 + Sync) -> FlexTensor {
    if let Some(values) = values_mut::<H>(&mut t) {
        kernels::map_in_place(values, f);
        return t;
    }
    let src = values::<H>(&t).expect("map takes tensors that fit");
    let out = kernels::map_to(src, f);
    output::<H>(out, Layout::contiguous(t.layout().shape().clone()))
}

/// `f(a, b)` of two half tensors of one shape that [`fits`], value by value: in place in `b`'s
/// buffer where nothing else holds it, else into a new one.
pub(crate) fn zip<H: Half>(
    a: &FlexTensor,
    mut b: FlexTensor,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> FlexTensor {
    assert_eq!(
        a.layout().shape(),
        b.layout().shape(),
        "zip takes tensors of one shape"
    );
    let xs = values::<H>(a).expect("zip takes tensors that fit");
    if let Some(ys) = values_mut::<H>(&mut b) {
        kernels::zip_in_place(xs, ys, f);
        return b;
    }
    let ys = values::<H>(&b).expect("zip takes tensors that fit");
    let out = kernels::zip_to(xs, ys, f);
    output::<H>(out, Layout::contiguous(b.layout().shape().clone()))
}

/// The sum over the rows of a contiguous `[m, n]` half tensor, `n` values: f32 sums taken row
/// after row, rounded once, as Flex's `sum_dim(0)` on half tensors (same order, same bits).
pub(crate) fn sum_rows<H: Half>(t: &FlexTensor) -> Option<Vec<H>> {
    let shape = t.layout().shape();
    if shape.num_dims() != 2 {
        return None;
    }
    Some(kernels::sum_rows(values::<H>(t)?, shape[1]))
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{DType, TensorData};
    use burn_backend::FloatDType;
    use burn_backend::ops::{ActivationOps, FloatTensorOps};
    use half::bf16;

    use super::*;

    // Ordinary values, signed zeros, ties, values past f16's range, infinities and NaN.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 40_000) as f32 / 97.0 - 206.0)
            .collect();
        let special = [
            0.0,
            -0.0,
            1.0 + f32::EPSILON,
            65520.0,
            -7e4,
            f32::INFINITY,
            f32::NAN,
        ];
        for (slot, value) in v.iter_mut().step_by(37).zip(special.iter().cycle()) {
            *slot = *value;
        }
        v
    }

    fn half(v: Vec<f32>, shape: [usize; 2], dtype: FloatDType) -> FlexTensor {
        Flex::float_cast(FlexTensor::from_data(TensorData::new(v, shape)), dtype)
    }

    fn bits(t: FlexTensor) -> Vec<u8> {
        t.into_data().bytes.to_vec()
    }

    const DTYPES: [FloatDType; 2] = [FloatDType::BF16, FloatDType::F16];

    // A tensor of a few blocks, and one of more than three parallel tasks (`TASK`), neither a
    // whole number of them.
    const SHAPES: [[usize; 2]; 2] = [[37, 29], [700, 301]];

    #[test]
    fn map_and_zip_give_flexs_own_bits_in_place_or_not() {
        let relu = |x: f32| if x > 0.0 { x } else { 0.0 };
        let sum = |x: f32, y: f32| x + y;
        // Not a multiple of the block, so the last block is short; and the same in more than
        // three parallel tasks, the last one short too.
        for (dtype, [m, n]) in DTYPES.into_iter().flat_map(|d| SHAPES.map(|s| (d, s))) {
            let a = half(values(m * n, 1), [m, n], dtype);
            let b = half(values(m * n, 2), [m, n], dtype);
            let (want_relu, want_sum) =
                (Flex::relu(a.clone()), Flex::float_add(a.clone(), b.clone()));
            // Shared buffers (the clones held here) get new ones; unshared ones are reused.
            let shared = with_half!(a.dtype(), H => map::<H>(a.clone(), relu), _ => unreachable!());
            assert_eq!(bits(shared), bits(want_relu.clone()), "{dtype:?} relu");
            let sum_shared =
                with_half!(a.dtype(), H => zip::<H>(&a, b.clone(), sum), _ => unreachable!());
            assert_eq!(bits(sum_shared), bits(want_sum.clone()), "{dtype:?} add");
            let (a_bytes, b_bytes) = (a.bytes().as_ptr(), b.bytes().as_ptr());
            let sum_own = with_half!(a.dtype(), H => zip::<H>(&a, b, sum), _ => unreachable!());
            assert_eq!(sum_own.bytes().as_ptr(), b_bytes, "zip reuses b's buffer");
            assert_eq!(bits(sum_own), bits(want_sum), "{dtype:?} add in place");
            let own = with_half!(a.dtype(), H => map::<H>(a, relu), _ => unreachable!());
            assert_eq!(
                own.bytes().as_ptr(),
                a_bytes,
                "map reuses its input's buffer"
            );
            assert_eq!(bits(own), bits(want_relu), "{dtype:?} relu in place");
        }
        // A transposed view does not fit; a slice of rows does.
        let a = half(values(8 * 6, 3), [8, 6], FloatDType::BF16);
        assert!(!fits(&Flex::float_swap_dims(a.clone(), 0, 1)));
        let rows = Flex::float_slice(a, &[burn::tensor::Slice::new(2, Some(5), 1)]);
        assert!(fits(&rows));
        let want = Flex::relu(rows.clone());
        let fast = map::<bf16>(rows, relu);
        assert_eq!(bits(fast), bits(want), "a slice at an offset");
    }

    #[test]
    fn epilogue_and_row_sums_give_flexs_own_bits() {
        for (dtype, [m, n]) in DTYPES.into_iter().flat_map(|d| SHAPES.map(|s| (d, s))) {
            let product = FlexTensor::from_data(TensorData::new(values(m * n, 3), [m, n]));
            let bias = Flex::float_cast(
                FlexTensor::from_data(TensorData::new(values(n, 4), [n])),
                dtype,
            );
            let flex = Flex::float_add(
                Flex::float_cast(product.clone(), dtype),
                Flex::float_reshape(bias.clone(), [1, n].into()),
            );
            let fast = with_half!(DType::from(dtype), H => {
                let out = round_add_row::<H>(product.storage(), Some(bias.storage()));
                output::<H>(out, Layout::contiguous([m, n].into()))
            }, _ => unreachable!());
            assert_eq!(bits(fast), bits(flex.clone()), "{dtype:?} epilogue");

            let flex_sum = Flex::float_sum_dim(flex.clone(), 0);
            let fast_sum = with_half!(DType::from(dtype), H => {
                let sums = Bytes::from_elems(sum_rows::<H>(&flex).unwrap());
                FlexTensor::new(sums, Layout::contiguous([1, n].into()), H::dtype())
            }, _ => unreachable!());
            assert_eq!(bits(fast_sum), bits(flex_sum), "{dtype:?} row sums");
        }
    }
}
