//! The process group's collectives at real sizes, on 2, 3 and 4 real processes of this machine
//! (started by `burn-accelerate launch`, see `../processes/harness.rs`): a 1 GiB all-reduce,
//! the gradients of a model with a 16.8M-value parameter, gradients (and ZeRO's reduce-scatter
//! and parameter sharing) synced where they lie against the contiguous path, bit for bit,
//! gather and broadcast of 20M values,
//! a 64 MiB dispatched batch, all-gather and reduce-scatter at uneven sizes in every element
//! type, and what a peer that exits or calls another collective does to the others.
//!
//! Each worker checks its own results against values it computes itself (every process knows
//! what every other contributes) and reports what it found wrong; the test asserts nothing was.
#![cfg(feature = "flex")]

// Shared with the processes suite, which uses all of it.
#[allow(dead_code)]
#[path = "../processes/harness.rs"]
mod harness;
#[path = "../needs/mod.rs"]
mod needs;

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};
use burn_accelerate::data::{DataLoaderConfig, ShardLoaderBuilder};
use burn_accelerate::distributed::{
    DistributedError, ProcessGroup, ProcessState, ReduceOp, SyncLayout, all_reduce_gradients,
    scope_sync_layout, shard_counts, sync_copied_values,
};
use burn_accelerate::zero::{Partition, reduce_scatter_gradients, share_parameters};
use half::{bf16, f16};
use harness::{launch, max_relative_difference, report, worker};
use serde::{Deserialize, Serialize};

type Train = Autodiff<Flex>;

/// What a worker found wrong (empty: everything as expected).
type Findings = Vec<String>;

fn check(findings: &mut Findings, ok: bool, what: impl FnOnce() -> String) {
    if !ok {
        findings.push(what());
    }
}

fn group() -> (ProcessState, ProcessGroup) {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    (state, group)
}

fn assert_none_found(reports: Vec<Findings>) {
    for (rank, findings) in reports.iter().enumerate() {
        assert!(findings.is_empty(), "rank {rank}: {findings:#?}");
    }
}

// ---------------------------------------------------------------------------------------
// Uneven all-gather and reduce-scatter, every element type.

