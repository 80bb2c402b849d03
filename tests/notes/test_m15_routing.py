"""Pins every numbered line of mech-notes/15-routing.md.

Tenants are prompts that share leading blocks: ``tenant(t, i)`` is tenant ``t``'s 8-token system
prompt (two blocks of 4) followed by request ``i``'s own ids, so requests of one tenant share
exactly two complete blocks.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechserve.cli.main import main
from mechserve.conformance.strategies import build, prompt_tokens, workloads
from mechserve.spec import m14_forced_runs as m14
from mechserve.spec import m15_routing as m
from mechserve.workload import WorkloadError, build_engine, build_fleet, load_rung, parse_workload

R = m.Request
CI = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENGINE: dict[str, Any] = {"max_step_tokens": 16, "page_size": 4, "num_pages": 16}


def tenant(t: int, i: int, own: int = 3) -> list[int]:
    """Tenant ``t``'s system prompt (8 ids) then ``own`` ids of request ``i``."""
    return [100 * t + k for k in range(1, 9)] + [10_000 + 10 * i + k for k in range(own)]


def fleet(requests: Sequence[m.Request], **kw: Any) -> m.Fleet:
    return m.Fleet(requests, **{**ENGINE, **kw})


def run(f: m.Fleet, limit: int = 300) -> list[m.FleetRecord]:
    def watch(rec: m.FleetRecord) -> None:
        assert rec.step < limit, "run() did not stop"
        f.check_invariants()

    return f.run(on_step=watch)


def view(i: int, running: int = 0, waiting: int = 0, kv: float = 0.0, step: int = -1) -> m.ReplicaView:
    return m.ReplicaView(i, step, running, waiting, kv)


def req(
    rid: str, tokens: Sequence[int], step: int = 0, ps: int = 4, oracle: tuple[int, ...] | None = None
) -> m.RouteRequest:
    plain = m.RouteRequest.from_tokens(rid, tokens, ps, step)
    assert plain.block_hashes == tuple(m.block_hashes(tokens, ps, m.hash_root()))
    return m.RouteRequest(rid, step, len(tokens), plain.block_hashes, oracle)


def stored(replica: int, tokens: Sequence[int], ps: int = 4) -> m.KVEventBatch:
    hashes = m.block_hashes(tokens, ps, m.hash_root())
    return m.KVEventBatch(0, (m.BlockStored(tuple(hashes), None, tuple(tokens[: len(hashes) * ps]), ps),), replica)


def state(policy: str, replicas: int = 2, **kw: Any) -> m.RouterState:
    return m.RouterState(m.RouterConfig(policy, replicas, 4, **kw))


def fleet_workload(w: dict[str, Any], **fleet_values: Any) -> Any:
    return build_fleet(m, parse_workload({**w, "fleet": fleet_values}))


def offered_at_arrival(engine: Any, requests: Sequence[Any]) -> list[Any]:
    """Run ``engine`` (built without requests) offering each request at its arrival step, in list
    order, as a server (and a fleet's router) does; return the records."""
    pending = sorted(enumerate(requests), key=lambda p: (p[1].arrival_step, p[0]))
    records, step = [], 0
    while pending or engine.waiting or engine.due or engine.running or engine._rejected or engine._aborted:
        while pending and pending[0][1].arrival_step <= step:
            engine.add_request(pending.pop(0)[1])
        records.append(engine.step())
        step += 1
        assert step < 400, "did not stop"
    return records


@CI
@given(w=workloads(prompts="mixed", output_caching="any", page_size=(1, 4)), policy=st.sampled_from(m.POLICIES))
def test_m15_n1_one_replica_is_m14_fed_at_arrival(w: dict[str, Any], policy: str) -> None:
    def outcome(run: Any) -> Any:
        try:
            return run(), None
        except Exception as exc:
            return None, type(exc).__name__

    one = build(m14, {**w, "requests": []})
    fresh = [
        m14.Request(
            str(spec["request_id"]),
            prompt_tokens(w, i),
            int(spec["max_new_tokens"]),
            arrival_step=spec.get("arrival_step") or 0,
            eos_after=spec.get("eos_after"),
        )
        for i, spec in enumerate(w["requests"])
    ]
    mine, mine_error = outcome(lambda: [r.to_json() for r in offered_at_arrival(one, fresh)])
    f = fleet_workload(w, replicas=1, routing_policy=policy)
    theirs, error = outcome(lambda: [rec.replicas[0].to_json() for rec in f.run()])
    assert (theirs, error) == (mine, mine_error)
    if error is None:
        assert {e["request_id"]: e for e in one.summary()} == {
            e["request_id"]: {k: v for k, v in e.items() if k != "replica"} for e in f.summary()
        }
        assert all(e["replica"] == 0 for e in f.summary())


