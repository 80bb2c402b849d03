# decode-step forward time per mode, interleaved (CPU time at one thread): docs/benchmarks.md, "Against llama.cpp".
# usage: decode_step_modes.py THREADS B... ; env VARIANTS=dtype[:quant],... ROUNDS CTX
import os, sys, time, torch
from mechserve.model.loader import load_model
from mechserve.kv.paged import Span, build_attention_batch

th = int(sys.argv[1])
torch.set_num_threads(th)
Bs = [int(b) for b in sys.argv[2:]] or [1, 8]
ctx = int(os.environ.get("CTX", "512"))


def setup(model, batch, context, ps=16):
    per = -(-(context + 1) // ps)
    cache = model.new_cache(batch * per + 1, ps)
    cache.k.normal_()
    cache.v.normal_()
    spans, slots = [], []
    for b in range(batch):
        t = list(range(1 + b * per, 1 + (b + 1) * per))
        spans.append(Span(b, context, 1, t))
        slots.append(t[context // ps] * ps + context % ps)
    g = model.arch.num_heads // model.arch.num_kv_heads
    attn = build_attention_batch(spans, slots, ps, g, model.distinct_sliding_windows)
    ids = torch.randint(100, model.arch.vocab_size, (batch,))
    pos = torch.full((batch,), context, dtype=torch.int64)
    return lambda: model.forward(ids, pos, cache, attn, torch.arange(batch))


models = {}
for v in os.environ.get("VARIANTS", "float32,bfloat16,bfloat16:q4_1,bfloat16:q8_0").split(","):
    dt, _, q = v.partition(":")
    models[v] = load_model("smollm2", dtype=getattr(torch, dt), tokenizer=False, quantization=q or None).model
clk = time.thread_time if th == 1 else time.perf_counter
for B in Bs:
    fs = {v: setup(m, B, ctx) for v, m in models.items()}
    ts = {}
    for r in range(int(os.environ.get("ROUNDS", "10"))):
        for v, f in fs.items():
            t = clk()
            f()
            ts.setdefault(v, []).append(clk() - t)
    print(
        f"B={B} th{th} ctx{ctx} "
        + "  ".join(f"{v}: min {min(x) * 1e3:.1f} med {sorted(x)[len(x) // 2] * 1e3:.1f}" for v, x in ts.items()),
        flush=True,
    )
