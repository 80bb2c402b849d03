"""What ``EngineCore`` builds behind the boundary: the executor with its KV cache, or the rank group.

One rank: a ``TorchExecutor`` over the loaded model, its pool allocated here (an allocation that
fails is a ``KVMemoryError`` naming what sized the pool).  ``world_size`` ranks: a ``RankGroup`` of
processes that each load their shard from the checkpoint directory (``mechserve.executor``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, overload

import torch

from mechserve.api.config import EngineConfig, SpeculativeConfig, format_bytes
from mechserve.api.errors import KVMemoryError, first_line, is_allocation_failure
from mechserve.api.proposers import proposer_method
from mechserve.engine.pool import page_bytes
from mechserve.executor.protocol import Executor
from mechserve.executor.sampling import Sampler
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.kv import native
from mechserve.model.protocol import Model, ModelShape


def configure_threads() -> int:
    """Use one intra-op thread per CPU this process may run on (torch may see the host's); returns it."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    if torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)
    return torch.get_num_threads()


@overload
def place_model(model: Model, config: EngineConfig) -> Model: ...
@overload
def place_model(model: ModelShape, config: EngineConfig) -> ModelShape: ...
def place_model(model: ModelShape, config: EngineConfig) -> ModelShape:
    """``model`` on ``config.device`` (``Model.to``) and, with ``config.compile``, its compiled
    twin (``Model.compiled``).  Raises ``ValueError`` naming a device this process cannot use."""
    from mechserve.model.loader import torch_device

    device = torch_device(config.device)
    if not isinstance(model, Model):  # a shape without weights (world_size > 1): the ranks hold them
        return model
    placed = model.to(device)
    return placed.compiled() if config.compile else placed


def load_draft(loaded: Any, speculative: SpeculativeConfig | None) -> Model | None:
    """The model of its own that ``speculative``'s method proposes with (``speculative.draft_model``), loaded
    next to ``loaded``'s model; None for a method without one (the registry's ``needs_model``).  Raises
    ``ValueError``/``ModelLoadError`` for a draft that cannot serve it."""
    if speculative is None or speculative.draft_model is None or not proposer_method(speculative.method).needs_model:
        return None
    from mechserve.model.draft import load_draft_model

    path = getattr(loaded, "path", None)
    if path is None:  # a bare model: its config knows where it came from
        source = getattr(getattr(loaded.model, "config", None), "_name_or_path", None)
        path = Path(source) if source else None
    return load_draft_model(
        speculative.draft_model, loaded.model, target_path=path, target_tokenizer=getattr(loaded, "tokenizer", None)
    )


def new_executor(
    model: Model, num_pages: int, page_size: int, *, sized_by: str = "num_pages", **kwargs: Any
) -> TorchExecutor:
    """A ``TorchExecutor`` with its KV cache allocated (``kwargs`` go to it).

    Raises ``KVMemoryError`` (naming ``sized_by``) if torch cannot allocate the cache.
    """
    try:
        return TorchExecutor(model, num_pages, page_size, **kwargs)
    except (RuntimeError, MemoryError) as exc:
        if not is_allocation_failure(exc):
            raise
        kv_bytes = num_pages * page_bytes(model, page_size)
        raise KVMemoryError(
            f"could not allocate the KV cache of {format_bytes(kv_bytes)} for {num_pages} pages ({first_line(exc)})",
            kv_bytes=kv_bytes,
            num_pages=num_pages,
            sized_by=sized_by,
        ) from exc


def build_executor(
    loaded: Any,
    config: EngineConfig,
    num_pages: int,
    sized_by: str,
    speculative: SpeculativeConfig | None,
    draft: Model | None,
    rank_timeout_s: float | None = None,
) -> Executor:
    """The executor ``config`` asks for: a ``TorchExecutor`` (one rank) or a ``RankGroup``.

    Raises ``ValueError`` for a setup the ranks cannot serve (a split the model cannot take, a model
    not loaded from a directory, one loaded without weights for one rank), ``KVMemoryError``,
    ``RankError`` when a rank cannot start.
    """
    model: ModelShape = loaded.model
    if config.world_size == 1:
        if not isinstance(model, Model):
            raise ValueError("a model loaded without weights (load_model(weights=False)) needs world_size > 1")
        return new_executor(
            model,
            num_pages,
            config.page_size,
            sized_by=sized_by,
            sampler=Sampler(config.seed),
            speculative=speculative,
            draft_model=draft,
        )
    from mechserve.executor.rank import RankSpec
    from mechserve.executor.rank_group import start_group
    from mechserve.model.arch import LlamaArch
    from mechserve.model.sharded import RankShape

    arch = model.arch
    if not isinstance(arch, LlamaArch):  # the ranks run ShardedLlama, the Megatron split of the Llama shape
        raise ValueError(f"world_size > 1 runs Llama-shaped models; this model's shape is a {type(arch).__name__}")
    for rank in range(config.world_size):  # refuse a split the model cannot take before starting anything
        RankShape.of(arch, config.world_size, rank)
    path = getattr(loaded, "path", None)
    if path is None:
        raise ValueError("world_size > 1 needs a model loaded from a directory (the ranks load their shards)")
    inv_freq = getattr(model, "inv_freq", None)  # RoPE, so that a rank need not read the config (LlamaShape)
    spec = RankSpec(
        path=str(path),
        dtype=str(model.dtype).removeprefix("torch."),
        num_pages=num_pages,
        page_size=config.page_size,
        seed=config.seed,
        speculative=speculative,
        threads=max(1, configure_threads() // config.world_size),
        native_attention=native.enabled(),
        arch=arch,
        rope=None if inv_freq is None else (inv_freq, float(getattr(model, "rope_scaling", 1.0))),
    )
    return start_group(spec, config.world_size, timeout_s=rank_timeout_s)


__all__ = ["build_executor", "configure_threads", "load_draft", "new_executor", "place_model"]