fn uneven_worker() -> Findings {
    let (_, group) = group();
    let (r, n) = (group.rank(), group.world_size());
    let mut found = Findings::new();

    // All-gather of different lengths (rank r gives 3r + 1 values), exactly, in rank order;
    // i64 values past f64's exact integers.
    let own: Vec<i64> = (0..3 * r + 1)
        .map(|i| (1 << 60) + (r * 100 + i) as i64)
        .collect();
    let gathered = group.all_gather(&own).unwrap();
    let expected: Vec<i64> = (0..n)
        .flat_map(|q| (0..3 * q + 1).map(move |i| (1 << 60) + (q * 100 + i) as i64))
        .collect();
    check(&mut found, gathered == expected, || {
        format!("all_gather: {gathered:?}")
    });

    // Past a piece (1 MiB) and not a multiple of one: bytes in pieces of two sizes.
    let len = (1 << 20) + 5 + r;
    let own: Vec<u8> = (0..len).map(|i| (i * 7 + r) as u8).collect();
    let gathered = group.all_gather(&own).unwrap();
    let expected: Vec<u8> = (0..n)
        .flat_map(|q| (0..(1 << 20) + 5 + q).map(move |i| (i * 7 + q) as u8))
        .collect();
    check(&mut found, gathered == expected, || {
        "all_gather of bytes past a piece differs".into()
    });

    // In place, with an empty slot.
    let counts: Vec<usize> = (0..n).map(|q| if q == 1 { 0 } else { q + 2 }).collect();
    let mut buffer = vec![0u32; counts.iter().sum()];
    let start: usize = counts[..r].iter().sum();
    for (i, v) in buffer[start..start + counts[r]].iter_mut().enumerate() {
        *v = (r * 10 + i) as u32;
    }
    group.all_gather_in_place(&mut buffer, &counts).unwrap();
    let expected: Vec<u32> = (0..n)
        .flat_map(|q| (0..counts[q]).map(move |i| (q * 10 + i) as u32))
        .collect();
    check(&mut found, buffer == expected, || {
        format!("all_gather_in_place: {buffer:?}")
    });

    // Reduce-scatter at uneven counts (torch's split: a shorter last slice) and at counts
    // with an empty slice, for every element type; sums of small integers are exact in each.
    for len in [13, 1, 3 * (1 << 18) + 7] {
        for counts in [shard_counts(len, n), {
            let mut c = vec![0; n];
            c[n - 1] = len;
            c
        }] {
            let start: usize = counts[..r].iter().sum();
            let mine = start..start + counts[r];
            // Rank q contributes (i % 50) + q at index i: the sum is n (i % 50) + n (n - 1) / 2.
            let sum = |i: usize| (n * (i % 50) + n * (n - 1) / 2) as f64;
            macro_rules! each_type {
                ($($t:ty => $from:expr),* $(,)?) => {$(
                    let mut values: Vec<$t> =
                        (0..len).map(|i| $from(((i % 50) + r) as f64)).collect();
                    let got = group
                        .reduce_scatter(&mut values, &counts, ReduceOp::Sum)
                        .unwrap()
                        .to_vec();
                    let want: Vec<$t> = mine.clone().map(|i| $from(sum(i))).collect();
                    check(&mut found, got == want, || {
                        format!("reduce_scatter {} of {len} at {counts:?}", stringify!($t))
                    });
                )*};
            }
            each_type!(
                f32 => |v: f64| v as f32,
                f64 => |v: f64| v,
                f16 => f16::from_f64,
                bf16 => bf16::from_f64,
                i64 => |v: f64| v as i64,
                i32 => |v: f64| v as i32,
                i16 => |v: f64| v as i16,
                u32 => |v: f64| v as u32,
                u64 => |v: f64| v as u64,
            );
            // The mean, of integers, divides as integers do.
            let mut values: Vec<i64> = (0..len).map(|i| ((i % 50) + r) as i64).collect();
            let got = group
                .reduce_scatter(&mut values, &counts, ReduceOp::Mean)
                .unwrap()
                .to_vec();
            let want: Vec<i64> = mine.clone().map(|i| sum(i) as i64 / n as i64).collect();
            check(&mut found, got == want, || {
                format!("integer mean at {counts:?}")
            });
        }
    }

    // Tensors: rows of an int tensor scattered by per-process counts.
    let device = Default::default();
    let rows = 2 * n + 1;
    let counts = shard_counts(rows, n);
    let values: Vec<i64> = (0..rows * 3).map(|i| i as i64 * 1000 + r as i64).collect();
    let tensor = Tensor::<Flex, 2, Int>::from_data(TensorData::new(values, [rows, 3]), &device);
    let mine = group
        .reduce_scatter_tensor(tensor, &counts, ReduceOp::Sum)
        .unwrap();
    let start: usize = counts[..r].iter().sum();
    let want: Vec<i64> = (start * 3..(start + counts[r]) * 3)
        .map(|i| n as i64 * i as i64 * 1000 + (n * (n - 1) / 2) as i64)
        .collect();
    check(&mut found, mine.dims() == [counts[r], 3], || {
        format!("reduce_scatter_tensor shape {:?}", mine.dims())
    });
    let got: Vec<i64> = mine.into_data().convert::<i64>().to_vec().unwrap();
    check(&mut found, got == want, || {
        format!("reduce_scatter_tensor: {got:?}")
    });

    // A bad call is refused before anything is sent, and the group stays usable.
    let err = group
        .reduce_scatter(&mut [1.0f32; 4], &[4], ReduceOp::Sum)
        .unwrap_err();
    check(
        &mut found,
        matches!(&err, DistributedError::InvalidCall(m) if m.contains("one count per process")),
        || format!("bad counts: {err}"),
    );
    group.barrier().unwrap();
    found
}

#[test]
fn all_gather_and_reduce_scatter_are_exact_at_uneven_sizes_on_2_3_and_4_processes() {
    const TEST: &str =
        "all_gather_and_reduce_scatter_are_exact_at_uneven_sizes_on_2_3_and_4_processes";
    if worker::<()>().is_some() {
        return report(&uneven_worker());
    }
    for n in [2, 3, 4] {
        assert_none_found(launch(TEST, n, &(), &[]).assert_success().reports(n));
    }
}

// ---------------------------------------------------------------------------------------
// A 1 GiB all-reduce.

fn gib_worker() -> Findings {
    let (_, group) = group();
    let (r, n) = (group.rank(), group.world_size());
    let len = 1usize << 28;
    // Small integers: every sum is exact in f32, so any value out of place shows.
    let mut values: Vec<f32> = (0..len).map(|i| ((i % 4099) + r) as f32).collect();
    group.all_reduce(&mut values, ReduceOp::Sum).unwrap();
    let offset = (n * (n - 1) / 2) as f32;
    let wrong = (0..len).find(|&i| values[i] != n as f32 * (i % 4099) as f32 + offset);
    match wrong {
        Some(i) => vec![format!("value {i} is {}", values[i])],
        None => vec![],
    }
}

#[test]
fn an_all_reduce_of_a_gib_is_exact_on_2_processes() {
    const TEST: &str = "an_all_reduce_of_a_gib_is_exact_on_2_processes";
    if worker::<()>().is_some() {
        return report(&gib_worker());
    }
    assert_none_found(launch(TEST, 2, &(), &[]).assert_success().reports(2));
}

// ---------------------------------------------------------------------------------------
// Gradients of a model with a 16.8M-value parameter.

#[derive(Module, Debug)]
struct Wide<B: Backend> {
    wide: Linear<B>,
    out: Linear<B>,
}

const WIDTH: usize = 4096;

impl<B: Backend> Wide<B> {
    fn new(device: &B::Device) -> Self {
        B::seed(device, 11);
        Self {
            wide: LinearConfig::new(WIDTH, WIDTH).init(device),
            out: LinearConfig::new(WIDTH, 8).init(device),
        }
    }

