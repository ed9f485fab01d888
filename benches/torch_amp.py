"""PyTorch's own f32 vs `torch.autocast` training-step times for the model of
benches/gpu_step.rs, so that burn-accelerate's autocast speed-up can be compared with
PyTorch's on the same GPU in the same run (benches/gpu.sh runs both).

The model is `nn.TransformerEncoderLayer(d_model=1024, nhead=8, dim_feedforward=4096,
dropout=0, activation="gelu", batch_first=True)` (post-norm, as Burn's default), inputs
16 x 512 x 1024. A step is forward (under autocast, or not), the mean square of the output in
f32, backward, and the gradients dropped, as the Burn side does. f32 matmuls run in full f32
(PyTorch's default, `fp32_precision = "ieee"`), as Burn's do.

    python benches/torch_amp.py [--device cuda] [--size full|small] [--steps 50]
"""

import argparse
import os
import statistics
import time

import torch
from torch import nn

SHAPES = {
    "full": dict(d_model=1024, heads=8, d_ff=4096, batch=16, seq=512),
    "small": dict(d_model=64, heads=8, d_ff=256, batch=2, seq=16),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(layer, x, dtype, steps, warmup):
    """Median seconds per step over `steps` timed steps, after `warmup` untimed ones."""
    device = x.device

    def step():
        with torch.autocast(device_type=device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            out = layer(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        layer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default=os.environ.get("GPU_BENCH_SIZE", "full"),
                        choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    device = torch.device(args.device)
    s = SHAPES[args.size]
    torch.manual_seed(7)
    layer = nn.TransformerEncoderLayer(
        d_model=s["d_model"], nhead=s["heads"], dim_feedforward=s["d_ff"], dropout=0.0,
        activation="gelu", batch_first=True, norm_first=False, layer_norm_eps=1e-5,
    ).to(device)
    x = torch.randn(s["batch"], s["seq"], s["d_model"], device=device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}, size {args.size}, "
          f"f32 matmul precision {torch.backends.cuda.matmul.fp32_precision}")
    f32 = time_steps(layer, x, None, args.steps, args.warmup)
    print(f"torch f32            {f32 * 1e3:9.3f} ms/step")
    for label, dtype in [("bf16", torch.bfloat16), ("f16", torch.float16)]:
        t = time_steps(layer, x, dtype, args.steps, args.warmup)
        print(f"torch {label} autocast   {t * 1e3:9.3f} ms/step   speed-up {f32 / t:.2f}x")


if __name__ == "__main__":
    main()
