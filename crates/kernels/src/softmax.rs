//! Softmax and log-softmax of rows of f32 values, and their gradients, one fused pass per row:
//! its max, `exp(x - max)` written in place, the sum, the scaling, all while the row is in L1.
//! The gradients from the output `y` and its gradient `g`: `dx = y · (g - Σ g·y)` for softmax,
//! `dx = g - exp(y) · Σ g` for log-softmax (`y = (x - max) - ln Σ exp(x - max)`), each row in
//! one pass. The root crate's `src/cpu/softmax.rs` runs them on Flex tensors, rows spread over
//! rayon's threads, with their autodiff node.
//!
//! # Accuracy
//!
//! [`exp`] is within 1 ulp of the exact value over the whole f32 range (see
//! [`exp`](crate::exp)). A softmax output then differs from the f64 softmax of the same f32 input by at
//! most `(6 + n/16 + |x - max|) · 2⁻²⁴` relative (`n` the row's length): the exp, the
//! row sum in sixteen running lanes, the scaling, and the rounding of `x - max` in f32,
//! which every f32 softmax (Flex's own included) makes. Masked entries (`-1e4`, `-∞`) give
//! exact zeros. A row that is entirely `-∞` gives NaN, as Flex's softmax and Burn's default
//! composition do (and PyTorch's): `-∞ - (-∞)` is NaN; so does a row with a NaN or a `+∞`.
//!
//! # Vectorisation
//!
//! The arithmetic is written once, as scalar code without branches, and compiled three times
//! ([`Isa`], `isa_variants!`). Each value sees the same operations in the same order, sums are taken in
//! sixteen lanes whatever the vector width, and fused multiply-adds round once on every path
//! (the portable code calls libm's `fmaf`: exact everywhere, slow only on x86 CPUs without
//! FMA, from before 2013), so the three give the same bits, on any number of threads.
//!

use crate::exp::exp;
use crate::isa::{Isa, isa_variants};

/// Lanes of the running maxima and sums: one AVX-512 register, two AVX2 ones; the same lanes
/// on every path, so the same sums.
const LANES: usize = 16;
/// Values per block of [`log_softmax_rows`]'s exponentials (a stack buffer in L1).
const BLOCK: usize = 256;

// `acc` folded in halves, lane `i` with lane `i + half`: a fixed order.
#[inline(always)]
fn fold(mut acc: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        let (low, high) = acc.split_at_mut(half);
        for (a, b) in low.iter_mut().zip(high.iter()) {
            *a = op(*a, *b);
        }
        half /= 2;
    }
    acc[0]
}

// `acc[i % LANES] = op(acc[i % LANES], values[i])` over `values`, in order.
#[inline(always)]
fn accumulate(acc: &mut [f32; LANES], values: &[f32], op: impl Fn(f32, f32) -> f32) {
    let mut chunks = values.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (a, v) in acc.iter_mut().zip(chunk) {
            *a = op(*a, *v);
        }
    }
    for (a, v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = op(*a, *v);
    }
}

// The larger, ignoring a NaN in `b` (a NaN in a row reaches every output through the sum).
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if b > a { b } else { a }
}

#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    accumulate(&mut acc, row, larger);
    fold(acc, larger)
}

#[inline(always)]
fn row_sum(row: &[f32]) -> f32 {
    let mut acc = [0.0; LANES];
    accumulate(&mut acc, row, |a, v| a + v);
    fold(acc, |a, b| a + b)
}

/// Softmax of each row of `len` values of `rows`, in place.
#[inline(always)]
fn softmax_rows(rows: &mut [f32], len: usize) {
    for row in rows.chunks_exact_mut(len) {
        let max = row_max(row);
        for v in row.iter_mut() {
            *v = exp(*v - max);
        }
        let scale = 1.0 / row_sum(row);
        for v in row.iter_mut() {
            *v *= scale;
        }
    }
}

