//! 2-D convolution of bf16 tensors, forward and backward, as GEMMs on the dot-product kernel.
//!
//! Each image's patches are laid out as the columns of a matrix (`im2col`): row `(ci, kh, kw)`
//! of the patch matrix holds input channel `ci` at kernel offset `(kh, kw)` for every output
//! position. Then, over a batch chunk of images side by side:
//! - the output is `W · patches` (`W` the weight as `[out channels, ci·kh·kw]`), the bias added
//!   to the f32 sums, rounded once;
//! - the input's gradient is `Wᵀ · grad`, its columns added back onto the input's pixels in f32
//!   (`col2im`), rounded once;
//! - the weight's gradient is `grad · patchesᵀ`, summed over chunks in f32, rounded once.
//!
//! The products run on [`bf16_gemm`](super::bf16_gemm): bf16 products summed in f32, as the
//! f32 convolution over the widened operands sums them, in another order. Chunks have a fixed
//! size for given shapes, so the result does not depend on the number of threads.
//!
//! Flex's own f32 convolution (what the widened path of [`low_conv`](super::low_conv) runs)
//! expands 2-D tensors to 3-D with copies and takes the backward pass through permuted copies
//! and a transposed convolution; these took about half of a bf16 conv net's step.

use std::cell::RefCell;

use burn_backend::ops::ConvOptions;
use half::bf16;

use super::bf16_gemm::{self, Bf16Matrix, release_large, scratch_of};
use super::half_kernels::{Half, as_half, half_buffer};

/// The sizes of one convolution: input `[batch, channels_in, height, width]`, weight
/// `[channels_out, channels_in, kernel[0], kernel[1]]`, output `[batch, channels_out, out[0],
/// out[1]]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    batch: usize,
    channels_in: usize,
    size: [usize; 2],
    channels_out: usize,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    out: [usize; 2],
}

// The most values of a chunk's patch matrix (4 MiB of bf16; its f32 gradient, 8 MiB), so that
// the scratch of a large batch stays small.
const CHUNK_VALUES: usize = 1 << 21;

impl Geometry {
    /// The geometry of `x` convolved with `weight` under `options`; `None` for what the GEMMs
    /// here do not compute (groups, channel counts that do not match, an empty output).
    pub(crate) fn new(x: &[usize], weight: &[usize], options: &ConvOptions<2>) -> Option<Self> {
        let ([batch, channels_in, h, w], [channels_out, weight_in, kh, kw]) = (
            <[usize; 4]>::try_from(x).ok()?,
            <[usize; 4]>::try_from(weight).ok()?,
        );
        if options.groups != 1 || weight_in != channels_in {
            return None;
        }
        let (size, kernel) = ([h, w], [kh, kw]);
        let out = |i: usize| {
            let span = options.dilation[i].checked_mul(kernel[i].checked_sub(1)?)? + 1;
            let padded = size[i] + 2 * options.padding[i];
            let out = padded.checked_sub(span)?.checked_div(options.stride[i])? + 1;
            (out > 0 && kernel[i] > 0).then_some(out)
        };
        let geometry = Self {
            batch,
            channels_in,
            size,
            channels_out,
            kernel,
            stride: options.stride,
            padding: options.padding,
            dilation: options.dilation,
            out: [out(0)?, out(1)?],
        };
        (geometry.patch() > 0 && channels_out > 0 && batch > 0).then_some(geometry)
    }

    /// The output's shape: `[batch, channels_out, out[0], out[1]]`.
    pub(crate) fn output_shape(&self) -> [usize; 4] {
        [self.batch, self.channels_out, self.out[0], self.out[1]]
    }

    // Values of one patch: the GEMMs' inner dimension.
    fn patch(&self) -> usize {
        self.channels_in * self.kernel[0] * self.kernel[1]
    }

    fn positions(&self) -> usize {
        self.out[0] * self.out[1]
    }

    fn image(&self) -> usize {
        self.channels_in * self.size[0] * self.size[1]
    }

    // Images per chunk: as many as fit `budget` patch values, at least one.
    fn images_per_chunk(&self, budget: usize) -> usize {
        (budget / (self.patch() * self.positions())).clamp(1, self.batch)
    }

