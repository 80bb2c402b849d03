"""The Llama-family forward pass over a flattened batch on paged KV state.

Covers Llama, SmolLM, Mistral, Qwen2 and Qwen3 checkpoints: RMSNorm, SwiGLU
MLP, RoPE (``default``, ``linear``, ``llama3``, ``yarn``), grouped-query
attention, optional q/k/v/o biases, optional per-head q/k RMSNorm (Qwen3),
optional sliding windows, tied or untied LM head.

One call of ``LlamaModel.forward`` is one engine step: every scheduled token
of every request in one ``[T, hidden]`` activation, and logits only for the
rows that sample.  Its shape (``LlamaArch``: which optional parts a family
has) is ``model/arch.py``'s; its tensors come from any loader through the
weight-name map (``model/weights.py``); ``model/registry.py`` lists the
families that run on it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from mechserve.api.errors import ModelLoadError
from mechserve.kv.paged import AttentionBatch, PagedKVCache, paged_attention
from mechserve.model import fused
from mechserve.model.arch import LlamaArch
from mechserve.model.layer import LayerWeights, Matrix, on_huge_pages
from mechserve.model.linear import dequantize_rows, linear
from mechserve.model.quantized import QuantizedMatrix
from mechserve.model.weights import ModelWeights

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ([head_dim // 2] float32) and the cos/sin scaling factor.

    Only position-independent variants are supported; ``dynamic`` and
    ``longrope`` change with the sequence length and raise ``ModelLoadError``, as does a
    malformed ``rope_parameters`` (not a mapping, a ``rope_theta`` that is not a number > 0).
    """
    raw = getattr(config, "rope_parameters", None) or {}
    if not isinstance(raw, dict):
        raise ModelLoadError(f"config: rope_parameters must be an object, got {raw!r}")
    params = dict(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if not isinstance(rope_type, str) or rope_type not in _STATIC_ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(_STATIC_ROPE_TYPES)}")
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not 0 < theta < math.inf:
        raise ModelLoadError(f"config: rope_theta must be a number > 0, got {theta!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings are not supported")
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    except (
        Exception
    ) as exc:  # transformers reads the variant's own fields; a missing or wrong one is the config's fault
        raise ModelLoadError(f"config: rope_parameters of type {rope_type!r} are malformed: {exc}") from None
    return inv.float(), float(scaling)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, computed in float32 as transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: ``x``: [T, heads, D]; ``cos``/``sin``: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_inputs(
    x: torch.Tensor,
    norm: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    h: int,
    kv: int,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to attention: ``x`` [T, hidden] -> rotated ``q`` [T, h, d], ``k`` and ``v`` [T, kv, d]."""
    y = rms_norm(x, norm, eps)
    qkv = linear(y, qkv_w, qkv_b)  # [T, (H + 2 KV) * D]
    q, k, v = torch.split(qkv, [h * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, kv, d), v.view(-1, kv, d)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def attention_outputs(
    x: torch.Tensor,
    attn: torch.Tensor,
    o: torch.Tensor,
    o_b: torch.Tensor | None,
    norm: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_b: torch.Tensor | None,
    down: torch.Tensor,
    down_b: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """A decoder layer after attention: ``x`` [T, hidden] plus the output projection of ``attn``
    [T, H * D], then the SwiGLU MLP's residual; returns the new [T, hidden]."""
    x = x + linear(attn, o, o_b)
    y = rms_norm(x, norm, eps)
    gate, up = linear(y, gate_up, gate_up_b).chunk(2, dim=-1)  # [T, I] each
    return x + linear(F.silu(gate) * up, down, down_b)


@functools.cache
def _compiled_blocks() -> tuple[Any, Any]:
    """``attention_inputs`` and ``attention_outputs`` under ``torch.compile`` with dynamic shapes.

    The weights are arguments, not captured constants, so every layer (and every model) shares one
    graph per block, and a new row count does not recompile (``dynamic=True``; only 1, 2-3 and more
    rows differ, through ``linear``'s padding).  Compiled once per process, on first use.
    """
    return torch.compile(attention_inputs, dynamic=True), torch.compile(attention_outputs, dynamic=True)


class LlamaModel:
    """Weights plus the paged forward (a ``model.protocol.Model``).  ``dtype`` is the activations', norms'
    and KV cache's dtype (the weight matrices may be GGUF blocks: ``quantization``)."""

    _blocks: tuple[Any, Any] = (attention_inputs, attention_outputs)
    native_layers: bool = False  # set per model in __init__ (a rank's shard builds its own)
    device: torch.device = torch.device("cpu")  # a subclass that builds its own tensors (a rank's shard) is on the host

    def __init__(self, config: Any, arch: LlamaArch, weights: ModelWeights, *, quantization: str | None = None) -> None:
        """The model of ``arch`` (read from the transformers ``config``, which also gives RoPE) with
        ``weights`` (``weights.assemble``: the parts, already checked against ``arch``).
        ``quantization``: the block format of the weight matrices (None: floats).  Raises
        ``ModelLoadError`` for a RoPE variant this forward does not implement."""
        self.config = config
        self.arch = arch
        self.embed: Matrix = weights.embed  # [V, hidden]
        self.norm = weights.norm
        self.lm_head: Matrix = weights.lm_head  # [V, hidden], the embedding itself when tied
        self.layers: list[LayerWeights] = weights.layers
        self.dtype = self.norm.dtype  # activations, norms, biases and KV (the matrices may be quantized)
        self.quantization = quantization
        # the matrices every step streams, packed onto huge pages (fewer TLB misses; model/layer.py)
        self.layers, self.embed, self.lm_head = on_huge_pages(self.layers, self.embed, self.lm_head)
        self.inv_freq, self.rope_scaling = rope_inv_freq(config, arch.head_dim)
        self.scale = arch.head_dim**-0.5
        self.distinct_sliding_windows = tuple(dict.fromkeys(arch.sliding_windows))
        self.device = self.norm.device  # the embedding may be quantized blocks
        # Whether every layer's weights suit the native blocks (model/fused.py).
        self.native_layers = all(fused.weights_apply(w, self.dtype) for w in self.layers)

    def to(self, device: torch.device | str) -> LlamaModel:
        """This model with every tensor (weights, norms, biases, RoPE frequencies) on ``device``.

        ``self`` when everything is already there; otherwise a copy whose tensors are copies on
        ``device`` (a tied LM head stays tied).  The caches it makes (``new_cache``) and the
        activations of its forward are on ``device`` too.
        """
        device = torch.device(device)
        if device == self.device:
            return self
        embed, lm_head = self.embed, self.lm_head
        if (
            not isinstance(embed, torch.Tensor)
            or not isinstance(lm_head, torch.Tensor)
            or any(isinstance(w.qkv, QuantizedMatrix) for w in self.layers)
        ):
            raise ValueError(f"a quantized model runs on the CPU only, not on {device}")
        moved = copy.copy(self)
        moved.embed = embed.to(device)
        moved.lm_head = moved.embed if lm_head is embed else lm_head.to(device)
        moved.norm = self.norm.to(device)
        moved.inv_freq = self.inv_freq.to(device)
        moved.layers = [
            LayerWeights(**{f.name: _to(getattr(w, f.name), device) for f in dataclasses.fields(LayerWeights)})  # type: ignore[arg-type]
            for w in self.layers
        ]
        moved.device = device
        return moved

    def truncated(self, num_layers: int) -> LlamaModel:
        """This model cut to its first ``num_layers`` decoder layers (a draft model for it).

        Embeddings, final norm, LM head, RoPE and the kept layers are this
        model's own tensors, shared, not copied.  Raises ``ValueError``
        unless ``1 <= num_layers <= arch.num_layers``.
        """
        if not 1 <= num_layers <= self.arch.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.arch.num_layers}], got {num_layers}")
        draft = copy.copy(self)
        draft.arch = replace(self.arch, num_layers=num_layers, sliding_windows=self.arch.sliding_windows[:num_layers])
        draft.layers = self.layers[:num_layers]
        draft.distinct_sliding_windows = tuple(dict.fromkeys(draft.arch.sliding_windows))
        return draft

    def compiled(self) -> LlamaModel:
        """A copy of this model (sharing its tensors) whose decoder layers run their dense parts (norms,
        projections, RoPE, MLP) through ``torch.compile`` (inductor; compiled on the first forward).

        Attention (``paged_attention``: the pool's writes and reads, the native kernel) stays eager
        between the two compiled blocks.  The greedy tokens are the eager model's (inductor fuses the
        element-wise work but keeps the matrix products in torch's kernels); checked in
        ``tests/model/test_compile.py``.
        """
        twin = copy.copy(self)
        twin._blocks = _compiled_blocks()
        return twin

    def weight_elements(self) -> tuple[int, int]:
        """``(layers, head)``: elements of the decoder layers' four matrices (all layers) and of the LM head."""
        layers = sum(w.qkv.numel() + w.o.numel() + w.gate_up.numel() + w.down.numel() for w in self.layers)
        return layers, self.lm_head.numel()

    def new_cache(self, num_pages: int, page_size: int, dtype: torch.dtype | None = None) -> PagedKVCache:
        """A zeroed paged KV cache shaped for this model, on the model's device."""
        a = self.arch
        return PagedKVCache(
            a.num_layers, num_pages, page_size, a.num_kv_heads, a.head_dim, dtype or self.dtype, device=self.device
        )

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids`` ([T] int64) as [T, hidden] in the model's dtype."""
        if isinstance(self.embed, QuantizedMatrix):
            return dequantize_rows(self.embed, input_ids, self.dtype)
        return self.embed.index_select(0, input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` ([T] int64): each [T, 1, head_dim], model dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        batch: AttentionBatch,
        logit_rows: torch.Tensor | None = None,
        hidden_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One step over a flat batch.

        ``input_ids``/``positions``: [T] int64; ``batch`` carries the slot
        mapping and attention groups; ``logit_rows``: [R] int64 rows whose
        logits are wanted (None = all).  Returns [R, vocab] float32 logits.
        K/V of every row is written to ``cache`` at ``batch.slot_mapping``.
        ``hidden_out``: a list that receives the final hidden states of the
        same R rows ([R, hidden] float32, after the last norm, before the LM
        head: what an EAGLE head is fed).
        """
        a = self.arch
        h, kv, d = a.num_heads, a.num_kv_heads, a.head_dim
        # The step's index tensors are built on the host; this is their one trip to the device
        # (no-ops on a CPU).  The pool never moves: K/V are written and read where they live.
        input_ids, positions, batch = input_ids.to(self.device), positions.to(self.device), batch.to(self.device)
        logit_rows = None if logit_rows is None else logit_rows.to(self.device)
        cos, sin = self.rope(positions)
        x = self.embed_rows(input_ids)  # [T, hidden]
        attn_out = torch.empty(x.shape[0], h * d, dtype=x.dtype, device=x.device)
        before, after = self._blocks
        # Each layer's dense blocks run as two native calls where the kernel takes the rows, unless compiled.
        native = self.native_layers and self._blocks is LlamaModel._blocks and fused.rows_apply(x, self.layers[0])
        for i, w in enumerate(self.layers):
            if native:
                q, k, v = fused.attention_inputs(x, w, cos, sin, a.rms_norm_eps, h, kv, d)
            else:
                q, k, v = before(
                    x, w.input_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, cos, sin, a.rms_norm_eps, h, kv, d
                )
            paged_attention(q, k, v, cache, i, batch, self.scale, a.sliding_windows[i], out=attn_out)
            if i == len(self.layers) - 1 and logit_rows is not None:
                # past the last attention only the rows whose logits are wanted matter (llama.cpp's
                # output-row pruning): a prefill chunk runs its last block for one row, not for all
                x, attn_out, logit_rows = x.index_select(0, logit_rows), attn_out.index_select(0, logit_rows), None
                # (those few rows go to the native block even where the chunk's rows were too many for it)
                native = self.native_layers and self._blocks is LlamaModel._blocks and fused.rows_apply(x, w)
            if native:
                x = fused.attention_outputs(x, attn_out, w, a.rms_norm_eps)
            else:
                x = after(
                    x,
                    attn_out,
                    w.o,
                    w.o_bias,
                    w.post_norm,
                    w.gate_up,
                    w.gate_up_bias,
                    w.down,
                    w.down_bias,
                    a.rms_norm_eps,
                )
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        x = rms_norm(x, self.norm, a.rms_norm_eps)
        if hidden_out is not None:
            hidden_out.append(x.float())
        return linear(x, self.lm_head, out_dtype=torch.float32)  # [R, V]
