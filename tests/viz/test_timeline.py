"""The timeline reads each request's part in each step off the trace, the same way for every rung."""

from __future__ import annotations

import json

from mechserve.spec import m16_request_draft_lengths as m16
from mechserve.viz.timeline import (
    ACCEPTED,
    DECODE,
    NONE,
    PREEMPTED,
    PREFILL,
    ROLLED_BACK,
    STALLED,
    WAITING,
    build_timeline,
)
from mechserve.viz.trace import Recorder, Trace, parse_trace

from .conftest import example, record

TWO = {
    "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 8},
    "requests": [
        {"request_id": "a", "prompt_len": 8, "max_new_tokens": 2},
        {"request_id": "b", "prompt_len": 8, "max_new_tokens": 2},
    ],
}


def rows(trace: Trace) -> dict[str, list[int]]:
    timeline = build_timeline(trace)
    return dict(zip(timeline.requests, timeline.cells))


def test_the_demo_reads_prefill_chunks_accepted_and_rolled_back_drafts(demo_trace: Trace) -> None:
    timeline = build_timeline(demo_trace)
    assert timeline.requests == ["r0", "r1", "r2"] and timeline.steps == [0, 1, 2, 3, 4, 5]
    assert rows(demo_trace) == {
        "r0": [PREFILL, ACCEPTED, NONE, NONE, NONE, NONE],
        "r1": [NONE, PREFILL, ACCEPTED, NONE, NONE, NONE],
        "r2": [NONE, NONE, PREFILL, PREFILL, ROLLED_BACK, ACCEPTED],
    }
    assert timeline.tokens[2] == [0, 0, 6, 4, 4, 2]
    assert timeline.marks["admitted"] == [(0, 0), (1, 1), (2, 2)]
    assert timeline.marks["finished"] == [(0, 1), (1, 2), (2, 5)]


def test_preemption_and_reuse_are_marked() -> None:
    trace = record(example("02"))
    cells = rows(trace)
    assert cells["c"][2:6] == [PREEMPTED] * 4
    assert cells["b"][4:6] == [PREEMPTED, PREEMPTED]
    assert (1, 5) in build_timeline(trace).marks["reused"]


def test_before_m09_a_decode_is_a_one_token_step_after_a_sample() -> None:
    assert rows(record(TWO, "m05")) == {"a": [PREFILL, DECODE, NONE, NONE], "b": [STALLED, PREFILL, PREFILL, DECODE]}


def test_waiting_shows_only_with_snapshots() -> None:
    workload = {**TWO, "engine": {**TWO["engine"], "max_running": 1}}
    trace = record(workload)
    assert rows(trace)["b"][0] == WAITING
    plain = parse_trace("\n".join(json.dumps(r) for r in trace.records))
    assert rows(plain)["b"][0] == NONE, "a --json trace cannot know b arrived"
    assert rows(record(TWO))["b"][0] == STALLED


def test_rejections_and_aborts_are_marked() -> None:
    engine = m16.Engine(
        [m16.Request("a", [1, 2, 3], 5), m16.Request("huge", list(range(1, 100)), 1)],
        max_step_tokens=8,
        page_size=4,
        num_pages=4,
    )
    recorder = Recorder(engine)
    recorder(engine.step())
    engine.abort("a")
    recorder(engine.step())
    timeline = build_timeline(recorder.trace(engine.summary()))
    assert timeline.marks["rejected"] == [(1, 0)]
    assert timeline.marks["aborted"] == [(0, 1)]
    assert timeline.cells[0] == [PREFILL, NONE]


def test_two_hundred_requests_make_two_hundred_rows(big_trace: Trace) -> None:
    timeline = build_timeline(big_trace)
    assert len(timeline.cells) == 200 and {len(row) for row in timeline.cells} == {len(big_trace.records)}
    used = {code for row in timeline.cells for code in row}
    assert {WAITING, STALLED, PREFILL, ACCEPTED, ROLLED_BACK, PREEMPTED} <= used
