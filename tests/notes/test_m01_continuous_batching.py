"""Tests pinning mech-notes/01-continuous-batching.md."""

from __future__ import annotations

import pytest

from mechserve.spec import m00_engine_loop as m00
from mechserve.spec import m01_continuous_batching as m

TOKEN = m.Sample.TOKEN


def req(rid: str, prompt: int, max_new: int, **kw: int) -> m.Request:
    return m.Request(rid, prompt, max_new, **kw)


def run(engine: m.Engine, limit: int = 100) -> list[m.StepRecord]:
    """``engine.run()``, failing instead of hanging when the run never stops."""

    def watch(t: m.StepRecord) -> None:
        assert t.step < limit, "run() did not stop"

    return engine.run(on_step=watch)


@pytest.mark.parametrize(("prompt", "max_new"), [(0, 1), (-1, 2), (2, 0), (2, -4)])
def test_m01_n1_constructor_validates_as_m00(prompt: int, max_new: int) -> None:
    with pytest.raises(ValueError):
        m.Engine([req("ok", 1, 1), req("bad", prompt, max_new)])


def test_m01_n2_batch_is_every_running_request_for_its_whole_remaining() -> None:
    e = m.Engine([req("a", 3, 2), req("b", 5, 1), req("w", 2, 1, arrival_step=9)])
    t0 = e.step()
    assert t0.scheduled == ("a", "b")
    assert list(t0.executed.items()) == [("a", 3), ("b", 5)]
    t1 = e.step()
    assert t1.scheduled == ("a",)
    assert dict(t1.executed) == {"a": 1}


def test_m01_n3_a_new_request_joins_at_its_list_position() -> None:
    e = m.Engine([req("late", 2, 2, arrival_step=2), req("early", 1, 5)])
    traces = [e.step() for _ in range(4)]
    assert [t.scheduled for t in traces] == [("early",), ("early",), ("late", "early"), ("late", "early")]
    assert list(traces[2].executed.items()) == [("late", 2), ("early", 1)]
    # early keeps decoding one token per step through late's prefill
    assert [t.executed["early"] for t in traces] == [1, 1, 1, 1]


def test_m01_n4_a_finished_request_leaves_without_a_barrier() -> None:
    e = m.Engine([req("short", 1, 1), req("long", 1, 3), req("new", 1, 1, arrival_step=1)])
    traces = run(e)
    assert [t.scheduled for t in traces] == [("short", "long"), ("long", "new"), ("long",)]
    assert [dict(t.finished) for t in traces] == [
        {"short": m.FinishReason.LENGTH},
        {"new": m.FinishReason.LENGTH},
        {"long": m.FinishReason.LENGTH},
    ]


def test_m01_n5_every_batch_member_samples() -> None:
    traces = run(m.Engine([req("a", 6, 2), req("b", 1, 3, arrival_step=1)]))
    for t in traces:
        assert list(t.sampled) == list(t.scheduled)
        assert set(t.sampled.values()) <= {TOKEN}
    assert [t.scheduled for t in traces] == [("a",), ("a", "b"), ("b",), ("b",)]


WORKLOADS = [
    [],
    [("a", 3, 2, 0, None)],
    [("a", 4, 3, 0, None), ("b", 2, 5, 1, None), ("c", 1, 2, 0, 1)],
    [("x", 1, 1, 4, None), ("y", 7, 2, -3, 0), ("z", 2, 6, 2, 9)],
    [("p", 5, 4, 1, 2), ("q", 5, 4, 1, None), ("r", 1, 1, 0, None), ("s", 3, 2, 6, 1)],
]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_m01_n6_output_identical_to_m00(workload: list[tuple[str, int, int, int, int | None]]) -> None:
    def trace_of(mod):  # type: ignore[no-untyped-def]
        reqs = [mod.Request(rid, p, n, arrival_step=a, eos_after=eos) for rid, p, n, a, eos in workload]
        engine = mod.Engine(reqs)
        return [t.to_json() for t in run(engine)], engine.summary()

    assert trace_of(m) == trace_of(m00)
