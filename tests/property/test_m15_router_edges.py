"""The router's edges (m15's policies, state and approximate tree) that mutation testing found untested
(docs/mutation.md, `router`): each refusal's whole message and each setting's boundary, what a route
request hashes by default, the state's bookkeeping and JSON form, cache_aware's tree eviction step by
step, and which load scorers precise names when the load wins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from mechserve.spec import m15_routing as m

SYSTEM = list(range(101, 109))  # two blocks of 4 a tenant's requests share


def req(rid: str, tokens: Sequence[int], step: int = 0, oracle: tuple[int, ...] | None = None) -> m.RouteRequest:
    r = m.RouteRequest.from_tokens(rid, tokens, 4, step)
    return m.RouteRequest(rid, step, len(tokens), r.block_hashes, oracle)


def state(policy: str, replicas: int = 2, **kw: Any) -> m.RouterState:
    return m.RouterState(m.RouterConfig(policy, replicas, 4, **kw))


def views(n: int, step: int = -1, waiting: Sequence[int] = (), kv: Sequence[float] = ()) -> list[m.ReplicaView]:
    return [m.ReplicaView(i, step, 0, waiting[i] if waiting else 0, kv[i] if kv else 0.0) for i in range(n)]


def stored(replica: int, tokens: Sequence[int]) -> m.KVEventBatch:
    hashes = tuple(m.block_hashes(tokens, 4, m.hash_root()))
    return m.KVEventBatch(0, (m.BlockStored(hashes, None, tuple(tokens[: len(hashes) * 4]), 4),), replica)


def decide(rid: str, replica: int) -> m.Decision:
    return m.Decision(rid, replica, "round_robin", "rotation", 0, "")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"policy": "random"},
            "unknown routing policy 'random'; choose from round_robin, least_loaded, cache_aware, precise, oracle",
        ),
        ({"replicas": 0}, "replicas must be > 0"),
        ({"page_size": 0}, "page_size must be > 0"),
        ({"cache_threshold": -0.1}, "cache_threshold must lie in [0, 1], not -0.1"),
        ({"cache_threshold": 1.5}, "cache_threshold must lie in [0, 1], not 1.5"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold must be >= 0, not -1"),
        ({"balance_rel_threshold": -0.5}, "balance_rel_threshold must be >= 0, not -0.5"),
        ({"max_tree_size": -1}, "max_tree_size must be >= 0, not -1"),
        ({"prefix_weight": -1.0}, "prefix_weight must be >= 0, not -1.0"),
        ({"queue_weight": -1.0}, "queue_weight must be >= 0, not -1.0"),
        ({"kv_weight": -2.0}, "kv_weight must be >= 0, not -2.0"),
        ({"load_guard": 1}, "load_guard must be True or False, not 1"),
    ],
)
def test_a_router_setting_out_of_range_is_refused_with_its_whole_message(setting: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        m.RouterConfig(**setting)
    assert str(refused.value) == message


def test_each_router_settings_boundary_is_accepted_and_round_trips() -> None:
    edge = m.RouterConfig(
        "cache_aware",
        1,
        1,
        cache_threshold=0.0,
        balance_abs_threshold=0,
        balance_rel_threshold=0.0,
        max_tree_size=0,
        prefix_weight=0.0,
        queue_weight=0.0,
        kv_weight=0.0,
        load_guard=False,
    )
    assert edge.to_json() == {
        "policy": "cache_aware",
        "replicas": 1,
        "page_size": 1,
        "cache_threshold": 0.0,
        "balance_abs_threshold": 0,
        "balance_rel_threshold": 0.0,
        "max_tree_size": 0,
        "prefix_weight": 0.0,
        "queue_weight": 0.0,
        "kv_weight": 0.0,
        "hash_seed": "",
        "load_guard": False,
    }
    assert m.RouterConfig.from_json(edge.to_json()) == edge
    assert m.RouterConfig(cache_threshold=1.0).cache_threshold == 1.0


def test_a_route_request_hashes_its_complete_blocks_with_the_shared_seed() -> None:
    tokens = list(range(1, 11))  # 10 tokens: two complete blocks of 4
    plain = m.RouteRequest.from_tokens("a", tokens, 4)
    assert (plain.request_id, plain.step, plain.prompt_len, plain.oracle_blocks) == ("a", 0, 10, None)
    assert plain.block_hashes == tuple(m.block_hashes(tokens, 4, m.hash_root())) and len(plain.block_hashes) == 2
    seeded = m.RouteRequest.from_tokens("a", tokens, 4, step=3, hash_seed="s")
    assert seeded.step == 3
    assert seeded.block_hashes == tuple(m.block_hashes(tokens, 4, m.hash_root("s"))) != plain.block_hashes


def test_commit_refuses_a_decision_that_does_not_fit_and_changes_nothing() -> None:
    s = state("round_robin", 2)
    a = req("a", SYSTEM)
    for bad in (decide("b", 0), decide("a", 2), decide("a", -1)):
        with pytest.raises(ValueError) as refused:
            s.commit(a, bad)
        assert str(refused.value) == f"decision {bad.request_id!r} -> {bad.replica} does not fit request 'a'"
    assert (s.placed, s.outstanding, s.recent, s.step, s.next_replica) == ({}, [0, 0], [0, 0], -1, 0)
    s.commit(a, decide("a", 1))
    with pytest.raises(ValueError) as again:
        s.commit(a, decide("a", 0))
    assert str(again.value) == "request 'a' is already placed on replica 1"


def test_the_requests_sent_in_a_step_are_counted_until_the_step_changes() -> None:
    s = state("round_robin", 3)
    s.commit(req("a", SYSTEM, step=2), decide("a", 2))
    assert (s.step, s.recent, s.outstanding, s.next_replica) == (2, [0, 0, 1], [0, 0, 1], 0)
    s.commit(req("b", SYSTEM, step=2), decide("b", 2))
    assert (s.recent, s.outstanding) == ([0, 0, 2], [0, 0, 2])
    s.commit(req("c", SYSTEM, step=3), decide("c", 0))
    assert (s.step, s.recent, s.outstanding, s.next_replica) == (3, [1, 0, 0], [1, 0, 2], 1)
    s.finish("unknown")  # ignored
    s.finish("b")
    s.finish("b")  # once only
    assert (s.outstanding, s.placed) == ([1, 0, 1], {"a": 2, "c": 0})


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware", "oracle"])
def test_only_precise_indexes_kv_events_and_every_policy_checks_the_rank(policy: str) -> None:
    s = state(policy, 2)
    s.observe(stored(1, SYSTEM))
    assert (s.index, s.resident) == ({}, [set(), set()])
    for rank in (None, 2, -1):
        with pytest.raises(ValueError) as refused:
            s.observe(m.KVEventBatch(0, (), rank))
        assert str(refused.value) == f"a KV event batch from replica {rank!r}: the fleet has 2"


def test_the_state_in_json_is_everything_choose_reads() -> None:
    s = state("cache_aware", 2)
    a = req("a", SYSTEM, step=4)
    s.commit(a, decide("a", 1))
    h0, h1 = a.block_hashes
    assert s.to_json() == {
        "config": s.config.to_json(),
        "next_replica": 0,
        "outstanding": [0, 1],
        "step": 4,
        "recent": [0, 1],
        "placed": {"a": 1},
        "tree": {
            "nodes": {str(h0): {"parent": None, "tenants": {1: 4}}, str(h1): {"parent": h0, "tenants": {1: 4}}},
            "size": [0, 8],
        },
        "index": {},
    }
    p = state("precise", 2)
    p.observe(stored(1, SYSTEM))
    p.observe(stored(0, SYSTEM[:4]))
    assert p.to_json()["tree"] is None
    assert p.to_json()["index"] == {str(h): mask for h, mask in sorted({h0: 3, h1: 2}.items())}


def test_the_tree_evicts_a_replicas_least_recently_sent_leaves_and_keeps_other_tenants() -> None:
    tree = m.ApproxTree(2, 1, 3)  # blocks of 1 token, 3 tokens per replica
    tree.insert([1, 2, 3], 0, 0)
    assert sorted(tree.nodes) == [1, 2, 3] and tree.size == [3, 0]  # at the limit, not over it
    tree.insert([1, 4], 1, 1)
    tree.insert([5], 0, 2)  # replica 0 at 4 tokens: its oldest leaf (3) goes, then it is within the limit
    assert sorted(tree.nodes) == [1, 2, 4, 5] and tree.size == [3, 2]
    assert tree.nodes[2].children == set() and tree.nodes[1].children == {2, 4}
    tree.insert([6, 7], 0, 3)  # 5 tokens: 2 goes (a leaf once 3 went), then replica 0's hold on 1, shared with 1
    assert tree.size == [3, 2]
    assert tree.to_json() == {
        "nodes": {
            "1": {"parent": None, "tenants": {1: 1}},
            "4": {"parent": 1, "tenants": {1: 1}},
            "5": {"parent": None, "tenants": {0: 2}},
            "6": {"parent": None, "tenants": {0: 3}},
            "7": {"parent": 6, "tenants": {0: 3}},
        },
        "size": [3, 2],
    }
    assert tree.nodes[1].children == {4} and tree.nodes[6].children == {7}
    assert [tree.match(h) for h in ([1, 4], [1, 2], [5], [6, 7], [9])] == [
        (2, (1,)),
        (1, (1,)),
        (1, (0,)),
        (2, (0,)),
        (0, ()),
    ]


def test_a_parent_is_evicted_only_once_no_child_of_the_replica_is_left() -> None:
    tree = m.ApproxTree(1, 1, 3)
    tree.insert([1, 2], 0, 0)
    tree.insert([1, 3], 0, 1)  # 1 now has two children of replica 0
    tree.insert([9, 10], 0, 2)  # 5 tokens: 2 goes, then 3 (1 is no leaf while 3 is there), and 1 stays
    assert tree.to_json() == {
        "nodes": {
            "1": {"parent": None, "tenants": {0: 1}},
            "9": {"parent": None, "tenants": {0: 2}},
            "10": {"parent": 9, "tenants": {0: 2}},
        },
        "size": [3],
    }
    assert tree.nodes[1].children == set()


def test_cache_aware_counts_the_match_of_the_smallest_tree_only_when_it_holds_it() -> None:
    s = state("cache_aware", 3)
    s.commit(req("x", SYSTEM), decide("x", 0))  # replica 0: the system prompt's 2 blocks, 8 tokens
    s.commit(req("y", list(range(201, 213))), decide("y", 1))  # 12 tokens on each of the others
    s.commit(req("z", list(range(301, 313))), decide("z", 2))
    q = req("q", SYSTEM + list(range(401, 425)))  # 8 of 32 tokens = 0.25: not above the threshold
    d = m.choose(q, s, views(3))
    assert (d.replica, d.rule, d.matched) == (0, "smallest_tree", 8)  # the smallest tree is the one that holds it
    s.commit(req("w", list(range(501, 513))), decide("w", 0))  # now replica 0's tree (20 tokens) is the largest
    d = m.choose(q, s, views(3))
    assert (d.replica, d.policy, d.rule, d.matched) == (1, "cache_aware", "smallest_tree", 0)
    at = state("cache_aware", 3, cache_threshold=0.25)  # 8 of 32 tokens is the threshold itself: not above it
    at.commit(req("x", SYSTEM), decide("x", 1))
    assert m.choose(q, at, views(3)).rule == "smallest_tree"


def test_precise_names_only_the_weighted_scorers_that_won() -> None:
    s = state("precise", 2, queue_weight=0.0, kv_weight=4.0)
    s.observe(stored(1, SYSTEM))
    # replica 0: 0 + 4 x 1.0 = 4; replica 1 (the prefix): 3 + 4 x 0.1 = 3.4.  Replica 0's queue is shorter
    # too, but the queue scorer weighs nothing, so it is not named.
    d = m.choose(req("q", [*SYSTEM, 9]), s, views(2, waiting=(0, 5), kv=(0.0, 0.9)))
    why = (
        "q goes to replica 0, which holds 0 of its prompt tokens, not to replica 1 (8): the load scorers outweigh "
        "the prefix (kv_usage: queue 0 vs 5, KV usage 0.00 vs 0.90; score 4.00 vs 3.40)."
    )
    assert d == m.Decision("q", 0, "precise", "load:kv_usage", 0, why)


@pytest.mark.parametrize(("policy", "holds"), [("precise", "holds"), ("oracle", "holds or will hold")])
def test_precise_and_the_oracle_decide_by_the_prefix_or_by_load_and_say_so(policy: str, holds: str) -> None:
    s = state(policy, 2)
    s.observe(stored(1, SYSTEM))  # precise: replica 1 holds both blocks of the prompt
    q = req("q", [*SYSTEM, 9], oracle=(0, 2))
    why = f"q goes to replica 1, which {holds} 8 of its 9 prompt tokens, as much as any (score 7.00: queue 0, KV usage 0.00)."
    assert m.choose(q, s, views(2)) == m.Decision("q", 1, policy, "longest_prefix", 8, why)
    fresh = req("f", list(range(11, 20)), oracle=(0, 0))  # no replica holds its first block
    why = (
        f"f goes to replica 0: no replica {holds} its first block, so queue (0) and KV usage (0.00) decide "
        "(score 4.00)."
    )
    assert m.choose(fresh, s, views(2, kv=(0.0, 0.5))) == m.Decision("f", 0, policy, "no_prefix", 0, why)


def test_precise_adds_what_it_sent_only_to_the_reports_from_before_it_sent() -> None:
    s = state("precise", 2)
    s.commit(req("a", list(range(1, 9)), step=5), decide("a", 0))  # sent to replica 0 at step 5
    mixed = [m.ReplicaView(0, 5, 0, 0, 0.0), m.ReplicaView(1, 4, 0, 1, 0.0)]  # 0 reported after, 1 before
    assert m.choose(req("q", list(range(11, 19)), step=5), s, mixed).replica == 0  # queues 0 and 1 + 0


def test_precise_adds_what_it_sent_since_a_replicas_report_and_not_before() -> None:
    s = state("precise", 2)
    s.commit(req("a", list(range(1, 9)), step=5), decide("a", 0))  # outstanding [1, 0], sent at step 5
    q = req("q", list(range(11, 19)), step=5)
    old = m.choose(q, s, views(2, step=4, waiting=(0, 1)))  # queues 0 + 1 and 1: equal, fewer outstanding wins
    fresh = m.choose(q, s, views(2, step=5, waiting=(0, 1)))  # the report already counts a: queues 0 and 1
    assert (old.replica, fresh.replica) == (1, 0)


def test_the_oracle_needs_one_count_per_replica() -> None:
    s = state("oracle", 2)
    with pytest.raises(ValueError) as refused:
        m.choose(req("x", SYSTEM, oracle=(1,)), s, views(2))
    assert str(refused.value) == "the oracle needs oracle_blocks for every replica with request 'x'"
    assert m.choose(req("x", SYSTEM, oracle=(0, 2)), s, views(2)).replica == 1


def test_a_log_entry_of_no_known_kind_is_refused_by_its_keys() -> None:
    with pytest.raises(ValueError) as refused:
        m.replay(m.RouterConfig("round_robin", 2, 4), [{"other": 1, "also": 2}])
    assert str(refused.value) == "a router log entry is route, events or finished, not ['also', 'other']"


@pytest.mark.parametrize(
    ("loads", "replica", "why"),
    [
        ([100, 200], 0, "range 100..200, more than 64 apart and 2.00x > 1.5x"),
        ([70, 0], 1, "range 0..70, more than 64 apart and 70.00x > 1.5x"),  # no load: the ratio is against 1
    ],
)
def test_cache_awares_load_rule_decides_and_says_why(loads: list[int], replica: int, why: str) -> None:
    s = state("cache_aware", 2)
    s.outstanding = list(loads)
    reason = f"a goes to replica {replica}, the least loaded: outstanding requests {why}, so the load rule wins."
    assert m.choose(req("a", SYSTEM), s, views(2)) == m.Decision("a", replica, "cache_aware", "imbalanced", 0, reason)


def test_cache_awares_load_rule_needs_more_than_the_relative_threshold() -> None:
    s = state("cache_aware", 2)
    s.outstanding = [195, 130]  # 65 apart (> 64), and 195 is exactly 1.5 x 130: not more
    assert m.choose(req("a", SYSTEM), s, views(2)).rule == "smallest_tree"


def test_the_rotation_and_least_loaded_decisions_whole() -> None:
    s = state("round_robin", 2)
    s.next_replica = 1
    rotation = "a goes to replica 1, next in rotation."
    assert m.choose(req("a", SYSTEM), s, views(2)) == m.Decision("a", 1, "round_robin", "rotation", 0, rotation)
    s = state("least_loaded", 2)
    s.outstanding = [2, 1]
    fewest = "a goes to replica 1, which has the fewest outstanding requests (1)."
    assert m.choose(req("a", SYSTEM), s, views(2)) == m.Decision("a", 1, "least_loaded", "least_loaded", 0, fewest)


def test_an_eviction_of_a_block_precise_never_indexed_changes_nothing() -> None:
    s = state("precise", 2)
    s.observe(stored(0, SYSTEM))
    before = dict(s.index)
    s.observe(m.KVEventBatch(1, (m.BlockRemoved((12345,)),), 1))  # replica 1 never said it held it
    s.observe(m.KVEventBatch(2, (m.BlockRemoved((54321,)),), 0))  # nor did replica 0
    assert s.index == before and s.resident[0] == set(before)


def test_a_router_keeps_no_log_unless_asked() -> None:
    config = m.RouterConfig("round_robin", 2, 4)
    quiet, logged = m.Router(config), m.Router(config, log=True)
    for router in (quiet, logged):
        router.route(req("a", SYSTEM), views(2))
        router.finish("a")
    assert quiet.log is None
    assert logged.log is not None and [next(iter(e)) for e in logged.log] == ["route", "finished"]


def test_choose_names_the_views_it_needs() -> None:
    s = state("round_robin", 3)
    for wrong in (views(2), [*views(2), m.ReplicaView(5, -1, 0, 0, 0.0)]):
        with pytest.raises(ValueError) as refused:
            m.choose(req("a", SYSTEM), s, wrong)
        assert str(refused.value) == "choose needs one view per replica in order 0..2"


def test_a_replica_that_cleared_its_cache_holds_nothing_until_it_stores_again() -> None:
    s = state("precise", 2)
    s.observe(stored(0, SYSTEM))
    s.observe(m.KVEventBatch(1, (m.AllBlocksCleared(),), 0))
    assert (s.resident[0], s.index) == (set(), {})
    s.observe(stored(0, SYSTEM[:4]))
    h0 = m.block_hashes(SYSTEM, 4, m.hash_root())[0]
    assert (s.resident[0], s.index) == ({h0}, {h0: 1})


def prefix_state(**kw: Any) -> m.RouterState:
    """precise over 3 replicas: replica 0 holds the prompt's first block, replicas 1 and 2 both blocks."""
    s = state("precise", 3, **kw)
    s.observe(stored(0, SYSTEM[:4]))
    s.observe(stored(1, SYSTEM))
    s.observe(stored(2, SYSTEM))
    return s


