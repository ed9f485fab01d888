//! Autocast's lower-class matmul and linear on Flex, whose own half-precision GEMMs are slow.
//!
//! Flex 0.21 multiplies bf16 matrices by copying both to contiguous f32 with a scalar loop,
//! running its f32 GEMM, and rounding the result back, element by element
//! (`matmul_bf16` in `burn-flex-0.21.0/src/ops/matmul.rs`; f16 goes through the `gemm` crate's
//! f16 kernels, slower still). Here the product is computed one of two ways, and rounded to
//! the half type, a linear's bias added as it is rounded:
//!
//! - bf16 on a CPU with AMX or AVX512-BF16: the GEMM of [`bf16_gemm`] on its tiles or dot
//!   products, which reads (or packs) the bf16 operands in place (transposed views too), sums
//!   in f32, about 1.5–2× as fast as the f32 GEMM on dot products, and rounds each block of
//!   the product as the task that summed it ends, so that no f32 product goes out to memory;
//! - otherwise (and on [`Route::Widened`]): the half operands widened to f32 in one
//!   vectorised pass, a transposed view kept transposed, and multiplied by Flex's f32 GEMM
//!   (the `gemm` crate, called directly) into per-thread scratch, then rounded in one pass:
//!   for bf16, Flex's own bits.
//!
//! Either way: the numbers of a half-precision GEMM with f32 accumulation, the operands kept
//! in the half type (what autodiff saves for the backward pass stays half the size).
//!
//! As for the fast cast, the replacement under autodiff is a backward node of its own
//! ([`gemm_tracked`], [`linear_tracked`]), which takes the forward's route for the backward
//! GEMMs. The operands are half matrices of the same dtype, 2-D or batches of the same
//! leading dimensions (no broadcasting); the decorator checks that, and which route the
//! process runs, before it calls in (`crate::backend::lowered`).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::Bytes;
use burn_backend::DType;
use burn_backend::ops::{FloatTensorOps, ModuleOps};
use burn_backend::tensor::FloatTensor;
use half::bf16;

use burn_accelerate_kernels::bf16_gemm::{
    self, Bf16Kernel, Bf16Matrix, Epilogue, Finish, Packed, Product, SCRATCH_KEPT, release_large,
    scratch_of, with_scratch,
};
use burn_accelerate_kernels::f32_gemm::{Kernel, f32_gemm, large, parallel};
use burn_accelerate_kernels::several_threads;
use burn_accelerate_kernels::tasks::for_each_chunk;

use super::Route;
use super::half_kernels::{
    add_row, add_widened, round_add_row, sum_rows, widen_in_tasks, widened, with_half,
};

// Scratch for one GEMM's operands widened to f32 and its f32 product, kept per thread: a
// fresh buffer is mapped and page-faulted in on every call, which costs as much again as
// filling it.
#[derive(Default)]
struct Scratch {
    widened: [Vec<f32>; 2],
    product: Vec<f32>,
}

