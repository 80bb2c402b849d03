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

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mechserve.api.limits import CLIENT_TIMEOUT_S

STARTUP_TIMEOUT = 60.0
log = logging.getLogger("mechserve.http")


class Server(uvicorn.Server):
    """uvicorn's ``Server`` that awaits ``drain()`` when shutdown begins, before it waits for connections, and
    that stops by itself when its engine dies.

    ``drain`` defaults to the app's ``AsyncLLM.drain`` (``app.state.llm``), if it has one.  Every tick
    (0.1 s) it looks at the engine: once ``llm.error`` is set (a rank died, a step could not be
    recovered), ``/health`` already answers 503 and new requests 503; the server logs the failure once,
    sets ``engine_error`` and shuts down, so that its process exits and a supervisor can restart it
    (vLLM's watchdog does the same with ``EngineDeadError``).
    """

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        llm = getattr(getattr(config.app, "state", None), "llm", None)
        self.llm = llm
        self.drain = drain if drain is not None else getattr(llm, "drain", None)
        self.engine_error: BaseException | None = None

    async def on_tick(self, counter: int) -> bool:
        error = getattr(self.llm, "error", None)
        if error is not None and self.engine_error is None:
            self.engine_error = error
            log.critical("%s; the server stops so that it can be restarted", error)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.drain is not None:
            try:
                await self.drain()
            except Exception:  # shutting down goes on; what is still in flight is cut as uvicorn would
                log.exception("draining the server's requests failed")
        await super().shutdown(sockets)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with two deadlines, ``read_timeout_s`` each (``--client-timeout``).

    * Reading: a request's head and body must arrive within it of the connection (or of the previous
      response's end), else the connection is closed, with a 408 when no response has begun.  uvicorn
      alone keeps a connection that sent a partial head, or nothing at all, open for ever (its keep-alive
      timer only runs between requests): 600 of them held 600 sockets.
    * Writing: a response the client does not read (the socket's buffers full, uvicorn's writes paused)
      for that long is given up: the connection closes, the request is aborted and what it had buffered
      is freed.

    The head's size is h11's ``h11_max_incomplete_event_size`` (16 KiB)."""

    read_timeout_s: float = CLIENT_TIMEOUT_S
    timed_out = 0  # connections closed by the deadline (all of this class's servers)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._unstall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unstall()
        self._write_deadline: asyncio.TimerHandle | None = self.loop.call_later(self.read_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._unstall()
        super().resume_writing()

    def _unstall(self) -> None:
        handle = getattr(self, "_write_deadline", None)
        if handle is not None:
            handle.cancel()
            self._write_deadline = None

    def _stalled(self) -> None:
        """The client read nothing for ``read_timeout_s``: close; the app sees a disconnect and aborts."""
        self._write_deadline = None
        if not self.transport.is_closing():
            type(self).timed_out += 1
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.abort()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()  # the request is read: what follows is the app's time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()  # type: ignore[union-attr]
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state in (h11.DONE, h11.MUST_CLOSE):
            return
        type(self).timed_out += 1
        cycle = self.cycle
        # a request began and no response to it has: say why (408); an idle keep-alive connection after a
        # complete response just closes, as uvicorn's keep-alive timeout does (a 408 there would follow the
        # previous response on the wire, read by a client that never sent another request)
        idle = cycle is not None and cycle.response_complete and self.conn.their_state == h11.IDLE
        if not idle and (cycle is None or cycle.response_complete or not cycle.response_started):
            self.transport.write(_TIMEOUT_RESPONSE)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app waiting for the body gets http.disconnect, its sends go nowhere
            cycle.message_event.set()
        self.transport.close()


_TIMEOUT_BODY = json.dumps(
    {"error": {"message": "the request was not received in time", "type": "invalid_request_error", "code": 408}}
).encode()
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


def guarded_protocol(read_timeout_s: float = CLIENT_TIMEOUT_S) -> type[GuardedH11Protocol]:
    """``GuardedH11Protocol`` with its deadline set to ``read_timeout_s`` (uvicorn's ``http=`` takes a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout_s": read_timeout_s})


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
        options = {
            "log_level": "warning",
            "timeout_graceful_shutdown": 5,
            "http": guarded_protocol(),
            **uvicorn_options,
        }
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
