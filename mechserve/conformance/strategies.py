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
* ``spec_len`` (a range), ``scripts`` (none when ``spec_len`` is 0, which the loader refuses with a script
  from m09 on, issue 31; ``True``: accept scripts, on about half the requests, with
  entries from -2 to ``spec_len + 2``, i.e. negatives and values above the draft; ``"rollback"``: ``spec_len``
  at least 1 and a script on every request with entries from -1 to ``spec_len - 1``, so nearly every decode window
  that drafts rolls guesses back, and with pages no larger than the window, back across a page
  boundary, freeing tail pages; a request drafts only with ``max_new_tokens >= 3``, which ``min_new``
  can ask for), ``eos``, ``world_size`` (a range), ``negatives`` (negative
  ``arrival_step``/``eos_after``: legal for the engines, rejected by the CLI loader, D4);
* ``arrivals``: ``"any"`` (each request's ``arrival_step`` drawn on its own, so a request may arrive
  before one listed ahead of it) or ``"list_order"`` (the same values, sorted along the list by the
  step they arrive at, a negative one counting as 0: no request arrives before one listed ahead of
  it, so m12's first-come-first-served order, D9, is list order, the order of every rung below);
* ``admission`` (m12 only): the engine section may carry ``max_waiting``, ``max_running`` and
  ``max_model_len``, and requests may ask for 0 tokens, have an empty prompt (``"tokens": []``) or
  carry ``stop_token_ids`` (mostly ids the scripted model will sample), so the door rejects for
  every reason a valid 4.2 spec can give (``door_verdicts``) and requests finish with STOP.  Such a
  workload builds on m12 and later only (rungs below refuse 0 tokens and empty prompts); it takes
  ``budget`` ``"any"`` or ``"large"``.  Off by default: no default workload has anything only m12 reads.
* ``output_caching`` (m13 and later): ``True`` puts ``"output_caching": true`` in the engine section (the
  rungs below refuse it, or ``build`` drops it for them), ``"any"`` draws it either way, ``False``
  (the default) leaves it out, so that m13 runs as m12.
* ``draft_limits`` (m16 and later): ``True`` gives about half the requests a ``draft_limit_script``
  (entries from 0 to ``spec_len + 1``) when ``spec_len`` is drawn above 0; ``False`` (the default) gives
  none, so that m16 runs as m15.  ``build`` drops the scripts below m16.

``mechanism_idle(rung)`` presets the knobs under which a rung's mechanism changes nothing relative to
the rung below, for ladder-consistency checks (for m12, arrivals in list order as well as a door that
refuses nothing: D9 reorders the others).  ``build(rung_module, workload)`` turns a workload into
that rung's ``Engine``, passing only what the rung takes (through the CLI's own loader,
``mechserve.workload``, unless told not to validate): m12's admission settings and stop ids reach
m12 and later only, m13's output-caching switch m13 and later, m14's forced scripts m14 only.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from hypothesis import strategies as st

from mechserve.spec import m01_continuous_batching, m12_admission_control
from mechserve.workload import (
    ENGINE_DEFAULTS,
    ENGINE_OPTIONAL,
    ENGINE_SWITCHES,
    build_engine,
    fit_rung,
    parse_workload,
    synthetic_prompt,
)

ENGINE_KEYS = (*ENGINE_DEFAULTS, *ENGINE_OPTIONAL, *ENGINE_SWITCHES)
"""The engine section's keys in 4.2 order: the five every workload has, then m12's optional limits,
then m13's switch."""


# ---- workload arithmetic ---------------------------------------------------------------------------------


