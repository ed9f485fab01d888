"""PyTorch + Hugging Face Accelerate twin of `examples/train_lm.rs`: the same GPT-style
byte-level causal language model, data, optimizer, schedule and precision, trained with
`Accelerator` on the CPU, printing the same summary keys, so that benches/lm_ab.py can compare
the two runs side by side.

The environment (the project's torch venv, as scripts/tch-env.sh makes it, plus Accelerate):

    python3 -m venv "$HOME/.cache/burn-accelerate/torch-venv"
    "$HOME/.cache/burn-accelerate/torch-venv/bin/pip" install torch==2.9.0
    "$HOME/.cache/burn-accelerate/torch-venv/bin/pip" install accelerate==1.16.0

Runs (PY=$HOME/.cache/burn-accelerate/torch-venv/bin/python):

    $PY benches/accelerate_lm.py --precision bf16 --steps 40             # 1 process, all cores
    $PY benches/accelerate_lm.py --precision f32 --steps 40 --threads 1
    OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benches/accelerate_lm.py --precision bf16 --steps 40             # DDP over gloo
    OMP_NUM_THREADS=1 $HOME/.cache/burn-accelerate/torch-venv/bin/accelerate launch --multi_gpu \\
        --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        benches/accelerate_lm.py --precision bf16 --steps 40             # the same, via Accelerate

Both 2-process forms were checked with accelerate 1.16.0 and torch 2.9.0 on a machine with no
GPU and no network, and give the same losses: each process gets `DistributedType.MULTI_CPU`
over gloo. `--multi_gpu` is no typo: it is the launcher's torch.distributed.run path, which
starts the processes whatever the devices, and `cpu=True` in this script picks gloo. `accelerate
launch --cpu --num_processes 2` does NOT start 2 processes: on the CPU it goes multi-process only
through `mpirun --hostfile` (--mpirun_hostfile); without one it runs a single plain process and
says nothing. The launcher's `--mixed_precision no` only silences its defaults warning: this
script passes its own precision to `Accelerator`, which wins. torchrun and the launcher give
each process OMP_NUM_THREADS=1 when it is unset (each process then runs 1 thread of the 2).

What mirrors the Burn side exactly:
- corpus: the bytes of README.md, BENCHMARKS.md, src/train/mod.rs, src/accelerator.rs,
  src/scaler.rs and src/data/shard.rs, concatenated (or `--text PATH`); a token is a byte;
- windows of `seq + 1` bytes every `seq`; the last tenth (at least one) validates, `--steps S`
  keeps the first S * batch * grad_accum * processes training windows: one epoch, S steps;
- the model: Burn 0.21's pre-norm `TransformerEncoder` written out, since Burn's attention
  differs from torch's: dropout on the raw scores (before the mask and the softmax), the future
  masked with -1e4 (Burn's `min_float`) rather than -inf; token and position embeddings N(0, 1),
  linear layers uniform(+-1/sqrt(fan_in)) (torch's defaults), exact GELU;
- Adam(betas 0.9/0.999, eps 1e-8), linear warm-up to `--lr` over `--warmup` steps, no clipping,
  mean cross-entropy in f32.

What cannot mirror it: the data order (shuffled each epoch from `--seed`, by torch's generator
rather than Burn's), the dropout masks, and the initial weights, all drawn from a different
random generator; so losses agree in distribution, not digit by digit.

Precision: `--precision f32|bf16|f16` is `Accelerator(mixed_precision="no"|"bf16"|"fp16",
cpu=True)`. Accelerate runs the model's forward under `torch.autocast("cpu", bfloat16)` for
bf16; the script checks on the first step that a Linear layer's output inside the forward has
the autocast dtype (and is f32 during the f32 validation). f16 is refused: accelerate 1.16 with
`cpu=True` accepts mixed_precision="fp16" and reports it, but only enables autocast and a
GradScaler when the device is not the CPU, so the run would silently be f32 (torch 2.9 itself
has float16 CPU autocast and `torch.amp.GradScaler("cpu")`; Accelerate does not use them).

Printed: progress every 10 optimizer steps on stderr (`step i/S loss= ms=`); on stdout, by the
main process only, `initial loss=` (the first batch's loss, averaged over the processes) and, as
the last line, `final steps= step_ms= tokens_per_s= train_loss= valid_loss= peak_rss_mib=
precision= processes=`. step_ms is the median time of an optimizer step (from the end of the
previous one: data, forward, backward, all-reduce, optimizer) after the first 3; tokens_per_s
counts every process's tokens over the same steps; train_loss is the mean over the last (up to)
10 steps of the loss of each step's batches, averaged over the processes; peak_rss_mib is the
largest peak RSS of any process. The validation loss is computed by the main process alone,
in f32 with dropout off, over every validation window.
"""

