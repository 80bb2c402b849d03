"""``ServingMetrics``: Prometheus text format (cumulative histograms, labels, escaping) and what it counts."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

from mechserve.api.params import SamplingParams
from mechserve.entrypoints.metrics import Histogram, ServingMetrics
from mechserve.spec.m13_output_caching import RejectReason


def record(**fields: object) -> SimpleNamespace:
    base: dict[str, object] = dict(tokens={}, preempted=(), reused={}, drafted={}, accepted={}, rejected=())
    return SimpleNamespace(**{**base, **fields})


def step(record: SimpleNamespace, prompt_tokens: dict[str, int] | None = None, **counts: int) -> SimpleNamespace:
    """A ``StepOutput``'s fields the metrics read."""
    fields: dict[str, object] = {"prefix_hits": 0, "preemptions": 0, **counts}
    return SimpleNamespace(record=record, prompt_tokens=prompt_tokens or {}, **fields)


def test_histogram_buckets_are_cumulative_and_end_with_inf() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    lines = h.lines("x", 'a="b"')
    assert lines == [
        'x_bucket{a="b",le="0.1"} 2',
        'x_bucket{a="b",le="1"} 3',
        'x_bucket{a="b",le="+Inf"} 4',
        'x_sum{a="b"} 3.65',
        'x_count{a="b"} 4',
    ]


def test_render_is_prometheus_text_with_every_family_typed_once() -> None:
    m = ServingMetrics('model "q"\n')
    rec = record(tokens={"a": (1, 2)}, reused={"a": 8}, rejected=(("b", RejectReason.OVERLOADED),))
    m.observe_step(step(rec, {"a": 10}, prefix_hits=8))
    m.observe_ttft(0.2)
    m.observe_itl([0.01, 0.02])
    m.observe_finished(["stop", "length"], 1.5)
    text = m.render()
    assert text.endswith("\n")
    types = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    assert len(types) == len({name for name, _ in types})
    for line in text.splitlines():
        assert line.startswith("#") or re.fullmatch(
            r'mechserve:[a-z0-9_]+\{model_name="model \\"q\\"\\n"[^}]*\} \S+', line
        )
    assert 'mechserve:prefix_cache_hit_rate{model_name="model \\"q\\"\\n"} 0.8' in text
    assert 'request_rejected_total{model_name="model \\"q\\"\\n",reason="OVERLOADED"} 1' in text
    assert 'request_success_total{model_name="model \\"q\\"\\n",finished_reason="stop"} 1' in text
    snap = m.snapshot()
    assert snap["generation_tokens"] == 2 and snap["itl_count"] == 2 and snap["ttft_count"] == 1


def test_the_metrics_count_the_steps_preemptions() -> None:
    """Which preemptions count is the scheduler's call (``Scheduler.step``, tests/engine/test_scheduler.py)."""
    m = ServingMetrics("m")
    m.observe_step(step(record(preempted=("a", "b", "c")), preemptions=1))
    assert m.snapshot()["preemptions"] == 1
    m.observe_step(step(record(preempted=("a", "b")), preemptions=2))
    assert m.snapshot()["preemptions"] == 3


def test_speculative_drafts_are_counted(make_llm, reference) -> None:
    prompt = [1, 2, 3] * 6

    async def main() -> tuple[object, dict]:
        async with make_llm(spec_len=3) as llm:
            out = await llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))
            return out, llm.metrics.snapshot()

    out, snap = asyncio.run(main())
    assert out.outputs[0].token_ids == reference(prompt, max_tokens=30).outputs[0].token_ids
    assert snap["spec_decode_draft_tokens"] > 0
    assert 0 <= snap["spec_decode_accepted_tokens"] <= snap["spec_decode_draft_tokens"]
    assert snap["generation_tokens"] == 30


def test_a_draft_model_speculates_behind_the_async_engine(make_llm, reference, tiny_dir) -> None:
    """``speculative_config`` (a dict with vLLM's names) reaches the engine: the tiny model's first layer drafts,
    greedy output is the plain output, and the drafts show in the metrics."""
    prompt = [5, 9, 2, 7] * 3
    config = {"method": "draft", "num_speculative_tokens": 2, "model": f"{tiny_dir}:layers=1", "adaptive": False}

    async def main() -> tuple[object, dict]:
        async with make_llm(speculative_config=config) as llm:
            assert llm.core.speculative is not None and llm.core.speculative.method == "draft"
            out = await llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))
            return out, llm.metrics.snapshot()

    out, snap = asyncio.run(main())
    assert out.outputs[0].token_ids == reference(prompt, max_tokens=12).outputs[0].token_ids
    assert snap["spec_decode_draft_tokens"] > 0
