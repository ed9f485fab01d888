//! 2-D convolution of half tensors, forward and backward, as GEMMs over `im2col` patches.
//!
//! Each image's patches are laid out as the columns of a matrix (`im2col`): row `(ci, kh, kw)`
//! of the patch matrix holds input channel `ci` at kernel offset `(kh, kw)` for every output
//! position. Then, over a batch chunk of images side by side:
//! - the output is `W · patches` (`W` the weight as `[out channels, ci·kh·kw]`), the bias added
//!   to the f32 sums, rounded once (on the bf16 kernel as each task sums its block, sent
//!   straight to the images' planes);
//! - the input's gradient is `Wᵀ · grad`, its columns added back onto the input's pixels in f32
//!   (`col2im`), rounded once; this one image by image, so that each image's product is
//!   summed while it is in cache;
//! - the weight's gradient is `grad · patchesᵀ`, summed over chunks in f32, rounded once.
//!
//! Where the column stride is not 1, the input is first split into phases (its columns
//! grouped by their remainder modulo the stride, `Phases`), so that the columns a patch row
//! reads, and those its gradient adds onto, lie side by side.
//!
//! Two kernels run the GEMMs ([`Kernel`]): bf16 patches on the dot-product GEMM of
//! [`bf16_gemm`], or patches of either half type widened to f32 on Flex's f32 GEMM. Both sum
//! exact products in f32, in another order than Flex's f32 convolution over the widened
//! operands. Chunks have a fixed size for given shapes, so the result does
//! not depend on the number of threads. The patch matrix is filled in tasks of whole rows,
//! and the input's gradient summed in tasks of whole images, on rayon's threads: each value is
//! written, or each pixel's sum taken, by one task in a fixed order.
//!
//! Flex's own f32 convolution (what the root crate's `low_conv` runs on
//! `Route::Widened`) expands 2-D tensors to 3-D with copies and takes the backward pass
//! through permuted copies and a transposed convolution; these took about half of a bf16 conv
//! net's training step.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

use half::bf16;

use super::bf16_gemm::{
    self, Bf16Matrix, Finish, Packed, Product, release_large, scratch_of, with_scratch,
};
use crate::f32_gemm::{Kernel, f32_gemm, parallel};
use crate::half::{Half, HalfKind, as_half, as_uninit, half_buffer, in_row_tasks};
use crate::tasks::for_each_chunk;

/// A 2-D convolution's options, as Burn's `Conv2dOptions` holds them: per axis (height,
/// width) the stride, the zeros padded on each side and the kernel's dilation, and the number
/// of channel groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// The step between output positions, per axis.
    pub stride: [usize; 2],
    /// Zeros added on each side of the input, per axis.
    pub padding: [usize; 2],
    /// The step between the kernel's taps, per axis.
    pub dilation: [usize; 2],
    /// Channel groups: the GEMMs here compute one group only.
    pub groups: usize,
}

impl Conv2dOptions {
    /// The options of a convolution, in `ConvOptions::new`'s order.
    pub fn new(
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        groups: usize,
    ) -> Self {
        Self {
            stride,
            padding,
            dilation,
            groups,
        }
    }
}

/// The sizes of one convolution: input `[batch, channels_in, height, width]`, weight
/// `[channels_out, channels_in, kernel[0], kernel[1]]`, output `[batch, channels_out, out[0],
/// out[1]]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
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
    pub fn new(x: &[usize], weight: &[usize], options: &Conv2dOptions) -> Option<Self> {
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
    pub fn output_shape(&self) -> [usize; 4] {
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

    // The batch in chunks of as many images as fit `budget` patch values (at least one):
    // `(first image, images)` each.
    fn chunks(&self, budget: usize) -> impl Iterator<Item = (usize, usize)> + use<> {
        let batch = self.batch;
        let chunk = (budget / (self.patch() * self.positions())).clamp(1, batch);
        (0..batch)
            .step_by(chunk)
            .map(move |first| (first, chunk.min(batch - first)))
    }

    // The input coordinate along axis `i` that output coordinate `o` reads at kernel offset
    // `k`, if inside the input (outside it is padding).
    fn input_at(&self, i: usize, o: usize, k: usize) -> Option<usize> {
        (o * self.stride[i] + k * self.dilation[i])
            .checked_sub(self.padding[i])
            .filter(|&at| at < self.size[i])
    }

    // The output columns that read inside the input at kernel column `kw` (a range, the
    // others read padding), and the input column the first of them reads; the next ones read
    // every `stride[1]`-th column from there.
    fn columns(&self, kw: usize) -> Span {
        let (offset, pad, stride) = (kw * self.dilation[1], self.padding[1], self.stride[1]);
        let end = match (self.size[1] + pad).checked_sub(offset + 1) {
            Some(last) => self.out[1].min(last / stride + 1),
            None => 0,
        };
        let start = pad.saturating_sub(offset).div_ceil(stride).min(end);
        let first = if start < end {
            start * stride + offset - pad
        } else {
            0
        };
        (start..end, first)
    }

    // `columns` for every kernel column, computed once per pass over the patches.
    fn column_spans(&self) -> Vec<Span> {
        (0..self.kernel[1]).map(|kw| self.columns(kw)).collect()
    }

    // Patch row `row`'s input channel and kernel offsets `(ci, kh, kw)`.
    fn row_parts(&self, row: usize) -> (usize, usize, usize) {
        let [kh_n, kw_n] = self.kernel;
        (row / (kh_n * kw_n), row / kw_n % kh_n, row % kw_n)
    }

    // Where, in an image, the input row read by output row `oh` at channel `ci` and kernel
    // row `kh` starts (`None` where it is padding).
    fn input_row(&self, ci: usize, kh: usize, oh: usize) -> Option<usize> {
        let [h, w] = self.size;
        self.input_at(0, oh, kh).map(|ih| (ci * h + ih) * w)
    }
}

// The output columns inside the input at one kernel column, and the input column the first
// of them reads (`Geometry::columns`).
type Span = (std::ops::Range<usize>, usize);

// What a kernel's patches are made of (bf16 or f32), and how it multiplies them.
trait Patch: Copy + Default + Send + Sync + 'static {
    const ZERO: Self;

    // `values` as patch values: widened into `buf`, or the same bits where they already are
    // (`None` where they are not and cannot be: f16 values for bf16 patches).
    fn from_half<'a, H: Half>(values: &'a [H], buf: &'a mut Vec<Self>) -> Option<&'a [Self]>;

    // `values` written as patch values into `out` (as long), with `from_half`'s `None`.
    fn write_from_half<H: Half>(values: &[H], out: &mut [Self]) -> Option<()>;

    // `c = a @ b`, each operand a slice with its shape and (row, column) strides, on rayon's
    // threads where `parallel`.
    fn gemm(
        a: Operand<Self>,
        b: Operand<Self>,
        c: &mut [f32],
        scratch: &mut Packed,
        parallel: bool,
    ) -> Option<()>;

    // A chunk's output: `weight · patches` (`[channels, images · positions]`), `bias` added
    // to the f32 sums, each rounded once to `H` into `out` (`[images, channels, positions]`),
    // on rayon's threads where `parallel`. By default through an f32 product in `shared`,
    // rounded by `round_output`.
    #[allow(clippy::too_many_arguments)]
    fn output<H: Half>(
        g: &Geometry,
        weight: Operand<Self>,
        patches: Operand<Self>,
        bias: Option<&[f32]>,
        out: &mut [H],
        shared: &mut Shared,
        parallel: bool,
    ) -> Option<()> {
        let product = scratch_of(&mut shared.product, weight.1[0] * patches.1[1]);
        Self::gemm(weight, patches, product, &mut shared.packed, parallel)?;
        round_output(g, product, bias, out);
        Some(())
    }

    // This type's buffers in the scratch.
    fn buffers(scratch: &mut Scratch) -> (&mut Buffers<Self>, &mut Shared);
}

