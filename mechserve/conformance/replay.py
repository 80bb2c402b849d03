"""Check 1, trace replay: the real run's trace is the trace the spec gives for the same verdicts.

A real run (m14 over real executors, ``runner.run_workload``) is recorded as step records: every
verdict it applied (``accepted``, per decode window) and every id it appended (``tokens``, per
sampling request).  The replay builds a fresh m14 engine over the same workload whose rank executors
are ``ReplayExecutor``s: m14's own scripted ``LocalExecutor`` with

* the accept scripts set to each request's recorded ``accepted`` counts, in order (rule N5 consumes
  one per decode window and clamps it to ``[0, drafted]``, exactly as for a scripted request), and
* the token ids of each sampling item taken from the recording, in order, instead of
  ``scripted_token``: the ids are the model's, and no script can know them.  The EOS trigger
  (``eos_after``) needs no help: it is the control side's rule S, applied by the engine to whatever
  ids arrive.

The recording is consumed per request, in order, not per step: the replay must not be told when
a request runs, or it could not find out that the real engine scheduled it differently.  Nothing
else is shared: the replay schedules, pages, caches, rolls back and samples by itself.  The
two runs must then agree on every field of every step record (``to_json``: the thirteen contract
fields, ``tokens``, ``rejected``, ``aborted``), on every plan the engine sent (request, positions,
placements, known ids, page tables), and on the end state of every request.  The first difference is
reported as ``first difference: step K, field F: real=… replay=…`` (``ReplayMismatch``).

The recorded counts are the ones the control side kept (after the EOS clamp and the stop-id cut);
replaying them gives the same kept counts, since the clamp and the cut are idempotent.  Standard
library only.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mechserve.conformance.errors import ConformanceError, ReplayMismatch
from mechserve.conformance.runner import (
    Exchange,
    Recorder,
    build_engine,
    end_state,
    engine_settings,
    events,
    run_workload,
)
from mechserve.spec import m16_request_draft_lengths as m16


class ReplayExecutor(m16.LocalExecutor):
    """m14's scripted executor answering from a recorded run (see the module docstring).

    ``records``: the real run's step records.  Raises ``ConformanceError`` from ``execute`` when
    the replay asks a request for more sampled ids than the real run produced.
    """

    def __init__(self, records: Sequence[m16.StepRecord]) -> None:
        scripts: dict[str, list[int]] = {}
        ids: dict[str, deque[tuple[int, ...]]] = {}
        for rec in records:
            for rid, a in rec.accepted.items():
                scripts.setdefault(rid, []).append(int(a))
            for rid, t in rec.tokens.items():
                ids.setdefault(rid, deque()).append(tuple(t))
        super().__init__(scripts, {})
        self.ids = ids

    def _run(self, item: m16.PlanItem) -> m16.Outcome:
        out = super()._run(item)
        if not item.sample:
            return out
        stream = self.ids.get(item.request_id)
        if not stream:
            raise ConformanceError(
                f"{item.request_id} samples at position {item.start_position + item.num_tokens - 1} "
                "but the real run recorded no more ids for it"
            )
        ids = stream.popleft()
        # m14: ids past the window's accepted + 1 were forced after its sample (N13)
        kept = out.accepted_draft_tokens + 1
        return dataclasses.replace(out, token_ids=ids[:kept], forced=ids[kept:])


@dataclasses.dataclass
class Replay:
    """The replay run: its engine, records, exchanges and the error that stopped it (None if none)."""

    engine: Any
    records: list[m16.StepRecord]
    exchanges: list[Exchange]
    error: Exception | None = None


def replay(
    workload: Mapping[str, Any], records: Sequence[m16.StepRecord], *, eos_token_ids: Sequence[int] = ()
) -> Replay:
    """Run ``workload`` on m14 over ``ReplayExecutor``s (one per rank) fed ``records``.

    Stops after ``len(records) + 1`` steps at most; an exception from the engine or the executors
    ends the replay and is kept in ``error``.  A request a record lists as ``aborted`` is aborted just
    before that step, as the real caller did (``abort`` between steps).
    """
    ranks = [ReplayExecutor(records) for _ in range(engine_settings(workload)["world_size"])]
    engine = build_engine(workload, ranks, eos_token_ids=eos_token_ids)
    recorder = Recorder(engine.executor, engine)
    engine.executor = recorder
    out = Replay(engine, [], recorder.exchanges)

    def abort_before(k: int) -> None:
        for rid in records[k].aborted if k < len(records) else ():
            engine.abort(rid)

    def on_step(record: m16.StepRecord) -> None:
        out.records.append(record)
        if len(out.records) > len(records):
            raise _Overrun
        abort_before(len(out.records))

    try:
        abort_before(0)
        engine.run(on_step)
    except _Overrun:
        pass
    except Exception as exc:  # the replay could not follow the recording: reported as a difference
        out.error = exc
    return out


class _Overrun(Exception):
    """The replay has more steps than the recording: stop, the comparison reports it."""


def _norm(value: Any) -> Any:
    """Dicts as ordered item lists, so that two records differing only in insertion order differ."""
    if isinstance(value, dict):
        return [[k, _norm(v)] for k, v in value.items()]
    if isinstance(value, list | tuple):
        return [_norm(v) for v in value]
    return value


def compare(
    real_records: Sequence[m16.StepRecord],
    replayed: Replay,
    *,
    real_exchanges: Sequence[Exchange] | None = None,
    real_end: list[dict[str, Any]] | None = None,
) -> None:
    """Raise ``ReplayMismatch`` at the first difference between a real run and its replay.

    Per step, in order: every ``to_json`` field of the record, then (when ``real_exchanges`` is given)
    the plan, item by item and field by field; then a replay error at that step; after the last step,
    the end state of every request (when ``real_end`` is given).
    """
    real_plans = {ex.step: ex.plan for ex in real_exchanges or ()}
    replay_plans = {ex.step: ex.plan for ex in replayed.exchanges}
    for k in range(max(len(real_records), len(replayed.records))):
        if k >= len(replayed.records):
            error = replayed.error
            detail = f"{type(error).__name__}: {error}" if error is not None else "(no record: the replay had ended)"
            raise ReplayMismatch(k, "record", real_records[k].to_json(), detail)
        if k >= len(real_records):
            raise ReplayMismatch(k, "record", "(no record: the real run had ended)", replayed.records[k].to_json())
        a, b = real_records[k].to_json(), replayed.records[k].to_json()
        for name in dict.fromkeys([*a, *b]):
            if _norm(a.get(name)) != _norm(b.get(name)):
                raise ReplayMismatch(k, name, a.get(name), b.get(name))
        if real_exchanges is not None:
            _compare_plans(k, real_plans.get(k, ()), replay_plans.get(k, ()))
    if replayed.error is not None:
        raise ReplayMismatch(
            len(replayed.records), "executor", "(continued)", f"{type(replayed.error).__name__}: {replayed.error}"
        )
    if real_end is not None:
        mine = end_state(replayed.engine)
        for i, (x, y) in enumerate(zip(real_end, mine)):
            for name in x:
                if x[name] != y.get(name):
                    raise ReplayMismatch(None, f"requests[{i}].{name} ({x['request_id']})", x[name], y.get(name))


def _compare_plans(step: int, real: Sequence[m16.PlanItem], mine: Sequence[m16.PlanItem]) -> None:
    if len(real) != len(mine):
        raise ReplayMismatch(step, "plan (items)", [i.request_id for i in real], [i.request_id for i in mine])
    for i, (x, y) in enumerate(zip(real, mine)):
        for f in dataclasses.fields(m16.PlanItem):
            if getattr(x, f.name) != getattr(y, f.name):
                raise ReplayMismatch(
                    step, f"plan[{i}].{f.name} ({x.request_id})", getattr(x, f.name), getattr(y, f.name)
                )


def check_replay(
    target: Any, workload: Mapping[str, Any], *, engine_factory: Callable[..., Any] = m16.Engine
) -> dict[str, Any]:
    """Check 1 on one workload: run it on ``engine_factory`` (the "real engine", default m16) over the
    target's executors, replay the verdicts and ids on m16, and compare (``ReplayMismatch``).

    Returns ``{"runs": 2, "steps": <steps compared>, "events": <what the real run exercised>}``.
    """
    real = run_workload(target, workload, engine_factory=engine_factory)
    replayed = replay(workload, real.records, eos_token_ids=target.eos_token_ids)
    compare(real.records, replayed, real_exchanges=real.exchanges, real_end=end_state(real.engine))
    return {"runs": 2, "steps": len(real.records), "events": events(real.records)}
