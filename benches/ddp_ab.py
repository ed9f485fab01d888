"""Interleaved A/B of the gradient sync against DDP over gloo (issue 38): the 100M-parameter
MLP of examples/ddp_step.rs ("ours") and its twin benches/ddp_gloo.py ("torch"), on one process
and on two, all four runs within every round (the order of the sides swapping each round), so
that whatever else loads the machine meanwhile hits both sides alike.

Build ours first, and make the torch venv (scripts/tch-env.sh makes it):

    cargo build --release --example ddp_step --bin burn-accelerate

then, with any Python (it only starts the programs):

    python3 benches/ddp_ab.py --rounds 3

Each round runs (D: --dims 4096,4096,4096,4096,4096,4096,4096 --batch 16 --steps S):

    ours, 1 process:   RAYON_NUM_THREADS=1 $TARGET/release/examples/ddp_step $D
    ours, 2:           $TARGET/release/burn-accelerate launch --num-processes 2 -- \\
                           $TARGET/release/examples/ddp_step $D
    torch, 1 process:  OMP_NUM_THREADS=1 $VENV/bin/python benches/ddp_gloo.py $D --warmup 2
    DDP, 2:            OMP_NUM_THREADS=1 $VENV/bin/python -m torch.distributed.run \\
                           --standalone --nproc_per_node 2 benches/ddp_gloo.py $D --warmup 2

One thread per process on both sides, as in BENCHMARKS.md. Printed: a line per run on stderr,
and a markdown table of each round and of the medians over the rounds: the step times, the
sync cost (2-process step minus 1-process step, for both sides: DDP overlaps its all-reduce with
the backward pass, so only the difference compares), our sync timed directly and the CPU
time it used (all threads of the main process: a sync that keeps a core busy all along cannot
be hidden behind a backward pass that keeps every core busy), the flat
all-reduce of every parameter (ours and gloo's), and the issue's two goals:
- our sync cost at most DDP's;
- our 2-process step at most DDP's 2-process step times (our 1-process step / torch's).

The machine should be otherwise idle.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOME_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "burn-accelerate")
OURS = re.compile(
    r"step_ms=([\d.]+) sync_ms=([\d.]+) .*flat_all_reduce_ms=([\d.]+).*sync_cpu_ms=(\d+)")
TORCH_STEP = re.compile(r"step_ms median=([\d.]+)")
GLOO = re.compile(r"all_reduce_ms \(\d+ f32\) mean=[\d.]+ median=([\d.]+)")


def run(cmd, env_extra):
    env = dict(os.environ, **env_extra)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}")
    return done.stdout


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--dims", default="4096,4096,4096,4096,4096,4096,4096")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target", default=os.environ.get(
        "CARGO_TARGET_DIR", os.path.join(HOME_CACHE, "target")))
    parser.add_argument("--venv", default=os.environ.get(
        "TORCH_VENV", os.path.join(HOME_CACHE, "torch-venv")))
    args = parser.parse_args()

    d = ["--dims", args.dims, "--batch", str(args.batch), "--steps", str(args.steps)]
    step = os.path.join(args.target, "release", "examples", "ddp_step")
    launch = os.path.join(args.target, "release", "burn-accelerate")
    python = os.path.join(args.venv, "bin", "python")
    one = {"OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}

    def ours(processes):
        cmd = [step, *d] if processes == 1 else [
            launch, "launch", "--num-processes", str(processes), "--", step, *d]
        m = OURS.search(run(cmd, one))
        return {"step": float(m[1]), "sync": float(m[2]), "flat": float(m[3]),
                "sync_cpu": float(m[4])}

    def torch(processes):
        script = [os.path.join("benches", "ddp_gloo.py"), *d, "--warmup", "2"]
        cmd = [python, *script] if processes == 1 else [
            python, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(processes), *script]
        out = run(cmd, one)
        flat = GLOO.search(out)
        return {"step": float(TORCH_STEP.search(out)[1]),
                "flat": float(flat[1]) if flat else None}

    rows = []
    for r in range(args.rounds):
        sides = [("ours", ours), ("torch", torch)]
        if r % 2:
            sides.reverse()
        got = {}
        for name, side in sides:
            for processes in (1, 2):
                got[(name, processes)] = side(processes)
                print(f"round {r + 1} {name} {processes}: {got[(name, processes)]}",
                      file=sys.stderr, flush=True)
        rows.append(got)

    def figures(got):
        o1, o2 = got[("ours", 1)]["step"], got[("ours", 2)]["step"]
        t1, t2 = got[("torch", 1)]["step"], got[("torch", 2)]["step"]
        return [o1, o2, o2 - o1, got[("ours", 2)]["sync"], got[("ours", 2)]["sync_cpu"],
                got[("ours", 2)]["flat"],
                t1, t2, t2 - t1, got[("torch", 2)]["flat"], t2 * o1 / t1]

    head = ["round", "ours 1 proc", "ours 2 procs", "ours sync cost", "ours sync (timed)",
            "ours sync CPU time", "ours flat all-reduce", "torch 1 proc", "DDP 2 procs", "DDP sync cost",
            "gloo flat all-reduce", "goal: ours 2 procs at most"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    table = [figures(got) for got in rows]
    for i, f in enumerate(table):
        print(f"| {i + 1} | " + " | ".join(f"{v:.0f} ms" for v in f) + " |")
    med = [statistics.median(col) for col in zip(*table)]
    print("| median | " + " | ".join(f"{v:.0f} ms" for v in med) + " |")
    print(f"\nsync cost: ours {med[2]:.0f} ms vs DDP's {med[8]:.0f} ms "
          f"({'met' if med[2] <= med[8] else 'missed'}); 2-process step: ours {med[1]:.0f} ms "
          f"vs the goal {med[10]:.0f} ms ({'met' if med[1] <= med[10] else 'missed'}); "
          f"1-process step: ours/torch = {med[0] / med[6]:.2f}")


if __name__ == "__main__":
    main()
