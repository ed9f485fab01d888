"""PyTorch DDP (gloo, CPU) counterpart of `examples/ddp_step.rs`: what synchronising gradients
costs on an MLP (by default the benchmark MLP, Linear(256, 512) -> ReLU -> Linear(512, 256);
`--dims` and `--batch` as the Rust side's), f32, batch 64 per process from a fixed-seed normal,
loss = mean of the output squared, SGD lr 1e-3), timed step by step (a step = forward +
backward (+ DDP all-reduce) + optimizer step + zero_grad).

    python benches/ddp_gloo.py                                   # one process, no DDP
    OMP_NUM_THREADS=1 python benches/ddp_gloo.py                 # the same, one thread
    torchrun --standalone --nproc_per_node 2 benches/ddp_gloo.py # two processes, DDP over gloo

torchrun gives each process OMP_NUM_THREADS=1 (as `burn-accelerate launch` gives
RAYON_NUM_THREADS=1 on a 2-core machine), so compare the 2-process step with the 1-thread
1-process one. Printed by rank 0: median and mean ms per step and, with 2 processes, the
mean `dist.all_reduce` of a flat f32 buffer as large as the model (the collective alone) and
its share of the step. DDP overlaps its all-reduce with backward, so the sync overhead is
read as 2-process step - 1-process step (pass the latter as --baseline-ms to print it).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    parser.add_argument("--baseline-ms", type=float, help="1-process median step, for the overhead")
    parser.add_argument("--dims", default="256,512,256", help="layer widths, input first")
    parser.add_argument("--batch", type=int, default=64, help="samples per process and step")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    torch.manual_seed(7)  # same weights and same batch on every process, as the Rust side
    dims = [int(d) for d in args.dims.split(",")]
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
        if i > 0:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(fan_in, fan_out))
    model = torch.nn.Sequential(*layers)
    params = sum(p.numel() for p in model.parameters())
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, dims[0])

    def step():
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    for _ in range(args.warmup):
        step()
    if distributed:
        dist.barrier()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    step_med, step_mean = statistics.median(times), statistics.mean(times)

    lines = [
        f"torch={torch.__version__} processes={world} threads={torch.get_num_threads()} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} params={params} "
        f"steps={args.steps} warmup={args.warmup}",
        f"step_ms median={step_med:.3f} mean={step_mean:.3f}",
    ]
    if distributed:
        buffer = torch.full((params,), 0.5)
        for _ in range(args.warmup):
            dist.all_reduce(buffer)
        dist.barrier()
        flat = []
        for _ in range(args.steps):
            start = time.perf_counter()
            dist.all_reduce(buffer)
            flat.append((time.perf_counter() - start) * 1e3)
        ar_mean, ar_med = statistics.mean(flat), statistics.median(flat)
        lines.append(
            f"all_reduce_ms ({params} f32) mean={ar_mean:.3f} median={ar_med:.3f} "
            f"share_of_step={100 * ar_mean / step_med:.1f}% (mean / step median)"
        )
    if args.baseline_ms is not None:
        over = step_med - args.baseline_ms
        lines.append(
            f"sync_overhead_ms={over:.3f} (step median - baseline {args.baseline_ms:.3f}) "
            f"= {100 * over / step_med:.1f}% of the step"
        )
    if rank == 0:
        print("\n".join(lines), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
