"""Hypothesis strategies for random mechserve workloads, and a builder that runs one on any rung.

A *workload* is the JSON workload spec of MECHANISMS 4.2 as a plain, JSON-ready dict::

    {"engine":   {"max_step_tokens": 8, "page_size": 4, "num_pages": 8, "spec_len": 0, "world_size": 1},
     "requests": [{"request_id": "r0", "prompt_len": 6, "max_new_tokens": 4},
                  {"request_id": "r1", "tokens": [3, 1, 4, 1, 5], "max_new_tokens": 2,
                   "arrival_step": 1, "eos_after": 1, "accept_script": [2, -1, 7]}]}

Optional request keys are left out when absent.  ``workloads()`` draws such dicts; its knobs let a
test ask for the situation it needs:

* ``budget``: ``"any"`` (small budgets: chunking, never-fits), ``"covering"`` (at least the most work
  any step of m01 does, so no spec-free budget rung ever cuts or skips anyone), ``"large"`` (covers
  every step of every rung, speculation windows included);
* ``pool``: ``"any"`` (may be smaller than one request: ``Irreducible``), ``"fits"`` (every request
  fits the pool on its own), ``"tight"`` (fits on its own, but barely: preemption and eviction),
  ``"ample"`` (everything fits at once: the pool never runs short);
* ``prompts``: ``"length"`` (``prompt_len`` only, so the synthetic prompts of 4.2 never share a
  block), ``"shared"`` (explicit ``tokens`` drawn from a few shared stems over a tiny alphabet, so
  prefix reuse, eviction and D2 adoption happen), ``"mixed"`` (either, per request);
* ``spec_len`` (a range), ``scripts`` (accept scripts with entries from -2 to ``spec_len + 2``,
  i.e. negatives and values above the draft), ``eos``, ``world_size`` (a range), ``negatives``
  (negative ``arrival_step``/``eos_after``: legal for the engines, rejected by the CLI loader, D4).

``mechanism_idle(rung)`` presets the knobs under which a rung's mechanism changes nothing relative to
the rung below, for ladder-consistency checks.  ``build(rung_module, workload)`` turns a workload into
that rung's ``Engine``, passing only what the rung takes (through the CLI's own loader,
``mechserve.workload``, unless told not to validate).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from hypothesis import strategies as st

from mechserve.spec import m01_continuous_batching
from mechserve.workload import ENGINE_DEFAULTS, build_engine, fit_rung, parse_workload, synthetic_prompt

ENGINE_KEYS = tuple(ENGINE_DEFAULTS)
"""The engine section's keys in 4.2 order."""


# ---- workload arithmetic ---------------------------------------------------------------------------------


