"""The workload strategies reach the mechanisms they are meant to exercise, and ``build`` is faithful.

Without these, a property could pass vacuously because its workloads never preempt, never share a
prefix or never roll back a guess.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from ladder_harness import CI, MODULES, execute

from mechserve.conformance.strategies import (
    IDLE_KNOBS,
    alone_pages,
    build,
    door_verdicts,
    engine_of,
    fits_alone,
    has_admission,
    mechanism_idle,
    peak_step_work,
    prompt_tokens,
    workloads,
)
from mechserve.spec import RUNGS, TOP
from mechserve.workload import ENGINE_OPTIONAL

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


ROLLBACKS = workloads(
    min_requests=1,
    pool="tight",
    prompts="shared",
    budget="large",
    spec_len=(1, 3),
    page_size=(1, 3),
    scripts="rollback",
    min_new=3,
    max_new=6,
)
"""The rollback half of m12 N22's workloads (``tests/notes/test_m12_admission_control.py``, ``mayhem``)."""


def test_rollback_scripts_roll_guesses_back_across_page_boundaries() -> None:
    """A rolled-back guess frees a tail page (m09 N10; m12 N22's page conservation must see it)."""
    freed = lambda run: any("freeing tail page" in line for rec in run.records for line in rec.explain)  # noqa: E731
    reaches(ROLLBACKS, TOP, freed)
    reaches(ROLLBACKS, TOP, lambda run: freed(run) and any(rec["preempted"] for rec in run.trace))


@CI
@given(workload=workloads(scripts="rollback", spec_len=(0, 3), min_new=3, max_new=6))
def test_rollback_scripts_and_min_new_are_what_they_say(workload: dict) -> None:
    k = workload["engine"]["spec_len"]
    for r in workload["requests"]:
        assert 3 <= r["max_new_tokens"] <= 6
        assert r["accept_script"] and all(-1 <= e <= max(0, k - 1) for e in r["accept_script"]), r


def waits_behind_a_cut(run: Any) -> bool:
    """Some step leaves a RUNNING request unscheduled (m04+: the budget ran out before its turn)."""
    running: list[str] = []
    for rec in run.trace:
        running += rec["admitted"]
        if any(rid not in rec["scheduled"] for rid in running):
            return True
        running = [rid for rid in running if rid not in rec["finished"]]
    return False


def test_note_properties_reach_their_interesting_cases() -> None:
    """m04 N3: a RUNNING request waits behind a cut; m08 N11: two requests publish in the step of a preemption."""
    reaches(workloads(budget="any", pool="ample"), "m04_chunked_prefill", waits_behind_a_cut)
    reaches(
        workloads(prompts="shared", pool="tight", max_requests=5, max_arrival=1, budget="large"),
        "m08_cache_aware_scheduling",
        lambda run: any(len(rec["published"]) >= 2 and rec["preempted"] for rec in run.trace),
    )


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


ADMISSION = workloads(admission=True, prompts="mixed", spec_len=(0, 3), scripts=True, world_size=(1, 2))


@pytest.mark.parametrize("reason", ["EMPTY_PROMPT", "TOO_LONG", "NEVER_FITS", "OVERLOADED"])
def test_admission_knob_reaches_every_reason_a_valid_spec_can_give(reason: str) -> None:
    """The door's other reasons need an engine-only value: a negative ``max_new_tokens`` or a duplicate id
    (the CLI loader refuses both); ``test_m12_fuzz`` offers those."""
    reaches(ADMISSION, TOP, lambda run: any(why == reason for rec in run.trace for _, why in rec["rejected"]))


def test_admission_knob_reaches_stops_zero_tokens_and_held_back_requests() -> None:
    reaches(ADMISSION, TOP, lambda run: any("STOP" in rec["finished"].values() for rec in run.trace))
    reaches(
        workloads(admission=True, budget="large", pool="ample", spec_len=(1, 4), eos=False, max_new=8),
        TOP,
        lambda run: any(
            rec["sampled"].get(rid) == "STOP" and rec["accepted"][rid] < d
            for rec in run.trace
            for rid, d in rec["drafted"].items()
        ),
    )
    reaches(
        ADMISSION,
        TOP,
        lambda run: any(r.max_new_tokens == 0 and r.state.value == "FINISHED" for r in run.engine.requests),
    )
    held = lambda run: any("max_running limit" in line for rec in run.records for line in rec.explain)  # noqa: E731
    reaches(ADMISSION, TOP, held)


@CI
@given(workload=ADMISSION)
def test_admission_settings_reach_m12_and_later_only(workload: dict) -> None:
    """``build`` passes m12's limits and stop ids to m12 and later alone (the top rung checked), on both
    paths; a zero-token request or an empty prompt makes every rung below m12 refuse the workload."""
    assert json.loads(json.dumps(workload)) == workload
    eng = engine_of(workload)
    keys = list(workload["engine"])
    assert keys[:5] == ["max_step_tokens", "page_size", "num_pages", "spec_len", "world_size"]
    assert keys[5:] == [key for key in ENGINE_OPTIONAL if key in keys], "m12's limits, in 4.2 order, only when drawn"
    assert len(door_verdicts(workload)) == len(workload["requests"])
    for validate in (True, False):
        engine = build(MODULES[TOP], workload, validate=validate)
        assert [getattr(engine, key) for key in ENGINE_OPTIONAL] == [eng.get(key) for key in ENGINE_OPTIONAL]
        for i, (r, spec) in enumerate(zip(engine.requests, workload["requests"])):
            assert r.tokens == prompt_tokens(workload, i) and r.max_new_tokens == spec["max_new_tokens"]
            assert r.stop_token_ids == tuple(spec.get("stop_token_ids") or ())
        refused = any(
            spec["max_new_tokens"] == 0 or not prompt_tokens(workload, i) for i, spec in enumerate(workload["requests"])
        )
        for rung in RUNGS[: RUNGS.index("m12_admission_control")]:
            if refused:
                with pytest.raises(ValueError):
                    build(MODULES[rung], workload, validate=validate)
                continue
            lower = build(MODULES[rung], workload, validate=validate)
            assert not any(hasattr(lower, key) for key in ENGINE_OPTIONAL), rung
            assert not any(getattr(r, "stop_token_ids", ()) for r in lower.requests), rung


