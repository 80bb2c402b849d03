"""Pins every numbered line of mech-notes/10-executor-boundary.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m09_speculative_decode as m09
from mechserve.spec import m10_executor_boundary as m

R = m.Request
Plan = tuple[m.PlanItem, ...]
Outcomes = tuple[m.Outcome, ...]
EOS = m.EOS_TOKEN_ID
st = m.scripted_token


def run(eng, limit: int = 200) -> list:
    """``eng.run()``, failing instead of hanging when the run never stops."""

    def watch(rec) -> None:
        assert rec.step < limit, "run() did not stop"

    return eng.run(on_step=watch)


def local(requests: list[m.Request]) -> m.LocalExecutor:
    return m.LocalExecutor(
        {r.request_id: r.accept_script for r in requests if r.accept_script is not None},
        {r.request_id: r.eos_after for r in requests if r.eos_after is not None},
    )


class Recorder:
    """The scripted executor, keeping every plan and answer."""

    def __init__(self, requests: list[m.Request]) -> None:
        self.inner = local(requests)
        self.log: list[tuple[Plan, Outcomes]] = []

    def execute(self, plan: Plan) -> Outcomes:
        out = self.inner.execute(plan)
        self.log.append((plan, out))
        return out


def snapshot(eng: m.Engine) -> tuple:
    """Everything the control side could have applied."""
    return (
        eng.step_counter,
        [(r.computed, r.generated, list(r.output_ids), list(r.page_table), r.draft_len, r.state) for r in eng.requests],
        [list(r.accept_script or []) for r in eng.requests],
        [list(s) for s in eng.pool.slots],
        list(eng.pool.free),
        list(eng.pool.owner),
        eng.cache.size,
    )


class Faulty:
    """The scripted executor whose answer at call ``at`` is rewritten by ``breaks``."""

    def __init__(self, requests: list[m.Request], at: int, breaks: Callable[[Plan, Outcomes], Outcomes]) -> None:
        self.inner, self.at, self.breaks = local(requests), at, breaks
        self.calls = 0
        self.engine: m.Engine | None = None
        self.before: tuple | None = None

    def execute(self, plan: Plan) -> Outcomes:
        out = self.inner.execute(plan)
        if self.calls == self.at:
            assert self.engine is not None
            self.before = snapshot(self.engine)
            out = self.breaks(plan, out)
        self.calls += 1
        return out


def edit(out: Outcomes, i: int, **changes: object) -> Outcomes:
    return tuple(dataclasses.replace(o, **changes) if k == i else o for k, o in enumerate(out))


def pair(at: int, breaks: Callable[[Plan, Outcomes], Outcomes], budget: int = 8) -> tuple[m.Engine, Faulty]:
    """a and b prefill at step 0 and run decode windows of 1 + 2 at step 1."""
    reqs = [R("a", [1, 2, 3], 5), R("b", [4, 5], 5)]
    faulty = Faulty(reqs, at, breaks)
    eng = m.Engine(reqs, budget, 2, 8, spec_len=2, executor=faulty)
    faulty.engine = eng
    return eng, faulty


def refused(eng: m.Engine, faulty: Faulty, step: int, match: str) -> None:
    for _ in range(step):
        eng.step()
    with pytest.raises(m.BoundaryViolation, match=match):
        eng.step()
    assert faulty.before is not None
    assert snapshot(eng) == faulty.before
    assert eng.step_counter == step


def test_m10_n1_one_plan_item_per_post_preemption_work_item_in_work_order() -> None:
    # 09-d1-recompute-not-speculative: at step 2, a is scheduled, then preempted
    reqs = [R("b", [0], 4), R("a", [1000], 3)]
    rec = Recorder(reqs)
    eng = m.Engine(reqs, 2, 1, 5, executor=rec, prefix_caching=False)
    trace = run(eng)
    assert trace[2].scheduled == ("b", "a") and trace[2].preempted == ("a",)
    plan, _ = rec.log[2]
    assert [(i.request_id, i.start_position, i.num_tokens, i.draft_len) for i in plan] == [("b", 2, 1, 0)]
    assert plan[0].page_table == (0, 2, 4)  # taken in residency, before the plan was frozen
    assert [[i.request_id for i in p] for p, _ in rec.log] == [["b", "a"], ["b", "a"], ["b"], ["b", "a"], ["a"]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan[0].num_tokens = 9  # type: ignore[misc]
    # draft_len travels too
    c = R("c", [1, 2], 9)
    rec = Recorder([c])
    eng = m.Engine([c], 8, 2, 8, spec_len=3, executor=rec)
    eng.step()
    eng.step()
    item = rec.log[1][0][0]
    assert (item.start_position, item.num_tokens, item.draft_len, item.page_table) == (2, 4, 3, (0, 1, 2))


def test_m10_n2_decode_marks_exactly_the_decode_windows() -> None:
    reqs = [R("b", [0], 4), R("a", [1000], 3)]
    rec = Recorder(reqs)
    run(m.Engine(reqs, 2, 1, 5, executor=rec, prefix_caching=False))
    flags = [[(i.request_id, i.start_position, i.decode) for i in plan] for plan, _ in rec.log]
    assert flags == [
        [("b", 0, False), ("a", 0, False)],  # prompt chunks
        [("b", 1, True), ("a", 1, True)],
        [("b", 2, True)],
        [("b", 3, True), ("a", 0, False)],  # a recomputes its prompt after preemption
        [("a", 1, False)],  # a recomputes its generated tokens: not a decode window (D1)
    ]


def test_m10_n3_placements_translate_every_position() -> None:
    c = R("c", [1, 2, 3], 9)
    rec = Recorder([c])
    eng = m.Engine([c], 8, 2, 8, spec_len=2, executor=rec)
    eng.step()
    eng.step()
    first, second = rec.log[0][0][0], rec.log[1][0][0]
    assert first.placements == ((0, 0, 0), (1, 0, 1), (2, 1, 0))
    assert second.page_table == (0, 1, 2)
    assert second.placements == ((3, 1, 1), (4, 2, 0), (5, 2, 1))


def test_m10_n4_known_token_ids_sample_and_generated_travel_in_the_plan() -> None:
    reqs = [R("b", [0], 4), R("a", [1000], 3)]
    rec = Recorder(reqs)
    eng = m.Engine(reqs, 2, 1, 5, executor=rec, prefix_caching=False)
    run(eng)
    a_ids = reqs[1].output_ids
    items = [(i.token_ids, i.sample, i.generated) for plan, _ in rec.log for i in plan if i.request_id == "a"]
    assert items == [
        ((1000,), True, 0),  # the prompt
        ((a_ids[0],), True, 1),  # a decode window carries only the last sampled id
        ((1000,), False, 2),  # recomputing the prompt: ends before the target, does not sample
        ((a_ids[0], a_ids[1]), True, 2),  # recomputing the sampled ids, then sampling the next
    ]
    # a prompt chunk that stops short
    c = R("c", [7, 8, 9], 2)
    rec = Recorder([c])
    eng = m.Engine([c], 2, 4, 4, spec_len=3, executor=rec)
    eng.step()
    item = rec.log[0][0][0]
    assert (item.token_ids, item.sample, item.decode) == ((7, 8), False, False)


def test_m10_n5_the_local_executor_consumes_the_requests_own_scripts() -> None:
    a = R("a", [1, 2], 9, accept_script=[7, -2, 1])
    b = R("b", [3, 4], 9)
    eng = m.Engine([a, b], 16, 2, 16, spec_len=2)
    ex = eng.executor
    assert isinstance(ex, m.LocalExecutor)
    assert ex.scripts["a"] is a.accept_script and "b" not in ex.scripts
    eng.step()  # prompt chunks consume nothing
    assert a.accept_script == [7, -2, 1]
    s1 = eng.step()
    assert a.accept_script == [-2, 1]
    assert (dict(s1.drafted), dict(s1.accepted)) == ({"a": 2, "b": 2}, {"a": 2, "b": 2})  # 7 -> 2; b: all
    s2 = eng.step()
    assert a.accept_script == [1] and s2.accepted["a"] == 0  # -2 -> 0
    # the executor on its own: a plan item it is handed directly
    plan = (m.PlanItem("x", 5, 3, 2, True, (), (9,), True, 1, ()),)
    alone = m.LocalExecutor({"x": [1, 4]}, {})
    assert alone.execute(plan)[0].accepted_draft_tokens == 1
    assert alone.execute(plan)[0].accepted_draft_tokens == 2
    assert alone.execute(plan)[0].accepted_draft_tokens == 2  # used up: accept all
    chunk = (m.PlanItem("x", 0, 3, 0, False, (), (1, 2, 3), True, 0, ()),)
    keep = [5]
    assert m.LocalExecutor({"x": keep}, {}).execute(chunk)[0].accepted_draft_tokens == 0
    assert keep == [5]


def test_m10_n6_the_local_executor_chains_scripted_ids_and_returns_eos_where_rule_s_says() -> None:
    a = R("a", [1, 2, 3], 6)
    eng = m.Engine([a], 8, 4, 8, spec_len=2)
    s0, s1 = eng.step(), eng.step()
    t0 = st(3, 3)
    assert dict(s0.tokens) == {"a": (t0,)}
    t1 = st(t0, 4)
    t2 = st(t1, 5)
    assert dict(s1.tokens) == {"a": (t1, t2, st(t2, 6))}
    assert a.output_ids == [t0, t1, t2, st(t2, 6)]
    assert all(t != EOS for t in a.output_ids)
    # eos_after 2: ids at j with generated + j >= 2 are EOS
    plan = (m.PlanItem("e", 3, 3, 2, True, (), (t0,), True, 1, ()),)
    out = m.LocalExecutor({}, {"e": 2}).execute(plan)[0]
    assert (out.accepted_draft_tokens, out.token_ids) == (2, (st(t0, 4), EOS, EOS))
    assert (out.executed_tokens, out.writes, out.start_position) == (3, (), 3)
    # eos_after 0: the very first sampled id is EOS; a chunk that does not sample appends nothing
    assert m.LocalExecutor({}, {"e": 0}).execute((dataclasses.replace(plan[0], generated=0),))[0].token_ids[0] == EOS
    chunk = m.PlanItem("e", 0, 2, 0, False, ((0, 0, 0), (1, 0, 1)), (1, 2), False, 0, (0,))
    assert m.LocalExecutor({}, {}).execute((chunk,))[0].token_ids == ()
    # a recompute after preemption reproduces the ids: a's last id chains from its id before preemption
    b, a2 = R("b", [0], 4), R("a", [1000], 3)
    run(m.Engine([b, a2], 2, 1, 5))
    x0 = st(1000, 1)
    x1 = st(x0, 2)
    assert a2.output_ids == [x0, x1, st(x1, 3)]


def test_m10_n7_a_wrong_number_of_outcomes_is_refused() -> None:
    eng, faulty = pair(1, lambda plan, out: edit(out, 0, request_id="zz", start_position=99)[:1])
    refused(eng, faulty, 1, r"1 outcome\(s\) for 2 plan item\(s\)")
    eng, faulty = pair(0, lambda plan, out: (*out, out[0]))
    refused(eng, faulty, 0, r"3 outcome\(s\) for 2")


def test_m10_n8_an_outcome_for_another_request_is_refused() -> None:
    # swapped outcomes: request, start and writes all differ; the request check comes first
    eng, faulty = pair(1, lambda plan, out: (out[1], out[0]))
    refused(eng, faulty, 1, "outcome for 'b' where 'a' was planned")
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, request_id="a", start_position=0, executed_tokens=9))
    refused(eng, faulty, 1, "outcome for 'a' where 'b' was planned")


def test_m10_n9_a_frontier_mismatch_is_refused() -> None:
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, start_position=out[1].start_position + 1, executed_tokens=9))
    refused(eng, faulty, 1, r"b: frontier mismatch \(3 != 2\)")


def test_m10_n10_a_token_count_other_than_planned_is_refused() -> None:
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, executed_tokens=2, writes=out[1].writes[:2]))
    refused(eng, faulty, 1, r"b: executed 2 token\(s\), planned 3")


def test_m10_n11_writes_other_than_the_placements_are_refused() -> None:
    def moved(plan: Plan, out: Outcomes) -> Outcomes:
        (p, page, off), *rest = out[1].writes
        return edit(out, 1, writes=((p, page + 1, off), *rest), accepted_draft_tokens=7)

    eng, faulty = pair(1, moved)
    refused(eng, faulty, 1, "b: writes differ")
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, writes=tuple(reversed(out[1].writes))))
    refused(eng, faulty, 1, "b: writes differ")
    eng, faulty = pair(0, lambda plan, out: edit(out, 1, writes=out[1].writes[:-1]))
    refused(eng, faulty, 0, "b: writes differ")


def test_m10_n12_an_acceptance_on_a_non_decode_item_is_refused() -> None:
    # step 0 items are prompt chunks; one id would also be the wrong count for acceptance 1
    eng, faulty = pair(0, lambda plan, out: edit(out, 1, accepted_draft_tokens=1))
    refused(eng, faulty, 0, "b: acceptance reported for a non-decode item")


def test_m10_n13_an_acceptance_outside_the_draft_is_refused() -> None:
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, accepted_draft_tokens=3))
    refused(eng, faulty, 1, r"b: acceptance 3 outside \[0, 2\]")
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, accepted_draft_tokens=-1, token_ids=()))
    refused(eng, faulty, 1, r"b: acceptance -1 outside \[0, 2\]")


def test_m10_n14_the_appended_ids_must_number_accepted_plus_one_or_none() -> None:
    eng, faulty = pair(1, lambda plan, out: edit(out, 1, accepted_draft_tokens=1))  # still 3 ids
    refused(eng, faulty, 1, r"b: 3 token id\(s\) appended, expected 2")
    eng, faulty = pair(0, lambda plan, out: edit(out, 1, token_ids=()))
    refused(eng, faulty, 0, r"b: 0 token id\(s\) appended, expected 1")
    # a prompt chunk that does not sample appends nothing (budget 4: b gets 1 of its 2 prompt tokens)
    eng, faulty = pair(0, lambda plan, out: edit(out, 1, token_ids=(5,)), budget=4)
    refused(eng, faulty, 0, r"b: 1 token id\(s\) appended, expected 0")


def test_m10_n15_nothing_is_applied_when_any_outcome_is_refused() -> None:
    seen: list[tuple] = []

    def last_item_bad(plan: Plan, out: Outcomes) -> Outcomes:
        seen.append(tuple(i.request_id for i in plan))
        return edit(out, len(out) - 1, executed_tokens=0)

    # 02-preemption-anchor at step 2: c is preempted and two of its blocks evicted before the plan
    reqs = [R("a", [0, 1, 2], 6), R("b", [1000, 1001, 1002], 5), R("c", [2000, 2001, 2002, 2003], 3, arrival_step=1)]
    faulty = Faulty(reqs, 2, last_item_bad)
    eng = m.Engine(reqs, 8, 2, 6, executor=faulty)
    faulty.engine = eng
    eng.step()
    eng.step()
    before_step = snapshot(eng)
    with pytest.raises(m.BoundaryViolation):
        eng.step()
    assert seen == [("a", "b")]
    after = snapshot(eng)
    assert after == faulty.before  # item a was valid, yet not applied
    assert after[1][0][:2] == before_step[1][0][:2]  # a: computed and generated untouched
    # what residency did stays: c preempted, its blocks evicted, pages 5 and 4 handed to a and b
    assert (reqs[2].computed, reqs[2].page_table) == (0, [])
    assert (reqs[0].page_table, reqs[1].page_table) == ([0, 1, 5], [2, 3, 4])
    assert eng.step_counter == 2


def test_m10_n16_commit_applies_writes_frontier_and_executed_in_work_order() -> None:
    reqs = [R("a", [1, 2, 3], 5), R("b", [4, 5], 5)]
    rec = Recorder(reqs)
    eng = m.Engine(reqs, 8, 2, 8, spec_len=2, executor=rec)
    s0 = eng.step()
    assert list(s0.executed.items()) == [("a", 3), ("b", 2)]
    assert eng.pool.slots[:3] == [[("a", 0), ("a", 1)], [("a", 2), None], [("b", 0), ("b", 1)]]
    s1 = eng.step()
    outcomes = rec.log[1][1]
    assert [(o.request_id, o.executed_tokens) for o in outcomes] == [("a", 3), ("b", 3)]
    assert list(s1.executed.items()) == [("a", 3), ("b", 3)]
    assert (reqs[0].computed, reqs[1].computed) == (3 + 3, 2 + 3)  # every guess accepted: no rollback
    for out in outcomes:
        for pos, page, off in out.writes:
            assert eng.pool.slots[page][off] == (out.request_id, pos)
    # the kept outcome is what resolve and sampling used
    assert dict(s1.tokens) == {o.request_id: o.token_ids for o in outcomes}


class RealModel:
    """A stand-in for a real executor: the scripted answer with the decode window's ids replaced."""

    def __init__(self, requests: list[m.Request], ids: tuple[int, ...], accepted: int) -> None:
        self.inner, self.ids, self.accepted = local(requests), ids, accepted

    def execute(self, plan: Plan) -> Outcomes:
        out = self.inner.execute(plan)
        return tuple(
            dataclasses.replace(o, accepted_draft_tokens=self.accepted, token_ids=self.ids) if i.decode else o
            for i, o in zip(plan, out)
        )


