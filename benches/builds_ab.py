"""Several builds of `examples/autocast_ab` against each other: one precision's training step,
the builds interleaved round by round, for a change's before and after on a noisy machine.

Build each commit's binary first and copy it aside, e.g.

    cargo build --release --example autocast_ab && cp target/release/examples/autocast_ab /tmp/ab.before
    # the change, then the same into /tmp/ab.after
    RAYON_NUM_THREADS=2 python3 benches/builds_ab.py --model conv --rounds 40 /tmp/ab.before /tmp/ab.after

Each round times every build once (the order rotating), after a short pause and `--repeat`
steps of which the last is timed, as `benches/torch_cpu_step.py` does. Printed per build: the
median step, the fastest, and the first quartile. Needs only Python's standard library.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binaries", nargs="+", help="builds of examples/autocast_ab")
    parser.add_argument("--model", default="conv", choices=["mlp", "conv", "deep", "lstm"])
    parser.add_argument("--precision", default="bf16", choices=["f32", "bf16", "f16"])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.02)
    args = parser.parse_args()

    builds = [
        subprocess.Popen([b, "--serve", "--model", args.model],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for b in args.binaries
    ]

    def step(build):
        build.stdin.write(args.precision + "\n")
        build.stdin.flush()
        line = build.stdout.readline()
        if not line:
            sys.exit(f"{build.args[0]} exited ({build.wait()})")
        return float(line)

    for build in builds:  # warm-up
        step(build)
    times = [[] for _ in builds]
    for r in range(args.rounds):
        for i in range(len(builds)):
            j = (i + r) % len(builds)
            time.sleep(args.pause)
            for _ in range(args.repeat):
                t = step(builds[j])
            times[j].append(t)
    for build in builds:
        build.stdin.close()
        build.wait()

    print(f"model {args.model}, {args.precision}, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    for name, t in zip(args.binaries, times):
        q1 = statistics.quantiles(t, n=4)[0]
        print(f"{name:>32}  median {statistics.median(t):8.2f} ms  fastest {min(t):8.2f} ms  "
              f"q1 {q1:8.2f} ms")


if __name__ == "__main__":
    main()
