"""The OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn; the ``serve`` extra).

``build_app(llm)`` is the ASGI app (``mechserve.server.app``);
``BackgroundServer(app)`` runs it with uvicorn on a loopback port in a
background thread (tests, notebooks); ``mechserve serve`` runs it in the
foreground (``mechserve.cli.serve``).
"""

from __future__ import annotations

from mechserve.server.app import build_app
from mechserve.server.background import BackgroundServer, bind_socket

__all__ = ["BackgroundServer", "bind_socket", "build_app"]
