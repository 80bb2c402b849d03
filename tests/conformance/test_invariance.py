"""Check 4, mechanism invariance: greedy ids equal transformers' ``generate`` under every configuration."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mechserve.conformance import (
    FIXED_WORKLOADS,
    VARIANTS,
    InvarianceMismatch,
    Target,
    check_invariance,
    invariance_workloads,
    model_workload,
)
from mechserve.conformance.invariance import expected, variant, with_stops
from mechserve.conformance.runner import events, run_workload

from .conftest import CI


@CI
@given(
    workload=invariance_workloads(128),
    names=st.lists(st.sampled_from(list(VARIANTS)), min_size=3, max_size=5, unique=True),
    stop_at=st.dictionaries(st.sampled_from(["r0", "r1", "r2", "r3"]), st.integers(0, 4), max_size=2),
)
def test_greedy_ids_do_not_depend_on_the_configuration(
    target: Target, workload: dict[str, Any], names: list[str], stop_at: dict[str, int]
) -> None:
    check_invariance(target, with_stops(target, workload, stop_at), names)


@pytest.mark.parametrize("name", list(FIXED_WORKLOADS))
def test_every_variant_on_the_fixed_workloads(target: Target, name: str) -> None:
    workload = with_stops(target, model_workload(FIXED_WORKLOADS[name], target.vocab_size), {"a": 2, "q": 1})
    assert check_invariance(target, workload)["runs"] == len(VARIANTS)


def test_the_variants_exercise_what_they_name(target: Target) -> None:
    """Each knob really changes the run: preemption under a tight pool, single-token chunks at budget 1,
    rollbacks at spec_len 3, two ranks, one request at a time."""
    base = model_workload(FIXED_WORKLOADS["shared-prefix"], target.vocab_size)
    tight = run_workload(target, variant(base, "pool tight"))
    assert events(tight.records)["preempted"] > 0
    budget = run_workload(target, variant(base, "budget 1"))
    assert all(sum(rec.executed.values()) <= 1 for rec in budget.records)
    assert events(run_workload(target, variant(base, "spec_len 3")).records)["rolled_back"] > 0
    assert run_workload(target, variant(base, "world size 2")).engine.world_size == 2
    alone = run_workload(target, variant(base, "one at a time"))
    assert all(len(rec.scheduled) <= 1 for rec in alone.records)
    assert not events(run_workload(target, variant(base, "prefix caching off")).records)["reused"]
    # output caching: generated blocks are published, and the next turns reuse the answers' blocks
    on = run_workload(target, variant(base, "output caching on"))
    assert any("holding generated tokens" in line for rec in on.records for line in rec.explain)
    turns = variant(base, "next turns", target)
    firsts = {r["request_id"]: len(r["tokens"]) for r in base["requests"]}
    run = run_workload(target, turns)
    reused: dict[str, int] = {}  # the most each next turn reused (a tight pool may evict and shrink a later hit)
    for rec in run.records:
        for rid, n in rec.reused.items():
            if rid.endswith("+"):
                reused[rid] = max(n, reused.get(rid, 0))
    assert reused and all(n > firsts[rid[:-1]] for rid, n in reused.items()), (reused, firsts)
    with pytest.raises(ValueError, match="needs the target"):
        variant(base, "next turns")


def test_the_reference_follows_rule_s(target: Target) -> None:
    prompt = [50, 51, 52]
    ref = target.reference(prompt, 6)
    assert expected(target, {"tokens": prompt, "max_new_tokens": 6}) == (ref, "LENGTH")
    assert expected(target, {"tokens": prompt, "max_new_tokens": 6, "eos_after": 2}) == (ref[:3], "EOS")
    assert expected(target, {"tokens": prompt, "max_new_tokens": 6, "stop_token_ids": [ref[1]]})[1] == "STOP"
    assert expected(target, {"tokens": prompt, "max_new_tokens": 0}) == ([], "LENGTH")


def test_a_difference_names_variant_request_and_index(target: Target) -> None:
    import dataclasses

    liar = dataclasses.replace(target, greedy=lambda prompt, n: [0] * n, _references={})
    workload = model_workload(FIXED_WORKLOADS["shared-prefix"], target.vocab_size)
    with pytest.raises(InvarianceMismatch, match=r"invariance: as drawn: a generated \[.*\] \(LENGTH\) but alone"):
        check_invariance(liar, workload)
