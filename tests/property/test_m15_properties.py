"""m15's fleet over random workloads, every policy, 1-4 replicas.

Every request is served by exactly one replica (the one its decision named, until the run ends);
pages are conserved on every replica after every step (free + private + cache-owned = num_pages,
and m15's invariants); with one replica the records are m14's fed at arrival; a policy's decision
depends only on (request, state, views), so the router's log replays to the same decisions and
``choose`` leaves the state as it found it; ``precise`` never picks a replica holding a shorter
resident prefix unless its rule names a load scorer.
"""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechserve.conformance.strategies import build, prompt_tokens, workloads
from mechserve.spec import m14_forced_runs as m14
from mechserve.spec import m15_routing as m15
from mechserve.workload import build_fleet, parse_workload

CI = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLEETS = workloads(
    prompts="shared", pool="tight", output_caching="any", max_requests=8, max_arrival=4, page_size=(1, 3)
)


def fleet_of(w: dict[str, Any], replicas: int, policy: str, log: bool = False) -> m15.Fleet:
    fleet = build_fleet(m15, parse_workload({**w, "fleet": {"replicas": replicas, "routing_policy": policy}}))
    fleet.router.log = [] if log else None
    return fleet


def checked_run(f: m15.Fleet) -> list[m15.FleetRecord]:
    records = []

    def on_step(rec: m15.FleetRecord) -> None:
        records.append(rec)
        assert rec.step < 500, "the fleet did not stop"
        f.check_invariants()
        for e in f.replicas:
            owners = e.pool.owner
            private = sum(isinstance(o, str) for o in owners)
            assert owners.count(None) + private + owners.count(m15.CACHE) == e.pool.num_pages
            assert len(e.pool.free) == owners.count(None)

    # a request larger than the pool on its own (m05's Irreducible) ends the run: the steps before still hold
    with contextlib.suppress(m15.OutOfPages):
        f.run(on_step=on_step)
    return records


@CI
@given(w=FLEETS, replicas=st.integers(1, 4), policy=st.sampled_from(m15.POLICIES))
def test_every_request_is_served_by_exactly_one_replica(w: dict[str, Any], replicas: int, policy: str) -> None:
    f = fleet_of(w, replicas, policy)
    records = checked_run(f)
    decided = [d for rec in records for d in rec.routed]
    assert len({d.request_id for d in decided}) == len(decided), "a request was routed twice"
    holders: dict[str, list[int]] = {}
    for i, e in enumerate(f.replicas):
        for r in e.requests:
            holders.setdefault(r.request_id, []).append(i)
    assert holders == {d.request_id: [d.replica] for d in decided}
    for rec in records:
        for i, r in enumerate(rec.replicas):
            ran = {*r.scheduled, *r.admitted, *r.finished, *(x for x, _ in r.rejected)}
            assert all(f.placement[x] == i for x in ran)


@CI
@given(
    w=workloads(prompts="mixed", pool="tight", output_caching="any", admission=True),
    policy=st.sampled_from(m15.POLICIES),
)
def test_one_replica_records_are_m14s_fed_at_arrival(w: dict[str, Any], policy: str) -> None:
    engine = build(m14, {**w, "requests": []})
    requests = sorted(
        (
            (
                spec.get("arrival_step") or 0,
                i,
                m14.Request(
                    str(spec["request_id"]),
                    prompt_tokens(w, i),
                    int(spec["max_new_tokens"]),
                    arrival_step=spec.get("arrival_step") or 0,
                    eos_after=spec.get("eos_after"),
                    stop_token_ids=tuple(spec.get("stop_token_ids") or ()),
                ),
            )
            for i, spec in enumerate(w["requests"])
        ),
        key=lambda t: t[:2],
    )
    mine: list[Any] = []
    try:
        step = 0
        while requests or engine.waiting or engine.due or engine.running or engine._rejected or engine._aborted:
            while requests and requests[0][0] <= step:
                engine.add_request(requests.pop(0)[2])
            mine.append(engine.step().to_json())
            step += 1
        mine_error = None
    except Exception as exc:
        mine_error = type(exc).__name__
    f = fleet_of(w, 1, policy)
    theirs: list[Any] = []
    try:
        f.run(on_step=lambda rec: theirs.append(rec.replicas[0].to_json()))
        error = None
    except Exception as exc:
        error = type(exc).__name__
    assert (theirs, error) == (mine, mine_error)