def test_m15_n2_routed_at_arrival_in_list_order_once() -> None:
    big = R("big", list(range(1, 80)), 5, arrival_step=1)  # needs more pages than the pool: REJECTED at its door
    reqs = [
        R("late", tenant(1, 0), 2, arrival_step=2),
        R("a", tenant(1, 1), 2),
        big,
        R("b", tenant(2, 2), 2, arrival_step=1),
    ]
    f = fleet(reqs, replicas=2, routing_policy="round_robin")
    records = run(f)
    assert [[d.request_id for d in rec.routed] for rec in records[:3]] == [["a"], ["big", "b"], ["late"]]
    assert all(rec.step == k and all(r.step == k for r in rec.replicas) for k, rec in enumerate(records))
    assert all(len(rec.replicas) == 2 for rec in records)
    assert any(not r.to_json()["executed"] for rec in records for r in rec.replicas)  # an empty record is still there
    assert f.placement == {"a": 0, "big": 1, "b": 0, "late": 1}
    assert records[1].replicas[1].rejected == (("big", m.RejectReason.NEVER_FITS),)
    assert {e["request_id"]: e["replica"] for e in f.summary()} == f.placement


def test_m15_n3_choose_is_pure_and_its_messages_round_trip() -> None:
    s = state("cache_aware", 3)
    first = req("a", tenant(1, 0))
    s.commit(first, m.choose(first, s, [view(i) for i in range(3)]))
    second, views = req("b", tenant(1, 1)), [view(0, 1, 2, 0.5), view(1), view(2)]
    before = json.dumps(s.to_json())
    d = m.choose(second, s, views)
    assert json.dumps(s.to_json()) == before
    assert d == m.choose(second, copy.deepcopy(s), list(views)) == m.choose(second, s, views)
    assert (d.request_id, d.replica, d.policy, d.rule, d.matched) == ("b", 0, "cache_aware", "cache_hit", 8)
    assert d.rule in m.RULES["cache_aware"] and d.reason.startswith("b goes to replica 0")
    for obj in (d, second, views[0], s.config):
        assert type(obj).from_json(json.loads(json.dumps(obj.to_json()))) == obj
    batch = stored(2, tenant(1, 0))
    assert m.KVEventBatch.from_wire(json.loads(json.dumps(batch.to_wire()))) == batch


