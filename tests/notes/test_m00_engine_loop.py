"""Tests pinning mech-notes/00-engine-loop.md."""

from __future__ import annotations

import dataclasses

import pytest

from mechserve.spec import m00_engine_loop as m

TOKEN, EOS = m.Sample.TOKEN, m.Sample.EOS
LENGTH, EOS_REASON = m.FinishReason.LENGTH, m.FinishReason.EOS


def req(rid: str, prompt: int, max_new: int, **kw: int) -> m.Request:
    return m.Request(rid, prompt, max_new, **kw)


def run(engine: m.Engine, limit: int = 100) -> list[m.StepRecord]:
    """``engine.run()``, failing instead of hanging when the run never stops."""

    def watch(t: m.StepRecord) -> None:
        assert t.step < limit, "run() did not stop"

    return engine.run(on_step=watch)


@pytest.mark.parametrize(("prompt", "max_new"), [(0, 1), (-2, 1), (1, 0), (1, -1)])
def test_m00_n1_constructor_rejects_bad_sizes(prompt: int, max_new: int) -> None:
    with pytest.raises(ValueError):
        m.Engine([req("ok", 1, 1), req("bad", prompt, max_new)])
    m.Engine([req("ok", 1, 1)])  # a valid request is accepted


def test_m00_n2_counter_stamps_the_trace_then_advances() -> None:
    e = m.Engine([req("a", 2, 3)])
    assert e.step_counter == 0
    first = e.step()
    assert first.step == 0
    assert e.step_counter == 1
    assert [t.step for t in run(e)] == [1, 2]
    assert e.step_counter == 3
    assert [t.step for t in run(m.Engine([req("a", 2, 3)]))] == [0, 1, 2]


def test_m00_n3_admission_by_arrival_in_list_order() -> None:
    reqs = [
        req("a", 1, 9, arrival_step=2),
        req("b", 1, 9, arrival_step=-5),
        req("c", 1, 9),
        req("d", 1, 9, arrival_step=1),
    ]
    e = m.Engine(reqs)
    assert e.step().admitted == ("b", "c")
    assert reqs[0].state is m.RequestState.WAITING
    assert e.step().admitted == ("d",)
    assert e.step().admitted == ("a",)
    assert e.step().admitted == ()
    # no capacity check: fifty arrivals are all admitted at once
    many = [req(f"r{i}", 7, 1) for i in range(50)]
    assert m.Engine(many).step().admitted == tuple(f"r{i}" for i in range(50))


def test_m00_n4_schedule_every_running_request_including_new_ones() -> None:
    e = m.Engine([req("b", 2, 1, arrival_step=1), req("a", 3, 3)])
    t0 = e.step()
    assert t0.scheduled == ("a",)
    t1 = e.step()
    assert t1.admitted == ("b",)
    assert t1.scheduled == ("b", "a")  # list order, and b runs in its admission step
    assert dict(t1.executed) == {"b": 2, "a": 1}
    assert dict(t1.sampled) == {"b": TOKEN, "a": TOKEN}


def test_m00_n5_execute_the_whole_remaining() -> None:
    r = req("a", 5, 3)
    e = m.Engine([r])
    seen = []
    for _ in range(3):
        t = e.step()
        seen.append((dict(t.executed), r.computed))
    assert seen == [({"a": 5}, 5), ({"a": 1}, 6), ({"a": 1}, 7)]


@pytest.mark.parametrize(("eos_after", "samples"), [(2, [TOKEN, TOKEN, EOS]), (0, [EOS]), (-1, [EOS])])
def test_m00_n6_rule_s_eos(eos_after: int, samples: list[m.Sample]) -> None:
    r = req("a", 1, 5, eos_after=eos_after)
    traces = run(m.Engine([r]))
    assert [t.sampled["a"] for t in traces] == samples
    assert r.generated == max(eos_after, 0)
    assert r.finish_reason is EOS_REASON
    assert dict(traces[-1].finished) == {"a": EOS_REASON}


@pytest.mark.parametrize("eos_after", [None, 3, 5])
def test_m00_n7_rule_s_token_and_length(eos_after: int | None) -> None:
    r = m.Request("a", 1, 3, eos_after=eos_after)
    traces = run(m.Engine([r]))
    assert [t.sampled["a"] for t in traces] == [TOKEN, TOKEN, TOKEN]
    assert [dict(t.finished) for t in traces] == [{}, {}, {"a": LENGTH}]
    assert r.generated == 3
    assert r.finish_reason is LENGTH


def test_m00_n8_finished_is_a_subset_of_sampled_and_leaves() -> None:
    reqs = [req("a", 1, 1), req("b", 1, 2), req("c", 1, 1)]
    e = m.Engine(reqs)
    t0 = e.step()
    assert list(t0.sampled) == ["a", "b", "c"]
    assert list(t0.finished.items()) == [("a", LENGTH), ("c", LENGTH)]
    assert [r.state for r in reqs] == [m.RequestState.FINISHED, m.RequestState.RUNNING, m.RequestState.FINISHED]
    t1 = e.step()
    assert t1.scheduled == ("b",)
    assert e.step().scheduled == ()


def test_m00_n9_every_scheduled_request_samples_every_step() -> None:
    reqs = [req("a", 4, 3), req("b", 2, 5, arrival_step=1), req("c", 1, 2, eos_after=1)]
    traces = run(m.Engine(reqs))
    assert len(traces) == 6
    for t in traces:
        assert list(t.executed) == list(t.scheduled) == list(t.sampled)
    assert sum(len(t.sampled) for t in traces) == 3 + 5 + 2


def test_m00_n10_final_frontier() -> None:
    reqs = [req("len", 4, 3), req("eos", 4, 5, eos_after=2), req("eos0", 6, 5, eos_after=0)]
    run(m.Engine(reqs))
    assert [(r.generated, r.computed, r.finish_reason) for r in reqs] == [
        (3, 6, LENGTH),
        (2, 6, EOS_REASON),
        (0, 6, EOS_REASON),
    ]


def test_m00_n11_run_until_all_finished_with_empty_traces_while_waiting() -> None:
    assert run(m.Engine([])) == []
    traces = run(m.Engine([req("late", 1, 1, arrival_step=3)]))
    assert [t.step for t in traces] == [0, 1, 2, 3]
    for t in traces[:3]:
        assert t.to_json() == {
            "step": t.step,
            "admitted": [],
            "scheduled": [],
            "executed": {},
            "sampled": {},
            "finished": {},
        }
    assert traces[3].to_json() == {
        "step": 3,
        "admitted": ["late"],
        "scheduled": ["late"],
        "executed": {"late": 1},
        "sampled": {"late": "TOKEN"},
        "finished": {"late": "LENGTH"},
    }


def test_m00_n12_trace_fields_order_and_names() -> None:
    t = m.Engine([req("a", 2, 1), req("b", 1, 3, eos_after=0)]).step()
    js = t.to_json()
    assert list(js) == ["step", "admitted", "scheduled", "executed", "sampled", "finished"]
    assert js["sampled"] == {"a": "TOKEN", "b": "EOS"}
    assert js["finished"] == {"a": "LENGTH", "b": "EOS"}
    trace_fields = [f.name for f in dataclasses.fields(t) if f.name != "explain"]
    assert trace_fields == list(js)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.step = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        t.executed["a"] = 9  # type: ignore[index]
