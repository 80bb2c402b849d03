"""Shutdown under load: Ctrl-C or SIGTERM on a busy ``mechserve serve`` ends every request in flight cleanly.

The trial: non-streaming clients got a plain-text 500, streams were cut without a ``finish_reason:
"abort"`` chunk or ``data: [DONE]``, and stderr had ~110 lines of tracebacks (uvicorn waited its
graceful timeout out, then cancelled the handlers mid-response).  Now the server drains the engine
when shutdown begins: new requests are refused, live ones aborted, every response ends properly.

The subprocess serves a tiny model whose context (8192) is far longer than what it can generate
before the signal; the test signals only once every client is known to be in flight (each stream
has sent its first chunk, the server's metrics count every request running).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_support import TINY_NAME, serving
from tiny_models import save_tiny, save_word_tokenizer, tiny_config

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "w1 w2"}]


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-8k")
    save_tiny(path, tiny_config(max_position_embeddings=8192))
    save_word_tokenizer(path)
    return path


def start_server(model: Path, world_size: int = 1) -> tuple[subprocess.Popen[str], str]:
    """``mechserve serve`` in a session of its own (so that a signal can reach its whole process group, as
    Ctrl-C in a terminal does), once it answers."""
    from mechserve.http import bind_socket

    probe = bind_socket()
    port = probe.getsockname()[1]
    probe.close()
    argv = [sys.executable, "-m", "mechserve", "serve", str(model), "--served-model-name", TINY_NAME]
    argv += ["--port", str(port), "--num-pages", "4096", "--page-size", "16", "--world-size", str(world_size)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stderr is not None
    banner = process.stderr.readline()
    assert "serving 'tiny'" in banner, banner
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # the banner comes before uvicorn listens
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.05)


def body(chat: bool, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"model": TINY_NAME, "max_tokens": 8000, "temperature": 0, "stream": stream}
    return {**out, "messages": CHAT} if chat else {**out, "prompt": "w1 w2 w3"}


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                return sample.value
    return 0.0


@pytest.mark.parametrize(
    ("signum", "world_size"),
    [
        (signal.SIGINT, 1),
        (signal.SIGTERM, 1),
        # Ctrl-C reaches the rank processes too: they ignore it and the driver ends them after the drain.
        pytest.param(signal.SIGINT, 2, marks=pytest.mark.slow),
    ],
    ids=["ctrl-c", "sigterm", "ctrl-c-two-ranks"],
)
def test_a_signal_ends_every_request_in_flight_cleanly(long_context_dir: Path, signum: int, world_size: int) -> None:
    process, url = start_server(long_context_dir, world_size)
    streams: dict[int, list[str]] = {}
    plain: dict[int, httpx.Response] = {}
    first_chunk = [threading.Event() for _ in range(3)]

    def read_stream(i: int) -> None:
        lines = streams.setdefault(i, [])
        with httpx.stream("POST", url + path(i == 1), json=body(i == 1, True), timeout=120) as reply:
            for line in reply.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk[i].set()

    def post(i: int) -> None:
        plain[i] = httpx.post(url + path(i == 1), json=body(i == 1, False), timeout=120)

    clients = [threading.Thread(target=read_stream, args=(i,)) for i in range(3)]
    clients += [threading.Thread(target=post, args=(i,)) for i in range(2)]
    try:
        for client in clients:
            client.start()
        for event in first_chunk:
            assert event.wait(60), "a stream never started"
        deadline = time.monotonic() + 60
        while running(url) < 5:  # the two non-streaming requests are in the engine too
            assert time.monotonic() < deadline, "the requests never all ran"
            time.sleep(0.02)
        os.killpg(process.pid, signum)  # the whole group, as a terminal's Ctrl-C or a supervisor's SIGTERM
        for client in clients:
            client.join(60)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    stderr = process.stderr.read() if process.stderr else ""
    assert code == 0
    assert stderr.splitlines() == ["mechserve: server stopped"], stderr  # no traceback, no cancelled task
    for i, lines in streams.items():
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2].removeprefix("data: "))
        assert [c["finish_reason"] for c in last["choices"]] == ["abort"], last
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]), i
    assert len(plain) == 2
    for reply in plain.values():
        assert reply.status_code == 503 and reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert (
            error["type"] == "server_error" and error["code"] == "shutting_down" and "shutting down" in error["message"]
        )


def test_a_drained_server_refuses_new_requests_with_503(make_llm) -> None:
    """Between the drain and the closing of the socket a request can still arrive: a 503 JSON body with code
    ``shutting_down`` (a stream's too, before it starts; the fault suite's SIGTERM under load met a stream
    refused with no code, which read as a dead engine), as is /health."""
    llm = make_llm()
    with serving(llm) as served:
        asyncio.run(llm.drain())
        requests = [
            ("/v1/completions", {"prompt": "w1", "max_tokens": 2}),
            ("/v1/completions", {"prompt": "w1", "max_tokens": 2, "stream": True}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True}),
        ]
        for route, request in requests:
            reply = httpx.post(served.url + route, json={"model": TINY_NAME, **request})
            assert reply.status_code == 503 and reply.headers["retry-after"], (route, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "shutting_down", (route, error)
            assert "shutting down" in error["message"], error
        assert httpx.get(served.url + "/health").status_code == 503
    assert served.wait_idle()["private"] == 0
