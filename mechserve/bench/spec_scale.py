"""``mechserve bench spec``: the spec engine at scale (m12, scripted executor, no model).

Runs m12 on ``--case`` (default: the repository's ``tests/data/scale-10k.json``, a copy of the shared
10,000-request case) and on variants of other sizes generated the same way: the case's engine
section, ``arrivals_per_step`` requests arriving per step (40), prompt lengths uniform 16-64 and
``max_new_tokens`` uniform 8-32, seeded.  For each size it reports the wall time, steps, the
step-time profile (mean over the first and the last tenth of the steps: flat means step cost does
not grow with the number of requests ever submitted) and a digest of the trace (every field but
``explain``), compared with the trace of ``--reference`` (default m11, the rung below, which must
decide identically on these workloads; ``none`` skips it).  ``--out DIR`` writes
``spec-scale.json`` and ``spec-step-times.png``.  The time Python's cyclic garbage collector takes
is reported apart (``--no-gc`` turns it off): its full passes scan every live object, so they grow
with all requests and records kept, and show as the periodic spikes of the step-time plot.
Top-level imports: standard library only.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CASE = Path(__file__).resolve().parents[2] / "tests" / "data" / "scale-10k.json"
SIZES = {"1k": 1_000, "10k": 10_000, "100k": 100_000}
ARRIVALS_PER_STEP = 40


def _sizes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SIZES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown size {', '.join(bad) or repr(text)}; choose from {', '.join(SIZES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--sizes", type=_sizes, default=["1k", "10k"], help="comma-separated from 1k,10k,100k (default 1k,10k)")
    add("--case", type=Path, default=None, help="the 10k case file (default: tests/data/scale-10k.json)")
    add("--reference", default="m11", help="rung whose trace must be identical (default m11; 'none' to skip)")
    add("--seed", type=int, default=0, help="seed of the generated variants (default 0)")
    add("--out", type=Path, default=None, help="directory for spec-scale.json and spec-step-times.png")
    add(
        "--no-gc",
        action="store_true",
        help="disable Python's cyclic garbage collector during each run (its full passes scan every live object)",
    )


def generate_case(num: int, engine: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """``num`` requests the way the 10k case was made: 40 arrive per step, prompts 16-64, outputs 8-32."""
    rng = random.Random(seed)
    requests = [
        {
            "request_id": f"r{i}",
            "prompt_len": rng.randint(16, 64),
            "max_new_tokens": rng.randint(8, 32),
            "arrival_step": i // ARRIVALS_PER_STEP,
        }
        for i in range(num)
    ]
    return {"engine": dict(engine), "requests": requests}


def trace_digest(records: list[Any]) -> str:
    """sha256 of the trace's records as JSON, without ``explain`` (prose, not a trace field) and without
    m12's door fields when empty (``rejected``, ``aborted``: rungs below m12 have no such fields)."""
    h = hashlib.sha256()
    for rec in records:
        doc = rec.to_json()
        doc.pop("explain", None)
        for door in ("rejected", "aborted"):
            if not doc.get(door, True):
                del doc[door]
        h.update(json.dumps(doc, sort_keys=True).encode())
    return h.hexdigest()


def run_rung(rung_name: str, case: dict[str, Any], collect: bool = True) -> dict[str, Any]:
    """Run ``rung_name`` on ``case``; wall seconds, per-step seconds, the trace digest, and the time the
    cyclic garbage collector took (``gc_seconds``, ``gc_full_passes``: generation-2 passes, whose cost
    grows with every object alive, requests and records included).  ``collect=False`` disables it."""
    from mechserve.workload import build_engine, load_rung, load_workload

    engine = build_engine(load_rung(rung_name), load_workload(json.dumps(case)))
    times: list[float] = []
    last = [time.perf_counter()]
    gc_time = [0.0, 0.0, 0]  # seconds, start of the running pass, full passes

    def on_step(_record: Any) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]
            gc_time[2] += info["generation"] == 2

    was_enabled = gc.isenabled()
    gc.collect()
    if not collect:
        gc.disable()
    gc.callbacks.append(on_gc)
    try:
        start = time.perf_counter()
        last[0] = start
        records = engine.run(on_step=on_step)
        wall = time.perf_counter() - start
    finally:
        gc.callbacks.remove(on_gc)
        if was_enabled:
            gc.enable()
    return {
        "rung": rung_name,
        "seconds": wall,
        "steps": len(records),
        "step_times": times,
        "digest": trace_digest(records),
        "gc_seconds": gc_time[0],
        "gc_full_passes": int(gc_time[2]),
    }


def _profile(times: list[float]) -> dict[str, float]:
    tenth = max(len(times) // 10, 1)
    return {
        "mean_step_ms": 1000 * sum(times) / max(len(times), 1),
        "first_tenth_mean_ms": 1000 * sum(times[:tenth]) / tenth,
        "last_tenth_mean_ms": 1000 * sum(times[-tenth:]) / tenth,
        "max_step_ms": 1000 * max(times, default=0.0),
    }


def run(args: argparse.Namespace) -> int:
    from mechserve.cli.errors import CliError

    path = args.case or DEFAULT_CASE
    try:
        base = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read the scale case {path}: {exc}") from None
    reference = None if args.reference == "none" else args.reference
    report: dict[str, Any] = {"case": str(path), "reference": reference, "gc": not args.no_gc, "sizes": {}}
    series: dict[str, list[float]] = {}
    ok = True
    for size in args.sizes:
        n = SIZES[size]
        case = base if n == len(base["requests"]) else generate_case(n, base["engine"], args.seed)
        try:
            top = run_rung("m12", case, collect=not args.no_gc)
            ref = run_rung(reference, case, collect=not args.no_gc) if reference and n <= 10_000 else None
        except ValueError as exc:  # an unknown reference rung, a bad case
            raise CliError(f"bench spec: {exc}") from None
        entry = {
            "requests": n,
            "seconds": top["seconds"],
            "steps": top["steps"],
            "digest": top["digest"],
            **_profile(top["step_times"]),
        }
        if ref is not None:
            entry.update(reference_seconds=ref["seconds"], identical_to_reference=ref["digest"] == top["digest"])
            ok &= entry["identical_to_reference"]
        report["sizes"][size] = entry
        series[f"{size} ({n} requests)"] = top["step_times"]
        same = (
            ""
            if ref is None
            else f", trace {'identical to' if entry['identical_to_reference'] else 'DIFFERS from'} {reference} ({ref['seconds']:.2f} s)"
        )
        print(
            f"m12 {size}: {top['seconds']:.2f} s ({top['gc_seconds']:.2f} s in the garbage collector, "
            f"{top['gc_full_passes']} full passes), {top['steps']} steps, step {entry['first_tenth_mean_ms']:.2f} ms "
            f"(first tenth) -> {entry['last_tenth_mean_ms']:.2f} ms (last tenth){same}",
            flush=True,
        )
    if args.out is not None:
        from mechserve.bench.plots import plot_step_times

        args.out.mkdir(parents=True, exist_ok=True)
        report["step_times_s"] = series
        (args.out / "spec-scale.json").write_text(json.dumps(report, indent=1))
        print(f"plot: {plot_step_times(series, args.out / 'spec-step-times.png')}", file=sys.stderr)
    if not ok:
        raise CliError(f"the m12 trace differs from {reference}'s")
    return 0