    // The input coordinate along axis `i` that output coordinate `o` reads at kernel offset
    // `k`, if inside the input (outside it is padding).
    fn input_at(&self, i: usize, o: usize, k: usize) -> Option<usize> {
        (o * self.stride[i] + k * self.dilation[i])
            .checked_sub(self.padding[i])
            .filter(|&at| at < self.size[i])
    }

    // For each patch row `(ci, kh, kw)`, output row `oh` and its input row (if any): `visit`
    // gets the row's index in the patch matrix, the output row, and the input row's start in
    // the image.
    fn rows(&self, mut visit: impl FnMut(usize, usize, Option<usize>)) {
        let [kh_n, kw_n] = self.kernel;
        let [h, w] = self.size;
        for ci in 0..self.channels_in {
            for kh in 0..kh_n {
                for kw in 0..kw_n {
                    let row = (ci * kh_n + kh) * kw_n + kw;
                    for oh in 0..self.out[0] {
                        let input = self.input_at(0, oh, kh).map(|ih| (ci * h + ih) * w);
                        visit(row, oh, input);
                    }
                }
            }
        }
    }

    // The kernel column of patch row `row`.
    fn kw(&self, row: usize) -> usize {
        row % self.kernel[1]
    }
}

// Per-thread scratch: the chunk's patches, its output gradient in GEMM order, an f32 product,
// an image's f32 gradient, and the GEMM's packed operands.
#[derive(Default)]
struct Scratch {
    patches: Vec<bf16>,
    grad: Vec<bf16>,
    product: Vec<f32>,
    image: Vec<f32>,
    packed: [Vec<u32>; 2],
}

