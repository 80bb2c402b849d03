"""``mechserve router`` in front of real ``mechserve serve`` workers (local processes on free ports).

The router calls m15's policy (``mechserve.spec.m15_routing.choose``, through its ``Router``) and its
decision log replays through m15 to the same choices (issue 26, items 4 and 6).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_support import RouterServer, WorkerProcess, free_port, wait_for, workers
from server_support import TINY_NAME

from mechserve.cli.main import main
from mechserve.router.fleet import RouterOptions, WorkerFleet, replay_log
from mechserve.spec import m15_routing as m15


@pytest.fixture(scope="module")
def two_workers(tiny_dir: Path) -> Iterator[list[WorkerProcess]]:
    with workers(tiny_dir, 2) as started:
        yield started


def completion(url: str, prompt: str, max_tokens: int = 4, **extra: object) -> httpx.Response:
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def sse_events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_router_cli_errors_are_one_line_and_status_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cases = [
        (["router"], "--worker-urls"),
        (["router", "--worker-urls"], "--worker-urls"),
        (["router", "--worker-urls", "localhost:8000"], "not a worker URL"),
        (["router", "--worker-urls", "http://h:99999"], "bad port"),
        (["router", "--worker-urls", "http://h:1/v1"], "not a worker URL"),
        (["router", "--worker-urls", "http://h:1", "--policy", "oracle"], "--policy"),
        (["router", "--worker-urls", "http://h:1", "--policy", "random"], "--policy"),
        (["router", "--worker-urls", "http://h:1", "http://h:1"], "named twice"),
        (["router", "--worker-urls", "http://h:1", "--policy", "precise"], "--kv-events-endpoints"),
        (["router", "--worker-urls", "http://h:1", "--kv-events-endpoints", "tcp://h:5"], "only --policy precise"),
        (
            ["router", "--worker-urls", "http://h:1", "--policy", "precise", "--kv-events-endpoints", "h:5"],
            "ZeroMQ endpoint",
        ),
        (["router", "--worker-urls", "http://h:1", "--kv-events-topic", "kv"], "--kv-events-topic"),
        (["router", "--worker-urls", "http://h:1", "--no-load-guard"], "--no-load-guard"),
        (["router", "--worker-urls", "http://h:1", "--cache-threshold", "2"], "--cache-threshold"),
        (["router", "--worker-urls", "http://h:1", "--balance-rel-threshold", "0"], "--balance-rel-threshold"),
        (["router", "--worker-urls", "http://h:1", "--decision-log", str(tmp_path / "no" / "log")], "--decision-log"),
    ]
    for argv, named in cases:
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, argv
        assert err.startswith("mechserve: error: ") and err.count("\n") == 1, (argv, err)
        assert named in err, (argv, err)


def test_router_routes_by_m15_and_its_log_replays_to_the_same_choices(two_workers: list[WorkerProcess]) -> None:
    urls = [w.url for w in two_workers]
    with RouterServer(urls, "cache_aware") as router:
        assert httpx.get(router.url + "/health").json() == {"live_workers": 2}
        models = httpx.get(router.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == [TINY_NAME]
        tenants = [" ".join(f"w{(t * 7 + i) % 128}" for i in range(24)) for t in range(4)]
        answers = {}
        for turn in range(3):
            for t, system in enumerate(tenants):
                reply = completion(router.url, f"{system} w{turn + 1} w{t + 2}")
                assert reply.status_code == 200, reply.text
                answers[(t, turn)] = reply.json()["choices"][0]["text"]
        # greedy output through the router is what one worker gives alone
        direct = completion(urls[1], f"{tenants[2]} w3 w4").json()["choices"][0]["text"]
        assert direct == answers[(2, 2)]
        logged, replayed = replay_log(router.fleet.log)
    assert len(logged) == 12 and replayed == logged
    rules = [d.rule for d in logged]
    assert rules.count("cache_hit") == 8, rules  # every later turn goes where its tenant's prefix went
    by_tenant: dict[int, set[int]] = {}
    for i, d in enumerate(logged):
        by_tenant.setdefault(i % 4, set()).add(d.replica)
    assert all(len(replicas) == 1 for replicas in by_tenant.values())
    assert {r for rs in by_tenant.values() for r in rs} == {0, 1}  # the smallest-tree rule spreads tenants


def test_round_robin_alternates_and_least_loaded_avoids_a_busy_worker(two_workers: list[WorkerProcess]) -> None:
    urls = [w.url for w in two_workers]
    with RouterServer(urls, "round_robin") as router:
        for i in range(4):
            assert completion(router.url, f"w{i} w5 w6").status_code == 200
        logged, replayed = replay_log(router.fleet.log)
    assert replayed == logged and [d.replica for d in logged] == [0, 1, 0, 1]
    with RouterServer(urls, "least_loaded") as router:
        for i in range(3):  # one at a time: each finds both idle, so the lowest index
            assert completion(router.url, f"w{i} w2").status_code == 200
        logged, replayed = replay_log(router.fleet.log)
    assert replayed == logged and [d.replica for d in logged] == [0, 0, 0]
    assert [d.rule for d in logged] == ["least_loaded"] * 3


def test_the_fleet_counts_outstanding_requests_until_they_finish() -> None:
    fleet = WorkerFleet(["http://a:1", "http://b:1"], RouterOptions("least_loaded", 4))
    for w in fleet.workers:
        fleet.joined(w, TINY_NAME)
    assert [fleet.route(rid, [])[0].url for rid in ("a", "b")] == ["http://a:1", "http://b:1"]
    fleet.finish("b")
    assert fleet.route("c", [])[0].url == "http://b:1"
    fleet.down(fleet.workers[1], "test")  # a new m15 router over the one live worker
    assert fleet.route("d", [])[0].url == "http://a:1"
    logged, replayed = replay_log(fleet.log)
    assert replayed == logged and [d.replica for d in logged] == [0, 1, 1, 0]


def test_a_worker_down_at_start_and_its_rejoin_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    fleet = WorkerFleet(["http://a:1", "http://b:1"], RouterOptions("round_robin", 4))
    with caplog.at_level(logging.WARNING, logger="mechserve.router"):
        fleet.joined(fleet.workers[0], TINY_NAME)
        fleet.down(fleet.workers[1], "health check failed: ConnectError")  # never answered: it was pending
        fleet.joined(fleet.workers[1], TINY_NAME)
        fleet.joined(fleet.workers[1], TINY_NAME)  # still live: nothing more to say
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "worker http://b:1 is down at start (requests go to the others until it answers): health check failed: "
        "ConnectError",
        "worker http://b:1 rejoined: it answers its checks again (it was down: health check failed: ConnectError)",
    ]


def test_streams_pass_through_chunk_by_chunk(two_workers: list[WorkerProcess]) -> None:
    with RouterServer([w.url for w in two_workers], "round_robin") as router:
        body = {"model": TINY_NAME, "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 0, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            events = sse_events(list(reply.iter_lines()))
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        direct = completion(two_workers[0].url, "w1 w2 w3", 6).json()["choices"][0]["text"]
        assert text == direct
        chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 3}
        reply = httpx.post(router.url + "/v1/chat/completions", json={**chat, "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        wait_for(lambda: not router.fleet.placed, what="every routed request to finish")
        assert router.fleet.router is not None and router.fleet.router.state.outstanding == [0, 0]


def test_bad_requests_get_openai_errors(two_workers: list[WorkerProcess]) -> None:
    with RouterServer([w.url for w in two_workers], "cache_aware") as router:
        reply = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
        reply = httpx.post(router.url + "/v1/completions", json=[1, 2], timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
        reply = completion(router.url, "w1", max_tokens=-3)  # the worker names the field
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
        reply = httpx.post(router.url + "/v1/completions", json={"prompt": "w1", "model": "other"}, timeout=30)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        reply = httpx.get(router.url + "/v1/nothing", timeout=30)
        assert reply.status_code == 404 and "error" in reply.json()
        wait_for(lambda: not router.fleet.placed, what="every routed request to finish")


def test_no_live_worker_is_a_503_and_health_says_so(tiny_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with RouterServer([url], "round_robin") as router:
        assert httpx.get(router.url + "/health").status_code == 503
        reply = completion(router.url, "w1")
        assert reply.status_code == 503 and "no worker is available" in reply.json()["error"]["message"]
        cards = httpx.get(router.url + "/workers").json()["workers"]
        assert cards[0]["state"] == "down" and "health check failed" in cards[0]["reason"]


def test_a_worker_serving_another_model_is_refused_at_join(tiny_dir: Path, two_workers: list[WorkerProcess]) -> None:
    other = WorkerProcess(tiny_dir, None, "another-model").wait_ready()
    try:
        with RouterServer([two_workers[0].url, other.url], "round_robin") as router:
            cards = {c["url"]: c for c in httpx.get(router.url + "/workers").json()["workers"]}
            assert cards[other.url]["state"] == "refused"
            assert "another-model" in cards[other.url]["reason"]
            for _ in range(3):
                assert completion(router.url, "w1 w2").status_code == 200
            logged, _ = replay_log(router.fleet.log)
            assert {d.replica for d in logged} == {0}
            assert router.fleet.live and [w.url for w in router.fleet.live] == [two_workers[0].url]
    finally:
        other.stop()


def test_replay_log_refuses_a_log_without_config() -> None:
    with pytest.raises(ValueError, match="config"):
        replay_log([{"finished": "x"}])
    config = m15.RouterConfig("round_robin", 2)
    router = m15.Router(config, log=True)
    views = [m15.ReplicaView(i, 0, 0, 0, 0.0) for i in range(2)]
    router.route(m15.RouteRequest("a", 1, 0, ()), views)
    logged, replayed = replay_log([{"config": config.to_json(), "workers": ["u", "v"]}, *(router.log or [])])
    assert logged == replayed and logged[0].replica == 0


def test_precise_routes_to_the_worker_whose_kv_events_hold_the_prefix(tiny_dir: Path) -> None:
    ports = [free_port() for _ in range(2)]
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports]
    started = [WorkerProcess(tiny_dir, None, TINY_NAME, "--kv-events-endpoint", ep) for ep in endpoints]
    try:
        for w in started:
            w.wait_ready()
        urls = [w.url for w in started]
        with RouterServer(urls, "precise", kv_events_endpoints=endpoints) as router:
            fleet = router.fleet
            assert fleet.router is not None and len(fleet.live) == 2
            system = " ".join(f"w{(5 * i + 3) % 128}" for i in range(20))  # 5 blocks of 4
            # warm worker 1 directly: only its events tell the router it holds the prefix
            assert completion(urls[1], f"{system} w1", 2).status_code == 200
            wait_for(lambda: len(fleet.workers[1].resident) >= 5, what="worker 1's KV events")
            assert not fleet.workers[0].resident
            reply = completion(router.url, f"{system} w9 w8", 2)
            assert reply.status_code == 200
            other = completion(router.url, "w100 w101 w102 w103 w104 w105 w106 w107 w1", 2)
            assert other.status_code == 200
            wait_for(lambda: not fleet.placed, what="every routed request to finish")
            logged, replayed = replay_log(fleet.log)
            assert any("events" in e for e in fleet.log)
    finally:
        for w in started:
            w.stop()
    assert replayed == logged
    first = logged[0]
    assert (first.replica, first.rule, first.matched) == (1, "longest_prefix", 20), first.reason
    assert logged[1].rule in ("no_prefix", "longest_prefix")


def test_router_command_serves_until_interrupted_and_its_decision_log_replays(
    two_workers: list[WorkerProcess], tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    from router_support import ROOT

    port, log_path = free_port(), tmp_path / "decisions.jsonl"
    argv = ["router", "--worker-urls", *(w.url for w in two_workers), "--port", str(port)]
    argv += ["--block-size", "4", "--decision-log", str(log_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "mechserve", *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        banner = process.stderr.readline() if process.stderr else ""
        assert f"routing on http://127.0.0.1:{port} by cache_aware over 2 worker(s)" in banner, banner
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url), what="the router to answer")
        system = " ".join(f"w{i}" for i in range(30, 50))
        for turn in range(3):
            assert completion(url, f"{system} w{turn}").status_code == 200
        # a client that goes away mid-stream: the worker's request ends, the router forgets it
        body = {"model": TINY_NAME, "prompt": "w7", "max_tokens": 400, "temperature": 0, "stream": True, "n": 4}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            next(s.iter_lines())
        for w in two_workers:
            wait_for(lambda w=w: _idle(w.url), what=f"{w.url} to end the abandoned stream")
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=30)
        rest = process.stderr.read() if process.stderr else ""
    assert code == 0 and "mechserve: router stopped" in rest, rest
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    logged, replayed = replay_log(entries)
    assert replayed == logged and len(logged) == 4
    assert [d.rule for d in logged[:3]] == ["smallest_tree", "cache_hit", "cache_hit"]
    finished = [e["finished"] for e in entries if "finished" in e]
    assert sorted(finished) == sorted(d.request_id for d in logged)  # the abandoned stream too


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _idle(url: str) -> bool:
    from mechserve.router.app import load_report

    running, waiting, _ = load_report(httpx.get(url + "/metrics", timeout=5).text)
    return running == 0 and waiting == 0


def test_messages_and_unstored_responses_are_routed_and_stored_ones_refused(two_workers: list[WorkerProcess]) -> None:
    """/v1/messages (and count_tokens) and /v1/responses with store false reach the workers through the router,
    streams included (they were 404); a stored response is refused naming why (it lives on one worker)."""
    with RouterServer([w.url for w in two_workers], "cache_aware") as router:
        user = [{"role": "user", "content": "w1 w2"}]
        body = {"model": TINY_NAME, "max_tokens": 3, "messages": user, "temperature": 0}
        reply = httpx.post(router.url + "/v1/messages", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["output_tokens"] == 3, reply.text
        with httpx.stream("POST", router.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("event: ")]
        assert lines[0] == "event: message_start" and lines[-1] == "event: message_stop", lines
        count = httpx.post(router.url + "/v1/messages/count_tokens", json={"model": TINY_NAME, "messages": user})
        assert count.status_code == 200 and count.json()["input_tokens"] > 0, count.text
        unstored = {"model": TINY_NAME, "input": "w1 w2", "max_output_tokens": 3, "store": False}
        reply = httpx.post(router.url + "/v1/responses", json=unstored, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["output_tokens"] == 3, reply.text
        with httpx.stream("POST", router.url + "/v1/responses", json={**unstored, "stream": True}, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("event: ")]
        assert lines[0] == "event: response.created" and lines[-1] == "event: response.incomplete", (
            lines
        )  # max_output_tokens
        for extra, param in (({"store": True}, "store"), ({}, "store"), ({"background": True}, "background")):
            stored = {k: v for k, v in unstored.items() if k != "store"} | extra
            reply = httpx.post(router.url + "/v1/responses", json=stored, timeout=60)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
            assert "the router keeps no stored responses" in reply.json()["error"]["message"]
        reply = httpx.post(router.url + "/v1/responses", json={**unstored, "previous_response_id": "resp_1"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "previous_response_id", reply.text
        for method, path in (
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("POST", "/v1/responses/resp_1/cancel"),
            ("GET", "/v1/responses/resp_1/input_items"),
        ):
            reply = httpx.request(method, router.url + path, timeout=30)
            assert reply.status_code == 400 and "the router keeps no stored responses" in reply.text, (path, reply.text)
        wait_for(lambda: not router.fleet.placed, what="every routed request to finish")