@CI
@given(workload=st.one_of(workloads(prompts="mixed", spec_len=(0, 3), scripts=True), *map(mechanism_idle, IDLE_KNOBS)))
def test_no_default_or_idle_workload_uses_admission(workload: dict) -> None:
    """Only ``admission=True`` draws what m12 alone reads, so every other workload builds on every rung."""
    assert not has_admission(workload)
    assert door_verdicts(workload) == [
        None if alone_pages(r, engine_of(workload)["page_size"]) <= engine_of(workload)["num_pages"] else "NEVER_FITS"
        for r in workload["requests"]
    ]


def test_a_covering_budget_cannot_be_measured_with_admission() -> None:
    with pytest.raises(ValueError):
        find(workloads(admission=True, budget="covering"), lambda w: True, settings=FIND)


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
    for knobs in (
        {"budget": "huge"},
        {"pool": "none"},
        {"prompts": "tokens"},
        {"scripts": "all"},
        {"min_new": 9},
        {"arrivals": "sorted"},
    ):
        with pytest.raises(ValueError):
            find(workloads(**knobs), lambda w: True, settings=FIND)


@CI
@given(workload=workloads(prompts="shared", output_caching="any"))
def test_the_output_caching_switch_reaches_m13_and_above_only(workload: dict) -> None:
    """``output_caching`` is drawn as a JSON boolean after m12's keys; ``build`` passes it to m13 and the
    rungs above on both paths, and drops it for every rung below (``fit_rung``; the CLI refuses it there)."""
    on = workload["engine"]["output_caching"]
    assert isinstance(on, bool) and list(workload["engine"])[-1] == "output_caching"
    assert engine_of(workload)["output_caching"] is on
    first = RUNGS.index("m13_output_caching")
    for validate in (True, False):
        for rung in RUNGS[first:]:
            assert build(MODULES[rung], workload, validate=validate).output_caching is on, rung
        for rung in RUNGS[:first]:
            assert not hasattr(build(MODULES[rung], workload, validate=validate), "output_caching"), rung


def test_output_caching_draws_reach_generated_blocks() -> None:
    """With the switch on, generated blocks are published (``block_keys`` beyond the prompt's)."""
    published_generated = lambda run: any(  # noqa: E731
        len(r.block_keys) > len(r.prompt_keys) for r in run.engine.requests
    )
    reaches(workloads(output_caching=True), TOP, published_generated)
    assert not find(workloads(), lambda w: True, settings=FIND)["engine"].get("output_caching")


def arrival(spec: dict) -> int:
    """The step a request offered before step 0 arrives at: its ``arrival_step``, a negative one counting as 0."""
    return max(0, spec.get("arrival_step") or 0)


@CI
@given(workload=workloads(arrivals="list_order", negatives=True, max_requests=7))
def test_list_order_arrivals_never_arrive_before_one_listed_ahead(workload: dict) -> None:
    """``arrivals="list_order"``: m12's first-come-first-served order (D9) is the list order."""
    steps = [arrival(r) for r in workload["requests"]]
    assert steps == sorted(steps)
    assert all(r.get("arrival_step") is None or list(r).index("arrival_step") == 3 for r in workload["requests"])


def admitted_out_of_list_order(run: Any) -> bool:
    """m12+ (D9): some step walks a request admitted earlier ahead of one listed before it."""
    ids = [r.request_id for r in run.engine.requests]
    return any(rec["scheduled"] != sorted(rec["scheduled"], key=ids.index) for rec in run.trace)


def test_default_arrivals_reach_first_come_first_served() -> None:
    """Unsorted arrivals make m12+ schedule out of list order, and preempt a request listed before one that
    keeps running (the victim is the one admitted last), so the properties see D9 at work."""

    def victim_listed_first(run: Any) -> bool:
        ids = [r.request_id for r in run.engine.requests]
        return any(
            ids.index(v) < ids.index(rid) for rec in run.trace for v in rec["preempted"] for rid in rec["executed"]
        )

    reaches(workloads(), TOP, admitted_out_of_list_order)
    reaches(workloads(pool="tight"), TOP, victim_listed_first)


@CI
@given(workload=mechanism_idle("m12_admission_control", prompts="mixed", pool="tight", negatives=True))
def test_m12_idle_workloads_are_served_in_list_order(workload: dict) -> None:
    """The idle knobs for m12 (N21) leave first come, first served nothing to reorder."""
    assert not admitted_out_of_list_order(execute("m12_admission_control", workload))
