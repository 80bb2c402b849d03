"""m09 — Speculative decode.

Key question: how does the engine compute guesses ahead of the truth, and
what does it undo when the verdict arrives?

A request that is caught up except for its last sampled token asks for a
*decode window*: that token plus ``draft_len`` guessed tokens, computed in
one pass.  The verifier's verdict says how many guesses were right; the rest
are *rolled back*::

    window (n = 1 + 3):   [last | d1 d2 d3]      verdict: accept 1
    after resolve:        [last | d1] + sample    d2 d3 rolled back, their
                                                  tail pages freed

A window of ``n`` tokens therefore yields ``accepted + 1`` new tokens.  The
verdicts come from a per-request ``accept_script`` (one entry per decode
window; absent or used up means accept all).  Only a caught-up request drafts,
and only a window that starts at the last sampled token is a decode window:
a recompute chunk after preemption never is (departure D1).  The rules are in
``mech-notes/09-speculative-decode.md``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

TITLE = "Speculative decode"
KEY_QUESTION = "How does the engine compute guesses ahead of the truth, and what does it undo when the verdict arrives?"
NOTE = "09-speculative-decode.md"


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


class Cache(Enum):
    """The owner marker of a page that belongs to the radix cache."""

    CACHE = "CACHE"


CACHE = Cache.CACHE


class Sample(Enum):
    """What one sample produced: a real token, or the end-of-sequence marker."""

    TOKEN = "TOKEN"
    EOS = "EOS"


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


# m07: a trie of prefix keys finds the longest resident prefix.
class RadixNode:
    """One cached block: its page id and its children in insertion order."""

    __slots__ = ("block", "children")

    def __init__(self, block: int) -> None:
        self.block = block
        self.children: dict[PrefixKey, RadixNode] = {}


class RadixCache:
    """A trie of prefix-key chains; ``size`` counts nodes.

    Contract: every node's key chains from its parent's key (key 0 of a chain
    from ROOT), so a node is reachable exactly through its key's ancestors.
    """

    def __init__(self) -> None:
        self.root: dict[PrefixKey, RadixNode] = {}
        self.size = 0

    def insert(self, keys: Sequence[PrefixKey], blocks: Sequence[int]) -> int:
        """Create the missing nodes of the chain ``keys``; return how many were created.

        Raises ``ValueError`` if the lengths differ, the keys are not a chain
        from ROOT, or an existing node holds a different block.
        """
        if len(keys) != len(blocks):
            raise ValueError(f"insert: {len(keys)} keys but {len(blocks)} blocks")
        parent: PrefixKey | None = ROOT
        for key in keys:
            if key.parent != parent:
                raise ValueError("insert: keys are not a chain starting at ROOT")
            parent = key
        created = 0
        children = self.root
        for key, block in zip(keys, blocks):
            node = children.get(key)
            if node is None:
                node = children[key] = RadixNode(block)
                created += 1
            elif node.block != block:
                raise ValueError(f"insert: key already holds block {node.block}, not {block}")
            children = node.children
        self.size += created
        return created

    def match(self, keys: Sequence[PrefixKey]) -> list[int]:
        """Blocks of the longest leading run of ``keys`` present; stops at the first miss."""
        blocks = []
        children = self.root
        for key in keys:
            node = children.get(key)
            if node is None:
                break
            blocks.append(node.block)
            children = node.children
        return blocks

    def leaves(self) -> Iterator[tuple[PrefixKey, RadixNode]]:
        """Childless nodes in depth-first pre-order, children in insertion order."""
        # m08: eviction takes the first unreferenced one (oldest branch first).
        stack = [iter(self.root.items())]
        while stack:
            item = next(stack[-1], None)
            if item is None:
                stack.pop()
            elif item[1].children:
                stack.append(iter(item[1].children.items()))
            else:
                yield item

    def remove_leaf(self, key: PrefixKey) -> int:
        """Delete the childless node of ``key`` and return its block.

        Raises ``ValueError`` if the node is absent or has children.
        """
        chain = []
        k: PrefixKey | None = key
        while k is not None:
            chain.append(k)
            k = k.parent
        children = self.root
        node = None
        for k in reversed(chain):
            parent_children = children
            node = children.get(k)
            if node is None:
                raise ValueError("remove_leaf: key is not in the cache")
            children = node.children
        assert node is not None
        if node.children:
            raise ValueError("remove_leaf: node has children")
        del parent_children[key]
        self.size -= 1
        return node.block


@dataclass
class Request:
    """One generation request.

    ``tokens`` is the prompt (token ids); ``max_new_tokens`` is a token
    count.  ``eos_after`` is the fake model's EOS trigger: once
    ``generated >= eos_after`` the next sample is EOS.  ``accept_script``
    holds one verifier verdict (accepted drafts) per decode window and is
    consumed from the front.  ``computed`` counts leading positions whose
    state exists; ``draft_len`` is the guesses asked for this step.
    """

    request_id: str
    tokens: list[int]  # m08: the prompt is explicit token ids
    max_new_tokens: int
    arrival_step: int = 0
    eos_after: int | None = None
    accept_script: list[int] | None = None  # m09
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    generated: int = 0
    computed: int = 0
    page_table: list[int] = field(default_factory=list)  # m03: page ids, position order
    prompt_keys: list[PrefixKey] = field(default_factory=list, repr=False)  # m08: set by the engine
    draft_len: int = 0  # m09

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    @property
    def target(self) -> int:
        """Positions that should be computed: the prompt plus every sampled token."""
        return self.prompt_len + self.generated

    @property
    def remaining(self) -> int:
        """Positions still owed (tokens), including this step's guesses (m09)."""
        return self.target - self.computed + self.draft_len


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` positions: ceil(tokens / page_size)."""
    return -(-tokens // page_size)


def translate(page_table: Sequence[int], pos: int, page_size: int) -> tuple[int, int]:
    """The slot ``(page_id, offset)`` that backs position ``pos``."""
    return page_table[pos // page_size], pos % page_size


class PagePool:
    """Pages ``0 .. num_pages-1``, each with an owner and ``page_size`` slots.

    An owner is None (free), a request id (private) or ``CACHE``.  The free
    list starts ascending; ``take`` removes from the front and ``release``
    appends to the back.  A slot holds ``(request_id, position)``.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.free: deque[int] = deque(range(num_pages))
        self.owner: list[str | Cache | None] = [None] * num_pages
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
    preempted: tuple[str, ...] = ()  # m05
    reused: Mapping[str, int] = field(default_factory=lambda: _frozen({}))  # m08: tokens
    published: Mapping[str, int] = field(default_factory=lambda: _frozen({}))  # m08: blocks
    evicted: tuple[int, ...] = ()  # m08: page ids
    drafted: Mapping[str, int] = field(default_factory=lambda: _frozen({}))  # m09: per decode window
    accepted: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    rolled_back: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
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
            "reused": dict(self.reused),
            "published": dict(self.published),
            "evicted": list(self.evicted),
            "drafted": dict(self.drafted),
            "accepted": dict(self.accepted),
            "rolled_back": dict(self.rolled_back),
        }


class Engine:
    """The complete engine as of m09.

    ``max_step_tokens`` is the per-step token budget; the pool has
    ``num_pages`` pages of ``page_size`` slots; ``spec_len`` is the most
    guesses a decode window may carry; ``namespace`` scopes the prefix keys
    (default ``"engine"``;
    with ``prefix_caching=False`` nothing is reused or published).  Raises ``ValueError`` if ``spec_len < 0``,
    ``max_step_tokens <= 0``, a request has an empty token list or
    ``max_new_tokens <= 0``, or ``num_pages <= 0`` or ``page_size <= 0``
    (checked in that order).
    """

    def __init__(
        self,
        requests: Sequence[Request],
        max_step_tokens: int,
        page_size: int,
        num_pages: int,
        spec_len: int = 0,
        namespace: str | None = None,
        prefix_caching: bool = True,
    ) -> None:
        if spec_len < 0:
            raise ValueError("spec_len must be >= 0")
        if max_step_tokens <= 0:
            raise ValueError("max_step_tokens must be > 0")
        for r in requests:
            if not r.tokens:
                raise ValueError(f"request {r.request_id!r}: the prompt token list is empty")
            if r.max_new_tokens <= 0:
                raise ValueError(f"request {r.request_id!r}: max_new_tokens must be > 0")
        if num_pages <= 0:
            raise ValueError("num_pages must be > 0")
        if page_size <= 0:
            raise ValueError("page_size must be > 0")
        self.pool = PagePool(num_pages, page_size)
        self.cache = RadixCache()  # m08
        self.namespace = "engine" if namespace is None else namespace
        self.prefix_caching = prefix_caching
        for r in requests:
            r.prompt_keys = prefix_keys(r.tokens, page_size, self.namespace)
        self.requests = list(requests)
        # Queues in list order: a step costs what is running or due, not every request ever seen.
        self._position = {id(r): i for i, r in enumerate(self.requests)}
        self.waiting: list[tuple[int, int, Request]] = [(r.arrival_step, i, r) for i, r in enumerate(self.requests)]
        heapq.heapify(self.waiting)
        self.running: list[Request] = []
        self.max_step_tokens = max_step_tokens
        self.spec_len = spec_len
        self.step_counter = 0
        self._why: list[str] = []

    def step(self) -> StepRecord:
        """Run one tick and return its record; the counter advances afterwards."""
        self._why = []
        admitted = self._admit()
        reused = self._reuse()
        self._draft()
        work = self._schedule()
        scheduled = tuple(r.request_id for r, _ in work)
        evicted: list[int] = []
        preempted = self._ensure_residency(work, evicted)
        executed = self._execute(work)
        drafted, accepted, rolled_back = self._resolve(work)
        published = self._publish(work)
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
            reused=_frozen(reused),
            published=_frozen(published),
            evicted=tuple(evicted),
            drafted=_frozen(drafted),
            accepted=_frozen(accepted),
            rolled_back=_frozen(rolled_back),
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

    def _reuse(self) -> dict[str, int]:
        """Cold requests adopt their longest cached prompt prefix; returns tokens reused."""
        # m08: at most (target-1)//page_size blocks, so one position is always computed; a preempted
        # request, whose target runs past its prompt, reuses every cached prompt block (D7).
        reused: dict[str, int] = {}
        if not self.prefix_caching:
            return reused
        ps = self.pool.page_size
        for r in self.running:
            if r.computed != 0 or r.page_table:
                continue
            hit = self.cache.match(r.prompt_keys)
            usable = min(len(hit), (r.target - 1) // ps)
            if usable > 0:
                r.page_table = hit[:usable]
                r.computed = usable * ps
                reused[r.request_id] = r.computed
                self._why.append(
                    f"{r.request_id} found {len(hit)} cached block(s) of its prompt and reused {usable} "
                    f"(pages {r.page_table}): {r.computed} token(s) it need not compute."
                )
        return reused

    def _draft(self) -> None:
        """Set ``draft_len`` for every running request (list order)."""
        # m09 (D1): only a request caught up except for its last sampled token drafts.
        for r in self.running:
            if r.generated >= 1 and r.computed == r.target - 1:
                r.draft_len = min(self.spec_len, r.max_new_tokens - r.generated - 1)
                if r.draft_len:
                    capped = " (capped so it cannot pass max_new_tokens)" if r.draft_len < self.spec_len else ""
                    self._why.append(f"{r.request_id} is caught up and asks for {r.draft_len} guess(es){capped}.")
            else:
                r.draft_len = 0

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

    def _ensure_residency(self, work: list[tuple[Request, int]], evicted: list[int]) -> list[str]:
        """Back every work item's positions with pages: evict, else preempt.

        Appends evicted page ids to ``evicted``, removes victims' items from
        ``work`` and returns the victims' ids in the order they were chosen.
        Raises ``Irreducible`` when the anchor alone needs more than the whole
        pool, and ``OutOfPages`` when nothing can be evicted and no victim is
        left.
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
            # m08: unreferenced cache pages go before anyone's computed state, but only when they
            # cover the shortfall: an eviction that spares no preemption only loses a block (D8).
            short, evictable = need - len(self.pool.free), self._evictable()
            if short <= evictable:
                freed = self._reclaim(short)
                self._why.append(
                    f"{need} page(s) needed but only {len(self.pool.free) - len(freed)} free: "
                    f"evicted unreferenced cache page(s) {freed}, deepest first."
                )
                evicted += freed
                continue
            victim = self._choose_victim(anchor, work)
            if victim is None:
                raise OutOfPages(f"step {self.step_counter} needs {need} page(s), only {len(self.pool.free)} free")
            self._why.append(
                f"{need} page(s) needed but only {len(self.pool.free)} free and {evictable} evictable cache page(s): "
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

    def _evictable(self) -> int:
        """How many cache pages leaf-by-leaf eviction could free now: those whose subtree holds no page
        of a running request's page table (D8)."""
        referenced = {p for r in self.running for p in r.page_table}
        count = 0
        pinned: set[int] = set()  # nodes whose subtree holds a referenced page
        stack = [(node, False) for node in self.cache.root.values()]
        while stack:  # post-order, without recursion: chains can be thousands of blocks deep
            node, children_done = stack.pop()
            if not children_done:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
            elif node.block in referenced or any(id(child) in pinned for child in node.children.values()):
                pinned.add(id(node))
            else:
                count += 1
        return count

    def _reclaim(self, k: int) -> list[int]:
        """Evict up to ``k`` unreferenced cache leaves, one search each; return their pages."""
        referenced = {p for r in self.running for p in r.page_table}
        freed: list[int] = []
        while len(freed) < k:
            leaf = next((key for key, node in self.cache.leaves() if node.block not in referenced), None)
            if leaf is None:
                break
            page = self.cache.remove_leaf(leaf)
            self.pool.release(page)
            freed.append(page)
        return freed

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
        """Release the victim's private pages and forget its computed state; keep its history.

        Its cache pages stay in the cache (m08).
        """
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

    def _resolve(self, work: list[tuple[Request, int]]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Apply each decode window's verdict: keep accepted guesses, roll back the rest.

        Returns ``(drafted, accepted, rolled_back)``, one entry per decode
        window in work order.  Prompt and recompute chunks record nothing.
        """
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        rolled_back: dict[str, int] = {}
        ps = self.pool.page_size
        for r, n in work:
            start = r.computed - n
            # m09 (D1): a window is a decode window only if it began at the last sampled token.
            if not (r.generated >= 1 and start == r.prompt_len + r.generated - 1):
                continue
            d = n - 1
            raw = r.accept_script.pop(0) if r.accept_script else d
            a = max(0, min(raw, d))
            if r.eos_after is not None:
                a = min(a, r.eos_after - r.generated)  # the EOS clamp
            r.computed -= d - a
            r.generated += a
            freed = []
            while len(r.page_table) > pages_for(r.computed, ps):
                page = r.page_table.pop()
                if self.pool.owner[page] == r.request_id:
                    self.pool.release(page)
                    freed.append(page)
            r.draft_len = 0
            drafted[r.request_id], accepted[r.request_id], rolled_back[r.request_id] = d, a, d - a
            if d:
                self._why.append(
                    f"{r.request_id}'s verifier accepted {a} of {d} guess(es) (verdict {raw}); "
                    f"{d - a} rolled back" + (f", freeing tail page(s) {freed}." if freed else ".")
                )
        return drafted, accepted, rolled_back

    def _publish(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        """Turn complete computed prompt blocks into cache pages; returns blocks inserted.

        A block whose key is already resident with another page is adopted:
        the request's table points at the resident page and its own copy is
        freed at once (departure D2).
        """
        published: dict[str, int] = {}
        if not self.prefix_caching:
            return published
        ps = self.pool.page_size
        for r, _ in work:
            c = min(r.computed, r.prompt_len) // ps
            keys = r.prompt_keys[:c]
            resident = self.cache.match(keys)
            # m08 (D2): first publisher wins; the others adopt its pages.
            adopted = []
            for i, page in enumerate(resident):
                if r.page_table[i] != page:
                    own = r.page_table[i]
                    r.page_table[i] = page
                    if self.pool.owner[own] == r.request_id:
                        self.pool.release(own)
                    adopted.append(own)
            if adopted:
                self._why.append(
                    f"{r.request_id}'s block(s) were already cached: it adopted the cached pages and freed its copies {adopted}."
                )
            if len(resident) < c:
                own_pages = r.page_table[len(resident) : c]
                self.cache.insert(keys, resident + own_pages)
                for page in own_pages:
                    self.pool.owner[page] = CACHE
                published[r.request_id] = c - len(resident)
                self._why.append(f"{r.request_id} published prompt block(s) on page(s) {own_pages} to the cache.")
        return published

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
        """Give back ``r``'s private pages, in page-table order; cache pages stay cached."""
        private = [page for page in r.page_table if self.pool.owner[page] == r.request_id]
        for page in private:
            self.pool.release(page)
        if private:
            self._why.append(f"{r.request_id} gave back private page(s) {private}.")
        r.page_table = []

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the pool and the cache are consistent.

        Every page is exactly one of free, private or cache-owned; a private
        page sits in its owner's page table and nowhere else; the cache's
        blocks are exactly the cache-owned pages; every page in an unfinished
        request's table is its own or the cache's; every unfinished request's
        table backs its computed positions.
        """
        free = set(self.pool.free)
        assert len(free) == len(self.pool.free), "a page is on the free list twice"
        cached: list[int] = []
        stack = [self.cache.root]
        while stack:
            for node in stack.pop().values():
                cached.append(node.block)
                stack.append(node.children)
        assert len(cached) == len(set(cached)) == self.cache.size, "a page is cached twice"
        for page, owner in enumerate(self.pool.owner):
            assert (owner is None) == (page in free), f"page {page}: owner {owner!r} vs free list"
            assert (owner is CACHE) == (page in cached), f"page {page}: owner {owner!r} vs cache"
        holders: dict[int, str] = {}
        for r in self.requests:
            if r.state is RequestState.FINISHED:
                assert not r.page_table, f"{r.request_id}: finished but holds pages"
                continue
            assert len(r.page_table) >= pages_for(r.computed, self.pool.page_size), (
                f"{r.request_id}: unbacked positions"
            )
            for page in r.page_table:
                owner = self.pool.owner[page]
                assert owner in (r.request_id, CACHE), f"{r.request_id}: page {page} belongs to {owner!r}"
                if owner is not CACHE:
                    assert page not in holders, f"private page {page} is in two tables"
                    holders[page] = r.request_id
        private = {p for p, o in enumerate(self.pool.owner) if isinstance(o, str)}
        assert private == set(holders), "a private page is in no owner's table"

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
