"""The native paged-attention kernel: built from ``csrc/paged_attention.cpp`` on first use, called through ctypes.

The kernel attends every item of a step (decode steps, decode windows of speculation, prefill chunks)
straight from the page pool, reading each K/V page once per block of queries (see the source for the
layouts and the algorithm).  It is built
once per machine into the cache directory by ``mechserve.native.build`` (the system C++ compiler,
``$CXX`` else ``c++``/``g++``; ``MECHSERVE_CACHE``, see ``mechserve.api.env``).

Which attention path a step uses is chosen by ``MECHSERVE_ATTENTION`` (``mechserve.api.env.attention_mode``):

* unset or ``auto``: the kernel when it builds, else torch's gather-then-SDPA path with a single
  warning on stderr saying why;
* ``native``: the kernel, and ``NativeKernelError`` if it cannot be built;
* ``torch``: always the gather-then-SDPA path (the reference the kernel is tested against).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from mechserve.api.env import ATTENTION_ENV, attention_mode
from mechserve.native.build import Kernel, usable

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI can check the mode without it
    import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
ABI = 3
KERNEL = Kernel(SOURCE, "mechserve_paged_attention_abi", ABI)


def build() -> Path:
    """Compile the kernel if this machine has no build of the current source; return the library's path.

    Raises ``NativeKernelError`` with the compiler's message if it cannot be built.
    """
    return KERNEL.build()


_ARGS = (
    [ctypes.c_void_p] * 6
    + [ctypes.c_int64] * 6
    + [ctypes.c_float, ctypes.c_int]
    + [ctypes.c_void_p] * 3
    + [ctypes.c_int64] * 2
)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of ``csrc/paged_attention.cpp``) with its functions' argument and result types set."""
    for name in ("mechserve_paged_attention_f32", "mechserve_paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGS, ctypes.c_int
    return lib


@cache
def _load() -> ctypes.CDLL:
    KERNEL.forget()
    return bind(KERNEL.load())


@cache
def enabled() -> bool:
    """Whether attention uses the kernel (per ``MECHSERVE_ATTENTION``; built on the first call).

    Raises ``NativeKernelError`` in ``native`` mode when the kernel cannot be built.
    """
    return usable(attention_mode(), _load, "native paged attention", variable=ATTENTION_ENV)


def supports(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernel handles these dtypes (float32 or bfloat16, the same for queries and pages)."""
    import torch

    return q_dtype == kv_dtype and q_dtype in (torch.float32, torch.bfloat16)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    out: torch.Tensor,
    items: torch.Tensor,
    tables: torch.Tensor,
    page_size: int,
    scale: float,
    sliding_window: int | None,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write the step's K/V rows into the pool, then attend the rows of ``items`` from it, writing their rows of ``out``.

    ``q``: [T, H, D] contiguous; ``k_pool``/``v_pool``: [P * page_size, KV, D] contiguous, the same
    dtype as ``q`` (float32 or bfloat16); ``out``: [T, H * D] contiguous, ``q``'s dtype; ``items``:
    [N, 4] int64 contiguous rows (first flat row, first position, query length, offset into
    ``tables``); ``tables``: int32, the items' page tables concatenated.  Query ``j`` of an item at
    position ``p = first position + j`` sees positions ``[0, p]`` (the last ``sliding_window`` of
    them when it is set).  ``new``: ``(k, v, slots)``, the step's rows ``k``/``v`` [T', KV, D] (the
    pool's dtype) and their slots [T'] int64, stored before any query reads the pool (the cache write
    of ``PagedKVCache.write``, in the same call).  Runs on ``torch.get_num_threads()`` threads.
    Raises ``ValueError`` on dtypes or shapes it does not handle, or a slot outside the pool (then
    nothing is written).
    """
    import torch

    t, h, d = q.shape
    kv = k_pool.shape[1]
    if not supports(q.dtype, k_pool.dtype) or v_pool.dtype != k_pool.dtype or out.dtype != q.dtype:
        raise ValueError(f"native paged attention needs float32 or bfloat16 throughout, got {q.dtype}/{k_pool.dtype}")
    if h % kv or k_pool.shape[2] != d or out.shape != (t, h * d) or items.dtype != torch.int64:
        raise ValueError("native paged attention: inconsistent shapes")
    k_new = v_new = slots = None
    if new is not None:
        k_new, v_new, slots = new
        if k_new.dtype != k_pool.dtype or v_new.dtype != k_pool.dtype or slots.dtype != torch.int64:
            raise ValueError("native paged attention: new K/V rows must have the pool's dtype, slots int64")
        if k_new.shape != v_new.shape or k_new.shape[1:] != k_pool.shape[1:] or slots.shape != (k_new.shape[0],):
            raise ValueError("native paged attention: new K/V rows and slots have inconsistent shapes")
    for x in (q, k_pool, v_pool, out, items, tables, k_new, v_new, slots):
        if x is not None and not x.is_contiguous():
            raise ValueError("native paged attention needs contiguous tensors")
    lib = _load()
    fn = lib.mechserve_paged_attention_f32 if q.dtype == torch.float32 else lib.mechserve_paged_attention_bf16
    status = fn(
        q.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        out.data_ptr(),
        items.data_ptr(),
        tables.data_ptr(),
        items.shape[0],
        h,
        kv,
        d,
        page_size,
        sliding_window or 0,
        scale,
        torch.get_num_threads(),
        None if k_new is None else k_new.data_ptr(),
        None if v_new is None else v_new.data_ptr(),
        None if slots is None else slots.data_ptr(),
        0 if slots is None else slots.shape[0],
        k_pool.shape[0],
    )
    if status != 0:
        raise ValueError(
            f"native paged attention: a slot of the new K/V rows is outside the pool's {k_pool.shape[0]} rows"
        )