// A GEMM operand: values, `[rows, cols]`, and (row, column) strides from the slice's start.
type Operand<'a, P> = (&'a [P], [usize; 2], [usize; 2]);

impl Patch for bf16 {
    const ZERO: Self = bf16::ZERO;

    fn from_half<'a, H: Half>(values: &'a [H], _: &'a mut Vec<Self>) -> Option<&'a [Self]> {
        (H::KIND == HalfKind::Bf16).then(|| bytemuck::cast_slice(values))
    }

    fn write_from_half<H: Half>(values: &[H], out: &mut [Self]) -> Option<()> {
        out.copy_from_slice(Self::from_half(values, &mut Vec::new())?);
        Some(())
    }

    fn gemm(
        a: Operand<Self>,
        b: Operand<Self>,
        c: &mut [f32],
        scratch: &mut Packed,
        parallel: bool,
    ) -> Option<()> {
        let ((a, [m, k], a_strides), (b, [_, n], b_strides)) = (a, b);
        let a = Bf16Matrix::new(a, 0, [m, k], a_strides)?;
        let b = Bf16Matrix::new(b, 0, [k, n], b_strides)?;
        bf16_gemm::gemm(a, b, Product::F32(c), parallel, scratch)
    }

    // Rounded as the tasks sum it (`Finish::Planes`): an f32 product was 4 MiB written and read
    // back for a conv net's first layer.
    fn output<H: Half>(
        g: &Geometry,
        (weight, [m, k], weight_strides): Operand<Self>,
        (patches, [_, n], patch_strides): Operand<Self>,
        bias: Option<&[f32]>,
        out: &mut [H],
        shared: &mut Shared,
        parallel: bool,
    ) -> Option<()> {
        // bf16 patches come of bf16 images only (`from_half`).
        let out: &mut [bf16] = match H::KIND {
            HalfKind::Bf16 => bytemuck::cast_slice_mut(out),
            _ => return None,
        };
        // SAFETY: the GEMM writes only initialised values through it.
        let out = unsafe { as_uninit(out) };
        let a = Bf16Matrix::new(weight, 0, [m, k], weight_strides)?;
        let b = Bf16Matrix::new(patches, 0, [k, n], patch_strides)?;
        let finish = Finish::Planes {
            positions: g.positions(),
            bias,
        };
        let product = Product::Bf16 { out, finish };
        bf16_gemm::gemm(a, b, product, parallel, &mut shared.packed)
    }

    fn buffers(scratch: &mut Scratch) -> (&mut Buffers<Self>, &mut Shared) {
        (&mut scratch.bf16, &mut scratch.shared)
    }
}

impl Patch for f32 {
    const ZERO: Self = 0.0;

    fn from_half<'a, H: Half>(values: &'a [H], buf: &'a mut Vec<Self>) -> Option<&'a [Self]> {
        let buf = scratch_of(buf, values.len());
        Self::write_from_half(values, buf)?;
        Some(buf)
    }

    fn write_from_half<H: Half>(values: &[H], out: &mut [Self]) -> Option<()> {
        H::widen(values, out);
        Some(())
    }

