"""Pins every numbered line of mech-notes/09-speculative-decode.md."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mechserve.spec import m08_cache_aware_scheduling as m08
from mechserve.spec import m09_speculative_decode as m

R = m.Request
SPEC = ("drafted", "accepted", "rolled_back")


def run(eng, limit: int = 200) -> list:
    """``eng.run()``, failing instead of hanging when the run never stops."""

    def watch(rec) -> None:
        assert rec.step < limit, "run() did not stop"

    return eng.run(on_step=watch)


def steps(eng: m.Engine, n: int) -> list[m.StepRecord]:
    return [eng.step() for _ in range(n)]


def spec_fields(rec: m.StepRecord) -> tuple[dict, dict, dict]:
    return dict(rec.drafted), dict(rec.accepted), dict(rec.rolled_back)


def synthetic(i: int, n: int) -> list[int]:
    return [1000 * i + j for j in range(n)]


def verdicts(engine: type[m.Engine] = m.Engine) -> tuple[m.Engine, list[m.Request]]:
    """05-spec-decode-verdicts."""
    reqs = [
        R("a", synthetic(0, 4), 9, accept_script=[1, 5, -1]),
        R("b", synthetic(1, 5), 10, eos_after=3, accept_script=[3]),
        R("c", synthetic(2, 3), 4),
        R("d", synthetic(3, 2), 6, eos_after=0),
    ]
    return engine(reqs, 16, 4, 16, spec_len=3), reqs


def test_m09_n1_spec_len_is_checked_first() -> None:
    with pytest.raises(ValueError, match="spec_len"):
        m.Engine([R("a", [], 0)], 0, 0, 0, spec_len=-1)
    with pytest.raises(ValueError, match="max_step_tokens"):
        m.Engine([R("a", [], 0)], 0, 0, 0, spec_len=0)
    assert m.Engine([], 8, 4, 8).spec_len == 0


def test_m09_n2_every_caught_up_running_request_drafts_scheduled_or_not() -> None:
    a = R("a", [1, 2, 3, 4], 9, arrival_step=1)
    b = R("b", [5, 6, 7], 3)
    eng = m.Engine([a, b], 4, 4, 16, spec_len=3)
    s0 = eng.step()
    assert s0.scheduled == ("b",)
    assert (b.generated, b.computed, b.draft_len) == (1, 3, 0)  # at step 0 b had sampled nothing yet
    s1 = eng.step()
    # a was prefilling (generated 0): no draft. b is caught up but gets no budget: it drafts anyway,
    # capped by max_new_tokens - generated - 1 = 1
    assert s1.scheduled == ("a",)
    assert (a.draft_len, b.draft_len) == (0, 1)
    s2 = eng.step()
    assert dict(s2.executed) == {"a": 4} and dict(s2.drafted) == {"a": 3}
    assert b.draft_len == 1
    # recomputing after preemption: computed >= prompt_len is not enough, it must be target - 1 (D1)
    # (prefix caching off, so that r1 recomputes its prompt too: D7 would let it reuse the prompt block)
    r0, r1 = R("r0", [0], 7), R("r1", [10, 11], 5)
    eng = m.Engine([r0, r1], 3, 2, 5, spec_len=1, prefix_caching=False)
    trace = steps(eng, 5)
    assert trace[3].preempted == ("r1",) and dict(trace[4].executed) == {"r1": 3}
    assert (r1.computed, r1.prompt_len, r1.target) == (3, 2, 5)
    s5 = eng.step()
    assert r1.draft_len == 0 and dict(s5.executed) == {"r1": 2}
    assert (r1.computed, r1.generated) == (5, 4) and "r1" not in s5.drafted


def test_m09_n3_a_decode_window_asks_for_one_plus_draft_len_and_the_budget_may_cut_it() -> None:
    for budget, executed, drafted in ((8, 4, 3), (3, 3, 2)):
        a = R("a", [1, 2, 3], 9)
        eng = m.Engine([a], budget, 4, 16, spec_len=3)
        eng.step()
        assert (a.computed, a.target) == (3, 4)
        s1 = eng.step()
        assert dict(s1.executed) == {"a": executed}
        assert dict(s1.drafted) == {"a": drafted}


def test_m09_n4_draft_positions_are_backed_by_pages() -> None:
    a = R("a", [1, 2], 9)
    eng = m.Engine([a], 8, 2, 8, spec_len=3)
    eng.step()
    assert a.page_table == [0]
    s1 = eng.step()
    assert dict(s1.executed) == {"a": 4}  # positions 2..5
    assert a.page_table == [0, 1, 2]
    assert [eng.pool.slots[p] for p in (1, 2)] == [[("a", 2), ("a", 3)], [("a", 4), ("a", 5)]]
    # the anchor check counts the drafts too
    big = R("big", [1, 2], 9)
    eng = m.Engine([big], 8, 2, 2, spec_len=3)
    eng.step()
    with pytest.raises(m.Irreducible):
        eng.step()
    assert eng.step_counter == 1


def test_m09_n5_prompt_and_recompute_chunks_are_not_decode_windows() -> None:
    # 09-d1-recompute-not-speculative, with a script on a to show nothing is consumed
    b = R("b", synthetic(0, 1), 4)
    a = R("a", synthetic(1, 1), 3, accept_script=[0, 0, 0, 0, 0])
    eng = m.Engine([b, a], 2, 1, 5, spec_len=0)
    trace = run(eng)
    assert [spec_fields(s) for s in trace] == [
        ({}, {}, {}),  # prompt chunks
        ({"b": 0, "a": 0}, {"b": 0, "a": 0}, {"b": 0, "a": 0}),
        ({"b": 0}, {"b": 0}, {"b": 0}),  # a was preempted
        ({"b": 0}, {"b": 0}, {"b": 0}),  # a recomputes its prompt token
        ({}, {}, {}),  # a recomputes positions 1..2: not a decode window
    ]
    assert dict(trace[4].executed) == {"a": 2}
    assert a.accept_script == [0, 0, 0, 0]  # one decode window, one entry
    assert (a.generated, a.computed, a.finish_reason) == (3, 3, m.FinishReason.LENGTH)


def test_m09_n6_each_decode_window_consumes_exactly_one_script_entry() -> None:
    # spec_len 0: every window drafts 0 and still consumes an entry
    a = R("a", [1, 2], 3, accept_script=[5, 7, 9])
    eng = m.Engine([a], 8, 2, 8, spec_len=0)
    eng.step()
    assert a.accept_script == [5, 7, 9]  # the prompt chunk consumed nothing
    s1 = eng.step()
    assert a.accept_script == [7, 9] and spec_fields(s1) == ({"a": 0}, {"a": 0}, {"a": 0})
    eng.step()
    assert a.accept_script == [9]
    # a window the budget cut to one token (06-world-size-4, q at step 2)
    p = R("p", [5, 6, 7, 8, 9], 8, accept_script=[2, 2])
    q = R("q", [5, 6, 7, 8, 1], 5, arrival_step=1, accept_script=[3, 0])
    eng = m.Engine([p, q], 5, 4, 12, spec_len=3)
    trace = steps(eng, 4)
    assert (trace[2].drafted["q"], q.draft_len) == (0, 0)
    # the next window uses the entry 0 (the 3 went to the cut window): both guesses rejected
    assert (trace[3].drafted["q"], trace[3].accepted["q"]) == (2, 0)
    assert q.accept_script == []
    # an empty script is an absent one: accept every guess
    c = R("c", [1, 2], 6, accept_script=[])
    eng = m.Engine([c], 8, 2, 8, spec_len=3)
    s = steps(eng, 2)[1]
    assert spec_fields(s) == ({"c": 3}, {"c": 3}, {"c": 0})


def test_m09_n7_verdicts_are_clamped_to_the_draft() -> None:
    eng, (a, *_) = verdicts()
    trace = run(eng)
    windows = [(s.drafted["a"], s.accepted["a"], s.rolled_back["a"]) for s in trace if "a" in s.drafted]
    # script [1, 5, -1]: 1 of 3; 5 clamps to 3; the draft cap leaves 1 guess and -1 clamps to 0; then accept-all of 0
    assert windows == [(3, 1, 2), (3, 3, 0), (1, 0, 1), (0, 0, 0)]
    assert a.accept_script == []


def test_m09_n8_the_eos_clamp_stops_acceptance_at_eos_after() -> None:
    eng, (_, b, *_) = verdicts()
    steps(eng, 1)
    assert (b.generated, b.eos_after, b.accept_script) == (1, 3, [3])
    s1 = eng.step()
    assert (s1.drafted["b"], s1.accepted["b"], s1.rolled_back["b"]) == (3, 2, 1)  # min(3, 3 - 1)
    assert s1.sampled["b"] is m.Sample.EOS
    assert (b.generated, b.computed) == (3, 8)


def test_m09_n9_rollback_moves_the_frontier_and_the_window_samples_at_once() -> None:
    a = R("a", [1, 2, 3, 4], 9, accept_script=[1])
    eng = m.Engine([a], 8, 4, 16, spec_len=3)
    eng.step()
    assert (a.computed, a.generated) == (4, 1)
    s1 = eng.step()
    assert dict(s1.executed) == {"a": 4}
    assert spec_fields(s1) == ({"a": 3}, {"a": 1}, {"a": 2})
    # computed 4 + 4 - 2 = 6; generated 1 + 1 (accepted) + 1 (bonus) = 3
    assert dict(s1.sampled) == {"a": m.Sample.TOKEN}
    assert (a.computed, a.generated, a.target) == (6, 3, 7)


def test_m09_n10_rolled_back_tail_pages_are_freed_last_page_first() -> None:
    a = R("a", [1], 9, accept_script=[0])
    eng = m.Engine([a], 8, 1, 8, spec_len=3)
    eng.step()
    assert a.page_table == [0] and list(eng.pool.free) == [1, 2, 3, 4, 5, 6, 7]
    s1 = eng.step()
    assert spec_fields(s1) == ({"a": 3}, {"a": 0}, {"a": 3})
    # positions 1..4 took pages 1..4; computed is back to 2, so pages 4, 3, 2 go back in that order
    assert a.page_table == [0, 1]
    assert list(eng.pool.free) == [5, 6, 7, 4, 3, 2]
    assert all(eng.pool.owner[p] is None and eng.pool.slots[p] == [None] for p in (2, 3, 4))


def test_m09_n11_resolve_clears_draft_len_and_records_zeros_too() -> None:
    eng, (a, b, c, _) = verdicts()
    steps(eng, 1)
    s1 = eng.step()
    assert list(s1.drafted) == list(s1.accepted) == list(s1.rolled_back) == ["a", "b", "c"]
    assert (a.draft_len, b.draft_len, c.draft_len) == (0, 0, 0)
    assert s1.rolled_back["c"] == 0
    x = R("x", [1, 2], 3)
    eng = m.Engine([x], 8, 2, 8)
    assert [spec_fields(s) for s in run(eng)] == [({}, {}, {}), *[({"x": 0}, {"x": 0}, {"x": 0})] * 2]


def test_m09_n12_only_the_sample_finishes_a_request() -> None:
    seen: list[tuple] = []

    class Probe(m.Engine):
        def _sample(self, r: m.Request, sampled: dict, finished: dict) -> None:
            seen.append((r.request_id, r.generated, r.state, r.finish_reason))
            super()._sample(r, sampled, finished)

    eng, (_, b, c, _) = verdicts(Probe)
    eng.step()
    seen.clear()
    s1 = eng.step()
    running = m.RequestState.RUNNING
    # after resolve, c had accepted both guesses (3 of 4) and b had reached eos_after: both still ran
    assert seen == [("a", 2, running, None), ("b", 3, running, None), ("c", 3, running, None)]
    assert dict(s1.finished) == {"b": m.FinishReason.EOS, "c": m.FinishReason.LENGTH}
    assert (c.generated, b.generated) == (4, 3)


def _run(mod, spec: dict, **kw: int) -> tuple[list[dict], list[dict], str | None]:
    reqs = [mod.Request(**r) for r in spec["requests"]]
    eng = mod.Engine(reqs, spec["max_step_tokens"], spec["page_size"], spec["num_pages"], **kw)
    trace: list[dict] = []
    try:
        while any(r.state is not mod.RequestState.FINISHED for r in reqs) and len(trace) < 500:
            trace.append(eng.step().to_json())
    except Exception as exc:
        return trace, eng.summary(), type(exc).__name__
    return trace, eng.summary(), None


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    base = draw(st.lists(st.integers(1, 3), min_size=10, max_size=10))
    requests = []
    for i in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 10))
        tokens = base[:n] if draw(st.booleans()) else draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        requests.append(
            {
                "request_id": f"r{i}",
                "tokens": tokens,
                "max_new_tokens": draw(st.integers(1, 5)),
                "arrival_step": draw(st.integers(0, 3)),
                "eos_after": draw(st.none() | st.integers(0, 4)),
            }
        )
    return {
        "max_step_tokens": draw(st.integers(1, 8)),
        "page_size": draw(st.integers(1, 3)),
        "num_pages": draw(st.integers(1, 8)),
        "requests": requests,
    }


_D1 = {  # 09-d1-recompute-not-speculative: the original design never terminates
    "max_step_tokens": 2,
    "page_size": 1,
    "num_pages": 5,
    "requests": [
        {"request_id": "b", "tokens": [0], "max_new_tokens": 4},
        {"request_id": "a", "tokens": [1000], "max_new_tokens": 3},
    ],
}


@settings(max_examples=150, deadline=None)
@example(_D1)
@given(workloads())
def test_m09_n13_at_spec_len_0_the_trace_is_m08s(spec: dict) -> None:
    ours, summary, error = _run(m, spec, spec_len=0)
    theirs = _run(m08, spec)
    for rec in ours:
        assert all(v == 0 for f in SPEC for v in rec[f].values())
    assert ([{k: v for k, v in rec.items() if k not in SPEC} for rec in ours], summary, error) == theirs
    assert all(s["generated"] <= r["max_new_tokens"] for s, r in zip(summary, spec["requests"]))
