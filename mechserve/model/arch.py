"""The shape of a Llama-shaped model (``LlamaArch``), read from its transformers config with its family's
differences from Llama (``LlamaVariant``).

The family is the registry's (``model/registry.py``): a Llama-shaped family is Llama's decoder layer
(RMSNorm, grouped-query attention with RoPE, SwiGLU MLP) with some optional parts switched on, and
``LlamaVariant`` says which, as the family's transformers module builds its layers::

    family      q/k/v bias        o bias            MLP biases    per-head q/k RMSNorm
    Llama       attention_bias    attention_bias    mlp_bias      no
    Mistral     no                no                no            no
    Qwen2       yes               no                no            no
    Qwen3       attention_bias    attention_bias    no            yes

(``attention_bias``/``mlp_bias``: the config field that decides, absent = no).  The resulting
``LlamaArch`` says which parts the checkpoint must hold; every loader reads exactly those
(``model/weights.py``), so a tensor the family does not have is not read, as transformers ignores it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mechserve.api.errors import ModelLoadError
from mechserve.model.checkpoint import whole_number


@dataclass(frozen=True, slots=True)
class LlamaVariant:
    """A Llama-shaped family's optional parts (module docstring): each bias is a constant, or the name of
    the config field that switches it on; ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3)."""

    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = "mlp_bias"
    qk_norm: bool = False

    def flag(self, config: Any, rule: bool | str) -> bool:
        """``rule`` for ``config``: the constant, or the config field (absent or null: false).  Raises
        ``ModelLoadError`` for a field that is not true or false."""
        if isinstance(rule, bool):
            return rule
        value = getattr(config, rule, None)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise ModelLoadError(f"config: {rule} must be true or false, got {value!r}")
        return value


LLAMA = LlamaVariant()


@dataclass(frozen=True, slots=True)
class LlamaArch:
    """The shape of a Llama-shaped model, read from a transformers config (``from_config``).

    ``sliding_windows`` holds one entry per layer: None for full causal attention or the sliding-window
    length (a decode window is speculation's term, not this).  ``max_position_embeddings``: the model's
    context (None if the config has none).  The four flags say which optional parts every layer has
    (``LlamaVariant``): q/k/v biases, an o_proj bias, gate/up/down biases, per-head q/k norms.
    Implements ``model.protocol.ModelArch``.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    max_position_embeddings: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: Any, variant: LlamaVariant) -> LlamaArch:
        """The shape of ``config`` for a family with ``variant``'s parts.

        Raises ``ModelLoadError`` for a value this forward cannot use (a size that is not a whole
        number >= 1, a non-positive ``rms_norm_eps``, heads that do not split into KV groups, a bias
        field that is not a boolean) or a shape it does not implement."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported activation {act!r} (only SwiGLU with silu)")
        hidden = _positive(config, "hidden_size")
        heads = _positive(config, "num_attention_heads")
        layers = _positive(config, "num_hidden_layers")
        kv_heads = _positive(config, "num_key_value_heads", optional=True) or heads
        if heads % kv_heads:
            raise ModelLoadError(f"{heads} attention heads do not split into {kv_heads} KV head groups")
        head_dim = _positive(config, "head_dim", optional=True)
        if head_dim is None:
            if hidden % heads:
                raise ModelLoadError(f"config: hidden_size {hidden} does not split into {heads} attention heads")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ModelLoadError(f"config: head_dim {head_dim} is odd; rotary embeddings need an even one")
        context = _positive(config, "max_position_embeddings", optional=True)
        eps = getattr(config, "rms_norm_eps", None)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ModelLoadError(f"config: rms_norm_eps must be a number > 0, got {eps!r}")
        tie = getattr(config, "tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ModelLoadError(f"config: tie_word_embeddings must be true or false, got {tie!r}")
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_positive(config, "intermediate_size"),
            vocab_size=_positive(config, "vocab_size"),
            rms_norm_eps=float(eps),
            tie_word_embeddings=tie,
            sliding_windows=_sliding_windows(config, layers),
            max_position_embeddings=context,
            qkv_bias=variant.flag(config, variant.qkv_bias),
            o_bias=variant.flag(config, variant.o_bias),
            mlp_bias=variant.flag(config, variant.mlp_bias),
            qk_norm=variant.qk_norm,
        )


def _positive(config: Any, name: str, *, optional: bool = False) -> Any:
    """``config.<name>`` if it is a whole number >= 1 (or absent/None when ``optional``); else ``ModelLoadError``."""
    value = getattr(config, name, None)
    if value is None and optional:
        return None
    return whole_number(name, value)


def _sliding_windows(config: Any, layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding windows: ``layer_types`` when given (Qwen2/3), else Mistral's global window."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        if not isinstance(types, list | tuple) or len(types) != layers:
            raise ModelLoadError(f"config: layer_types must list one type per layer ({layers}), got {types!r}")
        if "sliding_attention" in types:
            _positive(config, "sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window is not None and getattr(config, "use_sliding_window", True):
        return (_positive(config, "sliding_window"),) * layers
    return (None,) * layers


__all__ = ["LLAMA", "LlamaArch", "LlamaVariant"]