def test_m10_n17_the_eos_clamp_and_rollback_stay_on_the_control_side() -> None:
    a = R("a", [1, 2], 9, eos_after=2)
    eng = m.Engine([a], 8, 1, 10, spec_len=3, executor=RealModel([a], (11, 12, 13, 14), accepted=3))
    eng.step()
    assert a.page_table == [0, 1] and a.generated == 1
    s1 = eng.step()
    # reported 3 (and no EOS id), kept min(3, eos_after - generated) = 1
    assert (s1.drafted["a"], s1.accepted["a"], s1.rolled_back["a"]) == (3, 1, 2)
    assert (a.computed, a.generated) == (4, 2)
    assert dict(s1.finished) == {"a": m.FinishReason.EOS}  # rule S: generated reached eos_after
    assert dict(s1.tokens) == {"a": (11, 12)}
    assert list(eng.pool.free) == [6, 7, 8, 9, 5, 4, 2, 3]  # tail pages 5, 4 by rollback; then 2, 3 on finish


def test_m10_n18_an_eos_id_cuts_the_accepted_run() -> None:
    a = R("a", [1, 2], 9)
    eng = m.Engine(
        [a], 8, 1, 10, spec_len=3, executor=RealModel([a], (11, EOS, 13, 14), accepted=3), eos_token_ids=(EOS,)
    )
    eng.step()
    first = a.output_ids[0]
    s1 = eng.step()
    assert (s1.drafted["a"], s1.accepted["a"], s1.rolled_back["a"]) == (3, 1, 2)
    assert dict(s1.sampled) == {"a": m.Sample.EOS} and dict(s1.finished) == {"a": m.FinishReason.EOS}
    assert (a.computed, a.generated) == (4, 2)
    assert a.output_ids == [first, 11, EOS]  # 13 and 14 are not kept
    assert dict(s1.tokens) == {"a": (11, EOS)}
    # the scripted EOS id is an ordinary token for a caller's executor unless named
    c = R("c", [1, 2], 9)
    plain = m.Engine([c], 8, 1, 10, spec_len=3, executor=RealModel([c], (11, EOS, 13, 14), accepted=3))
    plain.step()
    assert plain.step().accepted["c"] == 3 and c.generated == 5
    # any configured stop id works the same way
    b = R("b", [1, 2], 9)
    eng = m.Engine([b], 8, 1, 10, spec_len=3, executor=RealModel([b], (11, 12, 77, 14), 3), eos_token_ids=(77,))
    eng.step()
    s1 = eng.step()
    assert (s1.accepted["b"], dict(s1.finished)) == (2, {"b": m.FinishReason.EOS})


