"""torch.distributed (gloo, CPU) counterpart of `examples/all_reduce_bw.rs`: `dist.all_reduce`
of f32 tensors of a few sizes, timed call by call on every process, with the peak resident
memory each size adds over its tensor.

    torchrun --standalone --nproc_per_node 2 benches/all_reduce_gloo.py

Printed by rank 0, per size: the median time of a call (the slowest process's), the algorithm
bandwidth (bytes / time) and the bus bandwidth (x 2 (n - 1) / n), and the largest growth of the
peak resident memory over the tensor on any process (Linux: VmHWM, reset before each size).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def reset_peak_memory():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,64,1024", help="sizes in MiB (default 1,64,1024)")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size (at least)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size first")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = [float(s) for s in args.sizes.split(",")]
    if rank == 0:
        print(
            f"torch={torch.__version__} processes={n} threads={torch.get_num_threads()} "
            f"sizes_mib={sizes} (median of >= {args.iters} calls after {args.warmup} warm-up)"
        )
    for size in sizes:
        values = int(size * 1024 * 1024 / 4)
        buffer = torch.arange(values, dtype=torch.float32).remainder_(1024)
        reset_peak_memory()
        before = peak_memory_mib()
        for _ in range(args.warmup):
            dist.all_reduce(buffer)
        times = []
        started = time.perf_counter()
        while True:
            # Rank 0 decides when to stop, so that every process makes as many calls.
            more = torch.tensor([len(times) < args.iters or time.perf_counter() - started < 1.0])
            dist.broadcast(more, src=0)
            if not more.item():
                break
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            times.append(time.perf_counter() - start)
        added = peak_memory_mib() - before
        worst = torch.tensor([statistics.median(times), added], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            seconds, added = worst.tolist()
            algbw = values * 4 / seconds / 1e9
            busbw = algbw * 2 * (n - 1) / n
            print(
                f"size_mib={size:g} calls={len(times)} median_ms={seconds * 1e3:.3f} "
                f"algbw_gbps={algbw:.2f} busbw_gbps={busbw:.2f} peak_rss_added_mib={added:.1f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
