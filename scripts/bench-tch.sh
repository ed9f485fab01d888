#!/usr/bin/env bash
# The LibTorch CPU benchmark (benches/tch_step.rs): f32 against bf16 cast by hand and bf16
# autocast through the decorator. Extra arguments go to the benchmark (a criterion filter).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/tch-env.sh
cargo bench --features tch --bench tch_step -- "$@"
