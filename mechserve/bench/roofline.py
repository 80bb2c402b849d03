"""The machine's roofline at the model's shapes, and model-FLOPs utilisation (MFU) of prefill and decode.

* ``matmul_peak``: ``F.linear`` GFLOP/s of ``[M, in] x [in, out]`` for each of the model's linear
  shapes (fused qkv, o, fused gate_up, down, LM head) at each ``M`` given, in the mode's dtype; the
  measured peak is the best of them (the "compute roof" this machine reaches on these shapes).
* ``prefill_probe``: one forward over a ``prompt_len``-token prompt (logits for its last row, as a
  sampling prefill computes); ``decode_probe``: one decode step of ``batch`` requests at context
  ``context`` on a filled paged KV cache (all rows sample).  Each reports the median of ``repeats``
  timed runs, tokens/s, achieved GFLOP/s, MFU (achieved / measured peak) and, for decode, the bytes
  it must read (weights once + every KV position) per second.

FLOPs: a multiply-add is 2; linear layers ``2 * params`` per row, attention ``4 * heads * head_dim``
per layer per (query, key) pair kept by the causal mask, LM head ``2 * hidden * vocab`` per sampled row.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """The model's distinct linear shapes as name -> (in_features, out_features)."""
    w = model.layers[0]
    return {
        "qkv": (w.qkv.shape[1], w.qkv.shape[0]),
        "o": (w.o.shape[1], w.o.shape[0]),
        "gate_up": (w.gate_up.shape[1], w.gate_up.shape[0]),
        "down": (w.down.shape[1], w.down.shape[0]),
        "lm_head": (model.lm_head.shape[1], model.lm_head.shape[0]),
    }


def linear_params(model: Any) -> int:
    """Parameters of the decoder's matrices (every layer's qkv, o, gate_up, down)."""
    return sum(w.qkv.numel() + w.o.numel() + w.gate_up.numel() + w.down.numel() for w in model.layers)


def weight_read_bytes(model: Any) -> int:
    """Bytes one decode step reads for the weight matrices (each layer's four and the LM head):
    float tensors at their element size, GGUF blocks at theirs (``QuantizedMatrix.nbytes``)."""

    def size(m: Any) -> int:
        return int(m.nbytes) if hasattr(m, "blocks") else m.numel() * m.element_size()

    return sum(size(w.qkv) + size(w.o) + size(w.gate_up) + size(w.down) for w in model.layers) + size(model.lm_head)


def matmul_peak(model: Any, rows: Sequence[int], repeats: int = 3) -> dict[str, Any]:
    """GFLOP/s of each linear shape at each row count (model's dtype); ``peak_gflops`` is the best."""
    dtype = model.dtype
    table: dict[str, dict[str, float]] = {}
    best = 0.0
    for m in rows:
        row: dict[str, float] = {}
        for name, (fan_in, fan_out) in linear_shapes(model).items():
            x = torch.randn(m, fan_in).to(dtype)
            w = torch.randn(fan_out, fan_in).to(dtype)
            seconds = _median_time(partial(F.linear, x, w), repeats)
            row[name] = 2 * m * fan_in * fan_out / seconds / 1e9
            best = max(best, row[name])
        table[str(m)] = row
    return {"gflops_by_rows": table, "peak_gflops": best, "dtype": str(dtype).removeprefix("torch.")}


def _attn_flops(model: Any, pairs: int) -> int:
    a = model.arch
    return 4 * a.num_heads * a.head_dim * a.num_layers * pairs


def prefill_probe(
    model: Any, prompt_len: int, peak_gflops: float, repeats: int = 3, page_size: int = 16
) -> dict[str, Any]:
    """One ``prompt_len``-token prefill forward: median seconds, tokens/s, GFLOP/s and MFU."""
    from mechserve.kv.paged import Span, build_attention_batch

    pages = -(-prompt_len // page_size)
    cache = model.new_cache(pages + 1, page_size)
    table = list(range(1, pages + 1))
    slots = [table[p // page_size] * page_size + p % page_size for p in range(prompt_len)]
    g = model.arch.num_heads // model.arch.num_kv_heads
    batch = build_attention_batch([Span(0, 0, prompt_len, table)], slots, page_size, g, model.distinct_sliding_windows)
    ids = torch.randint(100, model.arch.vocab_size, (prompt_len,))
    pos = torch.arange(prompt_len)
    last = torch.tensor([prompt_len - 1])
    seconds = _median_time(lambda: model.forward(ids, pos, cache, batch, last), repeats)
    a = model.arch
    flops = 2 * linear_params(model) * prompt_len + _attn_flops(model, prompt_len * (prompt_len + 1) // 2)
    flops += 2 * a.hidden_size * a.vocab_size
    gflops = flops / seconds / 1e9
    return {
        "prompt_len": prompt_len,
        "seconds": seconds,
        "tokens_per_s": prompt_len / seconds,
        "gflops": gflops,
        "mfu": gflops / peak_gflops if peak_gflops else None,
    }


def decode_probe(
    model: Any, batch: int, context: int, peak_gflops: float, repeats: int = 3, page_size: int = 16
) -> dict[str, Any]:
    """One decode step of ``batch`` requests each at ``context`` positions (KV filled with noise)."""
    from mechserve.kv.paged import Span, build_attention_batch

    per = -(-(context + 1) // page_size)
    cache = model.new_cache(batch * per + 1, page_size)
    cache.k.normal_()
    cache.v.normal_()
    spans, slots = [], []
    for b in range(batch):
        table = list(range(1 + b * per, 1 + (b + 1) * per))
        spans.append(Span(b, context, 1, table))
        slots.append(table[context // page_size] * page_size + context % page_size)
    g = model.arch.num_heads // model.arch.num_kv_heads
    attn = build_attention_batch(spans, slots, page_size, g, model.distinct_sliding_windows)
    ids = torch.randint(100, model.arch.vocab_size, (batch,))
    pos = torch.full((batch,), context, dtype=torch.int64)
    rows = torch.arange(batch)
    seconds = _median_time(lambda: model.forward(ids, pos, cache, attn, rows), repeats)
    a = model.arch
    flops = 2 * linear_params(model) * batch + _attn_flops(model, batch * (context + 1))
    flops += 2 * a.hidden_size * a.vocab_size * batch
    weight_bytes = weight_read_bytes(model)
    kv_bytes = 2 * a.num_layers * batch * (context + 1) * a.num_kv_heads * a.head_dim * cache.k.element_size()
    gflops = flops / seconds / 1e9
    return {
        "batch": batch,
        "context": context,
        "seconds": seconds,
        "tokens_per_s": batch / seconds,
        "gflops": gflops,
        "mfu": gflops / peak_gflops if peak_gflops else None,
        "bytes_read": weight_bytes + kv_bytes,
        "read_gb_per_s": (weight_bytes + kv_bytes) / seconds / 1e9,
    }


def roofline(
    model: Any, *, prompt_len: int, decode_batch: int, decode_context: int, repeats: int = 3
) -> dict[str, Any]:
    """Matmul peak at the prefill and decode row counts, then the prefill and decode probes against it."""
    peak = matmul_peak(model, sorted({decode_batch, prompt_len}), repeats)
    return {
        "matmul": peak,
        "prefill": prefill_probe(model, prompt_len, peak["peak_gflops"], repeats),
        "decode": decode_probe(model, decode_batch, decode_context, peak["peak_gflops"], repeats),
    }