def test_when_the_load_wins_precise_names_the_best_longest_holder_it_passed_over() -> None:
    s = prefix_state(queue_weight=2.5, kv_weight=1.0)
    busy = views(3, waiting=(0, 4, 4), kv=(0.0, 1.0, 1.0))
    # replica 0: 0 + 2.5 x 1 + 1 x 1.0 = 3.5; replicas 1 and 2: 3 x 1 + 0 + 0 = 3
    why = (
        "q goes to replica 0, which holds 4 of its prompt tokens, not to replica 1 (8): the load scorers outweigh "
        "the prefix (queue and kv_usage: queue 0 vs 4, KV usage 0.00 vs 1.00; score 3.50 vs 3.00)."
    )
    q = req("q", [*SYSTEM, 9])
    assert m.choose(q, s, busy) == m.Decision("q", 0, "precise", "load:queue+kv_usage", 4, why)
    s.outstanding = [0, 0, 1]  # of the two equal longest holders, the one with fewer outstanding requests
    assert "not to replica 1 (8)" in m.choose(q, s, busy).reason
    s.outstanding = [0, 1, 0]
    assert "not to replica 2 (8)" in m.choose(q, s, busy).reason
    queue_only = prefix_state(queue_weight=4.0, kv_weight=1.0)  # 4 + 0.5 = 4.5 against 3 + 0.6 = 3.6
    d = m.choose(q, queue_only, views(3, waiting=(0, 4, 4), kv=(0.5, 0.4, 0.4)))
    assert (d.replica, d.rule) == (0, "load:queue")  # replica 0's KV usage is the higher: not named


def test_when_the_guard_leaves_every_longest_holder_out_precise_names_the_least_loaded() -> None:
    s = prefix_state(balance_abs_threshold=2, balance_rel_threshold=1.5)
    s.outstanding = [0, 10, 5]  # replicas 1 and 2 are both overloaded
    why = (
        "q goes to replica 0, which holds 4 of its prompt tokens, not to replica 2 (8): replica 2 is overloaded "
        "(5 outstanding requests against the fewest, 0: more than 2 apart and over 1.5x), so the load guard "
        "leaves it out (score 7.00)."
    )
    assert m.choose(req("q", [*SYSTEM, 9]), s, views(3)) == m.Decision("q", 0, "precise", "load:imbalanced", 4, why)
