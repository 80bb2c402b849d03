"""Tests pinning mech-notes/02-token-budget.md."""

from __future__ import annotations

import pytest

from mechserve.spec import m02_token_budget as m

TOKEN = m.Sample.TOKEN


def req(rid: str, prompt: int, max_new: int, **kw: int) -> m.Request:
    return m.Request(rid, prompt, max_new, **kw)


def run(engine: m.Engine, limit: int = 100) -> list[m.StepRecord]:
    """``engine.run()``, failing instead of hanging when the run never stops."""

    def watch(t: m.StepRecord) -> None:
        assert t.step < limit, "run() did not stop"

    return engine.run(on_step=watch)


def test_m02_n1_budget_checked_first() -> None:
    for budget in (0, -3):
        with pytest.raises(ValueError, match="max_step_tokens"):
            m.Engine([], budget)
        with pytest.raises(ValueError, match="max_step_tokens"):
            m.Engine([req("bad", 0, 0)], budget)
    with pytest.raises(ValueError, match="bad"):
        m.Engine([req("ok", 1, 1), req("bad", 0, 1)], 8)
    with pytest.raises(ValueError, match="bad"):
        m.Engine([req("bad", 1, 0)], 8)
    m.Engine([], 1)


def test_m02_n2_whole_remaining_while_it_fits() -> None:
    e = m.Engine([req("a", 5, 3), req("b", 3, 3), req("c", 1, 3)], 8)
    t0 = e.step()
    assert t0.scheduled == ("a", "b")  # 5 + 3 = 8: equality fits; c finds B = 0
    assert list(t0.executed.items()) == [("a", 5), ("b", 3)]
    t1 = e.step()
    assert list(t1.executed.items()) == [("a", 1), ("b", 1), ("c", 1)]


def test_m02_n3_skip_and_keep_walking() -> None:
    e = m.Engine([req("a", 3, 3), req("b", 6, 3), req("c", 4, 3)], 8)
    t0 = e.step()
    assert t0.scheduled == ("a", "c")  # b (6) does not fit the 5 left; c (4) does
    assert dict(t0.executed) == {"a": 3, "c": 4}
    t1 = e.step()
    assert t1.scheduled == ("a", "b", "c")  # 1 + 6 + 1 = 8
    assert dict(t1.executed) == {"a": 1, "b": 6, "c": 1}


def test_m02_n4_no_partial_scheduling() -> None:
    a, b = req("a", 5, 2), req("b", 6, 2)
    e = m.Engine([a, b], 8)
    t0 = e.step()
    assert dict(t0.executed) == {"a": 5}  # not {"a": 5, "b": 3}
    assert b.computed == 0
    t1 = e.step()
    assert dict(t1.executed) == {"a": 1, "b": 6}
    traces = [t0, t1, *run(e)]
    assert all(sum(t.executed.values()) <= 8 for t in traces)
    assert b.generated == 2


def test_m02_n5_every_executed_request_samples() -> None:
    traces = run(m.Engine([req("a", 5, 2), req("b", 6, 3, eos_after=1), req("c", 2, 2)], 8))
    for t in traces:
        assert list(t.sampled) == list(t.executed)
    assert [dict(t.sampled) for t in traces][:2] == [{"a": TOKEN, "c": TOKEN}, {"a": TOKEN, "b": TOKEN, "c": TOKEN}]


def test_m02_n6_a_request_that_never_fits_waits_while_others_run() -> None:
    big = req("big", 10, 1)
    e = m.Engine([big, req("b", 2, 3)], 4)
    traces = [e.step() for _ in range(4)]
    assert [t.scheduled for t in traces] == [("b",), ("b",), ("b",), ()]
    assert big.state is m.RequestState.RUNNING
    assert big.computed == 0


def test_m02_n7_never_fits_raises_after_an_empty_step() -> None:
    seen: list[int] = []

    def watch(t: m.StepRecord) -> None:
        seen.append(t.step)
        assert t.step < 20, "run() did not stop"

    reqs = [req("big", 5, 1), req("small", 1, 1), req("huge", 9, 1)]
    e = m.Engine(reqs, 4)
    with pytest.raises(RuntimeError) as exc:
        e.run(on_step=watch)
    assert seen == [0, 1]  # step 1 scheduled nothing, and its trace was produced
    assert e.step_counter == 2
    assert "big" in str(exc.value)
    assert "huge" in str(exc.value)
    assert "small" not in str(exc.value)  # only RUNNING ids are named
    assert reqs[1].state is m.RequestState.FINISHED


def test_m02_n8_waiting_for_arrival_is_not_never_fits() -> None:
    traces = run(m.Engine([req("late", 2, 1, arrival_step=3)], 2))
    assert [t.scheduled for t in traces] == [(), (), (), ("late",)]
    assert [t.admitted for t in traces] == [(), (), (), ("late",)]
