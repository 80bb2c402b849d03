"""Pins every numbered line of mech-notes/12-admission-control.md.

The scripted model's ids are a function of a request's own history: after the prompt ``p`` the
``j``-th sampled id is ``scripted_token(previous id, len(p) + j)``, chained from ``p[-1]``
(``chain`` below), so expected ids are computed here, not read back from a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mechserve.conformance.strategies import build, engine_of, prompt_tokens, workloads
from mechserve.spec import m11_parallelism as m11
from mechserve.spec import m12_admission_control as m

R = m.Request
Why = m.RejectReason
TOKEN, EOS, STOP = m.Sample.TOKEN, m.Sample.EOS, m.Sample.STOP
LENGTH = m.FinishReason.LENGTH
WAITING, RUNNING, FINISHED = m.RequestState.WAITING, m.RequestState.RUNNING, m.RequestState.FINISHED
REJECTED, ABORTED = m.RequestState.REJECTED, m.RequestState.ABORTED
CI = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run(eng: m.Engine | m11.Engine, limit: int = 200, on_step: Callable[[Any], None] | None = None) -> list:
    """``eng.run()``, failing instead of hanging when the run never stops; ``on_step`` sees each record."""

    def watch(rec: m.StepRecord | m11.StepRecord) -> None:
        assert rec.step < limit, "run() did not stop"
        if on_step is not None:
            on_step(rec)

    return eng.run(on_step=watch)


def chain(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` ids the scripted model samples after ``prompt``."""
    ids, prev = [], prompt[-1]
    for j in range(n):
        prev = m.scripted_token(prev, len(prompt) + j)
        ids.append(prev)
    return ids


def pool_state(eng: m.Engine) -> tuple:
    return list(eng.pool.free), list(eng.pool.owner), [list(s) for s in eng.pool.slots], eng.cache.size


def ownership(eng: m.Engine) -> tuple[int, int, int]:
    """(free, private, cache-owned) page counts."""
    owners = eng.pool.owner
    return (
        sum(o is None for o in owners),
        sum(isinstance(o, str) for o in owners),
        sum(o is m.CACHE for o in owners),
    )


