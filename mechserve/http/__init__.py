"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn; the ``serve`` extra).

``build_app(llm)`` is the ASGI app (``mechserve.http.app``);
``Server`` is uvicorn's server that ends in-flight requests when it shuts
down; ``BackgroundServer(app)`` runs it with uvicorn on a loopback port in a
background thread (tests, notebooks); ``mechserve serve`` runs it in the
foreground (``mechserve.cli.serve``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mechserve.http.background import BackgroundServer, Server, bind_socket

if TYPE_CHECKING:
    from mechserve.http.app import build_app

__all__ = ["BackgroundServer", "Server", "bind_socket", "build_app"]


def __getattr__(name: str) -> Any:
    # build_app imports the engine (torch) on first use, so that mechserve router, which needs only
    # the error bodies and the background server, starts without it
    if name == "build_app":
        from mechserve.http.app import build_app

        return build_app
    raise AttributeError(f"module 'mechserve.http' has no attribute {name!r}")
