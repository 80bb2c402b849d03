"""Workloads for real models: the shared hypothesis strategies, mapped into a model's vocabulary.

The strategies of ``mechserve.conformance.strategies`` draw workloads for the scripted model, whose
prompts are synthetic (``[1000·i, 1000·i+1, …]``) or drawn from a tiny alphabet.  A real model needs
ids inside its vocabulary, so ``model_workload`` rewrites every prompt (and stop id) through
``token_map``: an injective-enough map into ``[V/4, V)`` that keeps equal ids equal, so prefix
sharing, reuse and adoption happen exactly where the scripted workload had them.  The engine section
and every other request field stay as drawn (``eos_after``, m12's scripted EOS trigger, is kept for
the replay, contract and KV checks and dropped for invariance, whose reference knows no such thing;
``accept_script`` is dropped: a real executor decides its own verdicts).

``real_workloads`` (replay, contract, KV) and ``invariance_workloads`` are the strategies the
``mechserve conform`` command and the tests share; ``FIXED_WORKLOADS`` is the small fixed set the
SmolLM2 end-to-end tests run.  Standard library and hypothesis only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from hypothesis import strategies as st

from mechserve.conformance.strategies import prompt_tokens, workloads


def token_map(vocab_size: int) -> Callable[[int], int]:
    """The map of a scripted workload's ids into ``[vocab_size // 4, vocab_size)``: ``t -> base + t mod span``.

    Low ids are avoided because tokenizers keep their special tokens (BOS, EOS, padding) there.
    Raises ``ValueError`` for a vocabulary under 8 ids.
    """
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be >= 8, got {vocab_size}")
    base = vocab_size // 4
    span = vocab_size - base
    return lambda t: base + int(t) % span


def model_workload(workload: Mapping[str, Any], vocab_size: int, *, eos_after: bool = True) -> dict[str, Any]:
    """A copy of ``workload`` for a model of ``vocab_size`` ids.

    Every request gets explicit ``tokens`` (its prompt through ``token_map``; an empty prompt stays
    empty) and keeps ``request_id``, ``max_new_tokens``, ``arrival_step``, ``stop_token_ids`` (mapped)
    and, with ``eos_after``, ``eos_after``.  The engine section is copied as given.
    """
    f = token_map(vocab_size)
    requests = []
    for i, spec in enumerate(workload.get("requests") or []):
        req: dict[str, Any] = {
            "request_id": str(spec["request_id"]),
            "tokens": [f(t) for t in prompt_tokens(workload, i)],
            "max_new_tokens": int(spec["max_new_tokens"]),
        }
        if spec.get("arrival_step") is not None:
            req["arrival_step"] = int(spec["arrival_step"])
        if eos_after and spec.get("eos_after") is not None:
            req["eos_after"] = int(spec["eos_after"])
        if spec.get("stop_token_ids"):
            req["stop_token_ids"] = [f(t) for t in spec["stop_token_ids"]]
        requests.append(req)
    return {"engine": dict(workload.get("engine") or {}), "requests": requests}


_SIZES: dict[str, Any] = dict(min_requests=2, max_requests=5, max_prompt=12, max_new=8, page_size=(1, 4))


def real_workloads(vocab_size: int, *, world_size: tuple[int, int] = (1, 2)) -> st.SearchStrategy[dict[str, Any]]:
    """Workloads for the replay, contract and KV checks, in ``vocab_size`` ids.

    One of: shared prompt stems on a tight pool (prefix reuse, adoption, eviction, preemption);
    m12's door at work (rejections, ``max_running``/``max_waiting``, 0-token requests, stop ids);
    an ample pool with a large budget.  All with speculation (``spec_len`` 0..3), ``eos_after``
    triggers, and ``world_size`` ranks.
    """
    knobs = dict(_SIZES, spec_len=(0, 3), world_size=world_size)
    return st.one_of(
        workloads(**knobs, pool="tight", prompts="shared"),
        workloads(**knobs, pool="fits", prompts="mixed", admission=True),
        workloads(**knobs, pool="ample", prompts="mixed", budget="large"),
    ).map(partial(model_workload, vocab_size=vocab_size))


def invariance_workloads(vocab_size: int, *, world_size: tuple[int, int] = (1, 2)) -> st.SearchStrategy[dict[str, Any]]:
    """Workloads for the invariance check: every request passes the door (each fits the pool alone), no
    ``eos_after``; the pool is tight (preemption) or merely fits, prompts share stems or not."""
    knobs = dict(_SIZES, spec_len=(0, 3), world_size=world_size, eos=False, prompts="mixed")
    return st.one_of(workloads(**knobs, pool="tight"), workloads(**knobs, pool="fits")).map(
        partial(model_workload, vocab_size=vocab_size, eos_after=False)
    )


def _req(rid: str, tokens: list[int], new: int, **extra: Any) -> dict[str, Any]:
    return {"request_id": rid, "tokens": tokens, "max_new_tokens": new, **extra}


_STEM = [7, 1, 3, 3, 8, 2, 9, 4]
FIXED_WORKLOADS: dict[str, dict[str, Any]] = {
    # Three prompts share an 8-token stem: the late ones reuse its pages, the twins adopt them; the pool
    # is tight, so someone is preempted; speculation rolls back.
    "shared-prefix": {
        "engine": {"max_step_tokens": 12, "page_size": 4, "num_pages": 7, "spec_len": 3, "world_size": 1},
        "requests": [
            _req("a", [*_STEM, 5, 6], 6),
            _req("b", [*_STEM, 5, 1, 2], 5, arrival_step=1),
            _req("c", [*_STEM, 0], 6, arrival_step=1),
        ],
    },
    # A budget of 3 chunks every prompt; page size 2; two ranks; an eos_after trigger.
    "chunked-two-ranks": {
        "engine": {"max_step_tokens": 3, "page_size": 2, "num_pages": 12, "spec_len": 2, "world_size": 2},
        "requests": [_req("x", [11, 12, 13, 14, 15, 16, 17], 5), _req("y", [21, 22, 23], 4, eos_after=2)],
    },
    # m12's door: one running at a time, a zero-token request, one that never fits, one refused as too long.
    "admission": {
        "engine": {
            "max_step_tokens": 16,
            "page_size": 4,
            "num_pages": 3,
            "spec_len": 1,
            "world_size": 1,
            "max_running": 1,
            "max_model_len": 14,
        },
        "requests": [
            _req("p", [31, 32, 33, 34, 35], 5),
            _req("zero", [41, 42], 0),
            _req("huge", list(range(50, 63)), 1),
            _req("long", list(range(70, 80)), 5),
            _req("q", [31, 32, 33, 34, 36], 4, stop_token_ids=[60]),
        ],
    },
}
"""A fixed set for the end-to-end tests on a real model (ids pass through ``model_workload`` first)."""