    fn gemm(
        a: Operand<Self>,
        b: Operand<Self>,
        c: &mut [f32],
        _: &mut Packed,
        parallel: bool,
    ) -> Option<()> {
        let ((a, [m, k], a_strides), (b, [_, n], b_strides)) = (a, b);
        f32_gemm((a, a_strides), (b, b_strides), [m, k, n], c, parallel)
    }

    fn buffers(scratch: &mut Scratch) -> (&mut Buffers<Self>, &mut Shared) {
        (&mut scratch.f32, &mut scratch.shared)
    }
}

// A kernel's buffers of patch values: the chunk's patches, its output gradient in GEMM order,
// the weight, and the chunk's images converted (f32 patches of half images).
#[derive(Default)]
struct Buffers<P> {
    patches: Vec<P>,
    grad: Vec<P>,
    weight: Vec<P>,
    image: Vec<P>,
    phases: Vec<P>,
}

// Buffers of either kernel: an f32 product, the packed operands.
#[derive(Default)]
struct Shared {
    product: Vec<f32>,
    packed: Packed,
}

// Per-thread scratch, kept between calls up to 8 MiB a buffer (`release_large`).
#[derive(Default)]
struct Scratch {
    bf16: Buffers<bf16>,
    f32: Buffers<f32>,
    shared: Shared,
}

impl<P> Buffers<P> {
    fn release_large(&mut self) {
        for buf in [
            &mut self.patches,
            &mut self.grad,
            &mut self.weight,
            &mut self.image,
            &mut self.phases,
        ] {
            release_large(buf);
        }
    }
}

impl Scratch {
    fn release_large(&mut self) {
        self.bf16.release_large();
        self.f32.release_large();
        release_large(&mut self.shared.product);
        self.shared.packed.iter_mut().for_each(release_large);
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
    // A task's buffers for the input's gradient (`ImageWork`), apart from `SCRATCH`, which
    // the thread that started the tasks holds.
    static IMAGE_WORK: RefCell<ImageWork> = RefCell::default();
}

// One image's product of the weight and its output gradient, its f32 sums in phases and
// rejoined (`image_gradient`), kept by each thread: a fresh sum buffer a task was 128 KiB
// for a small conv net, mapped, faulted in and unmapped each time (3% of its bf16 step).
#[derive(Default)]
struct ImageWork {
    product: Vec<f32>,
    packed: Packed,
    sums: Vec<f32>,
    image: Vec<f32>,
}

impl ImageWork {
    fn release_large(&mut self) {
        release_large(&mut self.product);
        release_large(&mut self.sums);
        release_large(&mut self.image);
        self.packed.iter_mut().for_each(release_large);
    }
}

// The input's columns grouped by their remainder modulo the column stride, so that the
// columns a kernel column reads for one output row lie side by side: each input row (of any
// image and channel) becomes `stride` phase rows of `width` values, phase `r` holding columns
// `r, r + stride, …`. With stride 1 this is the input itself. Read with a stride of 2, the
// patch rows and their gradients went one value at a time, in loops of 15 or 16: 18% of a
// bf16 conv net's step.
#[derive(Clone, Copy)]
struct Phases {
    stride: usize,
    width: usize,
}

impl Phases {
    fn of(g: &Geometry) -> Self {
        let stride = g.stride[1];
        Self {
            stride,
            width: g.size[1].div_ceil(stride),
        }
    }

    // Values of `rows` input rows in phases.
    fn len(&self, rows: usize) -> usize {
        rows * self.stride * self.width
    }

    // Where input row `row`'s column `column` lies.
    fn at(&self, row: usize, column: usize) -> usize {
        (row * self.stride + column % self.stride) * self.width + column / self.stride
    }

    // One input row into its phase rows (`stride · width` values; what no column fills is
    // left as it was, never read).
    fn split<P: Copy>(&self, row: &[P], out: &mut [P]) {
        match self.stride {
            2 => {
                let (even, odd) = out.split_at_mut(self.width);
                let (pairs, last) = row.as_chunks::<2>();
                for ((pair, even), odd) in pairs.iter().zip(even.iter_mut()).zip(odd) {
                    (*even, *odd) = (pair[0], pair[1]);
                }
                if let [value] = last {
                    even[pairs.len()] = *value;
                }
            }
            stride => {
                for (r, out) in out.chunks_mut(self.width).enumerate() {
                    for (out, value) in out.iter_mut().zip(row.iter().skip(r).step_by(stride)) {
                        *out = *value;
                    }
                }
            }
        }
    }

