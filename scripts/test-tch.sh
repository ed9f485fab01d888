#!/usr/bin/env bash
# The LibTorch tier, from nothing: PyTorch 2.9.0 from PyPI in a virtual environment (see
# tch-env.sh), then the generic suite and the probe's checks on LibTorch's CPU device.
# Extra arguments go to `cargo test`. Its costs are in BENCHMARKS.md ("LibTorch CPU", "The tier's costs").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/tch-env.sh
cargo test --features tch --test tch "$@"
# ZeRO stage 3's per-layer bound on LibTorch, on real processes (tests/processes/stage3_backends.rs).
cargo test --features tch --test processes stage3_backends::stage_3_holds_one_layers_gathered_parameters_at_a_time_on_libtorch
