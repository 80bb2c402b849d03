"""KV events of the runtime (``mechserve.kv_events``): the same cache changes m15's engine reports, on vLLM's wire."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.kv_events import CacheEventRecorder, KVEventPublisher, decode_batch, encode_batch
from mechserve.spec import m15_routing as m15
from mechserve.spec import m16_request_draft_lengths as m16


def apply(held: set[int], events: Any) -> None:
    for e in events:
        if isinstance(e, m15.BlockStored):
            assert not held & set(e.block_hashes), "a block stored twice without a removal"
            held.update(e.block_hashes)
        elif isinstance(e, m15.BlockRemoved):
            assert set(e.block_hashes) <= held, "a block removed that was never stored"
            held.difference_update(e.block_hashes)
        else:
            held.clear()


def check_chains(events: Any, root: int, page_size: int) -> None:
    """Every BlockStored chains from its parent over its token ids, as vLLM's hashes do."""
    for e in events:
        if isinstance(e, m15.BlockStored):
            parent = root if e.parent_block_hash is None else e.parent_block_hash
            assert len(e.token_ids) == len(e.block_hashes) * page_size == len(e.block_hashes) * e.block_size
            for i, h in enumerate(e.block_hashes):
                assert h == m15.block_hash(parent, e.token_ids[i * page_size : (i + 1) * page_size])
                parent = h


def requests(module: Any, seed: int, count: int) -> list[Any]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    out = []
    for i in range(count):
        prompt = rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
        out.append(module.Request(f"r{i}", prompt, rng.randrange(1, 9), arrival_step=rng.randrange(0, 6)))
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    count=st.integers(1, 12),
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(24, 64),
    output_caching=st.booleans(),
)
def test_recorder_reports_what_m15s_engine_reports(
    seed: int, count: int, page_size: int, num_pages: int, output_caching: bool
) -> None:
    """Step by step, the recorder's events over m14's cache leave a subscriber holding exactly the blocks
    m15's own events (its publish and evict points) say, with vLLM's chained hashes."""
    kw = dict(max_step_tokens=16, page_size=page_size, num_pages=num_pages, output_caching=output_caching)
    spec = m15.Engine(requests(m15, seed, count), **kw)
    real = m16.Engine(requests(m16, seed, count), **kw)
    recorder = CacheEventRecorder(page_size)
    theirs: list[set[int]] = []
    mine: list[set[int]] = []
    held_theirs: set[int] = set()
    held_mine: set[int] = set()

    def spec_step(rec: Any) -> None:
        apply(held_theirs, rec.kv_events)
        theirs.append(set(held_theirs))

    def real_step(rec: Any) -> None:
        events = recorder.changes(real.cache)
        check_chains(events, recorder.root, page_size)
        apply(held_mine, events)
        mine.append(set(held_mine))

    try:
        spec.run(on_step=spec_step)
    except (m16.OutOfPages, RuntimeError):
        return  # the workload does not fit; m14 would refuse it the same way
    real.run(on_step=real_step)
    assert mine == theirs
    assert any(mine)


def test_batches_round_trip_through_vllms_msgpack_layout() -> None:
    batch = m15.KVEventBatch(
        12.5,
        (
            m15.BlockStored((7, 8), None, (1, 2, 3, 4), 2),
            m15.BlockRemoved((5,)),
            m15.AllBlocksCleared(),
        ),
        3,
    )
    payload = encode_batch(batch)
    assert msgspec.msgpack.decode(payload) == [
        12.5,
        [
            ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU"],
            ["BlockRemoved", [5], "GPU"],
            ["AllBlocksCleared"],
        ],
        3,
    ]
    assert decode_batch(payload) == batch
    for bad in (b"\x00garbage", msgspec.msgpack.encode([1.0, [["Nope", 1]]]), msgspec.msgpack.encode({"ts": 1})):
        with pytest.raises(ValueError, match="not a KV event batch"):
            decode_batch(bad)
    with pytest.raises(ValueError, match="not a KV event batch"):  # a field of the wrong type
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"], "GPU"]]]))


def test_publisher_frames_topic_sequence_payload() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv")
    endpoint = publisher._socket.getsockopt_string(zmq.LAST_ENDPOINT)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        frames: list[list[bytes]] = []
        for _ in range(200):  # a PUB socket drops what it sends before the subscription arrives
            publisher.publish([m15.BlockRemoved((1,))])
            if sub.poll(20):
                frames.append(sub.recv_multipart())
                break
        assert frames, "no batch arrived"
        topic, seq, payload = frames[0]
        assert topic == b"kv" and len(seq) == 8
        first = int.from_bytes(seq, "big")
        publisher.publish([m15.BlockRemoved((2,))])
        publisher.publish([])  # nothing to say: nothing sent
        publisher.publish([m15.AllBlocksCleared()])
        later = [sub.recv_multipart() for _ in range(2)]
        assert [int.from_bytes(f[1], "big") for f in later] == [first + 1, first + 2]
        assert decode_batch(later[1][2]).events == (m15.AllBlocksCleared(),)
        assert decode_batch(payload).events == (m15.BlockRemoved((1,)),)
    finally:
        sub.close()
        publisher.close()
    with pytest.raises(ValueError, match="cannot bind the KV event endpoint"):
        KVEventPublisher("tcp://256.1.1.1:5")
