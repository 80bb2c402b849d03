"""Speed of the native few-row product on GGUF blocks (Q4_1, Q8_0) at SmolLM2-135M's shapes.

    PYTHONPATH=$PWD python docs/scripts/quant_kernel_speed.py [ROWS=1,8] [THREADS=2] [REPS=20] [--cpu]

For each format, activation dtype (float32, bfloat16) and row count it times
``mechserve.model.linear.native_linear`` on random blocks of each layer shape (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) and the Q8_0 LM head (49152x576), and prints the median wall time
and the GB/s of blocks read (``blocks.numel()`` bytes / time).  A "step" runs the four products of 30
layers of distinct weights in order, as a decode step reads them (66 MB of Q4_1, more than the L3
cache); each shape's time is summed over the 30 layers and the median over REPS steps is reported,
the ``layers`` figure being their total.  With ``--cpu`` it also
reports 1-thread CPU time (``time.thread_time``), useful when the machine is loaded.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from mechserve.model.linear import native_linear
from mechserve.model.quantized import quantize

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)

args = [a for a in sys.argv[1:] if not a.startswith("--")]
rows = [int(r) for r in (args[0] if args else "1,8").split(",")]
threads = int(args[1]) if len(args) > 1 else 2
reps = int(args[2]) if len(args) > 2 else 20
cpu = "--cpu" in sys.argv
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)


def timed(x, w, n):
    for _ in range(3):
        native_linear(x, w)
    wall, cpu_t = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.thread_time()
        native_linear(x, w)
        wall.append(time.perf_counter() - t)
        cpu_t.append(time.thread_time() - c)
    return statistics.median(wall), statistics.median(cpu_t)


def step(kind, xs, n):
    """Median over n steps of each shape's time summed over the 30 layers (distinct weights, in order)."""
    per = {name: [] for name in LAYER}
    for _ in range(n + 2):
        for name in LAYER:
            per[name].append(0.0)
        for layer in weights[kind]:
            for name, w in layer.items():
                t, c = time.perf_counter(), time.thread_time()
                native_linear(xs[name], w)
                per[name][-1] += (time.thread_time() - c) if cpu else (time.perf_counter() - t)
    return {name: statistics.median(v[2:]) for name, v in per.items()}


# 30 layers of distinct weights, as a decode step reads them (66 MB of Q4_1: more than the L3 holds).
weights = {
    kind: [
        {name: quantize(torch.randn(n, k, generator=g) * 0.05, kind) for name, (n, k) in LAYER.items()}
        for _ in range(30)
    ]
    for kind in ("q4_1", "q8_0")
}
head = quantize(torch.randn(*HEAD, generator=g) * 0.05, "q8_0")

for kind in ("q4_1", "q8_0"):
    for dtype in (torch.float32, torch.bfloat16):
        for m in rows:
            xs = {name: torch.randn(m, k, generator=g).to(dtype) for name, (n, k) in LAYER.items()}
            per = step(kind, xs, reps)
            total_t = sum(per.values())
            total_b = sum(layer[name].nbytes for layer in weights[kind] for name in LAYER)
            line = [f"{name} {30 * weights[kind][0][name].nbytes / t / 1e9:5.1f}" for name, t in per.items()]
            print(
                f"{kind} {str(dtype)[6:]:8s} M={m:<2d} layers {total_t * 1e3:6.2f} ms "
                f"{total_b / total_t / 1e9:5.1f} GB/s  ({', '.join(line)} GB/s)",
                flush=True,
            )
            if kind == "q8_0":
                x = torch.randn(m, HEAD[1], generator=g).to(dtype)
                wall, c = timed(x, head, max(10, reps))
                t = c if cpu else wall
                print(f"{'':18s}head   {t * 1e3:6.2f} ms {head.nbytes / t / 1e9:5.1f} GB/s", flush=True)
