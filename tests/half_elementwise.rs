//! Add, sub, mul and div of half tensors on Flex through the decorator
//! (`src/cpu/half_elementwise.rs`): two bf16 or two f16 tensors of one shape, or one and a
//! scalar, against plain Flex bit for bit, with autocast off and on, on one thread and two;
//! their backward nodes against plain `Autodiff<Flex>`'s gradients bit for bit; and what the
//! kernels leave to Flex (broadcast shapes, strided views, f32, f64, mixed dtypes under
//! autocast) still Flex's values.
#![cfg(feature = "flex")]

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_accelerate::{Accelerated, Precision, autocast};
use half::{bf16, f16};

type Acc = Accelerated<Flex>;
type AccAd = Accelerated<Autodiff<Flex>>;

const HALVES: [DType; 2] = [DType::BF16, DType::F16];

/// The ops under test: the four of two tensors, and the four of a tensor and a scalar.
#[derive(Debug, Clone, Copy)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    AddScalar(f64),
    SubScalar(f64),
    MulScalar(f64),
    DivScalar(f64),
}

const BINARY: [Op; 4] = [Op::Add, Op::Sub, Op::Mul, Op::Div];

impl Op {
    fn of_two_tensors(self) -> bool {
        matches!(self, Op::Add | Op::Sub | Op::Mul | Op::Div)
    }
}

// Dropout's keep scale, attention's `sqrt(d)` divisor, an integer, a scalar that is itself a
// bf16 rounding tie (1 + 2^-8, halfway between 1 and 1 + 2^-7: rounded to even, 1, before the
// op, as Flex rounds it), and the specials.
const SCALARS: [f64; 7] = [
    1.11,
    8.0,
    -3.0,
    1.0 + 1.0 / 256.0,
    0.0,
    f64::INFINITY,
    f64::NAN,
];

fn all_ops() -> Vec<Op> {
    let mut ops = BINARY.to_vec();
    for s in SCALARS {
        ops.extend([
            Op::AddScalar(s),
            Op::SubScalar(s),
            Op::MulScalar(s),
            Op::DivScalar(s),
        ]);
    }
    ops
}

fn apply<B: Backend, const D: usize>(op: Op, a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    match op {
        Op::Add => a + b,
        Op::Sub => a - b,
        Op::Mul => a * b,
        Op::Div => a / b,
        Op::AddScalar(s) => a.add_scalar(s),
        Op::SubScalar(s) => a.sub_scalar(s),
        Op::MulScalar(s) => a.mul_scalar(s),
        Op::DivScalar(s) => a.div_scalar(s),
    }
}

/// Varied values with every kind of special among them: signed zeros, infinities, NaNs of
/// both signs, subnormals of both half types, their largest finite values and values past
/// f16's, and values whose sums and products tie.
fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut v: Vec<f32> = (0..len as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 40_000) as f32 / 97.0 - 206.0)
        .collect();
    let special = [
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        1e-39,
        -3e-40,
        1e-6,
        -6e-8,
        3.38e38,
        65504.0,
        7e4,
        1.0 + 1.0 / 256.0,
        -2.0 - 1.0 / 128.0,
        0.5,
    ];
    for (slot, value) in v
        .iter_mut()
        .skip(seed as usize % 5)
        .step_by(3)
        .zip(special.iter().cycle())
    {
        *slot = *value;
    }
    v
}

/// `values` rounded to `dtype` by `half` (so by no kernel under test).
fn data(len: usize, seed: u32, dtype: DType) -> TensorData {
    let v = values(len, seed);
    match dtype {
        DType::BF16 => TensorData::new(v.into_iter().map(bf16::from_f32).collect(), [len]),
        DType::F16 => TensorData::new(v.into_iter().map(f16::from_f32).collect(), [len]),
        DType::F64 => TensorData::new(v.into_iter().map(f64::from).collect(), [len]),
        _ => TensorData::new(v, [len]),
    }
}

fn tensor<B: Backend, const D: usize>(data: &TensorData, dtype: DType) -> Tensor<B, D> {
    Tensor::from_data(data.clone(), (&Default::default(), dtype))
}

