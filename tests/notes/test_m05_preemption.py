"""Tests pinning mech-notes/05-preemption.md."""

from __future__ import annotations

import random

import pytest

from mechserve.spec import m05_preemption as m

TOKEN = m.Sample.TOKEN
LENGTH = m.FinishReason.LENGTH
RUNNING, FINISHED = m.RequestState.RUNNING, m.RequestState.FINISHED


def req(rid: str, prompt: int, max_new: int, **kw: int) -> m.Request:
    return m.Request(rid, prompt, max_new, **kw)


def run(engine: m.Engine, limit: int = 100) -> list[m.StepRecord]:
    """``engine.run()``, failing instead of hanging when the run never stops."""

    def watch(t: m.StepRecord) -> None:
        assert t.step < limit, "run() did not stop"

    return engine.run(on_step=watch)


@pytest.fixture(autouse=True)
def bounded_residency(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn a residency loop that never ends into a test failure instead of a hung run.

    Each victim is preempted at most once per step, so one step's residency can search for a victim at
    most once per request, plus the search that finds none; counting the searches bounds the loop
    without a clock.
    """
    ensure, choose = m.Engine._ensure_residency, m.Engine._choose_victim

    def ensure_counted(self: m.Engine, *args: object) -> object:
        self.victim_searches = 0
        return ensure(self, *args)

    def choose_counted(self: m.Engine, *args: object) -> object:
        self.victim_searches += 1
        assert self.victim_searches <= len(self.requests) + 1, "a residency loop that never ends"
        return choose(self, *args)

    monkeypatch.setattr(m.Engine, "_ensure_residency", ensure_counted)
    monkeypatch.setattr(m.Engine, "_choose_victim", choose_counted)


def test_m05_n1_scheduled_before_residency_the_rest_after() -> None:
    # page_size 2, 3 pages: a (prompt 4) and b (prompt 2) fill the pool; both grow in step 1
    e = m.Engine([req("a", 4, 3), req("b", 2, 3)], 8, 2, 3)
    traces = run(e)
    assert [(t.scheduled, t.preempted) for t in traces] == [
        (("a", "b"), ()),
        (("a", "b"), ("b",)),
        (("a", "b"), ("b",)),
        (("b",), ()),
        (("b",), ()),
    ]
    assert [dict(t.executed) for t in traces] == [{"a": 4, "b": 2}, {"a": 1}, {"a": 1}, {"b": 3}, {"b": 1}]
    assert [dict(t.sampled) for t in traces] == [
        {"a": TOKEN, "b": TOKEN},
        {"a": TOKEN},
        {"a": TOKEN},
        {"b": TOKEN},
        {"b": TOKEN},
    ]
    assert [dict(t.finished) for t in traces] == [{}, {}, {"a": LENGTH}, {}, {"b": LENGTH}]


def test_m05_n2_anchor_check_raises_irreducible_before_any_preemption() -> None:
    a, b = req("a", 8, 1, arrival_step=1), req("b", 2, 5)
    e = m.Engine([a, b], 8, 2, 3)
    e.step()
    assert b.page_table == [0]
    with pytest.raises(m.Irreducible):  # a: pages_for(0 + 8) = 4 > 3 pages in the pool
        e.step()
    assert issubclass(m.Irreducible, m.OutOfPages)
    assert e.step_counter == 1
    assert (b.page_table, b.computed, list(e.pool.free)) == ([0], 2, [1, 2])  # b was not preempted
    assert (a.state, a.computed, a.page_table) == (RUNNING, 0, [])  # admitted in the failing step
    # it strikes at the chunk that crosses the pool, not before
    c = req("c", 6, 1)
    e2 = m.Engine([c], 2, 2, 2)
    e2.step()
    e2.step()
    with pytest.raises(m.Irreducible):
        e2.step()
    assert (e2.step_counter, c.computed, c.page_table) == (2, 4, [0, 1])


def test_m05_n3_no_preemption_while_the_free_list_suffices() -> None:
    a, b = req("a", 4, 3), req("b", 2, 3)
    e = m.Engine([a, b], 8, 2, 3)
    t0 = e.step()  # needs exactly the 3 free pages
    assert t0.preempted == ()
    assert (a.page_table, b.page_table, list(e.pool.free)) == ([0, 1], [2], [])


def test_m05_n4_victims_scan_from_the_list_end() -> None:
    reqs = [req(rid, 1, 9) for rid in "abcd"] + [req("e", 1, 9, arrival_step=1), req("f", 1, 1, arrival_step=50)]
    a, b, _, _, e_, f = reqs
    e = m.Engine(reqs, 4, 1, 4)
    e.step()
    assert [r.page_table for r in reqs[:4]] == [[0], [1], [2], [3]]
    t1 = e.step()  # a, b, c, d each need a second page; e was admitted but got no budget
    assert t1.scheduled == ("a", "b", "c", "d")
    assert t1.preempted == ("d", "c")  # f (WAITING) and e (no pages, no work) are skipped
    assert (e_.page_table, e_.state, f.state) == ([], RUNNING, m.RequestState.WAITING)
    assert (a.page_table, b.page_table) == ([0, 3], [1, 2])


def test_m05_n5_eligibility_is_per_request_not_per_id() -> None:
    # two requests share the id "x"; only the first is scheduled (budget 8 = 4 + 4)
    anchor, x1, x2 = req("a", 4, 4), req("x", 4, 4), req("x", 4, 4)
    e = m.Engine([anchor, x1, x2], 8, 4, 1)
    t0 = e.step()  # with ids compared instead of requests, x2 is chosen again and again, for ever
    assert t0.scheduled == ("a", "x")
    assert t0.preempted == ("x",)
    assert dict(t0.executed) == {"a": 4}
    assert anchor.page_table == [0]


def test_m05_n6_preempting_releases_pages_and_keeps_history() -> None:
    a, x, b = req("a", 1, 9), req("x", 2, 1), req("b", 1, 9)
    e = m.Engine([a, x, b], 16, 1, 5)
    e.step()  # a [0], x [1, 2] (finishes, released), b [3]
    e.step()  # a [0, 4], b [3, 1]
    assert (b.page_table, list(e.pool.free)) == ([3, 1], [2])
    t2 = e.step()  # a and b each need a page, one is free: b is the victim
    assert t2.scheduled == ("a", "b")
    assert t2.preempted == ("b",)
    assert "b" not in t2.executed
    assert "b" not in t2.sampled
    assert list(e.pool.free) == [3, 1]  # [2] + b's [3, 1] in page-table order, then a took 2
    assert a.page_table == [0, 4, 2]
    assert (b.page_table, b.computed, b.generated, b.target) == ([], 0, 2, 3)
    assert (b.state, b.finish_reason) == (RUNNING, None)
    assert (e.pool.owner[3], e.pool.owner[1], e.pool.slots[3], e.pool.slots[1]) == (None, None, [None], [None])


def test_m05_n7_victims_only_until_the_shortfall_fits() -> None:
    a, b, c = req("a", 1, 9), req("b", 1, 9), req("c", 2, 9)
    small = m.Engine([a, b, c], 8, 1, 4)
    small.step()  # a [0], b [1], c [2, 3]
    t = small.step()  # a, b, c each need a page; c alone frees two
    assert t.preempted == ("c",)
    assert (a.page_table, b.page_table) == ([0, 2], [1, 3])
    reqs = [req(rid, 1, 9) for rid in "abcd"]
    e = m.Engine(reqs, 4, 1, 4)
    e.step()
    t1 = e.step()
    assert t1.preempted == ("d", "c")  # two free pages cover a and b: b is spared
    assert dict(t1.executed) == {"a": 1, "b": 1}
    for _ in range(2):
        t = e.step()
        assert t.preempted
        assert len(set(t.preempted)) == len(t.preempted)


def test_m05_n8_a_victims_budget_is_not_handed_on() -> None:
    a, b, d = req("a", 1, 9), req("b", 2, 9, arrival_step=1), req("d", 1, 9, arrival_step=1)
    e = m.Engine([a, b, d], 3, 1, 3)
    e.step()
    t1 = e.step()  # a:1 + b:2 use the budget; b must go, d could use its 2 tokens but does not get them
    assert t1.scheduled == ("a", "b")
    assert t1.preempted == ("b",)
    assert dict(t1.executed) == {"a": 1}
    assert (d.computed, d.page_table, list(e.pool.free)) == (0, [], [2])


def test_m05_n9_a_pageless_victim_frees_nothing() -> None:
    reqs = [req(rid, 1, 9) for rid in "abcd"]
    a, _, c, d = reqs
    e = m.Engine(reqs, 4, 1, 4)
    e.step()
    e.step()  # c and d preempted; a [0, 3], b [1, 2]
    t2 = e.step()  # work a:1, b:1, c:2; c holds nothing, so b must go too
    assert t2.scheduled == ("a", "b", "c")
    assert t2.preempted == ("c", "b")
    assert dict(t2.executed) == {"a": 1}
    assert (a.page_table, list(e.pool.free)) == ([0, 3, 1], [2])
    assert (c.page_table, d.page_table) == ([], [])


def test_m05_n10_an_unscheduled_page_holder_is_eligible() -> None:
    a, b, c = req("a", 3, 9, arrival_step=1), req("b", 1, 9), req("c", 1, 9)
    e = m.Engine([a, b, c], 3, 1, 4)
    e.step()  # b [0], c [1]
    t1 = e.step()  # a takes the whole budget (3 tokens, 3 pages); c holds a page but gets no work
    assert t1.scheduled == ("a",)
    assert t1.preempted == ("c",)
    assert (c.page_table, c.computed, c.generated) == ([], 0, 1)
    assert (b.page_table, b.computed) == ([0], 1)
    assert a.page_table == [2, 3, 1]


def test_m05_n11_a_victim_recomputes_then_samples_its_next_token() -> None:
    a, b = req("a", 1, 3), req("b", 1, 5)
    e = m.Engine([a, b], 2, 1, 5)
    traces = run(e)
    assert [t.preempted for t in traces] == [(), (), ("b",), (), (), (), ()]
    assert [dict(t.executed) for t in traces][3:] == [{"b": 2}, {"b": 1}, {"b": 1}, {"b": 1}]
    assert [dict(t.sampled) for t in traces][3:] == [{}, {"b": TOKEN}, {"b": TOKEN}, {"b": TOKEN}]
    assert sum("b" in t.sampled for t in traces) == 5  # nothing lost, nothing repeated
    assert (b.generated, b.computed, b.finish_reason) == (5, 5, LENGTH)
    assert e.summary()[1] == {
        "request_id": "b",
        "state": "FINISHED",
        "generated": 5,
        "computed": 5,
        "finish_reason": "LENGTH",
    }


def test_m05_n12_a_never_fitting_request_is_preempted_until_it_is_the_anchor() -> None:
    seen: list[m.StepRecord] = []

    def watch(t: m.StepRecord) -> None:
        seen.append(t)
        assert t.step < 20, "run() did not stop"

    e = m.Engine([req("a", 1, 3), req("big", 4, 1)], 8, 1, 3)
    with pytest.raises(m.Irreducible):
        e.run(on_step=watch)
    assert [(t.scheduled, t.preempted) for t in seen] == [(("a", "big"), ("big",))] * 3
    assert dict(seen[2].finished) == {"a": LENGTH}
    assert e.step_counter == 3  # step 3: big is the anchor and needs 4 of 3 pages


def test_m05_n13_out_of_pages_proper_is_unreachable() -> None:
    rng = random.Random(5)
    outcomes = {"finished": 0, "irreducible": 0, "preempted": 0}
    for _ in range(300):
        reqs = [
            req(f"r{i}", rng.randint(1, 6), rng.randint(1, 4), arrival_step=rng.randint(0, 3))
            for i in range(rng.randint(1, 4))
        ]
        e = m.Engine(reqs, rng.choice([1, 2, 3, 8]), rng.choice([1, 2, 3]), rng.randint(1, 6))
        try:
            while any(r.state is not FINISHED for r in reqs):
                assert e.step_counter < 200, "no progress"
                outcomes["preempted"] += bool(e.step().preempted)
        except m.OutOfPages as exc:
            assert type(exc) is m.Irreducible, f"plain OutOfPages: {exc}"
            outcomes["irreducible"] += 1
        else:
            outcomes["finished"] += 1
            assert all(r.generated == r.max_new_tokens for r in reqs)
    assert min(outcomes.values()) > 20, outcomes  # the sweep exercised every path


def test_m05_n14_preempted_is_in_every_trace() -> None:
    e = m.Engine([req("a", 4, 3), req("b", 2, 3)], 8, 2, 3)
    traces = run(e)
    assert list(traces[0].to_json()) == [
        "step",
        "admitted",
        "scheduled",
        "executed",
        "sampled",
        "finished",
        "preempted",
    ]
    assert [t.to_json()["preempted"] for t in traces] == [[], ["b"], ["b"], [], []]
