"""The workload strategies reach the mechanisms they are meant to exercise, and ``build`` is faithful.

Without these, a property could pass vacuously because its workloads never preempt, never share a
prefix or never roll back a guess.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import Phase, find, given, settings
from ladder_harness import CI, MODULES, execute

from mechserve.conformance.strategies import (
    IDLE_KNOBS,
    alone_pages,
    build,
    engine_of,
    fits_alone,
    mechanism_idle,
    peak_step_work,
    workloads,
)
from mechserve.spec import RUNGS

FIND = settings(max_examples=400, database=None, phases=[Phase.generate], deadline=None)


def reaches(strategy, rung: str, condition: Callable) -> dict:
    """A workload from ``strategy`` whose run on ``rung`` satisfies ``condition(run)``."""
    return find(strategy, lambda w: condition(execute(rung, w)), settings=FIND)


def any_field(name: str) -> Callable:
    return lambda run: any(rec[name] for rec in run.trace)


@pytest.mark.parametrize(
    ("rung", "knobs", "field"),
    [
        ("m05_preemption", {"pool": "tight"}, "preempted"),
        ("m08_cache_aware_scheduling", {"pool": "tight", "prompts": "shared"}, "preempted"),
        ("m08_cache_aware_scheduling", {"pool": "tight", "prompts": "shared"}, "evicted"),
        ("m08_cache_aware_scheduling", {"prompts": "shared"}, "reused"),
        ("m11_parallelism", {"prompts": "shared", "pool": "tight", "spec_len": (1, 3)}, "reused"),
    ],
)
def test_knobs_reach_the_mechanism(rung: str, knobs: dict, field: str) -> None:
    reaches(workloads(**knobs), rung, any_field(field))


def test_shared_prompts_reach_d2_adoption() -> None:
    """Two requests compute the same block before either published it; the second adopts (D2)."""
    adopted = lambda run: any("adopted" in line for rec in run.records for line in rec.explain)  # noqa: E731
    reaches(workloads(prompts="shared", pool="tight"), "m08_cache_aware_scheduling", adopted)


def test_scripts_reach_rollbacks_clamps_and_speculation_with_preemption() -> None:
    strategy = workloads(spec_len=(1, 3), scripts=True, pool="tight", prompts="shared", max_new=8)
    reaches(
        strategy, "m09_speculative_decode", lambda run: any(v for rec in run.trace for v in rec["rolled_back"].values())
    )
    reaches(
        strategy,
        "m10_executor_boundary",
        lambda run: any_field("preempted")(run) and any(v for rec in run.trace for v in rec["accepted"].values()),
    )
    clamped = lambda w: any(  # noqa: E731
        e < 0 or e > w["engine"]["spec_len"] for r in w["requests"] for e in r.get("accept_script") or []
    )
    find(strategy, clamped, settings=FIND)


@pytest.mark.parametrize(
    ("rung", "error"),
    [("m02_token_budget", "RuntimeError"), ("m04_chunked_prefill", "OutOfPages"), ("m11_parallelism", "Irreducible")],
)
def test_any_pool_and_budget_reach_the_documented_errors(rung: str, error: str) -> None:
    reaches(workloads(), rung, lambda run: run.error_name == error)


@CI
@given(workload=workloads(prompts="mixed", spec_len=(0, 3), scripts=True, world_size=(1, 4), pool="fits"))
def test_workloads_are_json_specs_and_build_faithfully(workload: dict) -> None:
    """Valid 4.2 specs; the CLI loader's engine and the direct one agree on every rung."""
    assert json.loads(json.dumps(workload)) == workload
    assert list(workload["engine"]) == ["max_step_tokens", "page_size", "num_pages", "spec_len", "world_size"]
    assert fits_alone(workload)
    eng = engine_of(workload)
    assert max((alone_pages(r, eng["page_size"]) for r in workload["requests"]), default=0) <= eng["num_pages"]
    for rung in RUNGS:
        engine = build(MODULES[rung], workload)
        assert [r.request_id for r in engine.requests] == [r["request_id"] for r in workload["requests"]]
        for i, (r, spec) in enumerate(zip(engine.requests, workload["requests"])):
            tokens = spec.get("tokens") or [1000 * i + j for j in range(spec.get("prompt_len", 0))]
            assert r.prompt_len == len(tokens)
            if hasattr(r, "tokens"):
                assert r.tokens == tokens
            if hasattr(r, "accept_script"):
                assert r.accept_script == spec.get("accept_script")
                assert r.accept_script is None or r.accept_script is not spec["accept_script"]
        assert build(MODULES[rung], workload, validate=False).requests == engine.requests
        for key in ("max_step_tokens", "spec_len", "world_size"):
            if hasattr(engine, key):
                assert getattr(engine, key) == eng[key]
        if hasattr(engine, "pool"):
            assert (engine.pool.num_pages, engine.pool.page_size) == (eng["num_pages"], eng["page_size"])


@CI
@given(workload=mechanism_idle("m02_token_budget", prompts="mixed"))
def test_covering_budget_is_at_least_the_peak_step_work(workload: dict) -> None:
    peak = peak_step_work(workload)
    assert peak <= workload["engine"]["max_step_tokens"] <= max(1, peak) + 2


def test_every_rung_above_m00_has_idle_knobs() -> None:
    assert set(IDLE_KNOBS) == set(RUNGS[1:])
    for rung in RUNGS[1:]:
        mechanism_idle(rung).validate()


def test_unknown_knob_values_are_rejected() -> None:
    for knobs in ({"budget": "huge"}, {"pool": "none"}, {"prompts": "tokens"}):
        with pytest.raises(ValueError):
            find(workloads(**knobs), lambda w: True, settings=FIND)
