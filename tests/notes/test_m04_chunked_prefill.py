"""Tests pinning mech-notes/04-chunked-prefill.md."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m04_chunked_prefill as m

TOKEN = m.Sample.TOKEN
RUNNING, WAITING = m.RequestState.RUNNING, m.RequestState.WAITING


def req(rid: str, prompt: int, max_new: int, **kw: int) -> m.Request:
    return m.Request(rid, prompt, max_new, **kw)


def run(engine: m.Engine, limit: int = 100) -> list[m.StepRecord]:
    """``engine.run()``, failing instead of hanging when the run never stops."""

    def watch(t: m.StepRecord) -> None:
        assert t.step < limit, "run() did not stop"

    return engine.run(on_step=watch)


def test_m04_n1_constructor_validates_as_m03() -> None:
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([req("bad", 0, 1)], 0, 4, 4)
    with pytest.raises(ValueError, match="bad"):
        m.Engine([req("bad", 1, 0)], 8, 0, 0)
    with pytest.raises(ValueError, match="num_pages"):
        m.Engine([], 8, 4, 0)
    with pytest.raises(ValueError, match="page_size"):
        m.Engine([], 8, 0, 4)
    m.Engine([], 1, 1, 1)


def test_m04_n2_take_min_of_remaining_and_what_is_left() -> None:
    e = m.Engine([req("a", 10, 3), req("b", 3, 3), req("c", 2, 3)], 8, 4, 16)
    t0 = e.step()
    assert t0.scheduled == ("a",)  # B reached 0 on a: b and c get nothing
    assert dict(t0.executed) == {"a": 8}
    t1 = e.step()
    assert t1.scheduled == ("a", "b", "c")
    assert list(t1.executed.items()) == [("a", 2), ("b", 3), ("c", 2)]  # 7 of 8
    t2 = e.step()
    assert list(t2.executed.items()) == [("a", 1), ("b", 1), ("c", 1)]


def cut_step(e: m.Engine) -> m.StepRecord:
    """``e.step()``, checking N3 against the state before it: the work is a prefix of the RUNNING list in
    which everyone but the last gets all it owes, the last gets what is left of the budget, and every
    RUNNING request behind the last scheduled one is nowhere in the record and does not move."""
    due = [r for r in e.requests if r.state is RUNNING or (r.state is WAITING and r.arrival_step <= e.step_counter)]
    owed = [(r, r.remaining, r.computed, r.generated) for r in due]
    t = e.step()
    work = list(t.executed.items())
    assert list(t.scheduled) == [rid for rid, _ in work]
    assert [rid for rid, _ in work] == [r.request_id for r, *_ in owed[: len(work)]]  # a prefix, in list order
    if owed:
        assert work, "the first RUNNING request always gets work"
    left = e.max_step_tokens
    for i, (rid, n) in enumerate(work):
        remaining = owed[i][1]
        assert n == min(remaining, left), (rid, n, remaining, left)
        assert i == len(work) - 1 or n == remaining, f"{rid} was cut short but is not the last scheduled"
        left -= n
    behind = owed[len(work) :]
    if behind:
        assert left == 0, "a RUNNING request was left out while budget remained"
    for r, _, computed, generated in behind:
        rid = r.request_id
        assert rid not in t.scheduled and rid not in t.executed and rid not in t.sampled and rid not in t.finished
        assert (r.state, r.computed, r.generated) == (RUNNING, computed, generated), rid
    return t


def test_m04_n3_first_always_served_only_last_cut() -> None:
    solo_r = req("solo", 7, 1)
    solo = m.Engine([solo_r], 2, 4, 4)
    assert dict(cut_step(solo).executed) == {"solo": 2}  # owes 7, more than the whole budget
    reqs = [req("a", 3, 3), req("b", 6, 3), req("c", 2, 3)]
    e = m.Engine(reqs, 5, 4, 16)
    shapes = []
    while any(r.state is not m.RequestState.FINISHED for r in reqs):
        assert e.step_counter < 50, "the run did not stop"
        shapes.append(list(cut_step(e).executed.items()))
    # c stands behind the cut b for two steps: not scheduled, its prompt untouched, then served in full
    assert shapes[:3] == [[("a", 3), ("b", 2)], [("a", 1), ("b", 4)], [("a", 1), ("b", 1), ("c", 2)]]
    # a decoding request behind a cut prompt waits too: the budget is not stretched for it
    a, big, d = req("a", 1, 9), req("big", 13, 1, arrival_step=1), req("d", 1, 9)
    e = m.Engine([a, big, d], 4, 4, 16)
    t0 = cut_step(e)
    assert (t0.scheduled, dict(t0.sampled)) == (("a", "d"), {"a": TOKEN, "d": TOKEN})
    t1 = cut_step(e)
    assert (t1.scheduled, dict(t1.executed)) == (("a", "big"), {"a": 1, "big": 3})
    assert "d" not in t1.sampled and (d.computed, d.generated, d.remaining) == (1, 1, 1)
    for _ in range(3):
        t = cut_step(e)
        assert (t.scheduled, dict(t.executed)) == (("a", "big"), {"a": 1, "big": 3})
    assert cut_step(e).scheduled == ("a", "big", "d")  # big's last prompt token leaves room: 1 + 1 + 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(budget="any", pool="ample", max_requests=5))
def test_m04_n3_every_step_serves_a_prefix_and_cuts_only_the_last(w: dict) -> None:
    e = build(m, w, validate=False)
    reqs = e.requests
    for _ in range(200):
        if all(r.state is m.RequestState.FINISHED for r in reqs):
            return
        cut_step(e)
    raise AssertionError("the run did not stop")


def test_m04_n4_pages_follow_the_slice() -> None:
    a, b = req("a", 10, 2), req("b", 1, 2)
    e = m.Engine([a, b], 4, 4, 8)
    tables = []
    for _ in range(3):
        e.step()
        tables.append((list(a.page_table), list(b.page_table)))
    assert tables == [([0], []), ([0, 1], []), ([0, 1, 2], [3])]
    assert list(e.pool.free) == [4, 5, 6, 7]


def test_m04_n5_out_of_pages_at_a_later_chunk() -> None:
    a = req("a", 10, 1)
    e = m.Engine([a], 4, 4, 2)
    e.step()
    e.step()
    with pytest.raises(m.OutOfPages):
        e.step()  # chunk 8..9 needs a third page
    assert e.step_counter == 2
    assert (a.computed, a.page_table, list(e.pool.free)) == (8, [0, 1], [])


def test_m04_n6_every_item_executes_ready_or_not() -> None:
    e = m.Engine([req("a", 3, 2), req("b", 10, 2)], 8, 4, 8)
    t0 = e.step()
    assert list(t0.executed.items()) == [("a", 3), ("b", 5)]
    assert dict(t0.sampled) == {"a": TOKEN}


def test_m04_n7_only_caught_up_requests_sample() -> None:
    a, b = req("a", 3, 2), req("b", 10, 2)
    e = m.Engine([a, b], 8, 4, 8)
    e.step()
    assert (b.computed, b.generated, b.state) == (5, 0, RUNNING)
    t1 = e.step()
    assert dict(t1.executed) == {"a": 1, "b": 5}
    assert list(t1.sampled) == ["a", "b"]  # b reached computed == target == 10
    assert (b.computed, b.generated) == (10, 1)
    t2 = run(m.Engine([req("p", 9, 1)], 4, 4, 4))
    assert [dict(t.sampled) for t in t2] == [{}, {}, {"p": TOKEN}]


def test_m04_n8_finish_releases_in_page_table_order() -> None:
    x, y = req("x", 4, 1), req("y", 6, 1, arrival_step=2)
    e = m.Engine([x, y], 2, 2, 4)
    e.step()
    e.step()  # x: second chunk, finishes and releases [0, 1]
    assert x.page_table == []
    assert list(e.pool.free) == [2, 3, 0, 1]
    traces = run(e)  # y: chunks of 2, pages [2, 3, 0]
    assert [dict(t.executed) for t in traces] == [{"y": 2}, {"y": 2}, {"y": 2}]
    assert list(e.pool.free) == [1, 2, 3, 0]
    assert e.pool.owner == [None] * 4


def test_m04_n9_a_prompt_longer_than_the_budget_completes() -> None:
    r = req("long", 10, 2)
    traces = run(m.Engine([r], 3, 4, 4))
    assert [dict(t.executed) for t in traces] == [{"long": 3}, {"long": 3}, {"long": 3}, {"long": 1}, {"long": 1}]
    assert [dict(t.sampled) for t in traces] == [{}, {}, {}, {"long": TOKEN}, {"long": TOKEN}]
    assert (r.generated, r.computed, r.finish_reason) == (2, 11, m.FinishReason.LENGTH)
