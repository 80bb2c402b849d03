"""The forward's matrix products: a native kernel that reads each weight once per call, and torch's GEMM.

``linear(x, weight, bias)`` is ``F.linear`` on one of two paths::

    weight              rows of x <= NATIVE_MAX_ROWS[weight kind]     more rows
    float32             native kernel (csrc/linear.cpp), any count    -
    bfloat16            native kernel                                 torch (oneDNN)
    QuantizedMatrix     native kernel on the blocks                   blocks dequantized a slice at a time
                                                                      into a reused buffer, then torch
    (a GGUF K-quant: csrc/kquants.cpp's product, up to 16 rows)

The kernel (``csrc/gemm.h``; formats in ``csrc/formats.h``) multiplies a few rows in a format's own
kernel on its stored blocks and more rows in register-blocked tiles, each weight read from memory
once per call: a decode step is bound by that read at a few rows and by arithmetic from a few dozen
rows on.  Where torch is used instead is measured (docs/benchmarks.md, "Batched decode and prefill"):
torch's float32 GEMM here is MKL's AVX2 path (this CPU is not an Intel one), about 0.7x the kernel at
every row count; oneDNN's bfloat16 GEMM is as fast as the kernel from about 128 rows and faster at
prefill sizes, where a quantized matrix dequantized once per call also pays.

The kernel is built once per machine by ``mechserve.native.build``.  ``MECHSERVE_LINEAR``
(``mechserve.api.env.linear_mode``) chooses: ``auto`` (the kernel when it builds, else torch with
one warning), ``native`` (``NativeKernelError`` if it cannot be built) or ``torch`` (torch only; a
quantized matrix is then dequantized by ``quantized.dequantize`` a slice at a time: the reference the
kernel is tested against).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from mechserve.api.env import LINEAR_ENV, linear_mode
from mechserve.model import kquants
from mechserve.model.quantized import QuantizedMatrix, dequantize
from mechserve.native.build import Kernel, usable

KERNEL = Kernel(
    Path(__file__).with_name("csrc") / "linear.cpp",
    "mechserve_linear_abi",
    3,
    std="c++20",
    # only the entry points are exported (csrc/linear.cpp says why)
    extra=("-ffp-contract=off", "-fvisibility=hidden", "-fvisibility-inlines-hidden"),
)
# Row counts up to which each weight kind goes to the kernel (measured on SmolLM2's shapes against torch,
# docs/benchmarks.md); a kind not listed (a block format added later) always does.
NATIVE_MAX_ROWS: dict[object, int] = {torch.float32: 1 << 62, torch.bfloat16: 128, "q4_1": 256, "q8_0": 256}
# issue 30 hook: GGUF's other formats (csrc/kquants.cpp: per-row dot products, no tiles) up to 16 rows, the
# limit every kind had when issue 30 measured them (not re-measured since); more rows are dequantized a slice
# at a time, then torch.
NATIVE_MAX_ROWS.update(dict.fromkeys(kquants.NATIVE_KINDS, 16))
# torch's matrix-matrix kernels are slower at 2 or 3 rows than at MIN_GEMM_ROWS (MKL's small-M path):
# F.linear of 2 or 3 rows took 1.1-1.4x the time of 4 on SmolLM2's shapes (2 threads).
MIN_GEMM_ROWS = 4
# A quantized matrix multiplied at many rows is dequantized this many weights at a time.
DEQUANT_SLICE = 1 << 21

TYPES = {torch.float32: 0, torch.bfloat16: 1, "q4_1": 2, "q8_0": 3}
# issue 30 hook: GGUF's other formats (kquants.py) by their native numbers: f32/bf16 blocks are linear.cpp's
# dense types 0/1, the rest (>= 16) are multiplied by csrc/kquants.cpp (here and, once registered with
# ``external_formats``, inside linear.cpp's fused blocks).
TYPES.update(kquants.NATIVE_TYPES)


def native_max_rows(weight: torch.Tensor | QuantizedMatrix) -> int:
    """Rows of activations up to which ``linear`` multiplies ``weight`` in the kernel (when it is enabled)."""
    kind = weight.kind if isinstance(weight, QuantizedMatrix) else weight.dtype
    return NATIVE_MAX_ROWS.get(kind, 1 << 62)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of ``csrc/linear.cpp``) with its functions' argument and result types set."""
    # Each function's arguments, one letter each: p pointer, i int, l int64, f float (csrc/linear.cpp);
    # then its result (- for none).
    signatures = {
        "mechserve_linear": "pipippillli-",
        "mechserve_dequantize_rows": "pipllpii-",
        "mechserve_attention_inputs": "pipfllpippplllpppi-",
        "mechserve_attention_outputs": "piplpippfpiplpipllpi-",
        "mechserve_linear_isa": "s",
        "mechserve_few_rows": "il",
        "mechserve_bf16_tiles": "i",
        "mechserve_set_external_product": "p-",  # issue 30 hook
    }
    kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_int64, "f": ctypes.c_float, "s": ctypes.c_char_p}
    for name, letters in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [kinds[c] for c in letters[:-1]], kinds.get(letters[-1])
    return lib


@cache
def library() -> ctypes.CDLL:
    """The built kernel library with its functions' argument types set (built on the first call).

    Raises ``NativeKernelError`` when it cannot be built or loaded.
    """
    KERNEL.forget()
    return bind(KERNEL.load())


def isa() -> str:
    """The instruction-set path the kernel was built with: ``avx512+bf16``, ``avx512``, ``avx2`` or ``portable``."""
    return library().mechserve_linear_isa().decode()


