"""E1 on the top rungs: a plan item's ``token_ids`` are exactly the known ids of the positions it computes,
the prompt's and then the ids sampled earlier, and nothing past them.

Mutation testing left m13's ``_plan`` mutant 30 alive (docs/mutation.md): ``max(1, end - prompt_len)``
for the end of the output ids a chunk knows, so a chunk that ends inside the prompt of a request that
already has output ids (a preempted request recomputing its prompt in chunks) carried one output id too
many.  The scripted executor only reads the last known id of a sampling item, so no trace changed; a
real executor feeds the known ids to the model.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from hypothesis import given
from ladder_harness import CI

from mechserve.conformance.strategies import build, workloads

RUNGS = ["m13_output_caching", "m14_forced_runs", "m16_request_draft_lengths"]


def rung(name: str) -> Any:
    return importlib.import_module(f"mechserve.spec.{name}")


def planned(eng: Any) -> list[tuple[Any, int, int]]:
    """Run ``eng`` by its halves, checking every plan item's known ids when it is planned; returns
    ``(item, prompt_len, output ids then)`` for each item."""
    seen = []
    while eng.waiting or eng.due or eng.running or eng._rejected or eng._aborted:  # as Engine.run
        assert eng.step_counter < 500, "did not stop"
        plan = eng.schedule()
        by_id = {r.request_id: r for r in eng.requests}
        for item in plan:
            r = by_id[item.request_id]
            known = r.tokens + r.output_ids  # every id of a position before the request's target
            end = min(item.start_position + item.num_tokens, len(known))
            assert item.token_ids == tuple(known[item.start_position : end]), (item, r)
            seen.append((item, r.prompt_len, len(r.output_ids)))
        eng.commit(eng.executor.execute(plan))
    return seen


@pytest.mark.parametrize("name", RUNGS)
def test_a_recomputed_prompt_chunk_knows_only_prompt_ids(name: str) -> None:
    mod = rung(name)
    # b (admitted last) is preempted once it has an output id, and recomputes its 8-id prompt 3 ids a step
    reqs = [mod.Request("a", [1, 2, 3, 4], 8), mod.Request("b", list(range(11, 19)), 8)]
    seen = planned(mod.Engine(reqs, max_step_tokens=3, page_size=2, num_pages=8, prefix_caching=False))
    # the case the mutant broke happened: a chunk ending inside the prompt of a request with output ids
    assert any(n_out and item.start_position + item.num_tokens < plen for item, plen, n_out in seen)


@CI
@pytest.mark.parametrize("name", RUNGS)
@given(w=workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, output_caching="any"))
def test_every_plan_item_knows_exactly_its_known_ids(name: str, w: dict[str, Any]) -> None:
    eng = build(rung(name), w, validate=False)
    try:
        planned(eng)
    except rung(name).OutOfPages:
        pass  # Irreducible: the plans before it were checked