def pages_for(tokens: int, page_size: int) -> int:
    """``ceil(tokens / page_size)``."""
    return -(-tokens // page_size)


def engine_of(workload: Mapping[str, Any]) -> dict[str, int]:
    """The workload's engine section with the 4.2 defaults filled in; m12's limits and m13's switch
    (a bool) only when given."""
    section = (workload.get("engine") or {}).items()
    given = {k: v if isinstance(v, bool) else int(v) for k, v in section if v is not None}
    return {**ENGINE_DEFAULTS, **given}


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
    window is capped at that frontier too (``draft_len <= max_new - generated - 1``).  A request that
    never takes a page (m12: 0 tokens, or an empty prompt, which the door refuses) needs 0.
    """
    n, max_new = prompt_len(spec), int(spec["max_new_tokens"])
    return pages_for(n + max_new - 1, page_size) if n and max_new > 0 else 0


def door_verdicts(workload: Mapping[str, Any]) -> list[str | None]:
    """Per request, list order: the reason m12's door refuses it (a ``RejectReason`` name), or None.

    All requests reach the door in the constructor, before any step, so every accepted request is
    still WAITING when the next one arrives: N3's checks in order, with the waiting queue holding
    exactly the requests accepted so far (N6) and every accepted id live (``DUPLICATE_ID``).
    ``NEVER_FITS`` is the conservative N4 bound ``alone_pages > num_pages``, whatever ``eos_after``.
    """
    eng = engine_of(workload)
    verdicts: list[str | None] = []
    live: set[str] = set()
    for spec in workload.get("requests") or []:
        n, max_new = prompt_len(spec), int(spec["max_new_tokens"])
        limit, waiting = eng.get("max_model_len"), eng.get("max_waiting")
        if n == 0:
            why = "EMPTY_PROMPT"
        elif max_new < 0:
            why = "BAD_MAX_NEW_TOKENS"
        elif str(spec["request_id"]) in live:
            why = "DUPLICATE_ID"
        elif limit is not None and n + max_new > limit:
            why = "TOO_LONG"
        elif max_new > 0 and alone_pages(spec, eng["page_size"]) > eng["num_pages"]:
            why = "NEVER_FITS"
        elif waiting is not None and len(live) >= waiting:
            why = "OVERLOADED"
        else:
            why = None
            live.add(str(spec["request_id"]))
        verdicts.append(why)
    return verdicts


def scripted_ids(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` ids the scripted model (m10+) samples after ``prompt``, EOS and stops aside."""
    ids, prev = [], prompt[-1]
    for j in range(n):
        prev = m12_admission_control.scripted_token(prev, len(prompt) + j)
        ids.append(prev)
    return ids


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
    min_new: int | None = None,
    max_arrival: int = 3,
    page_size: tuple[int, int] = (1, 4),
    budget: str = "any",
    pool: str = "any",
    prompts: str = "length",
    spec_len: tuple[int, int] = (0, 0),
    scripts: bool | str = False,
    eos: bool = True,
    world_size: tuple[int, int] = (1, 1),
    negatives: bool = False,
    admission: bool = False,
    output_caching: bool | str = False,
    arrivals: str = "any",
    draft_limits: bool = False,
) -> dict[str, Any]:
    """A random workload in the 4.2 JSON shape; see the module docstring for the knobs.

    Request ids are ``r0, r1, …`` (list order).  Without ``admission`` every value is valid for every
    rung's constructor; with it, for m12's.
    """
    if budget not in ("any", "covering", "large"):
        raise ValueError(f"budget must be any, covering or large, not {budget!r}")
    if pool not in ("any", "fits", "tight", "ample"):
        raise ValueError(f"pool must be any, fits, tight or ample, not {pool!r}")
    if prompts not in ("length", "shared", "mixed"):
        raise ValueError(f"prompts must be length, shared or mixed, not {prompts!r}")
    if min_new is not None and not (0 if admission else 1) <= min_new <= max_new:
        raise ValueError(f"min_new must lie in [{0 if admission else 1}, max_new], not {min_new!r}")
    if scripts not in (True, False, "rollback"):
        raise ValueError(f"scripts must be True, False or 'rollback', not {scripts!r}")
    if output_caching not in (True, False, "any"):
        raise ValueError(f"output_caching must be True, False or 'any', not {output_caching!r}")
    if arrivals not in ("any", "list_order"):
        raise ValueError(f"arrivals must be any or list_order, not {arrivals!r}")
    if admission and budget == "covering":
        raise ValueError("a covering budget is measured on m01, which cannot build an admission workload")
    n = draw(st.integers(min_requests, max_requests))
    # A rollback script needs guesses to judge: spec_len at least 1 (issue 31: the loader refuses a script
    # with spec_len 0 from m09 on).
    k = draw(
        st.integers(
            max(spec_len[0], 1) if scripts == "rollback" else spec_len[0],
            max(spec_len[1], 1) if scripts == "rollback" else spec_len[1],
        )
    )
    low = -2 if negatives else 0
    requests: list[dict[str, Any]] = []
    for i, prompt in enumerate(draw(_prompts(n, prompts, max_prompt))):
        if admission and draw(st.integers(0, 7)) == 0:
            prompt = {"tokens": []}  # EMPTY_PROMPT
        req: dict[str, Any] = {
            "request_id": f"r{i}",
            **prompt,
            "max_new_tokens": draw(st.integers((0 if admission else 1) if min_new is None else min_new, max_new)),
        }
        if draw(st.booleans()):
            req["arrival_step"] = draw(st.integers(low, max_arrival))
        if eos and draw(st.integers(0, 2)) == 0:
            req["eos_after"] = draw(st.integers(low, max_new + 1))
        # An accept_script needs guesses to judge: with spec_len 0 the loader refuses it from m09 on (issue 31).
        if k == 0:
            pass
        elif scripts == "rollback":
            req["accept_script"] = draw(st.lists(st.integers(-1, max(0, k - 1)), min_size=1, max_size=8))
        elif scripts and draw(st.booleans()):
            req["accept_script"] = draw(st.lists(st.integers(-2, k + 2), max_size=6))
        if admission and prompt_len(req) and draw(st.booleans()):
            # Mostly ids the request will sample (so it stops early, maybe inside an accepted run).
            chain = scripted_ids(_prompt_of(req, i), max(1, int(req["max_new_tokens"])))
            stops = st.sampled_from(chain) | st.integers(1, 2**31 - 1)
            req["stop_token_ids"] = draw(st.lists(stops, min_size=1, max_size=2))
        if draft_limits and k and draw(st.booleans()):  # m16: limits from 0 to above spec_len
            req["draft_limit_script"] = draw(st.lists(st.integers(0, k + 1), min_size=1, max_size=6))
        requests.append(req)
    if arrivals == "list_order":
        # m12 (D9): FCFS admits by arrival step, a negative one counting as 0; sorted, it is list order.
        steps = sorted((r.get("arrival_step") for r in requests), key=lambda a: max(0, a or 0))
        for i, step in enumerate(steps):
            req = {k: v for k, v in requests[i].items() if k != "arrival_step"}
            at = list(req).index("max_new_tokens") + 1  # where the key is drawn: after max_new_tokens
            items = list(req.items())
            requests[i] = dict(items[:at] + ([("arrival_step", step)] if step is not None else []) + items[at:])
    ps = draw(st.integers(*page_size))
    workload: dict[str, Any] = {"engine": {"page_size": ps, "spec_len": k}, "requests": requests}
    alone = [alone_pages(r, ps) for r in requests]
    biggest, total = max([1, *alone]), max(1, sum(alone))
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
    if admission:
        longest = max((prompt_len(r) + int(r["max_new_tokens"]) for r in requests), default=1)
        limits = {
            "max_waiting": st.integers(1, max(1, n)),
            "max_running": st.integers(1, 3),
            "max_model_len": st.integers(max(1, longest - 3), max(1, longest)),
        }
        for key, values in limits.items():
            if draw(st.booleans()):
                workload["engine"][key] = draw(values)
    if output_caching == "any":
        workload["engine"]["output_caching"] = draw(st.booleans())
    elif output_caching:
        workload["engine"]["output_caching"] = True
    engine = {key: workload["engine"][key] for key in ENGINE_KEYS if key in workload["engine"]}
    return {"engine": engine, "requests": requests}


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
    # N21: every request passes the door (each fits the pool on its own; no limit, no stop id, no
    # empty prompt, no zero-token request) and none arrives before one listed ahead of it (D9: m12
    # admits and walks in arrival order, m11 in list order): m12's trace is m11's plus empty
    # rejected/aborted.
    "m12_admission_control": {"pool": "fits", "admission": False, "arrivals": "list_order"},
    # N1 of m13: with output caching off, m13 is m12 field for field (the door's workloads included).
    "m13_output_caching": {"output_caching": False},
    # N1 of m14: no request has a forced_script, so no outcome forces an id: m14 is m13, either switch.
    "m14_forced_runs": {"output_caching": "any"},
    # m15's engine is m14's: its records add KV events, which are no JSON field (N11); the fleet is
    # checked against m14 fed at arrival by tests/property/test_m15_properties.py (N1).
    "m15_routing": {"output_caching": "any", "prompts": "mixed"},
    # N1 of m16: no request has a draft_limit_script (draft_limits off) and nothing calls limit_drafts,
    # so every window is m15's.
    "m16_request_draft_lengths": {"output_caching": "any", "prompts": "mixed", "spec_len": (0, 3), "scripts": True},
}
"""Per rung, the knobs under which its mechanism is idle, so its trace equals the rung below's."""