    // Process `rank`'s batch: every process can make any process's.
    fn loss(&self, rank: usize, device: &B::Device) -> Tensor<B, 1> {
        let x: Vec<f32> = (0..4 * WIDTH)
            .map(|i| ((i * 31 + rank * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let x = Tensor::<B, 2>::from_data(TensorData::new(x, [4, WIDTH]), device);
        self.out
            .forward(self.wide.forward(x))
            .powf_scalar(2.0)
            .mean()
    }
}

// Every parameter's gradient in `grads`, flat, in visiting order.
fn gradient_values(model: &Wide<Train>, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor<Train> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
            let grad = self.0.get::<Flex, D>(param.id).expect("a gradient");
            self.1
                .push(grad.into_data().convert::<f32>().to_vec().unwrap());
        }
    }
    let mut collect = Collect(grads, Vec::new());
    model.visit(&mut collect);
    collect.1
}

fn gradients_worker() -> Findings {
    let (_, group) = group();
    let (r, n) = (group.rank(), group.world_size());
    let device = Default::default();
    let model = Wide::<Train>::new(&device);
    assert_eq!(model.wide.weight.val().dims(), [WIDTH, WIDTH]);
    // The mean of every process's gradients, computed here alone.
    let mut expected: Vec<Vec<f32>> = Vec::new();
    for q in 0..n {
        let grads = GradientsParams::from_grads(model.loss(q, &device).backward(), &model);
        let values = gradient_values(&model, &grads);
        if expected.is_empty() {
            expected = values;
        } else {
            for (e, v) in expected.iter_mut().zip(values) {
                e.iter_mut().zip(v).for_each(|(e, v)| *e += v);
            }
        }
    }
    expected
        .iter_mut()
        .for_each(|e| e.iter_mut().for_each(|v| *v /= n as f32));
    let mut grads = GradientsParams::from_grads(model.loss(r, &device).backward(), &model);
    all_reduce_gradients::<Train, _>(&group, &model, &mut grads).unwrap();
    let got = gradient_values(&model, &grads);
    let mut found = Findings::new();
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let diff = max_relative_difference(g, e);
        check(&mut found, g.len() == e.len() && diff <= 1e-6, || {
            format!(
                "parameter {i} ({} values): relative difference {diff}",
                e.len()
            )
        });
    }
    found
}

#[test]
fn gradients_of_a_16_8m_value_parameter_are_the_mean_of_every_process() {
    const TEST: &str = "gradients_of_a_16_8m_value_parameter_are_the_mean_of_every_process";
    if worker::<()>().is_some() {
        return report(&gradients_worker());
    }
    for n in [2, 3] {
        assert_none_found(launch(TEST, n, &(), &[]).assert_success().reports(n));
    }
}

// ---------------------------------------------------------------------------------------
// Gradients synced where they lie (Flex) against the contiguous path, bit for bit.

/// A model whose gradients are every case the sync meets: a weight too large to share a
/// bucket (reduced in its own storage), weights laid out as torch lays them (`[out, in]`, used
/// transposed: their gradients are transposed views on Flex, where a Linear's are contiguous),
/// a layer used twice in one forward, one some ranks leave unused at some steps, a weight tied
/// to itself, and a parameter held in f16.
#[derive(Module, Debug)]
struct Tangle<B: Backend> {
    big: Param<Tensor<B, 2>>,
    twice: Linear<B>,
    sometimes: Linear<B>,
    flipped: Param<Tensor<B, 2>>,
    tied: Param<Tensor<B, 2>>,
    tied_again: Param<Tensor<B, 2>>,
    half: Param<Tensor<B, 1>>,
}

/// Past a bucket: `BIG × BIG` values (6.76M) against `BUCKET_VALUES` (6.55M).
const BIG: usize = 2600;
const NARROW: usize = 16;

/// How one step's gradients are made.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Case {
    Plain,
    /// `sometimes` unused on rank 1, used on the others.
    UnusedOnOneRank,
    /// `sometimes` unused everywhere: it must stay without a gradient.
    UnusedEverywhere,
    /// Two backward passes summed, as an accumulation window sums them.
    Accumulated,
    /// The last rank's loss multiplied past f32's (and f16's) range: infs there only.
    OverflowOnOneRank,
    /// Rank 0's `big` and `flipped` gradients contiguous where the others' are transposed,
    /// and rank 1's `tied` gradient a strided view (not dense): all three must travel in
    /// logical order.
    LayoutsDiffer,
}

const CASES: [Case; 6] = [
    Case::Plain,
    Case::UnusedOnOneRank,
    Case::UnusedEverywhere,
    Case::Accumulated,
    Case::OverflowOnOneRank,
    Case::LayoutsDiffer,
];

type Device = burn::backend::flex::FlexDevice;