impl Scratch {
    fn release_large(&mut self) {
        release_large(&mut self.patches);
        release_large(&mut self.grad);
        release_large(&mut self.product);
        release_large(&mut self.image);
        self.packed.iter_mut().for_each(release_large);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

// The patches of `image` into columns `at..at + positions` of the patch matrix `patches`,
// whose rows are `row_len` long.
fn patches_of(g: &Geometry, image: &[bf16], patches: &mut [bf16], row_len: usize, at: usize) {
    let ow_n = g.out[1];
    g.rows(|row, oh, input| {
        let kw = g.kw(row);
        let out = &mut patches[row * row_len + at + oh * ow_n..][..ow_n];
        let Some(start) = input else {
            return out.fill(bf16::ZERO);
        };
        let input = &image[start..][..g.size[1]];
        for (ow, value) in out.iter_mut().enumerate() {
            *value = g.input_at(1, ow, kw).map_or(bf16::ZERO, |iw| input[iw]);
        }
    });
}

// The reverse of `patches_of` for gradients: columns `at..at + positions` of `patches` added
// onto the pixels of `image` they were read from.
fn add_patches(g: &Geometry, patches: &[f32], row_len: usize, at: usize, image: &mut [f32]) {
    let ow_n = g.out[1];
    g.rows(|row, oh, input| {
        let Some(start) = input else { return };
        let kw = g.kw(row);
        let grads = &patches[row * row_len + at + oh * ow_n..][..ow_n];
        let input = &mut image[start..][..g.size[1]];
        for (ow, grad) in grads.iter().enumerate() {
            if let Some(iw) = g.input_at(1, ow, kw) {
                input[iw] += grad;
            }
        }
    });
}

fn parallel(m: usize, n: usize, k: usize) -> bool {
    m.saturating_mul(n).saturating_mul(k) >= 192 * 192 * 192
}

/// The convolution of `x` by `weight` (both contiguous), `bias` added to the f32 sums, each
/// output rounded once to bf16, as bits; `None` where the CPU lacks the dot-product kernel.
pub(crate) fn forward(
    g: &Geometry,
    x: &[bf16],
    weight: &[bf16],
    bias: Option<&[f32]>,
) -> Option<Vec<u16>> {
    forward_in_chunks(g, x, weight, bias, CHUNK_VALUES)
}

fn forward_in_chunks(
    g: &Geometry,
    x: &[bf16],
    weight: &[bf16],
    bias: Option<&[f32]>,
    budget: usize,
) -> Option<Vec<u16>> {
    let (patch, positions, channels) = (g.patch(), g.positions(), g.channels_out);
    let weight = Bf16Matrix::new(weight, 0, [channels, patch], [patch, 1])?;
    let mut out = half_buffer(g.batch * channels * positions);
    let out_values = as_half::<bf16>(&mut out);
    let chunk = g.images_per_chunk(budget);
    SCRATCH.with_borrow_mut(|s| {
        for first in (0..g.batch).step_by(chunk) {
            let images = chunk.min(g.batch - first);
            let columns = images * positions;
            let patches = scratch_of(&mut s.patches, patch * columns);
            for (n, image) in x[first * g.image()..]
                .chunks(g.image())
                .take(images)
                .enumerate()
            {
                patches_of(g, image, patches, columns, n * positions);
            }
            let patches = Bf16Matrix::new(patches, 0, [patch, columns], [columns, 1])?;
            let product = scratch_of(&mut s.product, channels * columns);
            let threads = parallel(channels, columns, patch);
            bf16_gemm::gemm(weight, patches, product, threads, &mut s.packed)?;
            // The product is `[channels, images · positions]`; the output `[images, channels,
            // positions]`.
            for (c, row) in product.chunks_mut(columns).enumerate() {
                if let Some(bias) = bias {
                    row.iter_mut().for_each(|v| *v += bias[c]);
                }
                for (n, sums) in row.chunks(positions).enumerate() {
                    let at = ((first + n) * channels + c) * positions;
                    <bf16 as Half>::round(sums, &mut out_values[at..][..positions]);
                }
            }
        }
        s.release_large();
        Some(())
    })?;
    Some(out)
}

/// The gradients of `x` and of `weight` (each where asked for) of the convolution that gave
/// the output gradient `grad`, as bf16 bits: f32 sums, rounded once. `None` where the CPU
/// lacks the dot-product kernel.
pub(crate) fn backward(
    g: &Geometry,
    x: &[bf16],
    weight: &[bf16],
    grad: &[bf16],
    [want_x, want_weight]: [bool; 2],
) -> Option<[Option<Vec<u16>>; 2]> {
    backward_in_chunks(g, x, weight, grad, [want_x, want_weight], CHUNK_VALUES)
}

fn backward_in_chunks(
    g: &Geometry,
    x: &[bf16],
    weight: &[bf16],
    grad: &[bf16],
    [want_x, want_weight]: [bool; 2],
    budget: usize,
) -> Option<[Option<Vec<u16>>; 2]> {
    let (patch, positions, channels) = (g.patch(), g.positions(), g.channels_out);
    let weight_t = Bf16Matrix::new(weight, 0, [patch, channels], [1, patch])?;
    let mut dx = want_x.then(|| half_buffer(g.batch * g.image()));
    let mut dw_sums = want_weight.then(|| vec![0f32; channels * patch]);
    let chunk = g.images_per_chunk(budget);
    SCRATCH.with_borrow_mut(|s| {
        for first in (0..g.batch).step_by(chunk) {
            let images = chunk.min(g.batch - first);
            let columns = images * positions;
            // The output gradient as `[channels, images · positions]`, the GEMMs' order.
            let grads = scratch_of(&mut s.grad, channels * columns);
            for (n, image) in grad[first * channels * positions..]
                .chunks(channels * positions)
                .take(images)
                .enumerate()
            {
                for (c, plane) in image.chunks(positions).enumerate() {
                    grads[c * columns + n * positions..][..positions].copy_from_slice(plane);
                }
            }
            let grads = Bf16Matrix::new(grads, 0, [channels, columns], [columns, 1])?;
            if let Some(dx) = dx.as_mut() {
                let product = scratch_of(&mut s.product, patch * columns);
                let threads = parallel(patch, columns, channels);
                bf16_gemm::gemm(weight_t, grads, product, threads, &mut s.packed)?;
                let dx = as_half::<bf16>(dx);
                for n in 0..images {
                    let image = scratch_of(&mut s.image, g.image());
                    image.fill(0.0);
                    add_patches(g, product, columns, n * positions, image);
                    <bf16 as Half>::round(image, &mut dx[(first + n) * g.image()..][..g.image()]);
                }
            }
            if let Some(sums) = dw_sums.as_mut() {
                let patches = scratch_of(&mut s.patches, patch * columns);
                for (n, image) in x[first * g.image()..]
                    .chunks(g.image())
                    .take(images)
                    .enumerate()
                {
                    patches_of(g, image, patches, columns, n * positions);
                }
                let patches_t = Bf16Matrix::new(patches, 0, [columns, patch], [1, columns])?;
                let product = scratch_of(&mut s.product, channels * patch);
                let threads = parallel(channels, patch, columns);
                bf16_gemm::gemm(grads, patches_t, product, threads, &mut s.packed)?;
                sums.iter_mut()
                    .zip(product.iter())
                    .for_each(|(sum, p)| *sum += p);
            }
        }
        s.release_large();
        Some(())
    })?;
    let dw = dw_sums.map(|sums| {
        let mut bits = half_buffer(sums.len());
        <bf16 as Half>::round(&sums, as_half::<bf16>(&mut bits));
        bits
    });
    Some([dx, dw])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(stride: usize, padding: usize, dilation: usize) -> ConvOptions<2> {
        ConvOptions::new(
            [stride, stride],
            [padding, padding],
            [dilation, dilation],
            1,
        )
    }

    fn values(n: usize, seed: u32) -> Vec<bf16> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 600.0 - 1.6)
            .map(bf16::from_f32)
            .collect()
    }