@pytest.mark.parametrize("policy", m.POLICIES)
def test_m15_n4_state_changes_only_by_commit_observe_finish_and_replays(policy: str) -> None:
    reqs = [R(f"r{i}", tenant(i % 3, i), 3, arrival_step=i // 2) for i in range(10)]
    f = fleet(reqs, replicas=3, routing_policy=policy, log=True)
    records = run(f)
    log = json.loads(json.dumps(f.router.log))
    assert [d for rec in records for d in rec.routed] == m.replay(f.config, log)
    assert {next(iter(e)) for e in log} == {"route", "events", "finished"}
    assert f.router.state.outstanding == [0, 0, 0] and f.router.state.placed == {}
    s = state(policy, 2)
    r0 = req("x", tenant(1, 0), oracle=(0, 0))
    d = m.choose(r0, s, [view(0), view(1)])
    s.commit(r0, d)
    assert s.outstanding[d.replica] == 1 and s.placed == {"x": d.replica} and s.recent[d.replica] == 1
    with pytest.raises(ValueError, match="already placed"):
        s.commit(r0, d)
    s.finish("x")
    assert s.outstanding == [0, 0]
    with pytest.raises(ValueError, match="route, events or finished"):
        m.replay(f.config, [{"other": 1}])


def test_m15_n5_views_are_the_replicas_reports_after_the_last_step() -> None:
    reqs = [R("a", tenant(1, 0), 4), R("b", tenant(2, 1), 4), R("c", tenant(3, 2), 4)]
    f = fleet(reqs, replicas=1, routing_policy="precise", max_running=2)
    f.step()
    (v,) = f.views()
    e = f.replicas[0]
    held = {p for r in e.running for p in r.page_table}
    assert (v.replica, v.step, v.running, v.waiting) == (0, 0, 2, 1)
    assert v.kv_usage == len(held) / 16 > 0
    with pytest.raises(ValueError, match="one view per replica"):
        m.choose(req("z", tenant(1, 9)), f.router.state, [view(1)])


def test_m15_n6_round_robin_rotates() -> None:
    s = state("round_robin", 3)
    chosen = []
    for i in range(7):
        r = req(f"r{i}", tenant(1, i))
        d = m.choose(r, s, [view(k) for k in range(3)])
        s.commit(r, d)
        chosen.append((d.replica, d.rule))
    assert chosen == [(i % 3, "rotation") for i in range(7)]


def test_m15_n7_least_loaded_takes_fewest_outstanding_lowest_index() -> None:
    s = state("least_loaded", 3)
    s.outstanding = [2, 1, 1]
    d = m.choose(req("a", tenant(1, 0)), s, [view(k) for k in range(3)])
    assert (d.replica, d.rule) == (1, "least_loaded")
    f = fleet([R(f"r{i}", tenant(1, i), 2) for i in range(4)], replicas=2, routing_policy="least_loaded")
    records = run(f)
    assert [d.replica for d in records[0].routed] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [([70, 0], True), ([70, 10], False), ([200, 100], True), ([140, 100], False), ([65, 0], True), ([64, 0], False)],
)
def test_m15_n8_cache_aware_load_rule_needs_both_thresholds(loads: list[int], imbalanced: bool) -> None:
    s = state("cache_aware", 2)
    warm = req("w", tenant(1, 0))
    s.commit(warm, m.Decision("w", 0, "cache_aware", "cache_hit", 0, ""))
    s.outstanding = list(loads)
    d = m.choose(req("a", tenant(1, 1)), s, [view(0), view(1)])
    assert (d.rule == "imbalanced") is imbalanced
    assert d.replica == (1 if imbalanced else 0)


def test_m15_n9_cache_aware_tree_match_threshold_smallest_tree_and_trim() -> None:
    s = state("cache_aware", 3)
    views = [view(k) for k in range(3)]
    a = req("a", tenant(1, 0))
    s.commit(a, m.choose(a, s, views))  # smallest tree: replica 0
    s.commit(b := req("b", tenant(2, 1)), m.choose(b, s, views))  # 1
    hit = m.choose(req("c", tenant(1, 2)), s, views)
    assert (hit.replica, hit.rule, hit.matched) == (0, "cache_hit", 8)  # 8 of 11 tokens > 0.3
    long = req("d", tenant(1, 3, own=20))  # 8 of 28 tokens = 0.29: not above the threshold
    miss = m.choose(long, s, views)
    assert (miss.replica, miss.rule) == (2, "smallest_tree")
    s.commit(long, miss)
    assert s.tree is not None and s.tree.match(long.block_hashes) == (7, (2,)) and s.tree.size[2] == 28
    trimmed = state("cache_aware", 2, max_tree_size=8)
    for i, step in ((0, 0), (1, 1)):
        r = req(f"t{i}", tenant(i + 1, i), step=step)
        trimmed.commit(r, m.Decision(r.request_id, 0, "cache_aware", "smallest_tree", 0, ""))
    assert trimmed.tree is not None and trimmed.tree.size[0] == 8
    assert trimmed.tree.match(req("q", tenant(1, 5)).block_hashes) == (0, ())  # the older tenant's blocks went first
    assert trimmed.tree.match(req("q", tenant(2, 5)).block_hashes) == (2, (0,))


def test_m15_n10_the_tree_hears_no_eviction() -> None:
    s = state("cache_aware", 2)
    a = req("a", tenant(1, 0))
    s.commit(a, m.Decision("a", 1, "cache_aware", "smallest_tree", 0, ""))
    s.observe(m.KVEventBatch(1, (m.BlockRemoved(a.block_hashes),), 1))
    d = m.choose(req("b", tenant(1, 1)), s, [view(0), view(1)])
    assert (d.replica, d.rule) == (1, "cache_hit")


def test_m15_n11_records_carry_kv_events_not_in_json() -> None:
    e = m.Engine([R("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2), R("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)], 32, 4, 6)
    first = e.step()
    h = m.block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, e.hash_root)
    assert first.kv_events == (
        m.BlockStored(tuple(h), None, (1, 2, 3, 4, 5, 6, 7, 8), 4, None, "GPU"),
    )  # b adopted: no event
    assert (
        "kv_events" not in first.to_json()
        and first.to_json()
        == m14.Engine(
            [m14.Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2), m14.Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)],
            32,
            4,
            6,
        )
        .step()
        .to_json()
    )
    records = e.run()
    later = m.Engine([R("c", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 1)], 32, 4, 6)
    later.cache, later._page_hash, later.pool = e.cache, e._page_hash, e.pool
    (rec,) = later.run()
    assert rec.kv_events[0] == m.BlockStored((m.block_hash(h[1], (9, 10, 11, 12)),), h[1], (9, 10, 11, 12), 4)
    evicting = m.Engine([R("x", list(range(1, 10)), 1), R("y", list(range(20, 45)), 1, arrival_step=1)], 32, 4, 7)
    recs = evicting.run()
    removed = [ev for rec in recs for ev in rec.kv_events if isinstance(ev, m.BlockRemoved)]
    assert removed and removed[0].block_hashes == tuple(
        reversed(m.block_hashes(list(range(1, 9)), 4, evicting.hash_root))
    )
    assert [rec.evicted for rec in recs if rec.evicted] and not [r for r in records if "kv_events" in r.to_json()]


