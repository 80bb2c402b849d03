"""The scheduler as the runtime sees it: the top rung of the ladder, behind a small contract.

``m16.Engine`` is the executable specification, unchanged; ``Scheduler`` is the one place in the
runtime that touches its state (vLLM's ``SchedulerInterface`` plays this part there).  Callers ask
for numbers and give orders; they never read its queues, pool or cache::

    add(...)                    offer a request to m12's door -> None, or the RejectReason
    abort(id)                   the request leaves now (the next record lists it under ``aborted``)
    drafting()                  the requests about to draft and their caps (m09's rule)
    schedule(spec_len, limits)  open a step -> plan: m16's draft limits, admission, reuse, drafts,
      -> plan                   schedule, residency, plan
    commit(outcomes, stop)      close it with the executor's outcomes -> Step: m16's record (with every
      -> Step                   stop decided on text applied: m12 N26) and what it means for metrics
    counts() / page_usage()     running and waiting requests, pages free/cached/private: O(1)
    summary() / check()         the end-of-run summary; m16's invariants plus the leak check

A stop decided outside the engine (a stop string, a failed request) is an input of ``commit``,
``stop(request_id, ids, finish_reason) -> None | keep``, asked once per request that appended ids
in the step, right after they are appended: the record ``commit`` returns is already the final one,
so nothing rewrites it afterwards.

``spec_engine`` is the m16 engine itself, for the two tools whose job is to read the spec's own
state: the trace pictures (``mechserve.viz``) and the conformance audits; ``prefix_cache`` is its
radix cache alone, for the KV event publisher.  Nothing writes to either from outside this class.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.api.config import EngineConfig
from mechserve.spec import m16_request_draft_lengths as m16


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

    record: m16.StepRecord
    prompt_tokens: Mapping[str, int]
    prefix_hits: int
    preemptions: int


# A stop decided on text, asked by ``commit`` for each request that appended ids in the step:
# (request id, the ids it appended, m16's finish reason if the step ended it) -> None, or the ids it keeps.
StopHook = Callable[[str, tuple[int, ...], m16.FinishReason | None], int | None]


class Scheduler:
    """The m16 engine for one ``EngineCore``: ``num_pages`` pages of ``config.page_size``.

    ``executors`` are the rank executors m16's own group joins when the spec engine steps itself
    (one per rank; the runtime runs each plan through ``Executor.execute`` instead, which joins the
    same ranks the same way); ``eos_token_ids`` end a request (unless it ignores EOS);
    ``max_model_len`` bounds prompt + output.  With ``keep_finished``, requests that left stay in
    ``summary()`` (a finite run printing its summary at the end); without it a request is dropped
    once its leaving has been reported, so a long-lived engine's memory follows its live requests.
    Raises ``ValueError`` for sizes m16 refuses.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_pages: int,
        max_model_len: int | None,
        eos_token_ids: Sequence[int],
        executors: Sequence[m16.Executor],
        keep_finished: bool = False,
    ) -> None:
        self.page_size = config.page_size
        self.num_pages = num_pages
        self.keep_finished = keep_finished
        self._engine = m16.Engine(
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
        self._requests: dict[str, m16.Request] = {}  # accepted and not yet dropped, by id
        self._computed_before: dict[str, int] = {}  # the open step's running requests' computed tokens

    @property
    def spec_engine(self) -> m16.Engine:
        """The m16 engine itself, to be read (never written) by the viz recorder and the conformance audits."""
        return self._engine

    @property
    def prefix_cache(self) -> m16.RadixCache:
        """The m16 engine's radix cache, to be read (never written) between steps on the engine thread: the
        KV event publisher (``mechserve.kv_events``) diffs it after a step that published or evicted."""
        return self._engine.cache

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
    ) -> m16.RejectReason | None:
        """Offer a request to m12's door: None if it joined the waiting queue, else why not (recorded
        in the next step's ``rejected``)."""
        request = m16.Request(
            request_id,
            list(prompt_ids),
            max_new_tokens,
            arrival_step=arrival_step,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos,
        )
        reason = self._engine.add_request(request)
        if reason is None:
            self._requests[request_id] = request
        return reason

    def abort(self, request_id: str) -> bool:
        """Take a waiting or running request out now (its private pages return); False if not live."""
        return self._engine.abort(request_id)

    def drafting(self, max_k: int) -> list[tuple[str, int]]:
        """``(request_id, cap)`` for each request about to draft in the next step (m09: caught up except
        for its last sampled token), ``cap`` the guesses the spec allows it below ``max_k``."""
        return [
            (r.request_id, min(max_k, r.max_new_tokens - r.generated - 1))
            for r in self._engine.running
            if r.generated >= 1 and r.computed == r.target - 1
        ]

    # One step: schedule, (the executor runs the plan), commit ----------------------------------------------------

    def schedule(
        self, spec_len: int | None = None, limits: Mapping[str, int | None] | None = None
    ) -> tuple[m16.PlanItem, ...]:
        """Open a step with ``spec_len`` guesses per decode window (if given) and each named request's
        draft limit (m16's ``limit_drafts``: request id -> None or the most guesses; a limit stays until
        changed); return its plan (m10 N21).  ``ValueError`` for an id that is not live or a bad limit.

        Requests whose end was already reported are dropped first (unless ``keep_finished``).
        ``m16.OutOfPages`` propagates."""
        engine = self._engine
        if not self.keep_finished:
            for gone in engine.drop_finished():
                if self._requests.get(gone.request_id) is gone:
                    del self._requests[gone.request_id]
        if limits:
            engine.limit_drafts(limits)
        if spec_len is not None:
            engine.spec_len = spec_len
        self._computed_before = {r.request_id: r.computed for r in engine.running if r.computed}
        return engine.schedule()

    def commit(self, outcomes: Sequence[m16.Outcome], stop: StopHook | None = None) -> Step:
        """Close the open step with one outcome per plan item (m14's ``commit``); return its record and
        its metrics facts.

        ``stop(request_id, ids, finish_reason)`` is asked for each request that appended ``ids`` in
        this step, right after they were appended, with the finish reason m14 gave it in this step
        (None while it runs on): None changes nothing; ``k`` keeps the first ``k`` ids and ends the
        request with STOP (m12 N26: the ids after them are cut from its output and the record, a decode
        window's ``accepted`` counts only the guesses kept, a running request's private pages return).
        Raises what m14's ``commit`` raises (``BoundaryViolation``, ``RuntimeError`` without an open step).
        """
        requests = self._requests

        def check(request_id: str, ids: tuple[int, ...]) -> int | None:
            assert stop is not None
            return stop(request_id, ids, requests[request_id].finish_reason)

        record = self._engine.commit(outcomes, None if stop is None else check)
        prompt_tokens = {}
        for rid in record.admitted:
            r = requests.get(rid)
            if r is not None and r.max_new_tokens > 0:
                prompt_tokens[rid] = r.prompt_len
        computed_before, self._computed_before = self._computed_before, {}
        return Step(
            record,
            prompt_tokens,
            prefix_hits=sum(record.reused.get(rid, 0) for rid in prompt_tokens),
            preemptions=sum(1 for rid in record.preempted if computed_before.get(rid, 0) > 0),
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
        shared = {p for r in engine.running for p in r.page_table if owner[p] is m16.CACHE}
        return PageUsage(self.num_pages, len(engine.pool.free), engine.cache.size, len(shared))

    def has_live(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self._engine.live)

    def summary(self) -> list[dict[str, Any]]:
        """m14's summary (``request_id``, ``state``, ``generated``, ``computed``, ``finish_reason``); a stop
        decided on text is a FINISHED request with finish reason STOP and the output it kept."""
        return self._engine.summary()

    def check(self) -> None:
        """Raise ``AssertionError`` unless m14's invariants hold and, with no live request, every page is
        free or cache-owned (nothing leaked)."""
        self._engine.check_invariants()
        if not self._engine.live:
            usage = self.page_usage()
            assert usage.private == 0, f"pages leaked: {usage}"


__all__ = ["PageUsage", "Scheduler", "Step", "StopHook"]
