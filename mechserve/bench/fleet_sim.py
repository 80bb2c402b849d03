"""One fleet simulation: m15's ``Fleet`` over a workload stream, measured step by step.

``simulate(workload, replicas=..., policy=..., engine=..., cost=...)`` feeds the workload's arrivals
to an m15 fleet of scripted replicas (no model), steps it until every request has left, and returns
the figures ``mechserve bench fleet`` reports (``Result``).  Nothing in the fleet changes for the
measurement: the simulator reads the records and the engines, it never writes them.  Standard
library only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mechserve.bench.fleet_engine import FastEngine
from mechserve.bench.fleet_workloads import Workload
from mechserve.spec import m15_routing as m15


@dataclass(frozen=True)
class CostModel:
    """Seconds a replica's step takes: ``a + b * tokens`` for a step that computes ``tokens`` > 0, 0 for
    an idle step.  ``source`` says where a and b came from."""

    a: float
    b: float
    source: str

    def step_seconds(self, tokens: int) -> float:
        return self.a + self.b * tokens if tokens else 0.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Live:
    replica: int
    arrival: int
    clock0: float  # the replica's clock before the arrival step
    prompt_len: int
    admitted: int | None = None
    first_token: float | None = None


@dataclass
class Result:
    """The figures of one simulation (see ``as_json`` for names and units)."""

    workload: str
    policy: str
    replicas: int
    requests: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    prefill_computed: int = 0
    computed: int = 0
    reused: int = 0
    preemptions: int = 0
    rejected: int = 0
    max_running_sum: int = 0
    running_sum: int = 0
    waiting_sum: int = 0
    rules: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    admission_wait: list[int] = field(default_factory=list)
    per_replica_requests: list[int] = field(default_factory=list)
    ideal_prefill: int = 0
    budget_tokens: int = 0
    wall_seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        """JSON-ready figures: token counts, ``prefix_hit_rate`` (reused / prompt tokens),
        ``imbalance`` (sum over steps of the most running requests on one replica, over the sum of
        the mean), ``waiting_mean`` (requests waiting fleet-wide, mean per step), admission wait in
        steps, TTFT in seconds under the cost model, the decisions' rules, requests per replica.

        ``ideal_prefill_tokens`` is the bound no routing can beat on this stream: each request
        computes only what no earlier request computed (one shared cache of unlimited size, every
        block of every earlier prompt and published output in it, m08's cap of one computed prompt
        token kept); ``utilization`` is the tokens computed over the replicas' budgets while the run lasted."""
        return {
            "workload": self.workload,
            "policy": self.policy,
            "replicas": self.replicas,
            "requests": self.requests,
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_computed": self.prefill_computed,
            "computed_tokens": self.computed,
            "reused_tokens": self.reused,
            "prefix_hit_rate": self.reused / self.prompt_tokens if self.prompt_tokens else None,
            "ideal_prefill_tokens": self.ideal_prefill,
            "utilization": self.computed / self.budget_tokens if self.budget_tokens else None,
            "preemptions": self.preemptions,
            "rejected": self.rejected,
            "imbalance": self.max_running_sum * self.replicas / self.running_sum if self.running_sum else None,
            "waiting_mean": self.waiting_sum / self.steps if self.steps else 0.0,
            "admission_wait_mean_steps": statistics.fmean(self.admission_wait) if self.admission_wait else None,
            "admission_wait_p99_steps": _pct([float(x) for x in self.admission_wait], 0.99),
            "ttft_mean_s": statistics.fmean(self.ttft) if self.ttft else None,
            "ttft_p50_s": _pct(self.ttft, 0.5),
            "ttft_p99_s": _pct(self.ttft, 0.99),
            "rules": dict(sorted(self.rules.items())),
            "requests_per_replica_max": max(self.per_replica_requests, default=0),
            "requests_per_replica_min": min(self.per_replica_requests, default=0),
            "wall_seconds": self.wall_seconds,
        }