/// The first index where two results' bytes differ, with their dtype and the lengths, or
/// `None` where they are the same bits.
fn difference(got: &TensorData, want: &TensorData) -> Option<String> {
    if got.dtype != want.dtype || got.shape != want.shape {
        return Some(format!(
            "{:?} {:?} for {:?} {:?}",
            got.dtype, got.shape, want.dtype, want.shape
        ));
    }
    if got.num_elements() == 0 {
        return None;
    }
    let width = got.bytes.len() / got.num_elements();
    let at = got
        .bytes
        .chunks(width)
        .zip(want.bytes.chunks(width))
        .position(|(g, w)| g != w)?;
    Some(format!(
        "at {at}: {:02x?} for {:02x?}",
        &got.bytes[at * width..][..width],
        &want.bytes[at * width..][..width]
    ))
}

fn assert_same(got: &TensorData, want: &TensorData, what: &str) {
    if let Some(diff) = difference(got, want) {
        panic!("{what}: {diff}");
    }
}

/// Every op of `lhs` and `rhs` (1-D tensors of `dtype`) on `B`, each of fresh operands.
fn outputs<B: Backend>(lhs: &TensorData, rhs: &TensorData, dtype: DType) -> Vec<TensorData> {
    all_ops()
        .into_iter()
        .map(|op| {
            let (a, b) = (tensor::<B, 1>(lhs, dtype), tensor::<B, 1>(rhs, dtype));
            apply(op, a, b).into_data()
        })
        .collect()
}

fn forward_is_flexs<Plain: Backend, Decorated: Backend>(autocast_on: bool) {
    for dtype in HALVES {
        for len in [1, 7, 17, 1_000_003] {
            let (lhs, rhs) = (data(len, 1, dtype), data(len, 2, dtype));
            let want = outputs::<Plain>(&lhs, &rhs, dtype);
            let got = {
                let _guard = autocast_on.then(|| autocast::enable(Precision::Bf16));
                outputs::<Decorated>(&lhs, &rhs, dtype)
            };
            for ((op, got), want) in all_ops().into_iter().zip(&got).zip(&want) {
                let what = format!("{op:?} {dtype:?} [{len}], autocast {autocast_on}");
                assert_same(got, want, &what);
            }
        }
    }
}

#[test]
fn forward_gives_flexs_bits_with_autocast_off() {
    let _off = autocast::disable();
    forward_is_flexs::<Flex, Acc>(false);
    forward_is_flexs::<Autodiff<Flex>, AccAd>(false);
}

#[test]
fn forward_gives_flexs_bits_under_autocast() {
    forward_is_flexs::<Flex, Acc>(true);
    forward_is_flexs::<Autodiff<Flex>, AccAd>(true);
}

/// `op(x, y)`'s output, and the gradients of `x` and `y` (empty for one not tracked), of
/// `sum(op(x, y) * w)` with `w` an untracked weight: everything in `dtype`, so that only the
/// ops under test (and the weight's mul) are on the path.
fn gradients<B: AutodiffBackend>(
    op: Op,
    track: (bool, bool),
    dtype: DType,
    len: usize,
) -> [TensorData; 3] {
    let leaf = |seed: u32, tracked: bool| {
        let t = tensor::<B, 1>(&data(len, seed, dtype), dtype);
        if tracked { t.require_grad() } else { t }
    };
    let (x, y) = (leaf(3, track.0), leaf(4, track.1));
    // Varied weights: the gradient reaching the op.
    let w = tensor::<B, 1>(&data(len, 5, dtype), dtype);
    let out = apply(op, x.clone(), y.clone());
    let grads = (out.clone() * w).sum().backward();
    let grad = |t: &Tensor<B, 1>| {
        t.grad(&grads).map_or_else(
            || TensorData::new(Vec::<f32>::new(), [0]),
            |g| g.into_data(),
        )
    };
    [out.into_data(), grad(&x), grad(&y)]
}

