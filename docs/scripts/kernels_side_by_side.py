"""The native kernels against torch's paths, side by side in one process, on SmolLM2's shapes.

    PYTHONPATH=$PWD python docs/scripts/kernels_side_by_side.py products exact,fast,q4_1,q8_0 1,4,32,64,512 [THREADS]
    PYTHONPATH=$PWD python docs/scripts/kernels_side_by_side.py attention f32,bf16 32:300:1,1:0:512 [THREADS]

``products``: the four matrices of 30 layers (random weights of SmolLM2's shapes on huge pages, as a
model's are) multiplied at each row count by ``linear.native_linear`` (the native kernel) and by torch
(``F.linear``; for GGUF blocks, dequantized a slice at a time then ``F.linear``), alternating, the best
of 5; with the weights' read rate and the arithmetic rate.  ``attention``: 30 layers of paged attention
for BATCH requests at CONTEXT positions computing QUERY tokens each (``32:300:1`` a decode step,
``1:0:512`` a 512-token prefill), native against ``MECHSERVE_ATTENTION=torch``'s gather and SDPA.
THREADS (default 2): torch's and the kernels' threads.  With one thread the times are CPU time (on a
shared machine the most stable figure); otherwise wall time.  Used for docs/benchmarks.md.
"""

import sys
import time

import torch
import torch.nn.functional as F

from mechserve.kv.paged import PagedKVCache, Span, build_attention_batch, paged_attention
from mechserve.model import linear as lin
from mechserve.model.quantized import QuantizedMatrix, quantize
from mechserve.native.memory import Arena

what, modes, sizes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, fused gate/up, down
LAYERS = 30


def best(fns: dict, repeats: int = 5) -> dict:
    out = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = clock()
            fn()
            out[name] = min(out[name], clock() - t)
    return out


def products(mode: str) -> None:
    dtype = torch.float32 if mode == "exact" else torch.bfloat16
    dense = [[torch.randn(n, k) / k**0.5 for n, k in SHAPES] for _ in range(LAYERS)]
    made = [[quantize(w, mode) if mode in ("q4_1", "q8_0") else w.to(dtype) for w in ws] for ws in dense]
    arena = Arena([w.blocks if isinstance(w, QuantizedMatrix) else w for ws in made for w in ws])
    layers = [
        [
            QuantizedMatrix(w.kind, arena.place(w.blocks), w.in_features)
            if isinstance(w, QuantizedMatrix)
            else arena.place(w)
            for w in ws
        ]
        for ws in made
    ]
    nbytes = sum(w.nbytes if isinstance(w, QuantizedMatrix) else w.numel() * w.element_size() for ws in layers for w in ws)
    for rows in map(int, sizes):
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}

        def torch_path(ws: list) -> None:
            for w in ws:
                x = xs[w.shape[1]]
                lin._quantized_gemm(x, w, None, dtype) if isinstance(w, QuantizedMatrix) else F.linear(x, w)

        t = best(
            {
                "native": lambda: [lin.native_linear(xs[w.shape[1]], w) for ws in layers for w in ws],
                "torch": lambda: [torch_path(ws) for ws in layers],
            }
        )
        flops = 2 * rows * sum(n * k for n, k in SHAPES) * LAYERS
        print(
            f"products {mode:5s} rows {rows:4d}: "
            + "  ".join(f"{k} {v * 1e3:8.2f} ms ({nbytes / v / 1e9:5.1f} GB/s, {flops / v / 1e9:4.0f} GFLOP/s)" for k, v in t.items())
            + f"  torch/native {t['torch'] / t['native']:.2f}x",
            flush=True,
        )


def attention(kind: str) -> None:
    dtype = torch.float32 if kind == "f32" else torch.bfloat16
    heads, kv, d, page = 9, 3, 64, 16
    for size in sizes:
        batch, context, query = map(int, size.split(":"))
        per = -(-(context + query) // page)
        cache = PagedKVCache(LAYERS, batch * per + 1, page, kv, d, dtype)
        cache.k.normal_()
        cache.v.normal_()
        spans, slots = [], []
        for b in range(batch):
            table = list(range(1 + b * per, 1 + (b + 1) * per))
            spans.append(Span(b * query, context, query, table))
            slots += [table[p // page] * page + p % page for p in range(context, context + query)]
        rows = batch * query
        q = torch.randn(rows, heads, d).to(dtype)
        k, v = torch.randn(rows, kv, d).to(dtype), torch.randn(rows, kv, d).to(dtype)
        out = torch.empty(rows, heads * d, dtype=dtype)
        batches = {
            name: build_attention_batch(spans, slots, page, heads // kv, (None,), native=name == "native")
            for name in ("native", "torch")
        }

        def run(name: str) -> None:
            for layer in range(LAYERS):
                paged_attention(q, k, v, cache, layer, batches[name], d**-0.5, None, out=out)

        t = best({name: (lambda n=name: run(n)) for name in batches}, repeats=3)
        kv_bytes = 2 * LAYERS * batch * (context + query) * kv * d * cache.k.element_size()
        print(
            f"attention {kind} batch {batch} context {context} query {query}: "
            + "  ".join(f"{n} {v * 1e3:8.2f} ms ({kv_bytes / v / 1e9:5.1f} GB/s of KV)" for n, v in t.items())
            + f"  torch/native {t['torch'] / t['native']:.2f}x",
            flush=True,
        )


for m in modes:
    (products if what == "products" else attention)(m)
