//! Softmax and log-softmax along the last dimension on Flex, one fused pass per row on every
//! core, with their autodiff nodes.
//!
//! Autocast runs softmax in f32 (its fp32 class). On `Autodiff<Flex>`, Burn computes it as
//! the default composition of `ActivationOps`: `max_dim`, `sub`, `exp`, `sum_dim` and `div`,
//! five passes over the tensor through Flex's one-threaded `unary_op` with libm's scalar
//! `expf`, and a backward of as many more. For a transformer's attention weights
//! (`[batch, heads, seq, seq]`) that was a large share of a training step. Here each row is
//! one task: its max, `exp(x - max)` written in place, the sum, the scaling, all while the
//! row is in L1, rows spread over rayon's threads; the backward node keeps the output `y` and
//! computes `dx = y · (g - Σ g·y)` row by row, in one pass. Log-softmax likewise:
//! `y = (x - max) - ln Σ exp(x - max)`, and `dx = g - exp(y) · Σ g`.
//!
//! The rows' arithmetic, its accuracy (within `(6 + n/16 + |x - max|) · 2⁻²⁴` relative of the
//! f64 softmax) and its three compilations that give the same bits are
//! `burn_accelerate_kernels::softmax`'s; here Flex's tensors are handed to it, in place where
//! their buffer is their own, rows shared among rayon's threads.
//!
//! Taken for contiguous f32 tensors along their last dimension, and for bf16 and f16 tensors
//! along their last dimension, which autocast would first cast to f32: each row is widened
//! into the f32 output as it is read (widening is exact, so the bits are those of the cast
//! and the f32 softmax), and the backward rounds each row's gradient back to the input's type
//! as the cast's node would, while the row is in L1. Attention's scores are a transformer's
//! largest tensor; their f32 copy, its fresh pages and the gradient's were a few percent of a
//! bf16 step. Anything else (another dimension, a strided f32 view, f64) goes to Flex's own
//! softmax or to Burn's composition on `Autodiff<Flex>`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Bytes, DType};
use burn_backend::FloatDType;
use burn_backend::ops::{ActivationOps, FloatTensorOps};
use burn_backend::tensor::FloatTensor;

use burn_accelerate_kernels::half::{Half, as_half, half_buffer};
use burn_accelerate_kernels::isa::Isa;
use burn_accelerate_kernels::softmax as rows;
use half::{bf16, f16};

use super::fast_cast;

use super::half_kernels::in_row_tasks;

/// Which of the two the kernels compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Softmax,
    LogSoftmax,
}

impl Kind {
    /// The kernel's rows of `len` values, in place.
    fn rows(self, isa: Isa, rows: &mut [f32], len: usize) {
        match self {
            Kind::Softmax => rows::softmax(isa, rows, len),
            Kind::LogSoftmax => rows::log_softmax(isa, rows, len),
        }
    }

    /// The gradient of the kernel's input rows from its output rows `ys` and their gradient
    /// `grads`, in place of `grads`.
    fn backward_rows(self, isa: Isa, ys: &[f32], grads: &mut [f32], len: usize) {
        match self {
            Kind::Softmax => rows::softmax_backward(isa, ys, grads, len),
            Kind::LogSoftmax => rows::log_softmax_backward(isa, ys, grads, len),
        }
    }
}

/// The length of `t`'s rows where the kernels take a softmax of `t` along `dim`: an f32 tensor
/// whose values lie contiguous, in order, `dim` its last, not empty.
fn rows_of(t: &FlexTensor, dim: usize) -> Option<usize> {
    let shape = t.layout().shape();
    let rank = shape.num_dims();
    let takes = t.dtype() == DType::F32
        && rank >= 1
        && dim + 1 == rank
        && t.layout().is_contiguous()
        && shape.num_elements() > 0;
    takes.then(|| shape[rank - 1])
}

/// `t`'s values where nothing else holds its buffer, to be written in place.
fn values_mut(t: &mut FlexTensor) -> Option<&mut [f32]> {
    let (start, end) = t.layout().contiguous_offsets()?;
    t.try_storage_mut::<f32>()
        .map(|storage| &mut storage[start..end])
}

