"""The simulator's replica: m15's ``Engine`` with its eviction search replaced by an equal, faster one.

m15's radix cache finds each eviction victim by walking the tree from the root (``RadixCache.leaves``:
the first unreferenced childless node in depth-first pre-order, children in insertion order), once
per evicted page.  A replica that is always full evicts on most steps, and the walk visits every
node the running requests hold before it finds one: at fleet scale that walk was most of the
simulation's time.  ``FastEngine`` keeps the cache's childless nodes in a list sorted by their
pre-order position instead, so a victim costs a skip over the held leaves (at most one per running
request) and a bisection:

* every node gets a creation number; a node's *path* is the creation numbers from the root down to
  it.  Children sit in insertion (= creation) order, so sorting paths as tuples is pre-order;
* a request holds its cache pages as one chain from the root (m08, D2), so the first unreferenced
  childless node in pre-order is the first unreferenced path in the sorted leaf list.

Two more hot paths are replaced the same way: publish resumes each running request's chain match
where its last publish ended (``_publish``), and the count of evictable pages (m08's D8) is the cache
size minus the cache pages running requests hold, instead of a post-order walk (``_evictable``); the
slot contents, which nothing in a simulation reads, are not written (``_apply``).  Nothing else differs: ``tests/property/test_fleet_engine.py`` checks on random workloads (eviction,
preemption, output caching, resets) that ``FastEngine`` produces m15's records, KV events included,
and its state passes m15's ``check_invariants``.  Standard library only.
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Sequence
from typing import Any

from mechserve.spec import m15_routing as m15


class _Node(m15.RadixNode):
    """A radix node that knows its parent (None at the root), its key and its pre-order path."""

    __slots__ = ("key", "parent", "path")

    def __init__(self, block: int, key: m15.PrefixKey, parent: _Node | None, path: tuple[int, ...]) -> None:
        super().__init__(block)
        self.key = key
        self.parent = parent
        self.path = path


class FastRadixCache(m15.RadixCache):
    """m15's ``RadixCache`` plus a sorted index of its childless nodes (``leaves`` in pre-order, kept, not walked)."""

    def __init__(self) -> None:
        super().__init__()
        self.created = 0
        self.leaf_paths: list[tuple[int, ...]] = []  # sorted: pre-order
        self.at: dict[tuple[int, ...], _Node] = {}

    def insert(self, keys: Sequence[m15.PrefixKey], blocks: Sequence[int]) -> int:
        if len(keys) != len(blocks):
            raise ValueError(f"insert: {len(keys)} keys but {len(blocks)} blocks")
        parent_key: m15.PrefixKey | None = m15.ROOT
        for key in keys:
            if key.parent != parent_key:
                raise ValueError("insert: keys are not a chain starting at ROOT")
            parent_key = key
        created = 0
        children = self.root
        parent: _Node | None = None
        for key, block in zip(keys, blocks):
            node = children.get(key)
            if node is None:
                if parent is not None and not parent.children:
                    self._unleaf(parent)
                self.created += 1
                node = _Node(block, key, parent, (parent.path if parent else ()) + (self.created,))
                children[key] = node
                self.at[node.path] = node
                bisect.insort(self.leaf_paths, node.path)
                created += 1
            elif node.block != block:
                raise ValueError(f"insert: key already holds block {node.block}, not {block}")
            children = node.children
            parent = node  # type: ignore[assignment]
        self.size += created
        return created

    def extend(self, parent: _Node | None, keys: Sequence[m15.PrefixKey], blocks: Sequence[int]) -> _Node | None:
        """Create nodes for ``keys`` (absent, a chain) under ``parent`` (None: the root), as ``insert``
        would; return the last one (``parent`` if ``keys`` is empty)."""
        for key, block in zip(keys, blocks):
            children = parent.children if parent else self.root
            if parent is not None and not parent.children:
                self._unleaf(parent)
            self.created += 1
            node = _Node(block, key, parent, (parent.path if parent else ()) + (self.created,))
            children[key] = node
            self.at[node.path] = node
            bisect.insort(self.leaf_paths, node.path)
            parent = node
        self.size += len(keys)
        return parent

    def _unleaf(self, node: _Node) -> None:
        i = bisect.bisect_left(self.leaf_paths, node.path)
        del self.leaf_paths[i]

    def leaves(self) -> Any:
        return ((self.at[p].key, self.at[p]) for p in list(self.leaf_paths))

    def remove_leaf(self, key: m15.PrefixKey) -> int:
        node = self._find(key)
        if node.children:
            raise ValueError("remove_leaf: node has children")
        return self._remove(node)

    def _find(self, key: m15.PrefixKey) -> _Node:
        chain = []
        k: m15.PrefixKey | None = key
        while k is not None:
            chain.append(k)
            k = k.parent
        children = self.root
        node = None
        for k in reversed(chain):
            node = children.get(k)
            if node is None:
                raise ValueError("remove_leaf: key is not in the cache")
            children = node.children
        return node  # type: ignore[return-value]

    def _remove(self, node: _Node) -> int:
        parent = node.parent
        del (parent.children if parent else self.root)[node.key]
        self._unleaf(node)
        del self.at[node.path]
        if parent is not None and not parent.children:
            bisect.insort(self.leaf_paths, parent.path)
        self.size -= 1
        return node.block

    def first_unreferenced_leaf(self, referenced: set[int]) -> _Node | None:
        """The node m15's ``_reclaim`` would evict next: the first childless one in pre-order whose
        page is not in ``referenced``."""
        for path in self.leaf_paths:
            node = self.at[path]
            if node.block not in referenced:
                return node
        return None


