"""Weight matrices kept in GGUF's block formats, Q4_1 and Q8_0, as the embedded model ships them.

A ``QuantizedMatrix`` is an ``[N, K]`` matrix stored row by row as ``K / 32`` blocks of 32 weights
(ggml's formats, as GGUF files hold them)::

    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles   w[j] = d * q[j] + m, q in 0..15;
                    byte i holds q[i] (low nibble) and q[i + 16] (high nibble)
    Q8_0  34 bytes: fp16 d, 32 int8                       w[j] = d * q[j]

``mechserve.model.linear`` multiplies activations with these blocks directly; this module holds
the data, the reference decoder (``dequantize``, plain torch, what the kernel is tested against)
and the quantizers (ggml's reference rounding, ``quantize_row_q4_1_ref`` / ``quantize_row_q8_0_ref``
in ggml-quants.c).  Loading a quantized model (blocks from the embedded GGUF where it holds them,
else quantized from the float checkpoint) is ``model/formats.py``'s ``QuantizedSafetensors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

QK = 32  # weights per block
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
QUANTIZATIONS = tuple(BLOCK_BYTES)


@dataclass(frozen=True, slots=True)
class QuantizedMatrix:
    """An ``[N, K]`` weight matrix as blocks: ``blocks`` is uint8 ``[N, K / 32 * block bytes]``.

    ``kind``: ``"q4_1"`` or ``"q8_0"``.  Raises ``ValueError`` for a shape the format cannot hold.
    """

    kind: str
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"unknown block format {self.kind!r}; known: {', '.join(QUANTIZATIONS)}")
        if self.in_features % QK or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"a {self.kind} matrix needs uint8 blocks [N, bytes] and in_features % {QK} == 0")
        if self.blocks.shape[1] != self.in_features // QK * BLOCK_BYTES[self.kind]:
            raise ValueError(f"{self.blocks.shape[1]} bytes per row do not hold {self.in_features} {self.kind} weights")
        if not self.blocks.is_contiguous():
            object.__setattr__(self, "blocks", self.blocks.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.in_features)

    def numel(self) -> int:
        return self.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: every block once."""
        return int(self.blocks.numel())

    def rows(self, index: torch.Tensor | slice) -> QuantizedMatrix:
        """The matrix of the rows ``index`` selects (a slice, or int64 row ids)."""
        picked = self.blocks[index] if isinstance(index, slice) else self.blocks.index_select(0, index)
        return QuantizedMatrix(self.kind, picked.contiguous(), self.in_features)

    @staticmethod
    def cat(parts: Sequence[QuantizedMatrix]) -> QuantizedMatrix:
        """Rows of ``parts`` stacked (q, k and v into one qkv matrix); they must share format and width."""
        kinds = {(p.kind, p.in_features) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack matrices of different formats or widths: {sorted(kinds)}")
        return QuantizedMatrix(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].in_features)


def dequantize(matrix: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix as ``[N, K]`` floats of ``dtype`` (computed in float32 as gguf-py does: ``d * q + m``)."""
    n, k = matrix.shape
    raw = matrix.blocks.view(n, k // QK, BLOCK_BYTES[matrix.kind])
    d = raw[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if matrix.kind == "q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16).float()
        qs = raw[..., 4:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # [N, nb, 32]
        values = d * q + m
    else:
        values = d * raw[..., 2:].contiguous().view(torch.int8).float()
    return values.reshape(n, k).to(dtype)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: halves away from zero (``torch.round`` rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedMatrix:
    """``weight`` ([N, K], K % 32 == 0) in blocks of ``kind`` with ggml's reference rounding.

    Q8_0: ``d = max|w| / 127``, ``q = roundf(w / d)``.  Q4_1: ``d = (max - min) / 15``, ``m = min``,
    ``q = min(15, trunc((w - min) / d + 0.5))``.  ``d`` and ``m`` are stored as fp16; ``q`` is
    computed from the float32 ``d`` and ``min``, as ggml does.  Raises ``ValueError`` otherwise.
    """
    if kind not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {kind!r}; known: {', '.join(QUANTIZATIONS)}")
    if weight.dim() != 2 or weight.shape[1] % QK:
        raise ValueError(f"{kind} needs a matrix whose rows are a multiple of {QK} wide, got {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.float().reshape(n, k // QK, QK)
    if kind == "q8_0":
        d = w.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = _round_away(w * inv).to(torch.int8)
        parts = [d.half().view(torch.uint8), q.view(torch.uint8)]
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.clamp(torch.trunc((w - lo) * inv + 0.5), max=15).to(torch.uint8)
        nibbles = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
        parts = [d.half().view(torch.uint8), lo.half().view(torch.uint8), nibbles]
    blocks = torch.cat(parts, dim=-1).reshape(n, -1)
    return QuantizedMatrix(kind, blocks.contiguous(), k)


__all__ = ["BLOCK_BYTES", "QK", "QUANTIZATIONS", "QuantizedMatrix", "dequantize", "quantize"]