import argparse
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = ["README.md", "BENCHMARKS.md", "src/train/mod.rs", "src/accelerator.rs",
          "src/scaler.rs", "src/data/shard.rs"]
VOCAB = 256
MIXED = {"f32": "no", "bf16": "bf16", "f16": "fp16"}
AUTOCAST_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# Burn's `min_float` for f32, what its attention fills the masked scores with.
MASK_FILL = -1.0e4


class Block(nn.Module):
    """One layer of Burn's `TransformerEncoder` with `norm_first: true`."""

    def __init__(self, d_model, heads, d_ff, dropout):
        super().__init__()
        self.heads = heads
        self.norm_a = nn.LayerNorm(d_model, eps=1e-5)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm_b = nn.LayerNorm(d_model, eps=1e-5)
        self.ff_in = nn.Linear(d_model, d_ff)
        self.ff_out = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, future):
        b, s, d = x.shape
        d_k = d // self.heads

        def split(t):
            return t.reshape(b, s, self.heads, d_k).transpose(1, 2)

        h = self.norm_a(x)
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d_k)
        # Burn drops out the raw scores, before the mask and the softmax: a dropped score
        # still takes part in the softmax, as 0 (torch's own attention drops the weights).
        scores = self.dropout(scores).masked_fill(future, MASK_FILL)
        ctx = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.dropout(self.out(ctx))
        f = self.ff_out(self.dropout(F.gelu(self.ff_in(self.norm_b(x)))))
        return x + self.dropout(f)


