"""Where a decode step's time goes, per mode: the step, the layers' dense blocks (and the GB/s at which
they read their weights), the LM head, attention, and the rest (embedding, RoPE tables, Python).

    PYTHONPATH=$PWD python docs/scripts/profile_decode.py exact,fast,q4_1,q8_0 [BATCH=1] [CONTEXT=512] [THREADS] [unfused] [rows=R]

It prefills BATCH sequences of CONTEXT random ids, then times 32 decode steps (after 8 warm-up steps)
of ``LlamaModel.forward``, each of R rows per sequence (``rows=R``, default 1: R > 1 is a speculative
window's verification, R positions of one sequence in one step) with the blocks, ``linear`` and ``paged_attention`` wrapped in timers.  With
the native blocks (model/fused.py) a layer's products and its norms, RoPE, SiLU and residuals are two
calls, timed together as "layers' blocks"; ``unfused`` runs the torch blocks instead, whose products
alone are timed ("layers' matmuls") and whose elementwise ops fall in "rest".  The wrappers add a few
microseconds per call (about 0.5 ms per step over 30 layers).  Used for docs/benchmarks.md.
"""

import statistics
import sys
import time

import torch

import mechserve.model.llama as llama
from mechserve.bench.runners import MODES
from mechserve.engine.executors import configure_threads
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model import fused
from mechserve.model.loader import load_model
from mechserve.model.quantized import QuantizedMatrix

modes = sys.argv[1].split(",")
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 512
configure_threads()
if len(sys.argv) > 4:
    torch.set_num_threads(int(sys.argv[4]))  # as bench run --threads
if "unfused" in sys.argv[5:]:
    fused.rows_apply = lambda x, w: False
R = next((int(a.split("=", 1)[1]) for a in sys.argv[5:] if a.startswith("rows=")), 1)
label = "layers' matmuls" if "unfused" in sys.argv[5:] else "layers' blocks"
spent = {"linear": 0.0, "lm_head": 0.0, "attention": 0.0}
read = {"linear": 0, "lm_head": 0}
real_linear, real_attention = llama.linear, llama.paged_attention
real_inputs, real_outputs = fused.attention_inputs, fused.attention_outputs


def weight_bytes(w):
    return w.blocks.numel() if isinstance(w, QuantizedMatrix) else w.numel() * w.element_size()


def timed_linear(x, w, b=None, out_dtype=None):
    t = time.perf_counter()
    y = real_linear(x, w, b, out_dtype)
    kind = "lm_head" if w.shape[0] > 40000 else "linear"  # the 49,152-row tied embedding
    spent[kind] += time.perf_counter() - t
    read[kind] += weight_bytes(w)
    return y


def timed_inputs(x, w, *args):
    t = time.perf_counter()
    y = real_inputs(x, w, *args)
    spent["linear"] += time.perf_counter() - t
    read["linear"] += weight_bytes(w.qkv)
    return y


def timed_outputs(x, attn, w, eps):
    t = time.perf_counter()
    y = real_outputs(x, attn, w, eps)
    spent["linear"] += time.perf_counter() - t
    read["linear"] += weight_bytes(w.o) + weight_bytes(w.gate_up) + weight_bytes(w.down)
    return y


def timed_attention(*args, **kwargs):
    t = time.perf_counter()
    real_attention(*args, **kwargs)
    spent["attention"] += time.perf_counter() - t


for mode in modes:
    dtype, quantization = MODES[mode]
    m = load_model("smollm2", dtype=dtype, quantization=quantization, tokenizer=False).model
    page, g = 16, m.arch.num_heads // m.arch.num_kv_heads
    per = -(-(ctx + 40 + R) // page)
    cache = m.new_cache(B * per, page)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(B)]

    def slot(b, p):
        return tables[b][p // page] * page + p % page

    steps = []
    with torch.inference_mode():
        for b in range(B):
            spans = [Span(0, 0, ctx, tables[b])]
            batch = build_attention_batch(spans, [slot(b, p) for p in range(ctx)], page, g, m.distinct_sliding_windows)
            m.forward(torch.randint(100, 40000, (ctx,)), torch.arange(ctx), cache, batch, None)
        llama.linear, llama.paged_attention = timed_linear, timed_attention
        fused.attention_inputs, fused.attention_outputs = timed_inputs, timed_outputs
        for s in range(40):
            pos = ctx + s
            spans = [Span(b * R, pos, R, tables[b]) for b in range(B)]
            slots = [slot(b, pos + r) for b in range(B) for r in range(R)]
            batch = build_attention_batch(spans, slots, page, g, m.distinct_sliding_windows)
            if s == 8:
                spent.update(dict.fromkeys(spent, 0.0))
                read.update(dict.fromkeys(read, 0))
            t = time.perf_counter()
            m.forward(torch.randint(100, 40000, (B * R,)), torch.arange(pos, pos + R).repeat(B), cache, batch, None)
            if s >= 8:
                steps.append(time.perf_counter() - t)
        llama.linear, llama.paged_attention = real_linear, real_attention
        fused.attention_inputs, fused.attention_outputs = real_inputs, real_outputs
    n, total = len(steps), sum(steps)
    lin, head, att = (spent[k] / n for k in ("linear", "lm_head", "attention"))
    print(
        f"{mode:5s} batch {B} x {R} rows context {ctx}: step p50 {statistics.median(steps) * 1e3:.1f} ms, "
        f"{label} {lin * 1e3:.1f} ms ({read['linear'] / n / 1e6:.0f} MB at {read['linear'] / n / lin / 1e9:.1f} GB/s), "
        f"LM head {head * 1e3:.1f} ms ({read['lm_head'] / n / 1e6:.0f} MB at {read['lm_head'] / n / head / 1e9:.1f} GB/s), "
        f"attention {att * 1e3:.1f} ms, rest {(total / n - lin - head - att) * 1e3:.1f} ms",
        flush=True,
    )
