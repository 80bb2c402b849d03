"""The fleet simulator's replica (``mechserve.bench.fleet_engine.FastEngine``) decides as m15's ``Engine``.

On random workloads with eviction pressure, preemption, shared prompts, output caching and prefix
cache resets between steps, both engines get the same requests and must produce the same plans,
records (every JSON field, the KV events and the explanations), summaries and errors, and the fast
one must pass m15's ``check_invariants`` after every step.  A fleet of fast replicas must produce the
fleet records of a fleet of m15 engines.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mechserve.bench.fleet_engine import FastEngine
from mechserve.conformance.strategies import build, workloads
from mechserve.spec import m15_routing as m15
from mechserve.workload import build_fleet, parse_workload

FAST = SimpleNamespace(**{**vars(m15), "Engine": FastEngine})  # m15 with the simulator's replica, for build()
CI = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def trace(engine: m15.Engine, resets: set[int]) -> tuple[list[Any], Any, str | None]:
    out: list[Any] = []
    try:
        while engine.waiting or engine.due or engine.running or engine._rejected or engine._aborted:
            if engine.step_counter in resets:
                out.append(("reset", engine.reset_prefix_cache()))
            plan = engine.schedule()
            rec = engine.commit(engine.executor.execute(plan))
            engine.check_invariants()
            out.append((plan, rec.to_json(), rec.kv_events, rec.explain))
            assert rec.step < 400
    except Exception as exc:
        return out, None, type(exc).__name__
    return out, engine.summary(), None


@CI
@given(
    w=workloads(prompts="shared", pool="tight", output_caching="any", max_requests=8, max_prompt=14, page_size=(1, 3)),
    resets=st.sets(st.integers(0, 12), max_size=3),
)
def test_fast_engine_decides_as_the_rung(w: dict[str, Any], resets: set[int]) -> None:
    slow, fast = build(m15, w), build(FAST, w)  # type: ignore[arg-type]
    assert isinstance(fast, FastEngine)
    assert trace(fast, resets) == trace(slow, resets)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    w=workloads(prompts="shared", pool="tight", output_caching="any", max_requests=8, page_size=(1, 3)),
    replicas=st.integers(1, 3),
    policy=st.sampled_from(m15.POLICIES),
)
def test_a_fleet_of_fast_replicas_is_the_fleet(w: dict[str, Any], replicas: int, policy: str) -> None:
    def run(factory: Any) -> Any:
        wl = parse_workload({**w, "fleet": {"replicas": replicas, "routing_policy": policy}})
        fleet = build_fleet(m15, wl)
        fleet.replicas = [factory([], **wl.engine) for _ in range(replicas)]
        try:
            return [r.to_json() for r in fleet.run()], fleet.summary()
        except m15.OutOfPages as exc:
            return type(exc).__name__

    assert run(FastEngine) == run(m15.Engine)


def _seeded(seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Longer prompts over a few long shared stems, in a pool a third of their size: evictions all the way."""
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 40) for _ in range(rng.randint(4, 30))] for _ in range(4)]
    requests = [
        {
            "request_id": f"r{i}",
            "tokens": rng.choice(stems) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 12))],
            "max_new_tokens": rng.randint(1, 10),
            "arrival_step": rng.randint(0, 10),
        }
        for i in range(rng.randint(5, 40))
    ]
    engine = {
        "max_step_tokens": rng.randint(4, 40),
        "page_size": rng.randint(1, 4),
        "num_pages": rng.randint(14, 48),
        "output_caching": rng.random() < 0.5,
        "max_running": rng.choice([2, 5, 64]),
    }
    return requests, engine


def test_fast_engine_on_seeded_workloads_with_constant_eviction() -> None:
    evicted = 0
    for seed in range(40):
        requests, engine = _seeded(seed)
        w = {"engine": engine, "requests": requests}
        slow, fast = build(m15, w), build(FAST, w)  # type: ignore[arg-type]
        mine = trace(fast, {7})
        assert mine == trace(slow, {7}), f"seed {seed}"
        evicted += sum(len(step[1]["evicted"]) for step in mine[0] if step[0] != "reset")
    assert evicted > 1000  # the walk was exercised, not skipped
