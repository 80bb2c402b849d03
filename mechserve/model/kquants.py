"""GGUF's other weight formats, kept as a file stores them: F16, Q4_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K.

A ``QuantizedMatrix`` (``model/quantized.py``) of one of these kinds holds each row's blocks as the
GGUF file does (ggml's layouts, described in ``csrc/kquants.cpp``)::

    kind   weights per block   bytes   ggml type        what llama.cpp's presets use it for
    f16    1                   2       F16 (1)          unquantized files, fallbacks
    q4_0   32                  18      Q4_0 (2)         Q4_0 files
    q5_0   32                  22      Q5_0 (6)         Q4_K_M's fallback for rows not a multiple of 256
    q5_1   32                  24      Q5_1 (7)         Q5_K_M's fallback for the same rows
    q4_k   256                 144     Q4_K (12)        Q4_K_S/M's matrices
    q5_k   256                 176     Q5_K (13)        Q5_K_S/M's matrices
    q6_k   256                 210     Q6_K (14)        Q6_K files, Q4/5_K_M's output and half their ffn_down/attn_v
    f32    1                   4       F32 (0)          a float32 matrix kept beside bfloat16 activations
    bf16   1                   2       BF16 (30)        a bfloat16 matrix kept beside float32 activations

This module holds what those kinds need besides the forward: their sizes (``FORMATS``), the reference
decoder (``dequantize_blocks``: gguf-py's ``gguf.quants``, the decoder llama.cpp's own Python tools use),
the encoders (``quantize_blocks``: gguf-py's for Q4_0/Q5_0/Q5_1, ggml's reference construction for the
K-quants, which gguf-py does not have) and the native kernel (``csrc/kquants.cpp``): few-row products on
the blocks (``native_linear``) and rows dequantized exactly as the reference does (``dequantize_rows``).
``f32`` and ``bf16`` matrices are multiplied by ``linear.cpp``'s dense kernels (its types 0 and 1).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from mechserve.api.env import LINEAR_ENV, linear_mode
from mechserve.native.build import Kernel, usable


@dataclass(frozen=True, slots=True)
class Format:
    """One weight format: its ``kind`` name, ggml type number (``gguf.GGMLQuantizationType``), weights per
    block, bytes per block and the type number the native kernels know it by."""

    kind: str
    ggml_type: int
    block: int
    block_bytes: int
    native: int


FORMATS: dict[str, Format] = {
    f.kind: f
    for f in (
        Format("f32", 0, 1, 4, 0),
        Format("bf16", 30, 1, 2, 1),
        Format("f16", 1, 1, 2, 16),
        Format("q4_0", 2, 32, 18, 17),
        Format("q5_0", 6, 32, 22, 18),
        Format("q5_1", 7, 32, 24, 19),
        Format("q4_k", 12, 256, 144, 20),
        Format("q5_k", 13, 256, 176, 21),
        Format("q6_k", 14, 256, 210, 22),
    )
}
KINDS = tuple(FORMATS)
MIXED = "mixed"  # a matrix whose row groups differ in format (stack)
# Every format's number in the native kernels (linear.cpp's for f32, bf16, q4_1, q8_0), MIXED's too.
NATIVE_TYPES = {"q4_1": 2, "q8_0": 3, **{k: f.native for k, f in FORMATS.items()}, MIXED: 63}
_BLOCKS = {"q4_1": (32, 20), "q8_0": (32, 34), **{k: (f.block, f.block_bytes) for k, f in FORMATS.items()}}
# The kinds csrc/kquants.cpp multiplies (f32, bf16, q4_1 and q8_0 matrices go to linear.cpp's kernels).
NATIVE_KINDS = (*(k for k, f in FORMATS.items() if f.native >= 16), MIXED)
QK_K = 256  # weights per K-quant block
MIXED_MAGIC = 0x4D49584544  # "MIXED", the first int64 of a mixed matrix's bytes
ALIGN = 64


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in ``kind`` (any block format, q4_1 and q8_0 included);
    ``ValueError`` when the row is not whole blocks."""
    block, nbytes = _BLOCKS[kind]
    if in_features <= 0 or in_features % block:
        raise ValueError(f"a {kind} row needs a multiple of {block} weights, got {in_features}")
    return in_features // block * nbytes


# Mixed matrices ---------------------------------------------------------------------------------------------------
#
# A llama.cpp Q4_K_M file stores a layer's attn_v in Q6_K beside Q4_K attn_q/attn_k (and, for rows not a
# multiple of 256, Q5_0 beside Q8_0), while the forward multiplies q, k and v as one fused matrix.  Such a
# matrix keeps each part as stored, one after the other, behind a header the kernels read:
#
#   int64 [MIXED_MAGIC, count, (type, rows, byte offset) x count], padded to ALIGN bytes, then each part's
#   rows of blocks at its offset (each a multiple of ALIGN from the first byte)