impl Tangle<Train> {
    fn new(device: &Device) -> Self {
        Train::seed(device, 5);
        let tied = Param::from_tensor(Tensor::random(
            [NARROW, 8],
            Distribution::Normal(0.0, 0.5),
            device,
        ));
        let half = Tensor::<Train, 1>::ones([NARROW], device).cast(DType::F16);
        let normal = |dims: [usize; 2]| {
            Param::from_tensor(Tensor::random(
                dims,
                Distribution::Normal(0.0, 0.02),
                device,
            ))
        };
        Self {
            big: normal([BIG, BIG]),
            twice: LinearConfig::new(NARROW, NARROW).init(device),
            sometimes: LinearConfig::new(NARROW, NARROW).init(device),
            flipped: normal([NARROW, NARROW]),
            tied_again: tied.clone(),
            tied,
            half: Param::from_tensor(half),
        }
    }

    // Process `rank` of `n`'s loss at `step` (`micro`: the pass within a window). `exact`:
    // every gradient a small integer (times a power of two), so that every sum is exact in
    // f32 and any order of adding gives the same bits; otherwise chained layers and a square
    // make arbitrary values.
    fn loss(
        &self,
        (rank, n): (usize, usize),
        step: usize,
        micro: usize,
        exact: bool,
    ) -> Tensor<Train, 1> {
        let device = self.half.device();
        let input = |cols: usize, salt: usize| {
            let values: Vec<f32> = (0..4 * cols)
                .map(|i| {
                    let k = (i * 31 + rank * 7919 + step * 104_729 + micro * 13 + salt * 3) % 7;
                    if exact {
                        k as f32 - 3.0
                    } else {
                        (k as f32 - 3.0) / 2.7 + (i % 11) as f32 / 50.0
                    }
                })
                .collect();
            Tensor::<Train, 2>::from_data(TensorData::new(values, [4, cols]), &device)
        };
        let case = CASES[step];
        let uses_sometimes = match case {
            Case::UnusedOnOneRank => rank != 1,
            Case::UnusedEverywhere => false,
            _ => true,
        };
        let half = self.half.val().cast(DType::F32).reshape([1, NARROW]);
        let loss = if exact {
            // Every output linear in the parameters: each gradient a sum of inputs.
            let mut out = input(BIG, 0).matmul(self.big.val().transpose()).sum()
                + input(NARROW, 7)
                    .matmul(self.flipped.val().transpose())
                    .sum()
                + self.twice.forward(input(NARROW, 1)).sum()
                + self.twice.forward(input(NARROW, 2)).sum()
                + input(NARROW, 3).matmul(self.tied.val()).sum()
                + input(8, 4).matmul(self.tied_again.val().transpose()).sum()
                + (input(1, 5) * half).sum();
            if uses_sometimes {
                out = out + self.sometimes.forward(input(NARROW, 6)).sum();
            }
            out
        } else {
            let h = input(BIG, 0).matmul(self.big.val().transpose());
            let h = h.slice([0..4, 0..NARROW]);
            let h = self.twice.forward(h).tanh();
            let mut h = self.twice.forward(h) * half;
            if uses_sometimes {
                h = h.clone() + self.sometimes.forward(h).tanh();
            }
            let h = h
                .matmul(self.flipped.val().transpose())
                .matmul(self.tied.val());
            h.matmul(self.tied_again.val().transpose())
                .powf_scalar(2.0)
                .mean()
        };
        if case == Case::OverflowOnOneRank && rank + 1 == n {
            // Powers of two: the scaled gradients stay exact where they are finite.
            loss * 2f32.powi(126) * 4.0
        } else {
            loss
        }
    }

    // Process `rank` of `n`'s gradients at `step`, as the window that completes there holds
    // them.
    fn gradients(&self, (rank, n): (usize, usize), step: usize, exact: bool) -> GradientsParams {
        let pass = |micro| {
            GradientsParams::from_grads(self.loss((rank, n), step, micro, exact).backward(), self)
        };
        let mut grads = pass(0);
        match CASES[step] {
            Case::Accumulated => {
                burn_accelerate::grads::accumulate::<Train, _>(self, &mut grads, pass(1));
            }
            Case::LayoutsDiffer if rank == 0 => {
                for id in [self.big.id, self.flipped.id] {
                    let g = grads.remove::<Flex, 2>(id).unwrap();
                    let g = Tensor::<Flex, 2>::from_data(g.into_data(), &self.half.device());
                    assert!(is_contiguous(&g));
                    grads.register(id, g);
                }
            }
            Case::LayoutsDiffer if rank == 1 => {
                let g = grads.remove::<Flex, 2>(self.tied.id).unwrap();
                let wide = Tensor::cat(vec![g.clone(), g], 1);
                grads.register(self.tied.id, wide.slice([0..NARROW, 0..8]));
            }
            _ => {}
        }
        grads
    }
}

fn is_contiguous<const D: usize>(grad: &Tensor<Flex, D>) -> bool {
    grad.clone().into_primitive().tensor().is_contiguous()
}