/// Log-softmax of each row of `len` values of `rows`, in place: `(x - max) - ln Σ e^(x - max)`,
/// Burn's order of operations.
#[inline(always)]
fn log_softmax_rows(rows: &mut [f32], len: usize) {
    let mut block = [0f32; BLOCK];
    for row in rows.chunks_exact_mut(len) {
        let max = row_max(row);
        let mut acc = [0.0; LANES];
        for chunk in row.chunks_mut(BLOCK) {
            let block = &mut block[..chunk.len()];
            for (e, v) in block.iter_mut().zip(chunk.iter_mut()) {
                *v -= max;
                *e = exp(*v);
            }
            accumulate(&mut acc, block, |a, v| a + v);
        }
        let log_sum = fold(acc, |a, b| a + b).ln();
        for v in row.iter_mut() {
            *v -= log_sum;
        }
    }
}

/// Softmax's gradient row by row, in place in `grads`: `y · (g - Σ g·y)`.
#[inline(always)]
fn softmax_backward_rows(outputs: &[f32], grads: &mut [f32], len: usize) {
    for (y, g) in outputs.chunks_exact(len).zip(grads.chunks_exact_mut(len)) {
        let mut acc = [0.0; LANES];
        let mut ys = y.chunks_exact(LANES);
        let mut gs = g.chunks_exact(LANES);
        for (y, g) in (&mut ys).zip(&mut gs) {
            for ((a, y), g) in acc.iter_mut().zip(y).zip(g) {
                *a = g.mul_add(*y, *a);
            }
        }
        for ((a, y), g) in acc.iter_mut().zip(ys.remainder()).zip(gs.remainder()) {
            *a = g.mul_add(*y, *a);
        }
        let dot = fold(acc, |a, b| a + b);
        for (g, y) in g.iter_mut().zip(y) {
            *g = y * (*g - dot);
        }
    }
}

/// Log-softmax's gradient row by row, in place in `grads`: `g - e^y · Σ g`.
#[inline(always)]
fn log_softmax_backward_rows(outputs: &[f32], grads: &mut [f32], len: usize) {
    for (y, g) in outputs.chunks_exact(len).zip(grads.chunks_exact_mut(len)) {
        let sum = row_sum(g);
        for (g, y) in g.iter_mut().zip(y) {
            *g = (-exp(*y)).mul_add(sum, *g);
        }
    }
}

// `e^x` of each value in place: the loop the tests hold against f64.
isa_variants! {
    fn softmax_rows(rows: &mut [f32], len: usize);
    fn log_softmax_rows(rows: &mut [f32], len: usize);
    fn softmax_backward_rows(outputs: &[f32], grads: &mut [f32], len: usize);
    fn log_softmax_backward_rows(outputs: &[f32], grads: &mut [f32], len: usize);
}

/// Softmax of each row of `len` values of `rows` (a whole number of rows), in place, on `isa`.
pub fn softmax(isa: Isa, rows: &mut [f32], len: usize) {
    on::softmax_rows(isa, rows, len);
}

/// Log-softmax of each row of `len` values of `rows`, in place, on `isa`: `(x - max) -
/// ln Σ e^(x - max)`, Burn's order of operations.
pub fn log_softmax(isa: Isa, rows: &mut [f32], len: usize) {
    on::log_softmax_rows(isa, rows, len);
}

/// Softmax's input gradient row by row from its `outputs`, in place in `grads` (as long):
/// `y · (g - Σ g·y)`.
pub fn softmax_backward(isa: Isa, outputs: &[f32], grads: &mut [f32], len: usize) {
    on::softmax_backward_rows(isa, outputs, grads, len);
}

/// Log-softmax's input gradient row by row from its `outputs`, in place in `grads`:
/// `g - e^y · Σ g`.
pub fn log_softmax_backward(isa: Isa, outputs: &[f32], grads: &mut [f32], len: usize) {
    on::log_softmax_backward_rows(isa, outputs, grads, len);
}
