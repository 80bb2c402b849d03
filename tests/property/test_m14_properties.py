"""m14's forced runs over random workloads.

A workload runs once without forcing; its requests' output ids are then the ids a grammar "allowing
only what the model would choose" forces: each request gets a ``forced_script`` whose entries force,
after a drawn output index ``i``, the next ``k`` ids of its own unforced output.  The forced run must
keep page conservation and m14's invariants after every step, end every request, never have a forced
id sampled by the executor, and give every request the ids, finish reason and ``generated`` of the
unforced run (N15); with no forced script at all m14's trace is m13's field for field (N1).
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from ladder_harness import CI

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m13_output_caching as m13
from mechserve.spec import m14_forced_runs as m14

LIVE = (m14.RequestState.WAITING, m14.RequestState.RUNNING)


def run_checked(w: dict[str, Any]) -> tuple[Any, list[m14.StepRecord], dict[str, set[int]]]:
    """Run ``w`` on m14, checking conservation and invariants after every step; also return, per request,
    the output indexes the scripted executors produced from a sampling row."""
    eng = build(m14, w, validate=False)
    sampled: dict[str, set[int]] = {}
    for ex in eng._scripted:
        run_item = ex._run

        def watch(item: m14.PlanItem, run_item: Any = run_item) -> m14.Outcome:
            out = run_item(item)
            # the accepted guesses were the executor's own (its chain), the last id its row's choice
            sampled.setdefault(item.request_id, set()).update(item.generated + j for j in range(len(out.token_ids)))
            return out

        ex._run = watch  # type: ignore[method-assign]
    records: list[m14.StepRecord] = []

    def on_step(rec: m14.StepRecord) -> None:
        assert rec.step < 2_000, "run() did not stop"
        eng.check_invariants()
        owners = eng.pool.owner
        free, cached = owners.count(None), owners.count(m14.CACHE)
        assert free + cached + sum(isinstance(o, str) for o in owners) == eng.pool.num_pages
        assert free == len(eng.pool.free)
        records.append(rec)

    eng.run(on_step=on_step)
    assert not any(r.state in LIVE for r in eng.requests), "a request never ended"
    assert all(o is None or o is m14.CACHE for o in eng.pool.owner), "pages leaked"
    return eng, records, sampled


@st.composite
def forced_workloads(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plain workload, the same with forced scripts drawn from the plain run's own output ids)."""
    w = draw(
        workloads(
            min_requests=1,
            max_requests=4,
            prompts="shared",
            pool="fits",
            spec_len=(0, 3),
            scripts=draw(st.booleans()),
            page_size=(1, 3),
            max_new=12,
            output_caching="any",
            world_size=(1, 2),
        )
    )
    eng = build(m14, w, validate=False)
    eng.run()
    forced = copy.deepcopy(w)
    for spec, r in zip(forced["requests"], eng.requests):
        ids = r.output_ids
        if len(ids) < 2:
            continue
        script = {}
        for i in sorted(set(draw(st.lists(st.integers(0, len(ids) - 2), max_size=3)))):
            k = draw(st.integers(1, len(ids) - 1 - i))
            script[str(i)] = list(ids[i + 1 : i + 1 + k])
        if script:
            spec["forced_script"] = script
    return w, forced


@CI
@given(pair=forced_workloads())
def test_forcing_what_the_model_samples_changes_no_id_and_never_samples_a_forced_id(pair: tuple) -> None:
    plain, forced = pair
    base, _, _ = run_checked(plain)
    eng, records, sampled = run_checked(forced)
    assert [r.output_ids for r in eng.requests] == [r.output_ids for r in base.requests]
    strip = [(e["request_id"], e["state"], e["generated"], e["finish_reason"]) for e in eng.summary()]
    assert strip == [(e["request_id"], e["state"], e["generated"], e["finish_reason"]) for e in base.summary()]
    # each output index is appended exactly once: by a sample (the first accepted + 1 ids) or forced (the tail)
    forced_idx: dict[str, set[int]] = {}
    count: dict[str, int] = {}
    for rec in records:
        for rid, ids in rec.tokens.items():
            k = rec.forced.get(rid, 0)
            assert len(ids) == rec.accepted.get(rid, 0) + 1 + k
            n = count.get(rid, 0)
            forced_idx.setdefault(rid, set()).update(range(n + len(ids) - k, n + len(ids)))
            count[rid] = n + len(ids)
    assert count == {r.request_id: len(r.output_ids) for r in eng.requests if r.output_ids}
    for rid, idx in forced_idx.items():
        assert not idx & sampled.get(rid, set()), f"{rid}: a forced id was sampled"


@CI
@given(
    w=st.one_of(
        workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True),
        workloads(admission=True, prompts="mixed", spec_len=(0, 2), scripts=True, output_caching="any"),
        workloads(pool="any", prompts="mixed", output_caching=True),
    )
)
def test_without_forced_scripts_m14_is_m13(w: dict) -> None:
    def outcome(module: Any) -> tuple[list[dict], list[dict], str | None]:
        eng = build(module, w, validate=False)
        records: list[dict] = []
        try:
            eng.run(on_step=lambda rec: records.append(rec.to_json()))
        except Exception as exc:  # compared, not raised: both rungs must fail alike
            return records, eng.summary(), type(exc).__name__
        return records, eng.summary(), None

    assert outcome(m14) == outcome(m13)
