"""Host memory for what the native kernels stream: tensors on transparent huge pages.

A decode step reads every weight matrix (and, in attention, every KV page) once, hundreds of megabytes
in 4 KiB pages: a TLB miss every 4 KiB.  On 2 MiB pages the same reads ran up to 20% faster here
(float32 products at 32 rows, docs/benchmarks.md).  Linux gives an anonymous mapping huge pages when
it is marked ``MADV_HUGEPAGE`` before it is first touched (``/sys/kernel/mm/transparent_hugepage/enabled``
``madvise`` or ``always``; with ``never``, or on another OS, this is plain memory).

``Arena`` hands out tensors from one such mapping, so the alignment costs at most one huge page in
all; ``huge_zeros`` is one tensor on its own mapping.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

import torch

HUGE_PAGE = 2 << 20  # bytes
MADV_HUGEPAGE = 14
ALIGN = 64  # each tensor of an arena starts on a cache line


@cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def _huge_bytes(nbytes: int) -> tuple[torch.Tensor, int]:
    """A fresh uint8 buffer of at least ``nbytes`` and the offset of its first huge-page boundary; the huge
    pages from there on are marked for transparent huge pages (nothing is touched)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    advised(raw[start:])
    return raw, start


def advised(buf: torch.Tensor) -> bool:
    """Mark the whole huge pages inside ``buf``'s memory ``MADV_HUGEPAGE``; whether the OS took the advice
    (False on another OS, or when it refuses: the memory then stays on plain pages)."""
    advise = _madvise()
    start = -buf.data_ptr() % HUGE_PAGE
    span = (buf.numel() * buf.element_size() - start) // HUGE_PAGE * HUGE_PAGE
    if advise is None or span <= 0:
        return False
    return advise(buf.data_ptr() + start, span, MADV_HUGEPAGE) == 0


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` on huge pages (where the OS gives them)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw, start = _huge_bytes(nbytes)
    return raw[start : start + nbytes].view(dtype).view(shape).zero_()


class Arena:
    """Room for copies of ``tensors`` packed into one huge-page mapping, each on a cache line: ``place``
    copies one in (any order).  ``place`` raises ``ValueError`` when more is placed than there is room for."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        total = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)
        self._raw, self._at = _huge_bytes(total)
        self._end = self._at + total

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` in the arena."""
        nbytes = t.numel() * t.element_size()
        if self._at + nbytes > self._end:
            raise ValueError("the arena is full: place only the tensors it was made for")
        out = self._raw[self._at : self._at + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        self._at += -(-nbytes // ALIGN) * ALIGN
        return out


__all__ = ["HUGE_PAGE", "Arena", "advised", "huge_zeros"]
