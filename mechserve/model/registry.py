"""The model families mechserve runs, keyed by the architecture a checkpoint's ``config.json`` names.

``find_family`` reads ``architectures`` (Hugging Face's class name, e.g. ``Qwen3ForCausalLM``) and
falls back to ``model_type`` for a config saved without one; anything else is one
``ModelLoadError`` naming it and listing ``FAMILIES``.  ``load_model`` (``model/loader.py``)
asks the registry first, then builds the family's model from any weight format.

Every family here is Llama-shaped: one ``LlamaModel`` forward (and ``ShardedLlama`` for tensor
parallelism), one weight-name map (``model/weights.py``), and a ``LlamaVariant`` saying which
optional parts its layers have (``model/arch.py``).  Adding a Llama-shaped family is one entry of
``FAMILIES``; a family whose decoder differs brings its own model module (a ``model.protocol.Model``)
and a ``ModelFamily`` subclass whose ``arch``/``build``/``shape`` make it.  A loader of files that
name their architecture otherwise (a GGUF file's ``general.architecture``: ``llama``, ``qwen2``,
``qwen3``) finds the same entries by ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mechserve.api.errors import ModelLoadError
from mechserve.model.arch import LLAMA, LlamaArch, LlamaVariant
from mechserve.model.checkpoint import read_config, transformers_config
from mechserve.model.llama import LlamaModel
from mechserve.model.sharded import LlamaShape
from mechserve.model.weights import TensorSource, assemble


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One architecture: its Hugging Face class name (``architecture``) and ``model_type``, and how it
    differs from Llama (``variant``)."""

    architecture: str
    model_type: str
    variant: LlamaVariant = LLAMA

    def arch(self, config: Any) -> LlamaArch:
        """The shape of a transformers ``config`` of this family (``ModelLoadError`` for one it cannot run)."""
        return LlamaArch.from_config(config, self.variant)

    def build(self, config: Any, source: TensorSource, quantization: str | None = None) -> LlamaModel:
        """The model of ``config`` with its weights from ``source`` (any file format); ``quantization``: the
        block format ``source`` gives the matrices in.  Raises ``ModelLoadError``."""
        arch = self.arch(config)
        return LlamaModel(config, arch, assemble(source, arch), quantization=quantization)

    def shape(self, config: Any, dtype: torch.dtype) -> LlamaShape:
        """The model of ``config`` without weights (what a driver of tensor-parallel ranks holds)."""
        return LlamaShape.of(config, self.arch(config), dtype)


FAMILIES: dict[str, ModelFamily] = {
    f.architecture: f
    for f in (
        ModelFamily("LlamaForCausalLM", "llama"),  # Llama 1-3, SmolLM, TinyLlama, ...
        ModelFamily("MistralForCausalLM", "mistral", LlamaVariant(qkv_bias=False, o_bias=False, mlp_bias=False)),
        ModelFamily("Qwen2ForCausalLM", "qwen2", LlamaVariant(qkv_bias=True, o_bias=False, mlp_bias=False)),
        ModelFamily("Qwen3ForCausalLM", "qwen3", LlamaVariant(mlp_bias=False, qk_norm=True)),
    )
}
MODEL_TYPES = tuple(dict.fromkeys(f.model_type for f in FAMILIES.values()))


def supported() -> str:
    """The registry as one line: ``LlamaForCausalLM (llama), ...``."""
    return ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES.values())


def find_family(architectures: object, model_type: object, where: object) -> ModelFamily:
    """The family of a config naming ``architectures`` (a list of class names, or None) and ``model_type``.

    The first listed architecture the registry knows decides; a config that lists none (saved
    without a model class) is found by ``model_type``.  The ``model_type`` must be one of the
    registry's (transformers builds the config from it).  Raises ``ModelLoadError`` naming what
    ``where``'s config says and listing the supported architectures.
    """
    if architectures is not None and (
        not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures)
    ):
        raise ModelLoadError(f"config: architectures must be a list of class names, got {architectures!r}")
    names: list[str] = architectures or []
    family = next((FAMILIES[a] for a in names if a in FAMILIES), None)
    if names and family is None:
        raise ModelLoadError(
            f"unsupported architecture {', '.join(names)} (model_type {model_type!r}) in {where}; supported: {supported()}"
        )
    if model_type not in MODEL_TYPES:
        said = f"for architecture {family.architecture}" if family else "(config.json names no architecture)"
        raise ModelLoadError(f"unsupported model_type {model_type!r} {said} in {where}; supported: {supported()}")
    return family or next(f for f in FAMILIES.values() if f.model_type == model_type)


def load_config(path: Path) -> tuple[ModelFamily, Any]:
    """The family of the checkpoint directory ``path`` and its transformers config.

    Raises ``ModelLoadError`` for a ``config.json`` that is not a JSON object, names an architecture
    the registry does not know, or that transformers cannot build a config from."""
    raw = read_config(path)
    family = find_family(raw.get("architectures"), raw.get("model_type"), path)
    return family, transformers_config(path, raw)


__all__ = ["FAMILIES", "MODEL_TYPES", "ModelFamily", "find_family", "load_config", "supported"]
