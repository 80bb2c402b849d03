"""Tests pinning mech-notes/04-chunked-prefill.md."""

from __future__ import annotations

import pytest

from mechserve.spec import m04_chunked_prefill as m

TOKEN = m.Sample.TOKEN
RUNNING = m.RequestState.RUNNING


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


def test_m04_n3_first_always_served_only_last_cut() -> None:
    solo = m.Engine([req("solo", 7, 1)], 2, 4, 4)
    assert dict(solo.step().executed) == {"solo": 2}  # owes 7, more than the whole budget
    reqs = [req("a", 3, 3), req("b", 6, 3), req("c", 2, 3)]
    e = m.Engine(reqs, 5, 4, 16)
    shapes = []
    while any(r.state is RUNNING or r.state is m.RequestState.WAITING for r in reqs):
        owed = {r.request_id: r.remaining for r in reqs}
        t = e.step()
        items = list(t.executed.items())
        assert all(n == owed[rid] for rid, n in items[:-1])  # all but the last get everything they owe
        shapes.append(items)
    assert shapes[:3] == [[("a", 3), ("b", 2)], [("a", 1), ("b", 4)], [("a", 1), ("b", 1), ("c", 2)]]


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