    // The reverse of `split`, for sums.
    fn join(&self, phases: &[f32], row: &mut [f32]) {
        match self.stride {
            2 => {
                let (even, odd) = phases.split_at(self.width);
                let (pairs, last) = row.as_chunks_mut::<2>();
                for ((pair, even), odd) in pairs.iter_mut().zip(even).zip(odd) {
                    *pair = [*even, *odd];
                }
                if let [value] = last {
                    *value = even[pairs.len()];
                }
            }
            stride => {
                for (r, phase) in phases.chunks(self.width).enumerate() {
                    for (value, sum) in row.iter_mut().skip(r).step_by(stride).zip(phase) {
                        *value = *sum;
                    }
                }
            }
        }
    }
}

// Row `row` of the patch matrix of images side by side (`positions` columns each) into `out`,
// read from `input`, the images in `phases`: for each output row, the input row's columns
// inside the input (`spans`), padding's zeros on either side.
fn patch_row<P: Patch>(
    g: &Geometry,
    spans: &[Span],
    (phases, input): (Phases, &[P]),
    row: usize,
    out: &mut [P],
) {
    if g.stride == [1, 1] && g.out[1] == g.size[1] {
        return patch_row_as_plane(g, spans, input, row, out);
    }
    let (ci, kh, kw) = g.row_parts(row);
    let (inside, first) = &spans[kw];
    for (n, out) in out.chunks_mut(g.positions()).enumerate() {
        for (oh, out) in out.chunks_mut(g.out[1]).enumerate() {
            let Some(ih) = g.input_at(0, oh, kh) else {
                out.fill(P::ZERO);
                continue;
            };
            zero(&mut out[..inside.start]);
            zero(&mut out[inside.end..]);
            let at = phases.at((n * g.channels_in + ci) * g.size[0] + ih, *first);
            copy_short(&mut out[inside.clone()], &input[at..]);
        }
    }
}

// The first `out.len()` values of `input` into `out`, for the tens of values of a patch's row
// segment: in blocks of 8, where `copy_from_slice` calls `memmove` (the call cost more than
// the copy).
#[inline(always)]
fn copy_short<P: Copy>(out: &mut [P], input: &[P]) {
    let (input, n) = (&input[..out.len()], out.len());
    if n < 8 {
        return out.iter_mut().zip(input).for_each(|(o, i)| *o = *i);
    }
    for (out, input) in out
        .as_chunks_mut::<8>()
        .0
        .iter_mut()
        .zip(input.as_chunks::<8>().0)
    {
        *out = *input;
    }
    // The last block, overlapping the one before where `n` is not a multiple of 8.
    let (out, input): (&mut [P; 8], &[P; 8]) = (
        (&mut out[n - 8..]).try_into().expect("8 values"),
        input[n - 8..].try_into().expect("8 values"),
    );
    *out = *input;
}

// `patch_row` where the stride is 1 and the output as wide as the input (`same` padding, most
// stride-1 convolutions): the output rows that read inside the input read one run of the
// input plane, shifted by the kernel offset, so it is copied at once and only the padding
// columns zeroed after (one a row for a 3×3 kernel). Copying row by row spent more in calls to
// `memmove` for 32 values than in the copies.
fn patch_row_as_plane<P: Patch>(
    g: &Geometry,
    spans: &[Span],
    images: &[P],
    row: usize,
    out: &mut [P],
) {
    let (ci, kh, kw) = g.row_parts(row);
    let (inside, first) = &spans[kw];
    let width = g.out[1];
    let mut rows = (0..g.out[0]).filter_map(|oh| Some((oh, g.input_row(ci, kh, oh)?)));
    let Some((top, start)) = rows.next() else {
        return out.fill(P::ZERO);
    };
    let bottom = rows.next_back().map_or(top, |(oh, _)| oh) + 1;
    // Where, in the image, the first of these rows' first output column reads (`first` is
    // where its first column inside the input reads); negative offsets read off the image's
    // start, which only its padding columns do.
    let from = (start + first) as isize - inside.start as isize;
    for (image, out) in images.chunks(g.image()).zip(out.chunks_mut(g.positions())) {
        let (above, rest) = out.split_at_mut(top * width);
        let (run, below) = rest.split_at_mut((bottom - top) * width);
        above.fill(P::ZERO);
        below.fill(P::ZERO);
        // The part of the run inside the image; what is left out is padding, zeroed below.
        let skip = from.min(0).unsigned_abs();
        let end = run.len().min((image.len() as isize - from).max(0) as usize);
        if skip < end {
            let at = (from + skip as isize) as usize;
            run[skip..end].copy_from_slice(&image[at..][..end - skip]);
        }
        for row in run.chunks_mut(width) {
            zero(&mut row[..inside.start]);
            zero(&mut row[inside.end..]);
        }
    }
}

// Padding's zeros: most often one value or none, where `fill` would call `memset`.
#[inline(always)]
fn zero<P: Patch>(values: &mut [P]) {
    match values {
        [] => {}
        [value] => *value = P::ZERO,
        values => values.fill(P::ZERO),
    }
}

// The reverse of `patch_row` for gradients, for one image: the rows of its `patches`
// (`positions` columns each) added onto the sums, in phases, of the pixels they were read
// from.
fn add_patches(
    g: &Geometry,
    spans: &[Span],
    patches: &[f32],
    (phases, sums): (Phases, &mut [f32]),
) {
    for (row, grads) in patches.chunks(g.positions()).take(g.patch()).enumerate() {
        let (ci, kh, kw) = g.row_parts(row);
        let (inside, first) = &spans[kw];
        for (oh, grads) in grads.chunks(g.out[1]).enumerate() {
            let Some(ih) = g.input_at(0, oh, kh) else {
                continue;
            };
            let grads = &grads[inside.clone()];
            let to = phases.at(ci * g.size[0] + ih, *first);
            for (sum, grad) in sums[to..][..grads.len()].iter_mut().zip(grads) {
                *sum += grad;
            }
        }
    }
}

// One image's gradient `dx` from its output gradient `grads` (`[channels_out, positions]` at
// the row stride of the chunk's `columns`): the weight's transpose times `grads`, each
// column's values summed onto the pixels it was read from, in phases, rejoined, rounded
// once. Image by image, so that the product stays in cache for the sums: as one product for
// a chunk (8 MiB for a small conv net), it went out to memory and back.
fn image_gradient<H: Half, P: Patch>(
    g: &Geometry,
    (weight_t, grads): (Operand<P>, Operand<P>),
    parallel: bool,
    work: &mut ImageWork,
    dx: &mut [H],
) -> Option<()> {
    let product = scratch_of(&mut work.product, g.patch() * g.positions());
    P::gemm(weight_t, grads, product, &mut work.packed, parallel)?;
    let phases = Phases::of(g);
    let sums = scratch_of(&mut work.sums, phases.len(g.channels_in * g.size[0]));
    sums.fill(0.0);
    add_patches(g, &g.column_spans(), product, (phases, sums));
    if phases.stride == 1 {
        H::round(sums, dx);
        return Some(());
    }
    let image = scratch_of(&mut work.image, g.image());
    for (row, phase_rows) in image.chunks_mut(g.size[1]).zip(sums.chunks(phases.len(1))) {
        phases.join(phase_rows, row);
    }
    H::round(image, dx);
    Some(())
}

// The patch matrix of images `first..first + images` of `x` into `patches`, `columns` long
// rows, in tasks of whole rows on rayon's threads where it is large; the images are first
// converted (into `buf`) where the patches are of another type, and split into phases (into
// `phase_buf`) where the column stride is not 1.
fn patches_of_chunk<H: Half, P: Patch>(
    g: &Geometry,
    x: &[H],
    (first, images): (usize, usize),
    (patches, buf, phase_buf): (&mut [P], &mut Vec<P>, &mut Vec<P>),
) -> Option<()> {
    let columns = images * g.positions();
    let x = P::from_half(&x[first * g.image()..][..images * g.image()], buf)?;
    let phases = Phases::of(g);
    let input = match phases.stride {
        1 => x,
        _ => {
            let split = scratch_of(phase_buf, phases.len(x.len() / g.size[1]));
            in_row_tasks(phases.len(1), split, |first, out| {
                let rows = x[first * g.size[1]..].chunks(g.size[1]);
                for (row, out) in rows.zip(out.chunks_mut(phases.len(1))) {
                    phases.split(row, out);
                }
            });
            &*split
        }
    };
    let spans = g.column_spans();
    in_row_tasks(
        columns,
        &mut patches[..g.patch() * columns],
        |first, rows| {
            for (i, out) in rows.chunks_mut(columns).enumerate() {
                patch_row(g, &spans, (phases, input), first + i, out);
            }
        },
    );
    Some(())
}

/// The convolution of `x` by `weight` (both contiguous) on `kernel`, `bias` added to the f32
/// sums, each output rounded once to `H`, as bits; `None` where the kernel does not run
/// (the dot-product GEMM on a CPU without it, or on f16 tensors).
pub fn forward<H: Half>(
    kernel: Kernel,
    g: &Geometry,
    x: &[H],
    weight: &[H],
    bias: Option<&[f32]>,
) -> Option<Vec<u16>> {
    match kernel {
        Kernel::Bf16(_) => forward_in_chunks::<H, bf16>(g, x, weight, bias, CHUNK_VALUES),
        Kernel::F32 => forward_in_chunks::<H, f32>(g, x, weight, bias, CHUNK_VALUES),
    }
}

fn forward_in_chunks<H: Half, P: Patch>(
    g: &Geometry,
    x: &[H],
    weight: &[H],
    bias: Option<&[f32]>,
    budget: usize,
) -> Option<Vec<u16>> {
    let (patch, positions, channels) = (g.patch(), g.positions(), g.channels_out);
    let mut out = half_buffer(g.batch * channels * positions);
    let out_values = as_half::<H>(&mut out);
    with_scratch(&SCRATCH, |scratch| {
        let (buffers, shared) = P::buffers(scratch);
        let weight = P::from_half(weight, &mut buffers.weight)?;
        for (first, images) in g.chunks(budget) {
            let columns = images * positions;
            let patches = scratch_of(&mut buffers.patches, patch * columns);
            patches_of_chunk(
                g,
                x,
                (first, images),
                (&mut *patches, &mut buffers.image, &mut buffers.phases),
            )?;
            P::output(
                g,
                (weight, [channels, patch], [patch, 1]),
                (patches, [patch, columns], [columns, 1]),
                bias,
                &mut out_values[first * channels * positions..][..channels * columns],
                shared,
                parallel(channels, columns, patch),
            )?;
        }
        scratch.release_large();
        Some(())
    })?;
    Some(out)
}

// The chunk's product `[channels, images · positions]` into its output `[images, channels,
// positions]`, `bias` added to the f32 sums, each rounded once: in tasks of whole images, as
// one thread this was 4% of a bf16 conv net's step.
fn round_output<H: Half>(g: &Geometry, product: &[f32], bias: Option<&[f32]>, out: &mut [H]) {
    let (positions, channels) = (g.positions(), g.channels_out);
    let columns = product.len() / channels;
    in_row_tasks(channels * positions, out, |first, out| {
        let mut sums = Vec::new();
        for (n, image) in out.chunks_mut(channels * positions).enumerate() {
            for (c, plane) in image.chunks_mut(positions).enumerate() {
                let row = &product[c * columns + (first + n) * positions..][..positions];
                match bias {
                    Some(bias) => {
                        sums.clear();
                        sums.extend(row.iter().map(|v| v + bias[c]));
                        H::round(&sums, plane);
                    }
                    None => H::round(row, plane),
                }
            }
        }
    });
}

/// The gradients of `x` and of `weight` (each where asked for) of the convolution that gave
/// the output gradient `grad`, on `kernel`, as bits of `H`: f32 sums, rounded once. `None`
/// where the kernel does not run (see [`forward`]).
pub fn backward<H: Half>(
    kernel: Kernel,
    g: &Geometry,
    x: &[H],
    weight: &[H],
    grad: &[H],
    want: [bool; 2],
) -> Option<[Option<Vec<u16>>; 2]> {
    match kernel {
        Kernel::Bf16(_) => backward_in_chunks::<H, bf16>(g, x, weight, grad, want, CHUNK_VALUES),
        Kernel::F32 => backward_in_chunks::<H, f32>(g, x, weight, grad, want, CHUNK_VALUES),
    }
}

fn backward_in_chunks<H: Half, P: Patch>(
    g: &Geometry,
    x: &[H],
    weight: &[H],
    grad: &[H],
    [want_x, want_weight]: [bool; 2],
    budget: usize,
) -> Option<[Option<Vec<u16>>; 2]> {
    let (patch, positions, channels) = (g.patch(), g.positions(), g.channels_out);
    let mut dx = want_x.then(|| half_buffer(g.batch * g.image()));
    let mut dw_sums = want_weight.then(|| vec![0f32; channels * patch]);
    with_scratch(&SCRATCH, |scratch| {
        let (buffers, shared) = P::buffers(scratch);
        let weight = P::from_half(weight, &mut buffers.weight)?;
        for (first, images) in g.chunks(budget) {
            let columns = images * positions;
            // The output gradient as `[channels, images · positions]`, the GEMMs' order:
            // straight into place, plane by plane (no converted copy of the images first), in
            // tasks of whole channels (on one thread, these copies were 2% of a bf16 conv
            // net's step, with the other threads idle).
            let grads = scratch_of(&mut buffers.grad, channels * columns);
            let (chunk, failed) = (
                &grad[first * channels * positions..],
                AtomicBool::new(false),
            );
            in_row_tasks(columns, grads, |c0, rows| {
                for (c, row) in (c0..).zip(rows.chunks_mut(columns)) {
                    for (n, out) in row.chunks_mut(positions).enumerate() {
                        let plane = &chunk[(n * channels + c) * positions..][..positions];
                        if P::write_from_half(plane, out).is_none() {
                            failed.store(true, Ordering::Relaxed);
                        }
                    }
                }
            });
            if failed.into_inner() {
                return None;
            }
            if let Some(dx) = dx.as_mut() {
                let weight_t = (weight, [patch, channels], [1, patch]);
                let dx = &mut as_half::<H>(dx)[first * g.image()..][..images * g.image()];
                // Image by image, each a task where there are several; the GEMMs on threads
                // of their own only where the images are too few to keep them all busy.
                let parallel =
                    parallel(patch, positions, channels) && images < rayon::current_num_threads();
                let (grads, failed) = (&*grads, AtomicBool::new(false));
                in_row_tasks(g.image(), dx, |first, dx| {
                    with_scratch(&IMAGE_WORK, |work| {
                        for (i, dx) in dx.chunks_mut(g.image()).enumerate() {
                            let grads = &grads[(first + i) * positions..];
                            let grads = (grads, [channels, positions], [columns, 1]);
                            let done = image_gradient(g, (weight_t, grads), parallel, work, dx);
                            if done.is_none() {
                                failed.store(true, Ordering::Relaxed);
                            }
                        }
                        work.release_large();
                    })
                });
                if failed.into_inner() {
                    return None;
                }
            }
            let grads: Operand<P> = (grads, [channels, columns], [columns, 1]);
            if let Some(sums) = dw_sums.as_mut() {
                let patches = scratch_of(&mut buffers.patches, patch * columns);
                patches_of_chunk(
                    g,
                    x,
                    (first, images),
                    (&mut *patches, &mut buffers.image, &mut buffers.phases),
                )?;
                let product = scratch_of(&mut shared.product, channels * patch);
                let patches_t = (&*patches, [columns, patch], [1, columns]);
                let parallel = parallel(channels, patch, columns);
                P::gemm(grads, patches_t, product, &mut shared.packed, parallel)?;
                sums.iter_mut()
                    .zip(product.iter())
                    .for_each(|(sum, p)| *sum += p);
            }
        }
        scratch.release_large();
        Some(())
    })?;
    let dw = dw_sums.map(|sums| {
        let mut bits = half_buffer(sums.len());
        H::round(&sums, as_half::<H>(&mut bits));
        bits
    });
    Some([dx, dw])
}

/// How [`channel_sums`] sums a channel's values within an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumOrder {
    /// One running sum, value after value: Flex's order, and its bits.
    InOrder,
    /// 16 running sums that vectorise, added up at the end of each image (a single chain of
    /// dependent additions was 6% of a bf16 conv net's step).
    InLanes,
}

