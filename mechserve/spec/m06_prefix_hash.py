"""m06 — Prefix hash (library rung; the engine is m05's).

Key question: what identifies a reusable prefix independently of which
request holds it and where it is stored?

A *prefix key* names one complete block of tokens together with everything
before it: ``(namespace, parent key, block tokens)``.  Keys chain, so two
requests whose prompts agree on their first ``k`` blocks get the same first
``k`` keys, wherever their pages live::

    tokens  [1 2 3 4 | 5 6 7 8 | 9]           page_size 4
    keys    k0 = (ns, ROOT, (1,2,3,4))
            k1 = (ns, k0,   (5,6,7,8))         the partial block [9] has no key

A different first block gives disjoint chains even when later blocks are
equal.  Equality is structural; the hash is computed once per key.  This rung
adds the structure beside m05's engine, unchanged; the engine first consults
it in m08.  The rules are in ``mech-notes/06-prefix-hash.md``.
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

TITLE = "Prefix hash"
KEY_QUESTION = "What identifies a reusable prefix independently of which request holds it and where it is stored?"
NOTE = "06-prefix-hash.md"


class OutOfPages(Exception):
    """The pages a step needs exceed the free pages and no victim is left."""


class Irreducible(OutOfPages):
    """The anchor alone needs more pages than the whole pool holds."""


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


# m06: a prefix key names one complete block together with everything before it.
@dataclass(frozen=True)
class PrefixKey:
    """``(namespace, parent, block_tokens)``; ``parent`` is None for ROOT.

    Equality is structural (namespace, parents recursively, tokens); the hash
    is computed once at construction, so chains hash in O(1) per key.
    """

    namespace: str
    parent: PrefixKey | None
    block_tokens: tuple[int, ...]
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.namespace, self.parent, self.block_tokens)))

    def __hash__(self) -> int:
        return self._hash


ROOT: PrefixKey | None = None


def prefix_keys(tokens: Sequence[int], page_size: int, namespace: str = "engine") -> list[PrefixKey]:
    """Keys of the complete blocks of ``tokens``: ``len(tokens) // page_size`` keys.

    Key ``i`` covers ``tokens[i*page_size:(i+1)*page_size]`` and chains from
    key ``i-1`` (key 0 from ROOT).  A trailing partial block has no key.
    """
    keys: list[PrefixKey] = []
    parent = ROOT
    for i in range(len(tokens) // page_size):
        parent = PrefixKey(namespace, parent, tuple(tokens[i * page_size : (i + 1) * page_size]))
        keys.append(parent)
    return keys


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
    preempted: tuple[str, ...] = ()  # m05
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
            "preempted": list(self.preempted),
        }


class Engine:
    """The complete engine as of m06 (m05's engine; prefix keys stand beside it).

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
        scheduled = tuple(r.request_id for r, _ in work)
        preempted = self._ensure_residency(work)
        executed = self._execute(work)
        sampled: dict[str, Sample] = {}
        finished: dict[str, FinishReason] = {}
        for r, _ in work:
            # m04: a slice that ends inside the prompt is not ready to sample.
            if r.computed == r.target:
                self._sample(r, sampled, finished)
        record = StepRecord(
            step=self.step_counter,
            admitted=tuple(admitted),
            scheduled=scheduled,
            executed=_frozen(executed),
            sampled=_frozen(sampled),
            finished=_frozen(finished),
            preempted=tuple(preempted),
            explain=tuple(self._why),
        )
        self.step_counter += 1
        return record

    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        """Step until every request is FINISHED; return all records.

        ``on_step`` (optional) sees each record as soon as it exists, so a
        caller can show the steps that led to an error.  ``OutOfPages``
        propagates.
        """
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
        # m04: each request gets min(remaining, what is left); only the last is cut.
        work = []
        budget = self.max_step_tokens
        for r in self.running:
            if budget == 0:
                break
            take = min(r.remaining, budget)
            if take > 0:
                work.append((r, take))
                budget -= take
                if take < r.remaining:
                    self._why.append(
                        f"{r.request_id} was cut to {take} of the {r.remaining} token(s) it owes: the budget ran out."
                    )
        return work

    def _ensure_residency(self, work: list[tuple[Request, int]]) -> list[str]:
        """Back every work item's positions with pages, preempting if needed.

        Removes victims' items from ``work`` and returns the victims' ids in
        the order they were chosen.  Raises ``Irreducible`` when the anchor
        alone needs more than the whole pool, and ``OutOfPages`` when no
        victim is left.
        """
        ps = self.pool.page_size
        preempted: list[str] = []
        if not work:
            return preempted
        # m05: the anchor is never a victim, so it must fit the pool on its own.
        anchor, anchor_n = work[0]
        if pages_for(anchor.computed + anchor_n, ps) > self.pool.num_pages:
            raise Irreducible(
                f"{anchor.request_id} needs {pages_for(anchor.computed + anchor_n, ps)} page(s) "
                f"but the pool has {self.pool.num_pages}"
            )
        while True:
            need = sum(max(0, pages_for(r.computed + n, ps) - len(r.page_table)) for r, n in work)
            if self.pool.can_fit(need):
                break
            victim = self._choose_victim(anchor, work)
            if victim is None:
                raise OutOfPages(f"step {self.step_counter} needs {need} page(s), only {len(self.pool.free)} free")
            self._why.append(
                f"{need} page(s) needed but only {len(self.pool.free)} free: "
                f"{victim.request_id} (the last eligible request in the list) was preempted."
            )
            self._preempt(victim, work)
            preempted.append(victim.request_id)
        for r, n in work:
            taken = [self.pool.take(r.request_id) for _ in range(pages_for(r.computed + n, ps) - len(r.page_table))]
            r.page_table += taken
            if taken:
                self._why.append(
                    f"{r.request_id} took free page(s) {taken} to back positions up to {r.computed + n - 1}."
                )
        return preempted

    def _choose_victim(self, anchor: Request, work: list[tuple[Request, int]]) -> Request | None:
        """The last RUNNING request, not the anchor, that holds pages or has work."""
        in_work = {id(r) for r, _ in work}
        for r in reversed(self.running):
            if r is anchor:
                continue
            if r.page_table or id(r) in in_work:
                return r
        return None

    def _preempt(self, victim: Request, work: list[tuple[Request, int]]) -> None:
        """Release the victim's pages and forget its computed state; keep its history."""
        self._release(victim)
        victim.computed = 0
        work[:] = [(r, n) for r, n in work if r is not victim]

    def _execute(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        executed = {}
        for r, n in work:
            for pos in range(r.computed, r.computed + n):
                page, offset = translate(r.page_table, pos, self.pool.page_size)
                self.pool.slots[page][offset] = (r.request_id, pos)
            r.computed += n
            executed[r.request_id] = n
            self._why.append(f"{r.request_id} computed {n} token(s), positions {r.computed - n}..{r.computed - 1}.")
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
