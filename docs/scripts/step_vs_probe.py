"""The engine's batch-1 decode step beside the roofline probe's forward, in one process, side by side.

    PYTHONPATH=$PWD python docs/scripts/step_vs_probe.py MODE [--threads 2,2pin,1] [--rounds 4] [--steps 48]

Issue 28's batch-1 table put ``bench run``'s own decode steps 2-4 ms above the probe of the same
forward (``run.ROOFLINE_STEPS``), measured minutes apart and in another process.  This script takes
both in one process, alternated, so that the machine's load falls on both alike.  Per round and
thread count it runs three blocks of ``--steps`` forwards each:

* ``probe``: the probe's forward (``roofline.decode_probe``'s inputs: batch 1, context 512, KV filled
  with noise), back to back;
* ``engine``: one request of the latency workload (512-token prompt) through ``EngineCore`` exactly as
  ``bench run``'s ``MechserveRunner`` builds it, each pure decode step timed whole (schedule, forward,
  sample, commit: ``step``) and its ``model.forward`` alone (``forward``);
* ``gap``: the probe's forward again, with the engine's median time outside the forward spent in a
  Python loop between two forwards (is a forward slower after a pause of the OpenMP team?).

Each block reports the median milliseconds, then, per step, every thread of this process (the main
thread and the OpenMP workers, from ``/proc/self/task/*/schedstat``: CPU time, time spent runnable but
waiting for a CPU, and context switches), and the machine's CPU that other processes used during the
block (``/proc/stat``'s busy time minus this process's, in cores) and its steal.  The summary gives
the ratios engine step / probe and engine forward / probe per thread count (medians over the rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from mechserve.api.config import EngineConfig
from mechserve.api.params import SamplingParams
from mechserve.bench.runners import MODES, MechserveRunner, _warm_up
from mechserve.bench.workloads import make_workload
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model.loader import load_model

HZ = os.sysconf("SC_CLK_TCK")


def threads_now() -> dict[int, tuple[str, int, int, int, int, int]]:
    """tid -> (name, run ns, wait ns, timeslices, voluntary switches, involuntary switches)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            run, wait, slices = map(int, (task / "schedstat").read_text().split())
            status = (task / "status").read_text().splitlines()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        vol = next(int(s.split()[1]) for s in status if s.startswith("voluntary_ctxt_switches"))
        inv = next(int(s.split()[1]) for s in status if s.startswith("nonvoluntary_ctxt_switches"))
        out[int(task.name)] = (name, run, wait, slices, vol, inv)
    return out


def machine_now() -> tuple[float, float]:
    """(busy seconds of all CPUs, steal seconds) since boot, from /proc/stat's first line."""
    f = list(map(int, Path("/proc/stat").read_text().splitlines()[0].split()[1:]))
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return (user + nice + system + irq + softirq) / HZ, steal / HZ