def test_m10_n19_resolve_without_verdicts_is_a_boundary_violation() -> None:
    a = R("a", [1, 2], 9)
    eng = m.Engine([a], 8, 2, 8, spec_len=2)
    eng.step()
    work = [(a, 3)]
    with pytest.raises(m.BoundaryViolation):
        eng._resolve(work, None)
    with pytest.raises(m.BoundaryViolation):
        eng._resolve([], None)
    assert (a.computed, a.generated, a.output_ids[1:]) == (2, 1, [])


def test_m10_n19_an_empty_verdict_map_is_no_verdicts() -> None:
    # spec bug: resolve with a verdict map that lacks the planned items raises KeyError, not BoundaryViolation
    a = R("a", [1, 2], 9)
    eng = m.Engine([a], 8, 2, 8, spec_len=2)
    eng.step()
    with pytest.raises(m.BoundaryViolation):
        eng._resolve([(a, 3)], {})


def _pairs(mod) -> list[dict]:
    reqs = [  # 08-preempt-reuse-speculation
        mod.Request("a", [0, 1, 2, 3, 4, 5], 7, accept_script=[0, 3, 3]),
        mod.Request("b", [3, 1, 4, 1, 5, 9, 2, 6, 5], 3, eos_after=2),
        mod.Request("c", [2000, 2001], 2, arrival_step=3),
    ]
    return [rec.to_json() for rec in run(mod.Engine(reqs, 8, 4, 5, spec_len=3))]


