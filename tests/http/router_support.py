"""Helpers of the router tests: ``mechserve serve`` workers as local processes on free ports, and a router.

A module of its own (not ``conftest``) so that test modules can import it by a name no other test folder uses.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from server_support import TINY_NAME

from mechserve.http import BackgroundServer
from mechserve.router.app import Proxy, build_router_app
from mechserve.router.fleet import RouterOptions, WorkerFleet

ROOT = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorkerProcess:
    """``mechserve serve`` on the tiny model at ``port`` (a free one unless given), in its own process."""

    def __init__(self, model_dir: Path | str, port: int | None = None, name: str = TINY_NAME, *extra: str) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["serve", "--model", str(model_dir), "--served-model-name", name, "--port", str(self.port)]
        argv += ["--page-size", str(PAGE_SIZE), "--num-pages", "256", *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mechserve", *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 120.0) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, f"worker {self.url} exited with {self.process.returncode}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"worker {self.url} never answered"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextmanager
def workers(model_dir: Path, count: int) -> Iterator[list[WorkerProcess]]:
    """``count`` workers started together, ready, stopped after the block."""
    started = [WorkerProcess(model_dir) for _ in range(count)]
    try:
        yield [w.wait_ready() for w in started]
    finally:
        for w in started:
            w.stop()


class RouterServer:
    """A router over ``urls`` on a free port in this process: ``fleet`` and ``proxy`` can be read."""

    def __init__(
        self, urls: Sequence[str], policy: str = "cache_aware", health_interval: float = 0.2, **options: Any
    ) -> None:
        endpoints = options.pop("kv_events_endpoints", ())
        self.fleet = WorkerFleet(urls, RouterOptions(policy, PAGE_SIZE, **options), endpoints)
        self.proxy = Proxy(self.fleet, health_interval=health_interval, health_timeout=0.5, request_timeout=60)
        self.server = BackgroundServer(build_router_app(self.proxy))
        self.url = self.server.url

    def __enter__(self) -> RouterServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
