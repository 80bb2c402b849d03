"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn; the ``serve`` extra).

``build_app(llm)`` is the ASGI app (``mechserve.http.app``);
``Server`` is uvicorn's server that ends in-flight requests when it shuts
down (and stops by itself when its engine dies); ``guarded_protocol`` closes connections that do not
send their request in time; ``BackgroundServer(app)`` runs it with uvicorn on a loopback port in a
background thread (tests, notebooks); ``mechserve serve`` runs it in the
foreground (``mechserve.cli.serve``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mechserve.http.background import BackgroundServer, GuardedH11Protocol, Server, bind_socket, guarded_protocol

if TYPE_CHECKING:
    from mechserve.http.app import build_app

__all__ = ["BackgroundServer", "GuardedH11Protocol", "Server", "bind_socket", "build_app", "guarded_protocol"]


def __getattr__(name: str) -> Any:
    # build_app imports the engine (torch) on first use, so that mechserve router, which needs only
    # the error bodies and the background server, starts without it
    if name == "build_app":
        from mechserve.http.app import build_app

        return build_app
    raise AttributeError(f"module 'mechserve.http' has no attribute {name!r}")