def test_m10_n20_the_trace_is_m09s_plus_the_appended_ids() -> None:
    ours, theirs = _pairs(m), _pairs(m09)
    assert [{k: v for k, v in rec.items() if k != "tokens"} for rec in ours] == theirs
    assert any(rec["preempted"] for rec in ours) and any(rec["rolled_back"] for rec in ours)
    for rec in ours:
        assert list(rec["tokens"]) == list(rec["sampled"])
        for rid, ids in rec["tokens"].items():
            assert len(ids) == rec["accepted"].get(rid, 0) + 1
            assert (ids[-1] == EOS) == (rec["sampled"][rid] == "EOS")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(pool="tight", prompts="mixed", spec_len=(0, 3), scripts=True, max_new=6))
def test_m10_n21_a_step_is_schedule_then_the_executor_then_commit(w: dict) -> None:
    whole, halves = build(m, w, validate=False), build(m, w, validate=False)
    theirs = Recorder(list(halves.requests))  # the caller's own executor: the scripted model, logged
    for _ in range(200):
        if not (whole.waiting or whole.running):
            break
        rec = whole.step()
        plan = halves.schedule()
        assert halves.step_counter == rec.step  # the step is open: the counter has not moved
        mine = halves.commit(theirs.execute(plan))
        assert mine.to_json() == rec.to_json() and mine.explain == rec.explain
        assert snapshot(halves)[1:] == snapshot(whole)[1:]
    assert not (halves.waiting or halves.running)
    assert len(theirs.log) == halves.step_counter == whole.step_counter  # one plan executed per record