def test_m15_n12_block_hash_is_sha256_cbor_64bit() -> None:
    assert m._cbor([5, [1, 2, 3], None]) == bytes.fromhex("830583010203f6")
    assert m._cbor([500, (24, 256, 70_000), None]) == bytes.fromhex("831901f483181819010" + "01a00011170f6")
    assert m.hash_root("") == int.from_bytes(hashlib.sha256(b"\x60").digest()[-8:], "big")
    assert m.hash_root("42") == int.from_bytes(hashlib.sha256(b"\x62" + b"42").digest()[-8:], "big")
    payload = b"\x83" + b"\x1b" + (7).to_bytes(8, "big") + b"\x84\x01\x02\x03\x04\xf6"
    assert m.block_hash(7, [1, 2, 3, 4]) == int.from_bytes(
        hashlib.sha256(m._cbor([7, [1, 2, 3, 4], None])).digest()[-8:], "big"
    )
    assert payload != m._cbor([7, [1, 2, 3, 4], None])  # canonical: 7 takes one byte, not eight
    assert m.block_hash(-1 & 0, [5, -3]) == int.from_bytes(
        hashlib.sha256(m._cbor([0, [5, -3], None])).digest()[-8:], "big"
    )
    e = m.Engine([R("a", list(range(1, 11)), 6)], 32, 4, 8, output_caching=True, hash_seed="s")
    run_all = e.run()
    a = e.requests[0]
    assert a.block_hashes == m.block_hashes(a.tokens + a.output_ids, 4, m.hash_root("s"))[: len(a.block_hashes)]
    assert len(a.block_hashes) == 3 and any(len(ev.block_hashes) for rec in run_all for ev in rec.kv_events)


def test_m15_n13_wire_layout_is_vllm_msgpack() -> None:
    batch = m.KVEventBatch(
        3.5, (m.BlockStored((1, 2), 9, (5, 6, 7, 8), 2), m.BlockRemoved((4,)), m.AllBlocksCleared()), 1
    )
    assert batch.to_wire() == [
        3.5,
        [["BlockStored", [1, 2], 9, [5, 6, 7, 8], 2, None, "GPU"], ["BlockRemoved", [4], "GPU"], ["AllBlocksCleared"]],
        1,
    ]
    assert m.KVEventBatch(1.0, ()).to_wire() == [1.0, []]
    assert m.KVEventBatch.from_wire(batch.to_wire()) == batch
    with pytest.raises(ValueError, match="unknown KV event"):
        m.KVEventBatch.from_wire([0.0, [["BlockMoved", [1]]]])
    with pytest.raises(ValueError, match="has 2 field"):
        m.KVEventBatch.from_wire([0.0, [["BlockRemoved", [1]]]])


def test_m15_n14_reset_prefix_cache() -> None:
    e = m.Engine([R("a", list(range(1, 10)), 3), R("b", list(range(20, 30)), 3, arrival_step=5)], 32, 4, 8)
    e.step()
    assert e.reset_prefix_cache() is False and e.cache.size == 2
    while e.running:
        e.step()
    cached = sorted(e._page_hash)
    free_before = list(e.pool.free)
    assert e.reset_prefix_cache() is True
    assert e.cache.size == 0 and list(e.pool.free) == free_before + cached and not e._page_hash
    e.check_invariants()
    assert e.step().kv_events == (m.AllBlocksCleared(),)


