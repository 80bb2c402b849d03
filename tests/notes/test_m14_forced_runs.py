"""Pins every numbered line of mech-notes/14-forced-runs.md.

The scripted model's ids are a function of a request's own history (``chain``), so the ids a request
would sample are known before it runs, and a ``forced_script`` can force exactly those ids (the
grammar allowing only what the model would choose anyway) or any other ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m13_output_caching as m13
from mechserve.spec import m14_forced_runs as m
from mechserve.workload import WorkloadError, build_engine, load_rung, load_workload

R = m.Request
CI = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROMPT = [1, 2, 3, 4, 5, 6]


def run(eng: m.Engine, limit: int = 400) -> list[m.StepRecord]:
    def watch(rec: m.StepRecord) -> None:
        assert rec.step < limit, "run() did not stop"
        eng.check_invariants()

    return eng.run(on_step=watch)


def chain(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` ids the scripted model samples after ``prompt``."""
    ids, prev = [], prompt[-1]
    for j in range(n):
        prev = m.scripted_token(prev, len(prompt) + j)
        ids.append(prev)
    return ids


def req(eng: m.Engine, rid: str = "a") -> m.Request:
    return next(r for r in eng.requests if r.request_id == rid)


class Recording(m.LocalExecutor):
    """The scripted executor, keeping every plan it was sent and every outcome it gave."""

    def __init__(self, forced: dict[str, dict[int, tuple[int, ...]]] | None = None, **kw: Any) -> None:
        super().__init__(kw.get("scripts", {}), kw.get("eos_after", {}), forced)
        self.plans: list[tuple[m.PlanItem, ...]] = []
        self.outcomes: list[tuple[m.Outcome, ...]] = []

    def execute(self, plan: tuple[m.PlanItem, ...]) -> tuple[m.Outcome, ...]:
        self.plans.append(plan)
        self.outcomes.append(super().execute(plan))
        return self.outcomes[-1]


def test_m14_n1_no_forced_ids_is_m13() -> None:
    assert m.Outcome("a", 0, 1, 0, (), (1,)).forced == ()
    for oc in (False, True):
        new = m.Engine(
            [R("a", PROMPT, 7), R("b", PROMPT[:3], 5, accept_script=[1, 0])], 8, 4, 8, spec_len=2, output_caching=oc
        )
        old = m13.Engine(
            [m13.Request("a", PROMPT, 7), m13.Request("b", PROMPT[:3], 5, accept_script=[1, 0])],
            8,
            4,
            8,
            spec_len=2,
            output_caching=oc,
        )
        assert [t.to_json() for t in run(new)] == [t.to_json() for t in old.run()]
        assert new.summary() == old.summary()


@CI
@given(
    w=st.one_of(
        workloads(prompts="shared", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 2), negatives=True),
        workloads(admission=True, prompts="mixed", spec_len=(0, 2), scripts=True, output_caching="any"),
    )
)
def test_m14_n1_without_forced_scripts_every_field_summary_and_error_are_m13s(w: dict) -> None:
    def outcome(module: Any) -> tuple[list[dict], list[dict], str | None]:
        eng = build(module, w, validate=False)
        records: list[dict] = []
        try:
            eng.run(on_step=lambda rec: records.append(rec.to_json()))
        except Exception as exc:  # compared, not raised
            return records, eng.summary(), type(exc).__name__
        return records, eng.summary(), None

    assert outcome(m) == outcome(m13)


def test_m14_n2_forced_ids_on_an_item_that_does_not_sample_are_a_violation() -> None:
    class Bad(m.LocalExecutor):
        def execute(self, plan: tuple[m.PlanItem, ...]) -> tuple[m.Outcome, ...]:
            outs = super().execute(plan)
            return tuple(o if i.sample else dataclasses.replace(o, forced=(9,)) for i, o in zip(plan, outs))

    # budget 4: the 6-token prompt is cut, so step 0's item does not sample
    eng = m.Engine([R("a", PROMPT, 3)], 4, 4, 8, executors=[Bad({}, {})])
    with pytest.raises(m.BoundaryViolation, match="forced id"):
        eng.step()
    assert req(eng).computed == 0 and not req(eng).output_ids  # nothing applied


