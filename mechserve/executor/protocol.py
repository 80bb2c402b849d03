"""The executor contract: what ``EngineCore`` asks of whatever runs its plans behind the boundary.

The spec (m10) fixes the data plane: one frozen plan per step in, one outcome per plan item out,
validated by the engine's commit (``mechserve.spec.m13_output_caching.Executor``).  A real
executor also keeps per-request state that the spec does not model (sampling params, token
history for proposers, logprobs); ``EngineCore`` drives it through the control methods below and
through nothing else, so any class with these methods can stand behind the engine::

    EngineCore                                   Executor
    ──────────                                   ────────
    building m13 ──────────── rank_executors() -> the executors m13's group joins (m11):
                                                   [self] for one rank, one proxy per rank process
    add_request (after the door) ─ add_request(id, prompt_ids, params, eos_token_ids=..., bad_words_ids=...,
                                   [grammar=CompiledGrammar: only for params.structured_outputs])
    before a step ──────────────── advise(caps, max_k) -> spec_len for the coming step
    m13.step() ──────────────────── execute(plan) -> outcomes            (through rank_executors)
    after a step ───────────────── take_logprobs(id) -> one TokenLogprobs per appended id
                                   take_prompt_logprobs(id) -> one per prompt position recorded
                                   settle(windows): the accepted guesses each decode window kept
                                   after every cut (EOS or stop id, stop string, max_tokens)
    a request leaves ───────────── release(id)      (after the step's settle)
    stats() ───────────────────── ExecutorStats (forwards, rows, speculation counts)
    close() ───────────────────── stop rank processes (nothing for one rank)

``TorchExecutor`` (one process) and ``RankGroup`` (tensor-parallel rank processes) implement it;
``docs/executors.md`` shows a third, written from scratch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from mechserve.api.outputs import TokenLogprobs
from mechserve.api.params import SamplingParams
from mechserve.spec import m13_output_caching as m13


@dataclass(slots=True)
class ExecutorStats:
    """Counters since the executor was built.

    ``forwards``: target forwards; ``rows``: target rows computed.  Per decode window, counted when the
    control side settles it (``Executor.settle``): ``windows``: decode windows; ``slots``: their guess
    positions; ``proposed``: guesses the proposer made (the rest of the slots were pads);
    ``accepted``: of those, the ones the request kept (the executor's verdict after the control
    side's cuts: an EOS or stop id inside an accepted run, a stop string, max_tokens); ``emitted``:
    ids the request kept from its decode windows (kept guesses, pads included, plus one each).
    """

    forwards: int = 0
    rows: int = 0
    windows: int = 0
    slots: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0


@runtime_checkable
class Executor(Protocol):
    """Anything ``EngineCore`` can drive: m13's ``execute`` plus the control methods (module docstring)."""

    def execute(self, plan: tuple[m13.PlanItem, ...]) -> tuple[m13.Outcome, ...]:
        """One step: an outcome per plan item, in item order (every rank's, joined, for a group)."""
        ...

    def rank_executors(self) -> Sequence[m13.Executor]:
        """The per-rank executors m13's group fans each plan out to and joins (m11)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int] | None = None,
        params: SamplingParams = ...,
        *,
        eos_token_ids: Sequence[int] = (),
        bad_words_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """Register a request the door accepted: how it samples, its end ids, its prompt (for drafting,
        penalties and prompt logprobs) and its bad words as token ids."""
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

    def advise(self, caps: Sequence[tuple[str, int]], max_k: int) -> int:
        """The ``spec_len`` in ``0..max_k`` that pays best for the requests about to draft."""
        ...

    def stats(self) -> ExecutorStats:
        """A copy of the counters."""
        ...

    def close(self) -> None:
        """Release what the executor holds outside this process (rank processes); idempotent."""
        ...


__all__ = ["Executor", "ExecutorStats"]
