"""``mechserve router --policy precise`` over two SmolLM2 workers publishing KV events (issue 26, items 4 and 6):
a conversation's next turn goes where its prefix is cached, greedy replies equal one worker's, the log replays."""

from __future__ import annotations

import httpx
import pytest
from router_support import RouterServer, WorkerProcess, free_port, wait_for

from mechserve.router.fleet import replay_log

pytestmark = pytest.mark.e2e
NAME = "smollm2"
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4


def chat(url: str, messages: list[dict[str, str]]) -> str:
    body = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


def test_precise_router_over_two_smollm2_workers() -> None:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    started = [WorkerProcess("smollm2", None, NAME, "--kv-events-endpoint", ep) for ep in endpoints]
    try:
        for w in started:
            w.wait_ready(timeout=600)
        with RouterServer([w.url for w in started], "precise", kv_events_endpoints=endpoints) as router:
            fleet = router.fleet
            first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
            answer = chat(router.url, first)
            (placed,) = {d["decision"]["replica"] for d in fleet.log if "decision" in d}
            wait_for(lambda: len(fleet.live[placed].resident) > 0, what="the first worker's KV events")
            second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another?"}]
            reply = chat(router.url, second)
            alone = chat(fleet.live[1 - placed].url, second)  # the other worker, straight
            wait_for(lambda: not fleet.placed, what="every routed request to finish")
            logged, replayed = replay_log(fleet.log)
    finally:
        for w in started:
            w.stop()
    assert reply == alone  # greedy output is one replica's
    assert replayed == logged
    assert logged[1].replica == placed and logged[1].rule == "longest_prefix" and logged[1].matched > 0