def test_m14_n3_forced_ids_are_output_ids_whose_kv_is_owed() -> None:
    ids = chain(PROMPT, 8)
    eng = m.Engine([R("a", PROMPT, 8, forced_script={0: (11, 12, 13)})], 16, 4, 8)
    rec = eng.step()
    a = req(eng)
    assert dict(rec.tokens) == {"a": (ids[0], 11, 12, 13)} and dict(rec.forced) == {"a": 3}
    assert (a.generated, a.computed, a.target, a.output_ids) == (4, 6, 10, [ids[0], 11, 12, 13])
    # a sample that finishes the request drops the forced ids that came with it
    done = m.Engine(
        [R("a", PROMPT, 1, forced_script={0: (11, 12)}), R("b", PROMPT, 5, eos_after=0, forced_script={0: (7,)})],
        16,
        4,
        8,
    )
    rec = done.step()
    assert dict(rec.finished) == {"a": m.FinishReason.LENGTH, "b": m.FinishReason.EOS}
    assert dict(rec.forced) == {} and req(done, "a").output_ids == [ids[0]] and req(done, "b").output_ids == [0]


def test_m14_n4_the_next_step_computes_the_run_like_a_prefill_chunk() -> None:
    ex = Recording({"a": {0: (11, 12, 13, 14)}})
    eng = m.Engine([R("a", PROMPT, 9)], 3, 4, 8, executors=[ex], eos_token_ids=[0])
    recs = run(eng)
    first = chain(PROMPT, 1)[0]
    # budget 3: prompt 3+3, then the run t 11 12 13 14 (5 positions) as 3 + 2, sampling only at its end
    assert [dict(t.executed) for t in recs[:5]] == [{"a": 3}, {"a": 3}, {"a": 3}, {"a": 2}, {"a": 1}]
    assert [dict(t.sampled) for t in recs[:5]] == [
        {},
        {"a": m.Sample.TOKEN},
        {},
        {"a": m.Sample.TOKEN},
        {"a": m.Sample.TOKEN},
    ]
    chunk1, chunk2 = ex.plans[2][0], ex.plans[3][0]
    assert (chunk1.start_position, chunk1.token_ids, chunk1.sample, chunk1.decode) == (6, (first, 11, 12), False, False)
    assert (chunk2.start_position, chunk2.token_ids, chunk2.sample) == (9, (13, 14), True)
    assert recs[3].tokens["a"] == (m.scripted_token(14, 11),)


def test_m14_n5_no_drafting_on_a_step_that_computes_forced_ids() -> None:
    eng = m.Engine([R("a", PROMPT, 9, forced_script={1: (11, 12)})], 16, 4, 8, spec_len=2)
    recs = run(eng)
    # step 0 prefill; step 1 a decode window (2 guesses, all accepted: ids 1..3) - the entry at index 1 is a guess
    assert (dict(recs[1].drafted), dict(recs[1].forced)) == ({"a": 2}, {})
    ex = Recording({"a": {3: (11, 12)}})
    eng = m.Engine([R("a", PROMPT, 12)], 16, 4, 8, spec_len=2, executors=[ex], eos_token_ids=[0])
    recs = run(eng)
    assert dict(recs[1].forced) == {"a": 2}  # after the window's bonus id at index 3
    # step 2 computes the bonus id and the run: no guesses, not a decode window, no speculation entries
    assert (recs[2].executed["a"], dict(recs[2].drafted), ex.plans[2][0].draft_len, ex.plans[2][0].decode) == (
        3,
        {},
        0,
        False,
    )
    assert dict(recs[3].drafted) == {"a": 2}  # caught up again: drafts as usual


