"""How many KV pages an engine gets, and whether they fit in memory.

The spec's pool is ``num_pages`` pages of ``page_size`` positions; behind the boundary each page is
K and V for every layer (``page_bytes``).  ``size_pool`` picks ``num_pages`` from the config::

    config.num_pages given      that many                                    sized_by "num_pages"
    config.kv_memory given      as many as the budget holds                  sized_by "kv_memory"
    neither                     min(max_kv_bytes, half the available memory,
                                    AUTO_MAX_POSITIONS or one full context)  sized_by "auto"

and ``check_kv_memory`` refuses a cache over the ``kv_memory`` budget or the available memory
(``KVMemoryError``, naming what sized it) before anything is allocated.  "Available memory" is the
host's for ``device="cpu"`` and the GPU's free memory for a CUDA device (``device_memory``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mechserve.api.config import EngineConfig, format_bytes
from mechserve.api.errors import KVMemoryError
from mechserve.api.limits import MAX_PAGES, MAX_SLOTS
from mechserve.spec.m16_request_draft_lengths import pages_for

if TYPE_CHECKING:  # torch stays out of this module's imports
    from mechserve.model.protocol import ModelShape

# A long-lived engine's automatic pool holds at most this many positions (or one full context, if larger):
# on a laptop, llama-server's default context (4096) twice over.  SmolLM2-135M: 180 MiB of bfloat16 KV
# (360 MiB float32); an 8B Llama: 1 GiB of bfloat16 KV (DEFAULT_KV_BYTES caps it there).  issue 30: was
# 16,384, twice what a 135M model's engine held beside its 92 MiB of Q4_1 weights.
AUTO_MAX_POSITIONS = 8_192
MEMINFO = "/proc/meminfo"


def page_bytes(model: ModelShape, page_size: int, dtype: Any | None = None) -> int:
    """Bytes of one KV page of ``model`` (a ``Model`` or its shape): K and V, every layer,
    ``page_size`` positions, in ``dtype`` (default the model's)."""
    a = model.arch
    itemsize = (dtype or model.dtype).itemsize
    return 2 * a.num_layers * page_size * a.num_kv_heads * a.head_dim * itemsize


def available_memory(meminfo: str | None = None) -> int | None:
    """``MemAvailable`` in bytes from ``meminfo`` (default ``MEMINFO``); None where it cannot be read (not Linux)."""
    try:
        with open(meminfo or MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_memory(device: str) -> int | None:
    """Free bytes where the KV cache of ``device`` (an ``EngineConfig.device`` name) will live: the host's
    ``available_memory()`` for ``"cpu"``, else what ``torch.cuda.mem_get_info`` says is free on the GPU."""
    if device == "cpu":
        return available_memory()
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def max_pages(page_size: int) -> int:
    """The most pages a pool of ``page_size`` may have (``MAX_PAGES``, ``MAX_SLOTS`` slots)."""
    return max(1, min(MAX_PAGES, MAX_SLOTS // page_size))


def model_context(model: ModelShape) -> int | None:
    """The model's context in positions, ``arch.max_position_embeddings`` (None if its config has none)."""
    return model.arch.max_position_embeddings


def auto_num_pages(
    prompt_lens: Sequence[int],
    max_new_tokens: int,
    page_size: int,
    model: ModelShape,
    max_kv_bytes: int,
    max_model_len: int | None = None,
) -> int:
    """Pages for every one of a known set of requests to be resident at once, capped at ``max_kv_bytes``.

    A request needs its largest frontier, prompt + ``max_new_tokens`` - 1
    positions (never more than ``max_model_len``; the door refuses longer
    ones).  Never fewer than the longest single request needs, so the pool is
    never irreducible for the workload, and never more than ``max_pages``.
    """
    limit = max_model_len if max_model_len is not None else 1 << 62
    need = [pages_for(max(1, min(n + max(max_new_tokens - 1, 0), limit)), page_size) for n in prompt_lens]
    pages = max(max(need), min(sum(need), max_kv_bytes // page_bytes(model, page_size)))
    return min(pages, max_pages(page_size))


def size_pool(model: ModelShape, config: EngineConfig, max_model_len: int | None = None) -> tuple[int, str]:
    """``(num_pages, sized_by)`` for a pool that serves requests not known in advance.

    ``config.num_pages`` when given; else as many pages as ``config.kv_memory``
    bytes hold; else ``auto``: ``config.max_kv_bytes`` (capped at half the
    available memory) or ``AUTO_MAX_POSITIONS`` positions (at least one
    ``max_model_len`` request), whichever is less.  Never more than
    ``max_pages``.  Raises ``KVMemoryError`` when ``kv_memory`` holds no page.
    """
    c = config
    per_page = page_bytes(model, c.page_size)
    if c.num_pages is not None:
        return c.num_pages, "num_pages"
    if c.kv_memory is not None:
        pages = c.kv_memory // per_page
        if pages < 1:
            raise KVMemoryError(
                f"a KV budget of {format_bytes(c.kv_memory)} holds no page: one page of {c.page_size} "
                f"positions takes {format_bytes(per_page)}",
                kv_bytes=per_page,
                num_pages=1,
                sized_by="kv_memory",
            )
        return min(pages, max_pages(c.page_size)), "kv_memory"
    budget = c.max_kv_bytes
    available = device_memory(c.device) if c.check_memory else None
    if available is not None:
        budget = min(budget, available // 2)
    positions = max(AUTO_MAX_POSITIONS, max_model_len or 0)
    pages = min(max(1, budget // per_page), pages_for(positions, c.page_size))
    return min(pages, max_pages(c.page_size)), "auto"


def check_kv_memory(config: EngineConfig, num_pages: int, kv_bytes: int, sized_by: str) -> None:
    """Raise ``KVMemoryError`` if ``kv_bytes`` exceed ``config.kv_memory`` or (``check_memory``) the available memory."""
    budget, where = config.kv_memory, "the KV budget"
    if config.check_memory:
        available = device_memory(config.device)
        if available is not None and (budget is None or available < budget):
            budget, where = available, "available memory"
    if budget is not None and kv_bytes > budget:
        raise KVMemoryError(
            f"KV cache of {format_bytes(kv_bytes)} for {num_pages} pages does not fit in "
            f"{format_bytes(budget)} of {where}",
            kv_bytes=kv_bytes,
            num_pages=num_pages,
            sized_by=sized_by,
        )


__all__ = [
    "AUTO_MAX_POSITIONS",
    "auto_num_pages",
    "available_memory",
    "check_kv_memory",
    "device_memory",
    "max_pages",
    "model_context",
    "page_bytes",
    "size_pool",
]