def test_m15_n15_precise_index_follows_events() -> None:
    s = state("precise", 3)
    s.observe(stored(0, tenant(1, 0)))
    s.observe(stored(2, tenant(1, 0)[:8]))
    hashes = req("q", tenant(1, 0)).block_hashes
    assert s.resident_prefix(hashes) == [2, 0, 2]
    s.observe(m.KVEventBatch(1, (m.BlockRemoved((hashes[0],)),), 0))
    assert s.resident_prefix(hashes) == [0, 0, 2]  # block 1 without block 0 is no prefix
    s.observe(m.KVEventBatch(2, (m.AllBlocksCleared(),), 2))
    assert s.resident_prefix(hashes) == [0, 0, 0] and s.index == {hashes[1]: 1}
    with pytest.raises(ValueError, match="replica"):
        s.observe(m.KVEventBatch(3, (), 5))


def test_m15_n16_precise_score_is_llm_d_weighted_sum() -> None:
    s = state("precise", 3)
    s.observe(stored(0, tenant(1, 0)[:4]))  # replica 0: 1 block, replica 1: 2 blocks, replica 2: none
    s.observe(stored(1, tenant(1, 0)[:8]))
    views = [view(0, waiting=0, kv=0.1), view(1, waiting=4, kv=0.9), view(2, waiting=2, kv=0.0)]
    d = m.choose(req("q", tenant(1, 5)), s, views)
    totals = [3 * 0 + 2 * 1.0 + 2 * 0.9, 3 * 1 + 2 * 0.0 + 2 * 0.1, 3 * 0 + 2 * 0.5 + 2 * 1.0]
    assert d.replica == totals.index(max(totals)) == 0
    assert "score 3.80 vs 3.20" in d.reason
    tie = m.choose(req("t", tenant(9, 5)), state("precise", 3), [view(k) for k in range(3)])
    assert (tie.replica, tie.rule) == (0, "no_prefix")


def test_m15_n17_precise_names_the_rule_and_never_loses_prefix_silently() -> None:
    s = state("precise", 2)
    s.observe(stored(1, tenant(1, 0)))
    quiet = m.choose(req("a", tenant(1, 1)), s, [view(0), view(1)])
    assert (quiet.replica, quiet.rule, quiet.matched) == (1, "longest_prefix", 8)
    busy = m.choose(req("b", tenant(1, 2)), s, [view(0, kv=0.0), view(1, waiting=3, kv=0.8)])
    assert (busy.replica, busy.rule) == (0, "load:queue+kv_usage") and "outweigh the prefix" in busy.reason
    equal_queues = m.choose(req("c", tenant(1, 3)), s, [view(0, kv=0.0), view(1, kv=1.0)])
    assert (equal_queues.replica, equal_queues.rule) == (1, "longest_prefix")  # 3 for the prefix beats 2 for KV
    heavy = state("precise", 2, kv_weight=4.0)
    heavy.observe(stored(1, tenant(1, 0)))
    kv_only = m.choose(req("c", tenant(1, 3)), heavy, [view(0, kv=0.0), view(1, kv=0.9)])
    assert (kv_only.replica, kv_only.rule) == (0, "load:kv_usage")
    none = m.choose(req("d", tenant(7, 3)), s, [view(0), view(1)])
    assert none.rule == "no_prefix"


def test_m15_n18_oracle_sees_what_replicas_will_hold() -> None:
    reqs = [R("a", tenant(1, 0), 3), R("b", tenant(1, 1), 3), R("c", tenant(2, 2), 3)]
    f = fleet(reqs, replicas=2, routing_policy="oracle")
    first = f.step().routed
    assert [(d.replica, d.rule) for d in first] == [(0, "no_prefix"), (0, "longest_prefix"), (1, "no_prefix")]
    p = fleet([R("a", tenant(1, 0), 3), R("b", tenant(1, 1), 3)], replicas=2, routing_policy="precise")
    assert [d.replica for d in p.step().routed] == [0, 1]  # precise cannot see a's blocks before they are published
    with pytest.raises(ValueError, match="oracle_blocks"):
        m.choose(req("x", tenant(1, 0)), state("oracle", 2), [view(0), view(1)])