impl Scratch {
    fn release_large(&mut self) {
        self.widened.iter_mut().for_each(release_large);
        release_large(&mut self.product);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
    // The bf16 GEMM's packed operands, per thread: the matrices of a batch may be multiplied
    // on several.
    static PACKED: RefCell<Packed> = RefCell::default();
}

/// The CPU's bf16 GEMM for bf16 operands where it has one, unless the route is
/// [`Route::Widened`]; Flex's f32 GEMM over the widened operands otherwise.
pub(crate) fn kernel_for(dtype: DType, route: Route) -> Kernel {
    match dtype {
        DType::BF16 => Kernel::for_bf16(route == Route::Widened),
        _ => Kernel::F32,
    }
}

// The half matrix (or batch of matrices) `t` widened into `buf`, keeping a transposed (or
// otherwise permuted) view as it is, since the GEMM reads strides: its strides in `buf`.
fn widen_into(t: &FlexTensor, buf: &mut Vec<f32>) -> Vec<usize> {
    let n = t.layout().num_elements();
    let stored = with_half!(t.dtype(), H => t.storage::<H>().len(), _ => unreachable!());
    let strides = t.layout().strides();
    let ordered = strides.iter().all(|s| *s >= 0);
    let dense = ordered && t.layout().start_offset() == 0 && stored == n;
    let t = if dense { t.clone() } else { t.to_contiguous() };
    let buf = scratch_of(buf, n);
    with_half!(t.dtype(), H => widen_in_tasks::<H>(t.storage(), buf), _ => unreachable!());
    t.layout()
        .strides()
        .iter()
        .map(|s| s.unsigned_abs())
        .collect()
}

// The sizes of a product of half matrices: its batch (the leading dimensions, the same
// in both operands) and `m × k` by `k × n`.
struct Dims {
    batch: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
}

impl Dims {
    fn of(a: &FlexTensor, b: &FlexTensor) -> Self {
        let (a, b) = (a.layout().shape(), b.layout().shape());
        let d = a.num_dims();
        Self {
            batch: a[..d - 2].to_vec(),
            m: a[d - 2],
            k: a[d - 1],
            n: b[d - 1],
        }
    }

    fn matrices(&self) -> usize {
        self.batch.iter().product()
    }

    // Where the `i`-th matrix of the batch starts in a tensor with `strides` (batch
    // dimensions first), and its (row, column) strides.
    fn matrix(&self, i: usize, strides: &[usize]) -> (usize, [usize; 2]) {
        let mut rest = i;
        let mut offset = 0;
        for (size, stride) in self.batch.iter().zip(strides).rev() {
            offset += rest % size * stride;
            rest /= size;
        }
        let d = self.batch.len();
        (offset, [strides[d], strides[d + 1]])
    }
}

// A layout's strides, if none is negative.
fn ordered_strides(t: &FlexTensor) -> Option<Vec<usize>> {
    t.layout()
        .strides()
        .iter()
        .map(|s| usize::try_from(*s).ok())
        .collect()
}

// `gemm(a_i, b_i, out_i)` for each matrix `i` of the batch of bf16 operands and its block
// `out_i` of `out`, the operands read in place, with the calling thread's packing scratch;
// false where it does not apply (negative strides) or a GEMM failed.
fn bf16_dot<T: Send>(
    a: &FlexTensor,
    b: &FlexTensor,
    dims: &Dims,
    out: &mut [T],
    gemm: impl Fn(Bf16Matrix, Bf16Matrix, &mut [T], bool, &mut Packed) -> Option<()> + Sync,
) -> bool {
    let (Some(a_strides), Some(b_strides)) = (ordered_strides(a), ordered_strides(b)) else {
        return false;
    };
    let (m, k, n) = (dims.m, dims.k, dims.n);
    // The batch's `i`-th matrix of `t`, read in place.
    fn matrix<'t>(
        t: &'t FlexTensor,
        (offset, strides): (usize, [usize; 2]),
        shape: [usize; 2],
    ) -> Option<Bf16Matrix<'t>> {
        let offset = t.layout().start_offset() + offset;
        Bf16Matrix::new(t.storage::<bf16>(), offset, shape, strides)
    }
    each_matrix(out, dims, |i, out| {
        let (Some(am), Some(bm)) = (
            matrix(a, dims.matrix(i, &a_strides), [m, k]),
            matrix(b, dims.matrix(i, &b_strides), [k, n]),
        ) else {
            return false;
        };
        with_scratch(&PACKED, |packed| {
            let done = gemm(am, bm, out, parallel(m, n, k), packed);
            packed.iter_mut().for_each(release_large);
            done.is_some()
        })
    })
}

