"""Ladder consistency: where a workload does not exercise rung k+1's mechanism, its trace is rung k's.

Traces are compared on the fields rung k has, together with the error type (and therefore the step
it comes at, since a run's records stop there); where rung k+1 adds fields, they are checked to be
empty (or zero) too.  Where the condition is "the mechanism never fired",
the property is stated exactly: rung k+1 agrees with rung k for as rung k ran without needing
the mechanism, and the step where rung k needed it is the step where rung k+1 used it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI, SLOW, execute, fields_of

from mechserve.conformance.strategies import (
    alone_pages,
    engine_of,
    mechanism_idle,
    prompt_tokens,
    workloads,
)

BROAD = dict(prompts="mixed", spec_len=(0, 3), scripts=True, negatives=True)


def assert_same(upper: str, lower: str, workload: dict) -> None:
    """``upper``'s trace and error equal ``lower``'s, on ``lower``'s fields."""
    hi, lo = execute(upper, workload), execute(lower, workload)
    assert hi.outcome(fields_of(lower)) == lo.outcome(), (upper, lower)


# ---- m01 == m00, m06 == m05, m07 == m05: always ---------------------------------------------------------

ALWAYS = [
    ("m01_continuous_batching", "m00_engine_loop"),
    ("m06_prefix_hash", "m05_preemption"),
    ("m07_radix_cache", "m05_preemption"),
]


@pytest.mark.parametrize(("upper", "lower"), ALWAYS)
@CI
@given(workload=st.one_of(workloads(**BROAD), workloads(pool="tight", prompts="shared")))
def test_structural_rungs_change_nothing(upper: str, lower: str, workload: dict) -> None:
    assert_same(upper, lower, workload)


@pytest.mark.slow
@pytest.mark.parametrize(("upper", "lower"), ALWAYS)
@SLOW
@given(workload=st.one_of(workloads(**BROAD), workloads(pool="tight", prompts="shared")))
def test_structural_rungs_change_nothing_slow(upper: str, lower: str, workload: dict) -> None:
    assert_same(upper, lower, workload)


# ---- m02 == m01 and m04 == m03 when the budget covers every step's work ---------------------------------


def check_budget_idle(workload: dict) -> None:
    assert_same("m02_token_budget", "m01_continuous_batching", workload)
    # m03 runs dry exactly when m04 does: same schedule, same residency.
    assert_same("m04_chunked_prefill", "m03_paged_state", workload)


@CI
@given(workload=mechanism_idle("m02_token_budget", **BROAD))
def test_budget_covering_every_step_changes_nothing(workload: dict) -> None:
    check_budget_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=mechanism_idle("m02_token_budget", **BROAD))
def test_budget_covering_every_step_changes_nothing_slow(workload: dict) -> None:
    check_budget_idle(workload)


# ---- m03 == m02 unless m03 runs out of pages; never with a pool for everything -------------------------


def check_pool_idle(workload: dict) -> None:
    m03, m02 = execute("m03_paged_state", workload), execute("m02_token_budget", workload)
    eng = engine_of(workload)
    if sum(alone_pages(r, eng["page_size"]) for r in workload["requests"]) <= eng["num_pages"]:
        assert m03.error_name != "OutOfPages"
    if m03.error_name == "OutOfPages":
        s = len(m03.records)
        assert m03.trace == m02.trace[:s]
    else:
        assert m03.outcome() == m02.outcome()


POOLS = st.one_of(mechanism_idle("m03_paged_state", **BROAD), workloads(**BROAD))


@CI
@given(workload=POOLS)
def test_pages_change_nothing_until_they_run_out(workload: dict) -> None:
    check_pool_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=POOLS)
def test_pages_change_nothing_until_they_run_out_slow(workload: dict) -> None:
    check_pool_idle(workload)


# ---- m05 == m04 while the pool never runs short ---------------------------------------------------------


def check_preemption_idle(workload: dict) -> None:
    m05, m04 = execute("m05_preemption", workload), execute("m04_chunked_prefill", workload)
    eng = engine_of(workload)
    if sum(alone_pages(r, eng["page_size"]) for r in workload["requests"]) <= eng["num_pages"]:
        assert m04.error is None
    s = len(m04.records)
    assert m05.project(fields_of("m04_chunked_prefill"))[:s] == m04.trace
    assert all(rec["preempted"] == [] for rec in m05.trace[:s])
    if m04.error is None:
        assert m05.error is None and len(m05.records) == s
    else:
        # The step where m04 ran dry is the step where m05 preempts, or finds the anchor irreducible.
        assert m04.error_name == "OutOfPages"
        assert (m05.error_name == "Irreducible" and len(m05.records) == s) or m05.trace[s]["preempted"]