def test_m15_n19_the_router_hears_every_step() -> None:
    reqs = [R(f"r{i}", tenant(i % 2, i), 3, arrival_step=i) for i in range(6)]
    f = fleet(reqs, replicas=2, routing_policy="precise")
    while f.step().step < 3:
        s = f.router.state
        live = {r.request_id for e in f.replicas for r in e.running + e.due}
        assert set(s.placed) == live and sum(s.outstanding) == len(live)
        for i, e in enumerate(f.replicas):
            assert s.resident[i] == set(e._page_hash.values())
    run(f)
    f.placement["r0"] = 1
    with pytest.raises(AssertionError, match="not where the router placed it"):
        f.check_invariants()


def test_m15_n20_the_fleet_hashes_once_and_engines_keep_the_keys() -> None:
    f = fleet([R("a", tenant(1, 0), 2), R("b", tenant(1, 1), 2)], replicas=2, routing_policy="round_robin")
    f.step()
    a, b = (next(r for e in f.replicas for r in e.requests if r.request_id == x) for x in "ab")
    assert all(ka is kb for ka, kb in zip(a.prompt_keys, b.prompt_keys))
    assert a.block_hashes == m.block_hashes(a.tokens, 4, m.hash_root())
    given = R("g", tenant(1, 2), 2)
    given.prompt_keys = list(a.prompt_keys[:2]) + m.prefix_keys(tenant(1, 2), 4)[2:]
    given.block_hashes = [1]  # one hash for two blocks: recomputed
    m.Engine([given], 16, 4, 16)
    assert given.prompt_keys[0] is a.prompt_keys[0] and given.block_hashes == m.block_hashes(
        given.tokens, 4, m.hash_root()
    )
    other = R("o", tenant(1, 3), 2)
    other.prompt_keys = m.prefix_keys(other.tokens, 2)  # another page size: recomputed
    m.Engine([other], 16, 4, 16)
    assert len(other.prompt_keys) == 2


def test_m15_n21_bad_values_are_refused() -> None:
    for kw, match in (
        ({"policy": "random"}, "unknown routing policy"),
        ({"replicas": 0}, "replicas"),
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"balance_rel_threshold": -0.5}, "balance_rel_threshold"),
        ({"max_tree_size": -1}, "max_tree_size"),
        ({"kv_weight": -1.0}, "kv_weight"),
        ({"load_guard": "none"}, "load_guard"),
    ):
        with pytest.raises(ValueError, match=match):
            m.RouterConfig(**kw)
    with pytest.raises(ValueError, match="duplicate request id"):
        fleet([R("a", [1, 2], 1), R("a", [3, 4], 1)])
    with pytest.raises(ValueError, match="executors"):
        fleet([], executors=[m.LocalExecutor({}, {})])
    with pytest.raises(ValueError, match="replicas must be > 0"):
        fleet([], replicas=0)


def test_m15_n22_fleet_record_json_explain_summary_and_run() -> None:
    f = fleet(
        [R("a", tenant(1, 0), 2), R("b", tenant(1, 1), 1, arrival_step=3)], replicas=2, routing_policy="cache_aware"
    )
    records = run(f)
    doc = records[0].to_json()
    assert list(doc) == ["step", "routed", "replicas"] and doc["routed"][0]["rule"] == "smallest_tree"
    assert [list(r) for r in doc["replicas"]] == [["replica", "record", "kv_events"]] * 2
    assert doc["replicas"][0]["record"] == records[0].replicas[0].to_json()
    assert doc["replicas"][0]["kv_events"][0]["type"] == "BlockStored"
    assert records[0].explain[0] == records[0].routed[0].reason
    assert any(s.startswith("replica 0: a arrived") for s in records[0].explain)
    assert [(e["request_id"], e["replica"], e["state"]) for e in f.summary()] == [
        ("a", 0, "FINISHED"),
        ("b", 0, "FINISHED"),
    ]
    assert not f.running and len(records) == 4  # b arrives at step 3 and finishes in it


