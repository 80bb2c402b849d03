"""Safety properties of every rung over random workloads.

Each run goes through ``ladder_harness.execute``, which after every step checks the token budget
(m02+), page conservation and ``check_invariants()`` (m03+), ``computed <= target + draft_len`` and
``generated <= max_new_tokens``, the scheduler's work list against the rung's rule, every frontier's
move, the victims' order, D2's own-chain invariant and the trace's internal shape (and m12's door
bookkeeping); it fails a run that goes past a generous step bound.  The properties here add what a
whole run must satisfy: the outcome is "every request FINISHED" or the documented error of that rung
(and with every request fitting the pool on its own, m05+ finish everything), except on m12, which
never raises: its door rejects what can never be served and everything else finishes, exactly as in
the same run without the rejected requests; the JSON trace round-trips with its keys in contract
order, the same workload gives the same trace twice, and negative arrival/EOS values act as 0.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from ladder_harness import (
    CI,
    MODULES,
    SLOW,
    anchor_of,
    check_summary,
    execute,
    fields_of,
    has_door,
    rung_index,
)

from mechserve.conformance.strategies import (
    alone_pages,
    cli_valid,
    door_verdicts,
    engine_of,
    fits_alone,
    prompt_len,
    prompt_tokens,
    workloads,
)
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


ADMISSION = st.one_of(
    workloads(admission=True, prompts="mixed", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True),
    workloads(admission=True, pool="tight", budget="large", prompts="shared", spec_len=(0, 2), scripts=True),
    workloads(admission=True, pool="fits", prompts="mixed", max_new=7, max_requests=7),
)
"""m12 only: workloads with limits, zero-token requests, empty prompts and stop ids."""


def without_rejected(workload: dict, rejected: set[int]) -> dict:
    """``workload`` less the requests at the positions ``rejected``, every prompt pinned as ``tokens``
    (a synthetic prompt depends on the list position, which the removal shifts)."""
    requests = [
        {**{k: v for k, v in spec.items() if k != "prompt_len"}, "tokens": prompt_tokens(workload, i)}
        for i, spec in enumerate(workload["requests"])
        if i not in rejected
    ]
    return {**workload, "requests": requests}


def check_door_outcome(rung: str, workload: dict) -> None:
    """m12 never raises: each request is REJECTED with the reason N3 gives it at the door, else FINISHED.

    The rejections are step 0's ``rejected`` in list order (the constructor offers the requests in
    list order, N1, N8); no record aborts anything; and the accepted requests' trace is exactly that
    of the same workload without the rejected ones (N7), whose step 0 only they could add.  Without
    admission settings the only reason is ``NEVER_FITS``, given exactly when
    ``pages_for(prompt + max_new - 1) > num_pages`` (N4, conservative: even a request ``eos_after``
    would stop in time is refused).
    """
    run = execute(rung, workload)
    assert run.error is None, f"{rung} raised {run.error!r}"
    verdicts = door_verdicts(workload)
    eng = engine_of(workload)
    for r, spec, why in zip(run.engine.requests, workload["requests"], verdicts, strict=True):
        got = r.reject_reason.value if r.reject_reason is not None else None
        assert got == why, (r.request_id, got, why)
        assert r.state.value == ("REJECTED" if why else "FINISHED"), (r.request_id, r.state)
        if "max_model_len" not in eng and prompt_len(spec) and spec["max_new_tokens"] > 0:
            assert (why == "NEVER_FITS") == (alone_pages(spec, eng["page_size"]) > eng["num_pages"]), spec
    check_summary(run)
    refused = [[spec["request_id"], why] for spec, why in zip(workload["requests"], verdicts) if why]
    trace = run.trace
    assert [rec["rejected"] for rec in trace] == ([refused] + [[]] * (len(trace) - 1) if trace else []), trace
    assert all(rec["aborted"] == [] for rec in trace)
    rest = execute(rung, without_rejected(workload, {i for i, why in enumerate(verdicts) if why}))
    assert rest.error is None and all(rec["rejected"] == [] for rec in rest.trace)
    if not rest.records:  # nothing was accepted: one record, holding only the rejections (N16)
        assert len(trace) == (1 if refused else 0)
        assert all(not v for rec in trace for k, v in rec.items() if k not in ("step", "rejected"))
    else:
        assert [{**rec, "rejected": []} for rec in trace] == rest.trace
    accepted = [r.request_id for r, why in zip(run.engine.requests, verdicts) if not why]
    assert [r.request_id for r in rest.engine.requests] == accepted
    assert [s for s in run.engine.summary() if s["request_id"] in accepted] == rest.engine.summary()


def check_outcome(rung: str, workload: dict) -> None:
    """Every request ends FINISHED, or the run raised the error documented for this rung."""
    if has_door(rung):
        check_door_outcome(rung, workload)
        return
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
    reasons = MODULES[rung].RejectReason.__members__ if has_door(rung) else {}
    for rec in first.trace:
        assert tuple(rec) == fields_of(rung)
        assert json.loads(json.dumps(rec)) == rec
        if has_door(rung):  # N15: [id, reason name] pairs, and ids
            assert all(type(e) is list and len(e) == 2 and e[1] in reasons for e in rec["rejected"]), rec
            assert all(type(rid) is str for rid in rec["aborted"]), rec
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
    """A request longer than the budget and the pool: m02/m03 never fits, m04 runs dry, m05-m11
    Irreducible, and m12 (and every rung above it) raises nothing: its door rejects it (NEVER_FITS), reported in step 0's
    only record, while a request beside it that fits is served as if alone."""
    workload = {
        "engine": {"max_step_tokens": 4, "page_size": 2, "num_pages": 2},
        "requests": [{"request_id": "big", "prompt_len": 9, "max_new_tokens": 2}],
    }
    runs = [execute(rung, workload) for rung in RUNGS]
    got = [run.error_name for run in runs]
    assert got == [None, None, "RuntimeError", "RuntimeError", "OutOfPages"] + ["Irreducible"] * 7 + [None] * 5, got
    m12 = runs[RUNGS.index("m12_admission_control")]
    assert [(r.state.value, r.reject_reason.value) for r in m12.engine.requests] == [("REJECTED", "NEVER_FITS")]
    assert [(rec["step"], rec["rejected"], rec["admitted"]) for rec in m12.trace] == [(0, [["big", "NEVER_FITS"]], [])]
    # Exactly at the bound (frontier 2 + 3 - 1 = 4 positions on 2 pages of 2) it is accepted and served.
    edge = {**workload, "requests": [{"request_id": "edge", "prompt_len": 2, "max_new_tokens": 3}]}
    assert execute("m12_admission_control", edge).engine.summary()[0]["state"] == "FINISHED"
    # One token more is refused, even though eos_after 0 would end it after one page (m11 serves it).
    over = {**edge, "requests": [{**edge["requests"][0], "max_new_tokens": 4, "eos_after": 0}]}
    assert execute("m11_parallelism", over).engine.summary()[0]["finish_reason"] == "EOS"
    assert execute("m12_admission_control", over).engine.requests[0].reject_reason.value == "NEVER_FITS"
    beside = {
        **workload,
        "requests": [{"request_id": "ok", "prompt_len": 3, "max_new_tokens": 2}, *workload["requests"]],
    }
    check_door_outcome("m12_admission_control", beside)


DOOR_RUNGS = [r for r in RUNGS if has_door(r)]


@pytest.mark.parametrize("rung", DOOR_RUNGS)
@CI
@given(workload=ADMISSION)
def test_door_outcome_and_trace_with_admission_settings(rung: str, workload: dict) -> None:
    check_door_outcome(rung, workload)
    check_json_and_determinism(rung, workload)


@pytest.mark.slow
@pytest.mark.parametrize("rung", DOOR_RUNGS)
@SLOW
@given(workload=ADMISSION)
def test_door_outcome_and_trace_with_admission_settings_slow(rung: str, workload: dict) -> None:
    check_door_outcome(rung, workload)
    check_json_and_determinism(rung, workload)


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