/// `f(rows)` on every whole-row chunk of `t`'s values (rows of `len`), in place where `t`'s
/// buffer is its own, else on a copy, which each task makes of its own rows.
/// `f(first, rows)`: `first` the chunk's first row.
fn rows_in_place(
    mut t: FlexTensor,
    len: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) -> FlexTensor {
    if let Some(values) = values_mut(&mut t) {
        in_row_tasks(len, values, f);
        return t;
    }
    let src = t
        .as_slice::<f32>()
        .expect("rows_of took a contiguous f32 tensor");
    // Zeros from `calloc`: fresh pages cost nothing until the tasks write them.
    let mut out = vec![0f32; src.len()];
    in_row_tasks(len, &mut out, |first, rows| {
        rows.copy_from_slice(&src[first * len..][..rows.len()]);
        f(first, rows)
    });
    FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(t.layout().shape().clone()),
        DType::F32,
    )
}

fn forward(t: FlexTensor, len: usize, kind: Kind, isa: Isa) -> FlexTensor {
    rows_in_place(t, len, |_, rows| kind.rows(isa, rows, len))
}

/// The length of `t`'s rows where the kernels take a softmax of the half tensor `t` along
/// `dim` widened to f32: a bf16 or f16 tensor along its last dimension, not empty (a view is
/// copied out first, as the cast would).
fn half_rows_of(t: &FlexTensor, dim: usize) -> Option<usize> {
    let shape = t.layout().shape();
    let rank = shape.num_dims();
    let takes = matches!(t.dtype(), DType::BF16 | DType::F16)
        && rank >= 1
        && dim + 1 == rank
        && shape.num_elements() > 0;
    takes.then(|| shape[rank - 1])
}

/// The softmax (or log-softmax) of the half tensor `t`, rows of `len`, each row widened into
/// the f32 output and computed there.
fn forward_widening(t: FlexTensor, len: usize, kind: Kind, isa: Isa) -> FlexTensor {
    fn rows_of_type<H: Half + burn_backend::Element>(
        t: &FlexTensor,
        len: usize,
        kind: Kind,
        isa: Isa,
    ) -> Vec<f32> {
        let start = t.layout().start_offset();
        let n = t.layout().shape().num_elements();
        let src = &t.storage::<H>()[start..start + n];
        // Zeros from `calloc`, as `rows_in_place`'s copy.
        let mut out = vec![0f32; n];
        in_row_tasks(len, &mut out, |first, rows| {
            H::widen(&src[first * len..][..rows.len()], rows);
            kind.rows(isa, rows, len);
        });
        out
    }
    let t = contiguous(t);
    let out = match t.dtype() {
        DType::BF16 => rows_of_type::<bf16>(&t, len, kind, isa),
        _ => rows_of_type::<f16>(&t, len, kind, isa),
    };
    FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(t.layout().shape().clone()),
        DType::F32,
    )
}

/// Softmax along `dim`: the fused kernel for a contiguous f32 tensor along its last dimension,
/// Flex's own otherwise.
pub(crate) fn softmax(tensor: FlexTensor, dim: usize) -> FlexTensor {
    match rows_of(&tensor, dim) {
        Some(len) => forward(tensor, len, Kind::Softmax, Isa::best()),
        None => Flex::softmax(tensor, dim),
    }
}

/// Log-softmax along `dim`, as [`softmax`] (Flex's own, Burn's composition, otherwise).
pub(crate) fn log_softmax(tensor: FlexTensor, dim: usize) -> FlexTensor {
    match rows_of(&tensor, dim) {
        Some(len) => forward(tensor, len, Kind::LogSoftmax, Isa::best()),
        None => Flex::log_softmax(tensor, dim),
    }
}

/// The f32 softmax along `dim` of a half tensor, as autocast's cast to f32 and then
/// [`softmax`] give it: widened row by row as read along the last dimension, cast first
/// otherwise.
pub(crate) fn softmax_of_half(tensor: FlexTensor, dim: usize) -> FlexTensor {
    match half_rows_of(&tensor, dim) {
        Some(len) => forward_widening(tensor, len, Kind::Softmax, Isa::best()),
        None => softmax(fast_cast::convert(tensor, FloatDType::F32), dim),
    }
}

