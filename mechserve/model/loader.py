"""A ready model from a name: the checkpoint, its family's forward, tokenizer and EOS ids.

``load_model("smollm2")`` (the embedded model), ``load_model(directory)`` or ``load_model(file.gguf)``
(a GGUF file: ``gguf_model`` checks it and reads its config and tokenizer, ``formats.GGUFTensors`` its
weights as it stores them); with ``weights=False``
only the model's shape (what the driver of tensor-parallel ranks needs: each rank reads its own
shard, ``load_shard``).  Loading is three steps, each in the module its name says::

    config.json ─> registry.load_config: the family (by architecture) and the transformers config
    weights     ─> formats: a TensorSource for the file format (safetensors, or quantized blocks)
    model       ─> family.build: the parts through the weight-name map (weights.assemble), the forward

This module is the factory above ``checkpoint`` (files), ``registry`` (families), ``formats``
(file formats) and ``sharded`` (the tensor-parallel forward), so none of those imports another's
loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from mechserve.api.config import device_name, dtype_name
from mechserve.api.errors import ModelLoadError
from mechserve.model.arch import LlamaArch
from mechserve.model.checkpoint import (
    EMBEDDED,
    Checkpoint,
    embedded_gguf,
    eos_token_ids,
    load_tokenizer,
    resolve_model,
)
from mechserve.model.formats import GGUFTensors, QuantizedSafetensors, SafetensorsFiles, gguf_matrices
from mechserve.model.gguf_file import is_gguf
from mechserve.model.llama import rope_inv_freq
from mechserve.model.memory import release_freed
from mechserve.model.protocol import Model, ModelShape
from mechserve.model.registry import find_family, load_config
from mechserve.model.sharded import ShardedLlama
from mechserve.model.weights import missing_gguf_tensors

M = TypeVar("M", bound=ModelShape)


@dataclass(slots=True)
class LoadedModel(Generic[M]):
    """A ready model: its directory, the model (a ``Model``, or only its ``ModelShape`` when loaded
    without weights), its tokenizer (None if not asked for) and EOS ids."""

    path: Path
    model: M
    tokenizer: Any | None
    eos_token_ids: tuple[int, ...]


@overload
def load_model(
    model: str = ...,
    dtype: torch.dtype = ...,
    tokenizer: bool = ...,
    weights: Literal[True] = ...,
    quantization: str | None = ...,
) -> LoadedModel[Model]: ...
@overload
def load_model(
    model: str = ...,
    dtype: torch.dtype = ...,
    tokenizer: bool = ...,
    weights: bool = ...,
    quantization: str | None = ...,
) -> LoadedModel[ModelShape]: ...
def load_model(
    model: str = EMBEDDED,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    weights: bool = True,
    quantization: str | None = None,
) -> LoadedModel[Any]:
    """Resolve ``model`` (``"smollm2"`` or a directory) and load weights, config and tokenizer.

    The family comes from the registry (``registry.find_family``: an architecture it does not know is
    a ``ModelLoadError`` listing the ones it does).  With ``weights=False`` the model is only its shape
    (``family.shape``): what the driver of tensor-parallel ranks needs, the ranks reading their own
    shards.  ``quantization`` (``"q4_1"``, ``"q8_0"``): the weight matrices in GGUF blocks,
    activations in ``dtype`` (``formats.QuantizedSafetensors``); the embedded SmolLM2's Q4_1 blocks
    come from its own GGUF file.  Every failure is a ``ModelLoadError`` naming the problem
    (``ValueError`` for an unknown ``quantization``).  A GGUF file (``model`` a path to one) keeps its
    matrices in the formats it stores, in one process (``quantization`` and ``weights=False`` are
    refused), with activations in ``dtype`` (float32 or bfloat16).
    """
    path = resolve_model(model)
    if is_gguf(path):  # issue 30
        loaded = _load_gguf(path, dtype, tokenizer, weights, quantization)
        release_freed()
        return loaded
    family, config = load_config(path)
    if not weights:
        tok = load_tokenizer(path) if tokenizer else None
        return LoadedModel(path, family.shape(config, dtype), tok, eos_token_ids(path, config, tok))
    with SafetensorsFiles(path, dtype) as files:
        source: SafetensorsFiles | QuantizedSafetensors = files
        if quantization is not None:
            stored = {}
            if model == EMBEDDED:  # its own GGUF holds the blocks: take them as they are
                arch = family.arch(config)
                stored = gguf_matrices(embedded_gguf(), arch.num_heads, arch.num_kv_heads)
            source = QuantizedSafetensors(files, quantization, stored)
        forward = family.build(config, source, quantization)
    tok = load_tokenizer(path) if tokenizer else None
    release_freed()  # issue 30: the load's freed buffers out of the resident set
    return LoadedModel(path, forward, tok, eos_token_ids(path, config, tok))


def _load_gguf(
    path: Path, dtype: torch.dtype, tokenizer: bool, weights: bool, quantization: str | None
) -> LoadedModel[Any]:
    """A GGUF file's model: every check (the file, its architecture, tensor names and types, its settings)
    before the tokenizer and the weights are read, then the registry's family builds it."""
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
    family = gguf_model.family(f)
    source = GGUFTensors(f, config, dtype)
    missing = missing_gguf_tensors(source, family.arch(config))
    if missing:  # before the tokenizer: a vocab-only file took 98 s to refuse (issue 30)
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path} is missing tensor {', '.join(missing[:3])}{more}")
    tok = gguf_model.gguf_tokenizer(f) if tokenizer else None
    forward = family.build(config, source)
    gguf_model.apply_rope_freqs(forward, gguf_model.rope_freqs(f))
    return LoadedModel(path, forward, tok, gguf_model.gguf_eos_ids(f))


def tokenizer_of(path: Path) -> Any:
    """The tokenizer of a resolved model path: a GGUF file's (from its metadata) or a directory's."""
    if is_gguf(path):
        from mechserve.model import gguf_model

        return gguf_model.gguf_tokenizer(gguf_model.open_model(path))
    return load_tokenizer(path)


def load_shard(
    path: str | Path,
    rank: int,
    world_size: int,
    dtype: torch.dtype = torch.float32,
    *,
    arch: LlamaArch | None = None,
    rope: tuple[torch.Tensor, float] | None = None,
) -> ShardedLlama:
    """Rank ``rank`` of ``world_size``'s shard of the checkpoint directory ``path``.

    ``arch`` and ``rope`` are the driver's (``LoadedModel.model`` of ``load_model(weights=False)``);
    without them the config is read here (through the registry).  Raises ``ModelLoadError`` and
    ``ValueError`` for a world size the model cannot split into."""
    config = None
    if arch is None or rope is None:
        family, config = load_config(Path(path))
        arch = family.arch(config)
        rope = rope_inv_freq(config, arch.head_dim)
    return ShardedLlama(path, rank, world_size, dtype, arch=arch, rope=rope, config=config)


def model_from_checkpoint(checkpoint: Checkpoint, quantization: str | None = None) -> Model:
    """The model of a checkpoint held in memory (tensors by Hugging Face name, as they are), its family
    found from the transformers config (``architectures``, else ``model_type``).  Raises ``ModelLoadError``."""
    config = checkpoint.config
    family = find_family(getattr(config, "architectures", None), getattr(config, "model_type", None), checkpoint.path)
    return family.build(config, checkpoint, quantization)


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


__all__ = [
    "EMBEDDED",
    "LoadedModel",
    "load_model",
    "load_shard",
    "model_from_checkpoint",
    "tokenizer_of",
    "torch_device",
    "torch_dtype",
]
