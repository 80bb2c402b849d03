"""``mechserve bench fleet``: routing policies side by side on a simulated fleet (m15, scripted replicas, no model).

::

    mechserve bench fleet [--replicas 16,64] [--requests 10000] [--workloads tenants,multiturn,rag,uniform]
                          [--policies round_robin,least_loaded,cache_aware,precise,oracle] [--rate R]
                          [--calibrate results.json] [--out DIR] [--seed N]

For every replica count, workload (``fleet_workloads``) and policy it runs m15's ``Fleet`` of
scripted replicas (``fleet_sim``) on the same seeded request stream and reports, side by side:
prefill tokens computed (and their ratio to round robin's), the prefix hit rate, the load imbalance
(sum over steps of the most running requests on one replica over the sum of the mean), queueing
(requests waiting per step, steps from arrival to admission) and TTFT under a stated cost model.

The cost model: a replica's step that computes ``t`` tokens takes ``a + b * t`` seconds (an idle
step none), each replica on its own clock; a request's TTFT is the time its replica spent from the
step it arrived at to the step that sampled its first token.  ``--calibrate FILE`` fits a and b by
least squares to the per-step times and tokens of the mechserve runs in a ``mechserve bench run``
``results.json``; without it the defaults come from docs/benchmarks.md's idle figures (a 512-token
prefill in 745 ms and a batch-1 decode step of ~36 ms: a = 0.036 s, b = 0.00138 s/token).  The
counts (tokens, hits, imbalance, queueing) are deterministic for a seed; only ``wall_seconds``
depends on the machine.  ``--out DIR`` writes ``fleet.json`` and ``fleet.png``.  The issue's
targets are checked at the end of the run (``targets``).  Top-level imports: standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mechserve.bench.fleet_workloads import WORKLOADS, Sizes
from mechserve.cli.parser import Bounded, names

POLICY_NAMES = ("round_robin", "least_loaded", "cache_aware", "precise", "oracle")
DEFAULT_A, DEFAULT_B = 0.036, (0.745 - 0.036) / 512
# Requests per step per replica, per workload: about three quarters of round robin's capacity at the defaults.
DEFAULT_RATE = {"tenants": 1.0, "multiturn": 1.0, "rag": 0.5, "uniform": 1.0}
TARGET_WORKLOADS = ("tenants", "multiturn")
TARGET_REPLICAS = (16, 64)
MAX_REPLICAS = 256


def _counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(not 1 <= v <= MAX_REPLICAS for v in values):
        raise argparse.ArgumentTypeError(f"replica counts must lie in 1..{MAX_REPLICAS}, got {text!r}")
    return list(dict.fromkeys(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--replicas", type=_counts, default=[16, 64], help="replica counts, comma-separated (default 16,64)")
    add("--requests", type=Bounded(int, ge=1, le=1_000_000), default=10_000, help="requests per run (default 10000)")
    add(
        "--workloads",
        type=names("workload", WORKLOADS),
        default=list(WORKLOADS),
        help=f"from {','.join(WORKLOADS)} (default all)",
    )
    add(
        "--policies",
        type=names("policy", POLICY_NAMES),
        default=list(POLICY_NAMES),
        help="routing policies (default all)",
    )
    add(
        "--rate",
        type=Bounded(float, ge=1e-6, le=1e6),
        default=None,
        help="requests (multiturn: turns) arriving per step per replica (default per workload: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_RATE.items())
        + ")",
    )
    add("--seed", type=int, default=0, help="workload seed (default 0)")
    add(
        "--zipf",
        type=Bounded(float, ge=0.0, le=10.0),
        default=1.0,
        help="popularity exponent of tenants and documents (default 1.0; 0: all equally popular)",
    )
    add(
        "--max-step-tokens",
        type=Bounded(int, ge=1, le=1_000_000),
        default=512,
        help="each replica's token budget (default 512)",
    )
    add("--page-size", type=Bounded(int, ge=1, le=4096), default=16, help="tokens per page (default 16)")
    add("--num-pages", type=Bounded(int, ge=1, le=1_000_000), default=2048, help="pages per replica (default 2048)")
    add(
        "--max-running",
        type=Bounded(int, ge=1, le=1_000_000),
        default=64,
        help="running requests per replica (default 64)",
    )
    add(
        "--cache-threshold",
        type=Bounded(float, ge=0.0, le=1.0),
        default=0.3,
        help="cache_aware's match threshold (default 0.3)",
    )
    add(
        "--balance-abs-threshold",
        type=Bounded(int, ge=0, le=1_000_000),
        default=64,
        help="cache_aware, and precise's load guard (default 64)",
    )
    add(
        "--balance-rel-threshold",
        type=Bounded(float, ge=0.0, le=1e6),
        default=1.5,
        help="cache_aware, and precise's load guard (default 1.5)",
    )
    add(
        "--no-load-guard",
        action="store_true",
        help="precise and oracle without the load guard (llm-d's scorers alone; m15 N24)",
    )
    add("--calibrate", type=Path, default=None, help="fit the cost model to a `mechserve bench run` results.json")
    add("--out", type=Path, default=None, help="directory for fleet.json and fleet.png")
    add("--no-plots", action="store_true", help="write fleet.json only")


def calibrate(path: Path) -> tuple[float, float, str]:
    """``(a, b, source)``: the least-squares fit of step seconds = a + b * tokens to every mechserve
    run of a ``bench run`` results document that recorded per-step times and tokens.

    Raises ``ValueError`` naming the file when it cannot be read or holds no such run.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--calibrate {path}: cannot read it: {exc}") from None
    xs: list[float] = []
    ys: list[float] = []
    workloads = doc.get("workloads") if isinstance(doc, dict) else None
    for entry in (workloads or {}).values():
        for run in (entry or {}).get("runs") or []:
            stats = run.get("engine_stats") or {}
            tokens, seconds = stats.get("tokens_per_step_series"), stats.get("step_time_series_s")
            if run.get("engine") == "mechserve" and tokens and seconds and len(tokens) == len(seconds):
                pairs = [(t, s) for t, s in zip(tokens, seconds) if t > 0]
                xs += [float(t) for t, _ in pairs]
                ys += [float(s) for _, s in pairs]
    if len(set(xs)) < 2:
        raise ValueError(
            f"--calibrate {path}: no mechserve run with per-step tokens and times at two or more sizes "
            "(run `mechserve bench run` and give its results.json)"
        )
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if a < 0 or b <= 0:
        raise ValueError(
            f"--calibrate {path}: the fit a={a:.4g} s, b={b:.4g} s/token is not a cost (too few or noisy steps)"
        )
    return a, b, f"fit to {len(xs)} steps of {path}"


