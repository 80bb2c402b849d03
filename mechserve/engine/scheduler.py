"""The scheduler as the runtime sees it: the top rung of the ladder, behind a small contract.

``m14.Engine`` is the executable specification, unchanged; ``Scheduler`` is the one place in the
runtime that touches its state (vLLM's ``SchedulerInterface`` plays this part there).  Callers ask
for numbers and give orders; they never read its queues, pool or cache::

    add(...)                    offer a request to m12's door -> None, or the RejectReason
    abort(id)                   the request leaves now (the next record lists it under ``aborted``)
    finish(id, kept)            a finish decided outside the step (a stop string): ends the request
                                with STOP, not as an abort, keeping ``kept`` of this step's ids
    trim(id, kept)              a request m14 just finished keeps only ``kept`` of this step's ids
                                (a prompt-logprobs request with max_tokens 0 keeps none)
    drafting()                  the requests about to draft and their caps (m09's rule)
    step(spec_len) -> Step      one m14 step, and what it means for metrics (prompt tokens admitted,
                                prefix-cache hits, preemptions that dropped computed state)
    cut(record)                 this step's record with every stop-string finish applied
    counts() / page_usage()     running and waiting requests, pages free/cached/private: O(1)
    summary() / check()         the end-of-run summary; m14's invariants plus the leak check

``spec_engine`` is the m14 engine itself, for the two tools whose job is to read the spec's own
state: the trace pictures (``mechserve.viz``) and the conformance audits.  Nothing writes to it
from outside this class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.api.config import EngineConfig
from mechserve.spec import m14_forced_runs as m14


@dataclass(frozen=True, slots=True)
class PageUsage:
    """The KV pool: ``total`` pages, of which ``free`` are free and ``cached`` hold published blocks,
    ``shared`` of those in a running request's page table (the other cached pages are evictable)."""

    total: int
    free: int
    cached: int
    shared: int = 0

    @property
    def private(self) -> int:
        """Pages held by requests (their own, not shared through the cache)."""
        return self.total - self.free - self.cached

    @property
    def in_use(self) -> int:
        """Pages a running request holds, its own or shared: what neither the free list nor eviction can give."""
        return self.private + self.shared


@dataclass(frozen=True, slots=True)
class Step:
    """One scheduler step: the spec's ``record`` and what it means for the serving metrics.

    ``prompt_tokens``: the prompt length of each request admitted in this step with tokens to
    generate; ``prefix_hits``: the tokens of those prompts served from the prefix cache;
    ``preemptions``: the victims that had computed state to drop (m05 also "preempts" a
    scheduled request that holds no page yet, step after step while the pool is short: no
    thrashing, not counted).
    """

    record: m14.StepRecord
    prompt_tokens: Mapping[str, int]
    prefix_hits: int
    preemptions: int


