"""Interleaved A/B of the byte-level language model: burn-accelerate's `examples/train_lm`
("ours") against its PyTorch + Accelerate twin, benches/accelerate_lm.py ("twin"), the two runs
of each configuration back to back within every round (their order swapping each round), so
that whatever else loads the machine meanwhile hits both sides alike.

Build ours first, and make the torch venv (see benches/accelerate_lm.py for its install lines):

    cargo build --release --example train_lm --bin burn-accelerate

then, with any Python (it only starts the two programs):

    python3 benches/lm_ab.py --precision f32,bf16 --steps 40 --rounds 3
    python3 benches/lm_ab.py --precision bf16 --processes 1,2 --steps 40
    python3 benches/lm_ab.py --precision f32 --d-model 128 --layers 2 --seq-len 128

Each round runs, per precision and process count:

    ours, 1 process:  $TARGET/release/examples/train_lm --precision P --steps S [model flags]
    twin, 1 process:  $VENV/bin/python benches/accelerate_lm.py --precision P --steps S [...]
    ours, 2:          $TARGET/release/burn-accelerate launch --num-processes 2 -- \\
                          $TARGET/release/examples/train_lm --precision P --steps S [...]
    twin, 2:          OMP_NUM_THREADS=1 $VENV/bin/python -m torch.distributed.run --standalone \\
                          --nproc_per_node 2 benches/accelerate_lm.py --precision P ...

TARGET is --target, else $CARGO_TARGET_DIR, else ~/.cache/burn-accelerate/target; VENV is
--venv, else $TORCH_VENV, else ~/.cache/burn-accelerate/torch-venv. One process uses every core
on both sides (their default); two processes get one thread each (the launcher sets
RAYON_NUM_THREADS=1 on a 2-core machine, torchrun OMP_NUM_THREADS=1). `--threads N` sets
RAYON_NUM_THREADS / OMP_NUM_THREADS for both instead.

Printed: a markdown table, per configuration, of the medians over the rounds of each side's
step_ms, tokens_per_s, final training and validation losses and peak RSS, and a row of
ours/twin of each (step time below 1.0, tokens/s above 1.0: ours is faster). The losses agree
in distribution only: data order, dropout masks and initial weights come from different
generators. The twin's peak RSS starts from about 500 MiB that importing torch 2.9 (the PyPI
wheel, CUDA libraries included) costs before any tensor exists. A run that fails stops the
whole comparison (its stderr's tail printed) with a non-zero exit. `--sides twin` (or `ours`)
runs one program alone, to try a configuration out.

The machine should be otherwise idle: torch's OpenMP threads wait at every barrier for a thread
another program has descheduled, so on a loaded 2-core machine the twin's 2-thread steps slow
down several times (1.5 s f32 steps took 4-10 s while a cargo build ran); the per-run lines
on stderr show such outliers.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOME_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "burn-accelerate")
# (flag, type): passed through to both programs, only when given.
MODEL_FLAGS = [("--batch-size", int), ("--seq-len", int), ("--d-model", int), ("--layers", int),
               ("--heads", int), ("--d-ff", int), ("--dropout", float), ("--lr", float),
               ("--warmup", int), ("--seed", int), ("--grad-accum", int), ("--text", str)]
FINAL = re.compile(r"^(?:\[rank 0\] )?final (.*)$")
KEYS = ["step_ms", "tokens_per_s", "train_loss", "valid_loss", "peak_rss_mib"]


def parse_final(stdout):
    """The key=value pairs of the (rank 0) `final ...` line, or None."""
    pairs = None
    for line in stdout.splitlines():
        match = FINAL.match(line.strip())
        if match:
            # Keys beyond KEYS (ours adds some, not all of them key=value) are ignored.
            pairs = dict(kv.split("=", 1) for kv in match.group(1).split() if "=" in kv)
    return pairs


def run(label, command, env):
    print(f"  {label}: {' '.join(command)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    final = parse_final(done.stdout) if done.returncode == 0 else None
    if final is None or any(k not in final for k in KEYS):
        tail = "\n".join((done.stderr + done.stdout).splitlines()[-30:])
        sys.exit(f"{label} failed (exit {done.returncode}, no complete `final` line):\n{tail}")
    print(f"    {time.perf_counter() - start:.0f} s: "
          + " ".join(f"{k}={final[k]}" for k in KEYS), file=sys.stderr, flush=True)
    return {k: float(final[k]) for k in KEYS}


def fmt(key, value):
    if key in ("train_loss", "valid_loss"):
        return f"{value:.4f}"
    if key == "peak_rss_mib":
        return f"{value:.0f}"
    return f"{value:.1f}"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="f32",
                        help="comma-separated: f32, bf16, f16 (default f32)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", default="1", help="1, 2 or 1,2")
    parser.add_argument("--threads", type=int,
                        help="RAYON_NUM_THREADS / OMP_NUM_THREADS for both sides")
    parser.add_argument("--sides", default="ours,twin",
                        help="which programs to run (ours,twin; one alone to try it out)")
    parser.add_argument("--target", default=os.environ.get("CARGO_TARGET_DIR",
                                                           os.path.join(HOME_CACHE, "target")))
    parser.add_argument("--venv", default=os.environ.get("TORCH_VENV",
                                                         os.path.join(HOME_CACHE, "torch-venv")))
    for flag, kind in MODEL_FLAGS:
        parser.add_argument(flag, type=kind, help="passed to both programs")
    args = parser.parse_args()

    precisions = args.precision.split(",")
    if any(p not in ("f32", "bf16", "f16") for p in precisions):
        parser.error(f"--precision: {args.precision}")
    if "f16" in precisions and "twin" in args.sides.split(","):
        parser.error("f16: the twin cannot run it (Accelerate runs fp16 on the CPU as f32; see "
                     "benches/accelerate_lm.py); use --sides ours")
    processes = [int(p) for p in args.processes.split(",")]
    if any(p not in (1, 2) for p in processes):
        parser.error(f"--processes: {args.processes}")
    sides = args.sides.split(",")
    if not sides or any(s not in ("ours", "twin") for s in sides):
        parser.error(f"--sides: {args.sides}")

    train_lm = os.path.join(args.target, "release", "examples", "train_lm")
    launcher = os.path.join(args.target, "release", "burn-accelerate")
    python = os.path.join(args.venv, "bin", "python")
    twin = os.path.join(ROOT, "benches", "accelerate_lm.py")
    needed = ([train_lm] + ([launcher] if 2 in processes else []) if "ours" in sides else []) \
        + ([python] if "twin" in sides else [])
    for path in needed:
        if not os.access(path, os.X_OK):
            sys.exit(f"missing {path}: build with `cargo build --release --example train_lm "
                     f"--bin burn-accelerate`, and make the venv as benches/accelerate_lm.py says")

    passed = []
    for flag, _ in MODEL_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            # Both programs run from the repo root: a relative --text must not move.
            passed += [flag, os.path.abspath(value) if flag == "--text" else str(value)]

    def commands(precision, world):
        common = ["--precision", precision, "--steps", str(args.steps)] + passed
        env = dict(os.environ)
        if args.threads:
            env.update(RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
        if world == 1:
            ours = [train_lm] + common
            theirs = [python, twin] + common
            return {"ours": (ours, env), "twin": (theirs, env)}
        ours = [launcher, "launch", "--num-processes", str(world), "--", train_lm] + common
        theirs = [python, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={world}", twin] + common
        twin_env = dict(env)
        twin_env.setdefault("OMP_NUM_THREADS", "1")
        return {"ours": (ours, env), "twin": (theirs, twin_env)}

    configs = [(p, w) for w in processes for p in precisions]
    results = {(c, s): [] for c in configs for s in sides}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for config in configs:
            cmds = commands(*config)
            for side in (sides if r % 2 == 0 else sides[::-1]):
                command, env = cmds[side]
                label = f"{side} {config[0]} x{config[1]}"
                results[(config, side)].append(run(label, command, env))

    def median(config, side, key):
        return statistics.median(result[key] for result in results[(config, side)])

    print(f"\n{args.rounds} round(s) of {args.steps} steps, medians; load average "
          f"{os.getloadavg()[0]:.2f}; flags: {' '.join(passed) or '(defaults)'}\n")
    print("| precision | processes | side | step ms | tokens/s | train loss | valid loss "
          "| peak RSS MiB |")
    print("|---|---|---|--:|--:|--:|--:|--:|")
    for config in configs:
        meds = {side: [median(config, side, key) for key in KEYS] for side in sides}
        rows = [(side, [fmt(k, v) for k, v in zip(KEYS, meds[side])]) for side in sides]
        if len(sides) == 2:
            rows.append(("ours/twin", [f"{a / b:.2f}" if b else "-"
                                       for a, b in zip(meds["ours"], meds["twin"])]))
        for side, cells in rows:
            print(f"| {config[0]} | {config[1]} | {side} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