    fn bits_to_f64(bits: &[u16]) -> Vec<f64> {
        bits.iter()
            .map(|b| f64::from(bf16::from_bits(*b).to_f32()))
            .collect()
    }

    // The direct convolution and its gradients in f64, with each value's bound: the f32 sum
    // of `k` terms (`k · ε · Σ|term|`) and one bf16 rounding of it.
    struct Reference {
        out: Vec<(f64, f64)>,
        dx: Vec<(f64, f64)>,
        dw: Vec<(f64, f64)>,
    }

    fn reference(g: &Geometry, x: &[bf16], w: &[bf16], bias: &[f32], grad: &[bf16]) -> Reference {
        let v = |t: bf16| f64::from(t.to_f32());
        let ([h, wd], [kh_n, kw_n], [oh_n, ow_n]) = (g.size, g.kernel, g.out);
        let (ci_n, co_n) = (g.channels_in, g.channels_out);
        let mut out = vec![(0.0, 0.0); g.batch * co_n * oh_n * ow_n];
        let mut dx = vec![(0.0, 0.0); g.batch * g.image()];
        let mut dw = vec![(0.0, 0.0); co_n * g.patch()];
        let add = |acc: &mut (f64, f64), term: f64| {
            acc.0 += term;
            acc.1 += term.abs();
        };
        for n in 0..g.batch {
            for (co, &b) in bias.iter().enumerate() {
                for oh in 0..oh_n {
                    for ow in 0..ow_n {
                        let o = ((n * co_n + co) * oh_n + oh) * ow_n + ow;
                        add(&mut out[o], f64::from(b));
                        for ci in 0..ci_n {
                            for kh in 0..kh_n {
                                for kw in 0..kw_n {
                                    let (Some(ih), Some(iw)) =
                                        (g.input_at(0, oh, kh), g.input_at(1, ow, kw))
                                    else {
                                        continue;
                                    };
                                    let i = ((n * ci_n + ci) * h + ih) * wd + iw;
                                    let k = ((co * ci_n + ci) * kh_n + kh) * kw_n + kw;
                                    add(&mut out[o], v(x[i]) * v(w[k]));
                                    add(&mut dx[i], v(grad[o]) * v(w[k]));
                                    add(&mut dw[k], v(grad[o]) * v(x[i]));
                                }
                            }
                        }
                    }
                }
            }
        }
        let bound = |terms: usize| {
            move |(sum, abs): (f64, f64)| {
                let f32_sum = terms as f64 * f64::from(f32::EPSILON) * abs;
                (sum, f32_sum + (sum.abs() + f32_sum) / 256.0)
            }
        };
        let terms = g.batch * g.positions() + g.patch() + co_n * kh_n * kw_n;
        Reference {
            out: out.into_iter().map(bound(terms)).collect(),
            dx: dx.into_iter().map(bound(terms)).collect(),
            dw: dw.into_iter().map(bound(terms)).collect(),
        }
    }

