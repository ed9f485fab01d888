//! GELU (Burn's exact form, `x · Φ(x)`) of Flex's f32, bf16 and f16 tensors on the kernels of
//! `burn_accelerate_kernels::gelu` (vectorised, on every core, each half value rounded once;
//! their docs give how `Φ` is computed and to what accuracy), with its autodiff node, which
//! keeps the input and computes Flex's exact derivative `g · (Φ(x) + x · φ(x))` in one pass
//! (Burn's trait default `gelu_backward` is the derivative of the tanh approximation, but
//! Flex, and so `Autodiff<Flex>`, overrides it with the exact one).
//!
//! Flex 0.21 computes GELU one value at a time with libm's scalar `erff`, each bf16 or f16
//! value widened and rounded alone (`gelu` in `burn-flex-0.21.0/src/ops/activation.rs`), and
//! its backward likewise with `erff` and `expf`. A transformer's feed-forward activation
//! (`[batch, seq, 4 · d_model]`) spent a large share of a bf16 step there.
//!
//! Taken for f32, bf16 and f16 tensors whose values lie contiguous, in order; anything else
//! goes to Flex's own GELU, or Burn's node on `Autodiff<Flex>`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Element};
use burn_accelerate_kernels::gelu::{self as kernels, Real};
use burn_accelerate_kernels::isa::Isa;
use burn_backend::ops::ActivationOps;
use burn_backend::tensor::FloatTensor;
use half::{bf16, f16};

/// An element type the kernels take (f32, bf16 or f16) that Flex's tensors hold.
trait FlexReal: Real + Element {}

impl<E: Real + Element> FlexReal for E {}

/// Runs `$body` with `$e` the element type of `$dtype`, or evaluates `$otherwise`.
macro_rules! with_real {
    ($dtype:expr, $e:ident => $body:expr, _ => $otherwise:expr) => {
        match $dtype {
            DType::F32 => {
                type $e = f32;
                $body
            }
            DType::BF16 => {
                type $e = bf16;
                $body
            }
            DType::F16 => {
                type $e = f16;
                $body
            }
            _ => $otherwise,
        }
    };
}

/// Whether the kernels take `t`: f32, bf16 or f16, its values contiguous, in order.
fn fits(t: &FlexTensor) -> bool {
    matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) && t.layout().is_contiguous()
}

/// `t`'s values where nothing else holds its buffer, to be written in place.
fn values_mut<E: FlexReal>(t: &mut FlexTensor) -> Option<&mut [E]> {
    let (start, end) = t.layout().contiguous_offsets()?;
    t.try_storage_mut::<E>()
        .map(|storage| &mut storage[start..end])
}

/// GELU of `t` (which [`fits`]) in `E`: in place where nothing else holds its buffer, else
/// into a new one.
fn forward<E: FlexReal>(mut t: FlexTensor, isa: Isa) -> FlexTensor {
    if let Some(values) = values_mut::<E>(&mut t) {
        kernels::gelu_in_place(isa, values);
        return t;
    }
    let src = t.as_slice::<E>().expect("gelu takes tensors that fit");
    let out = kernels::gelu_to(isa, src);
    FlexTensor::new(
        burn::tensor::Bytes::from_elems(out),
        burn::backend::flex::Layout::contiguous(t.layout().shape().clone()),
        E::dtype(),
    )
}

/// GELU's input gradient in `E` from its input `x` and the output's gradient `grad` (both
/// of one shape, `x` contiguous): in place in `grad`'s buffer where nothing else holds it.
fn backward<E: FlexReal>(x: &FlexTensor, mut grad: FlexTensor, isa: Isa) -> FlexTensor {
    let xs = x.as_slice::<E>().expect("gelu takes tensors that fit");
    if let Some(gs) = values_mut::<E>(&mut grad) {
        kernels::gelu_backward_in_place(isa, xs, gs);
        return grad;
    }
    let gs = grad.as_slice::<E>().expect("contiguous by now");
    let out = kernels::gelu_backward_to(isa, xs, gs);
    FlexTensor::new(
        burn::tensor::Bytes::from_elems(out),
        burn::backend::flex::Layout::contiguous(grad.layout().shape().clone()),
        E::dtype(),
    )
}

fn gelu_on(tensor: FlexTensor, isa: Isa) -> FlexTensor {
    match fits(&tensor) {
        true => with_real!(tensor.dtype(), E => forward::<E>(tensor, isa), _ => Flex::gelu(tensor)),
        false => Flex::gelu(tensor),
    }
}

