"""m01 — Continuous batching.

Key question: which requests take part in this tick, when the answer is
rebuilt from request states every time?

m00 ran each request to the end of what it owed, one after another.  m01 forms
the *batch* first: a work list of ``(request, tokens)`` pairs rebuilt from
request states in every step, then executes the whole batch, then samples it::

    admit ──> schedule ──> execute(batch) ──> sample(batch)
                 │
                 └─ work = [(r, r.remaining) for every RUNNING r, list order]

Nothing about the batch survives a step: a request that arrives joins the next
batch, one that finishes simply is not in it.  Observable behaviour is
identical to m00 for every input; the rung changes structure, not output.
The rules are in ``mech-notes/01-continuous-batching.md``.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

TITLE = "Continuous batching"
KEY_QUESTION = "Which requests take part in this tick, when the answer is rebuilt from request states every time?"
NOTE = "01-continuous-batching.md"


class RequestState(Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"


class FinishReason(Enum):
    LENGTH = "LENGTH"
    EOS = "EOS"


class Sample(Enum):
    """What one sample produced: a real token, or the end-of-sequence marker."""

    TOKEN = "TOKEN"
    EOS = "EOS"


@dataclass
class Request:
    """One generation request.

    ``prompt_len`` and ``max_new_tokens`` are token counts.  ``eos_after`` is
    the fake model's EOS trigger: once ``generated >= eos_after`` the next
    sample is EOS.  ``computed`` counts leading positions whose state exists.
    """

    request_id: str
    prompt_len: int
    max_new_tokens: int
    arrival_step: int = 0
    eos_after: int | None = None
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    generated: int = 0
    computed: int = 0

    @property
    def target(self) -> int:
        """Positions that should be computed: the prompt plus every sampled token."""
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        """Positions still owed (tokens)."""
        return self.target - self.computed


def _frozen(d: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class StepRecord:
    """What one step decided.  Dict fields keep the insertion order of the step.

    ``explain`` holds one plain sentence per decision; it is not a trace field.
    """

    step: int
    admitted: tuple[str, ...] = ()
    scheduled: tuple[str, ...] = ()
    executed: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    sampled: Mapping[str, Sample] = field(default_factory=lambda: _frozen({}))
    finished: Mapping[str, FinishReason] = field(default_factory=lambda: _frozen({}))
    explain: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict, trace fields in contract order."""
        return {
            "step": self.step,
            "admitted": list(self.admitted),
            "scheduled": list(self.scheduled),
            "executed": dict(self.executed),
            "sampled": {k: v.value for k, v in self.sampled.items()},
            "finished": {k: v.value for k, v in self.finished.items()},
        }


class Engine:
    """The complete engine as of m01.

    Raises ``ValueError`` if a request has ``prompt_len <= 0`` or
    ``max_new_tokens <= 0``.
    """

    def __init__(self, requests: Sequence[Request]) -> None:
        for r in requests:
            if r.prompt_len <= 0:
                raise ValueError(f"request {r.request_id!r}: prompt_len must be > 0")
            if r.max_new_tokens <= 0:
                raise ValueError(f"request {r.request_id!r}: max_new_tokens must be > 0")
        self.requests = list(requests)
        # Queues in list order: a step costs what is running or due, not every request ever seen.
        self._position = {id(r): i for i, r in enumerate(self.requests)}
        self.waiting: list[tuple[int, int, Request]] = [(r.arrival_step, i, r) for i, r in enumerate(self.requests)]
        heapq.heapify(self.waiting)
        self.running: list[Request] = []
        self.step_counter = 0
        self._why: list[str] = []

    def step(self) -> StepRecord:
        """Run one tick and return its record; the counter advances afterwards."""
        self._why = []
        admitted = self._admit()
        work = self._schedule()
        executed = self._execute(work)
        sampled: dict[str, Sample] = {}
        finished: dict[str, FinishReason] = {}
        for r, _ in work:
            self._sample(r, sampled, finished)
        record = StepRecord(
            step=self.step_counter,
            admitted=tuple(admitted),
            scheduled=tuple(r.request_id for r, _ in work),
            executed=_frozen(executed),
            sampled=_frozen(sampled),
            finished=_frozen(finished),
            explain=tuple(self._why),
        )
        self.step_counter += 1
        return record

    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        """Step until every request is FINISHED; return all records.

        ``on_step`` (optional) sees each record as soon as it exists, so a
        caller can show the steps that led to an error."""
        records = []
        while self.waiting or self.running:
            record = self.step()
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    def _admit(self) -> list[str]:
        arrived = []
        while self.waiting and self.waiting[0][0] <= self.step_counter:
            arrived.append(heapq.heappop(self.waiting)[2])
        arrived.sort(key=self._list_position)
        for r in arrived:
            r.state = RequestState.RUNNING
            bisect.insort(self.running, r, key=self._list_position)
            self._why.append(f"{r.request_id} arrived (arrival_step {r.arrival_step}) and was admitted.")
        return [r.request_id for r in arrived]

    def _list_position(self, r: Request) -> int:
        return self._position[id(r)]

    def _schedule(self) -> list[tuple[Request, int]]:
        # m01: the batch is a temporary of the step, rebuilt from request states.
        return [(r, r.remaining) for r in self.running]

    def _execute(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        executed = {}
        for r, n in work:
            r.computed += n
            executed[r.request_id] = n
            self._why.append(f"{r.request_id} computed all {n} token(s) it owed.")
        return executed

    def _sample(self, r: Request, sampled: dict[str, Sample], finished: dict[str, FinishReason]) -> None:
        """Rule S: EOS once ``generated >= eos_after``, else a TOKEN; LENGTH at the cap."""
        if r.eos_after is not None and r.generated >= r.eos_after:
            sampled[r.request_id] = Sample.EOS
            r.finish_reason = FinishReason.EOS
        else:
            sampled[r.request_id] = Sample.TOKEN
            r.generated += 1
            if r.generated >= r.max_new_tokens:
                r.finish_reason = FinishReason.LENGTH
        if r.finish_reason is not None:
            r.state = RequestState.FINISHED
            self.running.remove(r)
            finished[r.request_id] = r.finish_reason
            self._why.append(f"{r.request_id} finished ({r.finish_reason.value}) after {r.generated} token(s).")

    def summary(self) -> list[dict[str, Any]]:
        """One entry per request, list order: state, generated, computed, finish_reason."""
        return [
            {
                "request_id": r.request_id,
                "state": r.state.value,
                "generated": r.generated,
                "computed": r.computed,
                "finish_reason": r.finish_reason.value if r.finish_reason else None,
            }
            for r in self.requests
        ]