/// The f32 log-softmax of a half tensor, as [`softmax_of_half`].
pub(crate) fn log_softmax_of_half(tensor: FlexTensor, dim: usize) -> FlexTensor {
    match half_rows_of(&tensor, dim) {
        Some(len) => forward_widening(tensor, len, Kind::LogSoftmax, Isa::best()),
        None => log_softmax(fast_cast::convert(tensor, FloatDType::F32), dim),
    }
}

/// The rows' length where the kernels take the backward of the output `y` with the gradient
/// `grad`: an f32 gradient of `y`'s shape, `y` one of their outputs (never otherwise for the
/// outputs the kernels make and the f32 gradients Burn hands back).
fn backward_rows_of(y: &FlexTensor, grad: &FlexTensor) -> Option<usize> {
    let shape = y.layout().shape();
    let fits = grad.dtype() == DType::F32 && grad.layout().shape() == shape;
    fits.then(|| rows_of(y, shape.num_dims() - 1)).flatten()
}

/// `t` itself where contiguous, else a contiguous copy.
fn contiguous(t: FlexTensor) -> FlexTensor {
    match t.layout().is_contiguous() {
        true => t,
        false => t.to_contiguous(),
    }
}

/// The gradient of the input of a softmax (or log-softmax) along the last dimension, from its
/// output `y` and the output's gradient `grad`.
fn backward(y: FlexTensor, grad: FlexTensor, kind: Kind, isa: Isa) -> FlexTensor {
    let Some(len) = backward_rows_of(&y, &grad) else {
        // The same formula in Flex's ops.
        return composed_backward(y, grad, kind);
    };
    let grad = contiguous(grad);
    let ys = y
        .as_slice::<f32>()
        .expect("rows_of took a contiguous f32 tensor");
    rows_in_place(grad, len, |first, rows| {
        kind.backward_rows(isa, &ys[first * len..][..rows.len()], rows, len)
    })
}

/// The gradient of the half input of a widening softmax (or log-softmax): [`backward`]'s
/// rows, each rounded to `dtype` while in cache, as the cast's node would round the whole
/// gradient after it.
fn backward_rounding(
    y: FlexTensor,
    grad: FlexTensor,
    kind: Kind,
    dtype: DType,
    isa: Isa,
) -> FlexTensor {
    fn rows_of_type<H: Half>(ys: &[f32], gs: &[f32], len: usize, kind: Kind, isa: Isa) -> Vec<u16> {
        let mut out = half_buffer(ys.len());
        in_row_tasks(len, &mut out, |first, out| {
            let ys = &ys[first * len..][..out.len()];
            let mut rows = gs[first * len..][..out.len()].to_vec();
            kind.backward_rows(isa, ys, &mut rows, len);
            H::round(&rows, as_half::<H>(out));
        });
        out
    }
    let Some(len) = backward_rows_of(&y, &grad) else {
        // The same formula in Flex's ops, then the cast.
        return fast_cast::convert(composed_backward(y, grad, kind), dtype.into());
    };
    let grad = contiguous(grad);
    let ys = y
        .as_slice::<f32>()
        .expect("rows_of took a contiguous f32 tensor");
    let gs = grad.as_slice::<f32>().expect("made contiguous above");
    let out = match dtype {
        DType::BF16 => rows_of_type::<bf16>(ys, gs, len, kind, isa),
        _ => rows_of_type::<f16>(ys, gs, len, kind, isa),
    };
    FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(y.layout().shape().clone()),
        dtype,
    )
}

fn composed_backward(y: FlexTensor, grad: FlexTensor, kind: Kind) -> FlexTensor {
    let last = y.layout().shape().num_dims() - 1;
    let grad = Flex::float_cast(grad, y.dtype().into());
    match kind {
        Kind::Softmax => {
            let dot = Flex::float_sum_dim(Flex::float_mul(grad.clone(), y.clone()), last);
            Flex::float_mul(y, Flex::float_sub(grad, dot))
        }
        Kind::LogSoftmax => {
            let sum = Flex::float_sum_dim(grad.clone(), last);
            Flex::float_sub(grad, Flex::float_mul(Flex::float_exp(y), sum))
        }
    }
}

