"""mechserve: an LLM serving engine whose scheduler is an executable specification.

``from mechserve import LLM, SamplingParams`` is the offline API (vLLM's
names), ``AsyncLLM`` the async engine behind the server.  The exports are
resolved lazily, on first use, so ``import mechserve`` and ``import
mechserve.spec`` never import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it (imported on first access).
_LAZY = {
    "LLM": "mechserve.entrypoints.llm",
    "AsyncLLM": "mechserve.entrypoints.async_llm",
    "RequestsRejected": "mechserve.entrypoints.llm",
    "EngineCore": "mechserve.engine.core",
    "RequestRejected": "mechserve.engine.core",
    "SamplingParams": "mechserve.api.params",
    "StructuredOutputsParams": "mechserve.api.params",
    "RequestOutput": "mechserve.api.outputs",
    "CompletionOutput": "mechserve.api.outputs",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mechserve' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
