#!/usr/bin/env bash
# Issue 45's measurements in one run, for the first session on an Intel Xeon with AMX
# (`lscpu` shows amx_bf16): everything its goals ask, interleaved where they are ratios, with
# the CPU named. On another CPU it runs what that CPU has (the dot-product kernel, the twins)
# and says what it skipped, so the script itself is checked anywhere.
#
#   benches/amx.sh                      # THREADS=2 STEPS=30 ROUNDS=3 by default
#   THREADS=4 ROUNDS=5 benches/amx.sh   # more cores, more rounds
#
# In order:
#   1. the CPU (model, flags) and `burn-accelerate env` (which kernel runs, or why not AMX);
#   2. the tile kernel on the CPU's own tiles, bit for bit against its software model (the
#      `on_amx_tiles` tests .ci/run runs where /proc/cpuinfo has amx_bf16);
#   3. the GEMM alone against oneDNN's matmul, GFLOP/s on the LM's and the MLP's shapes
#      (examples/gemm_ab; oneDNN from Debian's libdnnl-dev, installed here if missing and
#      apt-get can, loaded at run time: never a dependency of the crate);
#   4. `train_lm` bf16 against its PyTorch + Accelerate twin on 1 and 2 processes
#      (benches/lm_ab.py);
#   5. a user's MLP step, bf16 and f32, against torch's (benches/torch_cpu_step.py);
#   6. where `perf` works, the bf16 step's profile (the shares BENCHMARKS.md names).
# Copy the tables into BENCHMARKS.md's "The bf16 GEMM on AMX tiles" section with the CPU line.
#
# The twins run in TWIN_VENV (default ~/.cache/burn-accelerate/twin-venv): a venv that reads
# the project's torch 2.9.0 venv (scripts/tch-env.sh makes it) through a .pth file and adds
# accelerate 1.16.0 and numpy, so that the LibTorch tier's venv stays as .ci/run made it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/burn-accelerate/target}"
threads="${THREADS:-2}"
# train_lm's step_ms leaves out its first steps (`WARM_UP_STEPS`, 3): STEPS must be larger.
steps="${STEPS:-30}"
rounds="${ROUNDS:-3}"
release="$CARGO_TARGET_DIR/release"
section() { printf '\n## %s\n\n' "$*"; }

section "CPU"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|CPU family|Model):' || true
flags="$(grep -m1 -w flags /proc/cpuinfo || true)"
for flag in amx_tile amx_bf16 avx512_bf16 avx512f; do
  if grep -qw "$flag" <<<"$flags"; then echo "flag $flag: yes"; else echo "flag $flag: no"; fi
done
amx=no
grep -qw amx_bf16 <<<"$flags" && amx=yes
uname -r
echo "threads per run: $threads; train_lm steps: $steps; rounds: $rounds"

cargo build --release --quiet --example train_lm --example gemm_ab --example autocast_ab \
  --bin burn-accelerate
"$release/burn-accelerate" env

section "The tile kernel on this CPU's tiles, bit for bit against the model"
# A failure here is reported and the timings still run (the exit status says it at the end):
# a session on an AMX machine may be the only one for a while.
failed=0
if [ "$amx" = yes ]; then
  cargo test --quiet -p burn-accelerate-kernels -- --ignored on_amx_tiles || failed=1
  cargo test --quiet --features ndarray --lib -- --ignored on_amx_tiles || failed=1
  [ "$failed" = 0 ] || echo "FAILED: the tile kernel on this CPU's tiles (above); the timings follow"
else
  echo "not run: this CPU has no AMX-BF16"
fi

section "The GEMM against oneDNN (GFLOP/s)"
if ! ldconfig -p | grep -q 'libdnnl\.so\.2'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libdnnl-dev >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libdnnl-dev >/dev/null; } \
      || echo "libdnnl-dev could not be installed: gemm_ab runs without the anchor"
  else
    echo "oneDNN not installed (apt-get install libdnnl-dev): gemm_ab runs without the anchor"
  fi
fi
OMP_NUM_THREADS="$threads" RAYON_NUM_THREADS="$threads" "$release/examples/gemm_ab" \
  --rounds "$((rounds * 3))"

source scripts/tch-env.sh
twin="${TWIN_VENV:-$HOME/.cache/burn-accelerate/twin-venv}"
if ! "$twin/bin/python" -c 'import torch, accelerate, numpy' 2>/dev/null; then
  python3 -m venv "$twin"
  site="$("$twin/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
    2>/dev/null >"$site/project-torch.pth"
  "$twin/bin/pip" install --quiet accelerate==1.16.0 numpy
fi
"$twin/bin/python" -c 'import torch, accelerate; print("torch", torch.__version__, "accelerate", accelerate.__version__)'

section "train_lm bf16 against its PyTorch + Accelerate twin"
python3 benches/lm_ab.py --venv "$twin" --target "$CARGO_TARGET_DIR" --precision bf16 \
  --processes 1,2 --steps "$steps" --rounds "$rounds"

section "A user's MLP step against torch's ($threads threads)"
RAYON_NUM_THREADS="$threads" "$twin/bin/python" \
  benches/torch_cpu_step.py --model mlp --rounds $((rounds * 7)) --threads "$threads" \
  --binary "$release/examples/autocast_ab"

section "Where the bf16 step goes (perf, train_lm --precision bf16 --steps $steps)"
if perf stat -e task-clock true >/dev/null 2>&1; then
  data="$(mktemp)"
  RAYON_NUM_THREADS="$threads" perf record -q -F 499 -o "$data" \
    "$release/examples/train_lm" --precision bf16 --steps "$steps" >/dev/null 2>&1
  # awk reads to the end, so that perf report never dies of a closed pipe (pipefail).
  perf report -i "$data" --no-children --sort symbol --stdio 2>/dev/null \
    | awk '/^ +[0-9]/ && ++shown <= 30 { sub(/ +-  +- *$/, ""); print }'
  rm -f "$data"
else
  echo "not run: perf is missing or not allowed here (apt-get install linux-perf)"
fi

if [ "$failed" != 0 ]; then
  echo "FAILED: the tile kernel's tests on this CPU's tiles (see its section)"
  exit 1
fi
