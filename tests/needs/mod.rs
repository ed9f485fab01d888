//! Tests that need what not every machine has: how they say so.
//!
//! A test that needs something not every machine has (a CUDA device, torchrun from the
//! LibTorch tier's venv, root and iproute2 to make network namespaces, the MPI engine; in
//! `src/`, a CPU with AVX512-BF16) is `#[ignore = "needs …"]`: a plain `cargo test` lists it
//! as `ignored`, with the reason, and never as `ok` without having run. The tier of `.ci/run`
//! that provides the need runs it with `--ignored`. Run with `--ignored` where the need is
//! missing, the test fails through [`missing`], naming it; it never returns early. Tests of
//! the launcher and the built-in engine fail the same way under
//! `BURN_ACCELERATE_TEST_ENGINE=mpi`, and the MPI tier leaves them out with `--skip` (the
//! harness counts them as filtered out).

/// Fails the test that needs `what`, which this machine (or this run) lacks.
pub fn missing(what: &str) -> ! {
    panic!("not run: this test needs {what}, which is missing here (see tests/needs/mod.rs)")
}