/// The node both tracked forms record: it keeps the output, and the input's dtype where it
/// was a half type widened as read (its gradient rounded back to it).
#[derive(Debug)]
struct Node {
    kind: Kind,
    widened_from: Option<DType>,
}

impl Backward<Flex, 1> for Node {
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output = ops.state;
        let Node { kind, widened_from } = self;
        unary::<Flex, _>(ops.parents, ops.node, grads, |grad| match widened_from {
            Some(dtype) => backward_rounding(output, grad, kind, dtype, Isa::best()),
            None => backward(output, grad, kind, Isa::best()),
        });
    }
}

fn tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    len: usize,
    kind: Kind,
) -> FloatTensor<Autodiff<Flex>> {
    let node = tensor.node.clone();
    let widened_from = matches!(tensor.primitive.dtype(), DType::BF16 | DType::F16)
        .then(|| tensor.primitive.dtype());
    let output = match widened_from {
        Some(_) => forward_widening(tensor.primitive, len, kind, Isa::best()),
        None => forward(tensor.primitive, len, kind, Isa::best()),
    };
    let backward = Node { kind, widened_from };
    match backward
        .prepare::<NoCheckpointing>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(output.clone(), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

/// [`softmax`] as a node of Burn's autodiff, keeping the output for the backward pass; Burn's
/// own composition for what the kernel does not take.
pub(crate) fn softmax_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    dim: usize,
) -> FloatTensor<Autodiff<Flex>> {
    match rows_of(&tensor.primitive, dim) {
        Some(len) => tracked(tensor, len, Kind::Softmax),
        None => Autodiff::<Flex>::softmax(tensor, dim),
    }
}

/// [`log_softmax`] as a node of Burn's autodiff, as [`softmax_tracked`].
pub(crate) fn log_softmax_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    dim: usize,
) -> FloatTensor<Autodiff<Flex>> {
    match rows_of(&tensor.primitive, dim) {
        Some(len) => tracked(tensor, len, Kind::LogSoftmax),
        None => Autodiff::<Flex>::log_softmax(tensor, dim),
    }
}

/// [`softmax_of_half`] as one node of Burn's autodiff in place of the cast's and the
/// softmax's: it keeps the f32 output, and rounds the input's gradient to the input's type
/// as the cast's node would.
pub(crate) fn softmax_of_half_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    dim: usize,
) -> FloatTensor<Autodiff<Flex>> {
    match half_rows_of(&tensor.primitive, dim) {
        Some(len) => tracked(tensor, len, Kind::Softmax),
        None => softmax_tracked(fast_cast::convert_tracked(tensor, FloatDType::F32), dim),
    }
}