def mentions(rec: m.StepRecord, rid: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The trace fields of ``rec`` that name ``rid``."""
    out = []
    for key, value in rec.to_json().items():
        if key in skip or key == "step":
            continue
        if rid in (value if isinstance(value, (list, dict)) else ()):
            out.append(key)
    return out


def test_m12_n1_constructor_checks_the_engine_not_the_requests() -> None:
    with pytest.raises(ValueError, match="spec_len"):
        m.Engine([], 0, 0, 0, spec_len=-1, world_size=0, max_waiting=0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([], 0, 0, 0, world_size=0, max_waiting=0)
    with pytest.raises(ValueError, match="num_pages"):
        m.Engine([], 1, 0, 0, world_size=0, max_waiting=0)
    with pytest.raises(ValueError, match="page_size"):
        m.Engine([], 1, 0, 1, world_size=0, max_waiting=0)
    with pytest.raises(ValueError, match="world_size"):
        m.Engine([], 1, 1, 1, world_size=0, max_waiting=0)
    with pytest.raises(ValueError, match="executor"):
        m.Engine([], 1, 1, 1, executors=[m.LocalExecutor({}, {})] * 2, max_waiting=0)
    for limit in ("max_waiting", "max_running", "max_model_len"):
        for value in (0, -1):
            with pytest.raises(ValueError, match=limit):
                m.Engine([], 1, 1, 1, **{limit: value})
        m.Engine([], 1, 1, 1, **{limit: 1})

    # requests that m11's constructor refused now pass the door, one by one, in list order
    def given() -> list[m.Request]:
        return [R("e", [], 2), R("n", [1], -1), R("z", [1, 2], 0), R("a", [1, 2], 2), R("a", [3], 1)]

    eng = m.Engine(given(), 4, 2, 2)
    assert [(r.state, r.reject_reason) for r in eng.requests] == [
        (REJECTED, Why.EMPTY_PROMPT),
        (REJECTED, Why.BAD_MAX_NEW_TOKENS),
        (WAITING, None),
        (WAITING, None),
        (REJECTED, Why.DUPLICATE_ID),
    ]
    offered = m.Engine([], 4, 2, 2)
    assert [offered.add_request(r) for r in given()] == [r.reject_reason for r in eng.requests]
    assert [t.to_json() for t in run(eng)] == [t.to_json() for t in run(offered)]
    assert eng.summary() == offered.summary()


def test_m12_n2_add_request_between_steps_never_raises() -> None:
    a = R("a", [1, 2, 3], 2)
    eng = m.Engine([a], 8, 4, 4)
    t0 = eng.step()
    assert t0.admitted == ("a",)
    b = R("b", [7, 8], 1)  # arrival_step 0 is already past: admitted at the next step
    assert eng.add_request(b) is None
    assert (b.state, eng.requests[-1]) == (WAITING, b)
    t1 = eng.step()
    assert t1.admitted == ("b",)
    assert dict(t1.executed) == {"a": 1, "b": 2}
    assert dict(t1.finished) == {"a": LENGTH, "b": LENGTH}
    c = R("c", [9], 1, arrival_step=4)
    assert eng.add_request(c) is None
    rest = run(eng)
    assert [t.step for t in rest] == [2, 3, 4]
    assert [t.admitted for t in rest] == [(), (), ("c",)]
    assert [r.request_id for r in eng.requests] == ["a", "b", "c"]  # list order = order at the door
    # nothing offered at the door makes it raise: a refusal is a return value
    odd = [R("x", [], -5), R("y", [], 0), R("c", [1], 1), R("w", [1] * 10**4, 10**6), R("v", [2], -1)]
    assert [eng.add_request(r) for r in odd] == [
        Why.EMPTY_PROMPT,
        Why.EMPTY_PROMPT,
        None,  # c finished: its id is free again (N20)
        Why.NEVER_FITS,
        Why.BAD_MAX_NEW_TOKENS,
    ]


def test_m12_n3_door_checks_in_order_first_failure_wins() -> None:
    # 2 pages of 2 slots, max_model_len 6, one waiting place, taken by "a"
    eng = m.Engine([R("a", [1], 1)], 4, 2, 2, max_waiting=1, max_model_len=6)
    assert eng.add_request(R("a", [], -1)) is Why.EMPTY_PROMPT  # also: bad max_new, duplicate
    assert eng.add_request(R("a", [], 0)) is Why.EMPTY_PROMPT
    assert eng.add_request(R("a", [1], -1)) is Why.BAD_MAX_NEW_TOKENS  # also: duplicate
    assert eng.add_request(R("a", [1] * 10, 5)) is Why.DUPLICATE_ID  # also: too long, never fits, overloaded
    assert eng.add_request(R("b", [1] * 6, 1)) is Why.TOO_LONG  # 6 + 1 > 6; also never fits, overloaded
    assert eng.add_request(R("b", [1] * 4, 2)) is Why.NEVER_FITS  # 4 + 2 <= 6 but pages_for(5) = 3 > 2; also full
    assert eng.add_request(R("b", [1] * 3, 2)) is Why.OVERLOADED  # pages_for(4) = 2 fits; the queue is full
    eng.step()  # "a" is admitted and finishes: the place is free
    assert eng.add_request(R("b", [1] * 3, 2)) is None


def test_m12_n4_never_fits_is_the_largest_frontier() -> None:
    # page_size 4, 2 pages: a request may reach frontier 8 (prompt 5 + 4 new - 1), not 9
    fit, over = R("fit", [1, 2, 3, 4, 5], 4), R("over", [1, 2, 3, 4, 6], 5)
    eng = m.Engine([fit, over], 8, 4, 2, spec_len=3)
    assert (fit.state, over.reject_reason) == (WAITING, Why.NEVER_FITS)
    run(eng)
    assert (fit.state, fit.generated, fit.computed) == (FINISHED, 4, 8)
    assert over.page_table == []
    # m11 took it and failed the whole run once it became the anchor
    with pytest.raises(m11.Irreducible):
        m11.Engine([m11.Request("over", [1, 2, 3, 4, 6], 5)], 8, 4, 2).run()
    # no request that passed the door ever makes a step raise: every small single-request case, twice over
    for ps in (1, 2, 3):
        for pages in (1, 2, 3, 4):
            for prompt in range(1, 8):
                for max_new in range(1, 7):
                    for k in (0, 2):
                        pair = [R(rid, list(range(1, prompt + 1)), max_new) for rid in "ab"]
                        e = m.Engine(pair, 3, ps, pages, spec_len=k)
                        fits = m.pages_for(prompt + max_new - 1, ps) <= pages
                        assert all((r.state is WAITING) == fits for r in pair)
                        run(e)
                        assert all(r.state is (FINISHED if fits else REJECTED) for r in pair)


def test_m12_n5_nothing_is_refused_for_the_budget() -> None:
    long = R("long", list(range(1, 11)), 2)
    eng = m.Engine([long], 1, 4, 3)  # budget 1, a 10-token prompt, frontier 11 fits 3 pages
    assert long.state is WAITING
    recs = run(eng)
    assert [dict(t.executed) for t in recs] == [{"long": 1}] * 11
    assert [t.step for t in recs if t.sampled] == [9, 10]
    assert (long.state, long.generated) == (FINISHED, 2)
    assert {w.name for w in Why} == {
        "EMPTY_PROMPT",
        "BAD_MAX_NEW_TOKENS",
        "DUPLICATE_ID",
        "TOO_LONG",
        "NEVER_FITS",
        "OVERLOADED",
    }


def test_m12_n6_overloaded_counts_waiting_requests_only() -> None:
    eng = m.Engine([], 8, 4, 8, max_waiting=2, max_running=1)
    assert eng.add_request(R("a", [1, 2], 3)) is None
    assert eng.add_request(R("b", [3], 1, arrival_step=5)) is None  # not arrived yet: still counts
    assert eng.add_request(R("c", [4], 1)) is Why.OVERLOADED
    eng.step()  # a admitted: RUNNING does not count
    assert eng.add_request(R("d", [5], 1)) is None
    eng.step()  # d arrived but a holds the only running slot: d waits
    assert eng.add_request(R("f", [6], 1)) is Why.OVERLOADED  # b (not arrived) + d (held back)
    assert eng.abort("b")  # an abort frees a place at once
    assert eng.add_request(R("g", [7], 1)) is None
    assert eng.add_request(R("h", [8], 1)) is Why.OVERLOADED  # rejected c and f never counted; d and g do
    run(eng)
    assert {r.request_id: r.state.value for r in eng.requests} == {
        "a": "FINISHED",
        "b": "ABORTED",
        "c": "REJECTED",
        "d": "FINISHED",
        "f": "REJECTED",
        "g": "FINISHED",
        "h": "REJECTED",
    }


def workload() -> list[m.Request]:
    """Chunking (budget 4), a shared prefix (reuse, publish), page pressure (6 pages of 2)."""
    return [R("a", [1, 2, 3, 4, 5], 3), R("b", [1, 2, 3, 4, 9], 2, arrival_step=1), R("c", [7, 7, 7], 4)]


def test_m12_n7_a_rejected_request_changes_nothing() -> None:
    plain = m.Engine(workload(), 4, 2, 6)
    bad = [R("e", [], 1), R("a", [1], 1), R("n", [1], -2), R("big", [1] * 13, 1)]
    mixed_reqs = workload()
    mixed_reqs[1:1] = bad[:2]
    mixed = m.Engine(mixed_reqs + bad[2:], 4, 2, 6)
    late = [R("e2", [], 3), R("a", [5], 1), R("huge", [2] * 20, 2)]
    plain_recs, mixed_recs = [], []
    while plain.running or plain.waiting or mixed.running or mixed.waiting:
        assert plain.step_counter < 200, "the run did not stop"
        plain_recs.append(plain.step().to_json())
        if late:
            assert mixed.add_request(late.pop(0)) is not None
        mixed_recs.append(mixed.step().to_json())
        assert pool_state(plain) == pool_state(mixed)
    rejected = [r for r in mixed.requests if r.state is REJECTED]
    assert [r.request_id for r in rejected] == ["e", "a", "n", "big", "e2", "a", "huge"]
    for rec in mixed_recs:
        rec.pop("rejected")
    for rec in plain_recs:
        rec.pop("rejected")
    assert mixed_recs == plain_recs
    assert [s for s in mixed.summary() if s["state"] != "REJECTED"] == plain.summary()
    for r in rejected:
        assert (r.page_table, r.computed, r.generated, r.output_ids, r.prompt_keys) == ([], 0, 0, [], [])
    assert all(r.reject_reason is not None for r in rejected)
    assert all(s["finish_reason"] is None for s in mixed.summary() if s["state"] == "REJECTED")


def test_m12_n8_rejections_go_into_the_next_record() -> None:
    eng = m.Engine([R("e", [], 1), R("a", [1, 2], 2)], 8, 2, 2)
    t0 = eng.step()
    assert dict(t0.rejected) == {"e": Why.EMPTY_PROMPT}
    assert eng.add_request(R("y", [1] * 9, 1)) is Why.NEVER_FITS
    assert eng.add_request(R("x", [], 1)) is Why.EMPTY_PROMPT
    t1 = eng.step()
    assert list(t1.rejected) == [("y", Why.NEVER_FITS), ("x", Why.EMPTY_PROMPT)]  # door order
    assert run(eng) == []  # all recorded, nothing runs
    assert dict(t1.finished) == {"a": LENGTH}


def test_m12_n9_max_running_admits_in_arrival_order() -> None:
    # c stands before d in the list but arrives later (step 1): d, arrived at step 0 and kept waiting by the
    # limit, keeps its place ahead of c and takes the slot a frees (a finishes at step 0), c the one d frees
    reqs = [R("a", [1], 1), R("b", [2], 3), R("c", [3], 1, arrival_step=1), R("d", [4], 1)]
    eng = m.Engine(reqs, 8, 1, 16, max_running=2)
    t0 = eng.step()
    assert (t0.admitted, [r.request_id for r in eng.due]) == (("a", "b"), ["d"])
    t1 = eng.step()
    assert (t1.admitted, [r.request_id for r in eng.due]) == (("d",), ["c"])
    recs = [t0, t1, *run(eng)]
    assert [t.admitted for t in recs] == [("a", "b"), ("d",), ("c",)]
    assert [dict(t.finished) for t in recs] == [{"a": LENGTH}, {"d": LENGTH}, {"b": LENGTH, "c": LENGTH}]
    assert [t.scheduled for t in recs] == [("a", "b"), ("b", "d"), ("b", "c")]  # b, admitted first, leads
    assert max(len(t.executed) for t in recs) == 2
    # an abort frees the slot for the next step
    a, b = R("a", [1], 5), R("b", [2], 1)
    eng = m.Engine([a, b], 8, 1, 16, max_running=1)
    assert eng.step().admitted == ("a",)
    assert (b.state, eng.due) == (WAITING, [b])
    eng.abort("a")
    assert eng.step().admitted == ("b",)


def test_m12_n10_zero_new_tokens_finishes_at_admission() -> None:
    a, z = R("a", [1, 2, 3], 2), R("z", [1, 2, 3, 4, 5], 0)
    eng = m.Engine([a, z], 8, 4, 2)
    t0 = eng.step()
    assert t0.admitted == ("a", "z")
    assert dict(t0.finished) == {"z": LENGTH}
    assert (t0.scheduled, dict(t0.executed), dict(t0.sampled)) == (("a",), {"a": 3}, {"a": TOKEN})
    assert "z" not in t0.tokens
    assert (z.state, z.finish_reason, z.generated, z.computed, z.output_ids, z.page_table) == (
        FINISHED,
        LENGTH,
        0,
        0,
        [],
        [],
    )
    assert ownership(eng) == (1, 1, 0)  # only a's page is taken
    assert not eng.abort("z")  # it is no longer live: its id is free again
    assert eng.add_request(R("z", [6], 1)) is None
    # no page is ever needed, so even a prompt bigger than the pool passes (max_model_len still applies)
    assert m.Engine([], 8, 4, 2).add_request(R("big", [1] * 100, 0)) is None
    assert m.Engine([], 8, 4, 2, max_model_len=99).add_request(R("big", [1] * 100, 0)) is Why.TOO_LONG
    # it takes no running slot, but waits its turn behind max_running
    reqs = [R("a", [1, 2, 3], 3), R("z", [5], 0), R("b", [4], 1)]
    recs = run(m.Engine(reqs, 8, 4, 8, max_running=1))
    assert [t.admitted for t in recs] == [("a",), (), (), ("z", "b")]
    assert dict(recs[3].finished) == {"z": LENGTH, "b": LENGTH}


def snapshot(eng: m.Engine) -> tuple:
    return (
        pool_state(eng),
        [(r.request_id, r.state, r.computed, r.generated, list(r.page_table)) for r in eng.requests],
        list(eng.waiting),
        list(eng.due),
        list(eng.running),
        dict(eng.live),
    )


def test_m12_n11_abort_returns_whether_a_live_request_was_aborted() -> None:
    reqs = [R("f", [1], 1), R("a", [1, 2], 4), R("w", [3], 1, arrival_step=5), R("x", [], 1)]
    eng = m.Engine(reqs, 8, 2, 4)
    eng.step()  # f finished, a running, w waiting, x rejected
    before = snapshot(eng)
    assert [eng.abort(rid) for rid in ("nope", "f", "x")] == [False, False, False]
    assert snapshot(eng) == before
    assert eng.abort("a") is True
    assert eng.abort("a") is False  # already ABORTED
    assert eng.abort("w") is True
    assert [r.state for r in reqs] == [FINISHED, ABORTED, ABORTED, REJECTED]
    assert eng.step().aborted == ("a", "w")  # the refused calls left no trace


def test_m12_n12_abort_a_waiting_request() -> None:
    soon, held, later = R("a", [1, 2], 3), R("held", [5], 2), R("later", [6], 2, arrival_step=3)
    eng = m.Engine([soon, held, later], 8, 2, 4, max_running=1)
    eng.step()
    assert (held.state, later.state, eng.due) == (WAITING, WAITING, [held])  # arrived, held back; not arrived
    assert eng.abort("held") and eng.abort("later")
    recs = run(eng)
    assert all(rid not in t.admitted for t in recs for rid in ("held", "later"))
    for r in (held, later):
        assert (r.state, r.page_table, r.computed, r.generated) == (ABORTED, [], 0, 0)
    assert (eng.waiting, eng.due) == ([], [])


def test_m12_n13_abort_a_running_request() -> None:
    # mid-prefill: budget 3 computes positions 0..2 of 7; block 0 is published, page 1 (position 2) is private
    p = R("p", [1, 2, 3, 4, 5, 6, 7], 1)
    eng = m.Engine([p], 3, 2, 4)
    t0 = eng.step()
    assert (dict(t0.published), p.page_table, list(eng.pool.free)) == ({"p": 1}, [0, 1], [2, 3])
    assert eng.abort("p")
    assert (p.state, p.page_table, list(eng.pool.free)) == (ABORTED, [], [2, 3, 1])
    assert (eng.pool.owner[0], eng.cache.size) == (m.CACHE, 1)  # the published block stays cached
    again = R("q", [1, 2, 9], 1)
    eng.add_request(again)
    assert dict(eng.step().reused) == {"q": 2}  # ... and serves the next request
    run(eng)
    big = R("big", [8] * 7, 1)  # needs all 4 pages: the now unreferenced cache page is evicted
    eng.add_request(big)
    assert [t.evicted for t in run(eng) if t.evicted] == [(0,)]
    # decoding: prompt block 0 is cached, pages 1 and 2 are private (page-table order)
    d = R("d", [1, 2, 3], 5)
    eng = m.Engine([d], 8, 2, 4)
    for _ in range(3):
        eng.step()
    assert (d.page_table, d.generated, list(eng.pool.free)) == ([0, 1, 2], 3, [3])
    assert eng.abort("d")
    assert (list(eng.pool.free), d.page_table, eng.pool.owner) == ([3, 1, 2], [], [m.CACHE, None, None, None])
    assert (d.generated, d.output_ids) == (3, chain([1, 2, 3], 3))  # the partial output is kept
    # preempted: b lost its pages at step 1 (it holds none), then is aborted
    a, b = R("a", [1, 2, 3, 4], 3), R("b", [5, 6], 3)
    eng = m.Engine([a, b], 8, 2, 3)
    eng.step()
    assert eng.step().preempted == ("b",)
    assert (b.state, b.page_table, b.generated) == (RUNNING, [], 1)
    free = list(eng.pool.free)
    assert eng.abort("b")
    assert (b.state, list(eng.pool.free), b.output_ids) == (ABORTED, free, chain([5, 6], 1))
    run(eng)
    assert a.state is FINISHED
    eng.check_invariants()


def test_m12_n14_aborts_go_into_the_next_record_only() -> None:
    reqs = [R("a", [1, 2], 5), R("b", [3, 4], 5), R("c", [5, 6], 2)]
    eng = m.Engine(reqs, 8, 2, 8)
    eng.step()
    eng.abort("b")
    eng.abort("a")
    recs = run(eng)
    assert recs[0].aborted == ("b", "a")
    for rid in ("a", "b"):
        assert mentions(recs[0], rid, skip=("aborted",)) == []
        assert all(mentions(t, rid) == [] for t in recs[1:])
    assert [t.aborted for t in recs[1:]] == [()] * (len(recs) - 1)


def test_m12_n15_every_record_carries_rejected_and_aborted() -> None:
    eng = m.Engine([R("x", [], 1), R("a", [1], 2)], 8, 2, 2)
    recs = run(eng)
    assert len(recs) == 2
    keys = list(recs[0].to_json())
    assert keys[-3:] == ["tokens", "rejected", "aborted"]
    assert recs[0].to_json()["rejected"] == [["x", "EMPTY_PROMPT"]]
    assert recs[1].to_json()["rejected"] == []
    assert all(t.to_json()["aborted"] == [] for t in recs)
    assert all(list(t.to_json()) == keys for t in recs)


def test_m12_n16_run_records_every_refusal_and_abort() -> None:
    recs = run(m.Engine([R("x", [], 1), R("y", [1], -1)], 8, 2, 2))
    assert len(recs) == 1
    assert dict(recs[0].rejected) == {"x": Why.EMPTY_PROMPT, "y": Why.BAD_MAX_NEW_TOKENS}
    assert run(m.Engine([], 8, 2, 2)) == []
    eng = m.Engine([R("a", [1], 3)], 8, 2, 2)
    eng.abort("a")  # before any step
    recs = run(eng)
    assert [(t.step, t.aborted, t.admitted, dict(t.executed)) for t in recs] == [(0, ("a",), (), {})]


def test_m12_n17_stop_ids_finish_with_stop() -> None:
    prompt = [1, 2, 3]
    ids = chain(prompt, 5)
    r = R("r", prompt, 5, stop_token_ids=(ids[2],))
    recs = run(m.Engine([r], 8, 4, 4))
    assert [dict(t.sampled) for t in recs] == [{"r": TOKEN}, {"r": TOKEN}, {"r": STOP}]
    assert dict(recs[-1].finished) == {"r": m.FinishReason.STOP}
    assert recs[-1].tokens["r"] == (ids[2],)
    assert (r.generated, r.output_ids, r.finish_reason) == (2, ids[:3], m.FinishReason.STOP)
    # a stop id beats the engine's EOS ids ...
    both = R("r", prompt, 5, stop_token_ids=(ids[1],))
    recs = run(m.Engine([both], 8, 4, 4, eos_token_ids=(ids[1],)))
    assert dict(recs[-1].finished) == {"r": m.FinishReason.STOP}
    # ... and the eos_after trigger beats a stop id (the scripted model returns EOS_TOKEN_ID there)
    early = R("r", prompt, 5, eos_after=1, stop_token_ids=(m.EOS_TOKEN_ID,))
    recs = run(m.Engine([early], 8, 4, 4))
    assert dict(recs[-1].sampled) == {"r": EOS}
    assert (early.finish_reason, early.output_ids) == (m.FinishReason.EOS, [ids[0], m.EOS_TOKEN_ID])


def test_m12_n18_ignore_eos_makes_eos_ids_ordinary() -> None:
    prompt = [1, 2, 3]
    ids = chain(prompt, 3)
    plain = R("r", prompt, 3)
    run(m.Engine([plain], 8, 4, 4, eos_token_ids=(ids[1],)))
    assert (plain.finish_reason, plain.generated, plain.output_ids) == (m.FinishReason.EOS, 1, ids[:2])
    deaf = R("r", prompt, 3, ignore_eos=True)
    recs = run(m.Engine([deaf], 8, 4, 4, eos_token_ids=(ids[1],)))
    assert [dict(t.sampled) for t in recs] == [{"r": TOKEN}] * 3
    assert (deaf.finish_reason, deaf.generated, deaf.output_ids) == (LENGTH, 3, ids)
    stop = R("r", prompt, 3, ignore_eos=True, stop_token_ids=(ids[1],))
    run(m.Engine([stop], 8, 4, 4, eos_token_ids=(ids[1],)))
    assert (stop.finish_reason, stop.generated) == (m.FinishReason.STOP, 1)
    trig = R("r", prompt, 3, ignore_eos=True, eos_after=1)
    run(m.Engine([trig], 8, 4, 4))
    assert (trig.finish_reason, trig.generated, trig.output_ids) == (m.FinishReason.EOS, 1, [ids[0], m.EOS_TOKEN_ID])


def spec_run(max_new: int, **kw: object) -> tuple[m.Request, list[m.StepRecord]]:
    engine_kw = {k: kw.pop(k) for k in ("eos_token_ids",) if k in kw}
    r = R("r", [1, 2, 3, 4], max_new, **kw)
    return r, run(m.Engine([r], 16, 4, 8, spec_len=4, **engine_kw))


def test_m12_n19_an_accepted_run_is_cut_at_a_stop_id() -> None:
    ids = chain([1, 2, 3, 4], 8)
    # step 0 samples ids[0]; step 1's window drafts 4, all accepted: it would append ids[1..5]
    r, recs = spec_run(8, stop_token_ids=(ids[3],))
    t1 = recs[1]
    assert (t1.drafted["r"], t1.accepted["r"], t1.rolled_back["r"]) == (4, 2, 2)
    assert (t1.tokens["r"], dict(t1.sampled), dict(t1.finished)) == (
        tuple(ids[1:4]),
        {"r": STOP},
        {"r": m.FinishReason.STOP},
    )
    assert (r.generated, r.output_ids, r.computed, len(recs)) == (3, ids[:4], 4 + 3, 2)
    # an EOS id is cut the same way; with ignore_eos it is an ordinary token
    r, recs = spec_run(8, eos_token_ids=(ids[3],))
    assert (recs[1].accepted["r"], r.finish_reason, r.output_ids) == (2, m.FinishReason.EOS, ids[:4])
    r, recs = spec_run(8, eos_token_ids=(ids[3],), ignore_eos=True)
    assert (recs[1].accepted["r"], r.finish_reason, r.output_ids) == (4, LENGTH, ids[:8])
    # the cap: max_new 3 drafts 1 at step 1, so ids[3] is never reached ...
    r, recs = spec_run(3, stop_token_ids=(ids[3],))
    assert (recs[1].drafted["r"], r.finish_reason, r.output_ids) == (1, LENGTH, ids[:3])
    # ... while a stop at the last id within the cap still wins over LENGTH
    r, recs = spec_run(3, stop_token_ids=(ids[2],))
    assert (dict(recs[1].sampled), r.finish_reason, r.generated, r.output_ids) == (
        {"r": STOP},
        m.FinishReason.STOP,
        2,
        ids[:3],
    )


def test_m12_n20_ids_are_unique_among_live_requests_only() -> None:
    eng = m.Engine([R("a", [1], 1), R("w", [2], 2, arrival_step=9), R("x", [], 1)], 8, 2, 4)
    assert eng.add_request(R("a", [5], 1)) is Why.DUPLICATE_ID  # a is waiting
    eng.step()  # a finished, w waiting, x rejected
    assert eng.add_request(R("w", [5], 1)) is Why.DUPLICATE_ID
    assert eng.abort("w")
    again = [R("a", [3], 2), R("w", [4], 2), R("x", [6], 2)]
    assert [eng.add_request(r) for r in again] == [None, None, None]
    assert eng.add_request(R("x", [7], 1)) is Why.DUPLICATE_ID  # the new x is live
    run(eng)
    assert [(r.state, r.generated) for r in again] == [(FINISHED, 2)] * 3


@CI
@given(
    w=workloads(
        pool="fits",
        prompts="mixed",
        spec_len=(0, 3),
        scripts=True,
        world_size=(1, 2),
        negatives=True,
        max_new=6,
        arrivals="list_order",  # N27: first come, first served is then m11's list order
    )
)
def test_m12_n21_valid_requests_trace_as_in_m11(w: dict) -> None:
    old, new = build(m11, w, validate=False), build(m, w, validate=False)
    old_recs, new_recs = run(old), run(new)
    assert len(old_recs) == len(new_recs)
    for o, n in zip(old_recs, new_recs):
        j = n.to_json()
        assert (j.pop("rejected"), j.pop("aborted")) == ([], [])
        assert j == o.to_json()
    assert old.summary() == new.summary()


@st.composite
def mayhem(draw: st.DrawFn) -> tuple[dict, dict, list[tuple[int, str]], list[tuple[int, m.Request]]]:
    """A workload with any pool, limits, late offers (valid or not) and aborts at chosen steps.

    Half the workloads roll speculative guesses back across page boundaries: every request fits the
    pool and drafts, pages are small, and every verdict is partial (``scripts="rollback"``), so the
    tail pages a rollback frees are exercised in most of them (a leak there is a bug N22 must catch).
    """
    w = draw(
        st.one_of(
            workloads(pool="any", prompts="shared", spec_len=(0, 2), scripts=True, max_new=5),
            workloads(
                min_requests=1,
                pool="tight",
                prompts="shared",
                budget="large",  # no window is cut short: every decode window drafts
                spec_len=(1, 3),
                page_size=(1, 3),
                scripts="rollback",
                min_new=3,  # a request drafts only from max_new_tokens 3 on
                max_new=6,
            ),
        )
    )
    limits = {key: draw(st.none() | st.integers(1, 4)) for key in ("max_waiting", "max_running", "max_model_len")}
    if limits["max_model_len"] is not None:
        limits["max_model_len"] += 6
    ids = [r["request_id"] for r in w["requests"]] + ["late0", "late1", "ghost"]
    aborts = draw(st.lists(st.tuples(st.integers(0, 8), st.sampled_from(ids)), max_size=4))
    late = draw(
        st.lists(
            st.tuples(
                st.integers(0, 8),
                st.builds(
                    R,
                    st.sampled_from(ids),
                    st.lists(st.integers(0, 3), max_size=9),
                    st.integers(-1, 4),
                    stop_token_ids=st.lists(st.integers(0, 3), max_size=2).map(tuple),
                ),
            ),
            max_size=4,
        )
    )
    return w, limits, aborts, late


def requests_of(w: dict) -> list[m.Request]:
    return [
        R(
            spec["request_id"],
            prompt_tokens(w, i),
            spec["max_new_tokens"],
            arrival_step=spec.get("arrival_step", 0),
            eos_after=spec.get("eos_after"),
            accept_script=list(spec["accept_script"]) if "accept_script" in spec else None,
        )
        for i, spec in enumerate(w["requests"])
    ]


def conserved(eng: m.Engine) -> None:
    """Page conservation: free + private + cache-owned = num_pages, every private page in its owner's table."""
    eng.check_invariants()
    free, private, cached = ownership(eng)
    assert free + private + cached == eng.pool.num_pages and free == len(eng.pool.free)
    held = [p for r in eng.requests for p in r.page_table if eng.pool.owner[p] is not m.CACHE]
    assert sorted(held) == [p for p, o in enumerate(eng.pool.owner) if isinstance(o, str)], "a private page leaked"


# A guess rolled back across a page boundary: step 1's window (positions 2..5) takes pages 1 and 2, all
# three guesses are rejected, and the frontier 3 needs two pages, so page 2 must go back to the free list.
_ROLLBACK = (
    {
        "engine": {"max_step_tokens": 8, "page_size": 2, "num_pages": 4, "spec_len": 3, "world_size": 1},
        "requests": [{"request_id": "r0", "tokens": [1, 2], "max_new_tokens": 5, "accept_script": [0, 1]}],
    },
    {"max_waiting": None, "max_running": None, "max_model_len": None},
    [],
    [],
)


@CI
@example(case=_ROLLBACK)
@given(case=mayhem())
def test_m12_n22_every_request_ends_finished_rejected_or_aborted(case: tuple) -> None:
    w, limits, aborts, late = case
    eng = m.Engine(requests_of(w), **engine_of(w), **limits)
    conserved(eng)
    for step in range(10):
        for when, rid in aborts:
            if when == step:
                eng.abort(rid)
                conserved(eng)
        for when, r in late:
            if when == step:
                eng.add_request(r)
                conserved(eng)
        eng.step()
        conserved(eng)
    run(eng, on_step=lambda rec: conserved(eng))
    assert {r.state for r in eng.requests} <= {FINISHED, REJECTED, ABORTED}
    assert all(o is None or o is m.CACHE for o in eng.pool.owner)
    assert len(eng.pool.free) + sum(o is m.CACHE for o in eng.pool.owner) == eng.pool.num_pages
    conserved(eng)


# ---- regressions: each was a bug in m12, found by these tests ---------------------------------------------


def test_m12_n20_a_reused_id_does_not_inherit_the_executor_state() -> None:
    eng = m.Engine([R("x", [1, 2, 3, 4], 3, eos_after=1, accept_script=[0])], 16, 4, 8, spec_len=2)
    run(eng)
    fresh = R("x", [1, 2, 3, 4], 3)
    assert eng.add_request(fresh) is None
    recs = run(eng)
    assert (fresh.finish_reason, fresh.generated) == (LENGTH, 3)
    assert [t.accepted["x"] for t in recs if "x" in t.accepted] == [1]  # no leftover verdict 0


def test_m12_n2_a_request_object_offered_twice_is_a_caller_error() -> None:
    eng = m.Engine([R("a", [1, 2], 3)], 16, 4, 8, max_waiting=1)
    b = R("b", [3, 4], 2)
    assert eng.add_request(b) is Why.OVERLOADED
    eng.step()
    with pytest.raises(ValueError, match="offered before"):
        eng.add_request(b)
    assert (b.state, eng.abort("b")) == (REJECTED, False)
    assert eng.add_request(R("b", [3, 4], 2)) is None  # a new object with the same id is fine
    run(eng)
    eng.check_invariants()


def test_m12_n8_every_rejection_has_a_trace_entry() -> None:
    eng = m.Engine([], 16, 4, 8)
    assert eng.add_request(R("q", [], 1)) is Why.EMPTY_PROMPT
    assert eng.add_request(R("q", [1], -1)) is Why.BAD_MAX_NEW_TOKENS
    recs = run(eng)
    assert [list(t.rejected) for t in recs] == [[("q", Why.EMPTY_PROMPT), ("q", Why.BAD_MAX_NEW_TOKENS)]]


def test_m12_n23_drop_finished_lets_go_of_requests_that_left() -> None:
    eng = m.Engine([R("a", [1, 2], 1), R("b", [3, 4], 5), R("e", [], 1)], 16, 4, 8)
    eng.step()  # a finishes, e's refusal is recorded, b runs
    r = R("x", [5, 6], 2)
    eng.add_request(R("bad", [7], -1))  # refused, not yet recorded
    assert eng.abort("b")  # aborted, not yet recorded
    assert eng.add_request(r) is None
    gone = eng.drop_finished()
    assert [g.request_id for g in gone] == ["a", "e"]
    assert [q.request_id for q in eng.requests] == ["b", "bad", "x"]
    eng.step()  # records bad's refusal and b's abort
    assert [g.request_id for g in eng.drop_finished()] == ["b", "bad"]
    run(eng)
    assert [g.request_id for g in eng.drop_finished()] == ["x"] and eng.requests == [] and eng.summary() == []
    with pytest.raises(ValueError, match="offered before"):
        eng.add_request(r)  # a dropped object carries its old state
    assert eng.add_request(R("x", [5, 6], 2)) is None
    eng.check_invariants()


def shared_prefix() -> list[m.Request]:
    """p and r share 3 blocks of 2 (positions 0..5), r's usable cap ⌊(7 − 1)/2⌋; x shares nothing."""
    return [R("p", [1, 2, 3, 4, 5, 6, 7], 2), R("r", [1, 2, 3, 4, 5, 6, 9], 1), R("x", [8, 8, 8], 1)]


def holds(rec: m.StepRecord) -> list[str]:
    return [line for line in rec.explain if "held back" in line]


def holds_line(rid: str, holder: str, s: int, h: int) -> str:
    """The ``explain`` line of a hold: ``s`` shared blocks, ``h`` of them cached."""
    return (
        f"{rid} is held back: {holder} is still computing the {s} prompt block(s) they share ({h} cached); "
        f"{rid} will reuse them once they are published."
    )


def test_m12_n24_a_request_is_held_until_the_prefix_it_shares_is_published() -> None:
    # budget 4, pages of 2: p computes positions 0..3 at step 0 (publishing 2 blocks), 4..6 at step 1 (block 2)
    eng = m.Engine(shared_prefix(), 4, 2, 16, hold_shared_prefix=True)
    recs = run(eng)
    assert [t.admitted for t in recs] == [("p", "x"), (), ("r",)]  # x, behind the held r, goes in at once
    assert [dict(t.executed) for t in recs] == [{"p": 4}, {"p": 3, "x": 1}, {"p": 1, "r": 1, "x": 2}]
    assert [dict(t.published) for t in recs] == [{"p": 2}, {"p": 1}, {"x": 1}]
    assert [dict(t.reused) for t in recs] == [{}, {}, {"r": 6}]  # all 3 shared blocks: r computes position 6 only
    assert [holds(t) for t in recs] == [[holds_line("r", "p", 3, 0)], [holds_line("r", "p", 3, 2)], []]
    assert [r.output_ids for r in eng.requests] == [
        chain([1, 2, 3, 4, 5, 6, 7], 2),
        chain([1, 2, 3, 4, 5, 6, 9], 1),
        chain([8, 8, 8], 1),
    ]
    # without the hold r adopts p's 2 published blocks at step 1 and computes positions 4, 5 and 6 itself
    off = run(m.Engine(shared_prefix(), 4, 2, 16))
    assert [t.admitted for t in off] == [("p", "r", "x"), (), (), ()]
    assert [dict(t.reused) for t in off] == [{}, {"r": 4}, {}, {}]
    assert sum(t.executed.get("r", 0) for t in off) == 3
    # a request admitted earlier in the same walk holds, as p does above; one that shares nothing beyond the
    # cache, a 0-token one, one without a usable block, and any request with prefix caching off are never held
    late = [R("q", [1, 2, 3, 4, 5, 6, 8], 1), R("z", [1, 2, 3, 4, 5, 6, 7], 0), R("s", [1, 2], 1)]
    eng = m.Engine([R("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)], 4, 2, 16, hold_shared_prefix=True)
    eng.step()  # p published blocks 0 and 1; q shares 3 blocks with p but may use only 3, one more than cached
    for r in late:
        eng.add_request(r)
    t1 = eng.step()
    assert (t1.admitted, holds(t1)) == (("z", "s"), [holds_line("q", "p", 3, 2)])
    t2 = eng.step()  # p has computed block 2 (positions 4, 5): q's 3 blocks are all cached
    assert (t2.admitted, dict(t2.reused)) == (("q",), {"q": 6})
    cold = m.Engine(shared_prefix(), 4, 2, 16, prefix_caching=False, hold_shared_prefix=True)
    assert run(cold)[0].admitted == ("p", "r", "x")


def test_m12_n25_a_hold_never_stops_a_request_or_changes_its_ids() -> None:
    # preempted: a, admitted at step 0 and so the anchor (first come, first served, D9), decodes at step 2 and
    # needs a page when p (arriving at step 1, computing 4 of its 7 prompt tokens there) needs 2 more: p, admitted
    # after a, is the victim, and a's page is p's block 1 (page 4), evicted; at step 3 p, at 0, still holds r
    def pressed() -> list[m.Request]:
        return [
            R("a", [8, 8, 8, 8, 8, 9], 2),
            R("p", [1, 2, 3, 4, 5, 6, 7], 1, arrival_step=1),
            R("r", [1, 2, 3, 4, 5, 6, 9], 1, arrival_step=1),
        ]

    eng = m.Engine(pressed(), 5, 2, 5, hold_shared_prefix=True)
    recs = run(eng)
    assert (recs[2].preempted, recs[2].evicted) == (("p",), (4,))
    assert [holds(t) for t in recs[:4]] == [[]] + [[holds_line("r", "p", 3, h)] for h in (0, 2, 1)]  # p at 0 holds on
    assert (recs[3].reused, recs[4].admitted, recs[4].reused["r"]) == ({"p": 2}, ("r",), 6)
    assert [r.state for r in eng.requests] == [FINISHED] * 3
    off = m.Engine(pressed(), 5, 2, 5)
    run(off)
    assert [r.output_ids for r in eng.requests] == [r.output_ids for r in off.requests]
    assert [r.output_ids for r in eng.requests] == [chain(r.tokens, r.max_new_tokens) for r in eng.requests]
    # aborted: r is let in at the next step and reuses what p published
    eng = m.Engine(shared_prefix()[:2], 4, 2, 16, hold_shared_prefix=True)
    assert eng.step().admitted == ("p",)
    assert eng.abort("p")
    t1 = eng.step()
    assert (t1.admitted, dict(t1.reused), holds(t1)) == (("r",), {"r": 4}, [])
    eng.check_invariants()
    # off: m11's trace, field for field
    old = m11.Engine([m11.Request(r.request_id, r.tokens, r.max_new_tokens) for r in shared_prefix()], 4, 2, 16)
    new = m.Engine(shared_prefix(), 4, 2, 16, hold_shared_prefix=False)
    for o, n in zip(run(old), run(new), strict=True):
        j = n.to_json()
        assert (j.pop("rejected"), j.pop("aborted")) == ([], [])
        assert j == o.to_json()


def stepped(eng: m.Engine, stop: Callable[[str, tuple[int, ...]], int | None] | None) -> m.StepRecord:
    """One step as a caller with a stop check makes it: schedule, the engine's executor, commit."""
    return eng.commit(eng.executor.execute(eng.schedule()), stop)


def test_m12_n26_a_stop_from_outside_keeps_a_prefix_of_what_was_appended() -> None:
    a, b = R("a", [1, 2, 3], 9, accept_script=[3]), R("b", [4, 5], 9)
    eng = m.Engine([a, b], 16, 2, 16, spec_len=3)
    asked: list[tuple[str, tuple[int, ...]]] = []

    def stop(rid: str, ids: tuple[int, ...]) -> int | None:
        asked.append((rid, ids))
        return 2 if rid == "a" and len(asked) > 2 else None

    first = stepped(eng, stop)
    assert asked == [("a", first.tokens["a"]), ("b", first.tokens["b"])]  # work order, exactly the ids
    rec = stepped(eng, stop)  # a's window: 3 guesses accepted + 1 sampled = 4 ids, 2 kept
    ids = chain([1, 2, 3], 5)
    assert asked[2] == ("a", tuple(ids[1:5]))
    assert rec.tokens["a"] == tuple(ids[1:3]) and rec.tokens["b"] == asked[3][1]
    assert (rec.drafted["a"], rec.accepted["a"], rec.rolled_back["a"]) == (3, 1, 2)
    assert dict(rec.finished) == {"a": m.FinishReason.STOP} and rec.sampled["a"] is TOKEN
    assert (a.state, a.finish_reason, a.output_ids, a.generated) == (FINISHED, m.FinishReason.STOP, ids[:3], 3)
    assert a.computed == a.target == 6 and a.page_table == []
    assert "a" not in eng.pool.owner  # a's private pages came back
    assert "a" not in eng.live and b.state is RUNNING
    run(eng)
    assert b.generated == 9  # b never noticed


def test_m12_n26_a_stop_relabels_a_request_that_ended_in_the_same_step() -> None:
    # ended on its length: every id kept, STOP instead of LENGTH, generated unchanged
    a = R("a", [1, 2], 1)
    eng = m.Engine([a], 8, 2, 8)
    rec = stepped(eng, lambda rid, ids: len(ids))
    assert dict(rec.finished) == {"a": m.FinishReason.STOP} and rec.tokens["a"] == tuple(chain([1, 2], 1))
    assert (a.generated, a.output_ids) == (1, chain([1, 2], 1))
    # ended on a stop id: the stop id is dropped, and it had never been counted
    stop_id = chain([1, 2], 2)[1]
    c = R("c", [1, 2], 5, stop_token_ids=(stop_id,))
    eng = m.Engine([c], 8, 2, 8)
    stepped(eng, None)
    rec = stepped(eng, lambda rid, ids: 0)
    assert rec.sampled["c"] is STOP and dict(rec.finished) == {"c": m.FinishReason.STOP}
    assert (rec.tokens["c"], c.output_ids, c.generated, c.computed) == ((), chain([1, 2], 1), 1, 3)
    eng.check_invariants()
    assert ownership(eng)[1] == 0


def test_m12_n26_keep_outside_the_appended_ids_is_refused() -> None:
    for keep in (-1, 2):
        a = R("a", [1, 2], 4)
        eng = m.Engine([a], 8, 2, 8)
        with pytest.raises(ValueError, match=r"keep 0\.\.1"):
            stepped(eng, lambda rid, ids, keep=keep: keep)


@CI
@given(w=workloads(pool="tight", prompts="shared", spec_len=(0, 3), scripts=True, max_new=6))
def test_m12_n26_no_stop_is_step(w: dict) -> None:
    plain, asked = build(m, w, validate=False), build(m, w, validate=False)
    for _ in range(200):
        if not asked.live:
            break
        mine = stepped(asked, lambda rid, ids: None)
        assert mine.to_json() == plain.step().to_json()
    assert asked.summary() == plain.summary()


@CI
@given(
    w=workloads(min_requests=1, pool="tight", prompts="shared", spec_len=(0, 3), scripts=True, max_new=6),
    cuts=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), max_size=6),
)
def test_m12_n26_stopped_requests_keep_exactly_their_ids_and_return_their_pages(w: dict, cuts: list) -> None:
    eng = build(m, w, validate=False)
    by_id = {r.request_id: r for r in eng.requests}
    plan = {f"r{i}": k for i, k in cuts}
    expected: dict[str, list[int]] = {}  # a stopped request's output: what it had, then the ids it kept

    def stop(rid: str, ids: tuple[int, ...]) -> int | None:
        if rid not in plan:
            return None
        keep = min(plan[rid], len(ids))
        had = by_id[rid].output_ids
        assert had[len(had) - len(ids) :] == list(ids)  # the ids asked about are the ones just appended
        expected[rid] = had[: len(had) - len(ids)] + list(ids[:keep])
        return keep

    for _ in range(200):
        if not eng.live:
            break
        rec = stepped(eng, stop)
        eng.check_invariants()
        for rid in expected.keys() & rec.finished.keys():
            r = by_id[rid]
            assert rec.finished[rid] is m.FinishReason.STOP and r.state is FINISHED
            assert (
                r.output_ids == expected[rid]
                and list(rec.tokens[rid]) == expected[rid][len(expected[rid]) - len(rec.tokens[rid]) :]
            )
            assert r.computed <= r.target and not r.page_table
    assert not eng.live
    assert ownership(eng)[1] == 0  # every stopped request returned its pages


def starving(rung: Any) -> list[Any]:
    """Issue 31's reproducer, smaller: r0 … r4 (4-token prompts, 12 tokens each) arrive one per step from step 1,
    and early, listed last, arrives first (step 0) and wants 10 tokens; budget 4, pages of 4, pages for all."""
    R_ = rung.Request
    late = [R_(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], 12, arrival_step=i + 1) for i in range(5)]
    return [*late, R_("early", [1, 2, 3, 4], 10)]


def test_m12_n27_first_come_first_served_whatever_the_list_order() -> None:
    eng = m.Engine(starving(m), 4, 4, 64)
    recs = run(eng)
    # early, admitted first, leads every step's walk: its prefill at step 0, then one decode token per step
    # until its 10th token at step 9, whoever arrives; the others follow in the order they arrived
    early = [t.step for t in recs if "early" in t.scheduled]
    assert early == list(range(10)) and all(t.scheduled[0] == "early" for t in recs[:10])
    assert [dict(t.executed).get("early") for t in recs[:10]] == [4] + [1] * 9
    assert recs[9].finished == {"early": LENGTH}
    assert [t.admitted for t in recs[:6]] == [("early",), ("r0",), ("r1",), ("r2",), ("r3",), ("r4",)]
    # step 1: r0 gets the 3 tokens early leaves; step 2: r0 its last prompt token, r1 the 2 left
    assert [dict(t.executed) for t in recs[1:3]] == [{"early": 1, "r0": 3}, {"early": 1, "r0": 1, "r1": 2}]
    assert all(
        list(t.scheduled) == sorted(t.scheduled, key=["early", "r0", "r1", "r2", "r3", "r4"].index) for t in recs
    )
    assert [r.request_id for r in eng.requests] == ["r0", "r1", "r2", "r3", "r4", "early"]  # the list is unchanged
    assert [r.output_ids for r in eng.requests] == [chain(r.tokens, r.max_new_tokens) for r in eng.requests]
    # m11 (list order, the original rule): each arrival listed ahead of early takes the budget first; from step 5
    # r0 … r3 take all 4 tokens of every step, and what r0 (done at step 12), r1 (14) and r2 (15) free goes to
    # r4, listed ahead of early, until its prompt is in (step 15): early waits 15 steps
    old = run(m11.Engine(starving(m11), 4, 4, 64))
    assert [t.step for t in old if "early" in t.scheduled][:2] == [0, 16]

    # the victim is the request admitted last: late, listed first, arrives at step 1; at step 2 its position 4
    # needs a page while early (admitted at step 0) holds 2 of the 3 and late the third, so late gives way, and
    # again at steps 3 and 4 (after reusing its cached block) and 5 (where early takes its third page too)
    def tight(rung: Any) -> list[Any]:
        return [rung.Request("late", [5, 6, 7, 8], 4, arrival_step=1), rung.Request("early", [1, 2, 3, 4], 6)]

    eng = m.Engine(tight(m), 8, 4, 3)
    recs = run(eng)
    assert [t.preempted for t in recs] == [(), (), ("late",), ("late",), ("late",), ("late",), (), (), ()]
    assert any(line.endswith("late (the eligible request admitted last) was preempted.") for line in recs[2].explain)
    assert [t.step for t in recs if "early" in t.executed] == [0, 1, 2, 3, 4, 5]  # early is never held up
    assert [dict(t.executed) for t in recs[5:7]] == [{"early": 1}, {"late": 5}]  # late recomputes 4 + 1
    assert [r.output_ids for r in eng.requests] == [chain(r.tokens, r.max_new_tokens) for r in eng.requests]
    old = run(m11.Engine(tight(m11), 8, 4, 3))
    assert [t.preempted for t in old[:5]] == [(), (), ("early",), ("early",), ("early",)]  # m11: the list's last


def issue_31_workload() -> dict[str, Any]:
    """Issue 31's reproducer exactly: r0 … r49 (4-token prompts, 60 tokens each) arrive one per step from
    step 1 and early, listed last, arrives at step 0; budget 8, pages of 4, 2000 pages."""
    late = [{"request_id": f"r{i}", "prompt_len": 4, "max_new_tokens": 60, "arrival_step": i + 1} for i in range(50)]
    return {
        "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 2000},
        "requests": [*late, {"request_id": "early", "prompt_len": 4, "max_new_tokens": 60, "arrival_step": 0}],
    }


def test_m12_n27_issue_31_early_arrival_listed_last_runs_every_step() -> None:
    """The request that arrived first is scheduled at every step from its arrival until it finishes; m11,
    in list order, leaves it out of most of them (m13 and m14 are checked through the CLI, in
    tests/cli/test_cli_workload.py)."""
    eng = build(m, issue_31_workload())
    recs = run(eng, limit=5000)
    early = [t.step for t in recs if "early" in t.scheduled]
    assert early == list(range(60)) and recs[59].finished == {"early": LENGTH}
    assert all(t.scheduled[0] == "early" for t in recs[:60])  # the anchor
    old = run(build(m11, issue_31_workload()), limit=5000)
    old_early = [t.step for t in old if "early" in t.scheduled]
    assert len(old_early) == 60 and old_early[-1] > 400  # m11: starved behind every later-listed arrival