class FastEngine(m15.Engine):
    """m15's ``Engine`` over a ``FastRadixCache``; ``_reclaim`` takes its victims from the sorted leaves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache = FastRadixCache()
        self._memo: dict[
            str, tuple[list[int], int, _Node]
        ] = {}  # request -> (its page table, blocks matched, last node)

    def _reclaim(self, k: int) -> list[int]:
        referenced = {p for r in self.running for p in r.page_table}
        cache = self.cache
        assert isinstance(cache, FastRadixCache)
        freed: list[int] = []
        while len(freed) < k:
            node = cache.first_unreferenced_leaf(referenced)
            if node is None:
                break
            page = cache._remove(node)
            self.pool.release(page)
            freed.append(page)
        if freed:  # m15, as in the rung
            self._events.append(m15.BlockRemoved(tuple(self._page_hash.pop(page) for page in freed)))
        return freed

    def _publish(self, work: list[tuple[m15.Request, int]]) -> dict[str, int]:
        """m15's ``_publish``, but a running request's match resumes where its last publish ended.

        A running request's cache pages are referenced, so nothing evicts them: while its page table
        is the same list, its first ``n`` blocks are still resident on the pages it holds, under the
        same node.  The rung matches the whole chain again every step; this matches from block ``n``.
        """
        published: dict[str, int] = {}
        if not self.prefix_caching:
            return published
        ps = self.pool.page_size
        cache = self.cache
        assert isinstance(cache, FastRadixCache)
        for r, _ in work:
            if self.output_caching:
                c = r.computed // ps
                keys = self._block_keys(r, c)
            else:
                c = min(r.computed, r.prompt_len) // ps
                keys = r.prompt_keys[:c]
            n, node = 0, None
            memo = self._memo.get(r.request_id)
            if memo is not None and memo[0] is r.page_table and cache.at.get(memo[2].path) is memo[2] and memo[1] <= c:
                n, node = memo[1], memo[2]
            resident = r.page_table[:n]
            children = node.children if node is not None else cache.root
            for key in keys[n:]:
                found = children.get(key)
                if found is None:
                    break
                resident.append(found.block)
                node, children = found, found.children  # type: ignore[assignment]
            adopted = []
            for i in range(n, len(resident)):
                page = resident[i]
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
                node = cache.extend(node, keys[len(resident) :], own_pages)
                for page in own_pages:
                    self.pool.owner[page] = m15.CACHE
                published[r.request_id] = c - len(resident)
                self._stored(r, keys, len(resident), own_pages)
                generated = c - max(len(resident), r.prompt_len // ps)
                what = f"block(s), {generated} holding generated tokens," if generated > 0 else "prompt block(s)"
                self._why.append(f"{r.request_id} published {what} on page(s) {own_pages} to the cache.")
                resident_n = c
            else:
                resident_n = len(resident)
            if node is not None:
                self._memo[r.request_id] = (r.page_table, resident_n, node)
        return published

    def _plan(self, work: list[tuple[m15.Request, int]]) -> tuple[m15.PlanItem, ...]:
        """m15's ``_plan`` with the placements built in one comprehension (the same tuples)."""
        ps = self.pool.page_size
        plan = []
        for r, n in work:
            start, prompt_len, generated = r.computed, len(r.tokens), r.generated
            target = prompt_len + generated
            decode = generated >= 1 and start == target - 1
            end = min(start + n, target)
            known = r.tokens[start:end] + r.output_ids[max(0, start - prompt_len) : max(0, end - prompt_len)]
            pt = r.page_table
            plan.append(
                m15.PlanItem(
                    r.request_id,
                    start,
                    n,
                    r.draft_len,
                    decode,
                    tuple([(p, pt[p // ps], p % ps) for p in range(start, start + n)]),
                    tuple(known),
                    decode or start + n == target,
                    generated,
                    tuple(pt),
                )
            )
        return tuple(plan)

    def _apply(
        self, work: list[tuple[m15.Request, int]], plan: tuple[m15.PlanItem, ...], outcomes: Any
    ) -> tuple[dict[str, int], dict[str, m15.Outcome]]:
        """m15's ``_apply`` (the same checks, the same results) without writing each position's slot:
        nothing in a simulation reads ``pool.slots`` (no record field, decision or invariant does)."""
        if len(outcomes) != len(plan) or any(
            out.request_id != item.request_id
            or out.start_position != item.start_position
            or out.executed_tokens != item.num_tokens
            or out.writes is not item.placements
            or (out.accepted_draft_tokens != 0 and not item.decode)
            or (item.decode and not 0 <= out.accepted_draft_tokens <= item.num_tokens - 1)
            or len(out.token_ids) != (out.accepted_draft_tokens + 1 if item.sample else 0)
            or (out.forced and not item.sample)
            for item, out in zip(plan, outcomes)
        ):
            return super()._apply(work, plan, outcomes)  # the rung says what is wrong, and raises
        executed: dict[str, int] = {}
        verdicts: dict[str, m15.Outcome] = {}
        for (r, _), out in zip(work, outcomes):
            r.computed += out.executed_tokens
            executed[r.request_id] = out.executed_tokens
            verdicts[r.request_id] = out
            self._why.append(
                f"{r.request_id} computed {out.executed_tokens} token(s), positions {r.computed - out.executed_tokens}..{r.computed - 1}."
            )
        return executed, verdicts

    def _release(self, r: m15.Request) -> None:
        self._memo.pop(r.request_id, None)
        super()._release(r)

    def _evictable(self) -> int:
        """m15's ``_evictable`` (D8) without the post-order walk: a running request's cache pages are
        one chain from the root, so the nodes whose subtree holds a referenced page are exactly the
        referenced cache pages, and the rest of the cache is evictable."""
        owner = self.pool.owner
        held = {p for r in self.running for p in r.page_table if owner[p] is m15.CACHE}
        return self.cache.size - len(held)

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self.cache = FastRadixCache()
        return done


# the Engine's parameters, for callers that read them (mechserve.workload passes only what a rung takes)
FastEngine.__signature__ = inspect.signature(m15.Engine)  # type: ignore[attr-defined]
