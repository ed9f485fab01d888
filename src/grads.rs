//! Whole-model gradient operations on Burn's [`GradientsParams`]: unscale-and-check,
//! accumulation, clipping.
//!
//! Everything here stays on the device. The overflow check folds one indicator per gradient
//! into a single scalar tensor ([`OverflowCheck`]) that is read from the host once, when the
//! optimizer step needs the answer: one synchronisation per step, none per parameter (torch's
//! `GradScaler` also needs exactly one).
//!
//! A module's parameters are visited with Burn's [`ModuleVisitor`], which is how the rank of
//! each gradient is known; gradients of parameters that are not in the module are left alone.

use core::cell::Cell;
use core::marker::PhantomData;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, ElementConversion, FloatDType, Tensor};

thread_local! {
    static HOST_READS: Cell<u64> = const { Cell::new(0) };
}

/// How many overflow indicators this thread has read from the device so far.
///
/// The only host synchronisation the crate's scaling path makes is
/// [`OverflowCheck::found_inf`]; this counts them, so that a test or a benchmark can check
/// that an optimizer step costs exactly one.
pub fn host_reads() -> u64 {
    HOST_READS.with(Cell::get)
}

/// Whether some checked gradient held an inf or a NaN, still on the device.
///
/// The indicator is a one-element f32 tensor, 0 when every checked value was finite and NaN
/// otherwise: each gradient contributes `sum(g) * 0`, which is NaN when `g` holds an inf or a
/// NaN (an inf or NaN term makes the sum non-finite, and `inf * 0` is NaN).
///
/// One deliberate difference from torch, for speed: the sum is one pass with no temporary,
/// where the exact `sum(g * 0)` costs a second pass and a gradient-sized allocation (on the
/// benchmark MLP, 1.2-2.7% of a training step against 3.6-4.7%; see `BENCHMARKS.md`). It can
/// raise a false alarm only when one f32 gradient tensor's *finite* scaled values sum past
/// `f32::MAX` (their mean magnitude above `f32::MAX / len`): that step is then skipped and the
/// scale backs off, where torch would apply it. Half-precision gradients, whose sums could
/// realistically pass f16's 65504, get the exact check.
#[derive(Debug, Clone)]
#[must_use = "an overflow check is only useful once read with found_inf"]
pub struct OverflowCheck<B: Backend> {
    indicator: Option<Tensor<B, 1>>,
}

impl<B: Backend> OverflowCheck<B> {
    /// A check that found nothing and costs nothing to read (no gradients, or no scaling).
    pub fn clean() -> Self {
        Self { indicator: None }
    }

    /// Folds another gradient's indicator in, on the device.
    fn add(&mut self, indicator: Tensor<B, 1>) {
        let indicator = if indicator.dtype() == DType::F32 {
            indicator
        } else {
            indicator.cast(FloatDType::F32)
        };
        self.indicator = Some(match self.indicator.take() {
            Some(acc) => acc + indicator,
            None => indicator,
        });
    }

    /// Reads the answer: the one host synchronisation of an optimizer step.
    pub fn found_inf(self) -> bool {
        match self.indicator {
            None => false,
            Some(indicator) => {
                HOST_READS.with(|n| n.set(n.get() + 1));
                let value: f32 = indicator.into_scalar().elem();
                value != 0.0
            }
        }
    }
}

/// Multiplies every gradient of `module`'s float parameters in `grads` by `factor` (the inverse
/// loss scale, possibly folded with another factor), after checking the *scaled* values for
/// inf and NaN as torch's `_amp_foreach_non_finite_check_and_unscale_` does.
///
/// Checking before unscaling matters when the scale has underflowed to 0: the scaled
/// gradients are then all zeros (clean), and unscaling them by an infinite factor gives NaN,
/// exactly as in torch. A `factor` of 1 multiplies nothing.
///
/// This is the function both the [`Accelerator`](crate::Accelerator) and a training loop that
/// arms the decorator's scale ([`ArmedLossScale`](crate::scaler::ArmedLossScale)) use.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::{Autodiff, Flex};
/// use burn::nn::LinearConfig;
/// use burn::optim::GradientsParams;
/// use burn::tensor::Tensor;
/// use burn_accelerate::grads;
///
/// type B = Autodiff<Flex>;
/// let device = Default::default();
/// let model = LinearConfig::new(3, 1).init::<B>(&device);
/// let loss = model.forward(Tensor::<B, 2>::ones([2, 3], &device)).sum() * 1024.0;
/// let mut g = GradientsParams::from_grads(loss.backward(), &model);
/// let check = grads::unscale_and_check::<B, _>(&model, &mut g, 1.0 / 1024.0);
/// assert!(!check.found_inf()); // the one host read
/// let bias = g.get::<Flex, 1>(model.bias.as_ref().unwrap().id).unwrap();
/// assert_eq!(bias.into_data().to_vec::<f32>().unwrap(), [2.0]);
/// # }
/// ```
pub fn unscale_and_check<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: f32,
) -> OverflowCheck<B::InnerBackend> {
    let mut visitor = UnscaleAndCheck::<B> {
        grads,
        factor,
        check: OverflowCheck::clean(),
    };
    module.visit(&mut visitor);
    visitor.check
}

