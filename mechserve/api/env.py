"""Every environment variable mechserve reads, in one place (standard library only).

==========================  ===========================================================================
``MECHSERVE_CACHE``         where converted models and built kernels live (default ``~/.cache/mechserve``)
``MECHSERVE_ATTENTION``     ``auto`` (default), ``native`` or ``torch``: attention, decode and prefill
``MECHSERVE_LINEAR``        ``auto`` (default), ``native`` or ``torch``: the matrix products, fused blocks
``MECHSERVE_SUFFIX_TREE``   ``auto`` (default), ``native`` or ``python``: suffix decoding's trees (C++ or the
                            pure-Python reference, ``executor.proposers_suffix``)
``MECHSERVE_RANK_TIMEOUT``  seconds a tensor-parallel rank may take to answer one step (default 300)
``MECHSERVE_TRACEBACK``     set: a rank's full traceback on its stderr (the driver reports one line)
``MECHSERVE_SPEC_COSTS``    ``measured`` (default) or ``static``: what adaptive speculation's governor prices
                            guesses with: costs measured on the loaded model (a calibration at start, then
                            every step), or the fixed prior (the same decisions on every run and machine)
``CXX``                     the C++ compiler that builds the native kernels (default c++/g++/clang++)
==========================  ===========================================================================
"""

from __future__ import annotations

import os
from pathlib import Path

from mechserve.api.errors import ModelLoadError

CACHE_ENV = "MECHSERVE_CACHE"
ATTENTION_ENV = "MECHSERVE_ATTENTION"
ATTENTION_MODES = ("auto", "native", "torch")
LINEAR_ENV = "MECHSERVE_LINEAR"
RANK_TIMEOUT_ENV = "MECHSERVE_RANK_TIMEOUT"
SUFFIX_TREE_ENV = "MECHSERVE_SUFFIX_TREE"
SUFFIX_TREE_MODES = ("auto", "native", "python")
SPEC_COSTS_ENV = "MECHSERVE_SPEC_COSTS"
SPEC_COSTS_MODES = ("measured", "static")
DEFAULT_RANK_TIMEOUT_S = 300.0


def cache_dir() -> Path:
    """``$MECHSERVE_CACHE`` or ``~/.cache/mechserve``; ``ModelLoadError`` if neither can be named."""
    try:
        return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mechserve").expanduser()
    except RuntimeError:  # no home directory to expand
        raise ModelLoadError(
            f"no home directory for the model cache; set {CACHE_ENV} to a writable directory"
        ) from None


def attention_mode() -> str:
    """``MECHSERVE_ATTENTION`` (``auto``/``native``/``torch``); raises ``ValueError`` on anything else."""
    value = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if value not in ATTENTION_MODES:
        raise ValueError(f"{ATTENTION_ENV} must be one of {', '.join(ATTENTION_MODES)}, got {value!r}")
    return value


def linear_mode() -> str:
    """``MECHSERVE_LINEAR`` (``auto``/``native``/``torch``, as ``MECHSERVE_ATTENTION``); ``ValueError`` otherwise."""
    value = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if value not in ATTENTION_MODES:
        raise ValueError(f"{LINEAR_ENV} must be one of {', '.join(ATTENTION_MODES)}, got {value!r}")
    return value


def suffix_tree_mode() -> str:
    """``MECHSERVE_SUFFIX_TREE`` (``auto``/``native``/``python``, default ``auto``); ``ValueError`` otherwise."""
    value = os.environ.get(SUFFIX_TREE_ENV, "auto").strip().lower() or "auto"
    if value not in SUFFIX_TREE_MODES:
        raise ValueError(f"{SUFFIX_TREE_ENV} must be one of {', '.join(SUFFIX_TREE_MODES)}, got {value!r}")
    return value


def rank_timeout() -> float:
    """``MECHSERVE_RANK_TIMEOUT`` seconds if set (a positive number), else ``DEFAULT_RANK_TIMEOUT_S``."""
    raw = os.environ.get(RANK_TIMEOUT_ENV)
    try:
        value = float(raw) if raw else DEFAULT_RANK_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{RANK_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{RANK_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def spec_costs_mode() -> str:
    """``MECHSERVE_SPEC_COSTS`` (``measured``/``static``, default ``measured``); ``ValueError`` otherwise."""
    value = os.environ.get(SPEC_COSTS_ENV, "measured").strip().lower() or "measured"
    if value not in SPEC_COSTS_MODES:
        raise ValueError(f"{SPEC_COSTS_ENV} must be one of {', '.join(SPEC_COSTS_MODES)}, got {value!r}")
    return value


def traceback_wanted() -> bool:
    """Whether ``MECHSERVE_TRACEBACK`` asks for full tracebacks."""
    return bool(os.environ.get("MECHSERVE_TRACEBACK"))


__all__ = [
    "ATTENTION_MODES",
    "CACHE_ENV",
    "LINEAR_ENV",
    "SPEC_COSTS_ENV",
    "SPEC_COSTS_MODES",
    "SUFFIX_TREE_ENV",
    "SUFFIX_TREE_MODES",
    "attention_mode",
    "cache_dir",
    "linear_mode",
    "rank_timeout",
    "spec_costs_mode",
    "suffix_tree_mode",
    "traceback_wanted",
]
