"""The fault and soak suite (issue 31): a real ``mechserve serve`` process under load, killed ranks, slow
clients and a broken model cache, each asserting what a trusted server does.

* every request ends, complete or with a clear error (never a 5xx other than a dead engine's 503);
* ``/metrics`` returns to idle (running 0, waiting 0, KV usage 0: cached pages no request holds are free);
* no traceback in the log (a dead rank's failure is logged once, with one);
* nothing hangs past ``HANG_S`` (each wait below is bounded by it and fails when it runs out);
* the server's resident memory after the soak is within ``MEMORY_SLACK`` of its level after warm-up.

The figures of a run (clients, requests, faults, memory) are printed (``pytest -s``).  Marked ``slow``: CI
runs it; the whole file takes a few minutes on two cores (most of it the real model's conversion).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ROOT, ServerProcess, save_chatml_byte_model

pytestmark = pytest.mark.slow

HANG_S = 120.0  # no wait in this file may last longer: past it, the server hung
CLIENTS = 24
REQUESTS_PER_CLIENT = 25
WARMUP_REQUESTS = 48
MEMORY_SLACK = 1.15  # resident memory after the soak <= 1.15 x after warm-up + 64 MiB
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    }
]
USER = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chatml_byte_model(tmp_path_factory.mktemp("chatml-bytes"), max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("logs") / "server.log"
    flags = ["--num-pages", "2048", "--page-size", "16", "--max-running", "32", "--client-timeout", "3"]
    with ServerProcess(model_dir, *flags, log=log) as served:
        yield served


def wait_idle(served: ServerProcess) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits; fail after ``HANG_S``."""
    deadline = time.monotonic() + HANG_S
    while True:
        gauges = {
            name: served.metric(f"vllm:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        }
        if not any(gauges.values()):
            return gauges
        assert time.monotonic() < deadline, f"the server never went idle: {gauges}"
        time.sleep(0.2)


# One request of the mix: (path, body, how the client behaves) -------------------------------------------------


def request(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    kind = rng.choice(
        ["text-n2", "text-stream-n2", "json", "tools-stream", "tools-auto", "cut-stream", "cut-plain", "tokenize"]
    )
    seed = rng.randrange(1 << 20)
    text = {"prompt": rng.choice(["abc", "hello world", '{"a":']), "seed": seed, "max_tokens": rng.randint(4, 24)}
    chat = {"messages": USER, "seed": seed, "max_tokens": rng.randint(8, 40)}
    if kind == "text-n2":
        return kind, "/v1/completions", {**text, "n": 2, "stop": ["ab", "}"], "logprobs": 2}
    if kind in ("text-stream-n2", "cut-stream"):
        body = {**text, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "stop": ["zz"]}
        return kind, "/v1/completions", body
    if kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        return (
            kind,
            "/v1/chat/completions",
            {**chat, "max_tokens": 64, "response_format": fmt, "logprobs": True, "top_logprobs": 1},
        )
    if kind == "tools-stream":
        return (
            kind,
            "/v1/chat/completions",
            {**chat, "max_tokens": 48, "tools": TOOLS, "tool_choice": "required", "stream": True},
        )
    if kind == "tools-auto":
        return kind, "/v1/chat/completions", {**chat, "tools": TOOLS, "n": 2}
    if kind == "cut-plain":
        return kind, "/v1/completions", {**text, "max_tokens": 400}
    return kind, "/tokenize", {"messages": USER}


async def one(client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any]) -> str:
    """Send one request and read it as its kind says; returns the outcome ("ok", "cut"), raising on a bad one."""
    if body.get("stream"):
        lines: list[str] = []
        async with client.stream("POST", path, json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            async for line in reply.aiter_lines():
                if line:
                    lines.append(line)
                if kind == "cut-stream" and len(lines) >= 2:
                    return "cut"  # leaving the block closes the connection mid-stream
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        if kind == "tools-stream":
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            assert finishes[-1] in ("tool_calls", "length"), finishes
            assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices"))
        return "ok"
    if kind == "cut-plain":
        try:
            await client.post(path, json=body, timeout=0.05)
        except httpx.TimeoutException:
            return "cut"
        return "ok"
    reply = await client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    if kind == "json":  # complete and valid, unless max_tokens cut it
        choice = data["choices"][0]
        if choice["finish_reason"] == "stop":
            out = json.loads(choice["message"]["content"])
            assert isinstance(out, dict) and isinstance(out["a"], int)
        else:
            assert choice["finish_reason"] == "length"
    if kind == "text-n2":
        assert len(data["choices"]) == 2 and all(c["logprobs"] for c in data["choices"])
    return "ok"


async def load(url: str, clients: int, per_client: int, seed: int) -> Counter[str]:
    """``clients`` concurrent clients sending ``per_client`` requests each; every one must end well."""
    outcomes: Counter[str] = Counter()

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=HANG_S) as client:
            for _ in range(per_client):
                kind, path, body = request(rng)
                outcomes[f"{kind}:{await one(client, kind, path, body)}"] += 1

    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return outcomes


def test_soak_then_sigint_under_load(server: ServerProcess) -> None:
    """Warm-up, the soak (streamed and plain, n=2, stop strings, logprobs, JSON schemas, forced and free tools,
    disconnects), idle metrics, bounded memory, no traceback; then Ctrl-C under load ends every request."""
    started = time.monotonic()
    asyncio.run(load(server.url, 8, WARMUP_REQUESTS // 8, seed=1))
    wait_idle(server)
    warm = server.rss()
    outcomes = asyncio.run(load(server.url, CLIENTS, REQUESTS_PER_CLIENT, seed=2))
    idle = wait_idle(server)
    after = server.rss()
    soak_s = time.monotonic() - started
    total = sum(outcomes.values())
    print(
        f"\nsoak: {CLIENTS} clients, {total} requests (+{WARMUP_REQUESTS} warm-up) in {soak_s:.0f} s; "
        f"{sum(v for k, v in outcomes.items() if k.endswith(':cut'))} cut by their clients; "
        f"RSS {warm / 2**20:.0f} MiB after warm-up, {after / 2**20:.0f} MiB after; idle {idle}"
    )
    print(f"outcomes: {dict(sorted(outcomes.items()))}")
    assert total == CLIENTS * REQUESTS_PER_CLIENT
    assert after <= warm * MEMORY_SLACK + (64 << 20), (warm, after)
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]

    # Ctrl-C (to the process group, as a terminal sends it) while clients stream: every one ends
    results: list[str] = []

    def stream(i: int) -> None:
        body = {"prompt": "abc", "max_tokens": 4000, "ignore_eos": True, "stream": True, "n": 1 + i % 2}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as reply:
                last = [line for line in reply.iter_lines() if line][-2:]
            results.append("abort" if '"abort"' in last[0] and last[1] == "data: [DONE]" else f"bad {last}")
        except httpx.HTTPError as exc:
            results.append(f"error {exc!r}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HANG_S
    while server.metric("vllm:num_requests_running") < 9:  # 6 streams, 3 of them n=2
        assert time.monotonic() < deadline, "the streams never all ran"
        time.sleep(0.05)
    code = server.stop(signal.SIGINT, timeout=HANG_S)
    for t in threads:
        t.join(HANG_S)
    assert code == 0 and results == ["abort"] * 6, results
    assert server.log().rstrip().endswith("mechserve: server stopped") and "Traceback" not in server.log()


async def until_shutdown(url: str, clients: int, seed: int, outcomes: Counter[str]) -> None:
    """``clients`` clients sending the soak's mix until the server goes away; every request must end as a trusted
    server ends one when it stops: complete, a stream ended with an ``abort`` chunk and ``[DONE]``, a 503
    ``shutting_down``, or the connection refused or closed before any response began (``ending``); never a 5xx,
    a cut response or a hang."""

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        limits = httpx.Limits(max_keepalive_connections=0)  # a connection per request: no keep-alive race
        async with httpx.AsyncClient(base_url=url, timeout=HANG_S, limits=limits) as client:
            while True:
                kind, path, body = request(rng)
                if kind.startswith("cut"):
                    continue  # the soak's disconnects are its own; here every request is read to its end
                outcome = await ending(client, path, body)
                outcomes[outcome] += 1
                if outcome in ("refused", "gone"):
                    return

    await asyncio.gather(*(client_loop(i) for i in range(clients)))


async def ending(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    """How one request ended while the server stops (see ``until_shutdown``); raises on a bad ending.

    A connection closed before any response began (refused, closed or reset: the server stopped listening, or
    closed a connection whose request it had not started) is ``"gone"``; one closed after its response began
    is a cut response, and fails."""
    began = False
    try:
        async with client.stream("POST", path, json=body) as reply:
            began = True
            if reply.status_code == 503:  # refused before it started: the server says why
                error = json.loads(await reply.aread())["error"]
                assert error["code"] == "shutting_down", error
                return "refused"
            assert reply.status_code == 200, await reply.aread()
            if not body.get("stream"):
                await reply.aread()
                return "complete"
            lines = [line async for line in reply.aiter_lines() if line]
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        if began:
            raise
        assert "Traceback" not in str(exc)
        return "gone"
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    finishes = [c["finish_reason"] for c in last.get("choices", [])]
    return "aborted" if "abort" in finishes else "complete"


def test_sigterm_to_the_server_alone_under_mixed_load(model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the server's own pid (as Kubernetes sends it: not to a process group) while 16 clients send
    the soak's mix (n=2, stop strings, logprobs, JSON schemas, forced and free tools, streamed and not):
    every request ends (complete, aborted with [DONE], a 503, or refused once the socket closed), the
    process exits 0 with no traceback."""
    flags = ["--num-pages", "2048", "--page-size", "16", "--max-running", "32"]
    with ServerProcess(model_dir, *flags, log=tmp_path / "server.log") as served:
        outcomes: Counter[str] = Counter()
        failures: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(until_shutdown(served.url, 16, seed=5, outcomes=outcomes))
            except BaseException as exc:  # handed to the test
                failures.append(exc)

        load_thread = threading.Thread(target=run)
        load_thread.start()
        deadline = time.monotonic() + HANG_S
        while served.metric("vllm:num_requests_running") < 8 or sum(outcomes.values()) < 32:
            assert time.monotonic() < deadline and load_thread.is_alive(), (outcomes, failures)
            time.sleep(0.05)
        os.kill(served.process.pid, signal.SIGTERM)
        code = served.process.wait(HANG_S)
        load_thread.join(HANG_S)
        assert not load_thread.is_alive(), "a client never got to the end of its request"
        log = served.log()
    print(f"\nSIGTERM under mixed load: exit {code}; outcomes {dict(sorted(outcomes.items()))}")
    assert not failures, failures[0]
    assert code == 0 and "Traceback" not in log and log.rstrip().endswith("mechserve: server stopped"), log[-3000:]
    assert outcomes["aborted"] + outcomes["refused"] > 0, outcomes  # the signal did come under load


def test_a_client_that_never_reads_its_stream_is_given_up(model_dir: Path, tmp_path: Path) -> None:
    """A stream whose client reads nothing fills the socket's buffers; after --client-timeout of that the server
    gives it up (the connection closes, the request is aborted, its buffered events freed) while the
    others are served as usual."""
    flags = ["--num-pages", "2048", "--page-size", "16", "--client-timeout", "3"]
    with ServerProcess(model_dir, *flags, log=tmp_path / "server.log") as served:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", served.port))
        body = json.dumps(
            # three choices of 7,000 tokens with 20 logprobs each: ~9 MB, more than the server's socket can
            # buffer (net.ipv4.tcp_wmem's 4 MiB); one choice (~3 MB) fitted on an idle machine and finished
            {"prompt": "abc", "max_tokens": 7000, "n": 3, "ignore_eos": True, "stream": True, "logprobs": 20}
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + HANG_S
        while served.metric("vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(5):  # the others are served meanwhile
            assert served.post("/v1/completions", {"prompt": "abc", "max_tokens": 8}).status_code == 200
        wait_idle(served)  # the stalled stream was given up (or ran out) and its request left the engine
        sock.settimeout(HANG_S)
        data = b""
        try:
            while chunk := sock.recv(1 << 16):  # what the buffers held, then the end: the server gave it up
                data += chunk
        except ConnectionResetError:
            pass
        sock.close()
        tokens = served.metric("vllm:generation_tokens_total")
        print(
            f"\nnever-reading client: {len(data)} bytes reached it before the server gave up; "
            f"{tokens:.0f} tokens generated in all"
        )
        assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data  # cut, not finished
        assert "Traceback" not in served.log()


def _rank_pids(served: ServerProcess) -> list[int]:
    children = Path(f"/proc/{served.process.pid}/task/{served.process.pid}/children").read_text().split()
    pids = []
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            pids.append(pid)
    return pids


@pytest.mark.parametrize("when", ["in-flight", "idle"])
def test_a_killed_rank_makes_the_server_exit_non_zero(model_dir: Path, tmp_path: Path, when: str) -> None:
    """kill -9 of a tensor-parallel rank left a zombie: /health 200 and a 500 with a traceback per request.
    Now the requests in flight end with a 503 body (no pid), /health and new requests are 503 (or refused
    once the process is gone), the log holds one traceback, and the process exits with status 1."""
    flags = ["--world-size", "2", "--num-pages", "512", "--page-size", "16"]
    with ServerProcess(model_dir, *flags, log=tmp_path / "server.log") as served:
        ranks = _rank_pids(served)
        assert len(ranks) == 2, ranks
        replies: list[Any] = []

        def plain() -> None:
            try:
                replies.append(
                    served.post(
                        "/v1/completions", {"prompt": "abc", "max_tokens": 6000, "ignore_eos": True}, timeout=HANG_S
                    )
                )
            except httpx.HTTPError as exc:
                replies.append(exc)

        def streamed() -> None:
            body = {"prompt": "abc", "max_tokens": 6000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=HANG_S) as reply:
                    replies.append([line for line in reply.iter_lines() if line][-2:])
            except httpx.HTTPError as exc:
                replies.append(exc)

        clients = [threading.Thread(target=f) for f in (plain, streamed)] if when == "in-flight" else []
        for c in clients:
            c.start()
        deadline = time.monotonic() + HANG_S
        while served.metric("vllm:num_requests_running") < len(clients):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(ranks[1], signal.SIGKILL)
        health = []
        while served.process.poll() is None:
            assert time.monotonic() < deadline + HANG_S, "the server never exited"
            try:
                health.append(httpx.get(served.url + "/health", timeout=5).status_code)
                after = served.post("/v1/completions", {"prompt": "abc", "max_tokens": 2}, timeout=10)
                health.append(after.status_code)
                assert "pid" not in after.text
                if after.status_code == 503:  # dead, not stopping: a supervisor can tell the two apart
                    assert after.json()["error"]["code"] == "engine_dead", after.text
            except httpx.TransportError:
                break
            time.sleep(0.05)
        code = served.process.wait(HANG_S)
        for c in clients:
            c.join(HANG_S)
        log = served.log()
    print(f"\nkilled rank ({when}): exit {code}; /health and new requests answered {Counter(health)} before exit")
    assert code == 1
    noticed = next((i for i, status in enumerate(health) if status != 200), len(health))
    assert 200 not in health[noticed:]  # once the death is noticed nothing says healthy
    assert log.count("Traceback") == 1 and "exiting with status 1" in log, log[-3000:]
    for reply in replies:
        if isinstance(reply, httpx.Response):
            assert reply.status_code == 503 and "pid" not in reply.text, reply.text
        elif isinstance(reply, list):
            assert reply[-1] == "data: [DONE]" and '"error"' in reply[0] and "pid" not in reply[0], reply
        else:
            assert isinstance(reply, httpx.TransportError), reply  # the process left before the answer


# The model cache on first run: the real conversion of the embedded SmolLM2 -----------------------------------

GENERATE = [sys.executable, "-m", "mechserve", "generate", "Hi", "--max-tokens", "1", "--temperature", "0"]


def cache_env(cache: Path) -> dict[str, str]:
    """A fresh cache (torch's attention and linear paths: no native kernel is built into it)."""
    paths = {"MECHSERVE_ATTENTION": "torch", "MECHSERVE_LINEAR": "torch"}
    return {**os.environ, **paths, "MECHSERVE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def generate(cache: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = cache_env(cache)
    return subprocess.run([*(prefix or []), *GENERATE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def mounted(directory: Path, options: str) -> list[str]:
    """An argv prefix: a tmpfs with ``options`` on ``directory``, in a mount namespace of the command's own."""
    directory.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "--map-root-user", "--mount", "sh", "-c", script, "sh", options, str(directory)]


def test_a_full_or_read_only_cache_on_first_run_is_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    full = generate(cache, mounted(cache, "size=64m"))  # the weights are ~540 MB
    assert full.returncode == 2, full.stderr
    assert full.stderr.splitlines()[-1] == (
        f"mechserve: error: cannot use the model cache {cache} (MECHSERVE_CACHE={cache}): No space left on device; "
        "set MECHSERVE_CACHE to a writable directory"
    ), full.stderr
    readonly = generate(cache, mounted(cache, "ro,size=1m"))
    assert readonly.returncode == 2
    assert readonly.stderr.splitlines() == [
        f"mechserve: error: cannot use the model cache {cache} (MECHSERVE_CACHE={cache}): Read-only file system; "
        "set MECHSERVE_CACHE to a writable directory"
    ]


def test_two_processes_convert_once_and_a_damaged_cache_is_found(tmp_path: Path) -> None:
    """Two first runs at once: one converts, the other waits and uses its copy; both answer alike.  Then 50 MB
    of random bytes over the converted weights (which once generated token 0 silently): the next run
    stops with the cache's delete-and-reconvert message."""
    cache = tmp_path / "cache"
    env = cache_env(cache)
    runs = [
        subprocess.Popen(GENERATE, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    assert [o[0].splitlines()[:2] for o in outs] == [outs[0][0].splitlines()[:2]] * 2  # the trace, the text
    errs = outs[0][1] + outs[1][1]
    assert errs.count("mechserve: converting the embedded SmolLM2") == 1, errs
    converted = next(cache.glob("smollm2-*"))
    weights = converted / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 3)
        f.write(os.urandom(50 << 20))
    damaged = generate(cache)
    assert damaged.returncode == 2
    assert damaged.stderr.splitlines() == [
        f"mechserve: error: the converted model in {converted} is damaged (model.safetensors: its content changed "
        "since it was written (SHA-256)); delete that directory and mechserve converts the embedded model again "
        f"on its next run (MECHSERVE_CACHE sets where the cache is)"
    ], damaged.stderr