def simulate(
    workload: Workload,
    *,
    replicas: int,
    policy: str,
    engine: Mapping[str, Any],
    cost: CostModel,
    fleet_options: Mapping[str, Any] | None = None,
) -> Result:
    """Run ``workload`` through an m15 fleet of ``replicas`` scripted replicas routed by ``policy``.

    ``engine`` are every replica's ``Engine`` arguments, ``fleet_options`` the router thresholds.
    Engine errors propagate (``OutOfPages``: a pool too small for a request).
    """
    import time

    start = time.perf_counter()
    fleet = m15.Fleet(
        [], replicas=replicas, routing_policy=policy, replica_factory=FastEngine, **(fleet_options or {}), **engine
    )
    res = Result(workload.name, policy, replicas, per_replica_requests=[0] * replicas)
    live: dict[str, _Live] = {}
    requests: dict[str, m15.Request] = {}
    clock = [0.0] * replicas
    decoding: set[str] = set()  # requests past their prompt: their next executed tokens are a decode window
    seen: set[int] = set()  # the ideal's one unlimited cache: every block hash computed so far, fleet-wide
    ps = int(engine["page_size"])
    step = 0
    while not workload.exhausted or fleet.running or any(e.waiting or e.due for e in fleet.replicas) or fleet._arrivals:
        for a in workload.due(step):
            r = m15.Request(a.request_id, a.tokens, a.max_new_tokens, arrival_step=step)
            requests[a.request_id] = r
            fleet.add_request(r)
        record = fleet.step()
        for d in record.routed:
            r = requests[d.request_id]
            live[d.request_id] = _Live(d.replica, step, clock[d.replica], r.prompt_len)
            res.rules[d.rule] = res.rules.get(d.rule, 0) + 1
            res.per_replica_requests[d.replica] += 1
            res.requests += 1
            res.prompt_tokens += r.prompt_len
            hit = 0
            for h in r.block_hashes[: (r.prompt_len - 1) // ps]:
                if h not in seen:
                    break
                hit += 1
            res.ideal_prefill += r.prompt_len - hit * ps
            seen.update(r.block_hashes)
        running = []
        for i, rec in enumerate(record.replicas):
            tokens = sum(rec.executed.values())
            clock[i] += cost.step_seconds(tokens)
            res.computed += tokens
            res.prefill_computed += tokens - sum(n for rid, n in rec.executed.items() if rid in decoding)
            res.reused += sum(rec.reused.values())
            res.preemptions += len(rec.preempted)
            res.rejected += len(rec.rejected)
            for rid in rec.admitted:
                live[rid].admitted = step
                res.admission_wait.append(step - live[rid].arrival)
            for rid in rec.sampled:
                entry = live[rid]
                if entry.first_token is None:
                    entry.first_token = clock[i] - entry.clock0
                    res.ttft.append(entry.first_token)
            decoding.update(rec.tokens)
            decoding.difference_update(rec.preempted, rec.finished)
            e = fleet.replicas[i]
            running.append(len(e.running))
            res.waiting_sum += len(e.waiting) + len(e.due)
            for rid in (*rec.finished, *(x for x, _ in rec.rejected), *rec.aborted):
                live.pop(rid, None)
                r = requests.pop(rid)
                seen.update(_published_hashes(r, ps, e.hash_root))
                workload.finished(rid, step, r.output_ids)
        res.budget_tokens += replicas * int(engine["max_step_tokens"])
        res.max_running_sum += max(running)
        res.running_sum += sum(running)
        fleet.drop_finished()
        step += 1
    res.steps = step
    res.wall_seconds = time.perf_counter() - start
    return res


def _published_hashes(r: m15.Request, page_size: int, root: int) -> list[int]:
    """The hashes of ``r``'s computed complete blocks, prompt and output (what output caching publishes)."""
    hashes = list(r.block_hashes)
    sequence = r.tokens + r.output_ids
    for i in range(len(hashes), r.computed // page_size):
        hashes.append(m15.block_hash(hashes[-1] if hashes else root, sequence[i * page_size : (i + 1) * page_size]))
    return hashes
