"""The decoder layer's two dense blocks, each one call into the native kernel (decode steps and, where the
kernel's products are the faster ones, prefill chunks).

``llama.attention_inputs`` and ``llama.attention_outputs`` are each a few dozen small torch ops: two
RMSNorms, RoPE on q and k, the residual adds, SiLU and the split and chunk around three products.
At a decode step those ops, not the products, were the largest cost after the weights' read:
at batch 1, context 512 on this 2-core machine, 5-7 ms of a 19-29 ms step in every mode
(``docs/scripts/profile_decode.py``, docs/benchmarks.md "Against llama.cpp").  Here each block is
one call of ``csrc/linear.cpp`` (``mechserve_attention_inputs`` / ``mechserve_attention_outputs``)
that runs the products in the native kernel (``csrc/gemm.h``) and the elementwise steps between them
in C++, all in one OpenMP team: products split the weight rows between the threads, the steps
between them split the activation rows.

They compute what the torch blocks compute, in the same order, rounding to bfloat16 wherever
torch's bfloat16 ops round; results differ from torch's only where a sum (the RMSNorm mean, the
products) or ``exp`` is evaluated in another order, as the kernel's products already do.
Used when ``rows_apply`` and ``weights_apply`` hold: the native linear kernel is enabled (``MECHSERVE_LINEAR``), the rows are on
the CPU, float32 or bfloat16, no more than the kernel takes for every matrix of the layer
(``linear.native_max_rows``), with the model's weights in that dtype or in GGUF blocks, and the layer
has no per-head q/k norm (Qwen3's, left to torch).
"""

from __future__ import annotations

import torch

from mechserve.model import kquants
from mechserve.model.layer import LayerWeights, Matrix
from mechserve.model.linear import TYPES, enabled, external_formats, library, native_max_rows
from mechserve.model.quantized import QuantizedMatrix


def _type(w: Matrix) -> int:
    return TYPES[w.kind if isinstance(w, QuantizedMatrix) else w.dtype]


def _data(w: Matrix) -> torch.Tensor:
    return w.blocks if isinstance(w, QuantizedMatrix) else w


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def weights_apply(w: LayerWeights, dtype: torch.dtype) -> bool:
    """Whether layer ``w`` can run natively with ``dtype`` activations: its matrices in ``dtype`` or GGUF
    blocks, its norms and biases contiguous in ``dtype``, and no per-head q/k norm."""
    if w.q_norm is not None or w.k_norm is not None:
        return False
    for m in (w.qkv, w.o, w.gate_up, w.down):
        if not isinstance(m, QuantizedMatrix) and (m.dtype != dtype or not m.is_contiguous()):
            return False
        if isinstance(m, QuantizedMatrix) and m.kind in kquants.NATIVE_KINDS and not external_formats():
            return False  # issue 30 hook: GGUF's other formats, once registered with linear.cpp
    for t in (w.input_norm, w.post_norm, w.qkv_bias, w.o_bias, w.gate_up_bias, w.down_bias):
        if t is not None and (t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu"):
            return False
    return True


def rows_apply(x: torch.Tensor, w: LayerWeights) -> bool:
    """Whether activations ``x`` ([T, hidden]) run natively through layer ``w``: CPU rows in float32 or
    bfloat16, no more than the kernel takes for each of the layer's matrices, with the native linear
    kernel enabled (``MECHSERVE_LINEAR``)."""
    return (
        x.shape[0] <= min(native_max_rows(m) for m in (w.qkv, w.o, w.gate_up, w.down))
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and enabled()
    )


def attention_inputs(
    x: torch.Tensor,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    h: int,
    kv: int,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``llama.attention_inputs`` in one native call: ``x`` [T, hidden] -> rotated ``q`` [T, h, d], ``k`` and
    ``v`` [T, kv, d], all in ``x``'s dtype; ``cos``/``sin``: [T, 1, d] in ``x``'s dtype.  Requires ``rows_apply`` and ``weights_apply``."""
    t, hidden = x.shape
    x = x.contiguous()
    q = torch.empty(t, h, d, dtype=x.dtype)
    k = torch.empty(t, kv, d, dtype=x.dtype)
    v = torch.empty(t, kv, d, dtype=x.dtype)
    cos, sin = cos.contiguous(), sin.contiguous()
    library().mechserve_attention_inputs(
        x.data_ptr(),
        TYPES[x.dtype],
        w.input_norm.data_ptr(),
        eps,
        t,
        hidden,
        _data(w.qkv).data_ptr(),
        _type(w.qkv),
        _ptr(w.qkv_bias),
        cos.data_ptr(),
        sin.data_ptr(),
        h,
        kv,
        d,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        torch.get_num_threads(),
    )
    return q, k, v


def attention_outputs(x: torch.Tensor, attn: torch.Tensor, w: LayerWeights, eps: float) -> torch.Tensor:
    """``llama.attention_outputs`` in one native call: ``x`` [T, hidden] plus the output projection of
    ``attn`` [T, H * D], then the SwiGLU MLP's residual; returns the new [T, hidden] (``x``'s dtype).
    Requires ``rows_apply`` and ``weights_apply``."""
    t, hidden = x.shape
    x, attn = x.contiguous(), attn.contiguous()
    out = torch.empty_like(x)
    library().mechserve_attention_outputs(
        x.data_ptr(),
        TYPES[x.dtype],
        attn.data_ptr(),
        attn.shape[1],
        _data(w.o).data_ptr(),
        _type(w.o),
        _ptr(w.o_bias),
        w.post_norm.data_ptr(),
        eps,
        _data(w.gate_up).data_ptr(),
        _type(w.gate_up),
        _ptr(w.gate_up_bias),
        w.gate_up.shape[0] // 2,
        _data(w.down).data_ptr(),
        _type(w.down),
        _ptr(w.down_bias),
        t,
        hidden,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


__all__ = ["attention_inputs", "attention_outputs", "rows_apply", "weights_apply"]
