"""The executor contract: what ``EngineCore`` asks of whatever runs its plans behind the boundary.

The spec (m10) fixes the data plane: one frozen plan per step in, one outcome per plan item out,
validated by the engine's commit (``mechserve.spec.m16_request_draft_lengths.Executor``).  A real
executor also keeps per-request state that the spec does not model (sampling params, token
history for proposers, logprobs, a grammar); ``EngineCore`` drives it through the control methods
below and through nothing else, so any class with these methods can stand behind the engine::

    EngineCore                                   Executor
    ──────────                                   ────────
    building m14 ──────────── rank_executors() -> the executors of its ranks (m11): [self] for one rank,
                                                   one proxy per rank process
    add_request (after the door) ─ add_request(ExecutorRequest): the request record (id, prompt ids,
                                   params, EOS ids, bad-word ids, compiled grammar; executor/request.py)
    before a step ──────────────── advise(caps, max_k) -> Advice: spec_len and per-request draft limits (m16)
    the step ───────────────────── execute(plan) -> outcomes: every rank's report, joined as m11 joins
                                   them (m16.ExecutorGroup: GroupViolation unless all agree)
                                   take_failures() -> the requests that failed inside it (below)
      m16 commits the outcomes; for each request that appended ids:
                                   take_logprobs(id) -> one TokenLogprobs per appended id
                                   take_prompt_logprobs(id) -> one per prompt position recorded
    after the step ─────────────── settle(windows): the accepted guesses each decode window kept after
                                   every cut (EOS or stop id, stop string, max_tokens: the record's accepted)
    a request leaves ───────────── release(id)      (after the step's settle)
    stats() ───────────────────── ExecutorStats (forwards, rows, speculation counts)
    close() ───────────────────── stop rank processes (nothing for one rank)

A request that fails inside a step on its own account (its grammar's matcher raises, its logits
processing raises) must not fail the step: the executor isolates it, still returns a valid outcome
for its item (the boundary holds for every other request), and reports it from ``take_failures``
(a ``RequestFailure``); ``EngineCore`` then ends that request alone, keeping none of the ids it
appended in that step.

``TorchExecutor`` (one process) and ``RankGroup`` (tensor-parallel rank processes) implement it;
``docs/executors.md`` shows a third, written from scratch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from mechserve.api.outputs import TokenLogprobs
from mechserve.executor.request import ExecutorRequest
from mechserve.spec import m16_request_draft_lengths as m16

if TYPE_CHECKING:
    from mechserve.executor.governor import Advice


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request that failed inside a step on its own account: ``param`` names the request field behind it
    (``"structured_outputs"`` for its grammar) or is None; ``message`` is one line (never a whole grammar)."""

    request_id: str
    param: str | None
    message: str


@dataclass(slots=True)
class ExecutorStats:
    """Counters since the executor was built.

    ``forwards``: target forwards; ``rows``: target rows computed.  Per decode window, counted when the
    control side settles it (``Executor.settle``): ``windows``: decode windows; ``slots``: their guess
    positions; ``proposed``: guesses the proposer made (the rest of the slots were pads);
    ``accepted``: of those, the ones the request kept (the executor's verdict after the control
    side's cuts: an EOS or stop id inside an accepted run, a stop string, max_tokens); ``emitted``:
    ids the request kept from its decode windows (kept guesses, pads included, plus one each);
    ``forced``: ids reported as forced after a sample (m14; the control side may cut a run that
    ends the request).
    """

    forwards: int = 0
    rows: int = 0
    windows: int = 0
    slots: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    forced: int = 0  # m14: ids reported in Outcome.forced (appended without sampling)


@runtime_checkable
class Executor(Protocol):
    """Anything ``EngineCore`` can drive: m14's ``execute`` plus the control methods (module docstring)."""

    def execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        """One step: an outcome per plan item, in item order; with several ranks, every rank's report joined
        as m11 joins them (``m16.ExecutorGroup``: ``GroupViolation`` unless all are equal)."""
        ...

    def rank_executors(self) -> Sequence[m16.Executor]:
        """The per-rank executors (m11): m14 is built with one per rank, and a group joins their reports."""
        ...

    def add_request(self, request: ExecutorRequest) -> None:
        """Register a request the door accepted (its record: how it samples, its end ids, its prompt for
        drafting, penalties and prompt logprobs, its bad words as token ids, its compiled grammar)."""
        ...

    def take_failures(self) -> list[RequestFailure]:
        """The requests that failed inside the last ``execute`` on their own account (module docstring),
        then forget them; each still got a valid outcome."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a request that left the engine (finished, aborted, stopped)."""
        ...

    def settle(self, windows: Mapping[str, int]) -> None:
        """After each step: ``request id -> accepted guesses kept`` for every decode window of the step.

        The step record's ``accepted``, after the control side cut each accepted run (an EOS or stop
        id, a stop string; drafts never pass max_tokens).  What the executor counts and learns from
        (``ExecutorStats``, acceptance estimates for ``advise``) is this, not its own verdicts.
        """
        ...

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """The logprobs recorded for ``request_id`` since the last call (one per appended id)."""
        ...

    def take_prompt_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """The prompt logprobs recorded since the last call (prompt positions 1, 2, ... in order;
        all of them by the step that samples the first token)."""
        ...

    def advise(self, caps: Sequence[tuple[str, int]], max_k: int) -> Advice:
        """The ``spec_len`` in ``0..max_k`` that pays best for the requests about to draft, and each one's
        draft limit (m16: ``Advice.limits``, request id -> None or the most guesses its window carries)."""
        ...

    def stats(self) -> ExecutorStats:
        """A copy of the counters."""
        ...

    def close(self) -> None:
        """Release what the executor holds outside this process (rank processes); idempotent."""
        ...


__all__ = ["Executor", "ExecutorRequest", "ExecutorStats", "RequestFailure"]
