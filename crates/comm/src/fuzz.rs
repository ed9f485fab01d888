//! What the decoders' property tests share (issue 49, SECURITY.md): inputs made from valid
//! encodings by the changes a broken or hostile peer or disk makes (bit flips, truncations,
//! extensions, a number field set to 0, 1, its maximum or near `u32::MAX`/`u64::MAX`), a
//! fixed seed and case count for CI, a long run for the benchmark of cases per second, and a
//! global allocator that counts, on each thread, what a decoder made the process allocate.
//!
//! Test-only; the checkpoint crate's tests include this file by path, so that both crates try
//! their decoders the same way.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// The variable that sets the long runs' case count (default [`LONG_RUN`]).
pub(crate) const CASES_VAR: &str = "BURN_ACCELERATE_FUZZ_CASES";
/// The long runs' cases per decoder unless [`CASES_VAR`] says otherwise: the goal.
pub(crate) const LONG_RUN: u32 = 1_000_000;

/// Values a length, count or index field is set to: the edges where decoders go wrong.
pub(crate) const EDGES: [u64; 16] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0xffff,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64 - 1,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    (i64::MAX as u64) + 1,
    u64::MAX - 1,
    u64::MAX,
];

/// One change to an encoding.
#[derive(Debug, Clone)]
pub(crate) enum Mutation {
    /// One bit flipped.
    Flip(Index, u8),
    /// Cut to a length.
    Truncate(Index),
    /// Bytes added at the end.
    Extend(Vec<u8>),
    /// Bytes inserted in the middle.
    Insert(Index, Vec<u8>),
    /// A little-endian 32-bit field set to an edge value.
    SetU32(Index, Index),
    /// A little-endian 64-bit field set to an edge value.
    SetU64(Index, Index),
    /// An edge value written as decimal text in the middle (for JSON and the environment).
    Number(Index, Index, bool),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0..8u8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        any::<Index>().prop_map(Mutation::Truncate),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, v)| Mutation::SetU32(i, v)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, v)| Mutation::SetU64(i, v)),
        (any::<Index>(), any::<Index>(), any::<bool>())
            .prop_map(|(i, v, neg)| Mutation::Number(i, v, neg)),
    ]
}

impl Mutation {
    /// Applies the change to `bytes`.
    pub(crate) fn apply(&self, bytes: &mut Vec<u8>) {
        let at = |i: &Index, room: usize| {
            if bytes.len() >= room {
                Some(i.index(bytes.len() - room + 1))
            } else {
                None
            }
        };
        match self {
            Mutation::Flip(i, bit) => {
                if let Some(at) = at(i, 1) {
                    bytes[at] ^= 1 << bit;
                }
            }
            Mutation::Truncate(i) => {
                let len = i.index(bytes.len() + 1);
                bytes.truncate(len);
            }
            Mutation::Extend(more) => bytes.extend_from_slice(more),
            Mutation::Insert(i, more) => {
                let at = i.index(bytes.len() + 1);
                bytes.splice(at..at, more.iter().copied());
            }
            Mutation::SetU32(i, v) => {
                if let Some(at) = at(i, 4) {
                    let value = EDGES[v.index(EDGES.len())] as u32;
                    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
                }
            }
            Mutation::SetU64(i, v) => {
                if let Some(at) = at(i, 8) {
                    let value = EDGES[v.index(EDGES.len())];
                    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
                }
            }
            Mutation::Number(i, v, negative) => {
                let at = i.index(bytes.len() + 1);
                let sign = if *negative { "-" } else { "" };
                let text = format!("{sign}{}", EDGES[v.index(EDGES.len())]);
                bytes.splice(at..at, text.bytes());
            }
        }
    }
}

/// Inputs for a decoder: random bytes, or one of `valid` (its encodings of real values)
/// with up to four [`Mutation`]s.
pub(crate) fn inputs(valid: Vec<Vec<u8>>, max_random: usize) -> impl Strategy<Value = Vec<u8>> {
    let mutated = (
        prop::sample::select(valid),
        prop::collection::vec(mutation(), 0..4),
    )
        .prop_map(|(mut bytes, changes)| {
            for change in &changes {
                change.apply(&mut bytes);
            }
            bytes
        });
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..max_random),
        4 => mutated,
    ]
}

/// Text inputs (an environment variable's value, a command line's argument): random
/// printable text, edge numbers, or one of `valid` mutated.
pub(crate) fn text(valid: &[&str]) -> impl Strategy<Value = String> {
    let valid: Vec<Vec<u8>> = valid.iter().map(|v| v.as_bytes().to_vec()).collect();
    let edges = prop::sample::select(EDGES.to_vec());
    prop_oneof![
        "[ -~]{0,12}",
        edges.prop_map(|v| v.to_string()),
        (1..u64::MAX).prop_map(|v| format!("-{v}")),
        inputs(valid, 1).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    )
}

/// Tries `property` on `cases` inputs from `strategy` with a fixed seed; fails with the
/// smallest input it finds that breaks it (a panic counts).
pub(crate) fn check<S: Strategy>(
    cases: u32,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    if let Err(e) = runner(cases).run(&strategy, property) {
        panic!("{e}");
    }
}

/// The long run of [`check`] (`cargo test -- --ignored`): [`CASES_VAR`] cases (default
/// [`LONG_RUN`]); prints the cases per second, for SECURITY.md.
pub(crate) fn long_run<S: Strategy>(
    decoder: &str,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let cases = std::env::var(CASES_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LONG_RUN);
    let start = Instant::now();
    check(cases, strategy, property);
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "{decoder}: {cases} cases in {seconds:.1} s ({:.0} cases/s), 0 failures",
        f64::from(cases) / seconds
    );
}

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The system's allocator, noting on each thread the largest block asked for.
pub(crate) struct Counting;

// SAFETY: every call goes to the system allocator as it came; the counter is a
// constant-initialised thread-local `Cell`, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: allocated by System with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: allocated by System with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The largest block this thread asked for while running `f`, and `f`'s result.
pub(crate) fn largest_allocation<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = LARGEST.with(|l| l.replace(0));
    let out = f();
    let largest = LARGEST.with(|l| l.replace(before.max(l.get())));
    (largest, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_stay_inside_the_input() {
        check(2000, inputs(vec![vec![], vec![1], vec![0; 9]], 16), |b| {
            prop_assert!(b.len() < 9 + 4 * 64 + 4 * 20);
            Ok(())
        });
    }

    #[test]
    fn the_counting_allocator_sees_a_large_block() {
        let (largest, v) = largest_allocation(|| Vec::<u8>::with_capacity(3 << 20));
        assert!(largest >= 3 << 20, "{largest}");
        drop(v);
        let (small, _) = largest_allocation(|| 1 + 1);
        assert!(small < 1 << 20, "{small}");
    }
}