@CI
@given(w=FLEETS, replicas=st.integers(2, 4), policy=st.sampled_from(m15.POLICIES))
def test_decisions_are_deterministic_given_the_state(w: dict[str, Any], replicas: int, policy: str) -> None:
    f = fleet_of(w, replicas, policy, log=True)
    records = checked_run(f)
    log = json.loads(json.dumps(f.router.log))
    assert m15.replay(f.config, log) == [d for rec in records for d in rec.routed][: len(m15.replay(f.config, log))]
    router = m15.Router(f.config)
    for entry in log:
        if "route" in entry:
            request = m15.RouteRequest.from_json(entry["route"])
            views = [m15.ReplicaView.from_json(v) for v in entry["views"]]
            before = json.dumps(router.state.to_json())
            d = m15.choose(request, router.state, views)
            assert json.dumps(router.state.to_json()) == before, "choose changed the state"
            assert m15.choose(request, copy.deepcopy(router.state), views) == d
            assert d == m15.Decision.from_json(entry["decision"])
            router.state.commit(request, d)
        elif "events" in entry:
            router.observe(m15.KVEventBatch.from_wire(entry["events"]))
        else:
            router.finish(entry["finished"])


@CI
@given(w=FLEETS, replicas=st.integers(2, 4))
def test_precise_takes_a_shorter_prefix_only_by_a_named_load_rule(w: dict[str, Any], replicas: int) -> None:
    f = fleet_of(w, replicas, "precise", log=True)
    checked_run(f)
    router = m15.Router(f.config)
    assert f.router.log is not None
    for entry in f.router.log:
        if "route" in entry:
            request = m15.RouteRequest.from_json(entry["route"])
            held = router.state.resident_prefix(request.block_hashes)
            d = router.route(request, [m15.ReplicaView.from_json(v) for v in entry["views"]])
            if held[d.replica] < max(held):
                assert d.rule.startswith("load:") and d.rule[5:], d
            else:
                assert d.rule == ("longest_prefix" if max(held) else "no_prefix"), d
            assert d.matched == held[d.replica] * f.config.page_size
        elif "events" in entry:
            router.observe(m15.KVEventBatch.from_wire(entry["events"]))
        else:
            router.finish(entry["finished"])


@CI
@given(
    holdings=st.lists(st.integers(0, 4), min_size=2, max_size=5),
    waiting=st.lists(st.integers(0, 9), min_size=5, max_size=5),
    usage=st.lists(st.floats(0, 1), min_size=5, max_size=5),
    weights=st.tuples(st.floats(0, 5), st.floats(0, 5), st.floats(0, 5)),
    outstanding=st.lists(st.integers(0, 6), min_size=5, max_size=5),
    balance=st.tuples(st.integers(0, 3), st.floats(0, 3)),
    guard=st.booleans(),
)
def test_precise_rules_on_random_states(
    holdings: list[int],
    waiting: list[int],
    usage: list[float],
    weights: Any,
    outstanding: list[int],
    balance: tuple[int, float],
    guard: bool,
) -> None:
    n = len(holdings)
    config = m15.RouterConfig(
        "precise",
        n,
        1,
        balance_abs_threshold=balance[0],
        balance_rel_threshold=balance[1],
        prefix_weight=weights[0],
        queue_weight=weights[1],
        kv_weight=weights[2],
        load_guard=guard,
    )
    state = m15.RouterState(config)
    for r in range(n):  # outstanding requests of their own (one-token prompts: no block), placed on replica r
        for k in range(outstanding[r]):
            rid = f"o{r}.{k}"
            state.commit(m15.RouteRequest(rid, -1, 1, ()), m15.Decision(rid, r, "precise", "no_prefix", 0, ""))
    tokens = [7, 8, 9, 10, 11]
    hashes = m15.block_hashes(tokens, 1, m15.hash_root())
    for r, k in enumerate(holdings):
        if k:
            state.observe(m15.KVEventBatch(0, (m15.BlockStored(tuple(hashes[:k]), None, tuple(tokens[:k]), 1),), r))
    views = [m15.ReplicaView(i, -1, 0, waiting[i], usage[i]) for i in range(n)]
    request = m15.RouteRequest("q", 0, 5, tuple(hashes))
    d = m15.choose(request, state, views)
    assert d == m15.choose(request, copy.deepcopy(state), views)
    held = state.resident_prefix(hashes)
    assert held == holdings
    loads, lo = outstanding[:n], min(outstanding[:n])
    over = [guard and x - lo > balance[0] and x > lo * balance[1] for x in loads]
    assert not over[d.replica]  # the guard leaves overloaded replicas out, and never all of them
    if held[d.replica] < max(held):
        if all(over[i] for i in range(n) if held[i] == max(held)):
            assert d.rule == "load:imbalanced"
        else:
            assert d.rule.startswith("load:") and set(d.rule[5:].split("+")) <= {"queue", "kv_usage"}
    else:
        assert d.rule in ("longest_prefix", "no_prefix")
