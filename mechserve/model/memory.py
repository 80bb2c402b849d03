"""What a loaded model holds in memory: its weights' bytes, each tensor once, by storage format.

``model_bytes(model)`` is what ``serve`` reports at start beside the KV pool's bytes, and what the
memory figures of docs/benchmarks.md compare with a process's resident set.  A weight shared by two
names (a tied LM head is the embedding) counts once; a ``QuantizedMatrix`` counts its blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from mechserve.model.quantized import QuantizedMatrix


def _weights(model: Any) -> Iterator[torch.Tensor | QuantizedMatrix]:
    for name in ("embed", "norm", "lm_head", "inv_freq"):
        value = getattr(model, name, None)
        if value is not None:
            yield value
    for layer in getattr(model, "layers", ()):
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if value is not None:
                yield value


def formats(model: Any) -> dict[str, int]:
    """Bytes of ``model``'s weights by format (``"float32"``, ``"bfloat16"``, ``"q4_k"``, ``"mixed"``, ...),
    each tensor counted once."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for w in _weights(model):
        data = w.blocks if isinstance(w, QuantizedMatrix) else w
        key = (data.data_ptr(), data.numel())  # a tied head is the embedding's storage
        if key in seen:
            continue
        seen.add(key)
        kind = w.kind if isinstance(w, QuantizedMatrix) else str(w.dtype).removeprefix("torch.")
        out[kind] = out.get(kind, 0) + data.numel() * data.element_size()
    return out


def release_freed() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing elsewhere).

    Loading reads each tensor into a buffer of its own and fuses q/k/v and gate/up into new ones; the
    freed parts stay in the heap, counted in the process's resident set, until trimmed (70 MiB of the
    embedded model's Q4_1 load, docs/benchmarks.md "Memory")."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)


def model_bytes(model: Any) -> int:
    """Bytes of every weight ``model`` holds (``formats`` summed)."""
    return sum(formats(model).values())


__all__ = ["formats", "model_bytes", "release_freed"]
