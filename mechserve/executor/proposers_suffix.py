"""Suffix decoding: guesses from suffix trees over this request's ids and over past requests' outputs.

The method of SuffixDecoding (Oliaro et al., arXiv 2411.04975; vLLM's ``method: "suffix"``, which
calls Snowflake's arctic-inference ``SuffixDecodingCache``), written here from the paper::

    per-request tree   every substring of at most ``max_tree_depth`` ids of the request's prompt and
                       output so far, with how often each occurred (a depth-bounded suffix trie, grown
                       by one id per step: O(max_tree_depth) per id)
    global tree        the same over the outputs of the last ``max_cached_requests`` requests (running
                       ones included, grown as they generate); the oldest request's substrings are
                       taken out again when one more would pass the bound (eviction by request, FIFO)

    pattern            the request's last ids: every suffix of length m = 1 .. max_tree_depth - 1 that
                       is a path of a tree is a match
    draft              from the match's node, follow the most frequent child (ties: the smaller id):
                       p_j = count(child) / count(ids that followed the node), prob_j = p_1 * ... * p_j,
                       stop when prob_j < min_token_prob or after floor(max_spec_factor * m) ids (the
                       adaptive length: a longer match earns a longer draft) or the window's slots
    score              sum of prob_j (the expected number of accepted guesses); the best-scoring
                       draft over both trees and every match length wins (ties: the longer match,
                       then the request's own tree)

The guesses are point masses, verified exactly like prompt lookup's (``torch_executor``); nothing here
can change an output, only how many steps it takes.  Why our own trees and not arctic-inference's
(faster: C++): its only distribution on PyPI (0.3.0) is a source archive whose build imports torch and
needs CMake, nanobind and a C++20 compiler (with pip's build isolation it downloads a second torch),
which a clean CPU install cannot count on.  O(max_tree_depth) work per id appended (the request tree and,
for its output, the global tree) and per proposal (``Matcher``; the draft search stops at the first match
length that cannot win, ``best_draft``); a conversation's next turn takes the last turn's request tree over.
Replaying one batch-1 run's proposer calls (``docs/scripts/suffix_cost.py --baseline``), that was 0.30 ms
per decode step against 6.5 ms before (21.6x; agent and chat, fast mode, a machine at load ~15-20), almost
all of it ``Cursor.append`` growing the trees.

Most of what remained was Python's cyclic garbage collector, not tree work: a tree of node objects (each
with a children dict) gave the collector two tracked objects per node, so growing a tree set collections
off, and every full collection scanned every node alive, the kept trees' and the global tree's (up to
``max_cached_requests`` outputs: tens of millions of nodes in a long-running server).  The trees hold no
object per node (``SuffixTree``: int arrays and one dict of ints, which cost a collection nothing).  Measured
with SmolLM2 loaded (fast mode) and the collector on, old and new interleaved in one process on a machine at
load ~3-6 on 2 cores, CPU time of the measuring thread (``docs/scripts/suffix_gc.py --replay``): adding the
8 ``summarise`` prompts (221-272 ids, the last 16 trees kept) 21-26 ms against 270-312 ms (33-34 ms when no
full collection fell inside); a full collection with a global tree over 400 outputs of 128 ids (865k
nodes) 193-200 ms, what it takes without a tree (206-255 ms: the process's other objects), against
558-654 ms; one ``summarise`` batch-8 run's proposer calls (293 ``available``, 114 ``propose``) replayed six
times, every replay's proposer kept alive, 47-54 ms per replay against 270-480 ms (51 ms in the one replay
no full collection fell inside); ``suffix_cost.py --baseline``'s batch-1 replay (``summarise``, ``chat``
and ``agent``, 2 sessions each; wall time, load ~5-7) 0.28 ms per decode step against 0.88 ms.  The price:
an array entry is slower to read and write than an attribute (CPython 3.11 does not specialise it), so with
the collector off the tree work alone takes 1.3x (a prompt: 19.0 against 14.4 ms) to 2x (text that repeats
itself: 13.1 against 6.4 ms) what it took (1.5x and 2x in an earlier run).

The trees are native by default (``NativeSuffixTree``, ``NativeCursor``, ``NativeMatcher``,
``native_best_draft``: ``csrc/suffix_tree.cpp`` through ctypes, ``suffix_native``).  Growing the trees in
Python was still ~50 us per ``Cursor.append`` (up to ``max_tree_depth`` array and dict updates per id per
tree), 2% of the engine's wall time at batch 8 on text where nothing is ever drafted; natively an id
appended, a cursor's bulk ``extend`` (a prompt), a matcher's step and a whole draft search are one foreign
call each.  The native trees are the same algorithm step for step (node ids, free-id reuse, ties, the score
summed in double in the same order): proposals are identical, and the pure-Python trees stay as their
reference (the tests compare the two side by side) and their fallback.  ``MECHSERVE_SUFFIX_TREE``
(``mechserve.api.env``), read once per proposer: ``auto`` (native when it builds, else Python with one
warning), ``native`` (``NativeKernelError`` if it cannot be built) or ``python``.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mechserve.executor import suffix_native
from mechserve.executor.proposers import NO_DRAFT, Draft, Window

if TYPE_CHECKING:
    from mechserve.api.proposers import ProposerContext
    from mechserve.executor.request import ExecutorRequest


@dataclass(frozen=True, slots=True)
class Match:
    """A draft: ``ids``, its ``score`` (expected accepted guesses) and the match length it came from."""

    ids: tuple[int, ...] = ()
    score: float = 0.0
    length: int = 0


NO_MATCH = Match()

ROOT = 0  # the root's node id in every tree: the empty substring
_SHIFT = 32  # an edge's key in ``SuffixTree.edges``: (parent id << _SHIFT) | token id
MAX_TOKEN_ID = (1 << _SHIFT) - 1  # the largest token id a tree takes
NATIVE_MAX_DEPTH = 1 << 16  # the deepest native tree (the options allow 256: MAX_SUFFIX_TREE_DEPTH)
_NO_MEMORY = "no memory for the native suffix tree (a tree that ran out refuses every later change)"


class SuffixTree:
    """Every substring of at most ``max_depth`` ids of the sequences added, with counts (module docstring).

    Sequences are added whole (``add``) or one id at a time (``Cursor.append``) and taken out whole
    (``remove``, the ids ``add`` or the cursor put in).  ``nodes`` counts the nodes held (the memory:
    at most ``max_depth`` new nodes per id added).

    A node is an int, its node id (``ROOT``, 0: the empty substring); a node's fields are entries of int64
    arrays indexed by it: ``count[n]`` how often its substring occurred, ``out[n]`` how often an id followed it
    (the sum of its children's counts), ``best[n]`` its most frequent child's node id (ties: the child under the
    smaller token id; -1 without children), ``token[n]`` the token id on the edge into it.  The edges are one
    dict of ints, ``edges[(parent << 32) | token] = child``; a node's children are also chained (``_first``,
    ``_next``, ``_prev``: node ids, -1 ends the chain) so that ``best`` can be found again when a child loses a
    count.  Ids of dropped nodes are reused (``_free``, before ids never used: ``_top`` on); a free node's
    fields are a new one's (count and out 0, no children, not in a chain).  The memory: about 190 bytes a node
    (the edge's dict entry and its two ints, the arrays' entries), against 280 with an object per node.

    Why not one object per node: Python's cyclic garbage collector tracks an array as one object with nothing
    inside to visit, whatever its length, and a dict holding only ints not at all, so a tree of millions of
    nodes costs a collection what a tree of one does, where node objects and their children dicts were each
    tracked, counted towards the next collection and scanned (issue 27).
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.count = array("q", (0,))
        self.out = array("q", (0,))
        self.best = array("q", (-1,))
        self.token = array("q", (-1,))
        self._first = array("q", (-1,))
        self._next = array("q", (-1,))
        self._prev = array("q", (-1,))
        self._chain = (self._first, self._next, self._prev)
        self.edges: dict[int, int] = {}
        self._free = array("q")  # ids of dropped nodes, to reuse (the next one last)
        self._top = 1  # ids from here on were never used
        self.nodes = 1
        self.version = 0  # bumped by every remove(): node ids held elsewhere (a Matcher's) may be gone or reused

    @property
    def root(self) -> int:
        """The root's node id (``ROOT``)."""
        return ROOT

    def child(self, node: int, token: int) -> int:
        """The node id of ``node``'s child under ``token``; -1 when it has none."""
        return self.edges.get((node << _SHIFT) | token, -1) if 0 <= token <= MAX_TOKEN_ID else -1

    def children(self, node: int) -> dict[int, int]:
        """``node``'s children: token id -> node id, by token id."""
        found = {}
        c = self._first[node]
        while c >= 0:
            found[self.token[c]] = c
            c = self._next[c]
        return dict(sorted(found.items()))

    def _grow(self) -> None:
        """Room for more nodes: every array half as long again (at least 64 entries), blank."""
        more = max(64, len(self.count) // 2)
        blank = ((self.count, 0), (self.out, 0), (self.best, -1), (self.token, -1), *((c, -1) for c in self._chain))
        for column, value in blank:
            column.extend(array("q", (value,)) * more)

    def cursor(self) -> Cursor:
        """An empty sequence in this tree, to be grown id by id."""
        return Cursor(self)

    def add(self, ids: Sequence[int]) -> None:
        """Add every substring of ``ids`` of at most ``max_depth`` ids."""
        cur = self.cursor()
        for t in ids:
            cur.append(t)

    def remove(self, ids: Sequence[int]) -> None:
        """Take out what ``add(ids)`` put in (ids < 0 break the sequence, as in ``Cursor.append``); nodes
        left with a zero count are dropped (their ids freed for reuse).

        A node whose count falls to zero held only this occurrence, so everything under it is this
        occurrence's continuation, a chain of nodes of count one: the walk goes on down it, dropping each node
        (which leaves it with a free node's fields: no count, no children), instead of stopping."""
        self.version += 1
        count, out, best, edges = self.count, self.out, self.best, self.edges
        first, nxt, prev, free = self._first, self._next, self._prev, self._free
        n = len(ids)
        for i in range(n):
            node = ROOT
            for j in range(i, min(i + self.max_depth, n)):
                t = ids[j]
                if t < 0:
                    break
                key = (node << _SHIFT) | t
                child = edges.get(key, -1)
                assert child >= 0, "remove() of ids never added"
                out[node] -= 1
                left = count[child] = count[child] - 1
                if left == 0:  # drop it: out of the edges and of its parent's chain of children
                    del edges[key]
                    before, after = prev[child], nxt[child]
                    if before >= 0:
                        nxt[before] = after
                    else:
                        first[node] = after
                    if after >= 0:
                        prev[after] = before
                    prev[child] = -1
                    free.append(child)
                    self.nodes -= 1
                if child == best[node]:
                    self._rerank(node)
                node = child

    def _rerank(self, node: int) -> None:
        """A child of ``node`` lost a count or left: find the most frequent again (ties: the smaller token id)."""
        count, token, nxt = self.count, self.token, self._next
        top, top_token, found = 0, -1, -1
        c = self._first[node]
        while c >= 0:
            k = count[c]
            if k > top or (k == top and token[c] < top_token):
                top, top_token, found = k, token[c], c
            c = nxt[c]
        self.best[node] = found

    def matches(self, context: Sequence[int]) -> list[int]:
        """The node ids of the suffixes of ``context`` the tree holds, by length (``[m - 1]``: the last ``m`` ids),
        at most ``max_depth - 1`` of them; every shorter suffix of a held one is held, so they stop at the first
        miss.  O(max_depth ** 2) dict lookups (``Matcher`` keeps them up to date in O(max_depth) per id)."""
        n = len(context)
        edges = self.edges
        found: list[int] = []
        for m in range(1, min(n, self.max_depth - 1) + 1):
            node = ROOT
            for t in context[n - m :]:
                node = edges.get((node << _SHIFT) | t, -1) if 0 <= t <= MAX_TOKEN_ID else -1
                if node < 0:
                    return found
            found.append(node)
        return found

    def speculate(self, context: Sequence[int], num: int, max_spec_factor: float, min_token_prob: float) -> Match:
        """The best draft of at most ``num`` ids continuing ``context`` (module docstring); an empty
        ``Match`` when no suffix of ``context`` is in the tree or ``num <= 0``."""
        return best_draft(self, self.matches(context), num, max_spec_factor, min_token_prob)


def best_draft(
    tree: SuffixTree,
    matched: Sequence[int],
    num: int,
    max_spec_factor: float,
    min_token_prob: float,
    beat: Match | None = None,
) -> Match:
    """The best-scoring draft of at most ``num`` ids from the node ids of ``tree``'s matched suffixes
    (``matched[m - 1]``: the suffix of ``m`` ids), each followed greedily by its most frequent child (module
    docstring); ``beat`` (default: no draft) when none beats it.  A draft beats another with a higher score, or
    an equal score and a longer match.

    Matches are tried longest first, and the search stops at the first whose adaptive length cannot beat the
    best so far: a draft of ``b`` ids scores at most ``b`` (every path probability is at most 1), and a shorter
    match has no longer budget.  Where the text repeats itself the longest match drafts with probability 1
    and ends the search at once, so a proposal walks one path instead of one per match length.  Where it does
    not, the longest matches have never been followed (a request tree's longest suffixes occur once, at its
    end); a suffix that was followed has every shorter one followed too, so the longest followed match is found
    by bisection, O(log max_depth), not by trying each.
    """
    best = NO_MATCH if beat is None else beat
    if num <= 0:
        return best
    count, out, follow, token = tree.count, tree.out, tree.best, tree.token
    lo, hi = 0, len(matched)  # the longest match with a child: matched[lo - 1] (none: lo == 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if follow[matched[mid - 1]] >= 0:
            lo = mid
        else:
            hi = mid - 1
    for m in range(lo, 0, -1):
        budget = min(num, int(max_spec_factor * m))
        if budget < best.score or (budget == best.score and m <= best.length):
            break
        node = matched[m - 1]
        ids: list[int] = []
        prob, score = 1.0, 0.0
        child = follow[node]
        while len(ids) < budget and child >= 0:
            prob *= count[child] / out[node]
            if prob < min_token_prob:
                break
            ids.append(token[child])
            score += prob
            node = child
            child = follow[node]
        if ids and (score > best.score or (score == best.score and m > best.length)):
            best = Match(tuple(ids), score, m)
    return best


class Cursor:
    """The end of a sequence being added to ``tree`` id by id: the node ids of its last ``max_depth - 1``
    suffixes."""

    __slots__ = ("_active", "ids", "tree")

    def __init__(self, tree: SuffixTree) -> None:
        self.tree = tree
        self.ids: list[int] = []
        self._active: list[int] = [ROOT]

    def append(self, token: int) -> None:
        """Add ``token`` to the sequence: every suffix ending at it (of at most ``max_depth`` ids) gains one
        occurrence.  An unknown id (< 0) is kept in ``ids`` but breaks the sequence: no substring spans it.

        Raises ``ValueError`` for a token id above ``MAX_TOKEN_ID``."""
        if token < 0:
            self.ids.append(token)
            self._active = [ROOT]
            return
        if token > MAX_TOKEN_ID:
            raise ValueError(f"token id {token} is above the suffix tree's largest, {MAX_TOKEN_ID}")
        self.ids.append(token)
        tree = self.tree
        count, out, best, label, edges, free = tree.count, tree.out, tree.best, tree.token, tree.edges, tree._free
        first, nxt, prev, shift, top = tree._first, tree._next, tree._prev, _SHIFT, tree._top
        active = [ROOT]
        grown = active.append
        created = 0
        for node in self._active:
            key = (node << shift) | token
            # a longer suffix than one just created is new too (it holds that one as its suffix): no lookup
            child = -1 if created else edges.get(key, -1)
            if child < 0:  # a new node (its fields are a free node's: no children), first in its parent's chain
                if free:
                    child = free.pop()
                else:
                    child, top = top, top + 1
                    if child == len(count):
                        tree._grow()  # in place: the arrays bound here stay the tree's
                edges[key] = child
                count[child] = k = 1
                label[child] = token
                after = nxt[child] = first[node]
                if after >= 0:
                    prev[after] = child
                first[node] = child
                created += 1
            else:
                k = count[child] = count[child] + 1
            out[node] += 1
            rival = best[node]
            if rival != child:  # is the child now the most frequent? (ties: the smaller token id)
                if rival < 0:
                    best[node] = child
                else:
                    held = count[rival]
                    if k > held or (k == held and token < label[rival]):
                        best[node] = child
            grown(child)
        tree.nodes += created
        tree._top = top
        if len(active) > tree.max_depth:  # the root plus suffixes of 1 .. max_depth - 1 ids may still grow
            del active[tree.max_depth]
        self._active = active

    def extend(self, ids: Sequence[int]) -> None:
        """``append`` each of ``ids`` (as ints) in turn; ``NativeCursor.extend`` does it in one foreign call."""
        for t in ids:
            self.append(int(t))

    @property
    def matched(self) -> list[int]:
        """The node ids of the sequence's suffixes of 1 .. ``max_depth - 1`` ids (its own tree holds them all), as
        ``SuffixTree.matches`` would find them, at no cost."""
        return self._active[1:]


class Matcher:
    """A sequence's suffixes matched in a tree it is not added to (the global tree for a running request): its
    ``matched`` node ids, kept up to date in O(max_depth) per id appended.

    Ids other sequences add later can make a longer suffix match; the nodes are found afresh every
    ``REFRESH`` ids and after every ``SuffixTree.remove`` (which may drop a node held here, or free its id
    for another).
    """

    REFRESH = 16
    __slots__ = ("_fresh", "_nodes", "_seen", "_version", "tree")

    def __init__(self, tree: SuffixTree) -> None:
        self.tree = tree
        self._nodes: list[int] = []
        self._version = -1
        self._fresh = 0
        self._seen = 0

    def matched(self, ids: Sequence[int]) -> list[int]:
        """The node ids of the suffixes of ``ids`` (known ids only; ``ids`` extends the sequence of the last call)."""
        nodes, fresh = self._extend(ids)
        self._nodes, self._fresh, self._seen, self._version = nodes, fresh, len(ids), self.tree.version
        return nodes

    def peek(self, ids: Sequence[int]) -> list[int]:
        """What ``matched(ids)`` would return now, leaving the matcher as it is (the governor's question)."""
        return self._extend(ids)[0]

    def _extend(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """The node ids after ``ids`` and the ids extended since they were last found afresh (0: found now)."""
        tree = self.tree
        appended = len(ids) - self._seen
        if (
            appended < 0
            or self._version != tree.version
            or self._fresh + appended > self.REFRESH
            or appended > tree.max_depth
        ):
            return tree.matches(_known_tail(ids, tree.max_depth - 1)), 0
        nodes = self._nodes
        edges, longest = tree.edges, tree.max_depth - 2
        for t in ids[len(ids) - appended :] if appended else ():
            if t < 0:
                nodes = []
                continue
            grown = []
            for node in (ROOT, *nodes[:longest]):
                child = edges.get((node << _SHIFT) | t, -1)
                if child < 0:
                    break
                grown.append(child)
            nodes = grown
        return nodes, self._fresh + appended


# The native trees (the upkeep of growing the trees, module docstring) ---------------------------------------------------

_INT64_MAX = (1 << 63) - 1


def _ids_array(ids: Sequence[int]) -> array[int]:
    """``ids`` as an int64 array (``ids`` itself when it is one); ids beyond int64 (never in a tree) become -1
    (unknown: a miss, a break)."""
    if isinstance(ids, array) and ids.typecode == "q":
        return ids
    try:
        return array("q", ids)
    except OverflowError:
        return array("q", (t if -_INT64_MAX - 1 <= t <= _INT64_MAX else -1 for t in ids))


def _address(buf: array[Any]) -> int:
    return buf.buffer_info()[0]


class _Column:
    """One of a native tree's node fields read like the Python tree's arrays: ``column[node]`` (an int;
    ``IndexError`` outside the tree's node vectors) and ``len(column)`` (how many node ids have room)."""

    __slots__ = ("_field", "_tree")

    def __init__(self, tree: NativeSuffixTree, field: int) -> None:
        self._tree, self._field = tree, field

    def __getitem__(self, node: int) -> int:
        ok = array("q", (0,))
        value = self._tree._lib.mechserve_suffix_tree_field(self._tree._h, self._field, node, _address(ok))
        if not ok[0]:
            raise IndexError(f"node id {node} is out of the tree's range")
        return int(value)

    def __len__(self) -> int:
        return int(self._tree._lib.mechserve_suffix_tree_stat(self._tree._h, 2))


class NativeSuffixTree:
    """``SuffixTree`` in C++ (``csrc/suffix_tree.cpp``, through ``suffix_native``): the same nodes, node ids,
    counts, most frequent children and drafts (the Python tree is the reference it is tested against), at
    one foreign call per id appended (``NativeCursor``), per ``remove``, per ``matches`` and per draft
    (``native_best_draft``).

    ``matches`` (and ``NativeCursor.matched``, ``NativeMatcher.matched``) give node ids as an int64
    ``array`` (a sequence of ints, what ``native_best_draft`` reads without converting).  The node fields
    read as the Python tree's arrays do (``count[n]``, ``out[n]``, ``best[n]``, ``token[n]``: ints, one
    foreign call each; for tests and inspection, not hot paths).  The native memory (64 bytes a node: eight
    int64 fields, plus a hash map entry of 16 bytes, at most half full, for each child of a node with more
    than 8) is freed when the object is collected; it is bounded as the Python tree's is (freed node ids are
    reused before new ones).  Raises ``ValueError`` for ``max_depth`` outside 2 .. ``NATIVE_MAX_DEPTH``,
    ``NativeKernelError`` if the library cannot be built, ``MemoryError`` when native memory runs out: a change
    that ran out may have been half made, so from then on the tree refuses every change (``MemoryError`` again)
    and answers every question with nothing (no child, no match, no draft), never reading a half-made node.
    """

    __slots__ = (
        "__weakref__",
        "_ask",
        "_ask_at",
        "_best_draft",
        "_follow",
        "_h",
        "_lib",
        "_matches",
        "_real",
        "_real_at",
        "_scratch",
        "max_depth",
        "version",
    )

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_depth > NATIVE_MAX_DEPTH:  # each cursor and matcher holds max_depth node ids
            raise ValueError(f"max_depth must be <= {NATIVE_MAX_DEPTH} for the native suffix tree, got {max_depth}")
        self._h: int | None = None
        self._lib = lib = suffix_native.library()
        handle = lib.mechserve_suffix_tree_new(max_depth)
        if not handle:
            raise MemoryError("no memory for a native suffix tree")
        self._h = handle
        self.max_depth = max_depth
        self.version = 0  # bumped by every remove(), as the Python tree's
        self._matches, self._follow = lib.mechserve_suffix_tree_matches, lib.mechserve_suffix_tree_follow
        self._best_draft = lib.mechserve_suffix_tree_best_draft
        self._scratch = array("q", bytes(8 * max_depth))  # matches(): how many, then the node ids
        # best_draft's question and answer: num, the rival's match length, the winner's, its ids (int64) ...
        self._ask = array("q", bytes(8 * (3 + max_depth)))
        self._real = array("d", bytes(8 * 4))  # ... max_spec_factor, min_token_prob, the rival's score, the winner's
        self._ask_at, self._real_at = _address(self._ask), _address(self._real)

    def __del__(self) -> None:
        handle, self._h = getattr(self, "_h", None), None
        if handle:
            self._lib.mechserve_suffix_tree_destroy(handle)

    def __reduce_ex__(self, protocol: object) -> Any:
        """Refused (``TypeError``): a copy would share the native memory, and each would free it."""
        raise TypeError("a NativeSuffixTree cannot be copied or pickled: its nodes are native memory")

    @property
    def root(self) -> int:
        """The root's node id (``ROOT``)."""
        return ROOT

    @property
    def nodes(self) -> int:
        """How many nodes the tree holds (the root included)."""
        return int(self._lib.mechserve_suffix_tree_stat(self._h, 0))

    # the node fields, as the Python tree's arrays (one foreign call per entry read)
    count = property(lambda self: _Column(self, 0), doc="How often each node's substring occurred.")
    out = property(lambda self: _Column(self, 1), doc="How often an id followed each node.")
    best = property(lambda self: _Column(self, 2), doc="Each node's most frequent child (-1: none).")
    token = property(lambda self: _Column(self, 3), doc="The token id on the edge into each node.")
    _first = property(lambda self: _Column(self, 4))
    _next = property(lambda self: _Column(self, 5))
    _prev = property(lambda self: _Column(self, 6))

    @property
    def _top(self) -> int:
        return int(self._lib.mechserve_suffix_tree_stat(self._h, 1))

    @property
    def _free(self) -> list[int]:
        """The ids of dropped nodes, to reuse (the next one last), as the Python tree's ``_free``."""
        n = self._lib.mechserve_suffix_tree_stat(self._h, 3)
        buf = array("q", bytes(8 * n))
        self._lib.mechserve_suffix_tree_free_ids(self._h, _address(buf), n)
        return buf.tolist()

    def child(self, node: int, token: int) -> int:
        """The node id of ``node``'s child under ``token``; -1 when it has none."""
        if not 0 <= token <= MAX_TOKEN_ID or not 0 <= node <= _INT64_MAX:
            return -1
        return int(self._lib.mechserve_suffix_tree_child(self._h, node, token))

    def children(self, node: int) -> dict[int, int]:
        """``node``'s children: token id -> node id, by token id.  ``IndexError`` for a node id out of range."""
        cap = 16
        while True:
            tokens, kids = array("q", bytes(8 * cap)), array("q", bytes(8 * cap))
            n = self._lib.mechserve_suffix_tree_children(self._h, node, _address(tokens), _address(kids), cap)
            if n < 0:
                raise IndexError(f"node id {node} is out of the tree's range")
            if n <= cap:
                return dict(sorted(zip(tokens[:n].tolist(), kids[:n].tolist())))
            cap = n

    def cursor(self) -> NativeCursor:
        """An empty sequence in this tree, to be grown id by id."""
        return NativeCursor(self)

    def add(self, ids: Sequence[int]) -> None:
        """Add every substring of ``ids`` of at most ``max_depth`` ids (one foreign call).

        Raises ``ValueError`` at an id above ``MAX_TOKEN_ID`` (the ids before it added)."""
        self.cursor().extend(ids)

    def remove(self, ids: Sequence[int]) -> None:
        """Take out what ``add(ids)`` put in, as ``SuffixTree.remove`` (ids < 0 break the sequence; nodes left
        with a zero count dropped, their ids freed for reuse; ``version`` bumped).

        Raises ``ValueError`` when ``ids`` were never added (checked first: the tree is then unchanged; the
        Python tree fails its assertion part way), ``MemoryError`` when the tree ran out of memory before."""
        self.version += 1
        buf = _ids_array(ids)
        done = self._lib.mechserve_suffix_tree_remove(self._h, _address(buf), len(buf))
        if done == -2:
            raise MemoryError(_NO_MEMORY)
        if done != 0:
            raise ValueError("remove() of ids never added")

    def matches(self, context: Sequence[int]) -> array[int]:
        """The node ids of the suffixes of ``context`` the tree holds, by length (``[m - 1]``: the last ``m``
        ids), at most ``max_depth - 1`` of them, as ``SuffixTree.matches`` (one foreign call); an int64 array."""
        k = min(len(context), self.max_depth - 1)
        tail = _ids_array(context[len(context) - k :] if k > 0 else ())
        n = self._matches(self._h, _address(tail), len(tail), _address(self._scratch))
        return self._scratch[1 : n + 1]

    def speculate(self, context: Sequence[int], num: int, max_spec_factor: float, min_token_prob: float) -> Match:
        """The best draft of at most ``num`` ids continuing ``context``, as ``SuffixTree.speculate``."""
        return native_best_draft(self, self.matches(context), num, max_spec_factor, min_token_prob)


def native_best_draft(
    tree: NativeSuffixTree,
    matched: Sequence[int],
    num: int,
    max_spec_factor: float,
    min_token_prob: float,
    beat: Match | None = None,
) -> Match:
    """``best_draft`` on a native tree, in one foreign call: the same draft (ids, score to the last bit, match
    length), ``beat`` (default: no draft) itself when none beats it.  ``matched``: node ids of ``tree``
    (``NativeCursor.matched``, ``NativeMatcher.matched``, ``NativeSuffixTree.matches``: int64 arrays, read
    as they are; any other sequence of ints is converted).

    Raises ``ValueError`` for a node id that is not ``tree``'s, or a ``max_spec_factor`` whose product with a
    match length is not finite."""
    best = NO_MATCH if beat is None else beat
    if num <= 0 or not matched:
        return best
    nodes = matched if type(matched) is array else _ids_array(matched)
    ask, real = tree._ask, tree._real
    ask[0] = num if num < _INT64_MAX else _INT64_MAX
    ask[1] = best.length
    real[0], real[1], real[2] = max_spec_factor, min_token_prob, best.score
    n = tree._best_draft(tree._h, nodes.buffer_info()[0], len(nodes), tree._ask_at, tree._real_at)
    if n == 0:
        return best
    if n < 0:
        raise ValueError(
            "a matched node id is not in the tree" if n == -2 else f"max_spec_factor {max_spec_factor} is not finite"
        )
    return Match(tuple(ask[3 : n + 3]), real[3], ask[2])


class NativeCursor:
    """``Cursor`` on a ``NativeSuffixTree``: ``ids`` (the sequence, a list of ints), ``append``, ``extend`` and
    ``matched`` as the Python cursor's; each ``append``/``extend`` is one foreign call.  Its state (the tree's
    handle, how many suffixes, their node ids: int64) lives in an array the native code updates in place."""

    __slots__ = ("_append", "_extend", "_state", "_where", "ids", "tree")

    def __init__(self, tree: NativeSuffixTree) -> None:
        self.tree = tree  # held: the tree outlives its cursors
        self.ids: list[int] = []
        self._state = array("q", (tree._h or 0, 1, ROOT)) + array("q", bytes(8 * tree.max_depth))
        self._where = _address(self._state)
        self._append = tree._lib.mechserve_suffix_tree_append
        self._extend = tree._lib.mechserve_suffix_tree_extend

    def append(self, token: int) -> None:
        """Add ``token`` to the sequence (``Cursor.append``); an id < 0 is kept in ``ids`` but breaks it.

        Raises ``ValueError`` for a token id above ``MAX_TOKEN_ID`` (then nothing changes)."""
        if token < 0:
            self.ids.append(token)
            self._state[1] = 1
            return
        if token > MAX_TOKEN_ID:
            raise ValueError(f"token id {token} is above the suffix tree's largest, {MAX_TOKEN_ID}")
        if self._append(self._where, token):
            raise MemoryError(_NO_MEMORY)
        self.ids.append(token)

    def extend(self, ids: Sequence[int]) -> None:
        """``append`` each of ``ids`` in turn, in one foreign call (what a prompt or a step's new ids take).

        Raises ``ValueError`` at an id above ``MAX_TOKEN_ID`` (the ids before it added, it and the rest not)."""
        try:
            buf = array("q", ids)
        except OverflowError:  # an id beyond int64: one at a time, to raise where the Python cursor does
            for t in ids:
                self.append(int(t))
            return
        n = len(buf)
        if not n:
            return
        done = self._extend(self._where, buf.buffer_info()[0], n)
        if done < 0:
            raise MemoryError(_NO_MEMORY)
        if done < n:
            self.ids.extend(buf[:done].tolist())
            raise ValueError(f"token id {buf[done]} is above the suffix tree's largest, {MAX_TOKEN_ID}")
        self.ids.extend(buf.tolist())

    @property
    def matched(self) -> array[int]:
        """The node ids of the sequence's suffixes of 1 .. ``max_depth - 1`` ids (``Cursor.matched``): an int64
        array."""
        state = self._state
        return state[3 : 2 + state[1]]


class NativeMatcher:
    """``Matcher`` on a ``NativeSuffixTree``: the same node ids (int64 arrays), found afresh at the same times
    (every ``REFRESH`` ids, after every ``remove``); extending them by the new ids, or finding them afresh,
    is one foreign call."""

    REFRESH = Matcher.REFRESH
    __slots__ = ("_fresh", "_new", "_new_at", "_next", "_next_at", "_now", "_now_at", "_seen", "_version", "tree")

    def __init__(self, tree: NativeSuffixTree) -> None:
        self.tree = tree
        self._now = array("q", bytes(8 * tree.max_depth))  # how many node ids, then the ids held
        self._next = array("q", bytes(8 * tree.max_depth))  # the same, being found
        self._now_at, self._next_at = _address(self._now), _address(self._next)
        self._new = array("q", (0,))  # one new id (a decode step's): no array made for it
        self._new_at = _address(self._new)
        self._version = -1
        self._fresh = 0
        self._seen = 0

    @property
    def _nodes(self) -> array[int]:
        now = self._now
        return now[1 : now[0] + 1]

    def matched(self, ids: Sequence[int]) -> array[int]:
        """The node ids of the suffixes of ``ids`` (known ids only; ``ids`` extends the sequence of the last call)."""
        fresh, found = self._extend(ids)
        if found is self._next:
            self._now, self._next = found, self._now
            self._now_at, self._next_at = self._next_at, self._now_at
        self._fresh, self._seen, self._version = fresh, len(ids), self.tree.version
        return found[1 : found[0] + 1]

    def peek(self, ids: Sequence[int]) -> array[int]:
        """What ``matched(ids)`` would return now, leaving the matcher as it is (the governor's question)."""
        found = self._extend(ids)[1]
        return found[1 : found[0] + 1]

    def _extend(self, ids: Sequence[int]) -> tuple[int, array[int]]:
        """The ids extended since the node ids after ``ids`` were last found afresh (0: found now), and the
        buffer holding them (``_now`` when nothing changed, else ``_next``)."""
        tree = self.tree
        appended = len(ids) - self._seen
        if (
            appended < 0
            or self._version != tree.version
            or self._fresh + appended > self.REFRESH
            or appended > tree.max_depth
        ):
            tail = _ids_array(_known_tail(ids, tree.max_depth - 1))
            tree._matches(tree._h, tail.buffer_info()[0], len(tail), self._next_at)
            return 0, self._next
        if not appended:
            return self._fresh, self._now
        if appended == 1:
            t = ids[-1]
            # outside the tree's ids: a break (t < 0) or a miss from the root, as an unknown id (int64 either way)
            self._new[0] = t if 0 <= t <= MAX_TOKEN_ID else -1
            tree._follow(tree._h, self._now_at, self._new_at, 1, self._next_at)
        else:
            new = _ids_array(ids[len(ids) - appended :])
            tree._follow(tree._h, self._now_at, new.buffer_info()[0], appended, self._next_at)
        return self._fresh + appended, self._next


AnyTree = SuffixTree | NativeSuffixTree
AnyCursor = Cursor | NativeCursor
AnyMatcher = Matcher | NativeMatcher


@dataclass(slots=True)
class _Local:
    """One request's own tree (prompt and output so far) and how much of its output the global tree has."""

    tree: AnyTree
    cursor: AnyCursor
    prompt_len: int
    matcher: AnyMatcher  # its suffixes in the global tree
    in_global: bool = False  # its output went into the global tree (and stays out once evicted)


class SuffixProposer:
    """Suffix decoding (module docstring); a ``Proposer`` (``mechserve.executor.proposers``).

    ``max_tree_depth``: the longest substring either tree holds (and so the longest match, one less);
    ``max_cached_requests``: how many requests' outputs the global tree holds (0: no global tree);
    ``max_spec_factor``: a match of m ids drafts at most ``floor(max_spec_factor * m)`` ids;
    ``min_token_prob``: a guess whose path probability falls below it ends the draft.  vLLM's
    ``suffix_decoding_*`` options of the same names.  ``native``: whether its trees are the native ones
    (``MECHSERVE_SUFFIX_TREE``, read when it is made; module docstring); raises ``ValueError`` for a bad
    value and ``NativeKernelError`` under ``native`` when they cannot be built.

    The next turn of a conversation (multi-turn chat, an agent loop) is a new request whose prompt repeats
    the last one's prompt and answer: the trees of the last ``FINISHED_KEPT`` requests to leave are kept, and a
    new request whose ids start with all the ids one of them holds takes that tree over (the longest such)
    and adds only the rest, instead of adding its whole prompt again (O(max_tree_depth) per id: the
    largest cost left once proposals are incremental).  The tree is then exactly the one its ids would
    build, so proposals are unchanged.
    """

    FINISHED_KEPT = 16

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        # the trees' implementation, once per proposer (MECHSERVE_SUFFIX_TREE: module docstring)
        self.native = suffix_native.enabled()
        self._tree: Callable[[int], AnyTree] = NativeSuffixTree if self.native else SuffixTree
        self._matcher: Callable[[Any], AnyMatcher] = NativeMatcher if self.native else Matcher
        self._best_draft: Callable[..., Match] = native_best_draft if self.native else best_draft
        self.global_tree = self._tree(max_tree_depth)
        # request id -> its cursor in the global tree, oldest first (running and finished requests)
        self._cached: OrderedDict[str, AnyCursor] = OrderedDict()
        self._local: dict[str, _Local] = {}
        # request id -> the tree and cursor of a request that left, newest last (FINISHED_KEPT of them)
        self._finished: OrderedDict[str, tuple[AnyTree, AnyCursor]] = OrderedDict()

    @classmethod
    def build(cls, ctx: ProposerContext) -> SuffixProposer:
        """The registry's factory: the ``suffix_decoding_*`` options of ``ctx.speculative``."""
        spec = ctx.speculative
        return cls(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
        )

    # The Proposer protocol ------------------------------------------------------------------------------------------

    def propose(self, windows: Sequence[Window]) -> list[Draft]:
        """Every window's request synced first (its tree, its output into the global tree, in plan order), then
        the drafts: what a window gets depends on the plan and the releases only, never on which requests
        ``available`` was asked about (rank 0 alone answers it; every rank proposes)."""
        states = [self._sync(w.request, w.history, own=False) for w in windows]
        drafts = []
        for w, local in zip(windows, states):
            found = self._draft(local, w.history, w.slots, local.matcher.matched(w.history)).ids if w.slots else ()
            drafts.append(Draft(found) if found else NO_DRAFT)
        return drafts

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int:
        """The draft's length now; grows only the request's own tree and reads the global tree as it is (its
        matcher peeked at, not moved), so asking changes no proposal."""
        local = self._sync(request, history, own=True)
        in_global = local.matcher.peek(history) if self.max_cached_requests > 0 else ()
        return len(self._draft(local, history, cap, in_global).ids)

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None:
        local = self._local.pop(request.request_id, None)
        if local is not None and local.cursor.ids:  # for the conversation's next turn
            self._finished[request.request_id] = (local.tree, local.cursor)
            while len(self._finished) > self.FINISHED_KEPT:
                self._finished.popitem(last=False)
        if self.max_cached_requests > 0:
            self._sync_global(request.request_id, local is not None and local.in_global, output_ids, 0)

    def forget_finished(self) -> None:
        """Forget every request that has left: an empty global tree and no kept trees, what a new proposer
        knows.  A benchmark that repeats the same prompts calls it between repeats, so a repeat is not
        answered from the memory of its own earlier answers (``mechserve bench spec-decode``).

        Raises ``RuntimeError`` while a request is registered: its output is growing in the global tree."""
        if self._local:
            raise RuntimeError(f"forget_finished() with {len(self._local)} request(s) still registered")
        self._cached.clear()  # the old global tree's cursors: the tree (and its native memory) goes with them
        self.global_tree = self._tree(self.max_tree_depth)
        self._finished.clear()

    # Trees -------------------------------------------------------------------------------------------------------------

    @property
    def cached_requests(self) -> int:
        """Requests whose outputs the global tree holds now."""
        return len(self._cached)

    def score(self, request: ExecutorRequest, history: Sequence[int], num: int) -> Match:
        """What ``propose`` drafts for one window of ``request`` after ``history`` (at most ``num`` ids), with its
        score and match length."""
        local = self._sync(request, history, own=False)
        return self._draft(local, history, num, local.matcher.matched(history))

    def _draft(self, local: _Local, history: Sequence[int], num: int, in_global: Sequence[int]) -> Match:
        """The better of the request tree's draft and the global tree's (``in_global``: the matched nodes there)."""
        args = (num, self.max_spec_factor, self.min_token_prob)
        found = self._best_draft(local.tree, local.cursor.matched, *args)
        if self.max_cached_requests > 0:  # the global tree's wins with a higher score, or as high from a longer match
            found = self._best_draft(self.global_tree, in_global, *args, beat=found)
        return found

    def _sync(self, request: ExecutorRequest, history: Sequence[int], *, own: bool) -> _Local:
        """The request's tree holding ``history`` (grown by the ids since the last call; rebuilt when the history
        is not an extension of what it holds) and, unless ``own``,
        its output so far added to the global tree."""
        rid = request.request_id
        local = self._local.get(rid)
        if local is not None and not _extends(history, 0, local.cursor.ids, self.max_tree_depth):
            local = None
        if local is None:
            tree, cursor = self._adopt(history)
            local = _Local(tree, cursor, request.prompt_len, self._matcher(self.global_tree))
            local.in_global = self._local.pop(rid, None) is not None and rid not in self._cached
            self._local[rid] = local
        cursor = local.cursor
        if len(history) > len(cursor.ids):
            cursor.extend(history[len(cursor.ids) :])
        if not own and self.max_cached_requests > 0:
            self._sync_global(rid, local.in_global, history, local.prompt_len)
            local.in_global = True
        return local

    def _adopt(self, history: Sequence[int]) -> tuple[AnyTree, AnyCursor]:
        """The tree and cursor of the finished request holding the longest prefix of ``history`` (taken out of
        the kept ones), else a new tree's."""
        found, longest = None, 0
        for key, (_, cursor) in self._finished.items():
            held = cursor.ids
            n = len(held)
            if longest < n <= len(history) and held[-1] == history[n - 1] and list(history[:n]) == held:
                found, longest = key, n
        if found is not None:
            return self._finished.pop(found)
        tree = self._tree(self.max_tree_depth)
        return tree, tree.cursor()

    def _sync_global(self, rid: str, added: bool, ids: Sequence[int], start: int) -> None:
        """Add the output ids of ``rid`` (``ids[start:]``) that the global tree lacks (re-adding them all if they
        are not an extension of what it holds, judged as the request tree's history is; nothing if they were
        ``added`` before and evicted since); evict the oldest cached requests beyond ``max_cached_requests``.
        O(ids added) tree work; the check that the ids extend what it holds is one list comparison."""
        cursor = self._cached.get(rid)
        if cursor is None and added:
            return  # evicted while running: its output stays out
        if cursor is not None and not _extends(ids, start, cursor.ids, self.max_tree_depth):
            self.global_tree.remove(cursor.ids)
            cursor = self._cached[rid] = self.global_tree.cursor()
        if cursor is None:
            cursor = self._cached[rid] = self.global_tree.cursor()
            while len(self._cached) > self.max_cached_requests:
                _, oldest = self._cached.popitem(last=False)
                self.global_tree.remove(oldest.ids)
        if len(ids) > start + len(cursor.ids):
            cursor.extend(ids[start + len(cursor.ids) :])


def _extends(ids: Sequence[int], start: int, held: list[int], depth: int) -> bool:
    """Whether ``ids[start:]`` extends ``held`` (what a tree holds of it), exactly: a history changes only by a
    cut and regrowth (a rollback, a stop cut, a recompute after preemption), and regrowth may repeat the last
    ``depth`` ids while an earlier one changed (text repeating itself), so the whole of ``held`` is compared.
    One list comparison in C (microseconds for thousands of ids): the last ``depth`` ids are compared first,
    where a change almost always shows.  ``depth`` only orders the comparison."""
    end = start + len(held)
    if len(ids) < end:
        return False
    k = min(len(held), depth)
    if list(ids[end - k : end]) != held[len(held) - k :]:
        return False
    return list(ids[start : end - k]) == held[: len(held) - k]


def _known_tail(history: Sequence[int], num: int) -> list[int]:
    """The last ``num`` ids of ``history`` after its last unknown (negative) id."""
    tail = list(history[-num:]) if num > 0 else []
    for j in range(len(tail) - 1, -1, -1):
        if tail[j] < 0:
            return tail[j + 1 :]
    return tail


__all__ = [
    "MAX_TOKEN_ID",
    "ROOT",
    "Cursor",
    "Match",
    "Matcher",
    "NativeCursor",
    "NativeMatcher",
    "NativeSuffixTree",
    "SuffixProposer",
    "SuffixTree",
    "best_draft",
    "native_best_draft",
]
