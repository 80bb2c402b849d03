"""Snapshots of a live run: one per step, every page accounted for, and a trace document that reads back the same."""

from __future__ import annotations

import json

import pytest

from mechserve.spec import RUNGS
from mechserve.viz.snapshot import CACHE, Snapshot
from mechserve.viz.trace import FORMAT, Trace, TraceError, parse_trace

from .conftest import EXAMPLES, example, record


def check_pages(snap: Snapshot) -> None:
    """Every page is exactly one of free, a request's or the cache's, and each view agrees with the others."""
    counts = snap.page_counts()
    assert counts["free"] + counts["owned"] + counts["cached"] == snap.num_pages
    assert snap.free is not None and snap.owners is not None
    assert sorted(snap.free) == [p for p, o in enumerate(snap.owners) if o is None]
    cached = sorted(p for p, o in enumerate(snap.owners) if o is CACHE)
    if snap.tree is not None:
        assert sorted(node.page for node in snap.tree) == cached
        assert all(-1 <= node.parent < i for i, node in enumerate(snap.tree))
    for rid, view in snap.requests.items():
        for page in view.page_table:
            assert snap.owners[page] in (rid, CACHE), f"{rid}'s table holds page {page} of {snap.owners[page]!r}"
    private = {p: o for p, o in enumerate(snap.owners) if isinstance(o, str)}
    for page, rid in private.items():
        assert page in snap.requests[rid].page_table, f"page {page} of {rid} is in no table"


SMALL = {
    "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 8},
    "requests": [
        {"request_id": "a", "tokens": [1, 2, 3, 4, 5, 6], "max_new_tokens": 3},
        {"request_id": "b", "tokens": [1, 2, 3, 4, 9], "max_new_tokens": 2, "arrival_step": 1},
    ],
}


def small_on(mech: str) -> Trace:
    """Two requests sharing a block, which every rung can run."""
    return record(SMALL, mech)


@pytest.mark.parametrize("mech", [name[:3] for name in RUNGS])
def test_every_rung_records_one_snapshot_per_step_and_what_it_has(mech: str) -> None:
    trace = small_on(mech)
    assert trace.snapshots is not None and len(trace.snapshots) == len(trace.records)
    assert [s.step for s in trace.snapshots] == [r["step"] for r in trace.records]
    number = int(mech[1:])
    for snap in trace.snapshots:
        assert (snap.owners is None) == (number < 3), "pages arrive in m03"
        assert (snap.tree is None) == (number < 8), "the radix cache arrives in m08"
        if snap.owners is not None:
            check_pages(snap)


RUNNABLE = [p for p in EXAMPLES if "error" not in json.loads(p.read_text())]


@pytest.mark.parametrize("path", RUNNABLE, ids=[p.stem for p in RUNNABLE])
def test_pages_are_conserved_in_every_snapshot_of_every_example(path) -> None:
    trace = record(example(path.stem[:2]))
    assert trace.snapshots
    for snap in trace.snapshots:
        check_pages(snap)


def test_pages_are_conserved_with_200_requests_under_preemption_and_eviction(big_trace: Trace) -> None:
    assert len(big_trace.request_ids()) == 200
    assert any(r["preempted"] for r in big_trace.records) and any(r["evicted"] for r in big_trace.records)
    for snap in big_trace.snapshots or ():
        check_pages(snap)
        assert snap.num_pages == 48


def test_a_snapshot_lists_arrived_waiting_requests_but_not_future_ones() -> None:
    workload = {
        "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 8, "max_running": 1},
        "requests": [
            {"request_id": "a", "prompt_len": 4, "max_new_tokens": 3},
            {"request_id": "b", "prompt_len": 4, "max_new_tokens": 1},
            {"request_id": "late", "prompt_len": 4, "max_new_tokens": 1, "arrival_step": 2},
        ],
    }
    first = record(workload).snapshots[0]
    assert first.requests["a"].state == "RUNNING" and first.requests["a"].page_table
    assert first.requests["b"].state == "WAITING" and first.requests["b"].page_table == ()
    assert "late" not in first.requests


def test_the_recorder_keeps_the_explain_sentences(demo_trace: Trace) -> None:
    assert all("explain" in r for r in demo_trace.records)
    assert "r0 arrived (arrival_step 0) and was admitted." in demo_trace.records[0]["explain"]


def test_the_trace_document_reads_back_the_same(demo_trace: Trace, big_trace: Trace) -> None:
    for trace in (demo_trace, big_trace):
        doc = json.loads(trace.dumps())
        assert doc["format"] == FORMAT
        back = parse_trace(trace.dumps())
        assert back.records == trace.records
        assert back.snapshots == trace.snapshots
        assert back.summary == trace.summary and back.title == trace.title
        assert back.engine == {"num_pages": trace.snapshots[0].num_pages, "page_size": 4}


def test_a_request_called_cache_is_not_the_cache() -> None:
    workload = {
        "engine": {"max_step_tokens": 8, "page_size": 2, "num_pages": 8},
        "requests": [{"request_id": "CACHE", "tokens": [1, 2, 3, 4, 5], "max_new_tokens": 2}],
    }
    trace = parse_trace(record(workload).dumps())
    first = trace.snapshots[0]
    assert "CACHE" in first.owners and CACHE in first.owners
    check_pages(first)


def test_a_deep_radix_chain_costs_no_recursion() -> None:
    blocks = 3000
    workload = {
        "engine": {"max_step_tokens": blocks + 8, "page_size": 1, "num_pages": blocks + 8},
        "requests": [{"request_id": "long", "tokens": list(range(1, blocks + 2)), "max_new_tokens": 1}],
    }
    trace = record(workload)
    tree = trace.snapshots[0].tree
    assert len(tree) == blocks + 1 and tree[-1].parent == blocks - 1
    assert parse_trace(trace.dumps()).snapshots == trace.snapshots


def test_a_json_trace_reads_without_snapshots_and_says_what_is_missing(cli) -> None:
    result = cli("demo", "--json", "--explain")
    trace = parse_trace(result.out)
    assert trace.snapshots is None and trace.source == "json"
    assert len(trace.records) == 6 and trace.summary[0]["request_id"] == "r0"
    assert trace.records[0]["explain"]
    missing = trace.unavailable()
    assert "--json trace" in missing["pages"] and "--json trace" in missing["tree"] and missing["text"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "is empty"),
        ("   \n", "is empty"),
        ("hello\n", "line 1: not JSON"),
        ('{"step": 0}\n[1, 2]\n', "line 2: neither a step record"),
        ('{"summary": []}\n{"step": 1}\n', "line 2: a step record after the summary"),
        ('{"summary": []}\n{"summary": []}\n', "a second summary"),
        ('{"step": 0, "executed": {"a": "x"}}\n', '"executed" must map request ids to integers'),
        ('{"step": 0, "rejected": ["a"]}\n', '"rejected" must be a list of [id, reason] pairs'),
        ('{"step": true}\n', "neither a step record"),
        ('{"format": "something-else"}', "is not 'mechserve-trace/1'"),
        ('{"format": "mechserve-trace/1", "steps": []}', "not a valid mechserve-trace/1 document"),
    ],
)
def test_what_is_not_a_trace_is_refused_with_a_reason(text: str, words: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace(text, "t.json")
    assert words in str(info.value) and str(info.value).startswith("t.json")
