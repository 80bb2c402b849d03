"""m16 — Per-request draft lengths.

Key question: when one request's guesses pay and its batchmates' do not, why give them all the same window?

Up to m15 rule D1 gives every caught-up request the same window, ``min(spec_len, max_new_tokens -
generated - 1)`` guesses, and the executor computes every position the plan names (m10).  At batch 1
the window is exactly what the one proposer proposes; in a batch, one request with a long match
raises ``spec_len`` for all, and each batchmate with nothing to propose pays a full window of
guesses that will be rolled back.  The serving literature picks the proposal length per request
(SmartSpec's goodput, the dynamic speculation length papers); the scheduler must know, because the
window's length decides the positions, pages and budget a request takes.  m16 is m15 (one engine
plus its routing, unchanged) plus one request field and one control call::

    control side, between steps:  limit_drafts({id: limit | None, ...})      a limit stays until changed
    workload:                     draft_limit_script [l1, l2, ...]          one entry per draft decision
    D1:   draft_len := min(spec_len, max_new_tokens - generated - 1, draft_limit, script entry)

With no limit anywhere every record is m15's.  The rules are in
``mech-notes/16-request-draft-lengths.md``.
"""

from __future__ import annotations

import hashlib
import heapq
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Protocol

TITLE = "Per-request draft lengths"
KEY_QUESTION = "When one request's guesses pay and its batchmates' do not, why give them all the same window?"
NOTE = "16-request-draft-lengths.md"

# m10: the scripted model's reserved end-of-sequence id; its other ids are >= 1.
EOS_TOKEN_ID = 0


class OutOfPages(Exception):
    """The pages a step needs exceed the free pages and no victim is left."""


class Irreducible(OutOfPages):
    """The anchor alone needs more pages than the whole pool holds."""


class BoundaryViolation(Exception):
    """An executor's result broke the boundary's contract; nothing was applied."""


class GroupViolation(Exception):
    """The ranks' reports cannot be joined: a bad rank set, world size or a disagreement."""


