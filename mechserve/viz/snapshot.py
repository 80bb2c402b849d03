"""Where a step left the engine: page owners, page tables, the radix tree and (real models) the text so far.

A step record says what one step *decided*; a ``Snapshot`` says where that
left the engine right after it::

    pool.owner   [CACHE, r0, r0, CACHE, None, ...]   one owner per page (None: free)
    page tables  r2 -> (5, 6, 7)                     every live request's pages, position order
    radix tree   0 ─┬─ 4                             published blocks, flat, pre-order,
                    └─ 6                             each node pointing at its parent
    text         r2 -> " and the"                    generated text so far (real-model runs)

``capture`` reads any rung's engine by duck typing (``pool``, ``cache``,
``requests``), so it never imports a rung: a rung without a page pool
(m00–m02) gives ``owners is None`` and one without a radix cache (before
m08) gives ``tree is None``.  Live runs build one snapshot per step with
``Engine.run(on_step=...)`` (see ``mechserve.viz.trace.Recorder``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Cached(Enum):
    """The owner of a page that belongs to the radix cache (every rung's own ``CACHE`` maps here)."""

    CACHE = "CACHE"


CACHE = Cached.CACHE
Owner = str | Cached | None  # a request id, the cache, or None (free)
LIVE_STATES = ("WAITING", "RUNNING")


@dataclass(frozen=True)
class TreeNode:
    """One published block: its page, its parent's index in the flat tree (-1: a child of the root), its tokens.

    ``text`` is the block decoded (real-model runs only).
    """

    page: int
    parent: int
    tokens: tuple[int, ...]
    text: str | None = None


@dataclass(frozen=True)
class RequestView:
    """A live request after a step: its state, positions computed, tokens generated and page table."""

    state: str
    computed: int
    generated: int
    page_table: tuple[int, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """The engine right after step ``step``.

    ``owners`` (None for a rung without a page pool) has one entry per page;
    ``free`` is the free list in its order (the next page taken is
    ``free[0]``); ``tree`` (None before the radix cache) lists the cached
    blocks in pre-order; ``requests`` holds every request that has arrived
    and has not left (waiting or running), in the engine's list order;
    ``text`` (real-model runs only) each request's generated text so far.
    """

    step: int
    owners: tuple[Owner, ...] | None = None
    free: tuple[int, ...] | None = None
    tree: tuple[TreeNode, ...] | None = None
    requests: Mapping[str, RequestView] = field(default_factory=dict)
    text: Mapping[str, str] | None = None

    @property
    def num_pages(self) -> int:
        """Pages in the pool (0 without one)."""
        return 0 if self.owners is None else len(self.owners)

    def page_counts(self) -> dict[str, int]:
        """``{"free": ..., "owned": ..., "cached": ...}`` pages; they add up to ``num_pages``."""
        owners = self.owners or ()
        free = sum(1 for o in owners if o is None)
        cached = sum(1 for o in owners if o is CACHE)
        return {"free": free, "owned": len(owners) - free - cached, "cached": cached}


def _owner(value: object) -> Owner:
    """A rung's page owner as ours: a request id stays, None stays, any rung's CACHE becomes ``CACHE``."""
    if value is None or isinstance(value, str):
        return value
    if getattr(value, "value", None) == "CACHE":
        return CACHE
    raise ValueError(f"unknown page owner {value!r}")


def _state(request: Any) -> str:
    state = request.state
    return str(getattr(state, "value", state))


def tree_nodes(cache: Any, block_text: Callable[[Sequence[int]], str] | None = None) -> tuple[TreeNode, ...]:
    """The radix cache's nodes, flat in pre-order (children in insertion order), each naming its parent.

    Iterative, so a chain thousands of blocks deep costs no recursion.
    """
    nodes: list[TreeNode] = []
    stack: list[tuple[int, Any]] = [(-1, iter(cache.root.items()))]
    while stack:
        parent, children = stack[-1]
        item = next(children, None)
        if item is None:
            stack.pop()
            continue
        key, node = item
        tokens = tuple(key.block_tokens)
        text = block_text(tokens) if block_text is not None else None
        nodes.append(TreeNode(node.block, parent, tokens, text))
        if node.children:
            stack.append((len(nodes) - 1, iter(node.children.items())))
    return tuple(nodes)


def capture(
    engine: Any,
    step: int,
    text: Mapping[str, str] | None = None,
    block_text: Callable[[Sequence[int]], str] | None = None,
) -> Snapshot:
    """A ``Snapshot`` of ``engine`` after step ``step`` (call it right after ``engine.step()`` returned).

    ``text`` is stored as given (the caller decodes); ``block_text`` decodes
    a cached block's tokens for the tree (real-model runs).  Raises
    ``ValueError`` for a page owner that is neither None, a request id nor a
    cache marker.
    """
    pool = getattr(engine, "pool", None)
    cache = getattr(engine, "cache", None)
    owners = None if pool is None else tuple(_owner(o) for o in pool.owner)
    free = None if pool is None else tuple(pool.free)
    tree = None if cache is None else tree_nodes(cache, block_text)
    live: dict[str, RequestView] = {}
    for r in engine.requests:
        if _state(r) in LIVE_STATES and getattr(r, "arrival_step", 0) <= step:
            table = tuple(getattr(r, "page_table", ()))
            live[r.request_id] = RequestView(_state(r), r.computed, r.generated, table)
    return Snapshot(step, owners, free, tree, live, None if text is None else dict(text))
