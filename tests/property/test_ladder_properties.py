"""Safety properties of every rung over random workloads.

Each run goes through ``ladder_harness.execute``, which after every step checks the token budget
(m02+), page conservation and ``check_invariants()`` (m03+), ``computed <= target + draft_len`` and
``generated <= max_new_tokens``, the scheduler's work list against the rung's rule, every frontier's
move, the victims' order, D2's own-chain invariant and the trace's internal shape; it fails a run that
goes past a generous step bound.  The properties here add what a whole run must satisfy: the outcome
is "every request FINISHED" or the documented error of that rung (and with every request fitting the
pool on its own, m05+ finish everything), the JSON trace round-trips with its keys in contract order,
the same workload gives the same trace twice, and negative arrival/EOS values act as 0.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from ladder_harness import CI, MODULES, SLOW, anchor_of, check_summary, execute, fields_of, rung_index

from mechserve.conformance.strategies import alone_pages, cli_valid, engine_of, fits_alone, prompt_len, workloads
from mechserve.spec import RUNGS

ANY = st.one_of(
    workloads(prompts="mixed", spec_len=(0, 3), scripts=True, world_size=(1, 3), negatives=True),
    workloads(pool="tight", budget="large", prompts="shared", spec_len=(0, 2), scripts=True),
    workloads(pool="ample", budget="any", prompts="mixed"),
)
"""Workloads of every kind: any budget and pool, shared prefixes, speculation with scripts."""

FITTING = st.one_of(
    workloads(
        min_requests=2, pool="tight", prompts="shared", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True
    ),
    workloads(pool="fits", prompts="mixed", spec_len=(0, 2), scripts=True, max_requests=7),
    workloads(
        min_requests=2, pool="tight", page_size=(1, 2), prompts="shared", max_prompt=6, max_new=6, max_requests=7
    ),
)
"""Workloads in which every request fits the pool on its own, under pressure (preemption, eviction)."""


def check_outcome(rung: str, workload: dict) -> None:
    """Every request ends FINISHED, or the run raised the error documented for this rung."""
    run = execute(rung, workload)
    i = rung_index(rung)
    eng = engine_of(workload)
    reqs = workload["requests"]
    too_long = any(prompt_len(r) > eng["max_step_tokens"] for r in reqs)
    pool_holds_all = sum(alone_pages(r, eng["page_size"]) for r in reqs) <= eng["num_pages"]
    if i == 2 or (i == 3 and pool_holds_all):  # never fits: exactly when a prompt exceeds the budget
        assert (run.error_name == "RuntimeError") == too_long, (run.error, too_long)
    if run.error is None:
        assert all(r.state.value == "FINISHED" for r in run.engine.requests)
        check_summary(run)
        return
    name = run.error_name
    assert i >= 2, f"{rung} raised {run.error!r}"
    if i == 2:
        assert isinstance(run.error, RuntimeError) and too_long, run.error
    elif i == 3:
        assert name in ("RuntimeError", "OutOfPages"), run.error
        assert name != "RuntimeError" or too_long, run.error
        assert name != "OutOfPages" or not pool_holds_all, run.error
    elif i == 4:
        assert name == "OutOfPages" and not pool_holds_all, run.error
    else:
        # m05+: only Irreducible, and only when the anchor alone needs more pages than the pool.
        assert isinstance(run.error, MODULES[rung].Irreducible), f"{rung}: {run.error!r}"
        anchor = next(s for s in reqs if s["request_id"] == anchor_of(run.engine).request_id)
        assert alone_pages(anchor, eng["page_size"]) > eng["num_pages"], run.error
        assert not fits_alone(workload)


@pytest.mark.parametrize("rung", RUNGS)
@CI
@given(workload=ANY)
def test_outcome_is_finished_or_the_documented_error(rung: str, workload: dict) -> None:
    check_outcome(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", RUNGS)
@SLOW
@given(workload=ANY)
def test_outcome_is_finished_or_the_documented_error_slow(rung: str, workload: dict) -> None:
    check_outcome(rung, workload)


def check_fitting_finishes(rung: str, workload: dict) -> None:
    """With every request fitting the pool on its own, m05+ finishes everything: no error, no livelock."""
    run = execute(rung, workload)
    assert run.error is None, f"{rung}: {run.error!r} although every request fits the pool on its own"
    assert all(r.state.value == "FINISHED" for r in run.engine.requests)
    check_summary(run)


FROM_M05 = [r for r in RUNGS if rung_index(r) >= 5]

# D2: the original design raised OutOfPages at step 1 here (MECHANISMS 6.1).
D2_EXAMPLE = {
    "engine": {"max_step_tokens": 16, "page_size": 2, "num_pages": 6, "spec_len": 0, "world_size": 1},
    "requests": [
        {"request_id": "r0", "tokens": [1, 2, 3, 4], "max_new_tokens": 1},
        {"request_id": "r1", "tokens": [1, 2, 3, 4, 5, 6, 7, 8], "max_new_tokens": 4},
    ],
}
# D1: the original design never terminated here, even at spec_len 0.
D1_EXAMPLE = {
    "engine": {"max_step_tokens": 2, "page_size": 1, "num_pages": 5, "spec_len": 0, "world_size": 1},
    "requests": [
        {"request_id": "b", "prompt_len": 1, "max_new_tokens": 4},
        {"request_id": "a", "prompt_len": 1, "max_new_tokens": 3},
    ],
}


@pytest.mark.parametrize("rung", FROM_M05)
@CI
@given(workload=FITTING)
@example(workload=D2_EXAMPLE)
@example(workload=D1_EXAMPLE)
def test_every_request_finishes_when_each_fits_the_pool(rung: str, workload: dict) -> None:
    check_fitting_finishes(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", FROM_M05)
@SLOW
@given(workload=FITTING)
def test_every_request_finishes_when_each_fits_the_pool_slow(rung: str, workload: dict) -> None:
    check_fitting_finishes(rung, workload)


def check_json_and_determinism(rung: str, workload: dict) -> None:
    """The JSON trace round-trips with keys in contract order; a second run gives the same everything."""
    first = execute(rung, workload)
    for rec in first.trace:
        assert tuple(rec) == fields_of(rung)
        assert json.loads(json.dumps(rec)) == rec
    second = execute(rung, workload, check=False)
    assert second.trace == first.trace
    assert (second.error_name, str(second.error)) == (first.error_name, str(first.error))
    assert second.engine.summary() == first.engine.summary()
    summary = json.loads(json.dumps(first.engine.summary()))
    assert summary == first.engine.summary()
    assert [tuple(s) for s in summary] == [("request_id", "state", "generated", "computed", "finish_reason")] * len(
        summary
    )


@pytest.mark.parametrize("rung", RUNGS)
@CI
@given(workload=ANY)
def test_trace_round_trips_and_is_deterministic(rung: str, workload: dict) -> None:
    check_json_and_determinism(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", RUNGS)
@SLOW
@given(workload=ANY)
def test_trace_round_trips_and_is_deterministic_slow(rung: str, workload: dict) -> None:
    check_json_and_determinism(rung, workload)


def test_empty_workload_runs_no_step_on_every_rung() -> None:
    for rung in RUNGS:
        run = execute(rung, {"engine": {}, "requests": []})
        assert run.records == [] and run.error is None


def test_oversized_request_raises_each_rungs_documented_error() -> None:
    """A request longer than the budget and the pool: m02/m03 never fits, m04 runs dry, m05+ Irreducible."""
    workload = {
        "engine": {"max_step_tokens": 4, "page_size": 2, "num_pages": 2},
        "requests": [{"request_id": "big", "prompt_len": 9, "max_new_tokens": 2}],
    }
    got = [execute(rung, workload).error_name for rung in RUNGS]
    assert got == [None, None, "RuntimeError", "RuntimeError", "OutOfPages"] + ["Irreducible"] * 7, got


def check_negatives_behave_like_zero(rung: str, workload: dict) -> None:
    """A negative ``arrival_step`` admits at step 0 and a negative ``eos_after`` acts as 0 (1.4, 1.5).

    D4 makes them CLI errors, so the negative run is built directly and the clamped one through the loader.
    """
    clamped = {
        **workload,
        "requests": [
            {k: max(0, v) if k in ("arrival_step", "eos_after") else v for k, v in spec.items()}
            for spec in workload["requests"]
        ],
    }
    assert cli_valid(clamped)
    negative, zero = execute(rung, workload), execute(rung, clamped)
    assert negative.outcome() == zero.outcome()
    assert negative.engine.summary() == zero.engine.summary()


NEGATIVE = workloads(prompts="mixed", spec_len=(0, 2), scripts=True, negatives=True, min_requests=1)


@pytest.mark.parametrize("rung", RUNGS)
@CI
@given(workload=NEGATIVE)
def test_negative_arrival_and_eos_behave_like_zero(rung: str, workload: dict) -> None:
    check_negatives_behave_like_zero(rung, workload)