def test_m14_n6_max_new_tokens_cuts_a_forced_run_and_ends_the_request() -> None:
    ids = chain(PROMPT, 1)
    eng = m.Engine([R("a", PROMPT, 4, forced_script={0: (11, 12, 13, 14, 15)})], 16, 4, 8)
    recs = run(eng)
    a = req(eng)
    assert len(recs) == 1 and dict(recs[0].finished) == {"a": m.FinishReason.LENGTH}
    assert recs[0].tokens["a"] == (ids[0], 11, 12, 13) and dict(recs[0].forced) == {"a": 3}
    assert (a.generated, a.computed) == (4, 6) and a.computed < a.prompt_len + a.generated - 1
    assert eng.pool.owner.count(None) + eng.pool.owner.count(m.CACHE) == 8  # its pages came back


def test_m14_n7_a_stop_id_inside_a_forced_run_ends_the_request_at_it() -> None:
    first = chain(PROMPT, 1)[0]
    for stop, reason, kw in ((0, m.FinishReason.EOS, {}), (12, m.FinishReason.STOP, {"stop_token_ids": (12,)})):
        eng = m.Engine([R("a", PROMPT, 9, forced_script={0: (11, stop, 13)}, **kw)], 16, 4, 8)
        recs = run(eng)
        a = req(eng)
        assert len(recs) == 1 and dict(recs[0].finished) == {"a": reason}
        assert a.output_ids == [first, 11, stop] and a.generated == 2 and a.finish_reason is reason
    # ignoring EOS, the EOS id is an ordinary forced token
    eng = m.Engine([R("a", PROMPT, 4, ignore_eos=True, forced_script={0: (11, 0)})], 16, 4, 8)
    run(eng)
    assert req(eng).output_ids[:3] == [first, 11, 0] and req(eng).finish_reason is m.FinishReason.LENGTH


def test_m14_n8_eos_after_is_checked_at_the_next_sample_only() -> None:
    first = chain(PROMPT, 1)[0]
    for spec_len in (0, 2):
        eng = m.Engine([R("a", PROMPT, 9, eos_after=2, forced_script={0: (11, 12, 13)})], 16, 4, 8, spec_len=spec_len)
        recs = run(eng)
        a = req(eng)
        # generated reaches 4 > eos_after 2 through forcing; the next sample (step 1) is EOS
        assert a.output_ids == [first, 11, 12, 13, 0] and a.generated == 4 and len(recs) == 2
        assert dict(recs[1].finished) == {"a": m.FinishReason.EOS}
        assert all(v >= 0 for t in recs for v in t.accepted.values())


def test_m14_n9_rollback_never_touches_a_forced_id() -> None:
    # every window keeps nothing (script 0): guesses are rolled back in every window
    ex = Recording({"a": {1: (11, 12, 13), 4: (21, 22)}}, scripts={"a": [0] * 20})
    eng = m.Engine([R("a", PROMPT, 12)], 16, 2, 20, spec_len=3, executors=[ex], eos_token_ids=[0])
    recs = run(eng)
    a = req(eng)
    forced_at: dict[int, int] = {}  # position -> the step that forced its id
    for t in recs:
        for rid, k in t.forced.items():
            end = a.prompt_len + sum(len(u.tokens.get(rid, ())) for u in recs[: t.step + 1])
            forced_at.update({p: t.step for p in range(end - k, end)})
    assert forced_at and a.output_ids[2:5] == [11, 12, 13]
    # once an id is forced, no later decode window's guess positions (after its known id) cover it
    for step, plan in enumerate(ex.plans):
        for item in plan:
            guesses = range(item.start_position + len(item.token_ids), item.start_position + item.num_tokens)
            assert not [p for p in guesses if forced_at.get(p, step) < step], (step, item, forced_at)
    assert sum(sum(t.rolled_back.values()) for t in recs) > 0


