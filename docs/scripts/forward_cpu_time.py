"""One SmolLM2 forward timed alone, for comparing two checkouts back to back on a shared machine.

    PYTHONPATH=/path/to/checkout python docs/scripts/forward_cpu_time.py MODE prefill 512 [THREADS=1]
    PYTHONPATH=/path/to/checkout python docs/scripts/forward_cpu_time.py MODE decode 32,300 [THREADS=1]

``prefill N``: one N-token prompt from an empty cache, logits for its last row (as a sampling prefill);
``decode B,C``: one step of B requests at context C, the KV pages filled with noise, every row
sampling.  Prints the best of 7 runs, in CPU time with one thread (the steadiest figure on a busy
machine), in wall time with more.  Used for docs/benchmarks.md (main against a branch).
"""

import sys
import time

import torch

from mechserve.bench.runners import MODES
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model.loader import load_model

mode, what, size = sys.argv[1], sys.argv[2], sys.argv[3]
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
dtype, quantization = MODES[mode]
m = load_model("smollm2", dtype=dtype, quantization=quantization, tokenizer=False).model
page, g = 16, m.arch.num_heads // m.arch.num_kv_heads
if what == "prefill":
    n = int(size)
    table = list(range(1, n // page + 2))
    cache = m.new_cache(len(table) + 1, page)
    slots = [table[p // page] * page + p % page for p in range(n)]
    batch = build_attention_batch([Span(0, 0, n, table)], slots, page, g, m.distinct_sliding_windows)
    args = (torch.randint(100, 40000, (n,)), torch.arange(n), cache, batch, torch.tensor([n - 1]))
else:
    b, ctx = map(int, size.split(","))
    per = -(-(ctx + 1) // page)
    cache = m.new_cache(b * per + 1, page)
    cache.k.normal_()
    cache.v.normal_()
    spans, slots = [], []
    for i in range(b):
        table = list(range(1 + i * per, 1 + (i + 1) * per))
        spans.append(Span(i, ctx, 1, table))
        slots.append(table[ctx // page] * page + ctx % page)
    batch = build_attention_batch(spans, slots, page, g, m.distinct_sliding_windows)
    args = (torch.randint(100, 40000, (b,)), torch.full((b,), ctx), cache, batch, torch.arange(b))
best = float("inf")
for _ in range(7):
    t = clock()
    m.forward(*args)
    best = min(best, clock() - t)
print(f"{mode} {what} {size}: {best * 1e3:.1f} ms ({'CPU' if clock is time.process_time else 'wall'})")
