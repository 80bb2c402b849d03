"""The machine's roofline at the model's shapes, and model-FLOPs utilisation (MFU) of prefill and decode.

* ``matmul_peak``: GFLOP/s of ``[M, in] x [in, out]`` for each of the model's linear shapes (fused qkv,
  o, fused gate_up, down, LM head) at each ``M`` given, in the mode's weights (its dtype or GGUF
  blocks), by torch's ``F.linear`` (float weights) and by the engine's own ``linear`` (the native
  kernel where it takes the rows); the measured peak is the best of them all (the "compute roof" this
  machine reaches on these shapes).
* ``read_bandwidth``: bytes/s of summing a float32 tensor far larger than the caches (the "memory
  roof"), on torch's threads.
* ``decode_roofline``: for one decode step of ``batch`` requests at ``context``, the bytes it must read
  (every weight once, every KV position once) over the measured bandwidth and its FLOPs over the
  measured peak; the larger is the step's floor on this machine, reported beside the step measured by
  ``decode_probe`` and their ratio.  ``roofline`` gives it at the fixed batches of the issue's targets
  (batch 1 at a 512-token context, batch 32 at 300) and ``bench run`` one per mechserve run, at the
  run's typical decode batch and context, with the run's own decode steps at that batch beside it
  (``run_steps``).
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


def _matrices(model: Any) -> dict[str, Any]:
    w = model.layers[0]
    return {"qkv": w.qkv, "o": w.o, "gate_up": w.gate_up, "down": w.down, "lm_head": model.lm_head}


def matmul_peak(model: Any, rows: Sequence[int], repeats: int = 3) -> dict[str, Any]:
    """GFLOP/s of each linear shape at each row count, by torch (``gflops_by_rows``: float weights of the
    model's dtype) and by the engine's ``linear`` on the model's own matrices (``engine_gflops_by_rows``);
    ``peak_gflops`` is the best of both."""
    from mechserve.model.linear import linear

    dtype = model.dtype
    table: dict[str, dict[str, float]] = {}
    engine: dict[str, dict[str, float]] = {}
    best = 0.0
    for m in rows:
        row: dict[str, float] = {}
        mine: dict[str, float] = {}
        for name, matrix in _matrices(model).items():
            fan_out, fan_in = matrix.shape
            x = torch.randn(m, fan_in).to(dtype)
            w = torch.randn(fan_out, fan_in).to(dtype)
            flops = 2 * m * fan_in * fan_out
            row[name] = flops / _median_time(partial(F.linear, x, w), repeats) / 1e9
            mine[name] = flops / _median_time(partial(linear, x, matrix), repeats) / 1e9
            best = max(best, row[name], mine[name])
        table[str(m)] = row
        engine[str(m)] = mine
    return {
        "gflops_by_rows": table,
        "engine_gflops_by_rows": engine,
        "peak_gflops": best,
        "dtype": str(dtype).removeprefix("torch."),
    }


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of the best of ``repeats`` sums of a float32 tensor of ``megabytes`` (far larger
    than the caches), on torch's threads: the rate at which this machine streams memory."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    best = min(_median_time(x.sum, 1, warmup=0) for _ in range(repeats))
    return x.numel() * 4 / best


def decode_cost(model: Any, batch: int, context: int, kv_element_size: int | None = None) -> dict[str, int]:
    """What one decode step of ``batch`` requests at ``context`` positions must do: ``bytes`` read (every
    weight matrix once, plus K and V of every position ``0 .. context`` of every request) and ``flops``
    (matrices and LM head per row, attention per (query, key) pair)."""
    a = model.arch
    size = kv_element_size or torch.empty(0, dtype=model.dtype).element_size()
    kv_bytes = 2 * a.num_layers * batch * (context + 1) * a.num_kv_heads * a.head_dim * size
    flops = 2 * linear_params(model) * batch + _attn_flops(model, batch * (context + 1))
    flops += 2 * a.hidden_size * a.vocab_size * batch
    return {"bytes": weight_read_bytes(model) + kv_bytes, "flops": flops}


def step_floor(cost: dict[str, int], bandwidth: float, peak_gflops: float) -> dict[str, Any]:
    """The floor of a step that must read ``cost["bytes"]`` and compute ``cost["flops"]`` on a machine that
    reads ``bandwidth`` bytes/s and multiplies at ``peak_gflops`` GFLOP/s: ``memory_s``, ``compute_s``,
    ``roofline_s`` (the larger, seconds) and ``bound`` (``"memory"`` or ``"compute"``).  Raises
    ``ValueError`` unless both rates are positive."""
    if not (bandwidth > 0 and peak_gflops > 0):
        raise ValueError(f"a roofline needs a positive bandwidth and peak, got {bandwidth} B/s, {peak_gflops} GFLOP/s")
    memory_s = cost["bytes"] / bandwidth
    compute_s = cost["flops"] / (peak_gflops * 1e9)
    return {
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "peak_gflops": peak_gflops,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "roofline_s": max(memory_s, compute_s),
        "bound": "memory" if memory_s >= compute_s else "compute",
    }


def decode_roofline(
    model: Any, batch: int, context: int, bandwidth: float, peak_gflops: float, repeats: int = 3
) -> dict[str, Any]:
    """One decode step of ``batch`` requests at ``context``: its floor ``max(bytes / bandwidth, flops / peak)``
    (``bandwidth`` in bytes/s, ``peak_gflops`` in GFLOP/s; ``step_floor``) beside the step ``decode_probe``
    measures (``measured_s``), and their ratio (``measured_over_roofline``: 1.0 is the machine's limit).
    ``bytes`` and ``flops`` are the probe's (``decode_cost`` with the KV cache's element size)."""
    measured = decode_probe(model, batch, context, peak_gflops, repeats)
    cost = {"bytes": measured["bytes_read"], "flops": measured["flops"]}
    floor = step_floor(cost, bandwidth, peak_gflops)
    return {
        "batch": batch,
        "context": context,
        **cost,
        **floor,
        "measured_s": measured["seconds"],
        "measured_over_roofline": measured["seconds"] / floor["roofline_s"],
    }


def roofline_line(r: dict[str, Any]) -> str:
    """``decode_roofline``'s result as one line of text (with the run's own steps when ``run_steps`` is there, their
    time in the forward when ``run_forward_s`` is, and the machine's other load when ``other_cores`` is)."""
    line = (
        f"decode step at batch {r['batch']}, context {r['context']}: {r['bytes'] / 1e6:.0f} MB / "
        f"{r['bandwidth_gb_per_s']:.1f} GB/s = {r['memory_s'] * 1e3:.1f} ms, {r['flops'] / 1e9:.2f} GFLOP / "
        f"{r['peak_gflops']:.0f} GFLOP/s = {r['compute_s'] * 1e3:.1f} ms; roofline {r['roofline_s'] * 1e3:.1f} ms "
        f"({r['bound']}-bound), measured {r['measured_s'] * 1e3:.1f} ms = {r['measured_over_roofline']:.2f}x"
    )
    if r.get("run_steps"):
        line += (
            f"; the run's {r['run_steps']} decode steps at batch {r['batch']}: median {r['run_step_s'] * 1e3:.1f} ms"
            f" = {r['run_over_roofline']:.2f}x"
        )
        if r.get("run_forward_s") is not None:
            line += f" (forward {r['run_forward_s'] * 1e3:.1f} ms)"
        if r.get("other_cores") is not None:
            line += f"; other processes used {r['other_cores']:.2f} cores during the run"
    elif "run_steps" in r:
        line += f"; the run had no pure decode step at batch {r['batch']}"
    return line


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
    """One decode step of ``batch`` requests each at ``context`` positions (KV filled with noise): median
    seconds, tokens/s, GFLOP/s, MFU, and the bytes it must read (``decode_cost``) per second."""
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
    cost = decode_cost(model, batch, context, cache.k.element_size())
    flops, read = cost["flops"], cost["bytes"]
    gflops = flops / seconds / 1e9
    return {
        "batch": batch,
        "context": context,
        "seconds": seconds,
        "tokens_per_s": batch / seconds,
        "flops": flops,
        "gflops": gflops,
        "mfu": gflops / peak_gflops if peak_gflops else None,
        "bytes_read": read,
        "read_gb_per_s": read / seconds / 1e9,
    }


def roofline(
    model: Any,
    *,
    prompt_len: int,
    decode_batch: int,
    decode_context: int,
    repeats: int = 3,
    steps: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """Matmul peak at the prefill and decode row counts and the read bandwidth, then the prefill and decode
    probes against them, and ``decode_roofline`` at each (batch, context) of ``steps`` (``decode_rooflines``)."""
    peak = matmul_peak(model, sorted({decode_batch, prompt_len, *(b for b, _ in steps)}), repeats)
    bandwidth = read_bandwidth()
    return {
        "matmul": peak,
        "read_bandwidth_gb_per_s": bandwidth / 1e9,
        "prefill": prefill_probe(model, prompt_len, peak["peak_gflops"], repeats),
        "decode": decode_probe(model, decode_batch, decode_context, peak["peak_gflops"], repeats),
        "decode_rooflines": [decode_roofline(model, b, c, bandwidth, peak["peak_gflops"], repeats) for b, c in steps],
    }