/// The f32 sum of each channel of `values`, `[batch, channels, positions]` (a convolution's
/// bias gradient before it is rounded): each plane widened into a buffer of its own as it is
/// summed, in `order`, over the images in order either way; the channels shared among rayon's
/// threads where `parallel`.
pub fn channel_sums<H: Half>(
    values: &[H],
    [batch, channels, positions]: [usize; 3],
    order: SumOrder,
    parallel: bool,
) -> Vec<f32> {
    let channel_sum = |c: usize, wide: &mut Vec<f32>| {
        wide.resize(positions, 0.0);
        (0..batch).fold(0f32, |sum, n| {
            H::widen(&values[(n * channels + c) * positions..][..positions], wide);
            match order {
                SumOrder::InOrder => wide.iter().fold(sum, |acc, g| acc + g),
                SumOrder::InLanes => sum + sum_in_lanes(wide),
            }
        })
    };
    // Channels in about 8 tasks a thread, each with one widening buffer.
    let per_task = channels.div_ceil(8 * rayon::current_num_threads()).max(1);
    let mut sums = vec![0f32; channels];
    for_each_chunk(&mut sums, per_task, parallel, |t, sums| {
        let mut wide = Vec::new();
        for (c, sum) in sums.iter_mut().enumerate() {
            *sum = channel_sum(t * per_task + c, &mut wide);
        }
    });
    sums
}