class Scheduler:
    """The m14 engine for one ``EngineCore``: ``num_pages`` pages of ``config.page_size``.

    ``executors`` are the rank executors m14 joins (one per rank); ``eos_token_ids`` end a request
    (unless it ignores EOS); ``max_model_len`` bounds prompt + output.  With ``keep_finished``,
    requests that left stay in ``summary()`` (a finite run printing its summary at the end);
    without it a request is dropped once its leaving has been reported, so a long-lived engine's
    memory follows its live requests.  Raises ``ValueError`` for sizes m14 refuses.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_pages: int,
        max_model_len: int | None,
        eos_token_ids: Sequence[int],
        executors: Sequence[m14.Executor],
        keep_finished: bool = False,
    ) -> None:
        self.page_size = config.page_size
        self.num_pages = num_pages
        self.keep_finished = keep_finished
        self._engine = m14.Engine(
            [],
            max_step_tokens=config.max_step_tokens,
            page_size=config.page_size,
            num_pages=num_pages,
            spec_len=config.spec_len,
            world_size=len(executors),
            prefix_caching=config.prefix_caching,
            hold_shared_prefix=config.hold_shared_prefix,
            output_caching=config.output_caching,
            executors=executors,
            eos_token_ids=eos_token_ids,
            max_waiting=config.max_waiting,
            max_running=config.max_running,
            max_model_len=max_model_len,
        )
        self._stopped: dict[str, int] = {}  # stopped by a string, not yet out of a record's `aborted`: kept ids
        self._cuts: dict[str, int] = {}  # this step's stop-string finishes: ids kept of what the step appended
        self._trims: dict[str, int] = {}  # this step's trims of a finished request's ids (finish reason kept)
        self._trimmed: set[str] = set()  # trimmed requests, for the summary (their kept length is in _outputs)
        self._outputs: dict[str, int] = {}  # a stopped request's kept output length, for the summary
        self._arriving: dict[str, tuple[int, int]] = {}  # accepted, not yet admitted: (prompt length, max_new)

    @property
    def spec_engine(self) -> m14.Engine:
        """The m14 engine itself, to be read (never written) by the viz recorder and the conformance audits."""
        return self._engine

    @property
    def step_counter(self) -> int:
        """The number of the next step (the failing one, while a step raises)."""
        return self._engine.step_counter

    # Requests -----------------------------------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        arrival_step: int = 0,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> m14.RejectReason | None:
        """Offer a request to m12's door: None if it joined the waiting queue, else why not (recorded
        in the next step's ``rejected``)."""
        request = m14.Request(
            request_id,
            list(prompt_ids),
            max_new_tokens,
            arrival_step=arrival_step,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos,
        )
        reason = self._engine.add_request(request)
        if reason is None:
            self._arriving[request_id] = (len(request.tokens), max_new_tokens)
        return reason

    def abort(self, request_id: str) -> bool:
        """Take a waiting or running request out now (its private pages return); False if not live."""
        self._arriving.pop(request_id, None)
        return self._engine.abort(request_id)

    def finish(self, request_id: str, kept: int, generated: int) -> None:
        """End ``request_id`` with STOP after the step that just ran: a stop string matched in its text.

        ``kept``: how many of the ids this step appended to it stay (the rest are cut, and the
        record from ``cut`` says so); ``generated``: its output length after the cut.  The spec
        has one way to take a live request out between steps, ``abort``, which is used here; the
        record and the summary report a finish with status STOP instead of an abort.
        """
        if request_id in self._engine.live:
            self._engine.abort(request_id)
            self._stopped[request_id] = kept
        self._cuts[request_id] = kept
        self._outputs[request_id] = generated

    def trim(self, request_id: str, kept: int) -> None:
        """Keep only ``kept`` of the ids this step appended to ``request_id``, which m14 finished in it
        (its finish reason stays); the record from ``cut`` and the summary say so."""
        self._trims[request_id] = kept
        self._outputs[request_id] = kept
        self._trimmed.add(request_id)

    def drafting(self, max_k: int) -> list[tuple[str, int]]:
        """``(request_id, cap)`` for each request about to draft in the next step (m09: caught up except
        for its last sampled token), ``cap`` the guesses the spec allows it below ``max_k``."""
        return [
            (r.request_id, min(max_k, r.max_new_tokens - r.generated - 1))
            for r in self._engine.running
            if r.generated >= 1 and r.computed == r.target - 1
        ]

    # One step -----------------------------------------------------------------------------------------------------

    def step(self, spec_len: int | None = None) -> Step:
        """Run one m14 step (with ``spec_len`` guesses per decode window, if given); engine errors propagate."""
        engine = self._engine
        if not self.keep_finished:
            for gone in engine.drop_finished():
                self._outputs.pop(gone.request_id, None)
                self._trimmed.discard(gone.request_id)
        if spec_len is not None:
            engine.spec_len = spec_len
        computed_before = {r.request_id: r.computed for r in engine.running if r.computed}
        record = engine.step()
        if self._stopped:  # finished by a stop string between steps: a finish, not an abort
            record = dataclasses.replace(
                record, aborted=tuple(rid for rid in record.aborted if self._stopped.pop(rid, None) is None)
            )
        prompt_tokens = {}
        for rid in record.admitted:
            prompt_len, max_new = self._arriving.pop(rid, (0, 0))
            if max_new > 0:
                prompt_tokens[rid] = prompt_len
        return Step(
            record,
            prompt_tokens,
            prefix_hits=sum(record.reused.get(rid, 0) for rid in prompt_tokens),
            preemptions=sum(1 for rid in record.preempted if computed_before.get(rid, 0) > 0),
        )

    def cut(self, record: m14.StepRecord) -> m14.StepRecord:
        """``record`` with this step's stop-string finishes applied: each such request's ``tokens`` cut to
        what it kept, its decode window's ``accepted``/``rolled_back`` counted on the kept ids, and
        ``finished`` STOP."""
        if not self._cuts and not self._trims:
            return record
        cuts, self._cuts = self._cuts, {}
        trims, self._trims = self._trims, {}
        tokens = dict(record.tokens)
        accepted = dict(record.accepted)
        rolled_back = dict(record.rolled_back)
        finished = dict(record.finished)
        for rid, kept in [*cuts.items(), *trims.items()]:
            if rid in tokens and kept:
                tokens[rid] = tokens[rid][:kept]
            else:
                tokens.pop(rid, None)  # a request appears in ``tokens`` only with ids
            if rid in accepted:
                accepted[rid] = min(accepted[rid], max(kept - 1, 0))
                rolled_back[rid] = record.drafted[rid] - accepted[rid]
            if rid in cuts:
                finished[rid] = m14.FinishReason.STOP
        return dataclasses.replace(
            record,
            tokens=_frozen(tokens),
            accepted=_frozen(accepted),
            rolled_back=_frozen(rolled_back),
            finished=_frozen(finished),
        )

    # Reading ------------------------------------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """``(running, waiting)`` requests; waiting counts those not yet arrived and those due."""
        engine = self._engine
        return len(engine.running), len(engine.waiting) + len(engine.due)

    def page_usage(self) -> PageUsage:
        """The pool's pages by owner, in O(1), and the cached ones running requests use, in O(their page
        tables' length)."""
        engine = self._engine
        owner = engine.pool.owner
        shared = {p for r in engine.running for p in r.page_table if owner[p] is m14.CACHE}
        return PageUsage(self.num_pages, len(engine.pool.free), engine.cache.size, len(shared))

    def has_live(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self._engine.live)

    def summary(self) -> list[dict[str, Any]]:
        """m14's summary, with a stop-string finish reported as ``FINISHED``/``STOP`` (and its kept output
        length as ``generated``) instead of ``ABORTED``."""
        entries = self._engine.summary()
        for entry in entries:
            rid = entry["request_id"]
            if rid in self._trimmed:
                entry.update(generated=self._outputs[rid])
            elif rid in self._outputs and entry["state"] in ("ABORTED", "FINISHED"):
                entry.update(state="FINISHED", finish_reason="STOP", generated=self._outputs[rid])
        return entries

    def check(self) -> None:
        """Raise ``AssertionError`` unless m14's invariants hold and, with no live request, every page is
        free or cache-owned (nothing leaked)."""
        self._engine.check_invariants()
        if not self._engine.live:
            usage = self.page_usage()
            assert usage.private == 0, f"pages leaked: {usage}"


def _frozen(d: dict[str, Any]) -> Mapping[str, Any]:
    from types import MappingProxyType

    return MappingProxyType(d)


__all__ = ["PageUsage", "Scheduler", "Step"]