/// [`log_softmax_of_half`] as one node of Burn's autodiff, as [`softmax_of_half_tracked`].
pub(crate) fn log_softmax_of_half_tracked(
    tensor: FloatTensor<Autodiff<Flex>>,
    dim: usize,
) -> FloatTensor<Autodiff<Flex>> {
    match half_rows_of(&tensor.primitive, dim) {
        Some(len) => tracked(tensor, len, Kind::LogSoftmax),
        None => log_softmax_tracked(fast_cast::convert_tracked(tensor, FloatDType::F32), dim),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    // Every path this CPU runs: the portable fallback always.
    fn paths() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.supported()).collect()
    }

    fn tensor(values: Vec<f32>, shape: &[usize]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
    }

    fn values(t: FlexTensor) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    fn bits(t: FlexTensor) -> Vec<u32> {
        values(t).iter().map(|v| v.to_bits()).collect()
    }

    // Rows of `len` values, the kind attention makes: ordinary scores, large magnitudes,
    // masked entries (-1e4 and -∞), a fully masked row of each kind, a row of one value.
    fn rows(len: usize, count: usize, seed: u32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..(len * count) as u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503);
                (h % 20_000) as f32 / 1000.0 - 10.0
            })
            .collect();
        for (r, row) in v.chunks_mut(len).enumerate() {
            match r % 6 {
                1 => row.iter_mut().step_by(3).for_each(|x| *x = -1e4),
                2 => row
                    .iter_mut()
                    .skip(1)
                    .step_by(2)
                    .for_each(|x| *x = f32::NEG_INFINITY),
                3 => row
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = [80.0, -80.0, 1e4, -1e4][i % 4] * (1.0 + *x / 100.0)),
                4 if r == 4 => row.fill(-1e4),
                _ => {}
            }
        }
        v
    }

    fn softmax64(row: &[f32]) -> (Vec<f64>, f64, f64) {
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, x| m.max(f64::from(*x)));
        let exps: Vec<f64> = row.iter().map(|x| (f64::from(*x) - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        (exps.iter().map(|e| e / sum).collect(), max, sum)
    }

    const LENGTHS: [usize; 7] = [1, 7, 16, 17, 255, 257, 1000];

    #[test]
    fn softmax_and_log_softmax_against_f64() {
        for (len, count) in LENGTHS.iter().flat_map(|&len| [(len, 1), (len, 13)]) {
            let x = rows(len, count, len as u32);
            let mut by_path: Vec<(Vec<u32>, Vec<u32>)> = vec![];
            for isa in paths() {
                let t = || tensor(x.clone(), &[count, len]);
                let y = values(forward(t(), len, Kind::Softmax, isa));
                let log_y = values(forward(t(), len, Kind::LogSoftmax, isa));
                for (r, row) in x.chunks(len).enumerate() {
                    let (want, max, sum) = softmax64(row);
                    let n = len as f64;
                    for i in 0..len {
                        let (got, want) = (y[r * len + i], want[i]);
                        let shift = (f64::from(row[i]) - max).abs();
                        if shift.is_infinite() {
                            assert_eq!(got, 0.0, "a masked entry of row {r}");
                            assert_eq!(log_y[r * len + i], f32::NEG_INFINITY);
                            continue;
                        }
                        let tol = (6.0 + n / 16.0 + shift) * want * 2f64.powi(-24) + 1e-44;
                        assert!(
                            (f64::from(got) - want).abs() <= tol,
                            "softmax row {r} [{i}] of {len}: {got}, not {want} on {isa:?}"
                        );
                        let want_log = f64::from(row[i]) - max - sum.ln();
                        let got_log = log_y[r * len + i];
                        let tol = (shift + want_log.abs() + 2.0 * sum.ln() + n / 16.0 + 4.0)
                            * 2f64.powi(-24);
                        assert!(
                            (f64::from(got_log) - want_log).abs() <= tol,
                            "log_softmax row {r} [{i}] of {len}: {got_log}, not {want_log}"
                        );
                    }
                }
                let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
                by_path.push((b(&y), b(&log_y)));
            }
            assert!(
                by_path.windows(2).all(|w| w[0] == w[1]),
                "paths differ at {len}"
            );
        }
    }

    #[test]
    fn masked_rows_follow_flex() {
        // -1e4 masks give exact zeros; a fully -1e4 row is uniform; a fully -∞ row is NaN,
        // in Flex's softmax (and Burn's composition) as here.
        let x = vec![
            1.0,
            -1e4,
            2.0,
            f32::NEG_INFINITY,
            -1e4,
            -1e4,
            -1e4,
            -1e4,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
        ];
        let ours = values(softmax(tensor(x.clone(), &[3, 4]), 1));
        let flex = values(Flex::softmax(tensor(x.clone(), &[3, 4]), 1));
        assert_eq!(ours[1], 0.0);
        assert_eq!(ours[3], 0.0);
        assert_eq!(ours[4..8], [0.25; 4]);
        assert!(ours[8..].iter().all(|v| v.is_nan()));
        assert!(flex[8..].iter().all(|v| v.is_nan()), "Flex's too");
        let log = values(log_softmax(tensor(x, &[3, 4]), 1));
        assert_eq!(log[3], f32::NEG_INFINITY);
        assert!(log[8..].iter().all(|v| v.is_nan()));
    }

    #[test]
    fn backward_against_f64() {
        for len in LENGTHS {
            let count = 9;
            let x = rows(len, count, 7);
            let g: Vec<f32> = rows(len, count, 11)
                .iter()
                .map(|v| if v.abs() > 10.0 { 0.5 } else { *v })
                .collect();
            let mut by_path = vec![];
            for isa in paths() {
                let y = forward(tensor(x.clone(), &[count, len]), len, Kind::Softmax, isa);
                let log_y = forward(tensor(x.clone(), &[count, len]), len, Kind::LogSoftmax, isa);
                let (ys, log_ys) = (values(y.clone()), values(log_y.clone()));
                let dx = values(backward(
                    y,
                    tensor(g.clone(), &[count, len]),
                    Kind::Softmax,
                    isa,
                ));
                let log_dx = values(backward(
                    log_y,
                    tensor(g.clone(), &[count, len]),
                    Kind::LogSoftmax,
                    isa,
                ));
                let n = len as f64;
                for r in 0..count {
                    let at = r * len..(r + 1) * len;
                    let (y, g, ly) = (&ys[at.clone()], &g[at.clone()], &log_ys[at.clone()]);
                    if y.iter().any(|v| v.is_nan()) {
                        continue;
                    }
                    let dot: f64 = y
                        .iter()
                        .zip(g)
                        .map(|(y, g)| f64::from(*y) * f64::from(*g))
                        .sum();
                    let dot_abs: f64 = y.iter().zip(g).map(|(y, g)| f64::from(*y * *g).abs()).sum();
                    let sum: f64 = g.iter().map(|g| f64::from(*g)).sum();
                    let sum_abs: f64 = g.iter().map(|g| f64::from(*g).abs()).sum();
                    for i in 0..len {
                        let (yi, gi) = (f64::from(y[i]), f64::from(g[i]));
                        let want = yi * (gi - dot);
                        let tol = 2f64.powi(-24)
                            * yi
                            * (2.0 * gi.abs() + 2.0 * dot.abs() + (n / 16.0 + 4.0) * dot_abs)
                            + 1e-44;
                        let got = f64::from(dx[r * len + i]);
                        assert!((got - want).abs() <= tol, "softmax' {r} [{i}] of {len}");
                        let e = f64::from(ly[i]).exp();
                        let want = gi - e * sum;
                        let tol = 2f64.powi(-24)
                            * (2.0 * gi.abs()
                                + 2.0 * (e * sum).abs()
                                + e * (n / 16.0 + 6.0) * sum_abs);
                        let got = f64::from(log_dx[r * len + i]);
                        assert!((got - want).abs() <= tol, "log_softmax' {r} [{i}] of {len}");
                    }
                }
                by_path.push((dx, log_dx));
            }
            let b = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for w in by_path.windows(2) {
                assert_eq!((b(&w[0].0), b(&w[0].1)), (b(&w[1].0), b(&w[1].1)), "{len}");
            }
        }
    }

    #[test]
    fn in_place_or_not_on_any_number_of_threads_the_same_bits() {
        // More than one parallel task of rows, the last one short.
        let (count, len) = (301, 257);
        let x = rows(len, count, 3);
        let g = rows(len, count, 5);
        let run = |threads: usize, shared: bool| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let t = tensor(x.clone(), &[count, len]);
                let keep = shared.then(|| t.clone());
                let y = softmax(t, 1);
                let log_y = log_softmax(tensor(x.clone(), &[count, len]), 1);
                let dx = backward(
                    y.clone(),
                    tensor(g.clone(), &[count, len]),
                    Kind::Softmax,
                    Isa::best(),
                );
                if let Some(kept) = keep {
                    assert_eq!(values(kept), x, "the input is left as it was");
                }
                (bits(y), bits(log_y), bits(dx))
            })
        };
        let one = run(1, false);
        assert!(one == run(2, false), "two threads");
        assert!(one == run(2, true), "a shared input");
    }

    #[test]
    fn a_half_input_widened_as_read_has_the_bits_of_its_cast_then_the_f32_kernel() {
        // Rows of attention's kind (masked, -inf, fully masked), in bf16 and f16, contiguous
        // and as a transposed view (copied out first, as the cast copies it).
        let len = 40;
        let values = rows(len, 12, 5);
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            let half = fast_cast::convert(tensor(values.clone(), &[3, 4, len]), dtype);
            let view = Flex::float_swap_dims(
                fast_cast::convert(tensor(values.clone(), &[3, len, 4]), dtype),
                1,
                2,
            );
            for t in [half, view] {
                let widened = fast_cast::convert(t.clone(), FloatDType::F32);
                assert_eq!(
                    bits(softmax_of_half(t.clone(), 2)),
                    bits(softmax(widened.clone(), 2))
                );
                assert_eq!(
                    bits(log_softmax_of_half(t, 2)),
                    bits(log_softmax(widened, 2))
                );
            }
        }
    }

    #[test]
    fn the_widening_node_gives_the_cast_and_softmax_nodes_values_and_gradient() {
        use burn::tensor::{Tensor, TensorPrimitive};
        type A = Autodiff<Flex>;
        let device = Default::default();
        let (len, count) = (33, 18);
        let shape = [3, count / 3, len];
        let x = rows(len, count, 9);
        let w: Vec<f32> = (0..len * count)
            .map(|i| ((i * 53) % 97) as f32 / 9.0 - 5.0)
            .collect();
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            for kind in [Kind::Softmax, Kind::LogSoftmax] {
                let run = |fused: bool| {
                    let x = Tensor::<A, 3>::from_data(TensorData::new(x.clone(), shape), &device)
                        .cast(dtype)
                        .require_grad();
                    let input = x.clone().into_primitive().tensor();
                    let widened = |input| fast_cast::convert_tracked(input, FloatDType::F32);
                    let y = match (kind, fused) {
                        (Kind::Softmax, true) => softmax_of_half_tracked(input, 2),
                        (Kind::Softmax, false) => softmax_tracked(widened(input), 2),
                        (Kind::LogSoftmax, true) => log_softmax_of_half_tracked(input, 2),
                        (Kind::LogSoftmax, false) => log_softmax_tracked(widened(input), 2),
                    };
                    let y = Tensor::<A, 3>::from_primitive(TensorPrimitive::Float(y));
                    let weights =
                        Tensor::<A, 3>::from_data(TensorData::new(w.clone(), shape), &device);
                    let grads = (y.clone() * weights).sum().backward();
                    let grad = x.grad(&grads).expect("x is tracked");
                    assert_eq!(
                        grad.dtype(),
                        dtype.into(),
                        "the gradient has the input's type"
                    );
                    (
                        y.into_data().bytes.to_vec(),
                        grad.into_data().bytes.to_vec(),
                    )
                };
                assert_eq!(run(true), run(false), "{dtype:?}, {kind:?}");
            }
        }
    }

    #[test]
    fn other_dims_views_and_dtypes_are_flexs() {
        let x = rows(6, 20, 9);
        let t = tensor(x, &[4, 5, 6]);
        let b = |t: FlexTensor| t.into_data().bytes.to_vec();
        assert_eq!(b(softmax(t.clone(), 1)), b(Flex::softmax(t.clone(), 1)));
        let view = Flex::float_swap_dims(t.clone(), 1, 2);
        assert_eq!(
            b(softmax(view.clone(), 2)),
            b(Flex::softmax(view.clone(), 2))
        );
        assert_eq!(
            b(log_softmax(view.clone(), 2)),
            b(Flex::log_softmax(view, 2))
        );
        let f64s = Flex::float_cast(t.clone(), burn_backend::FloatDType::F64);
        assert_eq!(b(softmax(f64s.clone(), 2)), b(Flex::softmax(f64s, 2)));
        let halves = Flex::float_cast(t, burn_backend::FloatDType::BF16);
        assert_eq!(b(softmax(halves.clone(), 2)), b(Flex::softmax(halves, 2)));
        // A slice of rows at an offset is contiguous, and taken.
        let t = tensor(rows(6, 20, 9), &[20, 6]);
        let slice = Flex::float_slice(t.clone(), &[burn::tensor::Slice::new(3, Some(9), 1)]);
        assert_eq!(rows_of(&slice, 1), Some(6));
        let want = values(softmax(tensor(values(t)[18..54].to_vec(), &[6, 6]), 1));
        assert_eq!(values(softmax(slice, 1)), want);
    }
}