def mixed_layout(segments: Sequence[tuple[str, int]], in_features: int) -> tuple[list[int], int]:
    """Byte offsets of each ``(kind, rows)`` segment's data and the total bytes of a mixed matrix."""
    at = -(-8 * (2 + 3 * len(segments)) // ALIGN) * ALIGN
    offsets = []
    for kind, rows in segments:
        offsets.append(at)
        at += -(-rows * row_bytes(kind, in_features) // ALIGN) * ALIGN
    return offsets, at


def stack(parts: Sequence[tuple[str, torch.Tensor]], in_features: int) -> torch.Tensor:
    """The bytes (uint8, 1-D) of a mixed matrix of ``parts``: ``(kind, blocks [rows, row bytes])`` in row order."""
    segments = [(kind, int(b.shape[0])) for kind, b in parts]
    offsets, total = mixed_layout(segments, in_features)
    out = torch.zeros(total, dtype=torch.uint8)
    header = [MIXED_MAGIC, len(parts)]
    for (kind, rows), at in zip(segments, offsets, strict=True):
        header += [NATIVE_TYPES[kind], rows, at]
    out[: 8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    for (_, b), at in zip(parts, offsets, strict=True):
        out[at : at + b.numel()] = b.reshape(-1)
    return out


def unstack(blocks: torch.Tensor, in_features: int) -> list[tuple[str, torch.Tensor]]:
    """The ``(kind, blocks [rows, row bytes])`` parts of a mixed matrix's bytes (views, not copies).

    Raises ``ValueError`` for bytes that do not start with a mixed matrix's header."""
    names = {v: k for k, v in NATIVE_TYPES.items()}
    head = blocks[:16].contiguous().view(torch.int64).tolist()
    if len(head) != 2 or head[0] != MIXED_MAGIC:
        raise ValueError("not a mixed matrix: its bytes do not start with the MIXED header")
    entries = blocks[16 : 16 + 24 * head[1]].contiguous().view(torch.int64).view(-1, 3).tolist()
    parts = []
    for type_id, rows, at in entries:
        kind = names[type_id]
        n = row_bytes(kind, in_features)
        parts.append((kind, blocks[at : at + rows * n].view(rows, n)))
    return parts


# Reference decoder and encoders ------------------------------------------------------------------------------------


def dequantize_blocks(kind: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows of blocks (uint8 ``[N, row_bytes]``) as float32 ``[N, in_features]``, by gguf-py's reference
    decoder (``gguf.quants.dequantize``).  Raises ``ValueError`` for a shape that is not whole rows."""
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(kind, in_features):
        raise ValueError(f"{kind} blocks must be uint8 [N, {row_bytes(kind, in_features)}], got {tuple(blocks.shape)}")
    raw = blocks.contiguous()
    if kind == "f32":
        return raw.view(torch.float32).clone()
    if kind == "bf16":
        return raw.view(torch.bfloat16).float()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.numpy(), GGMLQuantizationType(FORMATS[kind].ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, in_features)


def quantize_blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` (float ``[N, K]``, ``K`` a multiple of the kind's block) as uint8 ``[N, row_bytes]`` blocks.

    Q4_0, Q5_0, Q5_1: gguf-py's quantizers (ggml's reference rounding).  Q4_K, Q5_K: per 32-weight
    sub-block a scale ``(max - min) / levels`` and a min clamped to <= 0 (ggml's ``make_qkx2_quants``
    without its search), the eight scales and mins quantized to six bits against the block's fp16
    ``d``/``dmin`` as ``quantize_row_q4_K_ref`` does.  Q6_K: per 16 weights the signed scale
    ``max / -32`` (``make_qx_quants`` without its search), scales as int8 against the block's ``d``
    (``quantize_row_q6_K_ref``).  f16/bf16/f32: the values rounded to that type.  Raises ``ValueError``
    for an unknown kind or a shape it cannot hold.
    """
    if kind not in FORMATS:
        raise ValueError(f"unknown weight format {kind!r}; known: {', '.join(KINDS)}")
    if weight.dim() != 2:
        raise ValueError(f"{kind} quantizes a matrix, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    row_bytes(kind, k)
    w = weight.detach().float().contiguous()
    if kind in ("f32", "bf16", "f16"):
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[kind]
        return w.to(dtype).contiguous().view(torch.uint8).reshape(n, -1).clone()
    x = w.numpy().reshape(-1, FORMATS[kind].block)
    if kind in ("q4_0", "q5_0", "q5_1"):
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        out = quantize(x, GGMLQuantizationType(FORMATS[kind].ggml_type))
    elif kind == "q6_k":
        out = _quantize_q6_k(x)
    else:
        out = _quantize_q45_k(x, 31 if kind == "q5_k" else 15)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.uint8)).reshape(n, -1)


def _nearest(x: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` (its float trick rounds halves to even, as ``np.rint``), as int32."""
    return np.rint(x).astype(np.int32)


def _quantize_q45_k(x: np.ndarray, levels: int) -> np.ndarray:
    """Q4_K (``levels`` 15) or Q5_K (31) blocks of ``x`` [nb, 256]."""
    nb = x.shape[0]
    sub = x.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    hi = sub.max(-1)
    scale = (hi - lo) / levels  # [nb, 8] >= 0
    mins = -lo  # >= 0
    max_scale, max_min = scale.max(-1, keepdims=True), mins.max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_scale = np.where(max_scale > 0, 63.0 / max_scale, 0.0)
        inv_min = np.where(max_min > 0, 63.0 / max_min, 0.0)
    ls = np.clip(_nearest(inv_scale * scale), 0, 63).astype(np.uint8)
    lm = np.clip(_nearest(inv_min * mins), 0, 63).astype(np.uint8)
    d = (max_scale / 63.0).astype(np.float16)  # [nb, 1]
    dmin = (max_min / 63.0).astype(np.float16)
    ds = d.astype(np.float32) * ls.astype(np.float32)  # [nb, 8] the scales as the decoder sees them
    dm = dmin.astype(np.float32) * lm.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(ds[..., None] > 0, (sub + dm[..., None]) / ds[..., None], 0.0)
    q = np.clip(_nearest(q), 0, levels).astype(np.uint8)  # [nb, 8, 32]
    scales = np.zeros((nb, 12), dtype=np.uint8)
    scales[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    low = q & 0x0F
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(nb, 128)  # sub-block 2c low nibbles, 2c + 1 high
    parts = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), scales]
    if levels == 31:
        high = (q >> 4) & 1  # [nb, 8, 32]: bit j of qh[l] is sub-block j's
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for j in range(8):
            qh |= high[:, j, :] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``x`` [nb, 256]."""
    nb = x.shape[0]
    groups = x.reshape(nb, 16, 16)
    where = np.abs(groups).argmax(-1)[..., None]
    signed_max = np.take_along_axis(groups, where, -1)[..., 0]  # [nb, 16]
    scale = signed_max / -32.0
    which = np.abs(scale).argmax(-1)[..., None]
    max_scale = np.take_along_axis(scale, which, -1)  # [nb, 1], signed
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(max_scale != 0, -128.0 / max_scale, 0.0)
        d = np.where(max_scale != 0, 1.0 / iscale, 0.0).astype(np.float16)
    sc = np.minimum(127, _nearest(iscale * scale)).astype(np.int8)  # [nb, 16]
    dg = d.astype(np.float32) * sc.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dg[..., None] != 0, groups / dg[..., None], 0.0)
    q = (np.clip(_nearest(q), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [block, half, quarter, l]
    ql = np.concatenate(
        [(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4), (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=-1
    )
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate(
        [ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8).reshape(nb, 2)], axis=-1
    )


# The native kernel -------------------------------------------------------------------------------------------------

KERNEL = Kernel(
    Path(__file__).with_name("csrc") / "kquants.cpp",
    "mechserve_kquants_abi",
    1,
    std="c++20",
    extra=("-ffp-contract=off",),
)
_ACTIVATIONS = {torch.float32: 0, torch.bfloat16: 1}


@cache
def library() -> ctypes.CDLL:
    """The built kernel library with its functions' argument types set (built on the first call).

    Raises ``NativeKernelError`` when it cannot be built or loaded.
    """
    KERNEL.forget()
    lib = KERNEL.load()
    signatures = {  # p pointer, i int, l int64
        "mechserve_kquant_accepts": ("il", ctypes.c_int),
        "mechserve_kquant_product": ("pplliplpi", None),
        "mechserve_kquant_columns": ("ppllpillpl", None),
        "mechserve_kquant_linear": ("pipippillli", None),
        "mechserve_kquant_dequantize_rows": ("pipllpii", None),
    }
    kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_int64}
    for name, (letters, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [kinds[c] for c in letters], result
    return lib


@cache
def enabled() -> bool:
    """Whether the K-quant kernel is used (``MECHSERVE_LINEAR``, as the linear kernel; built on the first call)."""
    return usable(linear_mode(), library, "native K-quant kernel", variable=LINEAR_ENV)


def product_function() -> int:
    """The address of ``mechserve_kquant_columns``: the product of a share of the output columns on the
    calling thread, which linear.cpp's products and fused blocks call from each thread of their team."""
    return ctypes.cast(library().mechserve_kquant_columns, ctypes.c_void_p).value or 0


def native_linear(
    x: torch.Tensor,
    kind: str,
    blocks: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``W`` [out_features, K] stored as ``blocks`` of ``kind`` (one of ``NATIVE_KINDS``):
    ``x`` [M, K] float32 or bfloat16, ``bias`` [N] in x's dtype; returns [M, N] in ``out_dtype`` (default x's),
    accumulated in float32.  Runs on ``torch.get_num_threads()`` threads.  Raises ``ValueError`` for a
    dtype, kind or shape it does not take."""
    out_dtype = out_dtype or x.dtype
    if x.dtype not in _ACTIVATIONS or out_dtype not in _ACTIVATIONS:
        raise ValueError(f"the K-quant kernel takes float32 or bfloat16 activations, got {x.dtype} -> {out_dtype}")
    if kind not in NATIVE_KINDS:
        raise ValueError(f"the K-quant kernel multiplies {', '.join(NATIVE_KINDS)}, not {kind!r}")
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError("bias must be contiguous in the activations' dtype")
    m, k = x.shape
    if kind != MIXED and blocks.shape != (out_features, row_bytes(kind, k)):
        raise ValueError(f"{kind} blocks of shape {tuple(blocks.shape)} are not {out_features} rows of {k} weights")
    if kind == MIXED and sum(b.shape[0] for _, b in unstack(blocks, k)) != out_features:
        raise ValueError(f"a mixed matrix of {tuple(blocks.shape)} bytes does not have {out_features} rows")
    x = x.contiguous()
    y = torch.empty(m, out_features, dtype=out_dtype)
    library().mechserve_kquant_linear(
        x.data_ptr(),
        _ACTIVATIONS[x.dtype],
        blocks.data_ptr(),
        NATIVE_TYPES[kind],
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        _ACTIVATIONS[out_dtype],
        m,
        out_features,
        k,
        torch.get_num_threads(),
    )
    return y


def dequantize_rows(
    kind: str, blocks: torch.Tensor, in_features: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``ids`` ([R] int64) of the matrix stored as ``blocks`` (uint8 [N, row bytes] of ``kind``) as [R, K]
    ``dtype`` (float32 or bfloat16), equal to ``dequantize_blocks`` of those rows: the kernel when enabled
    (f32 and bf16 rows are cast by torch), else the reference decoder."""
    ids = ids.to(torch.int64)
    if kind in ("f32", "bf16"):
        source = torch.float32 if kind == "f32" else torch.bfloat16
        return blocks.view(source).index_select(0, ids).to(dtype)
    if dtype not in _ACTIVATIONS or not enabled():
        return _reference_rows(kind, blocks, in_features, ids).to(dtype)
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=dtype)
    library().mechserve_kquant_dequantize_rows(
        blocks.contiguous().data_ptr(),
        NATIVE_TYPES[kind],
        ids.data_ptr(),
        ids.numel(),
        in_features,
        out.data_ptr(),
        _ACTIVATIONS[dtype],
        torch.get_num_threads(),
    )
    return out


def _reference_rows(kind: str, blocks: torch.Tensor, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` by the reference decoders (a mixed matrix: each row by its part's)."""
    if kind != MIXED:
        return dequantize_any(kind, blocks.index_select(0, ids), in_features)
    out = torch.empty(ids.numel(), in_features)
    start = 0
    for part_kind, part in unstack(blocks, in_features):
        inside = (ids >= start) & (ids < start + part.shape[0])
        if bool(inside.any()):
            out[inside] = dequantize_any(part_kind, part.index_select(0, ids[inside] - start), in_features)
        start += part.shape[0]
    return out


def dequantize_any(kind: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """``dequantize_blocks`` for every block kind, q4_1 and q8_0 (``quantized.dequantize``'s) included."""
    if kind in FORMATS:
        return dequantize_blocks(kind, blocks, in_features)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(blocks.contiguous().numpy(), GGMLQuantizationType[kind.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(blocks.shape[0], in_features)


__all__ = [
    "FORMATS",
    "KERNEL",
    "KINDS",
    "MIXED",
    "NATIVE_KINDS",
    "NATIVE_TYPES",
    "QK_K",
    "Format",
    "dequantize_any",
    "dequantize_blocks",
    "dequantize_rows",
    "enabled",
    "library",
    "mixed_layout",
    "native_linear",
    "product_function",
    "quantize_blocks",
    "row_bytes",
    "stack",
    "unstack",
]