    fn assert_within(name: &str, got: &[u16], want: &[(f64, f64)]) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (got, (sum, bound))) in bits_to_f64(got).iter().zip(want).enumerate() {
            assert!(
                (got - sum).abs() <= *bound,
                "{name}[{i}]: {got} against {sum} ± {bound}"
            );
        }
    }

    #[test]
    fn forward_and_gradients_match_the_direct_convolution() {
        if !bf16_gemm::available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        // (x shape, weight shape, stride, padding, dilation): plain, strided and padded as in
        // a small conv net, dilated, a 1×1 kernel, one image; each also in chunks of one
        // image (a budget of one value).
        let cases = [
            ([2, 3, 7, 6], [4, 3, 3, 3], 1, 0, 1),
            ([3, 5, 9, 8], [6, 5, 3, 3], 2, 1, 1),
            ([2, 2, 9, 9], [3, 2, 3, 2], 1, 2, 2),
            ([2, 7, 4, 5], [5, 7, 1, 1], 1, 0, 1),
            ([1, 3, 6, 6], [2, 3, 5, 5], 3, 2, 1),
        ];
        for (xs, ws, stride, padding, dilation) in cases {
            let g = Geometry::new(&xs, &ws, &options(stride, padding, dilation)).unwrap();
            let x = values(xs.iter().product(), 1);
            let w = values(ws.iter().product(), 2);
            let bias: Vec<f32> = (0..ws[0]).map(|c| c as f32 * 0.25 - 0.5).collect();
            let grad = values(g.batch * g.channels_out * g.positions(), 3);
            let want = reference(&g, &x, &w, &bias, &grad);
            for budget in [CHUNK_VALUES, 1] {
                let case = format!(
                    "{xs:?} * {ws:?}, stride {stride}, padding {padding}, dilation {dilation}, budget {budget}"
                );
                let out = forward_in_chunks(&g, &x, &w, Some(&bias), budget).unwrap();
                assert_within(&format!("output of {case}"), &out, &want.out);
                let [dx, dw] = backward_in_chunks(&g, &x, &w, &grad, [true, true], budget).unwrap();
                assert_within(&format!("x's gradient of {case}"), &dx.unwrap(), &want.dx);
                assert_within(&format!("w's gradient of {case}"), &dw.unwrap(), &want.dw);
            }
        }
    }

    #[test]
    fn gradients_are_computed_only_where_asked_for() {
        if !bf16_gemm::available() {
            return;
        }
        let (xs, ws) = ([2, 3, 5, 5], [2, 3, 3, 3]);
        let g = Geometry::new(&xs, &ws, &options(1, 1, 1)).unwrap();
        let (x, w) = (values(150, 1), values(54, 2));
        let grad = values(g.batch * g.channels_out * g.positions(), 3);
        let [dx, dw] = backward(&g, &x, &w, &grad, [false, true]).unwrap();
        assert!(dx.is_none() && dw.is_some());
        let [dx, dw] = backward(&g, &x, &w, &grad, [true, false]).unwrap();
        assert!(dx.is_some() && dw.is_none());
    }

    #[test]
    fn geometries_the_gemms_do_not_compute_are_refused() {
        let plain = options(1, 0, 1);
        assert!(Geometry::new(&[1, 3, 5, 5], &[2, 3, 3, 3], &plain).is_some());
        let grouped = ConvOptions::new([1, 1], [0, 0], [1, 1], 3);
        assert!(Geometry::new(&[1, 3, 5, 5], &[3, 1, 3, 3], &grouped).is_none());
        // Channels that do not match, a kernel larger than the padded input, an empty batch.
        assert!(Geometry::new(&[1, 3, 5, 5], &[2, 4, 3, 3], &plain).is_none());
        assert!(Geometry::new(&[1, 3, 2, 2], &[2, 3, 3, 3], &plain).is_none());
        assert!(Geometry::new(&[0, 3, 5, 5], &[2, 3, 3, 3], &plain).is_none());
        assert!(Geometry::new(&[1, 3, 5], &[2, 3, 3, 3], &plain).is_none());
    }
}
