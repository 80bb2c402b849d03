"""Building an engine: every construction-time check, in the order they run, before ``EngineCore`` exists.

``EngineCore(loaded, config)`` calls ``assemble`` and keeps what it returns; ``EngineCore.open`` loads
the model first (``load``)::

    kernels        MECHSERVE_ATTENTION / MECHSERVE_LINEAR settled now (a bad value or a kernel that
                   cannot be built fails at load time, not at the first step)
    placement      the model on config.device (compiled with config.compile): the one place it is moved
    the model      loaded in config.dtype and config.quantization; max_model_len within its context
    speculation    the method's facts from the registry (mechserve.api.proposers): refused on ranks if
                   it cannot run there; its own model loaded and placed next to the target
    the pool       num_pages sized (mechserve.engine.pool), the KV bytes (the method's own KV included)
                   checked against the budget and the available memory
    the executor   the one given, or a TorchExecutor (one rank) / RankGroup (mechserve.engine.executors)
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from mechserve.api.config import EngineConfig, SpeculativeConfig, dtype_name
from mechserve.api.proposers import proposer_method
from mechserve.engine.executors import build_executor, configure_threads, load_draft, place_model
from mechserve.engine.pool import check_kv_memory, model_context, page_bytes, size_pool
from mechserve.executor.protocol import Executor
from mechserve.kv import native
from mechserve.model import linear as linear_kernel


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What one engine runs on, checked: the ``loaded`` model (placed), its ``max_model_len``, the
    ``speculative`` config (None: off), the pool (``num_pages``, what ``sized_by`` it, its ``kv_bytes``)
    and the ``executor`` behind the boundary."""

    loaded: Any
    max_model_len: int | None
    speculative: SpeculativeConfig | None
    num_pages: int
    sized_by: str
    kv_bytes: int
    executor: Executor


def load(model: Any, config: EngineConfig) -> Any:
    """``model`` (``"smollm2"``, a local Hugging Face directory, or an already loaded ``LoadedModel``) loaded
    in ``config.dtype`` and ``config.quantization``; with ``world_size > 1`` without weights (the rank
    processes load their shards).  Raises ``ModelLoadError``."""
    from mechserve.model.loader import LoadedModel, load_model, torch_dtype

    configure_threads()
    if isinstance(model, LoadedModel):
        return model
    return load_model(
        os.fspath(model),
        dtype=torch_dtype(config.dtype),
        weights=config.world_size == 1,
        quantization=config.quantization,
    )


def assemble(
    loaded: Any, config: EngineConfig, executor: Executor | None = None, rank_timeout_s: float | None = None
) -> EngineParts:
    """The checked parts of an engine for ``loaded`` under ``config`` (module docstring).

    Raises ``ValueError`` for a ``config.dtype`` or ``config.quantization`` other than the model's, a
    ``max_model_len`` past the model's context, a speculative method that cannot run with this
    ``world_size`` or a draft model that cannot serve this model; ``KVMemoryError`` when the cache
    exceeds ``kv_memory`` or the available memory or cannot be allocated; ``NativeKernelError`` when
    ``MECHSERVE_ATTENTION=native`` and the kernel cannot be built; ``RankError`` when a rank cannot start.
    """
    native.enabled()
    linear_kernel.enabled()
    if executor is None:  # weights and KV pool on config.device, the one place a model is moved
        placed = place_model(loaded.model, config)
        if placed is not loaded.model:
            loaded = copy.copy(loaded)
            loaded.model = placed
    model = loaded.model
    _check_model(model, config)
    max_model_len = _max_model_len(model, config)
    speculative = config.speculative_config()
    method = None if speculative is None else proposer_method(speculative.method)
    if method is not None and config.world_size > 1 and not method.ranks:
        raise ValueError(
            f"speculative method {method.name!r} ({method.summary}) does not run with world_size > 1; "
            "use prompt lookup or one rank"
        )
    draft = None if executor is not None else load_draft(loaded, speculative)
    if draft is not None:
        draft = place_model(draft, config)
    num_pages, sized_by = size_pool(model, config, max_model_len)
    per_page = page_bytes(model, config.page_size) + (
        0 if method is None else method.page_cost(draft, config.page_size)
    )
    kv_bytes = num_pages * per_page
    check_kv_memory(config, num_pages, kv_bytes, sized_by)
    executor = executor or build_executor(loaded, config, num_pages, sized_by, speculative, draft, rank_timeout_s)
    return EngineParts(loaded, max_model_len, speculative, num_pages, sized_by, kv_bytes, executor)


def _check_model(model: Any, config: EngineConfig) -> None:
    """Raise ``ValueError`` unless ``model`` was loaded in ``config.dtype`` and ``config.quantization``."""
    loaded_as = dtype_name(getattr(model, "dtype", config.dtype))
    if loaded_as != config.dtype:
        raise ValueError(
            f"the model was loaded in {loaded_as} but the config asks for dtype {config.dtype!r}: "
            f"give dtype={loaded_as!r}, or load the model in {config.dtype}"
        )
    loaded_q = getattr(model, "quantization", None)
    if loaded_q != config.quantization:
        raise ValueError(
            f"the model was loaded with quantization {loaded_q} but the config asks for {config.quantization}: "
            "load it with the config's quantization (EngineCore.open does)"
        )


def _max_model_len(model: Any, config: EngineConfig) -> int | None:
    """``config.max_model_len``, else the model's context; ``ValueError`` for one past the model's context."""
    context = model_context(model)
    if config.max_model_len and context is not None and config.max_model_len > context:
        # as vLLM: positions past the model's RoPE range were never trained and its cos/sin tables end there
        raise ValueError(
            f"max_model_len {config.max_model_len} is more than the model's context of {context} positions "
            "(max_position_embeddings in its config.json)"
        )
    return config.max_model_len or context


__all__ = ["EngineParts", "assemble", "load"]