class Block:
    """Counters around a block of ``n`` steps."""

    def __enter__(self) -> Block:
        self.t0, self.m0, self.wall0 = threads_now(), machine_now(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.t1, self.m1, self.wall1 = threads_now(), machine_now(), time.perf_counter()

    def report(self, n: int) -> dict[str, Any]:
        main = threading.get_native_id()
        per: dict[str, Any] = {}
        ours = 0.0
        for tid, after in self.t1.items():
            before = self.t0.get(tid, (after[0], 0, 0, 0, 0, 0))
            d = [a - b for a, b in zip(after[1:], before[1:])]
            ours += d[0] / 1e9
            if d[0] == 0 and d[1] == 0:
                continue  # a thread that did not run in this block
            key = "main" if tid == main else f"{after[0]}:{tid}"
            per[key] = {
                "cpu_ms": d[0] / 1e6 / n,
                "wait_ms": d[1] / 1e6 / n,
                "vol": d[3] / n,
                "invol": d[4] / n,
            }
        wall = self.wall1 - self.wall0
        busy = self.m1[0] - self.m0[0]
        return {
            "threads": per,
            "others_cores": max(busy - ours, 0.0) / wall,
            "steal_cores": (self.m1[1] - self.m0[1]) / wall,
        }


def pin(on: bool) -> None:
    """With ``on``, the main thread on CPU 0 and every other thread of this process (the OpenMP workers) spread
    over the other CPUs; else every thread on every CPU this process may use."""
    cpus = sorted(os.sched_getaffinity(0) | {c for t in Path("/proc/self/task").iterdir() for c in _cpus(int(t.name))})
    main = threading.get_native_id()
    others = [int(t.name) for t in Path("/proc/self/task").iterdir() if int(t.name) != main]
    for i, tid in enumerate([main, *others]):
        with contextlib.suppress(OSError):  # a thread that has ended
            os.sched_setaffinity(tid, {cpus[min(i, len(cpus) - 1)]} if on else set(cpus))


def _cpus(tid: int) -> set[int]:
    try:
        return os.sched_getaffinity(tid)
    except OSError:
        return set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument(
        "--threads",
        default="2,2pin,1",
        help="thread counts, alternated in each round; Npin: N threads with the main thread pinned to CPU 0 and "
        "the OpenMP workers to the others",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=48, help="forwards per block")
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    counts = args.threads.split(",")
    dtype, quantization = MODES[args.mode]
    loaded = load_model("smollm2", dtype=dtype, tokenizer=False, quantization=quantization)
    model = loaded.model
    ctx, page = args.context, 16

    # the probe's forward: decode_probe's inputs at batch 1
    per = -(-(ctx + 1) // page)
    cache = model.new_cache(per + 1, page)
    cache.k.normal_()
    cache.v.normal_()
    table = list(range(1, 1 + per))
    g = model.arch.num_heads // model.arch.num_kv_heads
    attn = build_attention_batch(
        [Span(0, ctx, 1, table)], [table[ctx // page] * page + ctx % page], page, g, model.distinct_sliding_windows
    )
    probe_args = (
        torch.randint(100, model.arch.vocab_size, (1,)),
        torch.full((1,), ctx, dtype=torch.int64),
        cache,
        attn,
        torch.arange(1),
    )

    # the engine as bench run's MechserveRunner builds it for the latency workload
    workload = make_workload("latency", model.arch.vocab_size, num=1, prompt_len=ctx, output_len=args.steps + 1)
    runner = MechserveRunner(loaded, args.mode, EngineConfig())
    core = runner._core(workload, "default")
    _warm_up(core, SamplingParams)
    forward = core.model.forward
    fwd_s: list[float] = []

    def timed_forward(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return forward(*a, **k)
        finally:
            fwd_s.append(time.perf_counter() - t)

    def probe_block(gap_s: float) -> tuple[list[float], Block]:
        times = []
        model.forward(*probe_args)
        with Block() as b:
            for _ in range(args.steps):
                t = time.perf_counter()
                model.forward(*probe_args)
                times.append(time.perf_counter() - t)
                end = time.perf_counter() + gap_s
                while time.perf_counter() < end:  # Python work, as the engine does between forwards
                    pass
        return times, b

    def engine_block() -> tuple[list[float], list[float], Block]:
        """One request's pure decode steps (one token computed): each step's seconds and its forward's."""
        params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
        core.add_request(list(workload.requests[0].prompt_ids), params)
        while not core.step().record.tokens:  # the prefill, chunked or not
            pass
        steps: list[float] = []
        fwds: list[float] = []
        core.model.forward = timed_forward  # type: ignore[method-assign]
        try:
            with Block() as b:
                while core.has_unfinished():
                    fwd_s.clear()
                    t = time.perf_counter()
                    out = core.step()
                    took = time.perf_counter() - t
                    if sum(out.record.executed.values()) == 1 and len(fwd_s) == 1:
                        steps.append(took)
                        fwds.append(fwd_s[0])
        finally:
            del core.model.forward
        return steps, fwds, b

    def fmt(r: dict[str, Any]) -> str:
        th = "; ".join(
            f"{k} cpu {v['cpu_ms']:.2f} wait {v['wait_ms']:.2f} vol {v['vol']:.1f} invol {v['invol']:.1f}"
            for k, v in r["threads"].items()
        )
        return f"others {r['others_cores']:.2f} cores, steal {r['steal_cores']:.2f} | per step: {th}"

    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    summary: dict[str, dict[str, list[float]]] = {t: {"step": [], "forward": [], "gap": []} for t in counts}
    print(f"mode {args.mode}, batch 1, context {ctx}; load average {os.getloadavg()}")
    for rnd in range(args.rounds):
        for t in counts:
            torch.set_num_threads(int(t.removesuffix("pin")))
            model.forward(*probe_args)  # the team exists
            pin(t.endswith("pin"))
            probe, pb = probe_block(0.0)
            steps, fwds, eb = engine_block()
            outside = max(ms(steps) - ms(fwds), 0.0) / 1e3
            gap, gb = probe_block(outside)
            summary[t]["step"].append(ms(steps) / ms(probe))
            summary[t]["forward"].append(ms(fwds) / ms(probe))
            summary[t]["gap"].append(ms(gap) / ms(probe))
            print(f"round {rnd} threads {t}:")
            print(f"  probe   {ms(probe):6.2f} ms        {fmt(pb.report(len(probe)))}")
            print(f"  engine  {ms(steps):6.2f} ms step, {ms(fwds):6.2f} forward  {fmt(eb.report(len(steps)))}")
            print(f"  gap {outside * 1e3:.2f} {ms(gap):6.2f} ms        {fmt(gb.report(len(gap)))}")
    print(f"load average {os.getloadavg()}")
    for t, r in summary.items():
        print(
            f"threads {t}: engine step / probe {statistics.median(r['step']):.2f}x "
            f"(rounds {', '.join(f'{x:.2f}' for x in r['step'])}); engine forward / probe "
            f"{statistics.median(r['forward']):.2f}x; probe after a gap / probe {statistics.median(r['gap']):.2f}x"
        )


if __name__ == "__main__":
    main()