/// Every parameter's gradient in `grads` in visiting order: its bits in logical order, and
/// whether it is a contiguous tensor (`None`: no gradient).
fn gradient_bits<B: Backend, M: Module<B>>(
    model: &M,
    grads: &GradientsParams,
) -> Vec<Option<(Vec<u32>, bool)>> {
    struct Collect<'a>(&'a GradientsParams, Vec<Option<(Vec<u32>, bool)>>);
    impl<B: Backend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let grad = self.0.get::<Flex, D>(param.id);
            self.1.push(grad.map(|g| {
                let contiguous = is_contiguous(&g);
                let values = g.into_data().convert::<f32>().to_vec::<f32>().unwrap();
                (values.iter().map(|v| v.to_bits()).collect(), contiguous)
            }));
        }
    }
    let mut collect = Collect(grads, Vec::new());
    model.visit(&mut collect);
    collect.1
}

// Where the large weight's gradient lies (compared to after the sync: in place or not).
// Where a Flex tensor's values lie.
fn address(tensor: Tensor<Flex, 2>) -> usize {
    tensor.into_primitive().tensor().bytes().as_ptr() as usize
}

fn storage_of(grads: &GradientsParams, model: &Tangle<Train>) -> usize {
    address(grads.get::<Flex, 2>(model.big.id).unwrap())
}

fn sync_layouts_worker(exact: bool) -> Findings {
    let (_, group) = group();
    let (r, n) = (group.rank(), group.world_size());
    let device = Default::default();
    let model = Tangle::<Train>::new(&device);
    let partition = Partition::of::<Train, _>(&model, n);
    let mut found = Findings::new();
    let names = [
        "big",
        "twice.weight",
        "twice.bias",
        "sometimes.weight",
        "sometimes.bias",
        "flipped",
        "tied",
        "tied (again)",
        "half",
    ];
    for (step, case) in CASES.iter().enumerate() {
        for stage2 in [false, true] {
            let mut stored = model.gradients((r, n), step, exact);
            let mut contiguous = model.gradients((r, n), step, exact);
            // The two backward passes must agree before the sync is compared.
            let (before, again) = (
                gradient_bits(&model, &stored),
                gradient_bits(&model, &contiguous),
            );
            check(&mut found, before == again, || {
                format!("{case:?}: two backward passes differ")
            });
            // The case this is for: transposed gradients, alone in a bucket and sharing one.
            if *case == Case::Plain {
                let transposed = |i: usize| before[i].as_ref().is_some_and(|g| !g.1);
                check(&mut found, transposed(0) && transposed(5), || {
                    "no transposed gradient".into()
                });
            }
            let big_storage = storage_of(&stored, &model);
            let copied = sync_copied_values();
            if stage2 {
                reduce_scatter_gradients::<Train, _>(&group, &model, &mut stored, &partition)
                    .unwrap();
            } else {
                all_reduce_gradients::<Train, _>(&group, &model, &mut stored).unwrap();
            }
            let copied = sync_copied_values() - copied;
            {
                let _contiguous = scope_sync_layout(SyncLayout::Contiguous);
                if stage2 {
                    reduce_scatter_gradients::<Train, _>(
                        &group,
                        &model,
                        &mut contiguous,
                        &partition,
                    )
                    .unwrap();
                } else {
                    all_reduce_gradients::<Train, _>(&group, &model, &mut contiguous).unwrap();
                }
            }
            let (got, want) = (
                gradient_bits(&model, &stored),
                gradient_bits(&model, &contiguous),
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.as_ref().map(|g| &g.0) == w.as_ref().map(|w| &w.0);
                check(&mut found, same, || {
                    let first = match (g, w) {
                        (Some(g), Some(w)) => {
                            g.0.iter().zip(&w.0).position(|(a, b)| a != b).map(|at| {
                                format!(
                                    "first at {at}: {} against {}",
                                    f32::from_bits(g.0[at]),
                                    f32::from_bits(w.0[at])
                                )
                            })
                        }
                        _ => Some(format!("present {} against {}", g.is_some(), w.is_some())),
                    };
                    format!(
                        "{case:?} (stage 2: {stage2}): {} differs from the contiguous path ({first:?})",
                        names[i]
                    )
                });
            }
            // `sometimes` unused everywhere stays without a gradient.
            if *case == Case::UnusedEverywhere {
                check(&mut found, got[3].is_none() && got[4].is_none(), || {
                    "an unused layer got a gradient".into()
                });
            }
            // Where it lay: the large weight's gradient in its own storage, never copied, and
            // every gradient in the layout it came in (the two made to differ: in logical
            // order).
            let differ = *case == Case::LayoutsDiffer;
            // On three processes or more, transposed gradients travel in logical order.
            let transposed_logical = differ || n > 2;
            let owns_big = !stage2 || partition.owner(model.big.id) == r;
            if owns_big && !transposed_logical {
                check(
                    &mut found,
                    storage_of(&stored, &model) == big_storage,
                    || format!("{case:?} (stage 2: {stage2}): the large gradient moved"),
                );
            }
            for (i, (g, b)) in got.iter().zip(&before).enumerate() {
                let (Some(g), Some(b)) = (g, b) else { continue };
                let logical = transposed_logical && [0, 5, 6, 7].contains(&i);
                check(&mut found, g.1 == (b.1 || logical), || {
                    format!(
                        "{case:?} (stage 2: {stage2}): {} was contiguous: {}, is: {}",
                        names[i], b.1, g.1
                    )
                });
            }
            check(
                &mut found,
                transposed_logical || copied < (BIG * BIG) as u64,
                || format!("{case:?} (stage 2: {stage2}): {copied} values copied"),
            );
        }
    }
    share_parameters_worker(&model, &partition, &mut found);
    found
}