// `a @ b` (+ `bias`) of bf16 operands by the bf16 `kernel`, each value rounded (and the bias
// added) as its task sums it; `None` where it does not apply (see `bf16_dot`).
fn bf16_dot_rounded(
    kernel: Bf16Kernel,
    a: &FlexTensor,
    b: &FlexTensor,
    bias: Option<&FlexTensor>,
    dims: &Dims,
) -> Option<Vec<bf16>> {
    let bias = bias.map(|bias| widened(bias.storage::<bf16>()));
    let add_bias = |column: usize, values: &mut [bf16]| {
        if let Some(bias) = &bias {
            add_widened(values, &bias[column..]);
        }
    };
    let epilogue: Option<Epilogue> = match bias {
        Some(_) => Some(&add_bias),
        None => None,
    };
    let len = dims.matrices() * dims.m * dims.n;
    let mut values = Vec::with_capacity(len);
    let out = &mut values.spare_capacity_mut()[..len];
    let done = bf16_dot(a, b, dims, out, |am, bm, out, threads, packed| {
        let product = Product::Bf16 {
            out,
            finish: Finish::Rows(epilogue),
        };
        bf16_gemm::gemm_on(kernel, am, bm, product, threads, packed)
    });
    // SAFETY: each matrix's GEMM wrote all its values (none failed), and the matrices cover
    // the product.
    done.then(|| unsafe {
        values.set_len(len);
        values
    })
}

// `product = a @ b` by Flex's f32 GEMM over the operands widened to f32, matrix by matrix
// of the batch.
fn widened_product(a: &FlexTensor, b: &FlexTensor, dims: &Dims, scratch: &mut Scratch) {
    let (m, k, n) = (dims.m, dims.k, dims.n);
    let [wa, wb] = &mut scratch.widened;
    let (a_strides, b_strides) = (widen_into(a, wa), widen_into(b, wb));
    let product = scratch_of(&mut scratch.product, dims.matrices() * m * n);
    let (wa, wb) = (&wa[..], &wb[..]);
    let done = each_matrix(product, dims, |i, c| {
        let (a_offset, a_matrix) = dims.matrix(i, &a_strides);
        let (b_offset, b_matrix) = dims.matrix(i, &b_strides);
        f32_gemm(
            (&wa[a_offset..], a_matrix),
            (&wb[b_offset..], b_matrix),
            [m, k, n],
            c,
            parallel(m, n, k),
        )
        .is_some()
    });
    assert!(done, "widened operands fit their buffers");
}

// `f(i, c)` for each matrix `i` of the batch and its block `c` of the product: matrix
// after matrix where each GEMM takes all threads, on rayon's threads where the matrices
// are too small to share out one by one (attention's, say). False if any `f` was.
fn each_matrix<T: Send>(
    product: &mut [T],
    dims: &Dims,
    f: impl Fn(usize, &mut [T]) -> bool + Sync,
) -> bool {
    let size = (dims.m * dims.n).max(1);
    let parallel = dims.matrices() > 1 && several_threads() && !large(dims.m, dims.n, dims.k);
    // Once one matrix failed the product is computed another way: the rest are skipped.
    let failed = AtomicBool::new(false);
    for_each_chunk(product, size, parallel, |i, c| {
        if !failed.load(Ordering::Relaxed) && !f(i, c) {
            failed.store(true, Ordering::Relaxed);
        }
    });
    !failed.into_inner()
}

