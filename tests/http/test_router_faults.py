"""Faults behind ``mechserve router`` (issue 26, item 5): a worker killed or hung mid-request ends its requests
with a clear error naming it, leaves the live set at once, the others keep serving, a restarted worker rejoins,
and no request hangs."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
from router_support import RouterServer, WorkerProcess, wait_for
from server_support import TINY_NAME

from mechserve.router.fleet import replay_log

LONG = {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 400, "temperature": 0, "n": 4}


def plain(url: str, prompt: str = "w3 w4") -> httpx.Response:
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def states(router: RouterServer) -> dict[str, str]:
    return {c["url"]: c["state"] for c in httpx.get(router.url + "/workers").json()["workers"]}


def test_a_worker_killed_mid_stream_ends_it_with_an_error_then_done_and_rejoins_after_restart(
    tiny_dir: Path,
) -> None:
    started = [WorkerProcess(tiny_dir) for _ in range(2)]
    try:
        for w in started:
            w.wait_ready()
        victim, survivor = started
        with RouterServer([w.url for w in started], "round_robin") as router:
            lines: list[str] = []
            with httpx.stream("POST", router.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    lines.append(line)
                    if len(lines) == 1:  # the stream runs on the victim (first in rotation): kill it now
                        victim.process.send_signal(signal.SIGSTOP)
                        victim.kill()
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert victim.url in error["message"] and error["code"] == "worker_failed"
            assert all("finish_reason" not in e or "length" not in e for e in events[:-2])  # it did not finish
            assert states(router)[victim.url] == "down"  # at once, on the failure itself
            assert httpx.get(router.url + "/health").json() == {"live_workers": 1}
            for i in range(3):  # the survivor serves everything
                assert plain(router.url, f"w{i} w9").status_code == 200
            # a worker restarted on the same address rejoins
            restarted = WorkerProcess(tiny_dir, victim.port)
            started.append(restarted)
            restarted.wait_ready()
            wait_for(lambda: states(router)[victim.url] == "live", what="the restarted worker to rejoin")
            served = {plain(router.url).status_code for _ in range(4)}
            assert served == {200}
            wait_for(lambda: not router.fleet.placed, what="every routed request to finish")
            logged, replayed = replay_log(router.fleet.log)
        assert replayed == logged
        urls = [e["workers"] for e in router.fleet.log if "config" in e]
        assert urls == [[victim.url, survivor.url], [survivor.url], [victim.url, survivor.url]]
        assert [d.replica for d in logged[-4:]] == [0, 1, 0, 1]  # both serve again
    finally:
        for w in started:
            w.stop()


def test_a_hung_worker_ends_a_plain_request_with_502_and_a_dead_one_is_503(tiny_dir: Path) -> None:
    started = [WorkerProcess(tiny_dir) for _ in range(2)]
    try:
        for w in started:
            w.wait_ready()
        by_url = {w.url: w for w in started}
        with RouterServer([w.url for w in started], "round_robin") as router:
            reply: dict[str, Any] = {}

            def send() -> None:
                reply["r"] = httpx.post(router.url + "/v1/completions", json=LONG, timeout=60)

            thread = threading.Thread(target=send)
            thread.start()
            wait_for(lambda: bool(router.fleet.placed), what="the request to be routed")
            (worker,) = router.fleet.placed.values()
            hung = by_url[worker.url]
            hung.process.send_signal(signal.SIGSTOP)  # it stops answering: the health round takes it down
            thread.join(60)
            assert not thread.is_alive(), "the request hung"
            r = reply["r"]
            assert r.status_code == 502, r.text
            assert hung.url in r.json()["error"]["message"] and r.json()["error"]["code"] == "worker_failed"
            assert "--health-check-timeout-secs" in r.json()["error"]["message"], r.text  # the timeout, named
            assert states(router)[hung.url] == "down"
            assert plain(router.url).status_code == 200  # the other serves
            hung.kill()
        # a worker that dies between health rounds: the request that finds it gone is a 503 naming it
        other = next(w for w in started if w is not hung)
        with RouterServer([other.url], "round_robin", health_interval=3600) as router:
            assert states(router)[other.url] == "live"
            other.kill()
            r = plain(router.url)
            assert r.status_code == 503 and other.url in r.json()["error"]["message"], r.text
            assert r.json()["error"]["code"] == "worker_unavailable"
            r = plain(router.url)
            assert r.status_code == 503 and "no worker is available" in r.json()["error"]["message"]
            assert httpx.get(router.url + "/health").status_code == 503
    finally:
        for w in started:
            w.stop()


def test_a_hung_worker_ends_a_messages_stream_with_its_error_event_naming_the_timeout(tiny_dir: Path) -> None:
    """A stream through the router from a worker that hangs ends with the API's own error event (Anthropic's on
    /v1/messages), naming the health check's timeout (it said "failed mid-stream: ReadError")."""
    started = [WorkerProcess(tiny_dir) for _ in range(2)]
    try:
        for w in started:
            w.wait_ready()
        with RouterServer([w.url for w in started], "round_robin") as router:
            body = {
                "model": TINY_NAME,
                "max_tokens": 400,
                "stream": True,
                "messages": [{"role": "user", "content": "w3"}],
            }
            lines: list[str] = []
            with httpx.stream("POST", router.url + "/v1/messages", json=body, timeout=60) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    lines.append(line)
                    if len(lines) == 1:  # streaming: the worker under it stops answering now
                        (worker,) = router.fleet.placed.values()
                        hung = next(w for w in started if w.url == worker.url)
                        hung.process.send_signal(signal.SIGSTOP)
            events = [line for line in lines if line]
            assert len(events) >= 2 and events[-2] == "event: error", lines
            error = json.loads(events[-1][len("data: ") :])
            assert error["type"] == "error" and error["error"]["type"] == "api_error", error
            message = error["error"]["message"]
            assert hung.url in message and "--health-check-timeout-secs" in message and "ReadError" not in message
    finally:
        for w in started:
            w.kill()