def pages_for(tokens: int, page_size: int) -> int:
    """``ceil(tokens / page_size)``."""
    return -(-tokens // page_size)


def engine_of(workload: Mapping[str, Any]) -> dict[str, int]:
    """The workload's engine section with the 4.2 defaults filled in."""
    return {**ENGINE_DEFAULTS, **{k: int(v) for k, v in (workload.get("engine") or {}).items()}}


def prompt_tokens(workload: Mapping[str, Any], index: int) -> list[int]:
    """The prompt request ``index`` gets: its ``tokens``, else the synthetic ``[1000·i, 1000·i+1, …]``."""
    return _prompt_of((workload.get("requests") or [])[index], index)


def _prompt_of(spec: Mapping[str, Any], index: int) -> list[int]:
    if spec.get("tokens") is not None:
        return list(spec["tokens"])
    return list(synthetic_prompt(index, int(spec["prompt_len"])))


def prompt_len(spec: Mapping[str, Any]) -> int:
    """A request dict's prompt length (``tokens`` wins over ``prompt_len``)."""
    return len(spec["tokens"]) if spec.get("tokens") is not None else int(spec["prompt_len"])


def alone_pages(spec: Mapping[str, Any], page_size: int) -> int:
    """The most pages one request can ever hold: ``pages_for(prompt + max_new - 1)``.

    The last sample happens at ``computed = target - 1 <= prompt + max_new - 1``, and a speculative
    window is capped at that frontier too (``draft_len <= max_new - generated - 1``).
    """
    return pages_for(prompt_len(spec) + int(spec["max_new_tokens"]) - 1, page_size)


def fits_alone(workload: Mapping[str, Any]) -> bool:
    """True when every request fits the pool on its own (no ``Irreducible`` is possible)."""
    eng = engine_of(workload)
    return all(alone_pages(r, eng["page_size"]) <= eng["num_pages"] for r in workload.get("requests") or [])


def peak_step_work(workload: Mapping[str, Any]) -> int:
    """The most tokens any step of m01 executes on this workload (0 without requests).

    A budget at least this large never cuts or skips anyone on m02–m08, so those rungs then schedule
    exactly what m01 does.
    """
    records = build(m01_continuous_batching, workload, validate=False).run()
    return max((sum(rec.executed.values()) for rec in records), default=0)


# ---- strategies ------------------------------------------------------------------------------------------


@st.composite
def _prompts(draw: st.DrawFn, n: int, mode: str, max_prompt: int) -> list[dict[str, Any]]:
    """One prompt entry (``{"prompt_len": …}`` or ``{"tokens": […]}``) per request."""
    stems = [[0]]
    if mode != "length":
        stems = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=max_prompt), min_size=1, max_size=3))
    out: list[dict[str, Any]] = []
    for _ in range(n):
        kind = mode if mode != "mixed" else draw(st.sampled_from(["length", "shared"]))
        if kind == "length":
            out.append({"prompt_len": draw(st.integers(1, max_prompt))})
            continue
        stem = draw(st.sampled_from(stems))
        cut = draw(st.integers(0, len(stem)))
        suffix = draw(st.lists(st.integers(0, 5), min_size=0 if cut else 1, max_size=max(1, max_prompt - cut)))
        out.append({"tokens": (stem[:cut] + suffix)[:max_prompt]})
    return out


@st.composite
def workloads(
    draw: st.DrawFn,
    *,
    min_requests: int = 0,
    max_requests: int = 5,
    max_prompt: int = 10,
    max_new: int = 5,
    max_arrival: int = 3,
    page_size: tuple[int, int] = (1, 4),
    budget: str = "any",
    pool: str = "any",
    prompts: str = "length",
    spec_len: tuple[int, int] = (0, 0),
    scripts: bool = False,
    eos: bool = True,
    world_size: tuple[int, int] = (1, 1),
    negatives: bool = False,
) -> dict[str, Any]:
    """A random workload in the 4.2 JSON shape; see the module docstring for the knobs.

    Request ids are ``r0, r1, …`` (list order).  Every value is valid for every rung's constructor.
    """
    if budget not in ("any", "covering", "large"):
        raise ValueError(f"budget must be any, covering or large, not {budget!r}")
    if pool not in ("any", "fits", "tight", "ample"):
        raise ValueError(f"pool must be any, fits, tight or ample, not {pool!r}")
    if prompts not in ("length", "shared", "mixed"):
        raise ValueError(f"prompts must be length, shared or mixed, not {prompts!r}")
    n = draw(st.integers(min_requests, max_requests))
    k = draw(st.integers(*spec_len))
    low = -2 if negatives else 0
    requests: list[dict[str, Any]] = []
    for i, prompt in enumerate(draw(_prompts(n, prompts, max_prompt))):
        req: dict[str, Any] = {"request_id": f"r{i}", **prompt, "max_new_tokens": draw(st.integers(1, max_new))}
        if draw(st.booleans()):
            req["arrival_step"] = draw(st.integers(low, max_arrival))
        if eos and draw(st.integers(0, 2)) == 0:
            req["eos_after"] = draw(st.integers(low, max_new + 1))
        if scripts and draw(st.booleans()):
            req["accept_script"] = draw(st.lists(st.integers(-2, k + 2), max_size=6))
        requests.append(req)
    ps = draw(st.integers(*page_size))
    workload: dict[str, Any] = {"engine": {"page_size": ps, "spec_len": k}, "requests": requests}
    alone = [alone_pages(r, ps) for r in requests]
    biggest, total = max(alone, default=1), sum(alone) or 1
    workload["engine"]["num_pages"] = draw(
        {
            "any": st.integers(1, total + 2),
            "fits": st.integers(biggest, max(biggest, total)),
            "tight": st.integers(biggest, biggest + 2),
            "ample": st.integers(total, total + 2),
        }[pool]
    )
    if budget == "any":
        workload["engine"]["max_step_tokens"] = draw(st.integers(1, max_prompt + 4))
    elif budget == "covering":
        workload["engine"]["max_step_tokens"] = max(1, peak_step_work(workload)) + draw(st.integers(0, 2))
    else:
        large = sum(prompt_len(r) for r in requests) + n * (1 + k)
        workload["engine"]["max_step_tokens"] = max(1, large) + draw(st.integers(0, 2))
    workload["engine"]["world_size"] = draw(st.integers(*world_size))
    return {"engine": {key: workload["engine"][key] for key in ENGINE_KEYS}, "requests": requests}