def test_m14_n10_a_preempted_request_recomputes_its_forced_ids() -> None:
    script = {0: (11, 12, 13), 5: (21, 22, 23, 24)}
    ex = Recording({"b": script})
    # a tight pool: b is preempted while a grows
    eng = m.Engine([R("a", PROMPT, 12), R("b", PROMPT[::-1], 12)], 16, 2, 10, executors=[ex], eos_token_ids=[0])
    recs = run(eng)
    assert any("b" in t.preempted and req(eng, "b").generated for t in recs)
    b_alone = m.Engine([R("b", PROMPT[::-1], 12, forced_script=script)], 16, 2, 40)
    run(b_alone)
    assert req(eng, "b").output_ids == req(b_alone, "b").output_ids
    # a recompute's plan carries the forced ids as known ids
    carrying = [i for p in ex.plans for i in p if i.request_id == "b" and 11 in i.token_ids]
    assert len(carrying) >= 2 and not any(i.decode and i.token_ids[-1] == 11 for i in carrying)


def test_m14_n11_output_caching_publishes_forced_blocks_once_computed() -> None:
    first = chain(PROMPT, 1)[0]
    eng = m.Engine([R("a", PROMPT, 9, forced_script={0: (11, 12, 13, 14, 15)})], 16, 4, 8, output_caching=True)
    recs = run(eng)
    # step 0: prompt 0..5 computed, block 0 published; t + 5 forced ids appended (positions 6..11), not computed
    assert dict(recs[0].published) == {"a": 1} and dict(recs[0].forced) == {"a": 5}
    # step 1 computes 6..11: blocks 1 (4..7) and 2 (8..11) are published, keyed over the forced ids
    assert recs[1].executed["a"] == 6 and dict(recs[1].published) == {"a": 2}
    keys = m.prefix_keys([*PROMPT, first, 11, 12, 13, 14, 15], 4)
    assert eng.cache.match(keys) and len(eng.cache.match(keys)) == 3


def test_m14_n12_the_scripted_executor_forces_after_the_last_appended_id() -> None:
    ex = m.LocalExecutor({}, {}, {"a": {0: (5,), 2: (6,), 9: (7,)}})
    item = m.PlanItem("a", 6, 1, 0, False, ((6, 0, 0),), (1,), True, 0, (0, 1))
    assert ex.execute((item,))[0].forced == (5,)
    window = m.PlanItem("a", 6, 3, 2, True, tuple((p, 0, 0) for p in range(6, 9)), (1,), True, 0, (0, 1, 2))
    assert ex.execute((window,))[0].forced == (6,)  # 2 guesses accepted: the last id has index 0 + 2
    ex.eos_after["a"] = 9
    late = m.PlanItem("a", 6, 1, 0, False, ((6, 0, 0),), (1,), True, 9, (0, 1))
    assert ex.execute((late,))[0].token_ids == (0,) and ex.execute((late,))[0].forced == ()  # none after EOS
    # an index the request never ends a sample on forces nothing; every rank its own copy
    eng = m.Engine([R("a", PROMPT, 6, forced_script={1: (11,)})], 16, 4, 8, spec_len=3, world_size=2)
    recs = run(eng)
    assert not any(t.forced for t in recs) and req(eng).forced_script == {1: (11,)}
    assert eng._scripted[0].forced["a"] is not eng._scripted[1].forced["a"]


def test_m14_n13_the_record_gains_no_json_field() -> None:
    first = chain(PROMPT, 1)[0]
    eng = m.Engine([R("a", PROMPT, 9, forced_script={0: (11, 0)})], 16, 4, 8)
    rec = eng.step()
    assert set(rec.to_json()) == set(m13.StepRecord(0).to_json())
    a = rec.tokens["a"]
    assert a[rec.accepted.get("a", 0) + 1 :] == (11, 0) and rec.forced["a"] == 2
    assert rec.to_json()["sampled"] == {"a": "TOKEN"} and rec.to_json()["finished"] == {"a": "EOS"} and a[0] == first


