"""m03 — Paged state.

Key question: where does each request's computed state physically live, and
when is that storage given back?

Computed state lives in fixed-size *pages* of ``page_size`` slots.  A request's
*page table* lists its pages in position order, so position ``p`` lives at
``translate(page_table, p) = (page_table[p // page_size], p % page_size)``::

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    page_table  [  5    ,   2     ,  7 ]     (page_size 4)
    slot of 9 = (7, 1)

Each step, after scheduling, *residency* makes every work item's positions
backed by pages, all or nothing: it takes pages from the front of the free
list, or raises ``OutOfPages`` before taking any.  A finished request gives
all its pages back (to the back of the free list).  The never-fits check of
m02 stays.  The rules are in ``mech-notes/03-paged-state.md``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

TITLE = "Paged state"
KEY_QUESTION = "Where does each request's computed state physically live, and when is that storage given back?"
NOTE = "03-paged-state.md"


class OutOfPages(Exception):
    """The pages a step needs exceed the free pages."""


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
    page_table: list[int] = field(default_factory=list)  # m03: page ids, position order

    @property
    def target(self) -> int:
        """Positions that should be computed: the prompt plus every sampled token."""
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        """Positions still owed (tokens)."""
        return self.target - self.computed


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` positions: ceil(tokens / page_size)."""
    return -(-tokens // page_size)


def translate(page_table: Sequence[int], pos: int, page_size: int) -> tuple[int, int]:
    """The slot ``(page_id, offset)`` that backs position ``pos``."""
    return page_table[pos // page_size], pos % page_size


class PagePool:
    """Pages ``0 .. num_pages-1``, each with an owner and ``page_size`` slots.

    The free list starts ascending; ``take`` removes from the front and
    ``release`` appends to the back.  A slot holds ``(request_id, position)``.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.free: deque[int] = deque(range(num_pages))
        self.owner: list[str | None] = [None] * num_pages
        self.slots: list[list[tuple[str, int] | None]] = [[None] * page_size for _ in range(num_pages)]

    def can_fit(self, pages: int) -> bool:
        return pages <= len(self.free)

    def take(self, owner: str) -> int:
        page = self.free.popleft()
        self.owner[page] = owner
        return page

    def release(self, page: int) -> None:
        self.owner[page] = None
        self.slots[page] = [None] * self.page_size
        self.free.append(page)


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
    """The complete engine as of m03.

    ``max_step_tokens`` is the per-step token budget; the pool has
    ``num_pages`` pages of ``page_size`` slots.  Raises ``ValueError`` if
    ``max_step_tokens <= 0``, a request has ``prompt_len <= 0`` or
    ``max_new_tokens <= 0``, or ``num_pages <= 0`` or ``page_size <= 0``
    (checked in that order).
    """

    def __init__(self, requests: Sequence[Request], max_step_tokens: int, page_size: int, num_pages: int) -> None:
        if max_step_tokens <= 0:
            raise ValueError("max_step_tokens must be > 0")
        for r in requests:
            if r.prompt_len <= 0:
                raise ValueError(f"request {r.request_id!r}: prompt_len must be > 0")
            if r.max_new_tokens <= 0:
                raise ValueError(f"request {r.request_id!r}: max_new_tokens must be > 0")
        if num_pages <= 0:
            raise ValueError("num_pages must be > 0")
        if page_size <= 0:
            raise ValueError("page_size must be > 0")
        self.pool = PagePool(num_pages, page_size)
        self.requests = list(requests)
        # Queues in list order: a step costs what is running or due, not every request ever seen.
        self._position = {id(r): i for i, r in enumerate(self.requests)}
        self.waiting: list[tuple[int, int, Request]] = [(r.arrival_step, i, r) for i, r in enumerate(self.requests)]
        heapq.heapify(self.waiting)
        self.running: list[Request] = []
        self.max_step_tokens = max_step_tokens
        self.step_counter = 0
        self._why: list[str] = []

    def step(self) -> StepRecord:
        """Run one tick and return its record; the counter advances afterwards."""
        self._why = []
        admitted = self._admit()
        work = self._schedule()
        self._ensure_residency(work)
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
        caller can show the steps that led to an error.

        Raises ``RuntimeError`` (naming the RUNNING requests) after a step that
        scheduled nothing while some request is RUNNING: it can never fit.
        """
        records = []
        while self.waiting or self.running:
            record = self.step()
            records.append(record)
            if on_step is not None:
                on_step(record)
            # m02: a running request larger than the budget would wait for ever.
            running = [r.request_id for r in self.running]
            if running and not record.scheduled:
                raise RuntimeError(f"never fits: nothing could be scheduled for running requests {running}")
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
        # m02: ... and it must fit the token budget, whole requests only.
        work = []
        budget = self.max_step_tokens
        for r in self.running:
            if r.remaining <= budget:
                work.append((r, r.remaining))
                budget -= r.remaining
            else:
                self._why.append(
                    f"{r.request_id} was skipped: it owes {r.remaining} token(s) but only {budget} of the budget are left."
                )
        return work

    def _ensure_residency(self, work: list[tuple[Request, int]]) -> None:
        """Back every work item's positions with pages, all or nothing.

        Raises ``OutOfPages`` before taking any page when the need exceeds the
        free list.
        """
        # m03: all or nothing, so a failed step leaves no half-backed request.
        ps = self.pool.page_size
        need = sum(pages_for(r.computed + n, ps) - len(r.page_table) for r, n in work)
        if not self.pool.can_fit(need):
            raise OutOfPages(f"step {self.step_counter} needs {need} page(s), only {len(self.pool.free)} free")
        for r, n in work:
            taken = [self.pool.take(r.request_id) for _ in range(pages_for(r.computed + n, ps) - len(r.page_table))]
            r.page_table += taken
            if taken:
                self._why.append(
                    f"{r.request_id} took free page(s) {taken} to back positions up to {r.computed + n - 1}."
                )

    def _execute(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        executed = {}
        for r, n in work:
            for pos in range(r.computed, r.computed + n):
                page, offset = translate(r.page_table, pos, self.pool.page_size)
                self.pool.slots[page][offset] = (r.request_id, pos)
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
            self._release(r)

    def _release(self, r: Request) -> None:
        """Give every page of ``r`` back, in page-table order."""
        for page in r.page_table:
            self.pool.release(page)
        if r.page_table:
            self._why.append(f"{r.request_id} gave back page(s) {r.page_table}.")
        r.page_table = []

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the pool is consistent.

        Every page is free or owned, never both; every owned page sits in its
        owner's page table exactly once; every unfinished request's page table
        backs its computed positions.
        """
        free = set(self.pool.free)
        assert len(free) == len(self.pool.free), "a page is on the free list twice"
        in_tables = [p for r in self.requests for p in r.page_table]
        assert len(in_tables) == len(set(in_tables)), "a page is in two page tables"
        holder = {p: r.request_id for r in self.requests for p in r.page_table}
        for page, owner in enumerate(self.pool.owner):
            assert (owner is None) == (page in free), f"page {page}: owner {owner!r} vs free list"
            if owner is not None:
                assert holder.get(page) == owner, f"page {page} owned by {owner!r} but not in its table"
        for page, rid in holder.items():
            assert self.pool.owner[page] == rid, f"{rid}'s page table holds page {page}, which it does not own"
        for r in self.requests:
            if r.state is not RequestState.FINISHED:
                assert len(r.page_table) >= pages_for(r.computed, self.pool.page_size), (
                    f"{r.request_id}: unbacked positions"
                )

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