// The sum of `values` in 16 running sums (one vector's worth), then across them.
fn sum_in_lanes(values: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = values.chunks_exact(16);
    let rest = chunks.remainder().iter().sum::<f32>();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(lane, v)| *lane += v);
    }
    lanes.iter().sum::<f32>() + rest
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;

    fn options(stride: usize, padding: usize, dilation: usize) -> Conv2dOptions {
        Conv2dOptions::new(
            [stride, stride],
            [padding, padding],
            [dilation, dilation],
            1,
        )
    }

    #[test]
    fn columns_inside_the_input_are_those_input_at_finds() {
        for (w, k, stride, padding, dilation) in geometries() {
            let options = options(stride, padding, dilation);
            let Some(g) = Geometry::new(&[1, 1, 3, w], &[1, 1, 1, k], &options) else {
                continue;
            };
            for kw in 0..k {
                let (inside, first) = g.columns(kw);
                for ow in 0..g.out[1] {
                    let want = g.input_at(1, ow, kw);
                    let got = inside
                        .contains(&ow)
                        .then(|| first + (ow - inside.start) * stride);
                    assert_eq!(got, want, "w {w} k {k} {stride}/{padding}/{dilation}: {ow}");
                }
            }
        }
    }

    // Input widths, kernel widths, strides, paddings and dilations, every combination.
    fn geometries() -> impl Iterator<Item = (usize, usize, usize, usize, usize)> {
        (1..9).flat_map(|w| {
            (1..5).flat_map(move |k| {
                (1..4).flat_map(move |s| {
                    (0..4).flat_map(move |p| (1..3).map(move |d| (w, k, s, p, d)))
                })
            })
        })
    }

    fn values<H: Half>(n: usize, seed: u32) -> Vec<H> {
        let wide: Vec<f32> = (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 600.0 - 1.6)
            .collect();
        let mut out = vec![H::default(); n];
        H::round(&wide, &mut out);
        out
    }

    fn value<H: Half>(h: H) -> f64 {
        let mut wide = [0f32];
        H::widen(&[h], &mut wide);
        f64::from(wide[0])
    }

    // The direct convolution and its gradients in f64, with each value's bound: the f32 sum
    // of `k` terms (`k · ε · Σ|term|`) and one rounding to `H` (`half_ulp`, relative).
    struct Reference {
        out: Vec<(f64, f64)>,
        dx: Vec<(f64, f64)>,
        dw: Vec<(f64, f64)>,
    }

    fn reference<H: Half>(
        g: &Geometry,
        [x, w, grad]: [&[H]; 3],
        bias: &[f32],
        half_ulp: f64,
    ) -> Reference {
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
                                    add(&mut out[o], value(x[i]) * value(w[k]));
                                    add(&mut dx[i], value(grad[o]) * value(w[k]));
                                    add(&mut dw[k], value(grad[o]) * value(x[i]));
                                }
                            }
                        }
                    }
                }
            }
        }
        let terms = g.batch * g.positions() + g.patch() + co_n * kh_n * kw_n;
        let bound = move |(sum, abs): (f64, f64)| {
            let f32_sum = terms as f64 * f64::from(f32::EPSILON) * abs;
            (sum, f32_sum + (sum.abs() + f32_sum) * half_ulp)
        };
        Reference {
            out: out.into_iter().map(bound).collect(),
            dx: dx.into_iter().map(bound).collect(),
            dw: dw.into_iter().map(bound).collect(),
        }
    }

    fn assert_within<H: Half>(name: &str, got: &[u16], want: &[(f64, f64)]) {
        assert_eq!(got.len(), want.len(), "{name}");
        let got: &[H] = bytemuck::cast_slice(got);
        for (i, (got, (sum, bound))) in got.iter().map(|h| value(*h)).zip(want).enumerate() {
            assert!(
                (got - sum).abs() <= *bound,
                "{name}[{i}]: {got} against {sum} ± {bound}"
            );
        }
    }

    // The output and both gradients on `kernel` against the direct convolution: plain,
    // strided and padded as in a small conv net, dilated, a 1×1 kernel, one image, and two
    // large enough for the patches and the input's gradient to be split into several tasks
    // (`TASK` values each); each also in chunks of one image (a budget of one value).
    fn check<H: Half, P: Patch>(half_ulp: f64) {
        let cases = [
            ([2, 3, 7, 6], [4, 3, 3, 3], 1, 0, 1),
            ([3, 5, 9, 8], [6, 5, 3, 3], 2, 1, 1),
            ([2, 2, 9, 9], [3, 2, 3, 2], 1, 2, 2),
            ([2, 7, 4, 5], [5, 7, 1, 1], 1, 0, 1),
            ([1, 3, 6, 6], [2, 3, 5, 5], 3, 2, 1),
            ([6, 4, 66, 70], [2, 4, 3, 3], 1, 1, 1),
            ([5, 4, 70, 66], [3, 4, 3, 3], 2, 1, 1),
            // Odd widths, column strides of 2 and 3: the last phase shorter.
            ([2, 3, 7, 9], [4, 3, 3, 3], 2, 1, 1),
            ([2, 2, 8, 7], [3, 2, 2, 3], 3, 1, 1),
            // Stride 1, output as wide as the input: patch rows copied as planes.
            ([2, 3, 8, 7], [2, 3, 3, 3], 1, 2, 2),
            ([1, 2, 5, 6], [2, 2, 5, 5], 1, 2, 1),
            // An output gradient copied into the GEMMs' order in several tasks.
            ([4, 3, 40, 40], [16, 3, 3, 3], 1, 1, 1),
        ];
        for (xs, ws, stride, padding, dilation) in cases {
            let g = Geometry::new(&xs, &ws, &options(stride, padding, dilation)).unwrap();
            let x = values::<H>(xs.iter().product(), 1);
            let w = values::<H>(ws.iter().product(), 2);
            let bias: Vec<f32> = (0..ws[0]).map(|c| c as f32 * 0.25 - 0.5).collect();
            let grad = values::<H>(g.batch * g.channels_out * g.positions(), 3);
            let want = reference(&g, [&x, &w, &grad], &bias, half_ulp);
            for budget in [CHUNK_VALUES, 1] {
                let case = format!(
                    "{:?} on {}: {xs:?} * {ws:?}, stride {stride}, padding {padding}, \
                     dilation {dilation}, budget {budget}",
                    H::KIND,
                    std::any::type_name::<P>(),
                );
                let out = forward_in_chunks::<H, P>(&g, &x, &w, Some(&bias), budget).unwrap();
                assert_within::<H>(&format!("output of {case}"), &out, &want.out);
                let [dx, dw] =
                    backward_in_chunks::<H, P>(&g, &x, &w, &grad, [true, true], budget).unwrap();
                assert_within::<H>(&format!("x's gradient of {case}"), &dx.unwrap(), &want.dx);
                assert_within::<H>(&format!("w's gradient of {case}"), &dw.unwrap(), &want.dw);
            }
        }
    }

    #[test]
    fn dot_products_match_the_direct_convolution() {
        if bf16_gemm::kernel().is_none() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        check::<bf16, bf16>(1.0 / 256.0);
    }

    #[test]
    fn f32_gemms_match_the_direct_convolution_in_both_half_types() {
        check::<bf16, f32>(1.0 / 256.0);
        check::<f16, f32>(1.0 / 2048.0);
    }

    #[test]
    fn f16_values_are_refused_by_the_bf16_kernel() {
        let g = Geometry::new(&[1, 1, 3, 3], &[1, 1, 2, 2], &options(1, 0, 1)).unwrap();
        let (x, w) = (values::<f16>(9, 1), values::<f16>(4, 2));
        let bf16 = Kernel::Bf16(crate::bf16_gemm::Bf16Kernel::DotProducts);
        assert!(forward(bf16, &g, &x, &w, None).is_none());
        assert!(forward(Kernel::F32, &g, &x, &w, None).is_some());
    }

    #[test]
    fn gradients_are_computed_only_where_asked_for() {
        let (xs, ws) = ([2, 3, 5, 5], [2, 3, 3, 3]);
        let g = Geometry::new(&xs, &ws, &options(1, 1, 1)).unwrap();
        let (x, w) = (values::<bf16>(150, 1), values::<bf16>(54, 2));
        let grad = values::<bf16>(g.batch * g.channels_out * g.positions(), 3);
        let [dx, dw] = backward(Kernel::F32, &g, &x, &w, &grad, [false, true]).unwrap();
        assert!(dx.is_none() && dw.is_some());
        let [dx, dw] = backward(Kernel::F32, &g, &x, &w, &grad, [true, false]).unwrap();
        assert!(dx.is_some() && dw.is_none());
    }

    #[test]
    fn geometries_the_gemms_do_not_compute_are_refused() {
        let plain = options(1, 0, 1);
        assert!(Geometry::new(&[1, 3, 5, 5], &[2, 3, 3, 3], &plain).is_some());
        let grouped = Conv2dOptions::new([1, 1], [0, 0], [1, 1], 3);
        assert!(Geometry::new(&[1, 3, 5, 5], &[3, 1, 3, 3], &grouped).is_none());
        // Channels that do not match, a kernel larger than the padded input, an empty batch.
        assert!(Geometry::new(&[1, 3, 5, 5], &[2, 4, 3, 3], &plain).is_none());
        assert!(Geometry::new(&[1, 3, 2, 2], &[2, 3, 3, 3], &plain).is_none());
        assert!(Geometry::new(&[0, 3, 5, 5], &[2, 3, 3, 3], &plain).is_none());
        assert!(Geometry::new(&[1, 3, 5], &[2, 3, 3, 3], &plain).is_none());
    }

    #[test]
    fn channel_sums_on_threads_are_the_sums_on_one() {
        let sizes = [3, 5, 1000];
        let values: Vec<bf16> = (0..sizes.iter().product::<usize>())
            .map(|i| bf16::from_f32(((i * 7919) % 201) as f32 / 50.0 - 2.0))
            .collect();
        for order in [SumOrder::InOrder, SumOrder::InLanes] {
            let on_one = channel_sums(&values, sizes, order, false);
            let on_threads = channel_sums(&values, sizes, order, true);
            let bits = |sums: &[f32]| sums.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&on_threads), bits(&on_one), "{order:?}");
            for (c, sum) in on_one.iter().enumerate() {
                let exact: f64 = (0..sizes[0])
                    .flat_map(|n| &values[(n * sizes[1] + c) * sizes[2]..][..sizes[2]])
                    .map(|v| f64::from(v.to_f32()))
                    .sum();
                assert!(
                    (f64::from(*sum) - exact).abs() < 1e-3,
                    "{order:?} channel {c}"
                );
            }
        }
    }
}
