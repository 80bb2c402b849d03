"""uvicorn for the server: ``Server`` ends in-flight requests at shutdown; ``BackgroundServer`` runs it in a thread.

``Server`` is uvicorn's server whose shutdown first drains the app (``drain``, normally
``AsyncLLM.drain``: new requests are refused, every live one is aborted), so every response in
flight ends as the protocol says (a stream with a ``finish_reason: "abort"`` chunk and
``data: [DONE]``, a non-streaming request with a 503) before uvicorn waits for the connections to
close, instead of waiting its graceful timeout out and then cancelling the handlers mid-response.

Binding first (port 0: the kernel picks a free port) means there is no
window in which another process can take the port, and the caller knows the
URL before uvicorn has started::

    with BackgroundServer(build_app(llm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import uvicorn

STARTUP_TIMEOUT = 60.0
log = logging.getLogger("mechserve.http")


class Server(uvicorn.Server):
    """uvicorn's ``Server`` that awaits ``drain()`` when shutdown begins, before it waits for connections.

    ``drain`` defaults to the app's ``AsyncLLM.drain`` (``app.state.llm``), if it has one.
    """

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        llm = getattr(getattr(config.app, "state", None), "llm", None)
        self.drain = drain if drain is not None else getattr(llm, "drain", None)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain is not None:
            try:
                await self.drain()
            except Exception:  # shutting down goes on; what is still in flight is cut as uvicorn would
                log.exception("draining the server's requests failed")
        await super().shutdown(sockets)


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (port 0: a free one), with SO_REUSEADDR."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class BackgroundServer:
    """uvicorn serving ``app`` on ``host:port`` (default: 127.0.0.1 and a free port) in a daemon thread.

    ``__enter__`` returns once the server accepts connections (its lifespan
    started the app's engine), raising ``RuntimeError`` if it fails to start;
    ``__exit__`` asks it to stop and joins the thread.  ``url`` is
    ``http://host:port``.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **uvicorn_options: Any) -> None:
        self.socket = bind_socket(host, port)
        self.host, self.port = self.socket.getsockname()[:2]
        options = {"log_level": "warning", "timeout_graceful_shutdown": 5, **uvicorn_options}
        self.server = Server(uvicorn.Config(app, lifespan="on", **options))
        self._thread = threading.Thread(target=self._run, name="mechserve-uvicorn", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        except BaseException as exc:  # reported by start()
            self._error = exc

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self._error or 'startup failed or timed out'}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