#[test]
fn gradients_are_burns_bit_for_bit() {
    let _off = autocast::disable();
    let tracking = [(true, false), (false, true), (true, true)];
    for dtype in HALVES {
        for len in [7, 1_003] {
            for op in all_ops() {
                for track in tracking {
                    // A scalar op has one operand.
                    if !op.of_two_tensors() && track != (true, false) {
                        continue;
                    }
                    let want = gradients::<Autodiff<Flex>>(op, track, dtype, len);
                    let got = gradients::<AccAd>(op, track, dtype, len);
                    for (part, (got, want)) in ["output", "x's gradient", "y's gradient"]
                        .iter()
                        .zip(got.iter().zip(&want))
                    {
                        let what = format!("{op:?} {dtype:?} [{len}] tracked {track:?}: {part}");
                        assert_same(got, want, &what);
                    }
                }
            }
        }
    }
}

// Broadcast shapes (a row, a column, leading dimensions), a transposed view and a slice at an
// offset, forward and backward, each against plain Flex.
fn fallbacks_are_flexs<Plain: AutodiffBackend, Decorated: AutodiffBackend>(dtype: DType) {
    type Pair<B> = (Tensor<B, 3>, Tensor<B, 3>);
    fn operands<B: Backend>(case: usize, dtype: DType) -> Pair<B> {
        let t = |shape: [usize; 3], seed: u32| {
            let len = shape.iter().product();
            tensor::<B, 1>(&data(len, seed, dtype), dtype).reshape(shape)
        };
        match case {
            0 => (t([4, 7, 33], 6), t([4, 1, 33], 7)),
            1 => (t([4, 7, 33], 6), t([1, 7, 1], 7)),
            2 => (t([1, 7, 33], 6), t([4, 7, 33], 7)),
            3 => (t([4, 33, 7], 6).swap_dims(1, 2), t([4, 7, 33], 7)),
            _ => (t([4, 9, 33], 6).narrow(1, 2, 7), t([4, 7, 33], 7)),
        }
    }
    fn run<B: AutodiffBackend>(op: Op, case: usize, dtype: DType) -> [TensorData; 3] {
        let (x, y) = operands::<B>(case, dtype);
        let (x, y) = (x.require_grad(), y.require_grad());
        let out = apply(op, x.clone(), y.clone());
        let w = Tensor::<B, 3>::ones(out.shape(), (&Default::default(), dtype)).mul_scalar(0.75);
        let grads = (out.clone() * w).sum().backward();
        let grad = |t: &Tensor<B, 3>| t.grad(&grads).map(|g| g.into_data());
        [out.into_data(), grad(&x).unwrap(), grad(&y).unwrap()]
    }
    for case in 0..5 {
        for op in BINARY {
            let want = run::<Plain>(op, case, dtype);
            let got = run::<Decorated>(op, case, dtype);
            for (part, (got, want)) in ["output", "x's gradient", "y's gradient"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                assert_same(got, want, &format!("{op:?} {dtype:?} case {case}: {part}"));
            }
        }
    }
}

#[test]
fn broadcasts_and_views_fall_back_to_flexs_bits() {
    let _off = autocast::disable();
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::F64] {
        fallbacks_are_flexs::<Autodiff<Flex>, AccAd>(dtype);
    }
    // And on the decorator over plain Flex, forward.
    for dtype in [DType::F32, DType::F64] {
        let (lhs, rhs) = (data(1_003, 1, dtype), data(1_003, 2, dtype));
        let want = outputs::<Flex>(&lhs, &rhs, dtype);
        let got = outputs::<Acc>(&lhs, &rhs, dtype);
        for ((op, got), want) in all_ops().into_iter().zip(&got).zip(&want) {
            assert_same(got, want, &format!("{op:?} {dtype:?}"));
        }
    }
    let x = tensor::<Flex, 1>(&data(7 * 33, 1, DType::BF16), DType::BF16).reshape([33, 7]);
    let y = tensor::<Flex, 1>(&data(7 * 33, 2, DType::BF16), DType::BF16).reshape([7, 33]);
    let ax = tensor::<Acc, 1>(&data(7 * 33, 1, DType::BF16), DType::BF16).reshape([33, 7]);
    let ay = tensor::<Acc, 1>(&data(7 * 33, 2, DType::BF16), DType::BF16).reshape([7, 33]);
    for op in BINARY {
        let want = apply(op, x.clone().transpose(), y.clone()).into_data();
        let got = apply(op, ax.clone().transpose(), ay.clone()).into_data();
        assert_same(&got, &want, &format!("{op:?} of a transposed view"));
    }
}