/// Multiplies every gradient of `module` in `grads` by `factor`, without checking.
pub fn scale<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: f32,
) {
    if factor != 1.0 {
        module.visit(&mut MapGrads::<B, _>::new(grads, |g: Flat<B>| {
            g.mul_scalar(factor)
        }));
    }
}

/// Adds `new` into `acc`, parameter by parameter (a gradient present in only one is kept).
pub fn accumulate<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    acc: &mut GradientsParams,
    mut new: GradientsParams,
) {
    if acc.is_empty() {
        *acc = new;
        return;
    }
    module.visit(&mut Accumulate::<B> {
        acc,
        new: &mut new,
        _backend: PhantomData,
    });
}

/// Scales all gradients of `module` together so that their global 2-norm is at most
/// `max_norm`, as `torch.nn.utils.clip_grad_norm_` does; returns the norm before clipping, on
/// the device.
///
/// The clip coefficient `max_norm / (norm + 1e-6)`, capped at 1, multiplies every gradient on
/// the device: no host read. A non-finite norm makes the gradients non-finite, as in torch;
/// with loss scaling the overflow check has already flagged such a step.
pub fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f32,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let norm = sum_of_squares::<B, M>(module, grads)?.sqrt();
    clip_to_norm::<B, M>(module, grads, norm.clone(), max_norm);
    Some(norm)
}

/// The sum of the squares of every gradient of `module` in `grads`, in f32, on the device
/// (`None` without gradients): a sharded process's part of the global norm.
pub(crate) fn sum_of_squares<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> Option<Tensor<B::InnerBackend, 1>> {
    let mut squares = SumOfSquares::<B> { grads, total: None };
    module.visit(&mut squares);
    squares.total
}

/// Scales every gradient by the clip coefficient of a global 2-norm `norm` against
/// `max_norm` (torch's, see [`clip_grad_norm`]).
pub(crate) fn clip_to_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    norm: Tensor<B::InnerBackend, 1>,
    max_norm: f32,
) {
    let coef = norm
        .clone()
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0);
    module.visit(&mut MapGrads::<B, _>::new(grads, move |g: Flat<B>| {
        let coef = if g.dtype() == coef.dtype() {
            coef.clone()
        } else {
            coef.clone().cast(g.dtype())
        };
        g * coef
    }));
}

/// Clamps every gradient of `module` to `[-clip_value, clip_value]`
/// (`torch.nn.utils.clip_grad_value_`).
pub fn clip_grad_value<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    clip_value: f32,
) {
    module.visit(&mut MapGrads::<B, _>::new(grads, |g: Flat<B>| {
        g.clamp(-clip_value, clip_value)
    }));
}

// A gradient seen flattened, by the maps below.
type Flat<B> = Tensor<<B as AutodiffBackend>::InnerBackend, 1>;

// Applies an elementwise map (with a scalar, or a broadcast one-element tensor) to every
// gradient. A closure cannot be generic over the rank, so it sees each gradient flattened and
// the result is reshaped back.
struct MapGrads<'a, B: AutodiffBackend, F> {
    grads: &'a mut GradientsParams,
    f: F,
    _backend: PhantomData<B>,
}

impl<'a, B: AutodiffBackend, F> MapGrads<'a, B, F> {
    fn new(grads: &'a mut GradientsParams, f: F) -> Self {
        Self {
            grads,
            f,
            _backend: PhantomData,
        }
    }
}

impl<B, F> ModuleVisitor<B> for MapGrads<'_, B, F>
where
    B: AutodiffBackend,
    F: Fn(Flat<B>) -> Flat<B>,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let shape = grad.shape();
            let flat = grad.reshape([shape.num_elements()]);
            let grad: Tensor<B::InnerBackend, D> = (self.f)(flat).reshape(shape);
            self.grads.register(param.id, grad);
        }
    }
}

struct UnscaleAndCheck<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    factor: f32,
    check: OverflowCheck<B::InnerBackend>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for UnscaleAndCheck<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let indicator = if grad.dtype() == DType::F32 || grad.dtype() == DType::F64 {
            grad.clone().sum()
        } else {
            grad.clone().mul_scalar(0.0).sum()
        };
        self.check.add(indicator.reshape([1]).mul_scalar(0.0));
        let grad = if self.factor == 1.0 {
            grad
        } else {
            grad.mul_scalar(self.factor)
        };
        self.grads.register(param.id, grad);
    }
}

struct Accumulate<'a, B: AutodiffBackend> {
    acc: &'a mut GradientsParams,
    new: &'a mut GradientsParams,
    _backend: PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Accumulate<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(new) = self.new.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let sum = match self.acc.remove::<B::InnerBackend, D>(param.id) {
            Some(old) => old + new,
            None => new,
        };
        self.acc.register(param.id, sum);
    }
}

struct SumOfSquares<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    total: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumOfSquares<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let grad = if grad.dtype() == DType::F32 {
            grad
        } else {
            grad.cast(FloatDType::F32)
        };
        let squares = grad.square().sum().reshape([1]);
        self.total = Some(match self.total.take() {
            Some(total) => total + squares,
            None => squares,
        });
    }
}