/// The step of a sharded optimizer, as each rank sees it: its own parameters moved by
/// `rank + 1`, the others' by something no owner gives (which the sharing must replace).
struct Step<'a> {
    rank: Option<usize>,
    partition: &'a Partition,
}

impl ModuleMapper<Train> for Step<'_> {
    fn map_float<const D: usize>(
        &mut self,
        param: Param<Tensor<Train, D>>,
    ) -> Param<Tensor<Train, D>> {
        let owner = self.partition.owner(param.id);
        let shift = match self.rank {
            Some(rank) if rank != owner => 1000.0 + rank as f32,
            _ => owner as f32 + 1.0,
        };
        param.map(|t| Tensor::from_inner(t.inner() + shift).require_grad())
    }
}

// Every parameter's bits, in visiting order.
fn parameter_bits<M: Module<Train>>(model: &M) -> Vec<Vec<u32>> {
    struct Collect(Vec<Vec<u32>>);
    impl ModuleVisitor<Train> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Train, D>>) {
            let values = param
                .val()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap();
            self.0.push(values.iter().map(|v| v.to_bits()).collect());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

// ZeRO's last step: every parameter from its owner, in place where this process holds it.
fn share_parameters_worker(model: &Tangle<Train>, partition: &Partition, found: &mut Findings) {
    let (_, group) = group();
    let r = group.rank();
    let stepped = |rank| model.clone().map(&mut Step { rank, partition });
    let expected = parameter_bits(&stepped(None));
    let mine = stepped(Some(r));
    let big = address(mine.big.val().inner());
    let copied = sync_copied_values();
    let shared = share_parameters::<Train, _>(&group, mine, partition).unwrap();
    let copied = sync_copied_values() - copied;
    let contiguous = {
        let _contiguous = scope_sync_layout(SyncLayout::Contiguous);
        share_parameters::<Train, _>(&group, stepped(Some(r)), partition).unwrap()
    };
    let (got, want) = (parameter_bits(&shared), parameter_bits(&contiguous));
    check(found, got == want, || {
        "shared parameters differ from the contiguous path's".into()
    });
    // Each parameter its owner's; a tied parameter where it is first met only (index 7 is
    // `tied` again, which both paths leave as the mapper made it, as Burn's optimizers do).
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        check(found, i == 7 || g == e, || {
            format!("shared parameter {i} is not its owner's")
        });
    }
    let big_after = address(shared.big.val().inner());
    check(found, big_after == big, || {
        "the large parameter was not received in place".into()
    });
    check(found, copied < (BIG * BIG) as u64, || {
        format!("sharing copied {copied} values")
    });
}

#[test]
fn gradients_synced_where_they_lie_are_the_contiguous_path_s_bit_for_bit() {
    const TEST: &str = "gradients_synced_where_they_lie_are_the_contiguous_path_s_bit_for_bit";
    if let Some(exact) = worker::<bool>() {
        return report(&sync_layouts_worker(exact));
    }
    // Any values, on two processes and on three (where gradients whose storage order is not
    // their logical order travel in logical order, so that the ring adds every value in the
    // contiguous path's order); exactly summable ones too.
    for (n, exact) in [(2, false), (3, false), (3, true)] {
        assert_none_found(launch(TEST, n, &exact, &[]).assert_success().reports(n));
    }
}

// ---------------------------------------------------------------------------------------
// Gather and broadcast of 20M values.