IDLE_KNOBS: dict[str, dict[str, Any]] = {
    "m01_continuous_batching": {},
    "m02_token_budget": {"budget": "covering"},
    "m03_paged_state": {"pool": "ample"},
    "m04_chunked_prefill": {"budget": "covering"},
    "m05_preemption": {"pool": "ample"},
    "m06_prefix_hash": {},
    "m07_radix_cache": {},
    "m08_cache_aware_scheduling": {"prompts": "length", "pool": "ample"},
    "m09_speculative_decode": {"spec_len": (0, 0)},
    "m10_executor_boundary": {},
    "m11_parallelism": {},
}
"""Per rung, the knobs under which its mechanism is idle, so its trace equals the rung below's."""


def mechanism_idle(rung: str, **knobs: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Workloads on which rung ``rung`` (a ``RUNGS`` name) adds nothing observable to the rung below.

    Extra ``knobs`` go to ``workloads()``; they must not switch the mechanism back on.
    """
    return workloads(**{**IDLE_KNOBS[rung], **knobs})


# ---- building an engine ----------------------------------------------------------------------------------


def cli_valid(workload: Mapping[str, Any]) -> bool:
    """False when the workload holds engine-legal values the CLI loader rejects (D4): a negative
    ``arrival_step`` or ``eos_after`` (drawn with ``negatives=True``)."""
    return all(
        spec.get(key) is None or spec[key] >= 0
        for spec in workload.get("requests") or []
        for key in ("arrival_step", "eos_after")
    )


def _request(rung: ModuleType, index: int, spec: Mapping[str, Any]) -> Any:
    takes = {f.name for f in dataclasses.fields(rung.Request)}
    kwargs: dict[str, Any] = {"request_id": str(spec["request_id"]), "max_new_tokens": int(spec["max_new_tokens"])}
    if "tokens" in takes:
        kwargs["tokens"] = _prompt_of(spec, index)
    else:
        kwargs["prompt_len"] = prompt_len(spec)
    for key in ("arrival_step", "eos_after", "accept_script"):
        if spec.get(key) is not None and key in takes:
            kwargs[key] = list(spec[key]) if key == "accept_script" else spec[key]
    return rung.Request(**kwargs)


def build(rung: ModuleType, workload: Mapping[str, Any], *, validate: bool = True) -> Any:
    """``rung.Engine`` over fresh requests built from ``workload``, given only what the rung takes.

    With ``validate`` (the default) this is the CLI's own path: ``mechserve.workload`` validates the
    spec (D4, ``WorkloadError``), drops what the rung lacks (``fit_rung``: ``spec_len``, accept scripts,
    ``world_size``) and builds it (``build_engine``).  ``validate=False`` builds directly, so values
    the engines accept but D4 rejects (negative ``arrival_step``/``eos_after``) reach the engine too.
    Either way lists are copied: the workload is never consumed and can be built again; m00–m07 get
    ``prompt_len`` (the length of ``tokens`` when given) and m08+ ``tokens`` (synthetic when absent).
    """
    if validate:
        fitted, _ = fit_rung(rung, parse_workload(json.loads(json.dumps(workload))))
        return build_engine(rung, fitted)
    engine = engine_of(workload)
    takes = inspect.signature(rung.Engine).parameters
    requests = [_request(rung, i, spec) for i, spec in enumerate(workload.get("requests") or [])]
    return rung.Engine(requests, **{k: engine[k] for k in ENGINE_KEYS if k in takes})