/// `a @ b + bias` of half matrices: f32 sums of the products, rounded once to the half
/// type, the bias (if any) added to the rounded product in the half type.
fn half_gemm(
    a: &FlexTensor,
    b: &FlexTensor,
    bias: Option<&FlexTensor>,
    kernel: Kernel,
) -> FlexTensor {
    let dtype = a.dtype();
    let dims = Dims::of(a, b);
    let len = dims.matrices() * dims.m * dims.n;
    let bias = bias.map(|b| b.to_contiguous());
    let dot = match kernel {
        Kernel::Bf16(kernel) if dtype == DType::BF16 => Some(kernel),
        _ => None,
    };
    // A product larger than the kept scratch is rounded as summed (its f32 sums would be
    // mapped afresh for each GEMM, 16 MiB for a `4096 × 1024` one); a smaller one goes
    // through the scratch. Rounded as summed too, the MLP's step in `examples/autocast_ab`
    // took 7% longer under glibc's default allocator, which then mapped and faulted in a
    // fresh buffer 500 more times a step (and 2% less time where freed memory is kept).
    let rounded = match dot {
        Some(kernel) if len * size_of::<f32>() > SCRATCH_KEPT => {
            bf16_dot_rounded(kernel, a, b, bias.as_ref(), &dims).map(Bytes::from_elems)
        }
        _ => None,
    };
    let values = rounded.unwrap_or_else(|| {
        with_scratch(&SCRATCH, |scratch| {
            let product = scratch_of(&mut scratch.product, len);
            let summed = dot.is_some_and(|kernel| {
                let summed =
                    |am: Bf16Matrix, bm: Bf16Matrix, c: &mut [f32], threads, packed: &mut _| {
                        bf16_gemm::gemm_on(kernel, am, bm, Product::F32(c), threads, packed)
                    };
                bf16_dot(a, b, &dims, product, summed)
            });
            if !summed {
                widened_product(a, b, &dims, scratch);
            }
            let values = with_half!(dtype, H => {
                let bias = bias.as_ref().map(|b| b.storage::<H>());
                Bytes::from_elems(round_add_row::<H>(&scratch.product[..len], bias))
            }, _ => unreachable!("the hooks admit half operands only"));
            scratch.release_large();
            values
        })
    });
    let shape = [dims.batch, vec![dims.m, dims.n]].concat();
    FlexTensor::new(values, Layout::contiguous(shape.into()), dtype)
}

/// `a @ b` of two half matrices: f32 products and sums, rounded once to the half type.
pub(crate) fn gemm(a: FlexTensor, b: FlexTensor, route: Route) -> FlexTensor {
    let kernel = kernel_for(a.dtype(), route);
    half_gemm(&a, &b, None, kernel)
}

/// `x @ w + b` of half matrices as Burn's default linear computes it: the product rounded,
/// then the bias added in the half type; in one pass over the f32 product.
pub(crate) fn linear(
    x: FlexTensor,
    weight: FlexTensor,
    bias: Option<FlexTensor>,
    route: Route,
) -> FlexTensor {
    let kernel = kernel_for(x.dtype(), route);
    half_gemm(&x, &weight, bias.as_ref(), kernel)
}

/// `product + bias` of a half `[m, n]` product and an `[n]` bias, in the product's buffer
/// where nothing else holds it: [`linear_tracked`]'s bias add.
pub(crate) fn add_bias(product: FlexTensor, bias: FlexTensor) -> FlexTensor {
    // `to_contiguous` of a contiguous tensor is a second handle on its buffer: while `product`
    // lived too, writing the sum copied the whole product first (8 MiB a layer of the deep
    // MLP, on the calling thread).
    let layout = product.layout();
    let stored = with_half!(product.dtype(), H => product.storage::<H>().len(), _ => 0);
    let whole =
        layout.is_contiguous() && layout.start_offset() == 0 && stored == layout.num_elements();
    let mut sum = match whole {
        true => product,
        false => product.to_contiguous(),
    };
    let bias = bias.to_contiguous();
    with_half!(sum.dtype(), H => {
        add_row::<H>(sum.storage_mut::<H>(), bias.storage::<H>());
    }, _ => unreachable!("the hooks admit half operands only"));
    sum
}

/// The bias's gradient: the output's summed over the batch, as Burn's
/// `linear_bias_backward`, in one vectorised pass where the gradient is contiguous
/// ([`linear_tracked`]'s).
pub(crate) fn bias_grad(grad: FlexTensor) -> FlexTensor {
    let n = grad.layout().shape()[1];
    let sums = with_half!(grad.dtype(), H => {
        sum_rows::<H>(&grad).map(Bytes::from_elems)
    }, _ => None);
    match sums {
        Some(values) => FlexTensor::new(values, Layout::contiguous([n].into()), grad.dtype()),
        None => Flex::linear_bias_backward(grad),
    }
}