fn gather_broadcast_worker() -> Findings {
    let (_, group) = group();
    let (r, n) = (group.rank(), group.world_size());
    let device = Default::default();
    let mut found = Findings::new();
    // Rank r gives 7M + r rows of one value: 21M values or more gathered.
    let value = |q: usize, i: usize| ((q * 1_000_003 + i) % 16_777_216) as f32;
    let rows = |q: usize| 7_000_000 + q;
    let own: Vec<f32> = (0..rows(r)).map(|i| value(r, i)).collect();
    let tensor = Tensor::<Flex, 1>::from_data(TensorData::new(own, [rows(r)]), &device);
    let gathered: Vec<f32> = group.gather(tensor).unwrap().into_data().to_vec().unwrap();
    let total: usize = (0..n).map(rows).sum();
    check(&mut found, gathered.len() == total, || {
        format!("gathered {} values of {total}", gathered.len())
    });
    let mut at = 0;
    for q in 0..n {
        let wrong = (0..rows(q)).find(|&i| gathered.get(at + i) != Some(&value(q, i)));
        check(&mut found, wrong.is_none(), || {
            format!("gathered value {wrong:?} of process {q}")
        });
        at += rows(q);
    }
    drop(gathered);
    // 20M values from process 1; the others pass a small tensor of another shape.
    let (from, len) = (1, 20_000_000);
    let tensor = if r == from {
        let values: Vec<f32> = (0..len).map(|i| value(9, i)).collect();
        Tensor::<Flex, 2>::from_data(TensorData::new(values, [len / 4, 4]), &device)
    } else {
        Tensor::<Flex, 2>::zeros([1, 1], &device)
    };
    let got = group.broadcast(tensor, from).unwrap();
    check(&mut found, got.dims() == [len / 4, 4], || {
        format!("broadcast shape {:?}", got.dims())
    });
    let got: Vec<f32> = got.into_data().to_vec().unwrap();
    let wrong = (0..len).find(|&i| got.get(i) != Some(&value(9, i)));
    check(&mut found, wrong.is_none(), || {
        format!("broadcast value {wrong:?}")
    });
    found
}

#[test]
fn gather_and_broadcast_carry_20m_values() {
    const TEST: &str = "gather_and_broadcast_carry_20m_values";
    if worker::<()>().is_some() {
        return report(&gather_broadcast_worker());
    }
    assert_none_found(launch(TEST, 3, &(), &[]).assert_success().reports(3));
}

// ---------------------------------------------------------------------------------------
// A 64 MiB dispatched batch.

const ITEM: usize = 1 << 20;

/// Items of a MiB each, item i filled with i (mod 128: one byte each in MessagePack).
struct Mebibytes;

impl Dataset<Vec<u8>> for Mebibytes {
    fn get(&self, index: usize) -> Option<Vec<u8>> {
        (index < self.len()).then(|| vec![(index % 128) as u8; ITEM])
    }

    fn len(&self) -> usize {
        130
    }
}

/// What a batch held: each item's first byte and whether it was whole and uniform.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Summary {
    firsts: Vec<u8>,
    whole: bool,
}

#[derive(Clone)]
struct Summarise;

impl Batcher<Flex, Vec<u8>, Summary> for Summarise {
    fn batch(&self, items: Vec<Vec<u8>>, _: &burn::backend::flex::FlexDevice) -> Summary {
        Summary {
            firsts: items.iter().map(|item| item[0]).collect(),
            whole: items
                .iter()
                .all(|item| item.len() == ITEM && item.iter().all(|b| *b == item[0])),
        }
    }
}

fn dispatch_worker() -> Vec<Summary> {
    let state = ProcessState::from_env().unwrap();
    // 64 items of a MiB per process and step: process 0 reads 128 and sends 64 MiB on.
    let config = DataLoaderConfig::new(64).with_dispatch_batches(true);
    let loader = ShardLoaderBuilder::new(config, Mebibytes, Summarise)
        .build_dispatching(&state, Default::default())
        .unwrap();
    loader.iter().collect()
}

#[test]
fn a_dispatched_batch_of_64_mib_arrives_whole() {
    const TEST: &str = "a_dispatched_batch_of_64_mib_arrives_whole";
    if worker::<()>().is_some() {
        return report(&dispatch_worker());
    }
    let reports: Vec<Vec<Summary>> = launch(TEST, 2, &(), &[]).assert_success().reports(2);
    for (rank, batches) in reports.iter().enumerate() {
        // 130 items: a full step, then the last two items (even_batches pads the tail).
        assert_eq!(batches.len(), 2, "rank {rank}");
        let firsts: Vec<u8> = (rank * 64..rank * 64 + 64).map(|i| i as u8 % 128).collect();
        assert_eq!(batches[0].firsts, firsts, "rank {rank}");
        assert!(batches.iter().all(|b| b.whole), "rank {rank}");
    }
}

// ---------------------------------------------------------------------------------------
// Errors that say what happened.

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
enum Fault {
    /// Process 1 exits while process 0 all-reduces 256 MiB.
    ExitMidTransfer,
    /// Process 0 all-reduces 10 values, process 1 11.
    OtherLength,
    /// Process 0 all-reduces while process 1 broadcasts the same bytes.
    OtherCollective,
}

/// What process 0 saw, and how long it took to see it.
#[derive(Debug, Serialize, Deserialize)]
struct Seen {
    error: String,
    seconds: f64,
}

fn fault_worker(fault: Fault) -> Seen {
    let (_, group) = group();
    let r = group.rank();
    group.barrier().unwrap();
    let start = Instant::now();
    let outcome = match fault {
        Fault::ExitMidTransfer => {
            let mut values = vec![1.0f32; 64 << 20];
            if r == 1 {
                // In the middle of the transfer: after a little of its first step.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    std::process::exit(3);
                });
            }
            group.all_reduce(&mut values, ReduceOp::Sum)
        }
        Fault::OtherLength => group.all_reduce(&mut vec![1.0f32; 10 + r], ReduceOp::Sum),
        Fault::OtherCollective if r == 0 => group.all_reduce(&mut [1u8; 12], ReduceOp::Sum),
        Fault::OtherCollective => group
            .broadcast_object(&"ten bytes".to_string(), 1)
            .map(drop),
    };
    Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[test]