// Under autocast a bf16 tensor with an f32 one is promoted first: the kernels then see two f32
// tensors and leave them to Flex, whose f32 op of the widened operand it is.
#[test]
fn mixed_dtypes_under_autocast_are_promoted_first() {
    let len = 1_003;
    let (lhs, rhs) = (data(len, 1, DType::BF16), data(len, 2, DType::F32));
    for op in BINARY {
        let want = {
            let a = tensor::<Flex, 1>(&lhs, DType::BF16).cast(FloatDType::F32);
            apply(op, a, tensor::<Flex, 1>(&rhs, DType::F32)).into_data()
        };
        let got = {
            let _bf16 = autocast::enable(Precision::Bf16);
            let a = tensor::<AccAd, 1>(&lhs, DType::BF16);
            apply(op, a, tensor::<AccAd, 1>(&rhs, DType::F32)).into_data()
        };
        assert_same(&got, &want, &format!("{op:?} bf16 with f32"));
    }
}

fn on_threads(threads: usize) -> Vec<TensorData> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let mut out = Vec::new();
        for dtype in HALVES {
            let (lhs, rhs) = (data(1_000_003, 8, dtype), data(1_000_003, 9, dtype));
            out.extend(outputs::<Acc>(&lhs, &rhs, dtype));
        }
        out
    })
}

#[test]
fn one_thread_and_two_give_the_same_bits() {
    let _off = autocast::disable();
    let (one, two) = (on_threads(1), on_threads(2));
    for (i, (one, two)) in one.iter().zip(&two).enumerate() {
        assert_same(two, one, &format!("result {i}"));
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn time(mut run: impl FnMut()) -> Duration {
    run();
    median(
        (0..9)
            .map(|_| {
                let start = Instant::now();
                run();
                start.elapsed()
            })
            .collect(),
    )
}

// `time`, of `run` on a new `setup()` each time (not timed).
fn time_with<T>(mut setup: impl FnMut() -> T, mut run: impl FnMut(T)) -> Duration {
    run(setup());
    median(
        (0..9)
            .map(|_| {
                let input = setup();
                let start = Instant::now();
                run(input);
                start.elapsed()
            })
            .collect(),
    )
}

/// Dropout's two ops on a transformer's `[8, 256, 1536]` bf16 activations, by Flex and by the
/// decorator. The operands are shared (held here), so both write new buffers.
#[test]
#[ignore = "a timing: cargo test --release --test half_elementwise -- --ignored --nocapture"]
fn dropout_ops_timing() {
    fn ops<B: Backend>() -> [Duration; 4] {
        let shape = [8, 256, 1536];
        let len = shape.iter().product();
        let x = tensor::<B, 1>(&data(len, 1, DType::BF16), DType::BF16).reshape(shape);
        let mask = tensor::<B, 1>(&data(len, 2, DType::BF16), DType::BF16)
            .reshape(shape)
            .greater_elem(0.0)
            .float()
            .cast(FloatDType::BF16);
        let mul = time(|| drop(x.clone() * mask.clone()));
        let scale = time(|| drop(x.clone().mul_scalar(1.11)));
        // In place: a fresh `x` each time, made outside the timing.
        let fresh = || tensor::<B, 1>(&data(len, 1, DType::BF16), DType::BF16).reshape(shape);
        let mul_in_place = time_with(fresh, |x| drop(x * mask.clone()));
        let scale_in_place = time_with(fresh, |x| drop(x.mul_scalar(1.11)));
        [mul, scale, mul_in_place, scale_in_place]
    }
    let _off = autocast::disable();
    let flex = ops::<Flex>();
    let ours = ops::<Acc>();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(ops::<Acc>);
    println!(
        "[8, 256, 1536] bf16, {} rayon threads:",
        rayon::current_num_threads()
    );
    let names = [
        "x * mask (new buffer)",
        "x * 1.11 (new buffer)",
        "x * mask (in place)",
        "x * 1.11 (in place)",
    ];
    for (i, name) in names.iter().enumerate() {
        println!(
            "  {name}: Flex {:?}, ours {:?} ({:.1}x), ours on one thread {:?}",
            flex[i],
            ours[i],
            flex[i].as_secs_f64() / ours[i].as_secs_f64(),
            one[i]
        );
    }
}
