"""m12's shared-prefix hold (N24, N25) over random workloads.

Each workload runs twice on m12, with ``hold_shared_prefix`` off and on, from the same requests.  With
the hold on, before every step the admissions are predicted from the requests' tokens alone
(``ladder_harness.predicted_admission``) and must be exactly what the step admits; after every step
the budget holds, ``check_invariants()`` passes and free + private + cache-owned pages = ``num_pages``.
The run must stop within ``step_bound``, every request ends in the state it ends in without the hold
(FINISHED, or REJECTED at the door), with the same output ids, finish reason and ``generated``, and
afterwards every page is free or cache-owned.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI, SLOW, predicted_admission, step_bound

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m12_admission_control as m

SHARED = st.one_of(
    workloads(min_requests=2, pool="fits", prompts="shared", spec_len=(0, 2), scripts=True, world_size=(1, 2)),
    workloads(min_requests=2, pool="tight", budget="any", prompts="shared", max_prompt=12, max_new=4),
    workloads(min_requests=2, pool="fits", prompts="shared", spec_len=(0, 2), scripts=True, admission=True),
    workloads(min_requests=3, max_requests=7, page_size=(1, 2), pool="ample", prompts="shared", max_arrival=1),
)
"""Requests sharing prefixes over a tiny alphabet: chunked by small budgets, preempted in tight pools,
speculating, behind m12's limits, many at once."""


def pages(engine: m.Engine) -> tuple[int, int, int]:
    """(free, private, cache-owned) page counts."""
    owners = engine.pool.owner
    return owners.count(None), sum(isinstance(o, str) for o in owners), owners.count(m.CACHE)


def run_checked(workload: dict[str, Any], hold: bool) -> tuple[m.Engine, list[m.StepRecord]]:
    engine = build(m, workload, validate=False)
    engine.hold_shared_prefix = hold
    bound = step_bound(workload)
    records: list[m.StepRecord] = []
    while engine.waiting or engine.due or engine.running or engine._rejected:
        want = predicted_admission(engine) if hold else None
        rec = engine.step()
        records.append(rec)
        assert len(records) <= bound, "still running past the step bound"
        if want is not None:
            assert rec.admitted == want, (rec.step, rec.admitted, want)
        assert sum(rec.executed.values()) <= engine.max_step_tokens
        engine.check_invariants()
        assert sum(pages(engine)) == engine.pool.num_pages
    return engine, records


def check_same_outcome(workload: dict[str, Any]) -> None:
    off, _ = run_checked(workload, hold=False)
    on, _ = run_checked(workload, hold=True)
    assert [r.state for r in on.requests] == [r.state for r in off.requests]
    assert {r.state for r in on.requests} <= {m.RequestState.FINISHED, m.RequestState.REJECTED}
    for a, b in zip(on.requests, off.requests, strict=True):
        assert (a.output_ids, a.finish_reason, a.generated) == (b.output_ids, b.finish_reason, b.generated), (
            a.request_id
        )
    assert pages(on)[1] == 0, "a private page outlived every request"


@CI
@given(w=SHARED)
def test_m12_hold_finishes_everything_with_the_ids_it_has_without_it(w: dict[str, Any]) -> None:
    check_same_outcome(w)


@pytest.mark.slow
@SLOW
@given(w=SHARED)
def test_m12_hold_finishes_everything_with_the_ids_it_has_without_it_slow(w: dict[str, Any]) -> None:
    check_same_outcome(w)


def test_m12_hold_is_exercised() -> None:
    """The strategy's kind of workload does hold requests: a burst behind one shared prompt."""
    shared = [1, 2, 3, 1, 2, 3, 1, 2]
    w = {
        "engine": {"max_step_tokens": 3, "page_size": 2, "num_pages": 40, "spec_len": 0, "world_size": 1},
        "requests": [{"request_id": f"r{i}", "tokens": [*shared, i], "max_new_tokens": 2} for i in range(4)],
    }
    _, records = run_checked(w, hold=True)
    assert records[0].admitted == ("r0",)
    assert sum("held back" in line for rec in records for line in rec.explain) == 3 * 3  # steps 0..2
    check_same_outcome(w)
