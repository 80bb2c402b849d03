"""A ready model from a name: the checkpoint, its forward (``LlamaModel``), tokenizer and EOS ids.

``load_model("smollm2")`` (the embedded model), ``load_model(directory)`` or ``load_model(file.gguf)``
(a GGUF file, ``model/gguf_model.py``: its matrices as it stores them); with ``weights=False``
only the model's shape (what the driver of tensor-parallel ranks needs: each rank reads its own
shard).  This module is the factory above ``checkpoint`` (files), ``llama`` (the forward) and
``sharded`` (the tensor-parallel forward), so none of those imports another's loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mechserve.api.config import device_name, dtype_name
from mechserve.api.errors import ModelLoadError
from mechserve.model.checkpoint import (
    EMBEDDED,
    Checkpoint,
    embedded_gguf,
    eos_token_ids,
    load_checkpoint,
    load_config,
    load_tokenizer,
    resolve_model,
)
from mechserve.model.gguf_file import is_gguf
from mechserve.model.llama import LlamaModel
from mechserve.model.memory import release_freed
from mechserve.model.sharded import ModelShape


@dataclass(slots=True)
class LoadedModel:
    """A ready model: the forward (``LlamaModel``), its tokenizer (None if not asked for) and EOS ids."""

    path: Path
    model: Any
    tokenizer: Any | None
    eos_token_ids: tuple[int, ...]


def load_model(
    model: str = EMBEDDED,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    weights: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Resolve ``model`` (``"smollm2"`` or a directory) and load weights, config and tokenizer.

    With ``weights=False`` the model is only its shape (``tensor_parallel.ModelShape``): what
    the driver of tensor-parallel ranks needs, the ranks reading their own shards.
    ``quantization`` (``"q4_1"``, ``"q8_0"``): the weight matrices in GGUF blocks, activations in
    ``dtype`` (``quantized.load_quantized``); the embedded SmolLM2's Q4_1 blocks come from its own
    GGUF file.  A GGUF file (``model`` a path to one) keeps its matrices in the formats it stores, in
    one process (``quantization`` and ``weights=False`` are refused), with activations in ``dtype``
    (float32 or bfloat16).  Every failure is a ``ModelLoadError`` naming the problem.
    """
    path = resolve_model(model)
    if is_gguf(path):  # issue 30
        loaded = _load_gguf(path, dtype, tokenizer, weights, quantization)
        release_freed()
        return loaded
    if not weights:
        config = load_config(path)
        tok = load_tokenizer(path) if tokenizer else None
        return LoadedModel(path, ModelShape.of(config, dtype), tok, eos_token_ids(path, config, tok))
    if quantization is not None:
        from mechserve.model.quantized import load_quantized

        checkpoint = load_quantized(path, dtype, quantization, gguf=embedded_gguf() if model == EMBEDDED else None)
    else:
        checkpoint = load_checkpoint(path, dtype)
    forward = LlamaModel(checkpoint)
    tok = load_tokenizer(path) if tokenizer else None
    release_freed()  # issue 30: the load's freed buffers out of the resident set
    return LoadedModel(path, forward, tok, eos_token_ids(path, checkpoint.config, tok))


def _load_gguf(path: Path, dtype: torch.dtype, tokenizer: bool, weights: bool, quantization: str | None) -> LoadedModel:
    """A GGUF file's model (``gguf_model``): every check (the file, its architecture, tensor names and
    types, its settings) before the tokenizer and the weights are read."""
    from mechserve.model import gguf_model

    if quantization is not None:
        raise ModelLoadError(
            f"quantization {quantization} applies to Hugging Face directories; a GGUF file's matrices run in the "
            f"formats it stores ({path.name})"
        )
    if not weights:
        raise ModelLoadError(f"a GGUF model runs in one process (world_size 1), not on tensor-parallel ranks: {path}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ModelLoadError(f"a GGUF model runs with dtype float32 or bfloat16, not {dtype_name(dtype)}")
    f = gguf_model.open_model(path)
    config = gguf_model.gguf_config(f)
    tok = gguf_model.gguf_tokenizer(f) if tokenizer else None
    forward = LlamaModel(Checkpoint(path, config, gguf_model.GGUFTensors(f, config, dtype)))  # type: ignore[arg-type]
    gguf_model.apply_rope_freqs(forward, gguf_model.rope_freqs(f))
    return LoadedModel(path, forward, tok, gguf_model.gguf_eos_ids(f))


def tokenizer_of(path: Path) -> Any:
    """The tokenizer of a resolved model path: a GGUF file's (from its metadata) or a directory's."""
    if is_gguf(path):
        from mechserve.model import gguf_model

        return gguf_model.gguf_tokenizer(gguf_model.open_model(path))
    return load_tokenizer(path)


def torch_dtype(dtype: object) -> torch.dtype:
    """The torch dtype of a name of ``mechserve.api.config.DTYPES`` (``"auto"`` is float32) or of a torch
    dtype; raises ``ValueError`` for anything else."""
    found: torch.dtype = getattr(torch, dtype_name(dtype))
    return found


def torch_device(device: object) -> torch.device:
    """The ``torch.device`` of a device name (``"cpu"``, ``"cuda"``, ``"cuda:N"``) that this process can use.

    Raises ``ValueError`` naming the device when its form is wrong (``device_name``) or it is not
    available here: no CUDA (``torch.cuda.is_available()`` is false, e.g. a CPU-only torch build)
    or no GPU ``N``.
    """
    name = device_name(device)
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} is not available: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
        )
    found = torch.device(name)
    count = torch.cuda.device_count()
    if found.index is not None and found.index >= count:
        raise ValueError(f"device {name!r} is not available: this process sees {count} CUDA device(s)")
    return found


__all__ = ["EMBEDDED", "LoadedModel", "load_model", "tokenizer_of", "torch_device", "torch_dtype"]
