"""Run a workload on the top rung (m14) over a target's rank executors, and record the boundary traffic.

This is the "real run" every check starts from::

    workload ──> m16.Engine(requests, executors=[wrap(rank, target.make_executor(P, S)) for each rank],
                            eos_token_ids=target.eos_token_ids, **engine section)
                 engine.executor (the rank group) is wrapped by a Recorder: (step, plan, joined outcomes)
    after each step: on_step(run, record); finished/aborted ids are released on every executor

A rank executor that has ``add_request(request)`` is told every accepted request's record before the
run (an ``ExecutorRequest`` with its prompt and greedy params, so a drafter sees prompts it never
computed after a prefix-cache hit), and one with ``release(request_id)`` is told when a request has
finished or was aborted.  Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mechserve.conformance.errors import ConformanceError
from mechserve.conformance.strategies import engine_of, prompt_len
from mechserve.executor.request import ExecutorRequest
from mechserve.spec import m16_request_draft_lengths as m16
from mechserve.workload import ENGINE_KEYS


@dataclass(frozen=True)
class Exchange:
    """One step's traffic across the boundary: the engine's plan and the outcomes the rank group joined."""

    step: int
    plan: tuple[m16.PlanItem, ...]
    outcomes: tuple[m16.Outcome, ...]


class Recorder:
    """Stands in for the engine's executor (the rank group) and records each step's ``Exchange``."""

    def __init__(self, inner: Any, engine: Any) -> None:
        self.inner = inner
        self.engine = engine
        self.exchanges: list[Exchange] = []

    def execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        outcomes = tuple(self.inner.execute(plan))
        self.exchanges.append(Exchange(self.engine.step_counter, plan, outcomes))
        return outcomes


@dataclass
class RealRun:
    """A run of ``workload`` on m14: the engine, the target's executors (``executors``, one per rank, as
    made) and what the engine was given (``ranks``, possibly wrapped), the step records and exchanges."""

    workload: dict[str, Any]
    engine: Any
    executors: list[Any]
    ranks: list[Any]
    records: list[m16.StepRecord] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)


def engine_settings(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The m14 ``Engine`` keyword arguments of the workload's engine section (4.2 defaults filled in).

    Besides the 4.2 keys the section may carry ``prefix_caching`` (a bool, default true),
    ``hold_shared_prefix`` (a bool, default false as in m12; the product path turns it on) and
    ``output_caching`` (a bool, default false as in m14; the product path turns it on).
    """
    eng = engine_of({"engine": {k: v for k, v in (workload.get("engine") or {}).items() if k in ENGINE_KEYS}})
    settings: dict[str, Any] = {k: eng[k] for k in ENGINE_KEYS if k in eng}
    raw = workload.get("engine") or {}
    for key in ("prefix_caching", "hold_shared_prefix", "output_caching"):
        if raw.get(key) is not None:
            settings[key] = bool(raw[key])
    return settings


def make_requests(workload: Mapping[str, Any]) -> list[m16.Request]:
    """Fresh m14 requests for the workload's request list (explicit ``tokens`` required)."""
    out = []
    for spec in workload.get("requests") or []:
        out.append(
            m16.Request(
                str(spec["request_id"]),
                list(spec["tokens"]),
                int(spec["max_new_tokens"]),
                arrival_step=int(spec.get("arrival_step") or 0),
                eos_after=spec.get("eos_after"),
                stop_token_ids=tuple(spec.get("stop_token_ids") or ()),
            )
        )
    return out


def build_engine(
    workload: Mapping[str, Any],
    ranks: Sequence[Any],
    *,
    eos_token_ids: Sequence[int] = (),
    engine_factory: Callable[..., Any] = m16.Engine,
) -> Any:
    """``engine_factory`` (default ``m16.Engine``) over the workload, with ``ranks`` as its rank executors.

    Raises ``ValueError`` as m14's constructor does (e.g. a number of ranks other than ``world_size``).
    """
    return engine_factory(
        make_requests(workload), executors=list(ranks), eos_token_ids=tuple(eos_token_ids), **engine_settings(workload)
    )


