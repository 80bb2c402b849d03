"""Issue 26's real two-replica benchmark: ``serve -dp 2`` with precise routing beside round robin, and two
replicas beside one engine, on this machine (one command; the lead runs it on an idle machine).

(a) The multi-tenant workload (``bench serve --workload multi-tenant``: ``mechserve.bench.fleet_workloads``'s
    tenants as text) through ``mechserve serve -dp 2 --threads 2`` with ``--routing-policy precise`` and
    with ``round_robin``: prefill tokens computed (prompt tokens minus prefix-cache hits, summed over the
    replicas' ``engine`` series of ``/metrics``, read before and after) and TTFT p50, side by side.
    Targets: precise computes at most 0.6x round robin's prefill tokens, and its TTFT p50 is at least 1.5x
    better.
(b) The mixed workload (``mechserve.bench.workloads``' ``throughput``: 32 requests, prompts 64-512,
    outputs 32-256, all at once, EOS ignored) through ``serve -dp 2 --threads 2`` (one thread per replica)
    and through one engine with ``--threads 2``: output tokens/s (reported either way).

It prints a markdown table and writes JSON to ``bench-results/issue26/``.  Each server is a fresh process
on a free port, stopped (SIGINT) after its run.  ``--quick`` runs small sizes (a few minutes on 2 loaded
cores); the full run takes much longer.

``python docs/scripts/issue26_real.py [--quick] [--model smollm2] [--out bench-results/issue26]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SIZES = {
    # multi-tenant: requests, rate (req/s), tenants, system prompt words (N/2..N), message words, output tokens
    "full": {"requests": 200, "rate": 1.0, "tenants": 32, "system_len": 512, "input_len": 64, "output_len": 32},
    "quick": {"requests": 32, "rate": 4.0, "tenants": 4, "system_len": 192, "input_len": 24, "output_len": 8},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``python -m mechserve serve MODEL FLAGS`` on a free port, until ``stop``."""

    def __init__(self, model: str, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "mechserve", "serve", model, "--port", str(self.port), *flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.log = log.open("w")
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        self.flags = flags

    def wait_ready(self, timeout: float = 900.0) -> Server:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server {self.flags} exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server {self.flags} never answered; see {self.log.name}")
            time.sleep(0.5)

    def counters(self) -> dict[str, float]:
        """Prompt tokens and prefix-cache hits, summed over every ``engine`` series of ``/metrics``."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        wanted = {"vllm:prompt_tokens_total": "prompt_tokens", "vllm:prefix_cache_hits_total": "hits"}
        out = dict.fromkeys(wanted.values(), 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    out[wanted[sample.name]] += sample.value
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def multi_tenant(model: str, policy: str, size: dict[str, Any], out: Path) -> dict[str, Any]:
    """(a): one ``-dp 2`` server routed by ``policy``, the multi-tenant workload through ``bench serve``."""
    from mechserve.bench.serve_client import BenchConfig, benchmark

    flags = ["-dp", "2", "--threads", "2", "--routing-policy", policy]
    server = Server(model, flags, out / f"serve-dp2-{policy}.log").wait_ready()
    try:
        before = server.counters()
        config = BenchConfig(
            url=server.url,
            workload="multi-tenant",
            num_requests=size["requests"],
            rate=size["rate"],
            tenants=size["tenants"],
            system_len=size["system_len"],
            input_len=size["input_len"],
            output_len=size["output_len"],
            timeout=3600.0,
        )
        report = asyncio.run(benchmark(config))
        after = server.counters()
    finally:
        server.stop()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    hits = after["hits"] - before["hits"]
    return {
        "policy": policy,
        "flags": flags,
        "prompt_tokens": prompt,
        "prefix_cache_hits": hits,
        "prefill_computed": prompt - hits,
        "p50_ttft_ms": report["p50_ttft_ms"],
        "report": report,
    }


def mixed(model: str, flags: list[str], quick: bool, out: Path, name: str) -> dict[str, Any]:
    """(b): the mixed workload (all at once) through one server; output tokens/s as the client saw them."""
    import httpx

    from mechserve.bench.serve_client import BenchConfig, one_request, summarize
    from mechserve.bench.workloads import make_workload

    server = Server(model, flags, out / f"serve-{name}.log").wait_ready()
    try:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
            served = json.loads(r.read())["data"][0]["id"]
        vocab = 49152 if model == "smollm2" else 32000
        workload = make_workload("throughput", vocab, quick=quick)

        async def run() -> tuple[list[Any], float]:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(base_url=server.url, timeout=3600.0, limits=limits) as client:
                bodies = [
                    {
                        "model": served,
                        "prompt": list(r.prompt_ids),
                        "max_tokens": r.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    for r in workload.requests
                ]
                started = time.perf_counter()
                results = await asyncio.gather(*(one_request(client, "completions", b) for b in bodies))
                return list(results), time.perf_counter() - started

        results, duration = asyncio.run(run())
    finally:
        server.stop()
    report = summarize(results, duration, BenchConfig(url=server.url, num_requests=len(results)))
    return {"name": name, "flags": flags, "output_throughput": report["output_throughput"], "report": report}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the figures")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default=str(ROOT / "bench-results" / "issue26"))
    for name in SIZES["full"]:  # any size of (a) can be overridden: --requests 400 --rate 0.5 ...
        kind = float if name == "rate" else int
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"(a)'s {name}")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    size = dict(SIZES["quick" if args.quick else "full"])
    size.update({k: getattr(args, k) for k in size if getattr(args, k) is not None})
    load = os.getloadavg()

    runs = {policy: multi_tenant(args.model, policy, size, out) for policy in ("precise", "round_robin")}
    two = mixed(args.model, ["-dp", "2", "--threads", "2"], args.quick, out, "dp2-threads2")
    one = mixed(args.model, ["--threads", "2"], args.quick, out, "dp1-threads2")

    p, rr = runs["precise"], runs["round_robin"]
    prefill_ratio = ratio(p["prefill_computed"], rr["prefill_computed"])
    ttft_gain = ratio(rr["p50_ttft_ms"], p["p50_ttft_ms"])
    result = {
        "quick": args.quick,
        "model": args.model,
        "sizes": size,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg(),
        "multi_tenant": runs,
        "mixed": {"dp2_threads2": two, "dp1_threads2": one},
        "precise_over_round_robin_prefill": prefill_ratio,
        "round_robin_over_precise_ttft_p50": ttft_gain,
        "dp2_over_dp1_output_throughput": ratio(two["output_throughput"], one["output_throughput"]),
        "targets": {
            "prefill_at_most_0.6x": prefill_ratio is not None and prefill_ratio <= 0.6,
            "ttft_p50_at_least_1.5x_better": ttft_gain is not None and ttft_gain >= 1.5,
        },
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out / f"issue26-real{'-quick' if args.quick else ''}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))

    def f(x: float | None, digits: int = 1) -> str:
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    print(f"## Issue 26, two replicas ({args.model}{', quick sizes' if args.quick else ''}; load {load[0]:.2f})\n")
    print("| multi-tenant, serve -dp 2 --threads 2 | prompt tokens | cache hits | prefill computed | TTFT p50 ms |")
    print("|---|---:|---:|---:|---:|")
    for policy, r in runs.items():
        row = (policy, r["prompt_tokens"], r["prefix_cache_hits"], r["prefill_computed"], r["p50_ttft_ms"])
        print(f"| {row[0]} | {row[1]:.0f} | {row[2]:.0f} | {row[3]:.0f} | {f(row[4])} |")
    print(
        f"\nprecise / round robin prefill: {f(prefill_ratio, 2)}x (target <= 0.6x); round robin / precise TTFT "
        f"p50: {f(ttft_gain, 2)}x (target >= 1.5x)\n"
    )
    print("| mixed workload | output tok/s | completed |")
    print("|---|---:|---:|")
    for name, r in (("serve -dp 2 --threads 2", two), ("serve --threads 2", one)):
        print(f"| {name} | {f(r['output_throughput'])} | {r['report']['completed']} |")
    print(f"\n-dp 2 / one engine: {f(result['dp2_over_dp1_output_throughput'], 2)}x; JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
