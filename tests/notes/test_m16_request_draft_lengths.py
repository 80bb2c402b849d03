"""Pins every numbered line of mech-notes/16-request-draft-lengths.md.

The scripted model's ids are a function of a request's own history, so a run with draft limits and
one without must end with the same ids; only the windows (``drafted``), the steps and the rolled-back
rows differ.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m15_routing as m15
from mechserve.spec import m16_request_draft_lengths as m
from mechserve.workload import WorkloadError, build_engine, load_rung, load_workload

R = m.Request
CI = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROMPT = [1, 2, 3, 4, 5, 6]


def run(eng: m.Engine, limit: int = 400) -> list[m.StepRecord]:
    def watch(rec: m.StepRecord) -> None:
        assert rec.step < limit, "run() did not stop"
        eng.check_invariants()

    return eng.run(on_step=watch)


def ends(eng: m.Engine) -> dict[str, tuple[list[int], Any, int]]:
    return {r.request_id: (r.output_ids, r.finish_reason, r.generated) for r in eng.requests}


def drafted(records: list[m.StepRecord], rid: str) -> list[int]:
    return [rec.drafted[rid] for rec in records if rid in rec.drafted]


@CI
@given(
    w=st.one_of(
        workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True),
        workloads(admission=True, prompts="mixed", spec_len=(0, 3), scripts=True, output_caching="any"),
    )
)
def test_m16_n1_without_limits_every_field_summary_and_error_are_m15s(w: dict) -> None:
    def outcome(module: Any) -> tuple[list[tuple[dict, list[dict]]], list[dict], str | None]:
        eng = build(module, w, validate=False)
        # each step's record and its KV events (block hashes chained from the engine's hash seed)
        records: list[tuple[dict, list[dict]]] = []
        try:
            eng.run(on_step=lambda rec: records.append((rec.to_json(), [module.event_json(e) for e in rec.kv_events])))
        except Exception as exc:  # compared, not raised
            return records, eng.summary(), type(exc).__name__
        return records, eng.summary(), None

    assert R("a", PROMPT, 3).draft_limit is None
    assert outcome(m) == outcome(m15)


def test_m16_n2_limit_drafts_validates_every_entry_before_setting_any() -> None:
    eng = m.Engine([R("a", PROMPT, 6), R("b", PROMPT, 6)], 32, 4, 16, spec_len=3)
    eng.limit_drafts({"a": 1, "b": None})
    assert (eng.requests[0].draft_limit, eng.requests[1].draft_limit) == (1, None)
    for bad, match in (
        ({"b": 2, "zz": 1}, r"'zz' is not a waiting or running request"),
        ({"b": 2, "a": -1}, r"limit for 'a' must be None or an int >= 0, not -1"),
        ({"b": 2, "a": 1.5}, r"limit for 'a' must be None or an int >= 0, not 1.5"),
        ({"b": 2, "a": True}, r"limit for 'a' must be None or an int >= 0, not True"),
    ):
        with pytest.raises(ValueError, match=match):
            eng.limit_drafts(bad)  # type: ignore[arg-type]
        assert (eng.requests[0].draft_limit, eng.requests[1].draft_limit) == (1, None)  # nothing changed
    eng.step()  # a and b computed their prompts
    plan = eng.schedule()
    eng.limit_drafts({"a": 0})  # the open step keeps its windows: a drafts 1 now, none after
    assert {i.request_id: i.num_tokens for i in plan} == {"a": 2, "b": 4}
    rec = eng.commit(eng.executor.execute(plan))
    assert rec.drafted == {"a": 1, "b": 3}
    assert eng.step().drafted["a"] == 0
    run(eng)
    with pytest.raises(ValueError, match=r"'a' is not a waiting or running request"):  # finished
        eng.limit_drafts({"a": 0})


def test_m16_n3_the_limit_joins_d1s_minimum() -> None:
    eng = m.Engine(
        [R("a", PROMPT, 8), R("b", PROMPT[:5], 8), R("c", PROMPT[:4], 8), R("d", PROMPT[:3], 8)], 64, 4, 32, spec_len=3
    )
    eng.limit_drafts({"a": 0, "b": 2, "c": 5})
    recs = run(eng)
    assert drafted(recs, "a") == [0] * 7  # a plain decode every step
    assert drafted(recs, "b")[0] == 2 and max(drafted(recs, "b")) == 2
    assert drafted(recs, "c")[0] == 3 and drafted(recs, "d")[0] == 3  # at or above m15's value: unchanged
    assert drafted(recs, "c") == drafted(recs, "d")


def test_m16_n4_a_limit_stays_until_changed_across_preemption() -> None:
    # a tight pool: b is preempted and recomputes; its limit still holds after
    eng = m.Engine([R("a", PROMPT, 10), R("b", PROMPT, 10)], 16, 2, 9, spec_len=3)
    eng.limit_drafts({"b": 1})
    recs: list[m.StepRecord] = []
    while eng.running or eng.waiting or not recs:
        rec = eng.step()
        recs.append(rec)
        eng.check_invariants()
        if len(recs) == 4:
            eng.limit_drafts({"a": 2}) if "a" in eng.live else None
        assert rec.step < 200
    assert any("b" in rec.preempted for rec in recs)
    assert all(d <= 1 for d in drafted(recs, "b")) and 1 in drafted(recs, "b")
    assert all(d <= 2 for d in drafted(recs, "a")[3:])
    assert ends(eng) == ends(run_plain([R("a", PROMPT, 10), R("b", PROMPT, 10)], 16, 2, 9, spec_len=3))


def run_plain(reqs: list[m.Request], *args: Any, **kw: Any) -> m.Engine:
    eng = m.Engine(reqs, *args, **kw)
    run(eng)
    return eng


def test_m16_n5_the_script_gives_one_limit_per_draft_decision() -> None:
    script = [1, 0, 5, 2]
    a = R("a", PROMPT, 14, draft_limit_script=script)
    eng = m.Engine([a], 64, 4, 32, spec_len=3)
    eng.limit_drafts({"a": 2})  # combined with the script by min
    recs = run(eng)
    assert a.draft_limit_script == [1, 0, 5, 2]  # the request's list stays whole
    # decisions: min(1,2)=1, min(0,2)=0, min(5,2)=2, min(2,2)=2, then the limit alone (2), capped near the end
    got = drafted(recs, "a")
    assert got[:4] == [1, 0, 2, 2] and all(d <= 2 for d in got)
    # no decision when D1 gives no guess: spec_len 0 consumes nothing
    b = R("b", PROMPT, 5, draft_limit_script=[0])
    eng0 = m.Engine([b], 64, 4, 32, spec_len=0)
    run(eng0)
    assert eng0._limit_scripts["b"] == [0]


def test_m16_n6_a_limited_window_is_an_ordinary_decode_window() -> None:
    a = R("a", PROMPT, 8, accept_script=[0, 5, 1], draft_limit_script=[2, 0, 2])
    eng = m.Engine([a], 64, 4, 32, spec_len=3)
    recs = [rec for rec in run(eng) if "a" in rec.drafted]
    assert [(r.drafted["a"], r.accepted["a"], r.rolled_back["a"]) for r in recs[:3]] == [
        (2, 0, 2),
        (0, 0, 0),
        (2, 1, 1),
    ]
    # the budget cut applies after the limit: budget 2 leaves one guess of a limit of 2
    b = R("b", PROMPT, 6, draft_limit_script=[2])
    cut = m.Engine([b], 2, 4, 32, spec_len=3)
    recs = run(cut)
    first = next(r for r in recs if "b" in r.drafted)
    assert first.executed["b"] == 2 and first.drafted["b"] == 1


@CI
@given(
    w=workloads(prompts="shared", pool="tight", spec_len=(1, 3), scripts=True, draft_limits=True, world_size=(1, 2)),
    limits=st.lists(st.one_of(st.none(), st.integers(0, 4)), min_size=5, max_size=5),
)
def test_m16_n7_limits_change_no_ids_finish_reason_or_generated(w: dict, limits: list[int | None]) -> None:
    plain = {
        **w,
        "requests": [
            {k: v for k, v in r.items() if k not in ("draft_limit_script", "accept_script")} for r in w["requests"]
        ],
    }
    base = build(m, plain, validate=False)
    base.run()
    limited_w = {**w, "requests": [{k: v for k, v in r.items() if k != "accept_script"} for r in w["requests"]]}
    eng = build(m, limited_w, validate=False)
    eng.limit_drafts({r.request_id: lim for r, lim in zip(eng.requests, limits) if r.request_id in eng.live})
    run(eng)
    assert ends(eng) == ends(base)


def test_m16_n8_explain_says_when_a_limit_cut_a_window() -> None:
    eng = m.Engine([R("a", PROMPT, 8), R("b", PROMPT[:4], 8)], 64, 4, 32, spec_len=3)
    eng.limit_drafts({"a": 1, "b": 3})
    recs = run(eng)
    said = [s for rec in recs for s in rec.explain]
    assert "a is caught up and may ask for 3 guess(es) but its draft limit is 1: it asks for 1." in said
    assert "b is caught up and asks for 3 guess(es)." in said
    assert not any(s.startswith("b is caught up and may ask") for s in said)  # b's limit cut nothing


def test_m16_n9_draft_limit_script_in_the_workload_refused_below_m16() -> None:
    text = (
        '{"engine": {"spec_len": 3}, "requests": [{"request_id": "a", "tokens": [1, 2, 3], "max_new_tokens": 6, '
        '"draft_limit_script": [1, 0]}]}'
    )
    w = load_workload(text)
    assert w.requests[0].draft_limit_script == (1, 0)
    eng = build_engine(load_rung("m16"), w)
    recs = eng.run()
    assert isinstance(eng, m.Engine) and drafted(recs, "a")[:2] == [1, 0]
    with pytest.raises(
        WorkloadError, match=r'^m15 has no per-request draft lengths: request "a" has a draft_limit_script'
    ) as err:
        build_engine(load_rung("m15"), w)
    assert "\n" not in str(err.value)
    for bad, where in (("[-1]", r"draft_limit_script\[0\]"), ('"x"', "draft_limit_script: must be a list of integers")):
        with pytest.raises(WorkloadError, match=where):
            load_workload(text.replace("[1, 0]", bad))
