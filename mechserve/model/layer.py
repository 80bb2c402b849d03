"""One decoder layer's weights (``LayerWeights``), shared by the forward (``llama.py``), its tensor-parallel
shard (``sharded.py``) and the native blocks (``fused.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mechserve.model.quantized import QuantizedMatrix

Matrix = torch.Tensor | QuantizedMatrix  # a weight matrix: floats of the model's dtype, or quantized blocks


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused into single matrices.

    ``qkv``: [(H + 2 * KV) * D, hidden]; ``o``: [hidden, H * D];
    ``gate_up``: [2 * I, hidden]; ``down``: [hidden, I]; norms: [hidden]
    (``q_norm``/``k_norm``: [D], Qwen3 only).  The four matrices are tensors of the model's dtype,
    or ``QuantizedMatrix`` blocks in a quantized model.
    """

    input_norm: torch.Tensor
    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o: Matrix
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Matrix
    gate_up_bias: torch.Tensor | None
    down: Matrix
    down_bias: torch.Tensor | None


__all__ = ["LayerWeights", "Matrix"]
