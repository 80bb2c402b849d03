"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn; the ``serve`` extra).

``build_app(llm)`` is the ASGI app (``mechserve.http.app``);
``Server`` is uvicorn's server that ends in-flight requests when it shuts
down; ``BackgroundServer(app)`` runs it with uvicorn on a loopback port in a
background thread (tests, notebooks); ``mechserve serve`` runs it in the
foreground (``mechserve.cli.serve``).
"""

from __future__ import annotations

from mechserve.http.app import build_app
from mechserve.http.background import BackgroundServer, Server, bind_socket

__all__ = ["BackgroundServer", "Server", "bind_socket", "build_app"]