/// The matrices of `t` transposed (its last two dimensions swapped), as a view.
pub(crate) fn transposed(t: FlexTensor) -> FlexTensor {
    let d = t.layout().shape().num_dims();
    Flex::float_swap_dims(t, d - 2, d - 1)
}

/// [`gemm()`] as a node of Burn's autodiff: the gradients are GEMMs of the same route.
pub(crate) fn gemm_tracked(
    a: FloatTensor<Autodiff<Flex>>,
    b: FloatTensor<Autodiff<Flex>>,
    route: Route,
) -> FloatTensor<Autodiff<Flex>> {
    #[derive(Debug)]
    struct Gemm {
        route: Route,
    }

    impl Backward<Flex, 2> for Gemm {
        type State = (Option<FlexTensor>, Option<FlexTensor>);

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let (a, b) = ops.state;
            let route = self.route;
            binary::<Flex, _, _>(
                ops.parents,
                ops.node,
                grads,
                |grad| gemm(grad, transposed(b.expect("kept for a's gradient")), route),
                |grad| gemm(transposed(a.expect("kept for b's gradient")), grad, route),
            );
        }
    }

    let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
    match (Gemm { route })
        .prepare::<NoCheckpointing>([a.node.clone(), b.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            // Each operand is needed for the other's gradient only.
            let state = (
                b_tracked.then(|| a.primitive.clone()),
                a_tracked.then(|| b.primitive.clone()),
            );
            prep.finish(state, gemm(a.primitive, b.primitive, route))
        }
        OpsKind::UnTracked(prep) => prep.finish(gemm(a.primitive, b.primitive, route)),
    }
}

