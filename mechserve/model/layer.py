"""One decoder layer's weights (``LayerWeights``), shared by the forward (``llama.py``), its tensor-parallel
shard (``sharded.py``) and the native blocks (``fused.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mechserve.model.quantized import QuantizedMatrix
from mechserve.native.memory import Arena

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


def on_huge_pages(
    layers: list[LayerWeights], embed: Matrix, lm_head: Matrix
) -> tuple[list[LayerWeights], Matrix, Matrix]:
    """The layers, embedding and LM head with their matrices copied into one huge-page arena
    (``native.memory``): every decode step streams them, and reads them up to 20% faster there.  A tied
    LM head stays the embedding's object; matrices not on the CPU are left where they are."""

    def data(m: Matrix) -> torch.Tensor:
        return m.blocks if isinstance(m, QuantizedMatrix) else m

    mats = [m for w in layers for m in (w.qkv, w.o, w.gate_up, w.down)] + [embed]
    mats += [] if lm_head is embed else [lm_head]
    if any(data(m).device.type != "cpu" for m in mats):
        return layers, embed, lm_head
    arena = Arena([data(m) for m in mats])

    def place(m: Matrix) -> Matrix:
        if isinstance(m, QuantizedMatrix):
            return QuantizedMatrix(m.kind, arena.place(m.blocks), m.in_features)
        return arena.place(m)

    moved = [
        dataclasses.replace(w, qkv=place(w.qkv), o=place(w.o), gate_up=place(w.gate_up), down=place(w.down))
        for w in layers
    ]
    new_embed = place(embed)
    return moved, new_embed, new_embed if lm_head is embed else place(lm_head)


__all__ = ["LayerWeights", "Matrix", "on_huge_pages"]
