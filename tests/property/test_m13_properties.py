"""m13's output caching over random workloads.

Every run goes through ``ladder_harness.execute``, which after every step checks page conservation and
``check_invariants()``, the work list and every frontier's move (the whole-sequence reuse cap of N8
included), D2's own chain over the whole sequence (``block_keys``), and that every cached block's
slots hold the positions its key names, written by a request whose tokens up to there are the key's
(``check_cached_slots``): with the scripted executor a slot holds ``(request, position)``, so this is
"the block's KV is the KV of its key's tokens".  The properties here add: every request ends
(FINISHED, or REJECTED at the door), with exactly the ids, finish reason and ``generated`` it has on
m12; with output caching off m13's trace is m12's field for field; afterwards every page is free or
cache-owned.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI, SLOW, check_summary, execute

from mechserve.conformance.strategies import alone_pages, prompt_tokens, scripted_ids, workloads
from mechserve.spec import m13_output_caching as m13


@st.composite
def conversations(draw: st.DrawFn) -> dict:
    """A workload plus next turns: each a later request whose prompt is an earlier request's prompt, the first
    ``k`` ids the scripted model gives it (its answer so far, cut before an ``eos_after`` EOS) and a new
    message, so that generated blocks are reused across requests (N3) and, for equal answers, adopted (N6)."""
    w = draw(
        workloads(
            min_requests=1,
            max_requests=3,
            prompts="shared",
            pool="fits",
            spec_len=(0, 3),
            scripts=True,
            page_size=(1, 3),
            max_new=8,
            output_caching=True,
        )
    )
    requests = list(w["requests"])
    for turn in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(requests) - 1))
        first = requests[i]
        prompt = prompt_tokens({"requests": requests}, i)
        cap = int(first["max_new_tokens"])
        if first.get("eos_after") is not None:
            cap = min(cap, max(0, int(first["eos_after"])))
        k = draw(st.integers(0, cap))
        message = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        requests.append(
            {
                "request_id": f"t{turn}",
                "tokens": [*prompt, *scripted_ids(prompt, k), *message],
                "max_new_tokens": draw(st.integers(1, 5)),
                "arrival_step": draw(st.integers(0, 12)),
            }
        )
    ps = w["engine"]["page_size"]
    biggest = max(alone_pages(r, ps) for r in requests)
    engine = {**w["engine"], "num_pages": max(w["engine"]["num_pages"], biggest + draw(st.integers(0, 2)))}
    return {"engine": engine, "requests": requests}


ON = st.one_of(
    conversations(),
    workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), output_caching=True),
    workloads(
        min_requests=1,
        pool="tight",
        prompts="shared",
        budget="large",
        spec_len=(1, 3),
        page_size=(1, 3),
        scripts="rollback",
        min_new=3,
        max_new=7,
        output_caching=True,
    ),
    workloads(admission=True, prompts="shared", spec_len=(0, 2), scripts=True, output_caching=True),
    workloads(
        min_requests=2, max_requests=7, prompts="shared", pool="fits", page_size=(1, 2), max_new=8, output_caching=True
    ),
)
"""Shared prefixes over a tiny alphabet (so answers collide and generated blocks are adopted), tight pools
(preemption, eviction, recompute), speculation with rollback across pages, m12's door, many requests."""


def check_same_ends(workload: dict) -> None:
    on, off = execute("m13_output_caching", workload), execute("m12_admission_control", workload)
    assert on.error is None and off.error is None, (on.error, off.error)
    assert on.engine.output_caching
    check_summary(on)
    ends = [
        (r.output_ids, r.finish_reason and r.finish_reason.value, r.generated, r.state.value)
        for r in on.engine.requests
    ]
    assert ends == [
        (r.output_ids, r.finish_reason and r.finish_reason.value, r.generated, r.state.value)
        for r in off.engine.requests
    ]
    assert on.engine.summary() == off.engine.summary()
    assert all(state in ("FINISHED", "REJECTED") for *_, state in ends)
    assert all(o is None or o is m13.CACHE for o in on.engine.pool.owner)


@CI
@given(workload=ON)
def test_output_caching_keeps_every_request_and_the_cache_right(workload: dict) -> None:
    check_same_ends(workload)


@pytest.mark.slow
@SLOW
@given(workload=ON)
def test_output_caching_keeps_every_request_and_the_cache_right_slow(workload: dict) -> None:
    check_same_ends(workload)


def check_off_is_m12(workload: dict) -> None:
    on, off = execute("m13_output_caching", workload), execute("m12_admission_control", workload)
    assert not on.engine.output_caching
    assert on.outcome() == off.outcome()
    assert on.engine.summary() == off.engine.summary()


OFF = st.one_of(
    workloads(prompts="mixed", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True),
    workloads(pool="tight", prompts="shared", spec_len=(0, 2), scripts=True, output_caching="any").filter(
        lambda w: not w["engine"].get("output_caching")
    ),
    workloads(admission=True, prompts="shared", spec_len=(0, 2), scripts=True),
)


@CI
@given(workload=OFF)
def test_output_caching_off_is_m12_field_for_field(workload: dict) -> None:
    check_off_is_m12(workload)


@pytest.mark.slow
@SLOW
@given(workload=OFF)
def test_output_caching_off_is_m12_field_for_field_slow(workload: dict) -> None:
    check_off_is_m12(workload)