def test_m15_n23_fleet_keys_need_m15(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    workload = {
        "engine": ENGINE,
        "fleet": {"replicas": 2, "routing_policy": "oracle"},
        "requests": [{"request_id": "a", "prompt_len": 5, "max_new_tokens": 2}],
    }
    spec = tmp_path / "w.json"
    spec.write_text(json.dumps(workload))
    assert main(["run", "--mech", "m14", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "fleet.replicas 2" in err[0] and 'fleet.routing_policy "oracle"' in err[0] and "m15" in err[0]
    )
    flags = ["--request", "a:5:2", "--replicas", "2", "--cache-threshold", "0.5"]
    assert main(["run", "--mech", "m14", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replicas 2" in err[0] and "--cache-threshold 0.5" in err[0]
    assert main(["run", *flags, "--json"]) == 0  # the default rung, m16, carries m15's routing: a fleet
    assert len(json.loads(capsys.readouterr().out.splitlines()[0])["replicas"]) == 2
    with pytest.raises(WorkloadError, match="has no routing"):
        build_engine(load_rung("m12"), parse_workload(workload))
    assert main(["run", "--mech", "m15", "--spec", str(spec), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["routed"][0]["policy"] == "oracle" and len(lines[0]["replicas"]) == 2
    assert lines[-1]["summary"][0]["replica"] == 0
    assert main(["demo", "--mech", "m15", "--json"]) == 0
    demo = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert demo[0]["routed"][0]["policy"] == "precise" and "replica" in demo[-1]["summary"][0]
    assert isinstance(build_fleet(m, parse_workload({"requests": []})), m.Fleet)


def place(s: m.RouterState, rid: str, replica: int) -> None:
    """Commit a request of its own (no shared prefix) to ``replica``: one more outstanding there."""
    s.commit(req(rid, tenant(50, len(s.placed))), m.Decision(rid, replica, s.config.policy, "no_prefix", 0, ""))


@pytest.mark.parametrize("policy", ["precise", "oracle"])
def test_m15_n24_load_guard_filters_overloaded_replicas(policy: str) -> None:
    def setup(rel: float = 1.5, **kw: Any) -> m.RouterState:
        s = state(policy, 3, balance_abs_threshold=2, balance_rel_threshold=rel, **kw)
        s.observe(stored(0, tenant(1, 0)))  # replica 0 holds 2 blocks of tenant 1, replica 1 one block
        s.observe(stored(1, tenant(1, 0)[:4]))
        for k in range(4):
            place(s, f"x{k}", 0)
        place(s, "y", 1)
        place(s, "z", 2)  # outstanding 4 / 1 / 1
        return s

    oracle = (2, 1, 0) if policy == "oracle" else None
    q = req("q", tenant(1, 9), oracle=oracle)
    views = [view(0, waiting=3, step=0), view(1, waiting=1, step=0), view(2, waiting=0, step=0)]
    s = setup()
    assert m._overloaded(s) == [True, False, False]  # 4 - 1 > 2 and 4 > 1.5 x 1
    d = m.choose(q, s, views)
    # replica 0 is left out; among the candidates replica 1 holds the longer prefix, normalized to 1
    # over the candidates: 3 x 1 + 2 x 0 (queue 1 vs 0) + 2 = 5 against replica 2's 0 + 2 + 2 = 4
    assert (d.replica, d.rule, d.matched) == (1, "load:imbalanced", 4)
    assert "replica 0 is overloaded (4 outstanding requests against the fewest, 1" in d.reason
    assert "score 5.00" in d.reason
    off = m.choose(q, setup(load_guard=False), views)
    assert (off.replica, off.rule, off.matched) == (0, "longest_prefix", 8)
    s.finish("x0")  # 3 - 1 = 2 is not more than 2 apart: no longer overloaded
    assert m._overloaded(s) == [False, False, False]
    assert (m.choose(q, s, views).replica, m.choose(q, s, views).rule) == (0, "longest_prefix")
    relaxed = setup(rel=4.0)
    assert m._overloaded(relaxed) == [False, False, False]  # 4 is not more than 4 x 1
    assert m.choose(q, relaxed, views).replica == 0
    empty = state(policy, 2, balance_abs_threshold=0, balance_rel_threshold=1.5)
    place(empty, "a", 0)  # 1 against 0: 1 - 0 > 0 and 1 > 0, so replica 1 (idle) must take it
    empty.observe(stored(0, tenant(1, 0)))
    e = m.choose(req("e", tenant(1, 8), oracle=(2, 0) if policy == "oracle" else None), empty, [view(0), view(1)])
    assert (e.replica, e.rule, e.matched) == (1, "load:imbalanced", 0)