fn gelu_backward_on(x: FlexTensor, grad: FlexTensor, isa: Isa) -> FlexTensor {
    let same = x.dtype() == grad.dtype() && x.layout().shape() == grad.layout().shape();
    if !(same && fits(&x)) {
        return Flex::gelu_backward(x, grad);
    }
    let grad = match grad.layout().is_contiguous() {
        true => grad,
        false => grad.to_contiguous(),
    };
    with_real!(x.dtype(), E => backward::<E>(&x, grad, isa), _ => Flex::gelu_backward(x, grad))
}

/// GELU of a tensor: the kernel for f32, bf16 and f16 tensors that lie contiguous, Flex's own
/// for anything else.
pub(crate) fn gelu(tensor: FlexTensor) -> FlexTensor {
    gelu_on(tensor, Isa::best())
}

/// [`gelu`] as a node of Burn's autodiff, keeping the input for the backward pass; Burn's own
/// node for what the kernel does not take.
pub(crate) fn gelu_tracked(tensor: FloatTensor<Autodiff<Flex>>) -> FloatTensor<Autodiff<Flex>> {
    #[derive(Debug)]
    struct Gelu;

    impl Backward<Flex, 1> for Gelu {
        type State = FlexTensor;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let input = ops.state;
            unary::<Flex, _>(ops.parents, ops.node, grads, |grad| {
                gelu_backward_on(input, grad, Isa::best())
            });
        }
    }

    if !fits(&tensor.primitive) {
        return Autodiff::<Flex>::gelu(tensor);
    }
    let node = tensor.node.clone();
    match Gelu
        .prepare::<NoCheckpointing>([node])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let input = tensor.primitive;
            let output = gelu(input.clone());
            prep.finish(input, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(gelu(tensor.primitive)),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;
    use burn_accelerate_kernels::gelu::reference::{cdf64, pdf64};
    use burn_backend::FloatDType;
    use burn_backend::ops::FloatTensorOps;

    use super::*;

    // Every path this CPU runs: the portable fallback always.
    fn paths() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.supported()).collect()
    }

    fn tensor(values: Vec<f32>, shape: &[usize], dtype: FloatDType) -> FlexTensor {
        Flex::float_cast(
            FlexTensor::from_data(TensorData::new(values, shape.to_vec())),
            dtype,
        )
    }

    fn wide(t: FlexTensor) -> Vec<f32> {
        t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
    }

    // The gap between `v` (a value of `dtype`) and the next one away from zero.
    fn half_ulp_at(v: f32, dtype: FloatDType) -> f64 {
        let v = v.abs();
        let next = match dtype {
            FloatDType::BF16 => {
                let h = bf16::from_f32(v);
                bf16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()
            }
            _ => {
                let h = f16::from_f32(v);
                f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32()
            }
        };
        f64::from(next)
    }

    #[test]
    fn half_tensors_round_once_within_one_ulp_of_the_exact_value() {
        // Every bf16 (and f16) from -14 to 14, as a tensor of odd length (a short last block).
        let from_bits = |bits: u32| f32::from_bits(bits << 16);
        let bf: Vec<f32> = (0..0x4160u32)
            .map(from_bits)
            .chain((0x8000..0xC160u32).map(from_bits))
            .collect();
        let hf: Vec<f32> = (0..0x7C00u16)
            .chain(0x8000..0xFC00)
            .map(|b| f16::from_bits(b).to_f32())
            .filter(|x| x.abs() < 14.0)
            .collect();
        for (dtype, xs) in [(FloatDType::BF16, bf), (FloatDType::F16, hf)] {
            let n = xs.len();
            let x = tensor(xs.clone(), &[n], dtype);
            let g: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) / 4.0).collect();
            let grad = tensor(g.clone(), &[n], dtype);
            for isa in paths() {
                let y = wide(gelu_on(x.clone(), isa));
                let dx = wide(gelu_backward_on(x.clone(), grad.clone(), isa));
                for i in 0..n {
                    let x64 = f64::from(xs[i]);
                    let want = x64 * cdf64(x64);
                    let err = (f64::from(y[i]) - want).abs();
                    let tol = half_ulp_at(want as f32, dtype) * 1.0001 + 1e-45;
                    assert!(
                        err <= tol,
                        "{dtype:?} gelu({}) = {}, not {want}",
                        xs[i],
                        y[i]
                    );
                    let gi = f64::from(g[i]);
                    let (cdf, slope) = (cdf64(x64), x64 * pdf64(x64));
                    let want = gi * (cdf + slope);
                    let f32_error = 4.0 * 2f64.powi(-23) * gi.abs() * cdf.abs().max(slope.abs());
                    let tol = half_ulp_at(want as f32, dtype) * 1.0001 + f32_error;
                    let err = (f64::from(dx[i]) - want).abs();
                    assert!(
                        err <= tol,
                        "{dtype:?} gelu'({}) · {gi} = {}, not {want}",
                        xs[i],
                        dx[i]
                    );
                }
            }
        }
    }

    #[test]
    fn near_flexs_own_where_flex_is_accurate() {
        // Flex computes `1 + erff(x/√2)`, which cancels for negative x: above -3 it is
        // accurate to a few ulp of its result, and the two agree.
        let xs: Vec<f32> = (0..6001).map(|i| i as f32 / 1000.0 - 3.0).collect();
        let n = xs.len();
        for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
            let x = tensor(xs.clone(), &[n], dtype);
            let ours = wide(gelu(x.clone()));
            let flex = wide(Flex::gelu(x.clone()));
            let g = tensor(vec![0.75; n], &[n], dtype);
            let ours_dx = wide(gelu_backward_on(x.clone(), g.clone(), Isa::best()));
            let flex_dx = wide(Flex::gelu_backward(x, g));
            // Flex's error in f32 is about |x| · 2⁻²³ (an ulp of `1 + erf`); a half result
            // is one value of the dtype or its neighbour.
            let (relative, mut differ) = (
                match dtype {
                    FloatDType::F32 => 1e-6,
                    FloatDType::BF16 => 8e-3,
                    _ => 1e-3,
                },
                0,
            );
            for i in 0..n {
                let tol = relative * flex[i].abs() + 2e-7 * (1.0 + xs[i].abs());
                assert!((ours[i] - flex[i]).abs() <= tol, "{dtype:?} {}", xs[i]);
                assert!(
                    (ours_dx[i] - flex_dx[i]).abs() <= relative.max(2e-6),
                    "{dtype:?} ' {}",
                    xs[i]
                );
                differ += usize::from(ours[i] != flex[i]);
            }
            eprintln!("{dtype:?}: {differ} of {n} values differ from Flex's");
        }
    }

    #[test]
    fn in_place_or_not_on_any_number_of_threads_the_same_bits() {
        // More than one parallel task, the last one short.
        let n = 150_001;
        let xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 2000) as f32 / 100.0 - 10.0)
            .collect();
        for dtype in [FloatDType::F32, FloatDType::BF16, FloatDType::F16] {
            let run = |threads: usize, shared: bool| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    let x = tensor(xs.clone(), &[n], dtype);
                    let keep = x.clone();
                    let y = match shared {
                        true => gelu(x.clone()),
                        false => gelu(tensor(xs.clone(), &[n], dtype)),
                    };
                    let g = tensor(xs.clone(), &[n], dtype);
                    let kept_g = shared.then(|| g.clone());
                    let dx = gelu_backward_on(keep.clone(), g, Isa::best());
                    assert_eq!(wide(keep), wide(tensor(xs.clone(), &[n], dtype)));
                    drop(kept_g);
                    (y.into_data().bytes.to_vec(), dx.into_data().bytes.to_vec())
                })
            };
            let one = run(1, false);
            assert!(one == run(2, false), "{dtype:?} on two threads");
            assert!(one == run(2, true), "{dtype:?} shared");
        }
    }

    #[test]
    fn views_and_other_dtypes_are_flexs() {
        let xs: Vec<f32> = (0..48).map(|i| i as f32 / 8.0 - 3.0).collect();
        let b = |t: FlexTensor| t.into_data().bytes.to_vec();
        let t = tensor(xs.clone(), &[6, 8], FloatDType::F32);
        let view = Flex::float_swap_dims(t.clone(), 0, 1);
        assert_eq!(b(gelu(view.clone())), b(Flex::gelu(view.clone())));
        let f64s = Flex::float_cast(t.clone(), FloatDType::F64);
        assert_eq!(b(gelu(f64s.clone())), b(Flex::gelu(f64s.clone())));
        let g = Flex::float_cast(t.clone(), FloatDType::F64);
        assert_eq!(
            b(gelu_backward_on(f64s.clone(), g.clone(), Isa::best())),
            b(Flex::gelu_backward(f64s, g))
        );
        // A strided gradient is made contiguous first.
        let x = view.to_contiguous();
        let dx = gelu_backward_on(x.clone(), view.to_contiguous(), Isa::best());
        let strided = gelu_backward_on(x, view, Isa::best());
        assert_eq!(b(dx), b(strided));
    }
}