class RequestState(Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    REJECTED = "REJECTED"  # m12: refused at the door
    ABORTED = "ABORTED"  # m12: left before finishing


class FinishReason(Enum):
    LENGTH = "LENGTH"
    EOS = "EOS"
    STOP = "STOP"  # m12: a stop token id


# m12: why the door refused a request.
class RejectReason(Enum):
    EMPTY_PROMPT = "EMPTY_PROMPT"
    BAD_MAX_NEW_TOKENS = "BAD_MAX_NEW_TOKENS"
    DUPLICATE_ID = "DUPLICATE_ID"
    TOO_LONG = "TOO_LONG"
    NEVER_FITS = "NEVER_FITS"
    OVERLOADED = "OVERLOADED"


class Cache(Enum):
    """The owner marker of a page that belongs to the radix cache."""

    CACHE = "CACHE"


CACHE = Cache.CACHE


class Sample(Enum):
    """What one sample produced: a real token, the end-of-sequence marker, or a stop token."""

    TOKEN = "TOKEN"
    EOS = "EOS"
    STOP = "STOP"  # m12


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


# m15: the block hash a router indexes, vLLM's ``sha256_cbor_64bit`` (vllm/v1/core/kv_cache_utils.py,
# ``hash_block_tokens``) as llm-d's indexer recomputes it (llm-d-kv-cache-manager,
# pkg/kvcache/kvblock/token_processor.go): hash i = low 64 bits of sha256(CBOR([hash i-1, tokens, null])).
def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR head (RFC 8949 4.2.1): major type ``major``, argument ``n`` in the fewest bytes."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"CBOR cannot hold the integer {n}")


def _cbor(value: object) -> bytes:
    """Canonical CBOR of an int, a str, None or a list/tuple of them (all a block hash needs)."""
    if isinstance(value, bool):
        raise TypeError("a block hash holds no booleans")
    if isinstance(value, int):
        return _cbor_uint(value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if value is None:
        return b"\xf6"
    if isinstance(value, list | tuple):
        return _cbor_head(4, len(value)) + b"".join([_cbor(item) for item in value])
    raise TypeError(f"a block hash holds no {type(value).__name__}")


_UINT: dict[int, bytes] = {}  # the encodings of the ids met so far: a block hash encodes one per token


def _cbor_uint(n: int) -> bytes:
    head = _UINT.get(n)
    if head is None:
        head = _cbor_head(0, n)
        if n < 1 << 20:
            _UINT[n] = head
    return head


def _low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")


def hash_root(seed: str = "") -> int:
    """The parent hash of a prompt's first block: low 64 bits of sha256(CBOR(seed)).

    vLLM's ``NONE_HASH`` with ``PYTHONHASHSEED=seed`` and llm-d's ``HashSeed``: engines and router must
    share the seed (default ``""``, llm-d's default) or their hashes never meet.
    """
    return _low64(_cbor(seed))


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The 64-bit hash of one complete block of ``tokens`` whose prefix hashes to ``parent``.

    ``parent`` is the previous block's hash (``hash_root(seed)`` for block 0); no extra keys (no
    LoRA adapter, no multimodal input, no cache salt), so the payload is ``[parent, tokens, null]``.
    """
    if tokens and min(tokens) < 0:
        return _low64(_cbor([parent, tuple(tokens), None]))
    encode = _UINT.get
    ids = b"".join([encode(t) or _cbor_uint(t) for t in tokens])  # the common case, without recursion
    head = b"\x83\x1b" + parent.to_bytes(8, "big") if parent >= 1 << 32 else b"\x83" + _cbor_uint(parent)
    return _low64(head + _cbor_head(4, len(tokens)) + ids + b"\xf6")


def block_hashes(tokens: Sequence[int], page_size: int, root: int) -> list[int]:
    """The chained hashes of the ``len(tokens) // page_size`` complete blocks of ``tokens`` (no partial block)."""
    hashes: list[int] = []
    parent = root
    for i in range(len(tokens) // page_size):
        parent = block_hash(parent, tokens[i * page_size : (i + 1) * page_size])
        hashes.append(parent)
    return hashes


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
    state exists; ``draft_len`` is the guesses asked for this step;
    ``output_ids`` are the token ids appended so far (an EOS or stop id
    included).  A sampled id in ``stop_token_ids`` finishes the request with
    STOP; ``ignore_eos`` makes the engine's EOS ids ordinary tokens (the
    scripted ``eos_after`` trigger still applies).  ``block_keys`` (m13)
    are the prefix keys of the complete blocks of prompt + output ids found
    so far: the prompt's keys, then keys over appended ids.  ``forced_script``
    (m14) is the scripted grammar: output index ``i`` -> the ids forced after
    the id at index ``i`` when that id is the last one a sampling outcome
    appends.  ``block_hashes`` (m15) are the ``block_hash`` chain of the
    same blocks, the names its KV events give them (vLLM's ``Request.block_hashes``).
    ``draft_limit`` (m16) is the most guesses the request's next decode
    window may carry (None: no limit), set by ``Engine.limit_drafts``;
    ``draft_limit_script`` (m16) holds one limit per draft decision, consumed
    from the front by the engine (absent or used up: no limit from it).
    """

    request_id: str
    tokens: list[int]  # m08: the prompt is explicit token ids
    max_new_tokens: int
    arrival_step: int = 0
    eos_after: int | None = None
    accept_script: list[int] | None = None  # m09
    stop_token_ids: tuple[int, ...] = ()  # m12
    ignore_eos: bool = False  # m12
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    generated: int = 0
    computed: int = 0
    page_table: list[int] = field(default_factory=list)  # m03: page ids, position order
    prompt_keys: list[PrefixKey] = field(default_factory=list, repr=False)  # m08: set by the engine
    draft_len: int = 0  # m09
    output_ids: list[int] = field(default_factory=list)  # m10: ids the executor appended
    reject_reason: RejectReason | None = None  # m12
    block_keys: list[PrefixKey] = field(default_factory=list, repr=False)  # m13: prompt + output blocks
    forced_script: dict[int, tuple[int, ...]] | None = None  # m14: output index -> forced ids
    block_hashes: list[int] = field(default_factory=list, repr=False)  # m15: block_hash of each block_keys entry
    draft_limit: int | None = None  # m16: the most guesses a window may carry; None: no limit
    draft_limit_script: list[int] | None = None  # m16: one limit per draft decision, front first

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


# m15: KV events, vLLM's schema (vllm/distributed/kv_events.py): how an engine tells a router what its cache holds.
MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the engine's own KV pool (its first tier) on any device


@dataclass(frozen=True)
class BlockStored:
    """Blocks one request published in one step: one chain, in position order.

    ``block_hashes[0]`` chains from ``parent_block_hash`` (None when it is the sequence's first block)
    and each later hash from the one before; ``token_ids`` are the ``len(block_hashes) * block_size``
    ids the blocks hold; ``lora_id`` is None (no adapters) and ``medium`` is ``MEDIUM``.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache, in eviction order (deepest first)."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone (``Engine.reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_EVENT_FIELDS: dict[str, tuple[type, tuple[str, ...]]] = {
    "BlockStored": (BlockStored, ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium")),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}


@dataclass(frozen=True)
class KVEventBatch:
    """One engine's events of one step: ``ts`` (vLLM: seconds since the epoch; the spec: the step),
    ``events`` in the order they happened, ``data_parallel_rank`` the replica that emitted them."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None

    def to_wire(self) -> list[Any]:
        """The batch as vLLM's msgpack encoder lays it out (msgspec ``array_like`` structs, tagged
        events), ready for any msgpack packer: ``[ts, [event, ...], data_parallel_rank]`` with
        ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
        ``["BlockRemoved", block_hashes, medium]`` and ``["AllBlocksCleared"]``; the rank is left
        out when None.  llm-d's ``kvevents`` decoder reads exactly this."""
        events = [
            [type(e).__name__, *(_wire(getattr(e, name)) for name in _EVENT_FIELDS[type(e).__name__][1])]
            for e in self.events
        ]
        return [self.ts, events] + ([] if self.data_parallel_rank is None else [self.data_parallel_rank])

    @staticmethod
    def from_wire(wire: Sequence[Any]) -> KVEventBatch:
        """The inverse of ``to_wire``.  Raises ``ValueError`` for an unknown tag or a wrong field count."""
        if not 2 <= len(wire) <= 3:
            raise ValueError(f"a KV event batch has 2 or 3 fields, not {len(wire)}")
        events: list[KVEvent] = []
        for raw in wire[1]:
            tag, *values = raw
            if tag not in _EVENT_FIELDS:
                raise ValueError(f"unknown KV event {tag!r}")
            kind, names = _EVENT_FIELDS[tag]
            if len(values) != len(names):
                raise ValueError(f"{tag} has {len(names)} field(s), got {len(values)}")
            args = {n: tuple(v) if isinstance(v, list) else v for n, v in zip(names, values)}
            events.append(kind(**args))
        return KVEventBatch(wire[0], tuple(events), wire[2] if len(wire) == 3 else None)


def _wire(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


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
    tokens: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: _frozen({}))  # m10 (E2)
    rejected: tuple[tuple[str, RejectReason], ...] = ()  # m12: (id, reason) pairs, in refusal order
    aborted: tuple[str, ...] = ()  # m12
    # m14: forced ids appended this step (the tail of ``tokens``); not a JSON field, see to_json.
    forced: Mapping[str, int] = field(default_factory=lambda: _frozen({}))
    # m15: the cache changes of the step (and of calls since the last one), vLLM's events; not a JSON field.
    kv_events: tuple[KVEvent, ...] = ()
    explain: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict, trace fields in contract order.

        m14: ``forced`` is not among them: the forced ids of ``tokens[id]`` are the ones after its
        first ``accepted.get(id, 0) + 1``, so the JSON trace of every workload is m13's form.
        """
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
            "tokens": {k: list(v) for k, v in self.tokens.items()},
            "rejected": [[k, v.value] for k, v in self.rejected],
            "aborted": list(self.aborted),
        }


# m10: the messages that cross the boundary, and the built-in scripted executor.
Placement = tuple[int, int, int]  # (position, page_id, offset)


@dataclass(frozen=True)
class PlanItem:
    """One work item as the executor sees it.

    The executor computes positions ``[start_position, start_position +
    num_tokens)``.  ``token_ids`` are the ids of those positions already
    known (prompt ids, recomputed ids, or for a decode window the last
    sampled id); the ``num_tokens - len(token_ids)`` positions after them are
    the executor's own guesses.  ``placements`` says where each position's
    state must be written; ``page_table`` backs every position up to the end
    of the item (reads go through it).  ``sample`` is true when the item
    ends at the request's frontier and must return sampled ids;
    ``generated`` counts the tokens sampled before this step.
    """

    request_id: str
    start_position: int
    num_tokens: int
    draft_len: int
    decode: bool
    placements: tuple[Placement, ...]
    token_ids: tuple[int, ...]
    sample: bool
    generated: int
    page_table: tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """An executor's answer for one plan item.

    ``accepted_draft_tokens`` is the verdict (0 for a non-decode item);
    ``writes`` the placements actually written; ``token_ids`` the ids
    appended: the accepted guesses then the sampled id
    (``accepted_draft_tokens + 1`` ids for a sampling item, none otherwise).
    ``forced`` (m14): the ids the request's grammar forces after the last
    of ``token_ids``, appended without sampling and computed in a later step
    (a sampling item only; empty when nothing is forced).
    """

    request_id: str
    start_position: int
    executed_tokens: int
    accepted_draft_tokens: int
    writes: tuple[Placement, ...]
    token_ids: tuple[int, ...]
    forced: tuple[int, ...] = ()  # m14


class Executor(Protocol):
    """Anything that turns a plan into one outcome per item, in item order."""

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]: ...


# m10: what a step decided before the boundary, kept from schedule() until commit().
@dataclass(frozen=True)
class _OpenStep:
    work: tuple[tuple[Request, int], ...]
    plan: tuple[PlanItem, ...]
    admitted: tuple[str, ...]
    scheduled: tuple[str, ...]
    preempted: tuple[str, ...]
    reused: Mapping[str, int]
    evicted: tuple[int, ...]
    rejected: tuple[tuple[str, RejectReason], ...]  # m12
    aborted: tuple[str, ...]  # m12
    finished: Mapping[str, FinishReason]  # m12: finished at admission (max_new_tokens 0)


# m12: a stop decided outside the engine: (request id, ids it appended this step) -> ids to keep, or None.
StopCheck = Callable[[str, tuple[int, ...]], int | None]


def scripted_token(prev_id: int, position: int) -> int:
    """The scripted model's next id after ``prev_id`` at ``position`` (never EOS_TOKEN_ID)."""
    return (prev_id * 1_000_003 + position * 7_919) % 65_521 + 1


class LocalExecutor:
    """The built-in scripted executor.

    Verdicts come from ``scripts`` (request id -> the request's own
    accept-script list, consumed from the front; absent or empty means
    accept every guess).  Token ids are ``scripted_token`` chained from the
    last known id, so a recompute reproduces them; ``EOS_TOKEN_ID`` is
    returned where rule S says EOS (``eos_after``).  ``forced`` (m14) holds
    each request's ``forced_script``: after a sampling item whose last
    appended id has output index ``i``, the ids ``forced[id][i]`` are
    reported as forced (none after an EOS id).
    """

    def __init__(
        self,
        scripts: dict[str, list[int]],
        eos_after: dict[str, int],
        forced: dict[str, dict[int, tuple[int, ...]]] | None = None,
    ) -> None:
        self.scripts = scripts
        self.eos_after = eos_after
        self.forced = {} if forced is None else forced  # m14

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        return tuple(self._run(item) for item in plan)

    def _run(self, item: PlanItem) -> Outcome:
        accepted = 0
        if item.decode:
            drafted = item.num_tokens - 1
            script = self.scripts.get(item.request_id)
            raw = script.pop(0) if script else drafted
            accepted = max(0, min(raw, drafted))
        ids: list[int] = []
        if item.sample:
            prev = item.token_ids[-1]
            position = item.start_position + len(item.token_ids)
            eos_after = self.eos_after.get(item.request_id)
            for j in range(accepted + 1):
                if eos_after is not None and item.generated + j >= eos_after:
                    prev = EOS_TOKEN_ID
                else:
                    prev = scripted_token(prev, position + j)
                ids.append(prev)
        # m14: the scripted grammar, keyed by the output index of the last id appended.
        forced: tuple[int, ...] = ()
        if ids and ids[-1] != EOS_TOKEN_ID:
            forced = tuple(self.forced.get(item.request_id, {}).get(item.generated + accepted, ()))
        return Outcome(
            item.request_id, item.start_position, item.num_tokens, accepted, item.placements, tuple(ids), forced
        )


# m11: one plan fans out to N ranks; N reports join into one result.
@dataclass(frozen=True)
class Envelope:
    """What rank ``rank`` of ``world_size`` receives: the step's plan."""

    rank: int
    world_size: int
    plan: tuple[PlanItem, ...]


@dataclass(frozen=True)
class Report:
    """What rank ``rank`` of ``world_size`` answers: its result."""

    rank: int
    world_size: int
    result: tuple[Outcome, ...]


def join(reports: Sequence[Report], world_size: int) -> tuple[Outcome, ...]:
    """Rank 0's result if the reports agree; ``GroupViolation`` otherwise.

    Checks, in order: the sorted ranks are exactly ``0 .. world_size-1``;
    every report's world size is ``world_size``; every result equals rank
    0's in every field.  There is no majority vote.
    """
    ranks = sorted(rep.rank for rep in reports)
    if ranks != list(range(world_size)):
        raise GroupViolation(f"ranks {ranks} are not 0..{world_size - 1}")
    for rep in reports:
        if rep.world_size != world_size:
            raise GroupViolation(f"rank {rep.rank} reports world size {rep.world_size}, not {world_size}")
    first = next(rep for rep in reports if rep.rank == 0)
    for rep in reports:
        if rep.result != first.result:
            raise GroupViolation(f"rank {rep.rank} disagrees with rank 0")
    return first.result


class ExecutorGroup:
    """``world_size`` rank executors behind one ``execute``: fan out, collect, join."""

    def __init__(self, ranks: Sequence[Executor]) -> None:
        self.ranks = list(ranks)

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        n = len(self.ranks)
        envelopes = [Envelope(rank, n, plan) for rank in range(n)]
        reports = [Report(env.rank, env.world_size, self.ranks[env.rank].execute(env.plan)) for env in envelopes]
        return join(reports, n)


class Engine:
    """The complete engine as of m16: m15's, whose windows a per-request draft limit can shorten (m16).

    ``max_step_tokens`` is the per-step token budget; the pool has
    ``num_pages`` pages of ``page_size`` slots; ``spec_len`` is the most
    guesses a decode window may carry; ``world_size`` is the number of ranks
    each plan reaches; ``namespace`` scopes the prefix keys (default
    ``"engine"``;
    with ``prefix_caching=False`` nothing is reused or published).  ``executors`` are the rank executors, one per rank
    (default: ``world_size`` ``LocalExecutor``s, each over its own deep copy
    of the accept scripts); a sampled id in ``eos_token_ids`` (default: the scripted
    ``EOS_TOKEN_ID`` with the built-in executor, none with yours) finishes a
    request with EOS.  ``max_waiting`` bounds the waiting queue (overload
    beyond it), ``max_running`` the running requests, ``max_model_len`` a
    request's prompt plus output (all optional).  ``hold_shared_prefix``
    (default off; it acts only with prefix caching on) holds a due request
    back while a running request is still computing prompt blocks the two
    share beyond what the cache already holds, so that it is admitted once
    they are published and reuses all of them instead of adopting a partial
    prefix and computing the rest again itself::

        budget 512, P and R share a 1,024-token prefix
        step 0: P admitted, R held     P computes 0..511, publishes 32 blocks
        step 1: R held (P at 512)      P computes 512..1023, publishes 32 more
        step 2: R admitted, reuses 1,024 tokens, computes only its own suffix
        (without the hold R adopts the 32 blocks of step 0 at step 1 and
        computes 512..1023 again)

    ``output_caching`` (default off; it acts only with prefix caching on)
    publishes every complete computed block of a request's prompt + output
    ids, not only its prompt blocks, and lets a cold request reuse its whole
    known sequence (a preempted one its generated blocks too)::

        computed frontier after resolve ──┐
        blocks   [ prompt ][ prompt | out ][ out out ][ out .|
                 └──── published, keys over prompt + output ──┘ partial: private

    m14 adds no switch: an executor's ``Outcome.forced`` ids (the built-in
    executor's from each request's ``forced_script``) are appended after
    the sampled id and computed in the next step like a prefill chunk::

        sample t, forced f1 f2 f3 ── output += t f1 f2 f3 ── next step: chunk [t f1 f2 f3] -> sample

    m15 adds no scheduling rule: each record carries ``kv_events``, what the step (and any call
    since the last one) did to the prefix cache, in vLLM's schema: a ``BlockStored`` per request
    that published blocks, a ``BlockRemoved`` per eviction, ``AllBlocksCleared`` after
    ``reset_prefix_cache``.  Blocks are named by ``block_hash`` chained from ``hash_root(hash_seed)``
    (``hash_seed`` default ``""``)::

        publish  blocks 3..5 of r ── BlockStored(block_hashes=[h3, h4, h5], parent_block_hash=h2, ...)
        evict    pages 7, 6       ── BlockRemoved(block_hashes=[hash of page 7's block, of page 6's])

    m16 adds one control call: ``limit_drafts({request_id: limit})`` caps the guesses a live
    request's decode windows may carry (``draft_limit``, until changed; None lifts it), and a
    request's ``draft_limit_script`` gives one such cap per draft decision (rule D1 below)::

        spec_len 4; a limited to 0, b to 2, c unlimited ── windows: a none, b 1+2, c 1+4

    Requests, given here or to
    ``add_request`` later, pass the door; a refused one is recorded, not
    raised.  First come, first served (D9): due requests are admitted in
    arrival order (list order among those arriving in the same step) and
    running ones are walked in admission order, so the request admitted
    first is the anchor and the one admitted last the first victim;
    ``requests`` and the summary stay in list order.  Raises ``ValueError`` if ``spec_len < 0``,
    ``max_step_tokens <= 0``, ``num_pages <= 0`` or ``page_size <= 0``
    (checked in that order), then if ``world_size <= 0``, the number of
    ``executors`` is not ``world_size``, or a given ``max_waiting``,
    ``max_running`` or ``max_model_len`` is ``<= 0``.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        max_step_tokens: int,
        page_size: int,
        num_pages: int,
        spec_len: int = 0,
        world_size: int = 1,
        namespace: str | None = None,
        prefix_caching: bool = True,
        executors: Sequence[Executor] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_waiting: int | None = None,
        max_running: int | None = None,
        max_model_len: int | None = None,
        hold_shared_prefix: bool = False,
        output_caching: bool = False,
        hash_seed: str = "",
    ) -> None:
        if spec_len < 0:
            raise ValueError("spec_len must be >= 0")
        if max_step_tokens <= 0:
            raise ValueError("max_step_tokens must be > 0")
        if num_pages <= 0:
            raise ValueError("num_pages must be > 0")
        if page_size <= 0:
            raise ValueError("page_size must be > 0")
        if world_size <= 0:
            raise ValueError("world_size must be > 0")
        if executors is not None and len(executors) != world_size:
            raise ValueError(f"{len(executors)} rank executor(s) for world_size {world_size}")
        for name, limit in (
            ("max_waiting", max_waiting),
            ("max_running", max_running),
            ("max_model_len", max_model_len),
        ):
            if limit is not None and limit <= 0:
                raise ValueError(f"{name} must be > 0")
        self.pool = PagePool(num_pages, page_size)
        self.cache = RadixCache()  # m08
        self.namespace = "engine" if namespace is None else namespace
        self.prefix_caching = prefix_caching
        self.requests: list[Request] = []
        # Queues, not the request list: a step costs what is running or due, not every request ever seen.
        self._position: dict[int, int] = {}
        self._next_position = 0  # m12: list order is the order requests reach the door
        self.waiting: list[tuple[int, int, Request]] = []
        self.due: list[Request] = []  # m12: arrived, waiting for a running slot, arrival order (D9)
        self.running: list[Request] = []  # m12 (D9): admission order; every walk over them follows it
        self.live: dict[str, Request] = {}  # m12: WAITING or RUNNING requests by id
        self.max_step_tokens = max_step_tokens
        self.spec_len = spec_len
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.hold_shared_prefix = hold_shared_prefix  # m12: see _holder
        self.output_caching = output_caching  # m13: see _publish
        # m11: every rank consumes its own copy of the scripts; the requests' lists stay whole.
        self.world_size = world_size
        self._scripted = [] if executors else [LocalExecutor({}, {}) for _ in range(world_size)]
        self.executor = ExecutorGroup(executors or self._scripted)
        # The scripted model's EOS id is 0; a real vocabulary's 0 is an ordinary token.
        if eos_token_ids is None:
            eos_token_ids = () if executors else (EOS_TOKEN_ID,)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.step_counter = 0
        self._open: _OpenStep | None = None  # m10: between schedule() and commit()
        self._why: list[str] = []
        self._rejected: list[tuple[str, RejectReason]] = []  # m12: since the last step
        self._aborted: list[str] = []
        self.hash_root = hash_root(hash_seed)  # m15: block 0's parent hash
        self._events: list[KVEvent] = []  # m15: since the last record
        self._page_hash: dict[int, int] = {}  # m15: cache page -> the block_hash of the block it holds
        self._limit_scripts: dict[str, list[int]] = {}  # m16: the engine's copy, so the request's stays whole
        for r in requests:
            self.add_request(r)

    # m12: the door.
    def add_request(self, r: Request) -> RejectReason | None:
        """Offer ``r`` to the engine; return None if it joined the waiting queue, else why not.

        A refused request is REJECTED at once: it holds no page, is never
        scheduled, is recorded in the next step's ``rejected`` and stays in
        the request list.  Raises ``ValueError`` if this very ``Request``
        object was offered before or is not a fresh WAITING request (a
        request's state lives in the object).  Checks, in order: empty
        prompt, ``max_new_tokens < 0``, an id already waiting or running, prompt + ``max_new_tokens`` over
        ``max_model_len``, ``pages_for(prompt + max_new_tokens - 1) >
        num_pages`` (the largest frontier it can ever need), a full waiting
        queue (``max_waiting``).
        """
        if id(r) in self._position or r.state is not RequestState.WAITING or r.output_ids:
            raise ValueError(f"request object {r.request_id!r} was offered before; offer a new Request")
        reason = self._door(r)
        self._position[id(r)] = self._next_position
        self._next_position += 1
        self.requests.append(r)
        if reason is not None:
            r.state = RequestState.REJECTED
            r.reject_reason = reason
            self._rejected.append((r.request_id, reason))
            self._why.append(f"{r.request_id} was rejected at the door: {reason.value}.")
            return reason
        ps = self.pool.page_size
        # m15: a routed request brings the keys and hashes the router computed; else they are made here.
        keys = r.prompt_keys
        if len(keys) != len(r.tokens) // ps or (keys and keys[0].namespace != self.namespace):
            r.prompt_keys = prefix_keys(r.tokens, ps, self.namespace)
        if len(r.block_hashes) != len(r.prompt_keys):
            r.block_hashes = block_hashes(r.tokens, ps, self.hash_root)
        r.block_keys = list(r.prompt_keys) if self.output_caching else []  # m13: extended as blocks fill
        heapq.heappush(self.waiting, (r.arrival_step, self._position[id(r)], r))
        self.live[r.request_id] = r
        # m11: each rank its own copy; an id used before must not inherit the old request's script.
        # m16: the engine consumes its own copy of the limit script; an id used before starts afresh.
        self._limit_scripts.pop(r.request_id, None)
        if r.draft_limit_script:
            self._limit_scripts[r.request_id] = list(r.draft_limit_script)
        for ex in self._scripted:
            ex.scripts.pop(r.request_id, None)
            ex.eos_after.pop(r.request_id, None)
            ex.forced.pop(r.request_id, None)  # m14
            if r.forced_script:
                ex.forced[r.request_id] = {i: tuple(ids) for i, ids in r.forced_script.items()}
            if r.accept_script is not None:
                ex.scripts[r.request_id] = list(r.accept_script)
            if r.eos_after is not None:
                ex.eos_after[r.request_id] = r.eos_after
        return None

    def _door(self, r: Request) -> RejectReason | None:
        ps = self.pool.page_size
        if not r.tokens:
            return RejectReason.EMPTY_PROMPT
        if r.max_new_tokens < 0:
            return RejectReason.BAD_MAX_NEW_TOKENS
        if r.request_id in self.live:
            return RejectReason.DUPLICATE_ID
        if self.max_model_len is not None and r.prompt_len + r.max_new_tokens > self.max_model_len:
            return RejectReason.TOO_LONG
        if r.max_new_tokens > 0 and pages_for(r.prompt_len + r.max_new_tokens - 1, ps) > self.pool.num_pages:
            return RejectReason.NEVER_FITS
        if self.max_waiting is not None and len(self.waiting) + len(self.due) >= self.max_waiting:
            return RejectReason.OVERLOADED
        return None

    def limit_drafts(self, limits: Mapping[str, int | None]) -> None:
        """m16 (N2): set the ``draft_limit`` of live requests: request id -> the most guesses its decode
        windows may carry from the next ``schedule`` on (None: no limit).  A limit stays until changed;
        a step already open keeps the windows it planned.

        Raises ``ValueError`` naming the first id that is not a WAITING or RUNNING request, or the first
        limit that is not None or an int ``>= 0``; then no limit is changed.
        """
        for request_id, limit in limits.items():
            if request_id not in self.live:
                raise ValueError(f"limit_drafts: {request_id!r} is not a waiting or running request")
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
                raise ValueError(
                    f"limit_drafts: the limit for {request_id!r} must be None or an int >= 0, not {limit!r}"
                )
        for request_id, limit in limits.items():
            self.live[request_id].draft_limit = limit

    def drop_finished(self) -> list[Request]:
        """Let go of every request that has left and whose leaving is already recorded; return them.

        A long-lived engine (a server) calls this after reading each step's
        outputs, so its memory follows the live requests, not every request
        ever offered.  Dropped requests leave ``requests`` (and the summary);
        live ones keep their list order.
        """
        pending = {rid for rid, _ in self._rejected} | set(self._aborted)
        gone: list[Request] = []
        kept: list[Request] = []
        for r in self.requests:
            left = r.state in (RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED)
            (gone if left and r.request_id not in pending else kept).append(r)
        self.requests = kept
        for r in gone:
            del self._position[id(r)]
        return gone

    def abort(self, request_id: str) -> bool:
        """Remove a waiting or running request now; return False if no such live request.

        A running request (mid-prefill, decoding, or preempted) gives back its
        private pages in page-table order; its published cache pages stay
        cached.  The abort is recorded in the next step's ``aborted``.
        """
        r = self.live.pop(request_id, None)
        if r is None:
            return False
        if r.state is RequestState.WAITING:
            self.waiting = [entry for entry in self.waiting if entry[2] is not r]
            heapq.heapify(self.waiting)
            if r in self.due:
                self.due.remove(r)
        else:
            self.running.remove(r)
            self._release(r)
        r.state = RequestState.ABORTED
        r.draft_len = 0
        self._aborted.append(request_id)
        self._why.append(f"{request_id} was aborted.")
        return True

    def step(self) -> StepRecord:
        """Run one tick and return its record; the counter advances afterwards.

        m10: a tick is ``commit(executor.execute(schedule()))``; a caller that runs the plan on its
        own executor makes the three calls itself and gets the same record.
        """
        return self.commit(self.executor.execute(self.schedule()))

    # m10: the two halves of a step, on either side of the boundary.
    def schedule(self) -> tuple[PlanItem, ...]:
        """Open a step: admit, reuse, draft, schedule and make the work resident; return its plan.

        The step stays open until ``commit``.  ``schedule`` while a step is open abandons that step,
        as a failed executor does: what it did to the queues and the pool stays, it has no record
        and the counter does not move.  ``OutOfPages`` propagates.
        """
        # m12: door decisions and aborts since the last step belong to this record.
        rejected, self._rejected = self._rejected, []
        aborted, self._aborted = self._aborted, []
        finished: dict[str, FinishReason] = {}
        admitted = self._admit(finished)
        reused = self._reuse()
        self._draft()
        work = self._schedule()
        scheduled = tuple(r.request_id for r, _ in work)
        evicted: list[int] = []
        preempted = self._ensure_residency(work, evicted)
        plan = self._plan(work)
        self._open = _OpenStep(
            tuple(work),
            plan,
            tuple(admitted),
            scheduled,
            tuple(preempted),
            _frozen(reused),
            tuple(evicted),
            tuple(rejected),
            tuple(aborted),
            _frozen(finished),
        )
        return plan

    def commit(self, outcomes: Sequence[Outcome], stop: StopCheck | None = None) -> StepRecord:
        """Close the open step with the executor's ``outcomes`` (one per plan item, in plan order) and
        return its record: validate and apply them, resolve the decode windows, publish, sample.

        m12: ``stop`` is a stop decided outside the engine (a stop string found in the text): it is
        asked once per request that appended ids in this step, in work order, right after they are
        appended, with the request id and those ids; it answers None, or how many of them the request
        keeps, and the request then finishes with STOP after them (``_stop``).

        Raises ``RuntimeError`` when no step is open (``commit`` before ``schedule``, or twice) and
        ``BoundaryViolation`` when an outcome breaks the contract; either way the step is closed,
        nothing of its execution applied and the counter unchanged.
        """
        opened, self._open = self._open, None
        if opened is None:
            raise RuntimeError("commit() without an open step: call schedule() first")
        work = list(opened.work)
        finished = dict(opened.finished)
        executed, verdicts = self._apply(work, opened.plan, outcomes)
        drafted, accepted, rolled_back, sampled_ids = self._resolve(work, verdicts)
        published = self._publish(work)
        sampled: dict[str, Sample] = {}
        tokens: dict[str, tuple[int, ...]] = {}
        forced: dict[str, int] = {}  # m14
        for r, _ in work:
            # m04: a slice that ends inside the prompt is not ready to sample.
            if r.computed == r.target:
                self._sample(r, sampled_ids[r.request_id], sampled, finished)
                tokens[r.request_id] = tuple(verdicts[r.request_id].token_ids[: accepted.get(r.request_id, 0) + 1])
                # m14: the ids the grammar forces after the sampled one, if the request goes on.
                out = verdicts[r.request_id]
                if out.forced and r.state is RequestState.RUNNING:
                    kept = self._force(r, out.forced, finished)
                    forced[r.request_id] = len(kept)
                    tokens[r.request_id] += kept
                # m12: a stop decided outside the engine may end the request inside what it appended.
                keep = None if stop is None else stop(r.request_id, tokens[r.request_id])
                if keep is not None:
                    tokens[r.request_id] = self._stop(
                        r, tokens[r.request_id], keep, finished, drafted, accepted, rolled_back
                    )
                    if r.request_id in forced:  # m14: the forced ids the stop kept
                        forced[r.request_id] = max(0, len(tokens[r.request_id]) - accepted.get(r.request_id, 0) - 1)
        record = StepRecord(
            step=self.step_counter,
            admitted=opened.admitted,
            scheduled=opened.scheduled,
            executed=_frozen(executed),
            sampled=_frozen(sampled),
            finished=_frozen(finished),
            preempted=opened.preempted,
            reused=opened.reused,
            published=_frozen(published),
            evicted=opened.evicted,
            drafted=_frozen(drafted),
            accepted=_frozen(accepted),
            rolled_back=_frozen(rolled_back),
            tokens=_frozen(tokens),
            rejected=opened.rejected,
            aborted=opened.aborted,
            forced=_frozen(forced),
            kv_events=tuple(self._events),  # m15
            explain=tuple(self._why),
        )
        self._why = []
        self._events = []
        self.step_counter += 1
        return record

    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
        """Step until no request waits or runs and every refusal and abort is recorded.

        ``on_step`` (optional) sees each record as soon as it exists, so a
        caller can show the steps that led to an error.  ``OutOfPages``
        propagates.
        """
        records = []
        while self.waiting or self.due or self.running or self._rejected or self._aborted:
            record = self.step()
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    def _admit(self, finished: dict[str, FinishReason]) -> list[str]:
        """Admit due requests in arrival order while a running slot is free (``max_running``).

        A request with ``max_new_tokens == 0`` finishes at admission (LENGTH,
        zero tokens, no page) and is recorded in ``finished``.  With
        ``hold_shared_prefix`` a due request whose shared prompt blocks a
        running request is still computing stays due (``_holder``) and the
        walk goes on past it.
        """
        # m12 (D9): first come, first served: a request that arrives joins the due list behind those
        # that arrived before it (list order among the requests arriving in the same step).
        arrived: list[Request] = []
        while self.waiting and self.waiting[0][0] <= self.step_counter:
            arrived.append(heapq.heappop(self.waiting)[2])
        self.due += sorted(arrived, key=self._list_position)
        admitted = []
        kept: list[Request] = []  # m12: due requests left for a later step, arrival order
        held = 0
        pending: dict[PrefixKey, Request] | None = None
        for i, r in enumerate(self.due):
            if self.max_running is not None and len(self.running) >= self.max_running:
                kept += self.due[i:]
                break
            if self.hold_shared_prefix and self.prefix_caching and r.max_new_tokens > 0:
                if pending is None:
                    pending = self._uncomputed_blocks()
                if self._holder(r, pending) is not None:
                    kept.append(r)
                    held += 1
                    continue
            admitted.append(r.request_id)
            self._why.append(f"{r.request_id} arrived (arrival_step {r.arrival_step}) and was admitted.")
            if r.max_new_tokens == 0:
                # m12: nothing to generate, so nothing to compute.
                r.state, r.finish_reason = RequestState.FINISHED, FinishReason.LENGTH
                del self.live[r.request_id]
                finished[r.request_id] = FinishReason.LENGTH
                self._why.append(f"{r.request_id} asked for 0 tokens and finished at once.")
                continue
            r.state = RequestState.RUNNING
            self.running.append(r)  # m12 (D9): running requests in admission order
            if pending is not None:
                for key in r.prompt_keys:  # it computes nothing before the later due requests are judged
                    pending.setdefault(key, r)
        self.due = kept
        if len(kept) > held:
            self._why.append(
                f"{len(kept) - held} arrived request(s) wait: {len(self.running)} running is the max_running limit."
            )
        return admitted

    # m12: the shared-prefix hold (SGLang's in-batch prefix caching).
    def _uncomputed_blocks(self) -> dict[PrefixKey, Request]:
        """Each prompt block some RUNNING request has not computed yet, with the first such request
        (admission order, D9).

        Block ``j`` of ``p`` is uncomputed while ``p.computed < (j + 1) * page_size``;
        a request past its prompt adds nothing, so this costs the running prefills' blocks.
        """
        ps = self.pool.page_size
        pending: dict[PrefixKey, Request] = {}
        for p in self.running:
            for key in p.prompt_keys[p.computed // ps :]:
                pending.setdefault(key, p)
        return pending

    def _holder(self, r: Request, pending: dict[PrefixKey, Request]) -> Request | None:
        """The running request ``r`` waits for, or None: it shares ``s`` leading prompt blocks with ``r``
        (capped at ``r``'s usable blocks, as reuse caps them), more than the ``h`` the cache holds for
        ``r``, and has not computed them yet.

        Keys chain, so equal key ``s - 1`` means ``s`` equal leading blocks: the longest such ``s``
        is the last of ``r``'s keys ``h .. usable - 1`` that is still uncomputed somewhere.
        """
        ps = self.pool.page_size
        usable = (r.prompt_len - 1) // ps
        keys = r.prompt_keys
        if not pending or usable == 0:
            return None
        h = min(len(self.cache.match(keys)), usable)
        for s in range(usable, h, -1):
            p = pending.get(keys[s - 1])
            if p is not None:
                self._why.append(
                    f"{r.request_id} is held back: {p.request_id} is still computing the {s} prompt block(s) "
                    f"they share ({h} cached); {r.request_id} will reuse them once they are published."
                )
                return p
        return None

    def _list_position(self, r: Request) -> int:
        return self._position[id(r)]

    def _reuse(self) -> dict[str, int]:
        """Cold requests, in admission order (D9), adopt their longest cached prefix; returns tokens reused."""
        # m08: at most (target-1)//page_size blocks, so one position is always computed; a preempted
        # request, whose target runs past its prompt, reuses every cached prompt block (D7).
        # m13: ... with output caching, of the whole known sequence: a preempted request gets its
        # generated blocks back too.
        reused: dict[str, int] = {}
        if not self.prefix_caching:
            return reused
        ps = self.pool.page_size
        for r in self.running:
            if r.computed != 0 or r.page_table:
                continue
            if self.output_caching:
                hit = self.cache.match(self._block_keys(r, r.target // ps))
                usable = min(len(hit), (r.target - 1) // ps)
            else:
                hit = self.cache.match(r.prompt_keys)
                usable = min(len(hit), (r.target - 1) // ps)
            if usable > 0:
                r.page_table = hit[:usable]
                r.computed = usable * ps
                reused[r.request_id] = r.computed
                seq = "tokens" if self.output_caching else "prompt"  # m13: prompt and output blocks
                self._why.append(
                    f"{r.request_id} found {len(hit)} cached block(s) of its {seq} and reused {usable} "
                    f"(pages {r.page_table}): {r.computed} token(s) it need not compute."
                )
        return reused

    def _draft(self) -> None:
        """Set ``draft_len`` for every running request (admission order, D9)."""
        # m09 (D1): only a request caught up except for its last sampled token drafts.
        for r in self.running:
            if r.generated >= 1 and r.computed == r.target - 1:
                r.draft_len = min(self.spec_len, r.max_new_tokens - r.generated - 1)
                if r.draft_len:
                    # m16 (N3, N5): a draft decision; the script's entry and the request's limit may cut it.
                    limit = r.draft_limit
                    script = self._limit_scripts.get(r.request_id)
                    if script:
                        entry = script.pop(0)
                        limit = entry if limit is None else min(limit, entry)
                    if limit is not None and limit < r.draft_len:
                        self._why.append(
                            f"{r.request_id} is caught up and may ask for {r.draft_len} guess(es) but its "
                            f"draft limit is {limit}: it asks for {limit}."
                        )
                        r.draft_len = limit
                        continue
                if r.draft_len:
                    capped = " (capped so it cannot pass max_new_tokens)" if r.draft_len < self.spec_len else ""
                    self._why.append(f"{r.request_id} is caught up and asks for {r.draft_len} guess(es){capped}.")
            else:
                r.draft_len = 0

    def _schedule(self) -> list[tuple[Request, int]]:
        # m01: the batch is a temporary of the step, rebuilt from request states.
        # m04: each request gets min(remaining, what is left); only the last is cut.
        # m12 (D9): walked in admission order, so the request admitted first is the anchor.
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
                f"{victim.request_id} (the eligible request admitted last) was preempted."
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
        if freed:  # m15
            self._events.append(BlockRemoved(tuple(self._page_hash.pop(page) for page in freed)))
        return freed

    # m15: vLLM's reset_prefix_cache, the one source of AllBlocksCleared.
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block now and return True, or change nothing and return False while a
        running request holds pages (as vLLM, which resets only when no block is in use).

        The cache pages go back to the free list in ascending page order and the next record's
        ``kv_events`` carries one ``AllBlocksCleared``.
        """
        if any(r.page_table for r in self.running):
            return False
        cached = sorted(self._page_hash)
        for page in cached:
            self.pool.release(page)
        self.cache = RadixCache()
        self._page_hash.clear()
        self._events.append(AllBlocksCleared())
        self._why.append(f"The prefix cache was reset: {len(cached)} cached page(s) freed.")
        return True

    def _choose_victim(self, anchor: Request, work: list[tuple[Request, int]]) -> Request | None:
        """The last RUNNING request in admission order (the one admitted last, D9), not the anchor, that
        holds pages or has work."""
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

    def _plan(self, work: list[tuple[Request, int]]) -> tuple[PlanItem, ...]:
        """Freeze the post-preemption work into plan items, work order."""
        ps = self.pool.page_size
        plan = []
        for r, n in work:
            start = r.computed
            decode = r.generated >= 1 and start == r.prompt_len + r.generated - 1
            end = min(start + n, r.target)
            # E1: the known ids of [start, end): prompt ids, then ids sampled earlier
            known = r.tokens[start:end] + r.output_ids[max(0, start - r.prompt_len) : max(0, end - r.prompt_len)]
            plan.append(
                PlanItem(
                    request_id=r.request_id,
                    start_position=start,
                    num_tokens=n,
                    draft_len=r.draft_len,
                    decode=decode,
                    placements=tuple((p, *translate(r.page_table, p, ps)) for p in range(start, start + n)),
                    token_ids=tuple(known),
                    sample=decode or start + n == r.target,
                    generated=r.generated,
                    page_table=tuple(r.page_table),
                )
            )
        return tuple(plan)

    def _apply(
        self, work: list[tuple[Request, int]], plan: tuple[PlanItem, ...], outcomes: Sequence[Outcome]
    ) -> tuple[dict[str, int], dict[str, Outcome]]:
        """Commit's first phase: validate every outcome, then apply them all; returns (executed, verdicts).

        Raises ``BoundaryViolation`` (applying nothing) on a count mismatch, a
        different request or start position, a token count other than
        planned, writes other than the placements, an acceptance on a
        non-decode item or outside ``[0, num_tokens - 1]``, or a number of
        appended ids other than ``accepted + 1`` (sampling item) or 0.
        """
        # m10: validate everything before applying anything.
        if len(outcomes) != len(plan):
            raise BoundaryViolation(f"{len(outcomes)} outcome(s) for {len(plan)} plan item(s)")
        for item, out in zip(plan, outcomes):
            rid = item.request_id
            if out.request_id != rid:
                raise BoundaryViolation(f"outcome for {out.request_id!r} where {rid!r} was planned")
            if out.start_position != item.start_position:
                raise BoundaryViolation(f"{rid}: frontier mismatch ({out.start_position} != {item.start_position})")
            if out.executed_tokens != item.num_tokens:
                raise BoundaryViolation(f"{rid}: executed {out.executed_tokens} token(s), planned {item.num_tokens}")
            if tuple(out.writes) != item.placements:
                raise BoundaryViolation(f"{rid}: writes differ from the planned placements")
            if not item.decode and out.accepted_draft_tokens != 0:
                raise BoundaryViolation(f"{rid}: acceptance reported for a non-decode item")
            if item.decode and not 0 <= out.accepted_draft_tokens <= item.num_tokens - 1:
                raise BoundaryViolation(
                    f"{rid}: acceptance {out.accepted_draft_tokens} outside [0, {item.num_tokens - 1}]"
                )
            want = out.accepted_draft_tokens + 1 if item.sample else 0
            if len(out.token_ids) != want:
                raise BoundaryViolation(f"{rid}: {len(out.token_ids)} token id(s) appended, expected {want}")
            # m14: only an item that samples can have a continuation forced after its sample.
            if out.forced and not item.sample:
                raise BoundaryViolation(f"{rid}: {len(out.forced)} forced id(s) on an item that does not sample")
        executed: dict[str, int] = {}
        verdicts: dict[str, Outcome] = {}
        for (r, _), out in zip(work, outcomes):
            for pos, page, offset in out.writes:
                self.pool.slots[page][offset] = (r.request_id, pos)
            r.computed += out.executed_tokens
            executed[r.request_id] = out.executed_tokens
            verdicts[r.request_id] = out
            self._why.append(
                f"{r.request_id} computed {out.executed_tokens} token(s), positions {r.computed - out.executed_tokens}..{r.computed - 1}."
            )
        return executed, verdicts

    def _resolve(
        self, work: list[tuple[Request, int]], verdicts: dict[str, Outcome] | None
    ) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
        """Apply each decode window's verdict: keep accepted guesses, roll back the rest.

        Returns ``(drafted, accepted, rolled_back, sampled_ids)``: one entry per
        decode window in work order, and the id each sampling request sampled.
        Prompt and recompute chunks record nothing.  Raises
        ``BoundaryViolation`` when a work item has no verdict.
        """
        if verdicts is None or any(r.request_id not in verdicts for r, _ in work):
            raise BoundaryViolation("resolve called without verdicts")
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        rolled_back: dict[str, int] = {}
        sampled_ids: dict[str, int] = {}
        ps = self.pool.page_size
        for r, n in work:
            out = verdicts[r.request_id]
            start = r.computed - n
            # m09 (D1): a window is a decode window only if it began at the last sampled token.
            if not (r.generated >= 1 and start == r.prompt_len + r.generated - 1):
                if out.token_ids:
                    sampled_ids[r.request_id] = out.token_ids[0]
                continue
            d = n - 1
            a = out.accepted_draft_tokens
            if r.eos_after is not None:
                # m14: forced ids may carry generated past eos_after; the clamp never goes below 0.
                a = max(0, min(a, r.eos_after - r.generated))  # the EOS clamp
            # m10 (E3): an accepted run is cut at its first EOS id; nothing after it is kept.
            # m12: ... or at its first stop id.
            stops = self._stop_ids(r)
            a = next((i for i, t in enumerate(out.token_ids[:a]) if t in stops), a)
            r.computed -= d - a
            r.generated += a
            r.output_ids += out.token_ids[:a]
            sampled_ids[r.request_id] = out.token_ids[a]
            freed = []
            # m13: a published block lies below every later frontier, so this never meets a cache page.
            while len(r.page_table) > pages_for(r.computed, ps):
                page = r.page_table.pop()
                if self.pool.owner[page] == r.request_id:
                    self.pool.release(page)
                    freed.append(page)
            r.draft_len = 0
            drafted[r.request_id], accepted[r.request_id], rolled_back[r.request_id] = d, a, d - a
            if d:
                self._why.append(
                    f"{r.request_id}'s executor accepted {out.accepted_draft_tokens} of {d} guess(es), {a} kept; "
                    f"{d - a} rolled back" + (f", freeing tail page(s) {freed}." if freed else ".")
                )
        return drafted, accepted, rolled_back, sampled_ids

    def _publish(self, work: list[tuple[Request, int]]) -> dict[str, int]:
        """Turn complete computed prompt blocks into cache pages; returns blocks inserted.

        With output caching, every complete computed block of prompt + output
        ids (m13).  A block whose key is already resident with another page is
        adopted: the request's table points at the resident page and its own
        copy is freed at once (departure D2).
        """
        published: dict[str, int] = {}
        if not self.prefix_caching:
            return published
        ps = self.pool.page_size
        for r, _ in work:
            if self.output_caching:
                # m13: the frontier after resolve; its ids are final (accepted, never rolled back).
                c = r.computed // ps
                keys = self._block_keys(r, c)
            else:
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
                self._stored(r, keys, len(resident), own_pages)  # m15
                generated = c - max(len(resident), r.prompt_len // ps)
                what = f"block(s), {generated} holding generated tokens," if generated > 0 else "prompt block(s)"
                self._why.append(f"{r.request_id} published {what} on page(s) {own_pages} to the cache.")
        return published

    # m15: what a publish tells the router.
    def _stored(self, r: Request, keys: list[PrefixKey], first: int, pages: list[int]) -> None:
        """Record one ``BlockStored`` for ``r``'s blocks ``first .. len(keys) - 1``, just published on ``pages``.

        ``r.block_hashes`` grows with ``r.block_keys`` (output blocks, m13) as blocks are published.
        """
        hashes = r.block_hashes
        while len(hashes) < len(keys):
            hashes.append(block_hash(hashes[-1] if hashes else self.hash_root, keys[len(hashes)].block_tokens))
        new = tuple(hashes[first : len(keys)])
        self._page_hash.update(zip(pages, new))
        tokens = tuple(t for key in keys[first:] for t in key.block_tokens)
        self._events.append(BlockStored(new, hashes[first - 1] if first else None, tokens, self.pool.page_size))

    # m13: the keys of a request's whole sequence, prompt then output, extended as its blocks fill.
    def _block_keys(self, r: Request, c: int) -> list[PrefixKey]:
        """The prefix keys of the first ``c`` complete blocks of ``r``'s prompt + output ids.

        The prompt's keys come first; each later key chains over ids the request has appended
        (accepted guesses and sampled ids), computed once and kept in ``r.block_keys``.  Every
        position below ``c * page_size`` must hold a known id (``c * page_size <= target``).
        """
        ps = self.pool.page_size
        keys = r.block_keys
        while len(keys) < c:
            start, end = len(keys) * ps, (len(keys) + 1) * ps
            block = r.tokens[start:end] + r.output_ids[max(0, start - r.prompt_len) : max(0, end - r.prompt_len)]
            assert len(block) == ps, f"{r.request_id}: block {len(keys)} holds unknown ids"
            keys.append(PrefixKey(self.namespace, keys[-1] if keys else ROOT, tuple(block)))
        return keys[:c]

    def _stop_ids(self, r: Request) -> frozenset[int]:
        """The ids that end ``r``: its stop ids, and the engine's EOS ids unless it ignores EOS."""
        return frozenset(r.stop_token_ids) | (frozenset() if r.ignore_eos else self.eos_token_ids)

    def _sample(self, r: Request, token_id: int, sampled: dict[str, Sample], finished: dict[str, FinishReason]) -> None:
        """Rule S, with stop ids: EOS at ``eos_after`` or on an EOS id, STOP on a stop id, else a TOKEN."""
        r.output_ids.append(token_id)
        if r.eos_after is not None and r.generated >= r.eos_after:
            sampled[r.request_id] = Sample.EOS
            r.finish_reason = FinishReason.EOS
        elif token_id in r.stop_token_ids:
            sampled[r.request_id] = Sample.STOP
            r.finish_reason = FinishReason.STOP
        elif token_id in self.eos_token_ids and not r.ignore_eos:
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
            del self.live[r.request_id]
            finished[r.request_id] = r.finish_reason
            self._why.append(f"{r.request_id} finished ({r.finish_reason.value}) after {r.generated} token(s).")
            self._release(r)

    # m14: a forced run, appended as output ids whose KV the next steps compute.
    def _force(self, r: Request, ids: Sequence[int], finished: dict[str, FinishReason]) -> tuple[int, ...]:
        """Append the forced ``ids`` after ``r``'s sample; return the ids kept.

        Each forced id is an output id (``output_ids``) that counts toward ``generated`` and
        ``max_new_tokens`` but is not computed: ``target`` grows and the scheduler owes it like a
        prefill chunk.  The run is cut where ``max_new_tokens`` is reached (the request finishes
        with LENGTH) and at its first stop id, kept as the request's last id (EOS or STOP, not
        counted in ``generated``, as a sampled one); ``eos_after`` is a sampling trigger and is
        checked only at the next sample.
        """
        kept: list[int] = []
        stops = self._stop_ids(r)
        for token_id in ids:
            kept.append(token_id)
            r.output_ids.append(token_id)
            if token_id in stops:
                r.finish_reason = FinishReason.STOP if token_id in r.stop_token_ids else FinishReason.EOS
                break
            r.generated += 1
            if r.generated >= r.max_new_tokens:
                r.finish_reason = FinishReason.LENGTH
                break
        self._why.append(
            f"{r.request_id}'s grammar forced {len(kept)} id(s) after its sample"
            + (f" (of {len(ids)}; the run was cut)" if len(kept) < len(ids) else "")
            + ": appended without sampling, computed in a later step."
        )
        if r.finish_reason is not None:
            r.state = RequestState.FINISHED
            self.running.remove(r)
            del self.live[r.request_id]
            finished[r.request_id] = r.finish_reason
            self._why.append(
                f"{r.request_id} finished ({r.finish_reason.value}) inside a forced run after {r.generated} token(s)."
            )
            self._release(r)
        return tuple(kept)

    # m12: a stop decided outside the engine, inside the ids a request appended this step.
    def _stop(
        self,
        r: Request,
        ids: tuple[int, ...],
        keep: int,
        finished: dict[str, FinishReason],
        drafted: dict[str, int],
        accepted: dict[str, int],
        rolled_back: dict[str, int],
    ) -> tuple[int, ...]:
        """End ``r`` with STOP after the first ``keep`` of the ``ids`` it appended this step; return them.

        The ids after them leave ``output_ids`` and, but for a last EOS or stop id the request already
        finished on, ``generated``; ``computed`` drops to the new ``target`` at most.  A decode
        window's ``accepted`` counts only the guesses kept (the others are ``rolled_back``).  A
        request still running finishes now and gives back its private pages; one that already
        finished in this step ends with STOP instead.  Raises ``ValueError`` unless ``0 <= keep <=
        len(ids)``.
        """
        if not 0 <= keep <= len(ids):
            raise ValueError(f"{r.request_id}: a stop may keep 0..{len(ids)} of the ids it appended, not {keep}")
        dropped = len(ids) - keep
        if dropped:
            ended_on_id = r.finish_reason in (FinishReason.EOS, FinishReason.STOP)
            del r.output_ids[len(r.output_ids) - dropped :]
            r.generated -= dropped - 1 if ended_on_id else dropped
            r.computed = min(r.computed, r.target)
            if r.request_id in accepted:
                accepted[r.request_id] = min(accepted[r.request_id], max(keep - 1, 0))
                rolled_back[r.request_id] = drafted[r.request_id] - accepted[r.request_id]
        if r.finish_reason is None:
            r.state = RequestState.FINISHED
            self.running.remove(r)
            del self.live[r.request_id]
            self._release(r)
        r.finish_reason = finished[r.request_id] = FinishReason.STOP
        self._why.append(
            f"{r.request_id} was stopped from outside after {keep} of the {len(ids)} id(s) it appended "
            f"(STOP, {r.generated} token(s))."
        )
        return ids[:keep]

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
            if r.state in (RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED):
                assert not r.page_table, f"{r.request_id}: {r.state.value} but holds pages"
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
        # m15: every cache page, and only those, has the hash its BlockStored named.
        assert set(self._page_hash) == set(cached), "a cache page without a block hash, or a hash without a page"

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


# m15: the router.  A policy is a pure function of (request, router state, replica views): ``choose``.
POLICIES = ("round_robin", "least_loaded", "cache_aware", "precise", "oracle")
DEFAULT_POLICY = "precise"


@dataclass(frozen=True)
class RouterConfig:
    """A router: its policy, the fleet it routes to, and the policy's parameters.

    ``replicas`` replicas, indices ``0 .. replicas - 1``, whose blocks hold ``page_size`` tokens and
    are hashed from ``hash_seed`` (the router hashes prompts as they do).  ``cache_aware`` takes
    sgl-router's and vllm-router's defaults: ``cache_threshold`` 0.3 (the share of the prompt a
    replica must match), ``balance_abs_threshold`` 64 and ``balance_rel_threshold`` 1.5 (outstanding
    requests), ``max_tree_size`` 2**26 (tokens per replica's tree; sgl-router counts characters).
    ``precise`` takes llm-d's default weights: ``prefix_weight`` 3, ``queue_weight`` 2 and
    ``kv_weight`` 2.  With ``load_guard`` (default on) precise and the oracle first leave out every
    replica that sgl-router's balance test, with the same two balance thresholds, calls overloaded
    against the least loaded one (N24).  Raises ``ValueError`` for an unknown policy or a value out
    of range.
    """

    policy: str = DEFAULT_POLICY
    replicas: int = 1
    page_size: int = 16
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 26
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    hash_seed: str = ""
    load_guard: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.replicas <= 0:
            raise ValueError("replicas must be > 0")
        if self.page_size <= 0:
            raise ValueError("page_size must be > 0")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must lie in [0, 1], not {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, not {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 0:
            raise ValueError(f"balance_rel_threshold must be >= 0, not {self.balance_rel_threshold}")
        if self.max_tree_size < 0:
            raise ValueError(f"max_tree_size must be >= 0, not {self.max_tree_size}")
        for name in ("prefix_weight", "queue_weight", "kv_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if not isinstance(self.load_guard, bool):
            raise ValueError(f"load_guard must be True or False, not {self.load_guard!r}")

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> RouterConfig:
        return RouterConfig(**doc)


@dataclass(frozen=True)
class RouteRequest:
    """What a router sees of a request: its id, the ``step`` it arrives at, its ``prompt_len`` (tokens)
    and the ``block_hashes`` of its prompt's complete blocks (``block_hashes(tokens, page_size,
    hash_root(seed))``; a router that has only text tokenizes first, as llm-d does).

    ``oracle_blocks`` is for the oracle alone: per replica, how many leading blocks of the prompt it
    holds or will hold once the requests already sent there are computed.  No real router can know
    it: the fleet reads it from inside the engines (``Fleet._oracle_blocks``).
    """

    request_id: str
    step: int
    prompt_len: int
    block_hashes: tuple[int, ...]
    oracle_blocks: tuple[int, ...] | None = None

    @staticmethod
    def from_tokens(
        request_id: str, tokens: Sequence[int], page_size: int, step: int = 0, hash_seed: str = ""
    ) -> RouteRequest:
        """What a router builds from a tokenized prompt: its block hashes as the engines name them."""
        return RouteRequest(request_id, step, len(tokens), tuple(block_hashes(tokens, page_size, hash_root(hash_seed))))

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "request_id": self.request_id,
            "step": self.step,
            "prompt_len": self.prompt_len,
            "block_hashes": list(self.block_hashes),
        }
        if self.oracle_blocks is not None:
            doc["oracle_blocks"] = list(self.oracle_blocks)
        return doc

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> RouteRequest:
        oracle = doc.get("oracle_blocks")
        return RouteRequest(
            doc["request_id"],
            doc["step"],
            doc["prompt_len"],
            tuple(doc["block_hashes"]),
            None if oracle is None else tuple(oracle),
        )


@dataclass(frozen=True)
class ReplicaView:
    """What replica ``replica`` reported after fleet step ``step``: its ``running`` and ``waiting``
    requests (vLLM's ``num_requests_running`` / ``num_requests_waiting``) and ``kv_usage``, the share
    of its pages that running requests hold (vLLM's ``kv_cache_usage_perc``: cached pages no request
    holds count as free, since they can be evicted), in [0, 1]."""

    replica: int
    step: int
    running: int
    waiting: int
    kv_usage: float

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> ReplicaView:
        return ReplicaView(**doc)


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why.

    ``rule`` names what decided (``RULES``); ``matched`` is how many of the prompt's tokens the chosen
    replica holds as the policy sees them (0 for a policy that does not look); ``reason`` says it in
    one sentence.
    """

    request_id: str
    replica: int
    policy: str
    rule: str
    matched: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> Decision:
        return Decision(**doc)


RULES = {
    "round_robin": ("rotation",),
    "least_loaded": ("least_loaded",),
    "cache_aware": ("imbalanced", "cache_hit", "smallest_tree"),
    "precise": ("longest_prefix", "no_prefix", "load:queue", "load:kv_usage", "load:queue+kv_usage", "load:imbalanced"),
    "oracle": ("longest_prefix", "no_prefix", "load:queue", "load:kv_usage", "load:queue+kv_usage", "load:imbalanced"),
}
"""The rules each policy's decisions name."""


class _TreeNode:
    __slots__ = ("children", "parent", "tenants")

    def __init__(self, parent: int | None) -> None:
        self.parent = parent
        self.children: set[int] = set()
        self.tenants: dict[int, int] = {}  # replica -> fleet step it was last sent this block


class ApproxTree:
    """cache_aware's memory: sgl-router's multi-tenant approximate radix tree (sgl-router/src/policies/
    tree.rs), over complete blocks instead of characters.

    A node is a block hash (which names the block and everything before it), with the replicas
    ("tenants") the router sent it to and the step it last did.  ``size[r]`` counts replica r's
    tokens (``page_size`` per node); when it passes ``max_size``, r's least recently sent leaves go
    first (sgl-router evicts the same way on a timer).  It never hears of an eviction inside a
    replica: that is what makes it approximate.
    """

    def __init__(self, replicas: int, page_size: int, max_size: int) -> None:
        self.page_size = page_size
        self.max_size = max_size
        self.nodes: dict[int, _TreeNode] = {}
        self.size = [0] * replicas

    def match(self, hashes: Sequence[int]) -> tuple[int, tuple[int, ...]]:
        """``(depth, tenants)``: the longest leading run of ``hashes`` in the tree and the replicas
        (ascending) at its deepest node, each of which was sent that whole run; ``(0, ())`` if none."""
        depth = 0
        for h in hashes:
            if h not in self.nodes:
                break
            depth += 1
        return depth, tuple(sorted(self.nodes[hashes[depth - 1]].tenants)) if depth else ()

    def insert(self, hashes: Sequence[int], replica: int, now: int) -> None:
        """Record that ``replica`` was sent the chain ``hashes`` at step ``now``, then trim its tree."""
        parent: int | None = None
        for h in hashes:
            node = self.nodes.get(h)
            if node is None:
                node = self.nodes[h] = _TreeNode(parent)
                if parent is not None:
                    self.nodes[parent].children.add(h)
            if replica not in node.tenants:
                self.size[replica] += self.page_size
            node.tenants[replica] = now
            parent = h
        if self.size[replica] > self.max_size:
            self._evict(replica)

    def _is_leaf(self, h: int, replica: int) -> bool:
        return not any(replica in self.nodes[c].tenants for c in self.nodes[h].children)

    def _evict(self, replica: int) -> None:
        """Drop ``replica``'s least recently sent leaves until its size is within ``max_size``."""
        heap = [
            (n.tenants[replica], h) for h, n in self.nodes.items() if replica in n.tenants and self._is_leaf(h, replica)
        ]
        heapq.heapify(heap)
        while self.size[replica] > self.max_size and heap:
            _, h = heapq.heappop(heap)
            node = self.nodes[h]
            del node.tenants[replica]
            self.size[replica] -= self.page_size
            parent = node.parent
            if not node.tenants:
                del self.nodes[h]
                if parent is not None:
                    self.nodes[parent].children.discard(h)
            if parent is not None and replica in self.nodes[parent].tenants and self._is_leaf(parent, replica):
                heapq.heappush(heap, (self.nodes[parent].tenants[replica], parent))

    def to_json(self) -> dict[str, Any]:
        nodes = {str(h): {"parent": n.parent, "tenants": dict(n.tenants)} for h, n in self.nodes.items()}
        return {"nodes": nodes, "size": list(self.size)}


def _prefix_by_mask(hashes: Sequence[int], masks: Callable[[int], int], replicas: int) -> list[int]:
    """Per replica, how many leading ``hashes`` it holds, where ``masks(h)`` has bit r set when r holds h.

    llm-d's longest-prefix scorer: a replica counts only while it holds every block so far.
    """
    held = [0] * replicas
    active = (1 << replicas) - 1
    for depth, h in enumerate(hashes):
        mask = masks(h) & active
        dropped = active & ~mask
        while dropped:
            low = dropped & -dropped
            held[low.bit_length() - 1] = depth
            dropped ^= low
        active = mask
        if not active:
            return held
    while active:
        low = active & -active
        held[low.bit_length() - 1] = len(hashes)
        active ^= low
    return held


class RouterState:
    """What a router remembers between decisions; ``choose`` reads it, only these methods change it.

    ``commit`` (a decision taken): the rotation's next replica, each replica's ``outstanding``
    requests (sent, not finished; sgl-router's per-worker load), what was sent in the current step
    (``recent``), and for cache_aware its ``tree``.  ``observe`` (a replica's KV events): for precise
    the ``index`` from block hash to the bit mask of replicas whose events say they hold it, and each
    replica's ``resident`` hashes.  ``finish`` (a request left its replica): its outstanding count.
    A policy's state is only what it reads: the tree exists for cache_aware, the index is kept for
    precise.
    """

    def __init__(self, config: RouterConfig) -> None:
        n = config.replicas
        self.config = config
        self.next_replica = 0
        self.outstanding = [0] * n
        self.step = -1  # the step of the last commit
        self.recent = [0] * n  # requests sent at self.step
        self.placed: dict[str, int] = {}  # request id -> replica, until it finishes
        self.tree = ApproxTree(n, config.page_size, config.max_tree_size) if config.policy == "cache_aware" else None
        self.index: dict[int, int] = {}
        self.resident: list[set[int]] = [set() for _ in range(n)]

    def commit(self, request: RouteRequest, decision: Decision) -> None:
        """Take ``decision`` for ``request``: count it as outstanding, advance the rotation, grow the tree.

        Raises ``ValueError`` if the request is already placed or the decision names another request
        or a replica out of range.
        """
        r = decision.replica
        if decision.request_id != request.request_id or not 0 <= r < self.config.replicas:
            raise ValueError(f"decision {decision.request_id!r} -> {r} does not fit request {request.request_id!r}")
        if request.request_id in self.placed:
            raise ValueError(
                f"request {request.request_id!r} is already placed on replica {self.placed[request.request_id]}"
            )
        if request.step != self.step:
            self.step, self.recent = request.step, [0] * self.config.replicas
        self.recent[r] += 1
        self.outstanding[r] += 1
        self.placed[request.request_id] = r
        self.next_replica = (r + 1) % self.config.replicas
        if self.tree is not None:
            self.tree.insert(request.block_hashes, r, request.step)

    def observe(self, batch: KVEventBatch) -> None:
        """Apply one replica's KV events (``data_parallel_rank`` names it); only precise indexes them.

        Raises ``ValueError`` for a batch without a valid rank.
        """
        r = batch.data_parallel_rank
        if r is None or not 0 <= r < self.config.replicas:
            raise ValueError(f"a KV event batch from replica {r!r}: the fleet has {self.config.replicas}")
        if self.config.policy != "precise":
            return
        bit = 1 << r
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.index[h] = self.index.get(h, 0) | bit
                self.resident[r].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._forget(h, bit)
                self.resident[r].difference_update(event.block_hashes)
            else:
                for h in self.resident[r]:
                    self._forget(h, bit)
                self.resident[r] = set()

    def _forget(self, h: int, bit: int) -> None:
        mask = self.index.get(h, 0) & ~bit
        if mask:
            self.index[h] = mask
        else:
            self.index.pop(h, None)

    def finish(self, request_id: str) -> None:
        """``request_id`` left its replica (finished, rejected or aborted); unknown ids are ignored."""
        r = self.placed.pop(request_id, None)
        if r is not None:
            self.outstanding[r] -= 1

    def resident_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Per replica, how many leading blocks of ``hashes`` its KV events say it holds."""
        return _prefix_by_mask(hashes, lambda h: self.index.get(h, 0), self.config.replicas)

    def to_json(self) -> dict[str, Any]:
        """Everything ``choose`` reads, JSON-ready (for logs and tests)."""
        return {
            "config": self.config.to_json(),
            "next_replica": self.next_replica,
            "outstanding": list(self.outstanding),
            "step": self.step,
            "recent": list(self.recent),
            "placed": dict(self.placed),
            "tree": None if self.tree is None else self.tree.to_json(),
            "index": {str(h): m for h, m in sorted(self.index.items())},
        }


def choose(request: RouteRequest, state: RouterState, views: Sequence[ReplicaView]) -> Decision:
    """The replica ``state.config.policy`` sends ``request`` to, and why; reads, never changes, ``state``.

    ``views`` are the replicas' latest reports, one per replica in replica order.  Ties go to the
    replica with the fewest outstanding requests, then the lowest index (precise and the oracle
    first prefer the longer prefix).  Raises ``ValueError`` for
    views that are not one per replica in order, and for an oracle request without ``oracle_blocks``.
    """
    n = state.config.replicas
    if len(views) != n or any(v.replica != i for i, v in enumerate(views)):
        raise ValueError(f"choose needs one view per replica in order 0..{n - 1}")
    return _POLICY[state.config.policy](request, state, views)


def _least(candidates: Sequence[int], state: RouterState) -> int:
    return min(candidates, key=lambda r: (state.outstanding[r], r))


def _round_robin(request: RouteRequest, state: RouterState, views: Sequence[ReplicaView]) -> Decision:
    r = state.next_replica
    return Decision(
        request.request_id,
        r,
        "round_robin",
        "rotation",
        0,
        f"{request.request_id} goes to replica {r}, next in rotation.",
    )


def _least_loaded(request: RouteRequest, state: RouterState, views: Sequence[ReplicaView]) -> Decision:
    r = _least(range(state.config.replicas), state)
    return Decision(
        request.request_id,
        r,
        "least_loaded",
        "least_loaded",
        0,
        f"{request.request_id} goes to replica {r}, which has the fewest outstanding requests ({state.outstanding[r]}).",
    )


def _cache_aware(request: RouteRequest, state: RouterState, views: Sequence[ReplicaView]) -> Decision:
    """sgl-router's ``CacheAwarePolicy.select_worker`` (sgl-router/src/policies/cache_aware.rs), on blocks."""
    cfg, rid, loads = state.config, request.request_id, state.outstanding
    assert state.tree is not None
    hi, lo = max(loads), min(loads)
    if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
        r = _least(range(cfg.replicas), state)
        why = (
            f"{rid} goes to replica {r}, the least loaded: outstanding requests range {lo}..{hi}, more than "
            f"{cfg.balance_abs_threshold} apart and {hi / max(lo, 1):.2f}x > {cfg.balance_rel_threshold}x, so the load rule wins."
        )
        return Decision(rid, r, "cache_aware", "imbalanced", 0, why)
    depth, tenants = state.tree.match(request.block_hashes)
    matched = depth * cfg.page_size
    rate = matched / request.prompt_len if request.prompt_len else 0.0
    if tenants and rate > cfg.cache_threshold:
        r = _least(tenants, state)
        why = (
            f"{rid} goes to replica {r}: the router sent it {matched} of the prompt's {request.prompt_len} tokens "
            f"before ({rate:.2f} > cache_threshold {cfg.cache_threshold})."
        )
        return Decision(rid, r, "cache_aware", "cache_hit", matched, why)
    r = min(range(cfg.replicas), key=lambda i: (state.tree.size[i], i))  # type: ignore[union-attr]
    why = (
        f"{rid} goes to replica {r}, whose tree is the smallest ({state.tree.size[r]} tokens): the best match is "
        f"{matched} of {request.prompt_len} tokens ({rate:.2f} <= cache_threshold {cfg.cache_threshold})."
    )
    return Decision(rid, r, "cache_aware", "smallest_tree", matched if r in tenants else 0, why)


def _normalized(scores: Sequence[float], present: Sequence[bool]) -> list[float]:
    """llm-d's min-max normalization over the replicas that have a score; the others get 0, and
    equal scores all get 1."""
    have = [s for s, p in zip(scores, present) if p]
    if not have:
        return [0.0] * len(scores)
    lo, hi = min(have), max(have)
    return [(1.0 if hi == lo else (s - lo) / (hi - lo)) if p else 0.0 for s, p in zip(scores, present)]


def _precise(request: RouteRequest, state: RouterState, views: Sequence[ReplicaView]) -> Decision:
    """llm-d's precise prefix-cache scorer (llm-d-kv-cache-manager's longest-prefix scorer over the
    KV-event index) beside the queue and KV-utilization scorers of the Gateway API inference extension,
    weighted 3/2/2 and summed; the highest total wins.  With ``load_guard`` the replicas sgl-router's
    balance test calls overloaded are filtered out before scoring (N24)."""
    return _scored(request, state, views, state.resident_prefix(request.block_hashes), "precise")


def _oracle(request: RouteRequest, state: RouterState, views: Sequence[ReplicaView]) -> Decision:
    """precise's scorers over what the replicas will hold (``oracle_blocks``) instead of what their
    events said they hold: the best-informed policy the benchmark compares precise with."""
    known = request.oracle_blocks
    if known is None or len(known) != state.config.replicas:
        raise ValueError(f"the oracle needs oracle_blocks for every replica with request {request.request_id!r}")
    return _scored(request, state, views, list(known), "oracle")


def _overloaded(state: RouterState) -> list[bool]:
    """Per replica, whether sgl-router's balance test calls it overloaded against the least loaded
    replica: its outstanding requests exceed the fewest by more than ``balance_abs_threshold`` and
    are more than ``balance_rel_threshold`` times the fewest.  All False without ``load_guard``."""
    cfg, loads = state.config, state.outstanding
    lo = min(loads)
    if not cfg.load_guard:
        return [False] * len(loads)
    return [x - lo > cfg.balance_abs_threshold and x > lo * cfg.balance_rel_threshold for x in loads]


def _scored(
    request: RouteRequest, state: RouterState, views: Sequence[ReplicaView], held: list[int], policy: str
) -> Decision:
    """The weighted sum of the prefix, queue and KV-usage scores; ``held`` is each replica's prefix in blocks.

    The load guard is a filter before the scorers, as llm-d's scheduler runs filters then scorers:
    an overloaded replica (``_overloaded``) is no candidate, and every score is normalized over the
    candidates; the least loaded replica is never overloaded, so one is always left.
    """
    cfg, rid, n = state.config, request.request_id, state.config.replicas
    over = _overloaded(state)
    cand = [i for i in range(n) if not over[i]]
    prefix = _normalized(held, [held[i] > 0 and not over[i] for i in range(n)])
    # the router adds what it sent since a replica's report, so a burst does not all go to one replica
    queue = [v.waiting + (state.recent[v.replica] if state.step > v.step else 0) for v in views]
    q = _normalized([-x for x in queue], [not o for o in over])
    total = [
        cfg.prefix_weight * prefix[i] + cfg.queue_weight * q[i] + cfg.kv_weight * (1.0 - views[i].kv_usage)
        for i in range(n)
    ]
    best = max(total[i] for i in cand)
    # ties: the longer prefix, so a shorter one wins only by a strictly better load score
    r = min((i for i in cand if total[i] == best), key=lambda i: (-held[i], state.outstanding[i], i))
    longest, ps = max(held), cfg.page_size
    holds = "holds" if policy == "precise" else "holds or will hold"
    if held[r] == longest:
        if longest:
            why = (
                f"{rid} goes to replica {r}, which {holds} {held[r] * ps} of its {request.prompt_len} prompt tokens, "
                f"as much as any (score {total[r]:.2f}: queue {queue[r]}, KV usage {views[r].kv_usage:.2f})."
            )
        else:
            why = (
                f"{rid} goes to replica {r}: no replica {holds} its first block, so queue ({queue[r]}) and KV usage "
                f"({views[r].kv_usage:.2f}) decide (score {total[r]:.2f})."
            )
        return Decision(rid, r, policy, "longest_prefix" if longest else "no_prefix", held[r] * ps, why)
    longest_cand = [i for i in cand if held[i] == longest]
    if not longest_cand:  # every longest holder is overloaded: the guard decided
        p = min((i for i in range(n) if held[i] == longest), key=lambda i: (state.outstanding[i], i))
        lo = min(state.outstanding)
        why = (
            f"{rid} goes to replica {r}, which {holds} {held[r] * ps} of its prompt tokens, not to replica {p} "
            f"({held[p] * ps}): replica {p} is overloaded ({state.outstanding[p]} outstanding requests against the "
            f"fewest, {lo}: more than {cfg.balance_abs_threshold} apart and over {cfg.balance_rel_threshold}x), "
            f"so the load guard leaves it out (score {total[r]:.2f})."
        )
        return Decision(rid, r, policy, "load:imbalanced", held[r] * ps, why)
    p = max(longest_cand, key=lambda i: (total[i], -state.outstanding[i], -i))
    scorers = (
        ("queue", cfg.queue_weight, q[r], q[p]),
        ("kv_usage", cfg.kv_weight, -views[r].kv_usage, -views[p].kv_usage),
    )
    won = [name for name, weight, mine, theirs in scorers if weight > 0 and mine > theirs]
    why = (
        f"{rid} goes to replica {r}, which {holds} {held[r] * ps} of its prompt tokens, not to replica {p} "
        f"({held[p] * ps}): the load scorers outweigh the prefix ({' and '.join(won)}: queue {queue[r]} vs {queue[p]}, "
        f"KV usage {views[r].kv_usage:.2f} vs {views[p].kv_usage:.2f}; score {total[r]:.2f} vs {total[p]:.2f})."
    )
    return Decision(rid, r, policy, "load:" + "+".join(won), held[r] * ps, why)


_POLICY: dict[str, Callable[[RouteRequest, RouterState, Sequence[ReplicaView]], Decision]] = {
    "round_robin": _round_robin,
    "least_loaded": _least_loaded,
    "cache_aware": _cache_aware,
    "precise": _precise,
    "oracle": _oracle,
}


class Router:
    """A router: ``choose`` over a ``RouterState``, and optionally a log of every input in order.

    With ``log`` on, ``route`` appends ``{"route": request, "views": [...], "decision": ...}``,
    ``observe`` ``{"events": batch in wire form}`` and ``finish`` ``{"finished": id}``, all JSON-ready,
    so ``replay(config, log)`` can take every decision again.
    """

    def __init__(self, config: RouterConfig, log: bool = False) -> None:
        self.state = RouterState(config)
        self.log: list[dict[str, Any]] | None = [] if log else None

    def route(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        """Choose a replica for ``request`` and commit to it; errors as ``choose`` and ``RouterState.commit``."""
        decision = choose(request, self.state, views)
        self.state.commit(request, decision)
        if self.log is not None:
            self.log.append(
                {"route": request.to_json(), "views": [v.to_json() for v in views], "decision": decision.to_json()}
            )
        return decision

    def observe(self, batch: KVEventBatch) -> None:
        self.state.observe(batch)
        if self.log is not None:
            self.log.append({"events": batch.to_wire()})

    def finish(self, request_id: str) -> None:
        self.state.finish(request_id)
        if self.log is not None:
            self.log.append({"finished": request_id})


def replay(config: RouterConfig, log: Sequence[Mapping[str, Any]]) -> list[Decision]:
    """Take again every decision of ``log`` (``Router.log``, or a real router's log in the same form)
    from a fresh state; returns them in order, to compare with the logged ones.

    Raises ``ValueError`` for an entry that is none of route, events or finished.
    """
    router = Router(config)
    decisions = []
    for entry in log:
        if "route" in entry:
            views = [ReplicaView.from_json(v) for v in entry["views"]]
            decisions.append(router.route(RouteRequest.from_json(entry["route"]), views))
        elif "events" in entry:
            router.observe(KVEventBatch.from_wire(entry["events"]))
        elif "finished" in entry:
            router.finish(entry["finished"])
        else:
            raise ValueError(f"a router log entry is route, events or finished, not {sorted(entry)}")
    return decisions


def event_json(event: KVEvent) -> dict[str, Any]:
    """One KV event as a JSON object: ``{"type": "BlockStored", "block_hashes": [...], ...}``."""
    kind = type(event).__name__
    return {"type": kind, **{name: _wire(getattr(event, name)) for name in _EVENT_FIELDS[kind][1]}}


@dataclass(frozen=True)
class FleetRecord:
    """One fleet step: the decisions for the requests that arrived (list order), then every
    replica's record of the step (replica order).  ``explain`` is not a trace field."""

    step: int
    routed: tuple[Decision, ...]
    replicas: tuple[StepRecord, ...]

    @property
    def explain(self) -> tuple[str, ...]:
        """The decisions' reasons, then each replica's sentences, prefixed with its index."""
        mine = tuple(d.reason for d in self.routed)
        return mine + tuple(f"replica {i}: {s}" for i, rec in enumerate(self.replicas) for s in rec.explain)

    def to_json(self) -> dict[str, Any]:
        """``{"step", "routed": [decision, ...], "replicas": [{"replica", "record", "kv_events"}, ...]}``:
        each ``record`` is the replica's own record (m14's JSON form), ``kv_events`` its events."""
        return {
            "step": self.step,
            "routed": [d.to_json() for d in self.routed],
            "replicas": [
                {"replica": i, "record": rec.to_json(), "kv_events": [event_json(e) for e in rec.kv_events]}
                for i, rec in enumerate(self.replicas)
            ],
        }


class Fleet:
    """m15's whole system: ``replicas`` engines, each with its own pool and radix cache, behind one router.

    ``requests`` (list order) arrive at their ``arrival_step``.  A fleet step is::

        route  every request due now, in list order: choose(...) -> replica -> that replica's door (m12)
        step   every replica once, in replica order (replica i's step k is fleet step k)
        hear   each replica's KV events and the requests that left it (finished, rejected, aborted)

    The router decides from the views the replicas reported after the previous step.  It hashes
    each prompt once and hands the replica the request's keys and hashes with it; equal keys are
    one object fleet-wide, so every radix cache compares them by identity.  ``engine`` holds the
    ``Engine`` keyword arguments every replica gets (``executors`` is refused: each replica runs its
    own scripted executor); ``log`` keeps the router's log (``Router``); ``replica_factory`` makes each
    replica (default ``Engine``; a simulator may give a subclass that decides identically).  Raises ``ValueError`` for
    ``replicas <= 0``, a bad router value (``RouterConfig``), a duplicate request id, or what
    ``Engine`` raises.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        *,
        replicas: int = 1,
        routing_policy: str = DEFAULT_POLICY,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        load_guard: bool = True,
        log: bool = False,
        replica_factory: Callable[..., Engine] | None = None,
        **engine: Any,
    ) -> None:
        if "executors" in engine:
            raise ValueError("a fleet's replicas run their own scripted executors; executors cannot be given")
        if replicas <= 0:
            raise ValueError("replicas must be > 0")
        self.replicas = [(replica_factory or Engine)([], **engine) for _ in range(replicas)]
        first = self.replicas[0]
        self.config = RouterConfig(
            routing_policy,
            replicas,
            first.pool.page_size,
            cache_threshold,
            balance_abs_threshold,
            balance_rel_threshold,
            hash_seed=engine.get("hash_seed", ""),
            load_guard=load_guard,
        )
        self.router = Router(self.config, log=log)
        self.requests: list[Request] = []
        self.placement: dict[str, int] = {}  # request id -> replica
        self.step_counter = 0
        self._arrivals: list[tuple[int, int, Request]] = []
        self._seen: set[str] = set()
        # interned keys and their hashes, kept while a request or a cache holds the key
        self._keys: weakref.WeakValueDictionary[PrefixKey, PrefixKey] = weakref.WeakValueDictionary()
        self._key_hash: weakref.WeakKeyDictionary[PrefixKey, int] = weakref.WeakKeyDictionary()
        # the oracle's knowledge, per block hash: the replicas holding it, and those whose requests will
        self._held: dict[int, int] = {}
        self._will: dict[int, int] = {}
        self._will_count: dict[tuple[int, int], int] = {}
        self._hashes: dict[str, tuple[int, ...]] = {}  # routed, unfinished request -> its prompt hashes
        for r in requests:
            self.add_request(r)

    def add_request(self, r: Request) -> None:
        """Queue ``r`` to be routed at its arrival step (the next step if that has passed).

        Raises ``ValueError`` for an id the fleet has seen before.
        """
        if r.request_id in self._seen:
            raise ValueError(f"duplicate request id {r.request_id!r}: a fleet routes each id once")
        self._seen.add(r.request_id)
        heapq.heappush(self._arrivals, (r.arrival_step, len(self.requests), r))
        self.requests.append(r)

    @property
    def running(self) -> bool:
        """True while some replica has a running request."""
        return any(e.running for e in self.replicas)

    def views(self) -> list[ReplicaView]:
        """What every replica reports now, after the last step: running, waiting and KV usage
        (only precise and the oracle read KV usage; it is 0 for the other policies)."""
        out = []
        scored = self.config.policy in ("precise", "oracle")
        for i, e in enumerate(self.replicas):
            held = len({p for r in e.running for p in r.page_table}) if scored else 0
            waiting = len(e.waiting) + len(e.due)
            out.append(ReplicaView(i, self.step_counter - 1, len(e.running), waiting, held / e.pool.num_pages))
        return out

    def step(self) -> FleetRecord:
        """Route the requests due now, step every replica, let the router hear them; return the record.

        Engine errors propagate (``OutOfPages``), after the router has placed this step's requests.
        """
        routed: list[Decision] = []
        views: list[ReplicaView] | None = None
        while self._arrivals and self._arrivals[0][0] <= self.step_counter:
            r = heapq.heappop(self._arrivals)[2]
            views = views or self.views()
            request = self._prepare(r)
            decision = self.router.route(request, views)
            self.placement[r.request_id] = decision.replica
            if self.config.policy == "oracle":
                self._hashes[r.request_id] = request.block_hashes
                self._expect(request.block_hashes, decision.replica, +1)
            self.replicas[decision.replica].add_request(r)
            routed.append(decision)
        records = tuple(e.step() for e in self.replicas)
        for i, rec in enumerate(records):
            if rec.kv_events:
                self.router.observe(KVEventBatch(self.step_counter, rec.kv_events, i))
                if self.config.policy == "oracle":
                    self._hear(i, rec.kv_events)
            for rid in (*rec.finished, *(rid for rid, _ in rec.rejected), *rec.aborted):
                self.router.finish(rid)
                if rid in self._hashes:
                    self._expect(self._hashes.pop(rid), i, -1)
        record = FleetRecord(self.step_counter, tuple(routed), records)
        self.step_counter += 1
        return record

    def run(self, on_step: Callable[[FleetRecord], None] | None = None) -> list[FleetRecord]:
        """Step until no request is left to route and no replica has work (``Engine.run``'s condition)."""
        records = []
        while self._arrivals or any(
            e.waiting or e.due or e.running or e._rejected or e._aborted for e in self.replicas
        ):
            record = self.step()
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    def _prepare(self, r: Request) -> RouteRequest:
        """Give ``r`` its prompt keys (interned) and block hashes; return what the router sees of it."""
        ps, ns = self.config.page_size, self.replicas[0].namespace
        keys: list[PrefixKey] = []
        hashes: list[int] = []
        parent: PrefixKey | None = ROOT
        h = self.replicas[0].hash_root
        for i in range(len(r.tokens) // ps):
            key = PrefixKey(ns, parent, tuple(r.tokens[i * ps : (i + 1) * ps]))
            known = self._keys.get(key)
            if known is None:
                known = self._keys[key] = key
                self._key_hash[key] = block_hash(h, key.block_tokens)
            parent, h = known, self._key_hash[known]
            keys.append(parent)
            hashes.append(h)
        r.prompt_keys, r.block_hashes = keys, hashes
        oracle = self._oracle_blocks(hashes) if self.config.policy == "oracle" else None
        return RouteRequest(r.request_id, self.step_counter, len(r.tokens), tuple(hashes), oracle)

    # The oracle's knowledge, read from inside the replicas: held blocks (their events, at once) and
    # the prompt blocks of the requests sent to them that have not left (they will be published).
    def _oracle_blocks(self, hashes: Sequence[int]) -> tuple[int, ...]:
        masks = lambda h: self._held.get(h, 0) | self._will.get(h, 0)  # noqa: E731
        return tuple(_prefix_by_mask(hashes, masks, self.config.replicas))

    def _expect(self, hashes: Sequence[int], replica: int, delta: int) -> None:
        bit = 1 << replica
        for h in hashes:
            n = self._will_count.get((h, replica), 0) + delta
            if n:
                self._will_count[(h, replica)] = n
                self._will[h] = self._will.get(h, 0) | bit
            else:
                del self._will_count[(h, replica)]
                self._will[h] &= ~bit
                if not self._will[h]:
                    del self._will[h]

    def _hear(self, replica: int, events: Sequence[KVEvent]) -> None:
        bit = 1 << replica
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._held[h] = self._held.get(h, 0) | bit
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._held[h] &= ~bit
            else:
                for h in list(self._held):
                    self._held[h] &= ~bit

    def drop_finished(self) -> list[Request]:
        """Let go of every request that has left its replica and whose leaving is recorded
        (``Engine.drop_finished`` on each replica); return them.  A long simulation calls this so
        its memory follows the live requests."""
        gone = [r for e in self.replicas for r in e.drop_finished()]
        dropped = {id(r) for r in gone}
        self.requests = [r for r in self.requests if id(r) not in dropped]
        for r in gone:
            del self.placement[r.request_id]
        return gone

    def summary(self) -> list[dict[str, Any]]:
        """One entry per request, fleet list order: its replica's summary entry plus ``replica``
        (None, and state WAITING, for a request not routed yet)."""
        entries: dict[str, dict[str, Any]] = {}
        for i, e in enumerate(self.replicas):
            for entry in e.summary():
                entries[entry["request_id"]] = {**entry, "replica": i}
        waiting = {"state": "WAITING", "generated": 0, "computed": 0, "finish_reason": None, "replica": None}
        return [entries.get(r.request_id, {"request_id": r.request_id, **waiting}) for r in self.requests]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless every replica's invariants hold (m14's, and m15's block
        hashes) and every routed request is on exactly the replica its decision named."""
        for e in self.replicas:
            e.check_invariants()
        where: dict[str, int] = {}
        for i, e in enumerate(self.replicas):
            for r in e.requests:
                assert r.request_id not in where, f"{r.request_id} is on replicas {where[r.request_id]} and {i}"
                where[r.request_id] = i
        assert where == self.placement, "a request is not where the router placed it"