def mechanism_idle(rung: str, **knobs: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Workloads on which rung ``rung`` (a ``RUNGS`` name) adds nothing observable to the rung below.

    Extra ``knobs`` go to ``workloads()``; they must not switch the mechanism back on.
    """
    return workloads(**{**IDLE_KNOBS[rung], **knobs})


# ---- building an engine ----------------------------------------------------------------------------------


def has_admission(workload: Mapping[str, Any]) -> bool:
    """True when the workload uses something only m12 takes: a limit, 0 tokens, an empty prompt, stop ids."""
    return any(key in engine_of(workload) for key in ENGINE_OPTIONAL) or any(
        int(spec["max_new_tokens"]) <= 0 or not prompt_len(spec) or spec.get("stop_token_ids")
        for spec in workload.get("requests") or []
    )


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
    for key in ("arrival_step", "eos_after", "accept_script", "stop_token_ids"):
        if spec.get(key) is not None and key in takes:
            value = spec[key]
            kwargs[key] = list(value) if key == "accept_script" else tuple(value) if key == "stop_token_ids" else value
    if spec.get("forced_script") and "forced_script" in takes:  # m14: JSON keys are decimal strings
        kwargs["forced_script"] = {int(i): tuple(ids) for i, ids in spec["forced_script"].items()}
    if spec.get("draft_limit_script") and "draft_limit_script" in takes:  # m16
        kwargs["draft_limit_script"] = list(spec["draft_limit_script"])
    return rung.Request(**kwargs)


def build(rung: ModuleType, workload: Mapping[str, Any], *, validate: bool = True) -> Any:
    """``rung.Engine`` over fresh requests built from ``workload``, given only what the rung takes.

    With ``validate`` (the default) this is the CLI's own path: ``mechserve.workload`` validates the
    spec (D4, ``WorkloadError``), drops what the rung lacks (``fit_rung``: ``spec_len``, accept scripts,
    ``world_size``, m12's limits and stop ids) and builds it (``build_engine``).  ``validate=False``
    builds directly, so values the engines accept but D4 rejects (negative ``arrival_step``/``eos_after``)
    reach the engine too; it drops the same things by what the rung's ``Engine`` and ``Request`` take.
    Either way m12's ``max_waiting``/``max_running``/``max_model_len`` and ``stop_token_ids`` reach m12
    only, and 0 tokens or an empty prompt make a lower rung raise (``WorkloadError``, a ``ValueError``,
    or the engine's own ``ValueError``).  Lists are copied: the workload is never consumed and can be
    built again; m00–m07 get ``prompt_len`` (the length of ``tokens`` when given) and m08+ ``tokens``
    (synthetic when absent).
    """
    if validate:
        fitted, _ = fit_rung(rung, parse_workload(json.loads(json.dumps(workload))))
        return build_engine(rung, fitted)
    engine = engine_of(workload)
    takes = inspect.signature(rung.Engine).parameters
    requests = [_request(rung, i, spec) for i, spec in enumerate(workload.get("requests") or [])]
    return rung.Engine(requests, **{k: engine[k] for k in ENGINE_KEYS if k in engine and k in takes})