def test_m10_n21_commit_closes_the_step_once() -> None:
    a = R("a", [1, 2, 3], 3)
    eng = m.Engine([a], 8, 2, 8)
    with pytest.raises(RuntimeError, match="schedule"):
        eng.commit(())  # nothing is open yet
    outcomes = eng.executor.execute(eng.schedule())
    rec = eng.commit(outcomes)
    assert (rec.step, eng.step_counter, dict(rec.executed)) == (0, 1, {"a": 3})
    with pytest.raises(RuntimeError, match="schedule"):
        eng.commit(outcomes)  # closed: the same answer cannot be applied twice
    assert (a.computed, a.generated, eng.step_counter) == (3, 1, 1)


def test_m10_n21_a_refused_answer_closes_the_step() -> None:
    a = R("a", [1, 2, 3], 3)
    eng = m.Engine([a], 8, 2, 8)
    plan = eng.schedule()
    good = eng.executor.execute(plan)
    with pytest.raises(m.BoundaryViolation):
        eng.commit((dataclasses.replace(good[0], executed_tokens=1),))
    with pytest.raises(RuntimeError, match="schedule"):
        eng.commit(good)  # the refused step stays closed; its residency stays (a holds 2 pages)
    assert (eng.step_counter, a.computed, a.page_table) == (0, 0, [0, 1])
    rec = eng.step()
    assert (rec.step, dict(rec.executed), rec.admitted) == (0, {"a": 3}, ())  # admitted in the lost step


def test_m10_n21_schedule_abandons_an_open_step() -> None:
    a, b = R("a", [1, 2, 3, 4], 2), R("b", [5, 6], 2, arrival_step=0)
    eng = m.Engine([a, b], 8, 2, 8)
    first = eng.schedule()  # its executor "fails": no commit
    assert [i.request_id for i in first] == ["a", "b"] and eng.step_counter == 0
    second = eng.schedule()
    assert second == first  # nothing was executed, so the same work is planned again on the same pages
    rec = eng.commit(eng.executor.execute(second))
    assert (rec.step, rec.admitted, dict(rec.executed)) == (0, (), {"a": 4, "b": 2})
    assert eng.step_counter == 1
