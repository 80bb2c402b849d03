"""The native suffix trie: built from ``csrc/suffix_tree.cpp`` on first use, called through ctypes.

``proposers_suffix`` wraps it (``NativeSuffixTree``, ``NativeCursor``, ``NativeMatcher``,
``native_best_draft``); this module only builds, opens and types the library and says whether it is used.
It is built once per machine into the cache directory by ``mechserve.native.build`` (the system C++
compiler, ``$CXX`` else ``c++``/``g++``; ``MECHSERVE_CACHE``, see ``mechserve.api.env``) and opened with
``ctypes.PyDLL``: the calls keep the GIL (each takes about a microsecond; releasing and taking the GIL back
would cost as much, and a tree is not safe to grow from two threads at once).

Which trees a ``SuffixProposer`` grows is chosen by ``MECHSERVE_SUFFIX_TREE``
(``mechserve.api.env.suffix_tree_mode``), read once per proposer:

* unset or ``auto``: the native trie when it builds, else the pure-Python one with a single warning on
  stderr saying why;
* ``native``: the native trie, and ``NativeKernelError`` if it cannot be built;
* ``python``: always the pure-Python trie (the reference the native one is tested against).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

from mechserve.api.env import SUFFIX_TREE_ENV, suffix_tree_mode
from mechserve.native.build import Kernel, usable

SOURCE = Path(__file__).with_name("csrc") / "suffix_tree.cpp"
ABI = 2
# no fused multiply-adds: a draft's score must round as Python's does (csrc/suffix_tree.cpp)
KERNEL = Kernel(SOURCE, "mechserve_suffix_tree_abi", ABI, extra=("-ffp-contract=off",))

_P, _L = ctypes.c_void_p, ctypes.c_int64
# every function's argument types and result type (csrc/suffix_tree.cpp says what each does)
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "mechserve_suffix_tree_new": ([_L], _P),
    "mechserve_suffix_tree_destroy": ([_P], None),
    "mechserve_suffix_tree_live": ([], _L),
    "mechserve_suffix_tree_stat": ([_P, _L], _L),
    "mechserve_suffix_tree_field": ([_P, _L, _L, _P], _L),
    "mechserve_suffix_tree_free_ids": ([_P, _P, _L], _L),
    "mechserve_suffix_tree_child": ([_P, _L, _L], _L),
    "mechserve_suffix_tree_children": ([_P, _L, _P, _P, _L], _L),
    "mechserve_suffix_tree_append": ([_P, _L], _L),
    "mechserve_suffix_tree_extend": ([_P, _P, _L], _L),
    "mechserve_suffix_tree_remove": ([_P, _P, _L], _L),
    "mechserve_suffix_tree_matches": ([_P, _P, _L, _P], _L),
    "mechserve_suffix_tree_follow": ([_P, _P, _P, _L, _P], _L),
    "mechserve_suffix_tree_best_draft": ([_P, _P, _L, _P, _P], _L),
}


def build() -> Path:
    """Compile the trie if this machine has no build of the current source; return the library's path.

    Raises ``NativeKernelError`` with the compiler's message if it cannot be built.
    """
    return KERNEL.build()


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of ``csrc/suffix_tree.cpp``) with its functions' argument and result types set."""
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


@cache
def library() -> ctypes.CDLL:
    """The library, built if needed and opened once per process as a ``ctypes.PyDLL`` (calls keep the GIL),
    its functions typed.  Raises ``NativeKernelError`` if it cannot be built or opened."""
    KERNEL.forget()
    opened = KERNEL.load()  # builds, checks the ABI
    return bind(ctypes.PyDLL(opened._name))


@cache
def _usable(mode: str) -> bool:
    return usable(mode, library, "native suffix tree", fallback="the Python suffix tree", variable=SUFFIX_TREE_ENV)


def enabled() -> bool:
    """Whether a proposer made now grows native trees (``MECHSERVE_SUFFIX_TREE``, read on every call; the
    library is built on the first call that wants it, and ``auto``'s warning is printed once per process).

    Raises ``ValueError`` on a bad ``MECHSERVE_SUFFIX_TREE`` and ``NativeKernelError`` in ``native`` mode
    when the library cannot be built."""
    mode = suffix_tree_mode()
    return mode != "python" and _usable(mode)


def forget() -> None:
    """Forget the opened library and ``auto``'s verdict, so the next ``enabled`` tries again (tests)."""
    library.cache_clear()
    _usable.cache_clear()


__all__ = ["ABI", "KERNEL", "SOURCE", "bind", "build", "enabled", "forget", "library"]