def check_targets(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's simulation targets, for each target workload and replica count present: met, missed,
    or not measured (a policy missing from the run), each with the figures it compared."""
    out = []
    by = {(r["workload"], r["replicas"], r["policy"]): r for r in runs}
    for workload in TARGET_WORKLOADS:
        for n in TARGET_REPLICAS:
            if not any(k[0] == workload and k[1] == n for k in by):
                continue

            def get(policy: str, field: str) -> Any:
                run = by.get((workload, n, policy))  # noqa: B023
                return None if run is None else run[field]

            rr, ca, pr, orc = (
                get(p, "prefill_tokens_computed") for p in ("round_robin", "cache_aware", "precise", "oracle")
            )
            checks: list[tuple[str, Any, str]] = [
                ("cache_aware prefill <= 0.5 x round_robin's", None if None in (ca, rr) else ca / rr, "<= 0.5"),
                ("precise prefill <= cache_aware's", None if None in (pr, ca) else pr / ca, "<= 1.0"),
                ("precise prefill within 5% of oracle's", None if None in (pr, orc) else pr / orc, "<= 1.05"),
            ]
            for policy in POLICY_NAMES[:-1]:
                checks.append((f"{policy} imbalance <= 1.5", get(policy, "imbalance"), "<= 1.5"))
            for name, value, bound in checks:
                limit = float(bound.split()[-1])
                verdict = "not measured" if value is None else "met" if value <= limit else "missed"
                out.append({"workload": workload, "replicas": n, "target": name, "value": value, "verdict": verdict})
    return out


def _row(r: dict[str, Any], rr: int | None) -> str:
    ratio = f"{r['prefill_tokens_computed'] / rr:.2f}" if rr else "-"
    return (
        f"  {r['policy']:<12} prefill {r['prefill_tokens_computed']:>11,} ({ratio:>4} of rr)  hit {r['prefix_hit_rate']:.3f}  "
        f"imbalance {r['imbalance'] or 0:.2f}  waiting {r['waiting_mean']:.1f}  admit wait {r['admission_wait_mean_steps'] or 0:.1f}"
        f"/{r['admission_wait_p99_steps'] or 0:.0f} steps  TTFT p50 {r['ttft_p50_s'] or 0:.2f} p99 {r['ttft_p99_s'] or 0:.2f} s"
        f"  ({r['wall_seconds']:.0f} s)"
    )


def run(args: argparse.Namespace) -> int:
    from mechserve.bench import fleet_workloads as fw
    from mechserve.bench.fleet_sim import CostModel, simulate
    from mechserve.cli.errors import CliError

    if args.calibrate is not None:
        try:
            a, b, source = calibrate(args.calibrate)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    else:
        a, b, source = (
            DEFAULT_A,
            DEFAULT_B,
            "docs/benchmarks.md defaults (idle: 512-token prefill 745 ms, decode step ~36 ms)",
        )
    cost = CostModel(a, b, source)
    engine = {
        "max_step_tokens": args.max_step_tokens,
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "max_running": args.max_running,
        "output_caching": True,
    }
    options = {
        "cache_threshold": args.cache_threshold,
        "balance_abs_threshold": args.balance_abs_threshold,
        "balance_rel_threshold": args.balance_rel_threshold,
        "load_guard": not args.no_load_guard,
    }
    print(f"cost model: step = {a * 1000:.1f} ms + {b * 1000:.3f} ms/token ({source})", file=sys.stderr)
    report: dict[str, Any] = {
        "load_average_at_start": _loadavg(),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if not callable(v) and k not in ("handler", "parser")
        },
        "engine": engine,
        "router": options,
        "cost_model": {"a_s": a, "b_s_per_token": b, "source": source},
        "runs": [],
    }
    for n in args.replicas:
        for name in args.workloads:
            rate = (args.rate or DEFAULT_RATE[name]) * n
            sizes = replace(Sizes(), requests=args.requests, rate=rate, zipf=args.zipf)
            print(f"{name}, {n} replicas, {args.requests} requests, {rate:g} per step:", flush=True)
            rr = None
            for policy in args.policies:
                try:
                    result = simulate(
                        fw.make(name, sizes, args.seed),
                        replicas=n,
                        policy=policy,
                        engine=engine,
                        cost=cost,
                        fleet_options=options,
                    )
                except ValueError as exc:  # a pool too small for the workload's requests, bad sizes
                    raise CliError(f"bench fleet: {exc}") from None
                doc = result.as_json()
                doc["rate_per_step"] = rate
                report["runs"].append(doc)
                if policy == "round_robin":
                    rr = doc["prefill_tokens_computed"]
                print(_row(doc, rr), flush=True)
    report["targets"] = check_targets(report["runs"])
    report["load_average_at_end"] = _loadavg()
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"target {t['workload']} x{t['replicas']}: {t['target']}: {value} -> {t['verdict']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fleet.json").write_text(json.dumps(report, indent=1))
        print(f"results: {args.out / 'fleet.json'}", file=sys.stderr)
        if not args.no_plots:
            print(f"plot: {plot(report, args.out / 'fleet.png')}", file=sys.stderr)
    return 0


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def plot(report: dict[str, Any], path: Path) -> Path:
    """Per workload and replica count: prefill tokens computed, TTFT p50/p99 and imbalance per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in report["runs"]:
        groups.setdefault((r["workload"], r["replicas"]), []).append(r)
    fig, axes = plt.subplots(len(groups), 3, figsize=(14, 3 * len(groups)), squeeze=False)
    for row, ((workload, n), runs) in zip(axes, groups.items()):
        names = [r["policy"] for r in runs]
        row[0].bar(names, [r["prefill_tokens_computed"] for r in runs], color="tab:blue")
        row[0].set_title(f"{workload} x{n}: prefill tokens computed", fontsize=9)
        p50 = [r["ttft_p50_s"] or 0.0 for r in runs]
        p99 = [r["ttft_p99_s"] or 0.0 for r in runs]
        row[1].bar(names, p50, color="tab:orange")
        row[1].errorbar(names, p50, yerr=[[0.0] * len(p50), [b - a for a, b in zip(p50, p99)]], fmt="none", ecolor="k")
        row[1].set_title(f"{workload} x{n}: TTFT s (p50, whisker p99)", fontsize=9)
        row[2].bar(names, [r["imbalance"] or 0.0 for r in runs], color="tab:green")
        row[2].axhline(1.5, color="k", lw=0.8, ls="--")
        row[2].set_title(f"{workload} x{n}: imbalance (max/mean running)", fontsize=9)
        for ax in row:
            ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:  # python -m mechserve.bench.fleet
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    start = time.perf_counter()
    code = run(parser.parse_args(argv))
    print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