def test_m14_n14_the_door_is_unchanged_and_the_frontier_bounded() -> None:
    eng = m.Engine([], 16, 4, 3, max_model_len=12)
    assert eng.add_request(R("a", PROMPT, 7, forced_script={0: (1,)})) is m.RejectReason.TOO_LONG
    assert eng.add_request(R("b", PROMPT, 7, forced_script={0: (1,)})) is m.RejectReason.TOO_LONG
    eng = m.Engine([], 16, 4, 3)
    assert eng.add_request(R("c", PROMPT, 8, forced_script={0: (1,)})) is m.RejectReason.NEVER_FITS
    assert eng.add_request(R("d", PROMPT, 7, forced_script={0: (1, 2, 3, 4, 5, 6, 7, 8)})) is None
    recs = run(eng)
    d = req(eng, "d")
    assert d.generated == 7 and len(d.output_ids) == 7 and len(recs) == 1  # cut at max_new_tokens
    peak = m.Engine([R("e", PROMPT, 7, forced_script={0: (1, 2, 3), 4: (5,)})], 16, 4, 3)
    frontier = []
    peak.run(on_step=lambda rec: frontier.append(max([r.computed for r in peak.running], default=0)))
    assert max(frontier) <= len(PROMPT) + 7 - 1


def test_m14_n15_forcing_what_the_model_samples_changes_no_id() -> None:
    for spec_len in (0, 2):
        base = m.Engine([R("a", PROMPT, 14, eos_after=11), R("b", PROMPT[:4], 9)], 6, 2, 12, spec_len=spec_len)
        plain = run(base)
        a, b = req(base, "a").output_ids, req(base, "b").output_ids
        forced = {"a": {0: tuple(a[1:5]), 6: tuple(a[7:12])}, "b": {2: tuple(b[3:6])}}
        eng = m.Engine(
            [
                R("a", PROMPT, 14, eos_after=11, forced_script=forced["a"]),
                R("b", PROMPT[:4], 9, forced_script=forced["b"]),
            ],
            6,
            2,
            12,
            spec_len=spec_len,
        )
        recs = run(eng)
        assert [req(eng, r).output_ids for r in "ab"] == [a, b]
        assert [(e["generated"], e["finish_reason"]) for e in eng.summary()] == [
            (e["generated"], e["finish_reason"]) for e in base.summary()
        ]
        if spec_len == 0:
            kept = sum(sum(t.forced.values()) for t in recs)
            assert kept > 0 and sum(len(t.sampled) for t in recs) == sum(len(t.sampled) for t in plain) - kept


def test_m14_n16_forced_script_in_the_workload_refused_below_m14() -> None:
    text = (
        '{"requests": [{"request_id": "a", "tokens": [1, 2, 3], "max_new_tokens": 6, "forced_script": {"0": [7, 8]}}]}'
    )
    w = load_workload(text)
    assert w.requests[0].forced_script == ((0, (7, 8)),)
    eng = build_engine(load_rung("m14"), w)
    recs = eng.run()
    assert recs[0].tokens["a"][1:] == (7, 8) and isinstance(eng, m.Engine)
    with pytest.raises(WorkloadError, match=r"^m13 has no forced runs: request \"a\" has a forced_script") as err:
        build_engine(load_rung("m13"), w)
    assert "\n" not in str(err.value)
    for bad, where in (
        ('{"x": [1]}', "must be an output index"),
        ('{"0": []}', "non-empty list"),
        ('{"0": [-1]}', r"forced_script\.0\[0\]"),
        ("[1]", "must be a JSON object"),
        ('{"6": [1]}', r"output index 6 is never reached \(max_new_tokens is 6"),  # found by a user's trial
    ):
        with pytest.raises(WorkloadError, match=where):
            load_workload(text.replace('{"0": [7, 8]}', bad))
