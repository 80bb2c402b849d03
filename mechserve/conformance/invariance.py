"""Check 4, mechanism invariance: greedy output does not depend on how the engine schedules it.

The reference for each request is its prompt continued *alone* by the target's ``greedy`` (for the
torch targets: transformers' ``generate``, batch 1), cut after the first stop or EOS id (STOP or EOS;
LENGTH after ``max_new_tokens`` ids otherwise).  The workload then runs on m13 over the target's
executors under each ``VARIANTS`` entry, one knob changed at a time, and every request must finish
with exactly the reference ids and finish reason::

    as drawn                 the workload's own engine section
    budget 1 / budget large  max_step_tokens 1 (every prefill chunked to single tokens) / covering all
    page size 1 / 16         pages of 1 or 16 positions (pool re-sized to hold everyone)
    pool tight / ample       the largest request alone (preemption, eviction, recompute) / everyone at once
    prefix caching off       no reuse, no publishing
    output caching on / off  generated blocks published and reused too (m13), or prompt blocks only
    next turns               output caching on, and after everyone, a next turn per request: its prompt,
                             its reference answer but the last id, and its prompt's first ids again,
                             so the answer's published blocks are reused (and the pool re-sized to fit)
    spec_len 0 / 3           no speculation / up to 3 guesses per decode window (rollback)
    world size 1 / 2         one rank / two ranks (each its own executor over shared weights; they must agree)
    reversed order           the request list reversed (priority among requests arriving together, and
                             with it anchor and victims, change: m12+ serve first come, first served, D9)
    staggered / together     request i arrives at step i / everyone at step 0
    one at a time            max_running 1: each request alone in the engine (the batch mix changes)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mechserve.conformance.errors import InvarianceMismatch
from mechserve.conformance.runner import EVENTS, engine_settings, events, run_workload
from mechserve.conformance.strategies import alone_pages, door_verdicts, prompt_len

_Edit = Callable[[dict[str, Any], list[dict[str, Any]], Any], None]
"""An edit of the engine section and the request list, given the target (only "next turns" reads it)."""


def _pool(requests: list[dict[str, Any]], page_size: int, kind: str) -> int:
    alone = [alone_pages(r, page_size) for r in requests]
    return max(1, max(alone, default=1)) if kind == "tight" else max(1, sum(alone))


def _page_size(ps: int) -> _Edit:
    def edit(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
        eng["page_size"] = ps
        eng["num_pages"] = _pool(reqs, ps, "ample")

    return edit


def _set(key: str, value: Any) -> _Edit:
    def edit(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
        eng[key] = value

    return edit


def _arrivals(stagger: bool) -> _Edit:
    def edit(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
        for i, r in enumerate(reqs):
            r["arrival_step"] = i if stagger else 0

    return edit


def _reverse(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
    reqs.reverse()


def _budget_large(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
    eng["max_step_tokens"] = sum(prompt_len(r) for r in reqs) + len(reqs) * (1 + max(3, eng["spec_len"]))


def _pool_kind(kind: str) -> _Edit:
    def edit(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
        eng["num_pages"] = _pool(reqs, eng["page_size"], kind)

    return edit


def _next_turns(eng: dict[str, Any], reqs: list[dict[str, Any]], target: Any) -> None:
    """Output caching on; after every request of the workload a next turn ``<id>+`` per request that wants
    two tokens or more, arriving once the first turns can all have ended (each step advances the anchor):
    its prompt, its reference answer less the last id (the last id's KV is never computed), then the
    prompt's first ids again as the new message."""
    if target is None:
        raise ValueError('variant "next turns" needs the target (its reference answers)')
    eng["output_caching"] = True
    later = max((int(r.get("arrival_step") or 0) for r in reqs), default=0)
    later += 2 * sum(prompt_len(r) + int(r["max_new_tokens"]) for r in reqs) + 1
    turns = []
    for r in reqs:
        n = int(r["max_new_tokens"])
        if n < 2 or not r["tokens"]:
            continue
        answer, _ = expected(target, r)
        message = list(r["tokens"][:3])
        turns.append(
            {
                "request_id": f"{r['request_id']}+",
                "tokens": [*r["tokens"], *answer[:-1], *message],
                "max_new_tokens": min(n, 4),
                "arrival_step": later,
            }
        )
    reqs += turns
    eng["num_pages"] = max(int(eng["num_pages"]), max((alone_pages(r, eng["page_size"]) for r in reqs), default=1))


VARIANTS: dict[str, _Edit] = {
    "as drawn": lambda eng, reqs, target: None,
    "budget 1": _set("max_step_tokens", 1),
    "budget large": _budget_large,
    "page size 1": _page_size(1),
    "page size 16": _page_size(16),
    "pool tight": _pool_kind("tight"),
    "pool ample": _pool_kind("ample"),
    "prefix caching off": _set("prefix_caching", False),
    "output caching on": _set("output_caching", True),
    "output caching off": _set("output_caching", False),
    "next turns": _next_turns,
    "spec_len 0": _set("spec_len", 0),
    "spec_len 3": _set("spec_len", 3),
    "world size 1": _set("world_size", 1),
    "world size 2": _set("world_size", 2),
    "reversed order": _reverse,
    "staggered arrivals": _arrivals(True),
    "arrivals together": _arrivals(False),
    "one at a time": _set("max_running", 1),
}
"""Each variant changes one knob of a workload (module docstring)."""


def variant(workload: Mapping[str, Any], name: str, target: Any = None) -> dict[str, Any]:
    """A copy of ``workload`` under variant ``name`` (a ``VARIANTS`` key; ``KeyError`` otherwise).

    ``target`` gives "next turns" its reference answers (``ValueError`` without it).
    """
    edit = VARIANTS[name]
    out = copy.deepcopy(dict(workload))
    eng = {**engine_settings(out), **{k: v for k, v in (out.get("engine") or {}).items() if v is not None}}
    reqs = out["requests"] = list(out.get("requests") or [])
    edit(eng, reqs, target)
    out["engine"] = eng
    return out


def expected(target: Any, spec: Mapping[str, Any]) -> tuple[list[int], str]:
    """The reference ids and finish reason of one request that passes the door.

    Rule S of m12 applied to the reference ids: the id number ``eos_after`` (m12's scripted EOS
    trigger, when given) ends it with EOS, else the first stop id with STOP, else the first EOS id
    with EOS, else ``max_new_tokens`` ids with LENGTH; an ending id is part of the output.
    """
    n = int(spec["max_new_tokens"])
    ref = target.reference(spec["tokens"], n) if n > 0 else []
    stops = set(spec.get("stop_token_ids") or ())
    eos_after = spec.get("eos_after")
    for j, t in enumerate(ref[:n]):
        if eos_after is not None and j >= eos_after:
            return ref[: j + 1], "EOS"
        if t in stops:
            return ref[: j + 1], "STOP"
        if t in target.eos_token_ids:
            return ref[: j + 1], "EOS"
    return ref[:n], "LENGTH"


def with_stops(target: Any, workload: Mapping[str, Any], stop_at: Mapping[str, int]) -> dict[str, Any]:
    """A copy of ``workload`` where request ``rid`` stops at its reference's id number ``stop_at[rid]``.

    The stop id is the id the reference produces there, so the request ends early with STOP (at
    that index or at an earlier occurrence of the same id), also inside an accepted speculative run.
    """
    out = copy.deepcopy(dict(workload))
    for spec in out.get("requests") or []:
        j = stop_at.get(str(spec["request_id"]))
        if j is None or int(spec["max_new_tokens"]) <= j:
            continue
        ref = target.reference(spec["tokens"], int(spec["max_new_tokens"]))
        if j < len(ref):
            spec["stop_token_ids"] = [ref[j]]
    return out


def check_invariance(target: Any, workload: Mapping[str, Any], variants: Sequence[str] | None = None) -> dict[str, Any]:
    """Check 4 on one workload: every request's greedy output under every variant equals the reference.

    ``variants``: ``VARIANTS`` names (default all).  A request the variant's door must refuse
    (``strategies.door_verdicts``: a pool it never fits, ``max_model_len``, ...) must be rejected for
    that reason; every other one must finish with its reference (``expected``).  Raises
    ``InvarianceMismatch`` at the first request that differs; returns ``{"runs": …, "steps": …, "events": …}``.
    """
    runs = steps = 0
    seen = dict.fromkeys(EVENTS, 0)
    for name in variants or list(VARIANTS):
        changed = variant(workload, name, target)
        door = door_verdicts(changed)
        run = run_workload(target, changed)
        runs += 1
        steps += len(run.records)
        for key, value in events(run.records).items():
            seen[key] += value
        for r, spec, verdict in zip(run.engine.requests, changed["requests"], door):
            ids, reason = ([], f"REJECTED {verdict}") if verdict else expected(target, spec)
            got = list(r.output_ids)
            got_reason = r.finish_reason.value if r.finish_reason else r.state.value
            if r.reject_reason is not None:
                got_reason = f"REJECTED {r.reject_reason.value}"
            if got != ids or got_reason != reason:
                j = next((i for i, (x, y) in enumerate(zip(got, ids)) if x != y), min(len(got), len(ids)))
                raise InvarianceMismatch(
                    f"invariance: {name}: {r.request_id} generated {got} ({got_reason}) but alone the reference "
                    f"generates {ids} ({reason}); first difference at output index {j}"
                )
    return {"runs": runs, "steps": steps, "events": seen}
