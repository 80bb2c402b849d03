"""The step's two halves (m10 N21) and the stop from outside (m12 N26) on every rung that has them.

The note tests pin the lines on the rung that introduces them; here the later rungs must keep them:
``schedule()``, the caller's executor and ``commit(outcomes)`` give ``step()``'s records on m10-m14
(m14 with forced runs), and a stop check that stops nothing changes nothing, while one that does
ends exactly the requests it names, with the ids it kept, and leaks no page.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI
from test_m14_properties import forced_workloads

from mechserve.conformance.strategies import build, workloads

HALVES = [
    "m10_executor_boundary",
    "m11_parallelism",
    "m12_admission_control",
    "m13_output_caching",
    "m14_forced_runs",
    "m16_request_draft_lengths",
]
FORCING = ("m14_forced_runs", "m16_request_draft_lengths")  # the rungs with forced runs among them
STOPS = HALVES[2:]
SCHEDULED = workloads(pool="tight", prompts="mixed", spec_len=(0, 3), scripts=True, max_new=6, world_size=(1, 2))


def rung(name: str) -> Any:
    return importlib.import_module(f"mechserve.spec.{name}")


def live(eng: Any) -> bool:
    return bool(getattr(eng, "live", None) or eng.waiting or eng.running)


def halves_equal_step(mod: Any, w: dict[str, Any]) -> None:
    whole, halves = build(mod, w, validate=False), build(mod, w, validate=False)
    while live(whole):
        assert whole.step_counter < 500, "run() did not stop"
        rec = whole.step()
        plan = halves.schedule()
        mine = halves.commit(halves.executor.execute(plan))
        assert mine.to_json() == rec.to_json() and mine.explain == rec.explain
    assert not live(halves) and halves.summary() == whole.summary()


@CI
@pytest.mark.parametrize("name", HALVES)
@given(w=SCHEDULED)
def test_schedule_execute_commit_is_step(name: str, w: dict[str, Any]) -> None:
    halves_equal_step(rung(name), w)


@CI
@pytest.mark.parametrize("name", FORCING)
@given(pair=forced_workloads())
def test_schedule_execute_commit_is_step_with_forced_runs(name: str, pair: tuple) -> None:
    halves_equal_step(rung(name), pair[1])


@CI
@pytest.mark.parametrize("name", STOPS)
@given(w=SCHEDULED, cuts=st.dictionaries(st.integers(0, 4), st.integers(0, 4)), data=st.data())
def test_a_stop_ends_the_named_requests_with_the_ids_they_kept(name: str, w: dict, cuts: dict, data: Any) -> None:
    if name in FORCING:
        w = data.draw(forced_workloads())[1]
    mod = rung(name)
    eng = build(mod, w, validate=False)
    by_id = {r.request_id: r for r in eng.requests}
    plan = {f"r{i}": k for i, k in cuts.items()}
    expected: dict[str, list[int]] = {}
    # an EOS or stop id the request finished on in this step is not counted in `generated`; a stop keeping
    # it leaves it uncounted, one cutting it off leaves every kept id counted
    uncounted: dict[str, int] = {}

    def stop(rid: str, ids: tuple[int, ...]) -> int | None:
        if rid not in plan:
            return None
        keep = min(plan[rid], len(ids))
        had = by_id[rid].output_ids
        assert had[len(had) - len(ids) :] == list(ids)
        expected[rid] = had[: len(had) - len(ids)] + list(ids[:keep])
        on_id = by_id[rid].finish_reason in (mod.FinishReason.EOS, mod.FinishReason.STOP)
        assert by_id[rid].generated == len(had) - on_id
        uncounted[rid] = int(on_id and keep == len(ids))
        return keep

    while eng.live:
        assert eng.step_counter < 500, "run() did not stop"
        rec = eng.commit(eng.executor.execute(eng.schedule()), stop)
        eng.check_invariants()
        for rid in expected.keys() & rec.finished.keys():
            assert rec.finished[rid] is mod.FinishReason.STOP
            assert by_id[rid].output_ids == expected[rid] and not by_id[rid].page_table
            assert by_id[rid].generated == len(expected[rid]) - uncounted[rid]
            if name in FORCING:
                assert (
                    rec.forced.get(rid, 0) <= len(rec.tokens[rid]) - rec.accepted.get(rid, 0) - 1 or not rec.tokens[rid]
                )
    ends = {e["request_id"]: (e["state"], e["finish_reason"]) for e in eng.summary()}
    assert all(ends[rid] == ("FINISHED", "STOP") for rid in expected)
    assert all(o is None or o is mod.CACHE for o in eng.pool.owner), "pages leaked"
