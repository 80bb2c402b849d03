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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from mechserve.api.env import linear_mode
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
# The kinds csrc/kquants.cpp multiplies (f32 and bf16 go to linear.cpp's dense kernels).
NATIVE_KINDS = tuple(k for k, f in FORMATS.items() if f.native >= 16)
QK_K = 256  # weights per K-quant block


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in ``kind``; ``ValueError`` when the row is not whole blocks."""
    f = FORMATS[kind]
    if in_features <= 0 or in_features % f.block:
        raise ValueError(f"a {kind} row needs a multiple of {f.block} weights, got {in_features}")
    return in_features // f.block * f.block_bytes


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
    ql = np.concatenate([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4), (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], axis=-1)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate(
        [ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8).reshape(nb, 2)], axis=-1
    )


# The native kernel -------------------------------------------------------------------------------------------------

KERNEL = Kernel(
    Path(__file__).with_name("csrc") / "kquants.cpp", "mechserve_kquants_abi", 1, std="c++20", extra=("-ffp-contract=off",)
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
    return usable(linear_mode(), library, "native K-quant kernel")


def product_function() -> int:
    """The address of ``mechserve_kquant_product``: linear.cpp's product signature, for its fused blocks."""
    return ctypes.cast(library().mechserve_kquant_product, ctypes.c_void_p).value or 0


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
    if blocks.shape != (out_features, row_bytes(kind, k)):
        raise ValueError(f"{kind} blocks of shape {tuple(blocks.shape)} are not {out_features} rows of {k} weights")
    x = x.contiguous()
    y = torch.empty(m, out_features, dtype=out_dtype)
    library().mechserve_kquant_linear(
        x.data_ptr(),
        _ACTIVATIONS[x.dtype],
        blocks.data_ptr(),
        FORMATS[kind].native,
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
        return dequantize_blocks(kind, blocks.index_select(0, ids), in_features).to(dtype)
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), in_features, dtype=dtype)
    library().mechserve_kquant_dequantize_rows(
        blocks.contiguous().data_ptr(),
        FORMATS[kind].native,
        ids.data_ptr(),
        ids.numel(),
        in_features,
        out.data_ptr(),
        _ACTIVATIONS[dtype],
        torch.get_num_threads(),
    )
    return out


__all__ = [
    "FORMATS",
    "KERNEL",
    "KINDS",
    "NATIVE_KINDS",
    "QK_K",
    "Format",
    "dequantize_blocks",
    "dequantize_rows",
    "enabled",
    "library",
    "native_linear",
    "product_function",
    "quantize_blocks",
    "row_bytes",
]
