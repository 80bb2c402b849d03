"""Pins every numbered line of mech-notes/11-parallelism.md."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from mechserve.spec import m10_executor_boundary as m10
from mechserve.spec import m11_parallelism as m

R = m.Request
Plan = tuple[m.PlanItem, ...]
Outcomes = tuple[m.Outcome, ...]


def run(eng, limit: int = 200) -> list:
    """``eng.run()``, failing instead of hanging when the run never stops."""

    def watch(rec) -> None:
        assert rec.step < limit, "run() did not stop"

    return eng.run(on_step=watch)


def requests(mod=m) -> list:
    """06-world-size-4's workload: speculation, scripts, prefix reuse, a budget-cut window."""
    return [
        mod.Request("p", [5, 6, 7, 8, 9], 8, accept_script=[2, 2]),
        mod.Request("q", [5, 6, 7, 8, 1], 5, arrival_step=1, accept_script=[3, 0]),
    ]


def engine(world_size: int, reqs: list | None = None, **kw: object) -> m.Engine:
    return m.Engine(requests() if reqs is None else reqs, 5, 4, 12, spec_len=3, world_size=world_size, **kw)


def local(reqs: list[m.Request]) -> m.LocalExecutor:
    return m.LocalExecutor(
        {r.request_id: list(r.accept_script) for r in reqs if r.accept_script is not None},
        {r.request_id: r.eos_after for r in reqs if r.eos_after is not None},
    )


class Rank:
    """A rank executor that logs what it is handed; from call ``at`` on, ``breaks`` rewrites its answer."""

    def __init__(self, reqs: list[m.Request], log: list, name: int, at: int = -1, breaks=None) -> None:
        self.inner, self.log, self.name, self.at, self.breaks = local(reqs), log, name, at, breaks
        self.calls = 0

    def execute(self, plan: Plan) -> Outcomes:
        self.log.append((self.name, plan))
        out = self.inner.execute(plan)
        if self.calls == self.at:
            out = self.breaks(out)
        self.calls += 1
        return out


def snapshot(eng: m.Engine) -> tuple:
    return (
        eng.step_counter,
        [(r.computed, r.generated, list(r.output_ids), list(r.page_table), r.state) for r in eng.requests],
        [list(s) for s in eng.pool.slots],
        list(eng.pool.free),
        eng.cache.size,
    )


