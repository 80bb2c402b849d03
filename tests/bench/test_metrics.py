"""The benchmark metrics, computed from known timestamps and a known trace (no model, no timing)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mechserve.bench.timings import RequestTiming, latency_summary, percentile, trace_stats, useful_flops
from mechserve.bench.workloads import make_workload
from mechserve.workload import build_engine, load_rung, load_workload


def test_request_timing_from_known_timestamps() -> None:
    t = RequestTiming(prompt_len=10, arrival=1.0, token_times=(2.0, 2.5, 2.5, 3.5))
    assert t.ttft == pytest.approx(1.0)
    assert t.e2e == pytest.approx(2.5)
    assert t.tpot == pytest.approx(0.5)  # (3.5 - 2.0) / 3
    assert t.itl() == pytest.approx([0.5, 1.0])  # the two tokens delivered together are one delivery
    assert RequestTiming(3, 0.0, (1.0,)).tpot is None
    assert RequestTiming(3, 0.0, ()).ttft is None


def test_latency_summary_uses_vllm_names_and_known_values() -> None:
    timings = [RequestTiming(10, 0.0, (1.0, 2.0, 3.0)), RequestTiming(20, 0.0, (2.0, 4.0))]
    m = latency_summary(timings)
    assert m["duration"] == pytest.approx(4.0)
    assert m["completed"] == 2 and m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.25)
    assert m["total_token_throughput"] == pytest.approx(35 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(1500.0)
    assert m["p50_ttft_ms"] == pytest.approx(1500.0)
    assert m["p99_ttft_ms"] == pytest.approx(1000 * (1.0 + 0.99))
    assert m["mean_tpot_ms"] == pytest.approx(1500.0)  # (1.0 + 2.0) / 2
    assert m["mean_itl_ms"] == pytest.approx(1000 * 4.0 / 3)  # gaps 1, 1, 2
    assert m["p50_itl_ms"] == pytest.approx(1000.0)
    assert m["mean_e2el_ms"] == pytest.approx(3500.0)
    assert latency_summary(timings, duration=8.0)["output_throughput"] == pytest.approx(5 / 8)
    with pytest.raises(ValueError):
        latency_summary([])
    with pytest.raises(ValueError):
        latency_summary(timings, duration=0.0)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def _rec(executed, tokens=None, drafted=None, accepted=None, reused=None, preempted=(), finished=()):
    return SimpleNamespace(
        executed=executed,
        tokens=tokens or {},
        drafted=drafted or {},
        accepted=accepted or {},
        reused=reused or {},
        preempted=tuple(preempted),
        finished=dict.fromkeys(finished),
    )


def test_trace_stats_separates_prefill_from_decode_windows() -> None:
    records = [
        _rec({"a": 8, "b": 4}, tokens={"a": (5,)}, reused={"b": 16}),  # a's prompt done; b mid-prompt
        _rec({"a": 3, "b": 2}, tokens={"a": (6, 7), "b": (9,)}, drafted={"a": 2}, accepted={"a": 1}),
        _rec({"a": 1, "b": 1}, tokens={"a": (8,), "b": (3,)}, preempted=(), finished=("a",)),
        _rec({"b": 6}, preempted=("c",)),  # c (absent otherwise) was preempted; b, still decoding, runs a window
    ]
    s = trace_stats(records, prompt_tokens=40)
    assert s["steps"] == 4
    assert s["tokens_per_step_series"] == [12, 5, 2, 6]
    assert s["computed_tokens"] == 25
    # decode windows: a's 3 (step 1) and 1 (step 2), b's 1 (step 2) and 6 (step 3)
    assert s["prefill_tokens_computed"] == 25 - (3 + 1 + 1 + 6)
    assert s["preemptions"] == 1
    assert s["reused_tokens"] == 16 and s["prefix_hit_rate"] == pytest.approx(0.4)
    assert s["drafted"] == 2 and s["accepted"] == 1 and s["acceptance_rate"] == pytest.approx(0.5)
    # decode rows per step, and their contexts: a at 8, 11; b at 22 (16 reused + 4 + 2), 23
    assert s["decode_rows_series"] == [0, 1, 2, 1]
    assert s["decode_context_mean"] == pytest.approx((8 + 11 + 22 + 23) / 4)
    assert trace_stats([], None)["acceptance_rate"] is None
    assert trace_stats([], None)["decode_context_mean"] is None


def test_trace_stats_on_a_real_m12_trace_counts_every_prompt_token_once() -> None:
    spec = {
        "engine": {"max_step_tokens": 16, "page_size": 4, "num_pages": 64},
        "requests": [{"request_id": f"r{i}", "prompt_len": 10 + i, "max_new_tokens": 5} for i in range(4)],
    }
    records = build_engine(load_rung("m12"), load_workload(json.dumps(spec))).run()
    s = trace_stats(records, prompt_tokens=sum(10 + i for i in range(4)))
    assert s["prefill_tokens_computed"] == 46  # no prefix hits, no preemption: every prompt token once
    assert s["computed_tokens"] == 46 + 4 * 4  # plus one decode row per token after the first
    assert s["output_tokens_appended"] == 20
    assert sum(s["decode_rows_series"]) == 16  # four decode rows per request
    assert s["decode_context_mean"] == pytest.approx(13.0)  # request i decodes at positions 10+i .. 13+i


def test_useful_flops_counts_linear_attention_and_head() -> None:
    # 3 positions computed (prompt 2 + output 2 - 1); attention pairs 1 + 2 + 3 = 6
    assert (
        useful_flops(2, 2, linear_params=10, attn_width=4, layers=2, lm_head=7)
        == 2 * 10 * 3 + 4 * 4 * 2 * 6 + 2 * 7 * 2
    )


def test_workloads_are_seeded_and_shaped_as_documented() -> None:
    w = make_workload("throughput", 1000, seed=3)
    assert w == make_workload("throughput", 1000, seed=3) and w != make_workload("throughput", 1000, seed=4)
    assert len(w.requests) == 32
    assert all(64 <= len(r.prompt_ids) <= 512 and 32 <= r.max_tokens <= 256 for r in w.requests)
    assert all(100 <= t < 1000 for r in w.requests for t in r.prompt_ids)
    p = make_workload("prefix", 1000, quick=True)
    system = p.requests[0].prompt_ids[:128]
    assert all(r.prompt_ids[:128] == system and len(r.prompt_ids) == 136 for r in p.requests)
    s = make_workload("spec", 1000, quick=True)
    assert all(r.prompt_ids[:16] * 3 == r.prompt_ids for r in s.requests)
    assert make_workload("latency", 1000, quick=True).sequential
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", 1000)
    with pytest.raises(ValueError, match="no size"):
        make_workload("latency", 1000, bogus=1)
