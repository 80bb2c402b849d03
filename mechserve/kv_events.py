"""KV events across machines: vLLM's ``KVEventBatch`` on a ZeroMQ PUB socket, and its subscriber.

An engine tells routers what its prefix cache holds as vLLM does (``vllm/distributed/kv_events.py``,
the schema of vLLM 0.11: ``KVEventBatch(ts, events, data_parallel_rank)`` of ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared``; docs/fleet.md), so llm-d's indexer can consume them::

    frame 0  topic              the publisher's topic (vLLM's default "")
    frame 1  sequence number    8 bytes, big-endian, 0, 1, 2, ... per publisher
    frame 2  payload            msgpack of the batch: msgspec array_like structs, events tagged by name

``CacheEventRecorder`` turns the runtime's prefix cache (m14's radix tree, read between steps) into
those events, with m15's block hashes (``sha256_cbor_64bit``); ``KVEventPublisher`` binds the PUB
socket and numbers the batches; ``decode_batch`` reads a payload back with the schema (msgspec
validates every field: nothing from the network is unpickled or trusted).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import zmq

from mechserve.spec import m15_routing as m15
from mechserve.spec import m16_request_draft_lengths as m16

# vLLM's structs (vllm/distributed/kv_events.py): array_like, events tagged with their class name.


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class WireBlockStored(_Event, tag="BlockStored"):
    """vLLM's ``BlockStored``: chained ``block_hashes``, the first's ``parent_block_hash``, their ids."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class WireBlockRemoved(_Event, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved``: evicted block hashes."""

    block_hashes: list[int]
    medium: str | None


class WireAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared``: the cache was emptied."""


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: ``ts`` (seconds since the epoch), the events, the engine's DP rank."""

    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(WireBatch)
_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: m15.KVEventBatch) -> bytes:
    """The msgpack payload of ``batch`` (m15's ``to_wire`` layout, which is vLLM's)."""
    return _ENCODER.encode(batch.to_wire())


def decode_batch(payload: bytes) -> m15.KVEventBatch:
    """The batch a payload carries; raises ``ValueError`` for one that does not follow the schema."""
    try:
        wire = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    return m15.KVEventBatch.from_wire(msgspec.to_builtins(wire))


class CacheEventRecorder:
    """What changed in an m14 engine's prefix cache since the last call, as vLLM's KV events.

    ``changes(cache)`` walks the radix tree (pre-order) and compares the blocks it holds with those
    it held at the last call: the new ones as ``BlockStored`` events (one per run of new blocks along
    a chain, parent hash and token ids included), the gone ones as one ``BlockRemoved``.  A block's
    hash is m15's ``block_hash`` chained from ``hash_root(hash_seed)`` (vLLM's ``sha256_cbor_64bit``
    with ``PYTHONHASHSEED=hash_seed``).  It reads the cache only: call it between steps, on the
    engine's thread.  Cost: one walk of the tree per call (callers skip steps that published and
    evicted nothing).
    """

    def __init__(self, page_size: int, hash_seed: str = "") -> None:
        self.page_size = page_size
        self.root = m15.hash_root(hash_seed)
        self.held: dict[m16.PrefixKey, int] = {}  # resident key -> its block hash

    def changes(self, cache: m16.RadixCache) -> list[m15.KVEvent]:
        """The events that take a subscriber from the last call's cache to ``cache``'s."""
        now: dict[m16.PrefixKey, int] = {}
        stored: list[m15.KVEvent] = []
        run: list[tuple[int, m16.PrefixKey]] = []  # the current run of new blocks along one chain
        run_parent: list[int | None] = [None]

        def close_run() -> None:
            if run:
                ids = tuple(t for _, key in run for t in key.block_tokens)
                hashes = tuple(h for h, _ in run)
                stored.append(m15.BlockStored(hashes, run_parent[0], ids, self.page_size))
                run.clear()

        # iterative pre-order walk: (children, parent hash, whether the parent was new in this call)
        stack: list[Any] = [(iter(cache.root.items()), None)]
        while stack:
            children, parent_hash = stack[-1]
            item = next(children, None)
            if item is None:
                stack.pop()
                continue
            key, node = item
            h = self.held.get(key)
            if h is None:
                h = m15.block_hash(self.root if parent_hash is None else parent_hash, key.block_tokens)
                if not run or run[-1][0] != parent_hash:
                    close_run()
                    run_parent[0] = parent_hash
                run.append((h, key))
            else:
                close_run()
            now[key] = h
            stack.append((iter(node.children.items()), h))
        close_run()
        gone = tuple(h for key, h in self.held.items() if key not in now)
        self.held = now
        return ([m15.BlockRemoved(gone)] if gone else []) + stored


class KVEventPublisher:
    """A ZeroMQ PUB socket bound to ``endpoint`` (vLLM's ``--kv-events-config`` endpoint, e.g.
    ``tcp://*:5557``) that sends each batch as ``[topic, sequence, payload]``.

    Thread-safe (one lock around the socket).  Raises ``ValueError`` for an endpoint ZeroMQ cannot
    bind (named in the message).
    """

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(f"cannot bind the KV event endpoint {endpoint}: {exc}") from None
        self.sequence = 0
        self._lock = threading.Lock()

    def publish(self, events: list[m15.KVEvent], rank: int | None = None) -> None:
        """Send ``events`` as one batch stamped now (nothing for an empty list)."""
        if not events:
            return
        payload = encode_batch(m15.KVEventBatch(time.time(), tuple(events), rank))
        with self._lock:
            self._socket.send_multipart([self.topic, self.sequence.to_bytes(8, "big"), payload])
            self.sequence += 1

    def close(self) -> None:
        with self._lock:
            self._socket.close()


class EnginePublisher:
    """The ``on_step`` hook of a serving engine: after a step that published or evicted, the cache's
    changes go out as one batch.  ``attach(core)`` names the ``EngineCore`` whose prefix cache is read
    (on the engine thread, between steps); before it, steps are not looked at."""

    def __init__(self, publisher: KVEventPublisher, hash_seed: str = "") -> None:
        self.publisher = publisher
        self.hash_seed = hash_seed
        self.core: Any = None
        self.recorder: CacheEventRecorder | None = None

    def attach(self, core: Any) -> None:
        self.recorder = CacheEventRecorder(core.config.page_size, self.hash_seed)
        self.core = core

    def __call__(self, out: Any) -> None:
        record = out.record
        if self.recorder is None or not (record.published or record.evicted):
            return
        self.publisher.publish(self.recorder.changes(self.core.scheduler.prefix_cache))
