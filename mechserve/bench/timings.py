"""Benchmark metrics with vLLM's names, computed from per-request timestamps and from an m13 trace.

Standard library only (the harness's CLI imports it before torch).

Per request (all times in seconds from one ``time.perf_counter()`` clock)::

    arrival ─────── first token ──── token 2 ── ... ── last token
    |<──── TTFT ────>|<──────── decode: (n_out - 1) tokens ──────>|
    |<─────────────────────────── E2E ───────────────────────────>|
    TPOT = (E2E - TTFT) / (n_out - 1)          (requests with n_out >= 2)
    ITL  = gaps between successive *deliveries* (steps that appended tokens); tokens delivered
           together (accepted speculative guesses) form one delivery, as one streamed chunk in
           vLLM's serving benchmark.

Throughputs divide by the run's wall time (first arrival to last finish): ``request_throughput``
(requests/s), ``output_throughput`` (wanted output tokens/s), ``total_token_throughput`` (prompt +
output tokens/s).  Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.bench.serve_client import percentile

__all__ = ["RequestTiming", "latency_summary", "percentile", "trace_stats", "turn_summary", "useful_flops"]


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request as a benchmark sees it.

    ``arrival``: submission time (s); ``token_times``: when each wanted output token was delivered
    (s, non-decreasing, one entry per token); ``prompt_len``: prompt tokens.
    """

    prompt_len: int
    arrival: float
    token_times: tuple[float, ...]

    @property
    def num_output(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def itl(self) -> list[float]:
        """Gaps between successive distinct delivery times (see the module docstring)."""
        deliveries = sorted(set(self.token_times))
        return [b - a for a, b in itertools.pairwise(deliveries)]


def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    """``mean_/p50_/p99_<name>_ms`` of ``values`` (seconds), None when there are none."""
    if not values:
        return {f"mean_{name}_ms": None, f"p50_{name}_ms": None, f"p99_{name}_ms": None}
    return {
        f"mean_{name}_ms": 1000 * math.fsum(values) / len(values),
        f"p50_{name}_ms": 1000 * percentile(values, 50),
        f"p99_{name}_ms": 1000 * percentile(values, 99),
    }


def latency_summary(timings: Sequence[RequestTiming], duration: float | None = None) -> dict[str, Any]:
    """vLLM-named throughput and latency figures of one run.

    ``duration``: the run's wall time in seconds (default: first arrival to last delivery).  Raises
    ``ValueError`` for an empty run or a non-positive duration.
    """
    if not timings:
        raise ValueError("no requests to summarise")
    if duration is None:
        ends = [t.token_times[-1] for t in timings if t.token_times]
        duration = (max(ends) if ends else 0.0) - min(t.arrival for t in timings)
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    prompt = sum(t.prompt_len for t in timings)
    output = sum(t.num_output for t in timings)
    report: dict[str, Any] = {
        "completed": len(timings),
        "duration": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(timings) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
    }
    report.update(_stats("ttft", [v for t in timings if (v := t.ttft) is not None]))
    report.update(_stats("tpot", [v for t in timings if (v := t.tpot) is not None]))
    report.update(_stats("itl", [gap for t in timings for gap in t.itl()]))
    report.update(_stats("e2el", [v for t in timings if (v := t.e2e) is not None]))
    return report


def trace_stats(records: Iterable[Any], prompt_tokens: int | None = None) -> dict[str, Any]:
    """Engine-side figures of an m13 trace (``StepRecord``s).

    ``steps``; ``tokens_per_step`` (mean of ``sum(executed)``) and its per-step series
    ``tokens_per_step_series``; ``decode_rows_series`` (per step, the requests it ran a decode window
    for) and ``decode_context_mean`` (the mean position a decode window's first row computes: its
    context, counting reused positions); ``computed_tokens``; ``decode_tokens`` (tokens appended, from
    ``tokens``); ``prefill_tokens_computed`` (computed minus decode-window tokens: prompt positions
    actually run); ``preemptions``; ``reused_tokens`` and ``prefix_hit_rate`` (reused tokens over
    ``prompt_tokens``, when given); ``drafted``/``accepted`` guesses and ``acceptance_rate``
    (None without speculation).
    """
    steps = 0
    series: list[int] = []
    preemptions = reused = drafted = accepted = appended = window_tokens = 0
    decoding: set[str] = set()  # requests whose prompt is done: their next slice is a decode window
    position: dict[str, int] = {}  # positions each request has computed or reused so far
    decode_rows: list[int] = []
    contexts: list[int] = []
    for rec in records:
        steps += 1
        series.append(sum(rec.executed.values()))
        for rid in rec.preempted:
            position[rid] = 0  # recomputed from its start (or from what the prefix cache gives back)
        for rid, n in rec.reused.items():
            position[rid] = position.get(rid, 0) + n
        windows = [rid for rid in rec.executed if rid in decoding]
        decode_rows.append(len(windows))
        contexts += [position.get(rid, 0) for rid in windows]
        for rid, n in rec.executed.items():
            position[rid] = position.get(rid, 0) + n
        preemptions += len(rec.preempted)
        reused += sum(rec.reused.values())
        drafted += sum(rec.drafted.values())
        accepted += sum(rec.accepted.values())
        appended += sum(len(v) for v in rec.tokens.values())
        window_tokens += sum(n for rid, n in rec.executed.items() if rid in decoding)
        decoding.update(rec.tokens)
        decoding.difference_update(rec.preempted, rec.finished)
    computed = sum(series)
    return {
        "steps": steps,
        "tokens_per_step": computed / steps if steps else 0.0,
        "tokens_per_step_series": series,
        "decode_rows_series": decode_rows,
        "decode_context_mean": sum(contexts) / len(contexts) if contexts else None,
        "computed_tokens": computed,
        "output_tokens_appended": appended,
        "prefill_tokens_computed": computed - window_tokens,
        "preemptions": preemptions,
        "reused_tokens": reused,
        "prefix_hit_rate": (reused / prompt_tokens) if prompt_tokens else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": (accepted / drafted) if drafted else None,
    }


def useful_flops(
    prompt_len: int, output_len: int, linear_params: int, attn_width: int, layers: int, lm_head: int
) -> int:
    """Model FLOPs of one request's wanted work (multiply-add = 2 FLOPs).

    Every position ``p`` in ``0 .. prompt_len + output_len - 2`` is computed once: ``2 *
    linear_params`` (the decoder's matrices) plus attention ``4 * attn_width * (p + 1)`` per layer
    (scores and weighted values over ``p + 1`` keys; ``attn_width`` = heads x head_dim); every output
    token costs one LM-head row, ``2 * lm_head`` (hidden x vocab).  The last output token is sampled,
    never fed back, so it adds no decoder pass.
    """
    positions = max(prompt_len + output_len - 1, 0)
    attn = 4 * attn_width * layers * positions * (positions + 1) // 2
    return 2 * linear_params * positions + attn + 2 * lm_head * output_len


def turn_summary(turns: Sequence[Any], page_size: int) -> list[dict[str, Any]]:
    """Per turn number (1, 2, ...), over the conversations: one dict of the multiturn workload's figures.

    ``turns`` are ``runners.TurnResult``s.  Each dict: ``turn``, ``conversations``, mean
    ``prompt_tokens``, ``new_tokens`` (tokens the previous turn never computed; None at turn 1),
    ``prefill_computed`` and ``reused``; ``prefill_computed_total``; ``retokenized`` (the share of
    prompts that repeat the previous prompt and answer ids exactly); ``excess_max``, the most prompt
    positions computed beyond the new ones among those prompts, and ``within_one_block``, whether that
    is below ``page_size`` for each of them (the issue's target: only the new message and at most one
    partial block); ``p50_ttft_ms``/``p99_ttft_ms`` (the engine's clock) and ``p50_ttft_cpu_ms``/
    ``p99_ttft_cpu_ms`` (CPU time).
    """
    out: list[dict[str, Any]] = []
    for t in sorted({r.turn for r in turns}):
        rows = [r for r in turns if r.turn == t]
        matched = [r for r in rows if r.retokenized]
        excess = [r.prefill_computed - r.new_tokens for r in matched]
        ttft = [r.ttft for r in rows]
        cpu = [r.ttft_cpu for r in rows]
        out.append(
            {
                "turn": t,
                "conversations": len(rows),
                "prompt_tokens": math.fsum(r.prompt_len for r in rows) / len(rows),
                "new_tokens": None if t == 1 else math.fsum(r.new_tokens for r in rows) / len(rows),
                "prefill_computed": math.fsum(r.prefill_computed for r in rows) / len(rows),
                "prefill_computed_total": sum(r.prefill_computed for r in rows),
                "reused": math.fsum(r.reused for r in rows) / len(rows),
                "retokenized": None if t == 1 else len(matched) / len(rows),
                "excess_max": max(excess) if excess else None,
                "within_one_block": None if t == 1 else bool(matched) and all(e < page_size for e in excess),
                "p50_ttft_ms": 1000 * percentile(ttft, 50),
                "p99_ttft_ms": 1000 * percentile(ttft, 99),
                "p50_ttft_cpu_ms": 1000 * percentile(cpu, 50),
                "p99_ttft_cpu_ms": 1000 * percentile(cpu, 99),
            }
        )
    return out
