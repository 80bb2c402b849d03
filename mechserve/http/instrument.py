"""Every HTTP request counted by its route, as vLLM's server counts them (``prometheus-fastapi-instrumentator``).

``Instrument`` is an ASGI middleware that feeds ``ServingMetrics.observe_http`` once per request:
the route's path template (``/v1/chat/completions``, ``/v1/responses/{response_id}``; ``none`` for a
path no route matches), the method, the status code and the seconds from arrival until the app
returned (a stream's last byte, or the client gone).  ``/metrics`` and ``/health`` are not counted,
as in vLLM (its scrapers and probes would drown the rest).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mechserve.entrypoints.metrics import ServingMetrics

EXCLUDED = frozenset({"/metrics", "/health"})


class Instrument:
    """ASGI middleware: ``metrics.observe_http(handler, method, status, seconds)`` for each HTTP request."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in EXCLUDED:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an app that raises before it answers is a server error

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.observe_http(handler(scope), scope["method"], status, time.perf_counter() - started)


def handler(scope: Scope) -> str:
    """The path template of the route that serves ``scope`` (``none`` when no route matches)."""
    app: Any = scope.get("app")
    found = "none"
    for route in getattr(app, "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return str(route.path)
        if match is Match.PARTIAL and found == "none":  # the path is served, not with this method
            found = str(route.path)
    return found


__all__ = ["EXCLUDED", "Instrument", "handler"]