PREEMPT = st.one_of(mechanism_idle("m05_preemption", **BROAD), workloads(**BROAD), workloads(pool="tight"))


@CI
@given(workload=PREEMPT)
def test_preemption_changes_nothing_while_the_pool_suffices(workload: dict) -> None:
    check_preemption_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=PREEMPT)
def test_preemption_changes_nothing_while_the_pool_suffices_slow(workload: dict) -> None:
    check_preemption_idle(workload)


# ---- m08 == m07 with distinct first blocks while m07 never preempts --------------------------------------


def first_blocks_distinct(workload: dict) -> bool:
    ps = engine_of(workload)["page_size"]
    firsts = [tuple(prompt_tokens(workload, i)[:ps]) for i in range(len(workload["requests"]))]
    firsts = [f for f in firsts if len(f) == ps]
    return len(firsts) == len(set(firsts))


def check_cache_idle(workload: dict) -> None:
    if not first_blocks_distinct(workload):
        return
    m08, m07 = execute("m08_cache_aware_scheduling", workload), execute("m07_radix_cache", workload)
    fields = fields_of("m07_radix_cache")
    quiet = next((s for s, rec in enumerate(m07.trace) if rec["preempted"]), None)
    if quiet is None:
        assert m08.outcome(fields) == m07.outcome()
        assert all(rec["reused"] == {} for rec in m08.trace)
    else:
        # Up to the first preemption nobody is cold with a cached prefix; the victims are the same.
        assert m08.project(fields)[: quiet + 1] == m07.trace[: quiet + 1]


CACHE_IDLE = st.one_of(
    mechanism_idle("m08_cache_aware_scheduling", spec_len=(0, 3), scripts=True, negatives=True),
    workloads(prompts="length", spec_len=(0, 2), scripts=True),
    workloads(prompts="length", pool="tight"),
    workloads(prompts="mixed", pool="ample"),
)


@CI
@given(workload=CACHE_IDLE)
def test_cache_changes_nothing_without_shared_first_blocks(workload: dict) -> None:
    check_cache_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=CACHE_IDLE)
def test_cache_changes_nothing_without_shared_first_blocks_slow(workload: dict) -> None:
    check_cache_idle(workload)


# ---- m09 at spec_len 0 == m08 apart from zero-valued speculation entries ----------------------------------


def check_speculation_idle(workload: dict) -> None:
    m09, m08 = execute("m09_speculative_decode", workload), execute("m08_cache_aware_scheduling", workload)
    assert m09.outcome(fields_of("m08_cache_aware_scheduling")) == m08.outcome()
    for rec in m09.trace:
        for name in ("drafted", "accepted", "rolled_back"):
            assert set(rec[name].values()) <= {0}, rec


SPEC_IDLE = st.one_of(
    mechanism_idle("m09_speculative_decode", prompts="mixed", scripts=True, negatives=True),
    mechanism_idle("m09_speculative_decode", prompts="shared", pool="tight", scripts=True),
)


@CI
@given(workload=SPEC_IDLE)
def test_spec_len_zero_changes_nothing(workload: dict) -> None:
    check_speculation_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=SPEC_IDLE)
def test_spec_len_zero_changes_nothing_slow(workload: dict) -> None:
    check_speculation_idle(workload)


# ---- m10 == m09 always; m11 == m10 for every world size; who consumes the scripts --------------------------


def decode_windows(run_trace: list[dict], rid: str) -> int:
    return sum(rid in rec["drafted"] for rec in run_trace)


def check_boundary_and_ranks(workload: dict) -> None:
    m09 = execute("m09_speculative_decode", workload)
    m10 = execute("m10_executor_boundary", workload)
    assert m10.outcome(fields_of("m09_speculative_decode")) == m09.outcome()
    for ws in range(1, 5):
        wl = {**workload, "engine": {**workload["engine"], "world_size": ws}}
        m11 = execute("m11_parallelism", wl)
        assert m11.outcome() == m10.outcome(), ws
        assert m11.engine.summary() == m10.engine.summary()
        for r, spec in zip(m11.engine.requests, workload["requests"]):
            assert r.accept_script == spec.get("accept_script"), "m11 consumed a request's own script"
    for run in (m09, m10):
        for r, spec in zip(run.engine.requests, workload["requests"]):
            script = spec.get("accept_script")
            if script is not None:
                used = decode_windows(run.trace, r.request_id)
                assert r.accept_script == script[used:], (run.rung, r.request_id, script, used)