class ByteLm(nn.Module):
    def __init__(self, seq, d_model, layers, heads, d_ff, dropout):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, d_ff, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, VOCAB)
        # A plain attribute, not a buffer: DDP would broadcast a buffer before every forward.
        self.future = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)

    def forward(self, tokens):
        s = tokens.shape[1]
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(s, device=tokens.device))
        future = self.future[:s, :s]
        for block in self.blocks:
            x = block(x, future)
        return self.head(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def windows(args):
    if args.text:
        corpus = open(args.text, "rb").read()
    else:
        corpus = b"".join(open(os.path.join(ROOT, p), "rb").read() for p in CORPUS)
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    n = (len(data) - 1) // args.seq_len
    if n < 2:
        sys.exit(f"the corpus ({len(data)} bytes) holds fewer than 2 windows of "
                 f"{args.seq_len + 1} bytes")
    # Window i is data[i*seq : i*seq + seq + 1]: consecutive windows share one byte.
    w = data[: n * args.seq_len + 1].unfold(0, args.seq_len + 1, args.seq_len)
    assert w.shape[0] == n
    n_valid = max(1, n // 10)
    return w[: n - n_valid], w[n - n_valid:]


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class DtypeProbe:
    """Records the output dtype of a module's next forward call."""

    def __init__(self, module):
        self.dtype = None
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, _module, _inputs, output):
        self.dtype = output.dtype
        self.handle.remove()


def check_dtype(probe, expected, what):
    if probe.dtype != expected:
        sys.exit(f"{what}: a Linear layer's output was {probe.dtype}, expected {expected}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="f32", choices=sorted(MIXED))
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (one epoch)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per process and batch")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-ff", type=int, default=1536)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear LR warm-up")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="batches whose gradients are summed before each optimizer step")
    parser.add_argument("--text", help="train on this file's bytes instead of the repo's sources")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: torch's, or OMP_NUM_THREADS)")
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error("--d-model must be a multiple of --heads")
    if min(args.steps, args.batch_size, args.grad_accum, args.warmup, args.seq_len) < 1:
        parser.error("--steps, --batch-size, --grad-accum, --warmup and --seq-len must be >= 1")

    # Imported late so that --help and argument errors stay fast.
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    accelerator = Accelerator(mixed_precision=MIXED[args.precision], cpu=True,
                              gradient_accumulation_steps=args.grad_accum)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.precision == "f16" and not accelerator.native_amp:
        sys.exit("f16: accelerate on the CPU accepts mixed_precision='fp16' but runs neither "
                 "autocast nor a GradScaler (the run would be f32); the twin has no f16")
    world = accelerator.num_processes
    if world > 1 and accelerator.distributed_type != DistributedType.MULTI_CPU:
        sys.exit(f"expected MULTI_CPU under {world} processes, got {accelerator.distributed_type}")
    set_seed(args.seed)

    train, valid = windows(args)
    per_step = args.batch_size * args.grad_accum * world
    need = args.steps * per_step
    if len(train) < need:
        sys.exit(f"--steps {args.steps} needs {need} training windows "
                 f"({args.batch_size} x {args.grad_accum} x {world} a step); the corpus has "
                 f"{len(train)} (and {len(valid)} for validation)")
    train = train[:need]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(train[:, :-1], train[:, 1:]),
        batch_size=args.batch_size, shuffle=True, drop_last=False)

    model = ByteLm(args.seq_len, args.d_model, args.layers, args.heads, args.d_ff, args.dropout)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.0)
    # Not handed to `prepare`: Accelerate's scheduler wrapper steps the schedule once per
    # process per optimizer step (unless split_batches), which would end the warm-up twice as
    # early on 2 processes as on 1; the Burn side counts optimizer steps.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    main = accelerator.is_main_process
    if main:
        print(f"{args.precision}: {world} process(es) x {torch.get_num_threads()} thread(s), "
              f"{accelerator.distributed_type}, {len(train)} training windows, {len(valid)} "
              f"validation, {sum(p.numel() for p in model.parameters())} parameters",
              file=sys.stderr)

    probe = DtypeProbe(accelerator.unwrap_model(model).blocks[0].query)
    model.train()
    step_ms, step_loss, micro = [], [], []
    start = time.perf_counter()
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = lm_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro.append(loss.item())
        if probe is not None:
            check_dtype(probe, AUTOCAST_DTYPE[args.precision], "training forward")
            probe = None
            first = accelerator.reduce(torch.tensor(micro[0]), reduction="mean").item()
            if main:
                print(f"initial loss={first:.6f}", flush=True)
        if not accelerator.sync_gradients:
            continue
        scheduler.step()
        now = time.perf_counter()
        step_ms.append((now - start) * 1e3)
        start = now
        step_loss.append(sum(micro) / len(micro))
        micro = []
        i = len(step_ms)
        if main and i % 10 == 0:
            print(f"step {i}/{args.steps} loss={step_loss[-1]:.4f} ms={step_ms[-1]:.1f}",
                  file=sys.stderr, flush=True)
    if len(step_ms) != args.steps:
        sys.exit(f"ran {len(step_ms)} optimizer steps, expected {args.steps}")

    # Losses and peak RSS cross the processes once, after the timed loop, so that no step
    # pays for a collective the Burn side does not make.
    recent = accelerator.reduce(torch.tensor(step_loss[-min(10, args.steps):]), "mean")
    peak_rss = accelerator.gather(torch.tensor([peak_rss_mib()])).max().item()
    if not main:
        accelerator.end_training()
        return

    net = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    net.eval()
    probe = DtypeProbe(net.blocks[0].query)
    total = 0.0
    with torch.no_grad():
        for at in range(0, len(valid), args.batch_size):
            batch = valid[at: at + args.batch_size]
            total += lm_loss(net(batch[:, :-1]), batch[:, 1:]).item() * len(batch)
    check_dtype(probe, torch.float32, "validation forward")
    valid_loss = total / len(valid)
    peak_rss = max(peak_rss, peak_rss_mib())  # the validation's share, on this process

    timed = step_ms[3:] if len(step_ms) > 3 else step_ms
    tokens = len(timed) * per_step * args.seq_len
    print(f"final steps={args.steps} step_ms={statistics.median(timed):.1f} "
          f"tokens_per_s={tokens / (sum(timed) / 1e3):.1f} "
          f"train_loss={recent.mean().item():.6f} valid_loss={valid_loss:.6f} "
          f"peak_rss_mib={int(round(peak_rss))} precision={args.precision} processes={world}",
          flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
