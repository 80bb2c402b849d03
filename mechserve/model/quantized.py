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

A ``QuantizedMatrix`` may also hold a GGUF file's other formats as the file stores them (F16, Q4_0,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and F32/BF16 kept beside activations of the other dtype), and a
"mixed" matrix of row groups in different formats: their layouts, reference decoder, encoders and
kernel are ``mechserve.model.kquants``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mechserve.model import kquants

QK = 32  # weights per block
# issue 30: every block format a matrix may be kept in (Q4_1 and Q8_0 here; the rest kquants.FORMATS),
# its weights per block and bytes per block.  ``QUANTIZATIONS``: those a float checkpoint is quantized to.
BLOCK_WEIGHTS = {"q4_1": QK, "q8_0": QK, **{k: f.block for k, f in kquants.FORMATS.items()}}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, **{k: f.block_bytes for k, f in kquants.FORMATS.items()}}
QUANTIZATIONS = ("q4_1", "q8_0")


@dataclass(frozen=True, slots=True)
class QuantizedMatrix:
    """An ``[N, K]`` weight matrix as blocks: ``blocks`` is uint8 ``[N, K / 32 * block bytes]``.

    ``kind``: ``"q4_1"`` or ``"q8_0"``, or a GGUF format of ``kquants.KINDS`` (blocks of
    ``BLOCK_WEIGHTS[kind]`` weights), or ``"mixed"``: row groups of different formats stacked as
    ``kquants.stack`` lays them out (``blocks`` uint8 1-D; ``segments``, read from its header, are the
    groups' ``(kind, rows)``).  Raises ``ValueError`` for a shape the format cannot hold.
    """

    kind: str
    blocks: torch.Tensor
    in_features: int
    segments: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind == kquants.MIXED:  # issue 30: a file's q/k/v (or gate/up) in different formats
            if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 1:
                raise ValueError("a mixed matrix needs its bytes as uint8 [total bytes]")
            parts = kquants.unstack(self.blocks, self.in_features)
            segments = tuple((k, int(b.shape[0])) for k, b in parts)
            if kquants.mixed_layout(segments, self.in_features)[1] != self.blocks.numel():
                raise ValueError(f"{self.blocks.numel()} bytes are not the mixed matrix its header describes")
            object.__setattr__(self, "segments", segments)
            return
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"unknown block format {self.kind!r}; known: {', '.join(BLOCK_BYTES)}")
        block = BLOCK_WEIGHTS[self.kind]
        if self.in_features % block or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError(f"a {self.kind} matrix needs uint8 blocks [N, bytes] and in_features % {block} == 0")
        if self.blocks.shape[1] != self.in_features // block * BLOCK_BYTES[self.kind]:
            raise ValueError(f"{self.blocks.shape[1]} bytes per row do not hold {self.in_features} {self.kind} weights")
        if not self.blocks.is_contiguous():
            object.__setattr__(self, "blocks", self.blocks.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        if self.segments:
            return (sum(rows for _, rows in self.segments), self.in_features)
        return (int(self.blocks.shape[0]), self.in_features)

    def numel(self) -> int:
        return self.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: every block once."""
        return int(self.blocks.numel())

    def rows(self, index: torch.Tensor | slice) -> QuantizedMatrix:
        """The matrix of the rows ``index`` selects (a slice, or int64 row ids); not of a mixed matrix."""
        if self.segments:
            raise ValueError("rows of a mixed matrix are taken with kquants.dequantize_rows")
        picked = self.blocks[index] if isinstance(index, slice) else self.blocks.index_select(0, index)
        return QuantizedMatrix(self.kind, picked.contiguous(), self.in_features)

    @staticmethod
    def cat(parts: Sequence[QuantizedMatrix]) -> QuantizedMatrix:
        """Rows of ``parts`` stacked (q, k and v into one qkv matrix); they must share their width.  Parts of
        different formats (as a GGUF file may store q, k and v) make a ``"mixed"`` matrix."""
        kinds = {(p.kind, p.in_features) for p in parts}
        if len({k for _, k in kinds}) != 1:
            raise ValueError(f"cannot stack matrices of different widths: {sorted(kinds)}")
        if len(kinds) == 1 and parts[0].kind != kquants.MIXED:
            return QuantizedMatrix(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].in_features)
        k = parts[0].in_features
        pieces = [
            piece for p in parts for piece in (kquants.unstack(p.blocks, k) if p.segments else [(p.kind, p.blocks)])
        ]
        return QuantizedMatrix(kquants.MIXED, kquants.stack(pieces, k), k)


def dequantize(matrix: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix as ``[N, K]`` floats of ``dtype`` (computed in float32 as gguf-py does: ``d * q + m``)."""
    n, k = matrix.shape
    if matrix.kind in kquants.FORMATS:
        return kquants.dequantize_blocks(matrix.kind, matrix.blocks, k).to(dtype)
    if matrix.segments:
        parts = [dequantize(QuantizedMatrix(kind, b, k), dtype) for kind, b in kquants.unstack(matrix.blocks, k)]
        return torch.cat(parts)
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
    computed from the float32 ``d`` and ``min``, as ggml does.  A GGUF format of ``kquants.KINDS``: its
    encoder (``kquants.quantize_blocks``).  Raises ``ValueError`` otherwise.
    """
    if kind in kquants.FORMATS:
        return QuantizedMatrix(kind, kquants.quantize_blocks(weight, kind), int(weight.shape[-1]))
    if kind not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {kind!r}; known: {', '.join(BLOCK_BYTES)}")
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


__all__ = ["BLOCK_BYTES", "BLOCK_WEIGHTS", "QK", "QUANTIZATIONS", "QuantizedMatrix", "dequantize", "quantize"]