RANKS = st.one_of(
    workloads(prompts="mixed", spec_len=(0, 3), scripts=True, negatives=True),
    workloads(prompts="shared", pool="tight", spec_len=(1, 3), scripts=True, max_new=7),
)


@CI
@given(workload=RANKS)
def test_executor_boundary_and_ranks_change_nothing(workload: dict) -> None:
    check_boundary_and_ranks(workload)


@pytest.mark.slow
@SLOW
@given(workload=RANKS)
def test_executor_boundary_and_ranks_change_nothing_slow(workload: dict) -> None:
    check_boundary_and_ranks(workload)


# ---- m12 == m11 when every request passes the door (N21) -------------------------------------------------


def check_door_idle(workload: dict) -> None:
    """Every request passes the door, no limit, stop id or zero-token request is given and no request
    arrives before one listed ahead of it (D9: m12 admits first come, first served, m11 in list order):
    m12's trace is m11's on m11's fields, with ``rejected`` and ``aborted`` empty in every record, and the
    same ends.  Limits that never bind (``max_waiting`` and ``max_running`` the number of requests, ``max_model_len``
    the longest request exactly) change nothing either."""
    m12, m11 = execute("m12_admission_control", workload), execute("m11_parallelism", workload)
    assert m11.error is None
    assert m12.outcome(fields_of("m11_parallelism")) == m11.outcome()
    assert all(rec["rejected"] == [] and rec["aborted"] == [] for rec in m12.trace)
    assert m12.engine.summary() == m11.engine.summary()
    reqs = workload["requests"]
    if reqs:
        longest = max(len(prompt_tokens(workload, i)) + r["max_new_tokens"] for i, r in enumerate(reqs))
        limits = {"max_waiting": len(reqs), "max_running": len(reqs), "max_model_len": longest}
        bounded = execute("m12_admission_control", {**workload, "engine": {**workload["engine"], **limits}})
        assert bounded.outcome() == m12.outcome()


DOOR_IDLE = st.one_of(
    mechanism_idle("m12_admission_control", prompts="mixed", spec_len=(0, 3), scripts=True, negatives=True),
    mechanism_idle("m12_admission_control", pool="tight", prompts="shared", spec_len=(0, 2), scripts=True),
    mechanism_idle("m12_admission_control", world_size=(1, 3), max_requests=7),
)


@CI
@given(workload=DOOR_IDLE)
def test_door_that_refuses_nothing_changes_nothing(workload: dict) -> None:
    check_door_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=DOOR_IDLE)
def test_door_that_refuses_nothing_changes_nothing_slow(workload: dict) -> None:
    check_door_idle(workload)


# ---- m13 == m12 with output caching off (N1) --------------------------------------------------------------


def check_output_caching_idle(workload: dict) -> None:
    """Output caching off (absent, or false): m13's trace, summary and error are m12's, field for field."""
    m13, m12 = execute("m13_output_caching", workload), execute("m12_admission_control", workload)
    assert not m13.engine.output_caching
    assert m13.outcome() == m12.outcome()
    assert m13.engine.summary() == m12.engine.summary()


OUTPUT_IDLE = st.one_of(
    mechanism_idle("m13_output_caching", prompts="mixed", spec_len=(0, 3), scripts=True, negatives=True),
    mechanism_idle("m13_output_caching", pool="tight", prompts="shared", spec_len=(0, 2), scripts=True),
    mechanism_idle("m13_output_caching", admission=True, prompts="shared", world_size=(1, 2)),
)


@CI
@given(workload=OUTPUT_IDLE)
def test_output_caching_off_changes_nothing(workload: dict) -> None:
    check_output_caching_idle(workload)


@pytest.mark.slow
@SLOW
@given(workload=OUTPUT_IDLE)
def test_output_caching_off_changes_nothing_slow(workload: dict) -> None:
    check_output_caching_idle(workload)