@cache
def external_formats() -> bool:
    """issue 30 hook: whether ``linear.cpp``'s products (its fused blocks included) take the formats of
    ``kquants.NATIVE_KINDS``: registers ``csrc/kquants.cpp``'s product with it, once, when both kernels are
    enabled."""
    if not (enabled() and kquants.enabled()):
        return False
    library().mechserve_set_external_product(kquants.product_function())
    return True


@cache
def enabled() -> bool:
    """Whether products (up to ``native_max_rows``) use the kernel (per ``MECHSERVE_LINEAR``; built on the first call).

    Raises ``NativeKernelError`` in ``native`` mode when the kernel cannot be built.
    """
    return usable(linear_mode(), library, "native linear kernel", variable=LINEAR_ENV)


def native_linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedMatrix,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The kernel's ``x @ weight.T + bias``: ``x`` [M, K] float32 or bfloat16, ``weight`` [N, K] (x's
    dtype, or a ``QuantizedMatrix``), ``bias`` [N] in x's dtype; returns [M, N] in ``out_dtype``
    (default x's; float32 or bfloat16), accumulated in float32.  Runs on ``torch.get_num_threads()``
    threads.  Raises ``ValueError`` for dtypes or shapes it does not take.
    """
    out_dtype = out_dtype or x.dtype
    quantized = isinstance(weight, QuantizedMatrix)
    w_type = weight.kind if isinstance(weight, QuantizedMatrix) else weight.dtype
    if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the linear kernel takes float32 or bfloat16 activations, got {x.dtype} -> {out_dtype}")
    if not quantized and w_type != x.dtype:
        raise ValueError(f"weight dtype {w_type} differs from the activations' {x.dtype}")
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError("bias must be contiguous in the activations' dtype")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight expects {weight.shape[1]}")
    if isinstance(weight, QuantizedMatrix) and weight.kind in kquants.NATIVE_KINDS:  # issue 30 hook
        if not kquants.enabled():
            return F.linear(x, dequantize(weight, x.dtype), bias).to(out_dtype)
        return kquants.native_linear(x, weight.kind, weight.blocks, n, bias, out_dtype)
    x = x.contiguous()
    data = weight.blocks if isinstance(weight, QuantizedMatrix) else weight.contiguous()
    y = torch.empty(m, n, dtype=out_dtype)
    library().mechserve_linear(
        x.data_ptr(),
        TYPES[x.dtype],
        data.data_ptr(),
        TYPES[w_type],
        bias.data_ptr() if bias is not None else None,
        y.data_ptr(),
        TYPES[out_dtype],
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return y


def dequantize_rows(matrix: QuantizedMatrix, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` ([R] int64) of ``matrix`` as [R, K] ``dtype`` (float32 or bfloat16): an embedding lookup.

    The kernel when enabled, else ``quantized.dequantize`` of the selected rows (the same values).
    """
    if matrix.kind in kquants.FORMATS or matrix.segments:  # issue 30 hook: GGUF's other formats
        return kquants.dequantize_rows(matrix.kind, matrix.blocks, matrix.in_features, ids, dtype)
    if not enabled():
        return dequantize(matrix.rows(ids), dtype)
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), matrix.in_features, dtype=dtype)
    library().mechserve_dequantize_rows(
        matrix.blocks.data_ptr(),
        TYPES[matrix.kind],
        ids.data_ptr(),
        ids.numel(),
        matrix.in_features,
        out.data_ptr(),
        TYPES[dtype],
        torch.get_num_threads(),
    )
    return out


def _quantized_gemm(
    x: torch.Tensor, weight: QuantizedMatrix, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Many rows against a quantized matrix: dequantize a slice of its rows at a time, multiply with torch."""
    n, k = weight.shape
    step = max(1, DEQUANT_SLICE // k)
    y = torch.empty(x.shape[0], n, dtype=out_dtype)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = dequantize_rows(weight, torch.arange(r0, r1), x.dtype)
        b = bias[r0:r1] if bias is not None else None
        y[:, r0:r1] = F.linear(x, w, b)
    return y


# Under torch.compile (EngineConfig.compile) a product is a graph break: its path choice (a cached
# kernel check, the library's ctypes call) is not traceable, and the compiled blocks gain by fusing the
# elementwise ops between products, not the products.
@torch.compiler.disable
def linear(
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedMatrix,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear`` (``x``: [T, in] -> [T, out]) by the fastest path for its row count (module docstring).

    ``out_dtype``: the result's dtype (default ``x``'s); the kernel writes it from its float32
    accumulator, torch's path converts.  Torch's path computes 2 or 3 rows as ``MIN_GEMM_ROWS``
    (zero rows added, then dropped), which is faster on a CPU.
    """
    rows = x.shape[0]
    out_dtype = out_dtype or x.dtype
    if (
        rows <= native_max_rows(weight)
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and (isinstance(weight, QuantizedMatrix) or weight.dtype == x.dtype)
        and enabled()
    ):
        return native_linear(x, weight, bias, out_dtype)
    if isinstance(weight, QuantizedMatrix):
        return _quantized_gemm(x, weight, bias, out_dtype)
    if 1 < rows < MIN_GEMM_ROWS and x.device.type == "cpu":
        padded = torch.cat((x, x.new_zeros(MIN_GEMM_ROWS - rows, x.shape[1])))
        return F.linear(padded, weight, bias)[:rows].to(out_dtype)
    return F.linear(x, weight, bias).to(out_dtype)


__all__ = [
    "MIN_GEMM_ROWS",
    "NATIVE_MAX_ROWS",
    "TYPES",
    "bind",
    "dequantize_rows",
    "enabled",
    "external_formats",
    "isa",
    "library",
    "linear",
    "native_linear",
    "native_max_rows",
]
