#!/usr/bin/env bash
# The GPU benchmark, both sides on the same GPU in one run: burn-accelerate's transformer
# block step (benches/gpu_step.rs) in f32, bf16 and f16 autocast, then PyTorch's own f32 vs
# torch.autocast for the same model (benches/torch_amp.py, torch 2.9.0 from the venv that
# scripts/tch-env.sh sets up). Results go to stdout; copy them into BENCHMARKS.md with the
# GPU model this prints.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/burn-accelerate/target}"
cargo bench --features cuda --bench gpu_step
source scripts/tch-env.sh
python benches/torch_amp.py --device cuda
