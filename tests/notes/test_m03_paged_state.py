"""Tests pinning mech-notes/03-paged-state.md."""

from __future__ import annotations

import pytest

from mechserve.spec import m03_paged_state as m

RUNNING, FINISHED = m.RequestState.RUNNING, m.RequestState.FINISHED


def req(rid: str, prompt: int, max_new: int, **kw: int) -> m.Request:
    return m.Request(rid, prompt, max_new, **kw)


def run(engine: m.Engine, limit: int = 100) -> list[m.StepRecord]:
    """``engine.run()``, failing instead of hanging when the run never stops."""

    def watch(t: m.StepRecord) -> None:
        assert t.step < limit, "run() did not stop"

    return engine.run(on_step=watch)


def test_m03_n1_pool_checks_come_after_the_m02_checks() -> None:
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([], 0, 0, 0)
    with pytest.raises(ValueError, match="bad"):
        m.Engine([req("bad", 0, 1)], 8, 0, 0)
    with pytest.raises(ValueError, match="num_pages"):
        m.Engine([req("a", 1, 1)], 8, 4, 0)
    with pytest.raises(ValueError, match="page_size"):
        m.Engine([req("a", 1, 1)], 8, -1, 4)
    m.Engine([req("a", 1, 1)], 8, 1, 1)


def test_m03_n2_free_list_pages_for_and_translate() -> None:
    e = m.Engine([], 8, 4, 5)
    assert list(e.pool.free) == [0, 1, 2, 3, 4]
    assert [m.pages_for(t, 4) for t in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert m.translate([5, 2, 7], 9, 4) == (7, 1)
    assert m.translate([5, 2, 7], 4, 4) == (2, 0)
    assert m.translate([5, 2, 7], 3, 4) == (5, 3)


def test_m03_n3_scheduling_ignores_pages() -> None:
    # the m02 walk: b (6) is skipped, c (4) fits, pages play no part
    e = m.Engine([req("a", 3, 3), req("b", 6, 3), req("c", 4, 3)], 8, 4, 16)
    assert e.step().scheduled == ("a", "c")
    assert e.step().scheduled == ("a", "b", "c")
    # a request the pool cannot hold is still scheduled, and the step fails
    tight = m.Engine([req("x", 4, 1), req("y", 8, 1)], 16, 4, 2)
    with pytest.raises(m.OutOfPages):
        tight.step()


def test_m03_n4_residency_takes_from_the_front_in_work_order() -> None:
    a, b = req("a", 3, 5), req("b", 4, 5)
    e = m.Engine([a, b], 16, 2, 6)
    e.step()
    assert (a.page_table, b.page_table, list(e.pool.free)) == ([0, 1], [2, 3], [4, 5])
    assert e.pool.owner == ["a", "a", "b", "b", None, None]
    e.step()  # a: 4 positions (2 pages, none new); b: 5 positions (3 pages)
    assert (a.page_table, b.page_table, list(e.pool.free)) == ([0, 1], [2, 3, 4], [5])
    assert e.pool.owner[4] == "b"
    e.step()
    assert (a.page_table, b.page_table, list(e.pool.free)) == ([0, 1, 5], [2, 3, 4], [])


def test_m03_n5_out_of_pages_is_all_or_nothing() -> None:
    a, b, c = req("a", 2, 5), req("b", 2, 5), req("c", 1, 5, arrival_step=3)
    e = m.Engine([a, b, c], 16, 2, 5)
    for _ in range(3):
        e.step()
    assert (a.page_table, b.page_table, list(e.pool.free)) == ([0, 2], [1, 3], [4])
    # step 3 needs a:1 + b:1 + c:1 = 3 pages, only page 4 is free
    with pytest.raises(m.OutOfPages):
        e.step()
    assert e.step_counter == 3
    assert (a.page_table, b.page_table, c.page_table, list(e.pool.free)) == ([0, 2], [1, 3], [], [4])
    assert e.pool.owner[4] is None
    assert (a.computed, b.computed, a.generated, b.generated) == (4, 4, 3, 3)
    assert c.state is RUNNING  # admitted in the failing step, and it stays admitted


def test_m03_n6_execute_writes_slots_then_advances_computed() -> None:
    a, b = req("a", 3, 5), req("b", 2, 5)
    e = m.Engine([a, b], 16, 2, 6)
    e.step()
    assert e.pool.slots[0] == [("a", 0), ("a", 1)]
    assert e.pool.slots[1] == [("a", 2), None]
    assert e.pool.slots[2] == [("b", 0), ("b", 1)]
    assert (a.computed, b.computed) == (3, 2)
    e.step()
    assert e.pool.slots[1] == [("a", 2), ("a", 3)]
    assert b.page_table == [2, 3]
    assert e.pool.slots[3] == [("b", 2), None]
    assert (a.computed, b.computed) == (4, 3)


def test_m03_n7_finish_releases_in_page_table_order_to_the_back() -> None:
    x, y = req("x", 4, 1), req("y", 6, 1, arrival_step=1)
    e = m.Engine([x, y], 16, 2, 4)
    e.step()  # x takes [0, 1] and finishes
    assert list(e.pool.free) == [2, 3, 0, 1]
    assert x.page_table == []
    assert e.pool.owner == [None, None, None, None]
    assert e.pool.slots[0] == [None, None]
    e.step()  # y takes [2, 3, 0] and finishes
    assert list(e.pool.free) == [1, 2, 3, 0]
    assert y.page_table == []
    assert all(slots == [None, None] for slots in e.pool.slots)


def test_m03_n8_released_pages_serve_only_the_next_step() -> None:
    # a finishes in step 1 and gives pages [0, 1] back, but only after residency of step 1
    a, b = req("a", 4, 2), req("b", 4, 1, arrival_step=1)
    e = m.Engine([a, b], 16, 4, 2)
    e.step()
    with pytest.raises(m.OutOfPages):
        e.step()
    a2, b2 = req("a", 4, 2), req("b", 4, 2, arrival_step=2)
    e2 = m.Engine([a2, b2], 16, 4, 2)
    e2.step()
    e2.step()
    assert list(e2.pool.free) == [0, 1]
    e2.step()
    assert b2.page_table == [0]


def test_m03_n9_pool_invariant_between_steps() -> None:
    reqs = [req("a", 3, 4), req("b", 5, 2, arrival_step=1), req("c", 1, 3, eos_after=1), req("d", 7, 1)]
    e = m.Engine(reqs, 8, 2, 12)
    while any(r.state is not FINISHED for r in reqs):
        e.step()
        e.check_invariants()
        owned = [p for r in reqs for p in r.page_table]
        assert sorted(owned + list(e.pool.free)) == list(range(12))
        for r in reqs:
            expected = 0 if r.state is FINISHED else m.pages_for(r.computed, 2)
            assert len(r.page_table) == expected
            assert all(e.pool.owner[p] == r.request_id for p in r.page_table)
    assert sorted(e.pool.free) == list(range(12))


def test_m03_n10_never_fits_kept_and_out_of_pages_propagates() -> None:
    e = m.Engine([req("big", 5, 1)], 4, 4, 8)
    with pytest.raises(RuntimeError, match="big"):
        run(e)
    assert e.step_counter == 1
    e2 = m.Engine([req("wide", 5, 1)], 8, 4, 1)
    with pytest.raises(m.OutOfPages):
        run(e2)
    assert e2.step_counter == 0