/// [`linear`] as nodes of Burn's autodiff: the product's, and the bias add's.
pub(crate) fn linear_tracked(
    x: FloatTensor<Autodiff<Flex>>,
    weight: FloatTensor<Autodiff<Flex>>,
    bias: Option<FloatTensor<Autodiff<Flex>>>,
    route: Route,
) -> FloatTensor<Autodiff<Flex>> {
    let Some(bias) = bias else {
        return gemm_tracked(x, weight, route);
    };
    #[derive(Debug)]
    struct Bias;

    // The bias's gradient is the sum of the output's over the batch, as Burn's
    // `linear_bias_backward`; the product's goes on unchanged.
    impl Backward<Flex, 2> for Bias {
        type State = ();

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            binary::<Flex, _, _>(ops.parents, ops.node, grads, |grad| grad, bias_grad);
        }
    }

    let product = gemm_tracked(x, weight, route);
    let parents = [product.node.clone(), bias.node.clone()];
    // The product's own node keeps no reference to it: the sum can take its place.
    let output = add_bias(product.primitive, bias.primitive);
    Bias.prepare::<NoCheckpointing>(parents)
        .compute_bound()
        .stateless(output)
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use burn_backend::FloatDType;

    use super::*;

    fn half<const D: usize>(values: Vec<f32>, shape: [usize; D], dtype: FloatDType) -> FlexTensor {
        Flex::float_cast(FlexTensor::from_data(TensorData::new(values, shape)), dtype)
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 300.0 - 3.3)
            .collect()
    }

    fn bits(t: FlexTensor) -> Vec<u8> {
        t.into_data().bytes.to_vec()
    }

    #[test]
    fn bf16_gemm_widened_gives_flexs_own_bits_transposed_or_not() {
        let a = half(values(6 * 5, 1), [6, 5], FloatDType::BF16);
        let b = half(values(5 * 7, 2), [5, 7], FloatDType::BF16);
        let widened = |a: &FlexTensor, b: &FlexTensor| half_gemm(a, b, None, Kernel::F32);
        assert_eq!(
            bits(widened(&a, &b)),
            bits(Flex::float_matmul(a.clone(), b.clone()))
        );
        // Transposed views, as the backward pass multiplies them.
        let at = transposed(half(values(5 * 6, 3), [5, 6], FloatDType::BF16));
        let bt = transposed(half(values(7 * 5, 4), [7, 5], FloatDType::BF16));
        assert_eq!(bits(widened(&at, &bt)), bits(Flex::float_matmul(at, bt)));
        // A batch of matrices, one operand transposed, as attention multiplies them.
        let q = half(values(2 * 3 * 6 * 5, 5), [2, 3, 6, 5], FloatDType::BF16);
        let k = transposed(half(
            values(2 * 3 * 7 * 5, 6),
            [2, 3, 7, 5],
            FloatDType::BF16,
        ));
        let product = widened(&q, &k);
        assert_eq!(product.layout().shape().to_vec(), vec![2, 3, 6, 7]);
        assert_eq!(bits(product), bits(Flex::float_matmul(q, k)));
    }

    /// `kernel`'s bf16 products are within a bf16 rounding of the widened ones.
    fn assert_within_a_bf16_rounding_of_widened(kernel: Bf16Kernel) {
        assert!(
            kernel.runs_here(),
            "not run: this test needs a CPU that runs {kernel:?}"
        );
        // Positive values: no cancellation, so the two f32 sums (in different orders)
        // differ far below a bf16 rounding, and their roundings by one bf16 step at most.
        let positive = |n, seed| values(n, seed).iter().map(|v| v + 3.4).collect();
        let a = half(positive(9 * 40, 1), [9, 40], FloatDType::BF16);
        let b = half(positive(40 * 35, 2), [40, 35], FloatDType::BF16);
        // A row view from the second row: a layout with an offset.
        let a_rows = Flex::float_slice(a.clone(), &[burn::tensor::Slice::from(1..9)]);
        let cases = [
            (a.clone(), b.clone()),
            (a_rows, b.clone()),
            // A column-major b, as a transposed weight.
            (a, transposed(transposed(b).to_contiguous())),
            // A batch of matrices, one operand transposed, as attention multiplies them.
            (
                half(positive(2 * 3 * 9 * 40, 3), [2, 3, 9, 40], FloatDType::BF16),
                transposed(half(
                    positive(2 * 3 * 35 * 40, 4),
                    [2, 3, 35, 40],
                    FloatDType::BF16,
                )),
            ),
        ];
        for (a, b) in cases {
            let values = |t: FlexTensor| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
            let dot = values(half_gemm(&a, &b, None, Kernel::Bf16(kernel)));
            let widened = values(half_gemm(&a, &b, None, Kernel::F32));
            for (d, w) in dot.iter().zip(&widened) {
                assert!((d - w).abs() <= w / 128.0, "{kernel:?}: {d} against {w}");
            }
        }
    }

    #[test]
    fn bf16_gemm_on_the_tile_model_is_within_a_bf16_rounding_of_widened() {
        assert_within_a_bf16_rounding_of_widened(Bf16Kernel::TileModel);
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn bf16_gemm_by_dot_products_is_within_a_bf16_rounding_of_widened() {
        assert_within_a_bf16_rounding_of_widened(Bf16Kernel::DotProducts);
    }

    #[test]
    #[ignore = "needs a CPU with AMX-BF16 (on_amx_tiles): .ci/run runs it with --ignored where the CPU has it"]
    fn bf16_gemm_on_amx_tiles_is_within_a_bf16_rounding_of_widened() {
        assert_within_a_bf16_rounding_of_widened(Bf16Kernel::Tiles);
    }

    /// A linear's bias is added to `kernel`'s rounded product as Flex adds it.
    fn assert_bias_added_as_flex_adds_it(kernel: Kernel) {
        // Wider than a task of the dot-product kernel (256 columns), so that runs of a row
        // start past the bias's first value.
        let (m, k, n) = (50, 40, 300);
        let x = half(values(m * k, 7), [m, k], FloatDType::BF16);
        let w = half(values(k * n, 8), [k, n], FloatDType::BF16);
        let bias = half(values(n, 9), [n], FloatDType::BF16);
        let product = half_gemm(&x, &w, None, kernel);
        let row = Flex::float_reshape(bias.clone(), [1, n].into());
        let want = Flex::float_add(product, row);
        assert_eq!(
            bits(half_gemm(&x, &w, Some(&bias), kernel)),
            bits(want),
            "{kernel:?}"
        );
    }

    #[test]
    fn a_linears_bias_is_added_to_the_rounded_product_as_flex_adds_it_on_the_widened_kernel() {
        assert_bias_added_as_flex_adds_it(Kernel::F32);
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn a_linears_bias_is_added_to_the_rounded_product_as_flex_adds_it_on_the_dot_kernel() {
        assert!(
            Bf16Kernel::DotProducts.runs_here(),
            "not run: this test needs a CPU with AVX512-BF16"
        );
        assert_bias_added_as_flex_adds_it(Kernel::Bf16(Bf16Kernel::DotProducts));
    }

    #[test]
    fn a_linears_bias_is_added_to_the_rounded_product_as_flex_adds_it_on_the_tile_model() {
        assert_bias_added_as_flex_adds_it(Kernel::Bf16(Bf16Kernel::TileModel));
    }

    /// `kernel`'s product rounded as its tasks sum it has the bits of its f32 product rounded
    /// after.
    fn assert_rounded_as_summed_is_rounded_after(kernel: Bf16Kernel) {
        assert!(
            kernel.runs_here(),
            "not run: this test needs a CPU that runs {kernel:?}"
        );
        // Past a task's 256 columns; with and without a bias; a batch with one operand
        // transposed.
        let (m, k, n) = (50, 40, 300);
        let x = half(values(m * k, 7), [m, k], FloatDType::BF16);
        let w = half(values(k * n, 8), [k, n], FloatDType::BF16);
        let bias = half(values(n, 9), [n], FloatDType::BF16);
        let q = half(values(2 * 3 * 6 * 5, 5), [2, 3, 6, 5], FloatDType::BF16);
        let kt = transposed(half(
            values(2 * 3 * 7 * 5, 6),
            [2, 3, 7, 5],
            FloatDType::BF16,
        ));
        let cases = [(&x, &w, Some(&bias)), (&x, &w, None), (&q, &kt, None)];
        for (a, b, bias) in cases {
            let dims = Dims::of(a, b);
            let rounded = bf16_dot_rounded(kernel, a, b, bias, &dims).unwrap();
            let after = half_gemm(a, b, bias, Kernel::Bf16(kernel));
            assert_eq!(bytemuck::cast_slice::<_, u8>(&rounded), &bits(after)[..]);
        }
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn a_product_rounded_as_summed_has_the_bits_of_one_rounded_after() {
        assert_rounded_as_summed_is_rounded_after(Bf16Kernel::DotProducts);
    }

    #[test]
    fn a_product_rounded_as_summed_on_the_tile_model_has_the_bits_of_one_rounded_after() {
        assert_rounded_as_summed_is_rounded_after(Bf16Kernel::TileModel);
    }

    /// A batch whose one operand is broadcast (expanded as a view, stride 0 over the batch, as
    /// autocast's matmul hands it over) gives `kernel`'s bits of the same product with that
    /// operand copied out whole, on both sides, transposed or not.
    fn assert_a_broadcast_batch_gives_the_bits_of_its_operands_copied_out(kernel: Bf16Kernel) {
        assert!(
            kernel.runs_here(),
            "not run: this test needs a CPU that runs {kernel:?}"
        );
        let bf16 = |n, seed, shape: [usize; 4]| half(values(n, seed), shape, FloatDType::BF16);
        let expand = |t: FlexTensor, shape: [usize; 4]| Flex::float_expand(t, shape.into());
        // Shared keys [1, 3, 7, 33] (transposed), queries [2, 3, 17, 33]: m, n and k off the
        // tiles' 16 and 32; and the queries shared instead, [2, 1, ...] against [2, 3, ...].
        let q = bf16(2 * 3 * 17 * 33, 1, [2, 3, 17, 33]);
        let k_shared = transposed(bf16(3 * 7 * 33, 2, [1, 3, 7, 33]));
        let q_shared = bf16(2 * 17 * 33, 3, [2, 1, 17, 33]);
        let k = transposed(bf16(2 * 3 * 7 * 33, 4, [2, 3, 7, 33]));
        let cases = [
            (q.clone(), expand(k_shared, [2, 3, 33, 7])),
            (expand(q_shared, [2, 3, 17, 33]), k),
        ];
        for (a, b) in cases {
            let product = half_gemm(&a, &b, None, Kernel::Bf16(kernel));
            assert_eq!(product.layout().shape().to_vec(), vec![2, 3, 17, 7]);
            let whole = half_gemm(
                &a.to_contiguous(),
                &b.to_contiguous(),
                None,
                Kernel::Bf16(kernel),
            );
            assert_eq!(bits(product), bits(whole), "{kernel:?}");
        }
    }

    #[test]
    fn a_broadcast_batch_on_the_tile_model_gives_the_bits_of_its_operands_copied_out() {
        assert_a_broadcast_batch_gives_the_bits_of_its_operands_copied_out(Bf16Kernel::TileModel);
    }

    #[test]
    #[ignore = "needs a CPU with AVX512-BF16: .ci/run runs it with --ignored where the CPU has it"]
    fn a_broadcast_batch_by_dot_products_gives_the_bits_of_its_operands_copied_out() {
        assert_a_broadcast_batch_gives_the_bits_of_its_operands_copied_out(Bf16Kernel::DotProducts);
    }

    #[test]
    #[ignore = "needs a CPU with AMX-BF16 (on_amx_tiles): .ci/run runs it with --ignored where the CPU has it"]
    fn a_broadcast_batch_on_amx_tiles_gives_the_bits_of_its_operands_copied_out() {
        assert_a_broadcast_batch_gives_the_bits_of_its_operands_copied_out(Bf16Kernel::Tiles);
    }

    #[test]
    fn a_bias_is_added_in_the_products_own_buffer_where_it_is_whole() {
        let (m, n) = (6, 5);
        let bias = half(values(n, 1), [n], FloatDType::BF16);
        let row = Flex::float_reshape(bias.clone(), [1, n].into());
        let product = half(values(m * n, 2), [m, n], FloatDType::BF16);
        let want = bits(Flex::float_add(product.clone(), row.clone()));
        let at = product.storage::<bf16>().as_ptr();
        let sum = add_bias(product, bias.clone());
        assert_eq!(
            sum.storage::<bf16>().as_ptr(),
            at,
            "the product's buffer was copied"
        );
        assert_eq!(bits(sum), want);
        // Rows 1.. of a larger product: a view past its buffer's start, summed into a copy.
        let rows = half(values((m + 1) * n, 3), [m + 1, n], FloatDType::BF16);
        let view = Flex::float_slice(rows, &[burn::tensor::Slice::from(1..m + 1)]);
        let want = bits(Flex::float_add(view.clone(), row));
        assert_eq!(bits(add_bias(view, bias)), want);
    }

    #[test]
    fn f16_gemm_is_the_f32_product_rounded_once() {
        let (av, bv) = (values(8 * 16, 5), values(16 * 3, 6));
        let a = half(av.clone(), [8, 16], FloatDType::F16);
        let b = half(bv.clone(), [16, 3], FloatDType::F16);
        let wide = |t: &FlexTensor| Flex::float_cast(t.clone(), FloatDType::F32);
        let exact = Flex::float_matmul(wide(&a), wide(&b));
        let want = Flex::float_cast(exact, FloatDType::F16);
        assert_eq!(bits(gemm(a, b, Route::Fastest)), bits(want));
    }
}
