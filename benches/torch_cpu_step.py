"""burn-accelerate's `Accelerated<Autodiff<Flex>>` training step against PyTorch's on the CPU,
f32 against f32 and bf16 autocast against `torch.autocast("cpu", dtype=torch.bfloat16)`, in
one run, on the same thread count, the steps interleaved one by one.

Our side is `examples/autocast_ab --serve` (built first: `cargo build --release --example
autocast_ab`), which times one step per precision named on its stdin; this script builds the
same model in torch, and each round times ours f32, torch's f32, ours bf16, torch's bf16 (the
order rotating every round), with a short pause between variants so that neither side's idle
threads still spin while the other runs, and `--repeat` steps of a variant in a row of which
the last is timed (the first after a switch ran 1.5-2x slower on our side: the other process's
traces in the caches, and its threads). Run torch with `OMP_WAIT_POLICY=PASSIVE`: its OpenMP
threads otherwise spin on the cores after each step (the script sets it where the environment
does not). Both sides time a step the same way: forward (under
autocast or not), the mean square of the output minus a target, backward, and the gradients
dropped (`set_to_none`), so a step allocates them afresh, as Burn's does.

Models (as examples/autocast_ab.rs):
- `mlp`: 256×512 → 2048 → 512 with ReLU;
- `conv`: 32 RGB images of 32×32, conv 3→32 and 32→64 (3×3, the second with stride 2), ReLU,
  spatial mean, linear 64→10;
- `deep`: 8 linear layers of 1024 with ReLU between, batch 4096;
- `lstm`: two bidirectional LSTM layers (hidden `--hidden`), 32 sequences of 10 steps of one
  feature, a linear head on the last step.

    RAYON_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE ~/.cache/burn-accelerate/torch-venv/bin/python \
        benches/torch_cpu_step.py --model mlp --rounds 21 [--threads 2]

Printed: each variant's median and fastest step, and their ratios to torch's step of the same
precision (ours / torch's: below 1.0 ours is faster) and to its own f32.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

# torch's OpenMP threads read the policy when they start: passive unless the environment says
# otherwise, so that they do not spin on the cores our process's steps run on between torch's.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 (after the policy)
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(512, 2048)
        self.down = nn.Linear(2048, 512)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(2).mean(2))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(8))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


class LstmNet(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, 1)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def build(model, hidden):
    if model == "mlp":
        return Mlp(), torch.randn(256, 512), torch.randn(256, 512)
    if model == "conv":
        return ConvNet(), torch.randn(32, 3, 32, 32), torch.randn(32, 10)
    if model == "deep":
        return Deep(), torch.randn(4096, 1024), torch.randn(4096, 1024)
    if model == "lstm":
        return LstmNet(hidden), torch.randn(32, 10, 1), torch.randn(32, 1)
    raise ValueError(model)


def torch_step(net, x, y, bf16):
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = net(x)
    loss = (out.float() - y).pow(2).mean()
    loss.backward()
    net.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "conv", "deep", "lstm"])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int,
                        default=int(os.environ.get("RAYON_NUM_THREADS", os.cpu_count())))
    parser.add_argument("--pause", type=float, default=0.02,
                        help="seconds between variants (idle threads stop spinning)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="steps per variant and round, the last one timed: the first "
                             "after a switch pays for the other process's traces (caches, "
                             "its threads waking and sleeping)")
    parser.add_argument("--binary", action="append",
                        help="our build (examples/autocast_ab); several, each named "
                             "`ours#<i>` by its order, to compare builds against torch in one "
                             "run. Default: the release build under CARGO_TARGET_DIR or "
                             "target/")
    parser.add_argument("--ours-args", default="",
                        help="more arguments for autocast_ab (e.g. --cast-small)")
    args = parser.parse_args()

    binaries = args.binary or [os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")),
        "release", "examples", "autocast_ab")]
    torch.set_num_threads(args.threads)
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    ours = {}
    for i, binary in enumerate(binaries):
        name = "ours" if len(binaries) == 1 else f"ours#{i + 1}"
        ours[name] = (binary, subprocess.Popen(
            [binary, "--serve", "--model", args.model, "--hidden", str(args.hidden),
             *args.ours_args.split()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))

    def our_step(name, precision):
        binary, process = ours[name]
        process.stdin.write(precision + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            sys.exit(f"{binary} exited ({process.wait()})")
        return float(line)

    torch.manual_seed(7)
    net, x, y = build(args.model, args.hidden)
    variants = {}
    for precision in ["f32", "bf16"]:
        for name in ours:
            variants[f"{name} {precision}"] = lambda n=name, p=precision: our_step(n, p)
        variants[f"torch {precision}"] = lambda bf16=precision == "bf16": torch_step(
            net, x, y, bf16)
    names = list(variants)
    for name in names:  # warm-up
        variants[name]()
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            time.sleep(args.pause)
            for _ in range(args.repeat):
                t = variants[name]()
            times[name].append(t)
    for _, process in ours.values():
        process.stdin.close()
        process.wait()

    med = {n: statistics.median(t) for n, t in times.items()}
    best = {n: min(t) for n, t in times.items()}
    extra = f" hidden {args.hidden}" if args.model == "lstm" else ""
    print(f"torch {torch.__version__}, model {args.model}{extra}, {args.threads} threads, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.2f}, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    if len(ours) > 1:
        for name, (binary, _) in ours.items():
            print(f"{name}: {binary}")
    for n in names:
        who, precision = n.split()
        torch_n = "torch " + precision
        print(f"{n:<11} median {med[n]:8.2f} ms  fastest {best[n]:8.2f} ms  "
              f"vs {who} f32 {med[n] / med[who + ' f32']:.2f}x  "
              + (f"ours/torch {med[n] / med[torch_n]:.2f}x "
                 f"(fastest {best[n] / best[torch_n]:.2f}x)" if who != "torch" else ""))


if __name__ == "__main__":
    main()