def step_bound(workload: Mapping[str, Any]) -> int:
    """A generous bound on the steps of any run of the workload (the anchor advances every step)."""
    reqs = workload.get("requests") or []
    last = max((max(0, int(r.get("arrival_step") or 0)) for r in reqs), default=0)
    return 2 * (last + sum(prompt_len(r) + max(0, int(r["max_new_tokens"])) for r in reqs)) + 10


def run_workload(
    target: Any,
    workload: Mapping[str, Any],
    *,
    wrap: Callable[[int, Any], Any] | None = None,
    on_step: Callable[[RealRun, m16.StepRecord], None] | None = None,
    engine_factory: Callable[..., Any] = m16.Engine,
) -> RealRun:
    """Run ``workload`` to the end on ``engine_factory`` over ``target``'s executors; return the run.

    ``wrap(rank, executor)`` may wrap each rank's executor (a checker); ``on_step(run, record)`` runs
    after every step.  Whatever the engine, an executor, a wrapper or ``on_step`` raises propagates
    (``BoundaryViolation``, ``GroupViolation``, a ``ConformanceError``); a run still going after
    ``step_bound`` steps raises ``ConformanceError``.
    """
    settings = engine_settings(workload)
    executors = [
        target.make_executor(settings["num_pages"], settings["page_size"]) for _ in range(settings["world_size"])
    ]
    ranks = [wrap(rank, ex) if wrap is not None else ex for rank, ex in enumerate(executors)]
    engine = build_engine(workload, ranks, eos_token_ids=target.eos_token_ids, engine_factory=engine_factory)
    for r in engine.requests:
        if r.reject_reason is None:
            for ex in executors:
                add = getattr(ex, "add_request", None)
                if add is not None:
                    add(ExecutorRequest(r.request_id, tuple(r.tokens)))
    recorder = Recorder(engine.executor, engine)
    engine.executor = recorder
    run = RealRun(dict(workload), engine, executors, ranks, exchanges=recorder.exchanges)
    bound = step_bound(workload)

    def step_done(record: m16.StepRecord) -> None:
        run.records.append(record)
        for rid in (*record.finished, *record.aborted):
            for ex in executors:
                release = getattr(ex, "release", None)
                if release is not None:
                    release(rid)
        if on_step is not None:
            on_step(run, record)
        if len(run.records) > bound:
            raise ConformanceError(f"still running after {bound} steps")

    engine.run(step_done)
    return run


EVENTS = ("preempted", "rolled_back", "reused", "evicted", "rejected", "stopped", "eos")
"""The trace events ``events`` counts: what a run exercised."""


def events(records: Sequence[m16.StepRecord]) -> dict[str, int]:
    """How often a run's trace shows each of ``EVENTS``: preemptions, decode windows with a rollback,
    prefix reuses, evicted pages, rejections, requests that finished with STOP and with EOS."""
    out = dict.fromkeys(EVENTS, 0)
    for rec in records:
        out["preempted"] += len(rec.preempted)
        out["rolled_back"] += sum(1 for v in rec.rolled_back.values() if v)
        out["reused"] += len(rec.reused)
        out["evicted"] += len(rec.evicted)
        out["rejected"] += len(rec.rejected)
        out["stopped"] += sum(1 for v in rec.finished.values() if v is m16.FinishReason.STOP)
        out["eos"] += sum(1 for v in rec.finished.values() if v is m16.FinishReason.EOS)
    return out


def end_state(engine: Any) -> list[dict[str, Any]]:
    """Per request, list order: m14's ``summary()`` entry plus ``output_ids`` and ``reject_reason``."""
    return [
        {**entry, "output_ids": list(r.output_ids), "reject_reason": r.reject_reason.value if r.reject_reason else None}
        for entry, r in zip(engine.summary(), engine.requests)
    ]