fn a_broken_collective_says_what_became_of_the_other_process() {
    const TEST: &str = "a_broken_collective_says_what_became_of_the_other_process";
    if let Some(fault) = worker::<Fault>() {
        return report(&fault_worker(fault));
    }
    if harness::under_mpi() {
        // The built-in engine's errors, on processes started without a launcher.
        needs::missing(
            "the built-in engine rather than MPI (BURN_ACCELERATE_TEST_ENGINE=mpi is set)",
        );
    }
    // Without the launcher (which would stop process 0 itself when process 1 exits), and the
    // timeout far away.
    let run = |fault: Fault| -> Vec<Seen> {
        let runs = harness::launch_direct(TEST, 2, &fault, &[("BURN_ACCELERATE_TIMEOUT", "600")]);
        let ranks = match fault {
            Fault::ExitMidTransfer => {
                assert_eq!(runs[1].status.code(), Some(3), "{}", runs[1].output());
                1
            }
            _ => 2,
        };
        runs[0].reports(ranks)
    };

    let seen = run(Fault::ExitMidTransfer);
    let error = &seen[0].error;
    assert!(
        error.contains("process 1 (pid ")
            && error.contains("on this machine) exited during all-reduce #"),
        "{error}"
    );
    assert!(seen[0].seconds < 10.0, "{}", seen[0].seconds);

    // Both processes name both sides: their own check finds it, or the other's abort says it.
    let seen = run(Fault::OtherLength);
    for (rank, seen) in seen.iter().enumerate() {
        let error = &seen.error;
        assert!(
            error.contains("disagrees")
                && error.contains("all-reduce #2 (10 f32 values)")
                && error.contains("all-reduce #2 (11 f32 values)"),
            "rank {rank}: {error}"
        );
    }

    // The broadcast's root, too, fails: it waits for the ring to close.
    let seen = run(Fault::OtherCollective);
    for (rank, seen) in seen.iter().enumerate() {
        let error = &seen.error;
        assert!(
            error.contains("disagrees")
                && error.contains("broadcast #2")
                && error.contains("all-reduce #2 (12 u8 values)"),
            "rank {rank}: {error}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Under MPI: a killed rank.

fn killed_worker() {
    let (_, group) = group();
    group.barrier().unwrap();
    if group.rank() == 1 {
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    loop {
        group
            .all_reduce(&mut [1.0f32; 1 << 16], ReduceOp::Sum)
            .unwrap();
    }
}

#[test]
#[ignore = "needs the MPI engine: BURN_ACCELERATE_TEST_ENGINE=mpi --features mpi, with --ignored"]
fn a_killed_rank_ends_the_mpi_job_within_seconds() {
    const TEST: &str = "a_killed_rank_ends_the_mpi_job_within_seconds";
    if worker::<()>().is_some() {
        return killed_worker();
    }
    if !harness::under_mpi() {
        // The built-in engine's case is the fault tests' (tests/faults, tests/processes).
        needs::missing("the MPI engine (BURN_ACCELERATE_TEST_ENGINE=mpi, --features mpi)");
    }
    let run = launch(TEST, 3, &(), &[]);
    assert!(!run.status.success(), "{}", run.output());
    assert!(run.elapsed < Duration::from_secs(20), "{:?}", run.elapsed);
}

// Under MPI: MPI's own errors.

fn mpi_error_worker() -> String {
    let (_, group) = group();
    // Process 1 sends two values where process 0 makes room for one: MPI reports the
    // truncation to process 0 (MPI_ERRORS_RETURN), instead of aborting the job.
    let r = group.rank();
    let counts = [1, 1 + r];
    let mut buffer = vec![7u32; 2 + r];
    let error = group
        .all_gather_in_place(&mut buffer, &counts)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    report(&error);
    // As a training script would: end on the error (the job then aborts).
    std::process::exit(i32::from(!error.is_empty()));
}

#[test]
#[ignore = "needs the MPI engine: BURN_ACCELERATE_TEST_ENGINE=mpi --features mpi, with --ignored"]
fn an_mpi_error_is_a_typed_error_with_mpi_s_message() {
    const TEST: &str = "an_mpi_error_is_a_typed_error_with_mpi_s_message";
    if worker::<()>().is_some() {
        mpi_error_worker();
        return;
    }
    if !harness::under_mpi() {
        needs::missing("the MPI engine (BURN_ACCELERATE_TEST_ENGINE=mpi, --features mpi)");
    }
    let run = launch(TEST, 2, &(), &[]);
    let error: String = run.report(0);
    assert!(
        error.starts_with("MPI_Allgatherv failed (MPI error") && error.contains("TRUNCATE"),
        "{error}\n{}",
        run.output()
    );
    assert!(run.elapsed < Duration::from_secs(30), "{:?}", run.elapsed);
}
