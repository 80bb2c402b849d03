"""A client that goes away aborts its request: its pages return (free + cached == total) and the step trace
records the abort, for streaming and non-streaming requests alike."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from server_support import TINY_NAME, serving


def slowed(llm: Any, seconds: float) -> Any:
    """``llm`` whose executor takes at least ``seconds`` per step (a model that is not tiny)."""
    executor = llm.core.executor
    real = executor.execute

    def slow(plan: Any) -> Any:
        time.sleep(seconds)
        return real(plan)

    executor.execute = slow
    return llm


def generated(llm: Any, request_id: str) -> int:
    return sum(len(record.tokens.get(request_id, ())) for record in llm.trace)


def assert_aborted_and_freed(served: Any, request_id: str, max_tokens: int) -> None:
    counts = served.wait_idle()
    assert counts["private"] == 0 and counts["free"] + counts["cached"] == served.llm.core.num_pages
    assert any(request_id in record.aborted for record in served.llm.trace), "the abort is not in the trace"
    assert generated(served.llm, request_id) < max_tokens
    assert served.llm.metrics.snapshot()["finished"].get("abort", 0) >= 1


def test_a_streaming_client_that_disconnects_aborts_its_request(make_llm) -> None:
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.002)) as served:
        body = {"model": TINY_NAME, "prompt": "w1 w2 w3", "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for _ in range(3):
                next(lines)
        request_id = first.split('"id":"', 1)[1].split('"', 1)[0]
        assert_aborted_and_freed(served, request_id, 300)


def test_an_openai_stream_closed_early_aborts_its_request(make_llm) -> None:
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.002)) as served:
        stream = served.client().chat.completions.create(
            model=TINY_NAME, messages=[{"role": "user", "content": "w4 w5"}], max_tokens=300, stream=True
        )
        chunks = [next(stream) for _ in range(4)]
        stream.close()
        assert_aborted_and_freed(served, chunks[0].id, 300)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_waiting_client_that_disconnects_aborts_its_request(make_llm, path: str) -> None:
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.005)) as served:
        body: dict[str, Any] = {"model": TINY_NAME, "max_tokens": 300, "temperature": 0}
        body.update({"messages": [{"role": "user", "content": "w6"}]} if "chat" in path else {"prompt": "w6 w7"})
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + path, json=body, timeout=httpx.Timeout(30, read=0.3))
        (request_id,) = {rid for record in served.llm.trace for rid in record.admitted}
        assert_aborted_and_freed(served, request_id, 300)