def test_m11_n1_world_size_is_checked_after_every_m10_check() -> None:
    with pytest.raises(ValueError, match="spec_len"):
        m.Engine([R("a", [], 0)], 0, 0, 0, spec_len=-1, world_size=0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([], 0, 4, 8, world_size=0)
    with pytest.raises(ValueError, match="empty"):
        m.Engine([R("a", [], 1)], 8, 4, 8, world_size=0)
    with pytest.raises(ValueError, match="page_size"):
        m.Engine([], 8, 0, 8, world_size=0)
    with pytest.raises(ValueError, match="world_size"):
        m.Engine([], 8, 4, 8, world_size=0)
    with pytest.raises(ValueError, match="world_size"):
        m.Engine([], 8, 4, 8, world_size=-3)
    with pytest.raises(ValueError, match="2 rank executor"):
        m.Engine([], 8, 4, 8, world_size=3, executors=[local([]), local([])])
    assert m.Engine([], 8, 4, 8).world_size == 1


def test_m11_n2_every_rank_consumes_its_own_copy_of_the_scripts() -> None:
    reqs = requests()
    eng = engine(3, reqs)
    ranks = eng.executor.ranks
    assert len(ranks) == 3 and all(isinstance(r, m.LocalExecutor) for r in ranks)
    lists = [rank.scripts["p"] for rank in ranks]
    assert all(lst == [2, 2] and lst is not reqs[0].accept_script for lst in lists)
    assert len({id(lst) for lst in lists}) == 3
    run(eng)
    assert [r.accept_script for r in reqs] == [[2, 2], [3, 0]]  # untouched
    assert [rank.scripts for rank in ranks] == [{"p": [], "q": []}] * 3  # each copy used up


def test_m11_n3_every_rank_receives_the_identical_plan() -> None:
    reqs = requests()
    log: list = []
    eng = engine(4, reqs, executors=[Rank(reqs, log, k) for k in range(4)])
    s0 = eng.step()
    s1 = eng.step()
    assert [name for name, _ in log] == [0, 1, 2, 3] * 2
    for step in (0, 1):
        plans = [plan for _, plan in log[4 * step : 4 * step + 4]]
        assert all(plan is plans[0] for plan in plans)
    assert [i.request_id for i in log[4][1]] == ["p", "q"]
    assert dict(s1.executed) == {"p": 4, "q": 1} and dict(s0.executed) == {"p": 5}
    # the envelope a rank is sent, and the report it returns
    env = m.Envelope(2, 4, log[4][1])
    assert (env.rank, env.world_size, env.plan) == (2, 4, log[4][1])


def _reports(result: Outcomes, ranks: list[int], world_sizes: list[int]) -> list[m.Report]:
    return [m.Report(k, n, result) for k, n in zip(ranks, world_sizes)]


def _result() -> Outcomes:
    return (m.Outcome("a", 0, 2, 0, ((0, 0, 0), (1, 0, 1)), (7,)),)


def test_m11_n4_the_ranks_must_be_exactly_0_to_n_minus_1() -> None:
    res = _result()
    other = (dataclasses.replace(res[0], token_ids=(8,)),)
    for ranks in ([0, 1], [0, 1, 1], [1, 2, 3], [0, 1, 2, 3, 4], [0, 2, 3, 3], [0, 1, 2, 3, 3]):
        # a wrong world size and a disagreeing result are present too: the rank check comes first
        reps = _reports(res, ranks, [4] * len(ranks))
        reps[-1] = m.Report(reps[-1].rank, 5, other)
        with pytest.raises(m.GroupViolation, match="ranks"):
            m.join(reps, 4)
    assert m.join(_reports(res, [3, 1, 0, 2], [4] * 4), 4) == res  # order of arrival does not matter


def test_m11_n5_every_report_must_carry_the_same_world_size() -> None:
    res = _result()
    other = (dataclasses.replace(res[0], accepted_draft_tokens=1),)
    reps = [m.Report(0, 3, res), m.Report(1, 3, other), m.Report(2, 2, res)]
    with pytest.raises(m.GroupViolation, match="rank 2 reports world size 2, not 3"):
        m.join(reps, 3)


def test_m11_n6_any_disagreement_with_rank_0_fails_without_a_vote() -> None:
    res = _result()
    variants = [
        (),  # count
        (*res, res[0]),
        (dataclasses.replace(res[0], accepted_draft_tokens=1),),
        (dataclasses.replace(res[0], writes=((0, 0, 0), (1, 1, 1))),),
        (dataclasses.replace(res[0], token_ids=(9,)),),
        (dataclasses.replace(res[0], start_position=1),),
    ]
    for odd in variants:
        with pytest.raises(m.GroupViolation, match="rank 3 disagrees"):
            m.join([m.Report(0, 4, res), m.Report(1, 4, res), m.Report(2, 4, res), m.Report(3, 4, odd)], 4)
        # rank 0 is the odd one out: three agreeing ranks do not outvote it
        with pytest.raises(m.GroupViolation, match="disagrees"):
            m.join([m.Report(0, 4, odd), m.Report(1, 4, res), m.Report(2, 4, res), m.Report(3, 4, res)], 4)


def test_m11_n7_the_joined_result_is_rank_0s_and_is_committed_once() -> None:
    res = _result()
    twin = (dataclasses.replace(res[0]),)
    assert twin == res and twin is not res
    assert m.join([m.Report(1, 2, twin), m.Report(0, 2, res)], 2) is res
    reqs = requests()
    log: list = []
    eng = engine(4, reqs, executors=[Rank(reqs, log, k) for k in range(4)])
    s0 = eng.step()
    # five prompt positions computed once, not four times over
    assert dict(s0.executed) == {"p": 5} and reqs[0].computed == 5
    assert eng.pool.slots[0] == [("p", 0), ("p", 1), ("p", 2), ("p", 3)]
    assert len(reqs[0].output_ids) == 1 and reqs[0].generated == 1


def test_m11_n8_a_group_violation_applies_nothing() -> None:
    reqs = requests()
    before: list[tuple] = []

    def diverge(out: Outcomes) -> Outcomes:
        before.append(snapshot(eng))
        return tuple(dataclasses.replace(o, accepted_draft_tokens=0) for o in out)

    log: list = []
    ranks = [Rank(reqs, log, 0), Rank(reqs, log, 1), Rank(reqs, log, 2, at=1, breaks=diverge)]
    eng = engine(3, reqs, executors=ranks)
    eng.step()
    with pytest.raises(m.GroupViolation, match="rank 2 disagrees"):
        eng.step()
    assert snapshot(eng) == before[0]
    assert eng.step_counter == 1
    assert reqs[0].computed == 5 and reqs[0].generated == 1


def _trace(mod, reqs: list, **kw: int) -> tuple[list[dict], list[dict]]:
    eng = mod.Engine(reqs, 5, 4, 12, spec_len=3, **kw)
    return [rec.to_json() for rec in run(eng)], eng.summary()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_m11_n9_world_size_has_no_observable_effect(world_size: int) -> None:
    reference = _trace(m10, requests(m10))
    assert _trace(m, requests(), world_size=world_size) == reference
    assert any(rec["rolled_back"].get("q") for rec in reference[0])
    # with a request that is preempted, reuses and hits EOS (08-preempt-reuse-speculation)
    spec = [
        ("a", [0, 1, 2, 3, 4, 5], 7, {"accept_script": [0, 3, 3]}),
        ("b", [3, 1, 4, 1, 5, 9, 2, 6, 5], 3, {"eos_after": 2}),
        ("c", [2000, 2001], 2, {"arrival_step": 3}),
    ]

    def trace_of(mod, **kw: int) -> tuple[list[dict], list[dict]]:
        reqs = [mod.Request(rid, list(t), n, **copy.deepcopy(extra)) for rid, t, n, extra in spec]
        eng = mod.Engine(reqs, 8, 4, 5, spec_len=3, **kw)
        return [rec.to_json() for rec in run(eng)], eng.summary()

    assert trace_of(m, world_size=world_size) == trace_of(m10)
