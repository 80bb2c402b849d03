"""``mechserve bench run``: workloads x engines x modes side by side in one process, JSON results and plots.

::

    mechserve bench run [--workload throughput,latency,prefix,spec,serve,multiturn|all] [--engine mechserve,hf,...]
                        [--mode exact,fast] [--quick] [--out DIR] [--model M] [--seed N]

Modes: ``exact`` (float32 weights and KV, the mode checked token for token against transformers),
``fast`` (bfloat16 weights and KV), and ``q4_1`` / ``q8_0`` (the weight matrices in GGUF blocks,
multiplied as they are, bfloat16 activations and KV; q4_1 is the embedded model's own file).  Each
run in a mode other than exact reports how far its greedy output stays equal to the same engine's
exact run.  transformers has no quantized mode; llama.cpp runs F32, BF16, Q4_1 and Q8_0 GGUFs.
``--model FILE.gguf`` runs a GGUF file as it stores its weights, in mode exact (float32 activations and
KV) or fast (bfloat16), beside llama.cpp on the same file (transformers skipped).  Every engine runs
each workload of ``workloads`` (see there) after a warm-up; mechserve's runs each in a fresh process
(``fresh.run_fresh``: its peak RSS is that run's alone; ``--in-process`` runs them here, where every
mode's model is loaded at once); ``--engine`` names an optional engine that is not installed:
it is skipped with a line on stderr saying why.  The ``multiturn`` workload runs mechserve alone, in four
configurations stepped in turn (output caching on and off, each with and without prompt lookup;
``_multiturn``).  Besides the runs, the machine's roofline
(``roofline``) is measured in each mode and reported with prefill and decode MFU and the decode steps of
``ROOFLINE_STEPS`` beside their floor ``max(bytes / bandwidth, FLOPs / peak)``; each mechserve run of
the throughput, latency, prefix and spec workloads gets such a line for its typical decode batch
(``_run_roofline``: the step measured there and the run's own steps at that batch).

``DIR/results.json`` holds the machine, versions, git commit, arguments, every run (vLLM-named
metrics, peak RSS, MFU of the wanted work, engine-side figures from the m13 trace) and the
comparisons (mechserve / hf ratios, fast-vs-exact agreement); ``DIR/*.png`` the plots.  A one-line
summary per run goes to stdout.  The top level imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mechserve.bench.workloads import WORKLOADS
from mechserve.cli.parser import Bounded, names

ENGINE_NAMES = ("mechserve", "hf", "llama-cpp", "vllm")
MODE_NAMES = ("exact", "fast", "q4_1", "q8_0")
# (batch, context) of the decode steps each mode's roofline is measured at besides the runs' own: the
# latency workload's batch-1 step after its 512-token prompt, and the mixed workload's batch of 32
# (issue 28's targets); --quick: the quick workloads' sizes.
ROOFLINE_STEPS = ((1, 512), (32, 300))
ROOFLINE_STEPS_QUICK = ((1, 64), (8, 64))


def _engine_int(name: str) -> Any:
    """An engine size ``name`` (``mechserve.cli.engine_args.setting``: the range ``EngineConfig`` checks); the
    bench's ``--spec-len`` is a variant's guesses, at least 1."""
    from mechserve.api.config import setting_range
    from mechserve.cli.engine_args import setting

    return Bounded(int, ge=1, le=setting_range(name)[1]) if name == "spec_len" else setting(name)


def _engine_settings(args: argparse.Namespace) -> Any:
    """mechserve's ``EngineConfig`` from the bench's flags (``engine_config``; ``--seed`` seeds the workload and
    ``--spec-len`` names a variant, so the engine's seed is 0 and each run sets its own sizes)."""
    from mechserve.cli.engine_args import engine_config

    return engine_config(args, ignore=("seed", "spec_len"), seed=0)


def _device(text: str) -> str:
    from mechserve.api.config import device_name

    try:
        return device_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> tuple[str, object]:
    """``KEY=N`` or ``KEY=LO,HI`` (a range), positive integers (a float for ``rate``)."""
    key, sep, value = text.partition("=")
    try:
        if not sep or not key:
            raise ValueError
        parts = [float(v) if key == "rate" else int(v) for v in value.split(",")]
        if len(parts) not in (1, 2) or any(p <= 0 for p in parts):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=N or KEY=LO,HI with positive numbers, got {text!r}") from None
    return key, (parts[0] if len(parts) == 1 else tuple(parts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--workload",
        type=names("workload", WORKLOADS, WORKLOADS),
        default=["throughput"],
        help=f"comma-separated, or 'all': {', '.join(WORKLOADS)} (default throughput)",
    )
    add(
        "--engine",
        type=names("engine", ENGINE_NAMES),
        default=["mechserve", "hf"],
        help=f"comma-separated: {', '.join(ENGINE_NAMES)} (default mechserve,hf; absent optional ones are skipped)",
    )
    add(
        "--mode",
        type=names("mode", MODE_NAMES),
        default=["exact"],
        help="comma-separated: exact (fp32), fast (bf16), q4_1, q8_0 (GGUF blocks, bf16 activations); default exact",
    )
    add(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded, default), a local Hugging Face model directory or a GGUF file (modes exact, fast)",
    )
    add("--quick", action="store_true", help="small sizes: about a minute for everything on 2 CPU cores")
    add(
        "--in-process",
        action="store_true",
        help="run mechserve here instead of one fresh process per run (its peak RSS then counts every mode's model)",
    )
    add(
        "--size",
        type=_size,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload size, e.g. num=16, prompt_range=64,512, output_len=32 (repeatable; "
        "see mechserve.bench.workloads.SIZES)",
    )
    add("--out", type=Path, default=Path("bench-results"), help="directory for results.json and the plots")
    add("--seed", type=int, default=0, help="workload seed (default 0)")
    add(
        "--max-step-tokens",
        type=_engine_int("max_step_tokens"),
        default=512,
        help="mechserve's per-step budget (default 512)",
    )
    add(
        "--spec-len",
        type=_engine_int("spec_len"),
        default=None,
        help="also run mechserve with prompt-lookup speculation of up to N guesses (variant ngram-N) on the "
        "throughput and latency workloads; greedy output is unchanged, so it is compared like the default",
    )
    add(
        "--hf-batch-size",
        type=Bounded(int, ge=1),
        default=None,
        help="hf static batch size (default: all requests in one batch)",
    )
    add(
        "--threads",
        type=Bounded(int, ge=1),
        default=None,
        help="torch intra-op threads for every engine (default: one per usable CPU). On a machine shared "
        "with other busy processes, 1 avoids OpenMP threads waiting on each other at every barrier",
    )
    add(
        "--device",
        type=_device,
        default="cpu",
        help="where mechserve's engine and transformers' model run: cpu (default), cuda or cuda:N. The "
        "roofline probes are CPU-only and are skipped on another device; scale the workloads up with "
        "--size, e.g. --size num=256",
    )
    add(
        "--compile",
        action="store_true",
        help="run mechserve with torch.compile of each decoder layer's dense parts (EngineConfig.compile)",
    )
    add("--no-roofline", action="store_true", help="skip the matmul-peak / prefill / decode MFU probes")
    add("--no-plots", action="store_true", help="write results.json only")


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU model, cores usable, memory, OS, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        mem = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cpus": cpus,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "load_average_at_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: a shared machine's other work skews every timing, so it is recorded."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("mechserve", "torch", "transformers", "numpy", "llama-cpp-python", "vllm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> dict[str, Any]:
    """HEAD of the checkout mechserve runs from, and whether the tree has changes (None outside git)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def run(args: argparse.Namespace) -> int:
    from mechserve.cli.errors import CliError

    try:
        results = benchmark(args)
    except (OSError, ValueError) as exc:
        raise CliError(f"bench run: {exc}") from None
    print(f"results: {args.out / 'results.json'}", file=sys.stderr)
    return 0 if results else 2


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far output lists ``b`` stay equal to ``a``: share of identical requests, mean common-prefix share."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n / max(len(x), 1))
    return {"identical_requests": same / len(a), "mean_common_prefix": sum(prefix) / len(prefix)}


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run everything ``args`` asks for; write ``results.json`` (and plots) into ``args.out``; return the document."""
    from mechserve.bench import runners as eng
    from mechserve.bench.fresh import FreshRun, run_fresh
    from mechserve.bench.roofline import linear_params, roofline, roofline_line
    from mechserve.bench.timings import latency_summary, useful_flops
    from mechserve.bench.workloads import SIZES, make_workload
    from mechserve.engine.executors import configure_threads
    from mechserve.model.checkpoint import resolve_model
    from mechserve.model.gguf_file import is_gguf
    from mechserve.model.loader import load_model, torch_device

    if not args.no_plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise OSError("the plots need matplotlib: pip install 'mechserve[viz]', or pass --no-plots")
    from mechserve.bench.workloads import SIZES as known

    unknown = sorted({k for k, _ in args.size} - {k for w in args.workload for k in known[w]["full"]})
    if unknown:
        raise ValueError(f"no workload of {', '.join(args.workload)} has the size(s) {', '.join(unknown)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device != "cpu":
        torch_device(args.device)  # an unavailable device fails here, before any model is loaded
        args.no_roofline = True  # its probes time CPU tensors; a GPU's peaks are not measured (docs/gpu.md)
    threads = configure_threads()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
        threads = torch.get_num_threads()
    args.out.mkdir(parents=True, exist_ok=True)
    path = resolve_model(args.model)
    gguf = is_gguf(path)
    if gguf:
        stored = [m for m in args.mode if eng.MODES[m][1] is not None]
        if stored:
            raise ValueError(
                f"--mode {','.join(stored)}: a GGUF file runs its weights as it stores them; choose exact "
                "(float32 activations and KV) or fast (bfloat16)"
            )
    results: dict[str, Any] = {
        "machine": {**machine(), "torch_threads": threads},
        "versions": versions(),
        "git": git_commit(),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, list, Path, type(None))) and k != "benchmark_module"
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "roofline": {},
        "workloads": {},
        "skipped": [],
    }
    optional: dict[str, Any] = {n: eng.OptionalRunner(n) for n in args.engine if n == "vllm"}
    if "llama-cpp" in args.engine:
        optional["llama-cpp"] = eng.LlamaCppRunner("exact", model=str(args.model), threads=threads)
    for name, peer in list(optional.items()):
        reason = peer.available()
        if reason:
            print(reason, file=sys.stderr)
            results["skipped"].append({"engine": name, "reason": reason})
        else:
            del optional[name]  # available: it runs below
    loaded: dict[str, Any] = {}
    peaks: dict[str, float] = {}
    bandwidth: list[float] = []  # bytes/s, measured with the first mode's roofline
    for mode in args.mode:
        dtype, quantization = eng.MODES[mode]
        # ids in, ids out (hf detokenizes nothing either)
        loaded[mode] = load_model(str(args.model), dtype=dtype, tokenizer=False, quantization=quantization)
        if not args.no_roofline:
            q = args.quick
            r = roofline(
                loaded[mode].model,
                prompt_len=128 if q else 512,
                decode_batch=8 if q else 64,
                decode_context=64 if q else 300,
                repeats=2 if q else 3,
                steps=ROOFLINE_STEPS_QUICK if q else ROOFLINE_STEPS,
            )
            results["roofline"][mode] = r
            peaks[mode] = r["matmul"]["peak_gflops"]
            bandwidth.append(r["read_bandwidth_gb_per_s"] * 1e9)
            _say(
                f"roofline {mode}: matmul peak {r['matmul']['peak_gflops']:.0f} GFLOP/s; prefill "
                f"{r['prefill']['prompt_len']} tokens {r['prefill']['seconds'] * 1000:.0f} ms (MFU "
                f"{r['prefill']['mfu']:.0%}); decode batch {r['decode']['batch']} ctx {r['decode']['context']} "
                f"{r['decode']['tokens_per_s']:.0f} tok/s (MFU {r['decode']['mfu']:.0%}, "
                f"{r['decode']['read_gb_per_s']:.1f} GB/s read; machine reads {r['read_bandwidth_gb_per_s']:.1f} GB/s)"
            )
            for line in r["decode_rooflines"]:
                _say(f"  roofline {mode}: {roofline_line(line)}")
    model0 = next(iter(loaded.values())).model
    a = model0.arch
    flops_args = (linear_params(model0), a.num_heads * a.head_dim, a.num_layers, a.hidden_size * a.vocab_size)
    hf_runners: dict[str, Any] = {}
    hf_skipped: set[str] = set()
    for wname in args.workload:
        sizes = {k: v for k, v in args.size if k in SIZES[wname]["full"]}
        if wname == "multiturn":
            results["workloads"][wname] = _multiturn(args, loaded, path, sizes)
            continue
        workload = make_workload(wname, a.vocab_size, quick=args.quick, seed=args.seed, **sizes)
        entry: dict[str, Any] = {"params": _jsonable(workload.params), "runs": [], "skipped": []}
        results["workloads"][wname] = entry
        if wname == "serve":
            _serve(args, workload, entry)
            continue
        for mode in args.mode:
            for ename in args.engine:
                if ename in optional:
                    continue
                if ename == "hf" and gguf:
                    if "gguf" not in hf_skipped:
                        hf_skipped.add("gguf")
                        reason = "hf skipped: a GGUF file runs in mechserve and llama.cpp here"
                        print(reason, file=sys.stderr)
                        results["skipped"].append({"engine": "hf", "reason": reason})
                    continue
                if ename == "hf" and eng.MODES[mode][1] is not None:
                    if mode not in hf_skipped:
                        hf_skipped.add(mode)
                        reason = f"hf skipped in mode {mode}: transformers has no GGUF-block mode here"
                        print(reason, file=sys.stderr)
                        results["skipped"].append({"engine": "hf", "mode": mode, "reason": reason})
                    continue
                if ename == "llama-cpp":
                    runner: Any = eng.LlamaCppRunner(mode, model=str(args.model), threads=threads)
                elif ename == "hf":
                    if mode not in hf_runners:
                        hf_runners[mode] = eng.HFRunner(path, mode, batch_size=args.hf_batch_size, device=args.device)
                    runner = hf_runners[mode]
                else:
                    runner = eng.MechserveRunner(loaded[mode], mode, _engine_settings(args), spec_len=args.spec_len)
                for variant in runner.variants(workload):
                    if ename == "mechserve" and not args.in_process:
                        spec = FreshRun(
                            model=str(args.model),
                            mode=mode,
                            workload=wname,
                            variant=variant,
                            threads=threads,
                            quick=args.quick,
                            seed=args.seed,
                            sizes=sizes,
                            config=asdict(runner.config),
                            spec_len=args.spec_len,
                        )
                        res = run_fresh(spec)
                    else:
                        res = runner.run(workload, variant)
                    metrics = latency_summary(res.timings, res.duration)
                    flops = sum(useful_flops(len(r.prompt_ids), r.max_tokens, *flops_args) for r in workload.requests)
                    record = {
                        "engine": res.engine,
                        "variant": res.variant,
                        "mode": res.mode,
                        "settings": res.settings,
                        "metrics": metrics,
                        "peak_rss_bytes": res.peak_rss_bytes,
                        "process_peak_rss_bytes": res.process_peak_rss_bytes,
                        "useful_gflops_per_s": flops / res.duration / 1e9,
                        "mfu": (flops / res.duration / 1e9 / peaks[mode]) if mode in peaks else None,
                        "engine_stats": res.engine_stats,
                        "outputs": res.outputs,
                    }
                    if res.engine == "mechserve" and mode in peaks:
                        # the memory roof: the best read rate measured (once per mode, all before the runs)
                        record["roofline"] = _run_roofline(
                            loaded[mode].model, res.engine_stats, max(bandwidth), peaks[mode]
                        )
                    entry["runs"].append(record)
                    _say(_line(wname, record))
                    if record.get("roofline"):
                        _say(f"  roofline {wname}/{mode}/{res.variant}: {roofline_line(record['roofline'])}")
                    warning = shared_machine_warning(res.engine_stats, threads)
                    if warning:
                        _say(f"  {wname}/{mode}/{res.variant}: {warning}")
        _compare(entry)
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["machine"]["load_average_at_end"] = _loadavg()
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if not args.no_plots:
        from mechserve.bench.plots import write_plots

        for p in write_plots(results, args.out):
            print(f"plot: {p}", file=sys.stderr)
    return results


# Other processes' CPU during a run, in cores, above which its times are not an idle machine's figures.
SHARED_CORES = 0.2


def shared_machine_warning(stats: dict[str, Any] | None, threads: int) -> str | None:
    """A warning when other processes used more than ``SHARED_CORES`` cores during a run (``stats``: its
    ``engine_stats``, with ``other_cores`` from ``runners.other_load``), else None.  With as many threads
    as cores every barrier of a forward waits for the thread another process holds off its core, so such a
    run's steps sit well above the probe's (docs/benchmarks.md, issue 28's batch-1 steps)."""
    others = (stats or {}).get("other_cores")
    if others is None or others <= SHARED_CORES:
        return None
    return (
        f"warning: other processes used {others:.2f} cores during this run; its times are not an idle "
        f"machine's (on {threads} thread(s), every barrier waits for a thread they hold off its core)"
    )


def _run_roofline(
    model: Any, stats: dict[str, Any] | None, bandwidth: float, peak: float, repeats: int = 3
) -> dict[str, Any] | None:
    """The decode step at a run's typical batch (the median number of decode rows of the steps that had
    any) and context (the mean position its decode rows computed): its roofline beside the step
    ``decode_probe`` measures at that batch and context (``roofline.decode_roofline``), and beside the
    run's own pure decode steps at that batch (one token for each of ``batch`` requests and nothing else):
    ``run_steps`` (how many), ``run_step_s`` (their median wall time, the scheduler and sampling included)
    and ``run_over_roofline`` (None when there were none), ``run_forward_s`` (the median of those steps'
    time inside the model's forward, where the run recorded it: the step less the scheduler, sampling and
    commit) and ``other_cores`` (the CPU that other processes used during the run, in cores; see
    ``runners.other_load``).  ``bandwidth`` in bytes/s, ``peak`` in GFLOP/s.  None when the run decoded
    nothing."""
    import statistics

    from mechserve.bench.roofline import decode_roofline

    stats = stats or {}
    series = stats.get("decode_rows_series", [])
    rows = [n for n in series if n]
    context = stats.get("decode_context_mean")
    if not rows or context is None:
        return None
    batch = round(statistics.median(rows))
    r = decode_roofline(model, batch, round(context), bandwidth, peak, repeats)
    tokens = stats.get("tokens_per_step_series", [])
    pure = [i for i, (n, t) in enumerate(zip(series, tokens, strict=False)) if n == batch and t == batch]
    step_series, forward_series = stats.get("step_time_series_s", []), stats.get("forward_time_series_s")
    steps = [step_series[i] for i in pure if i < len(step_series)]
    r["run_steps"] = len(steps)
    r["run_step_s"] = statistics.median(steps) if steps else None
    r["run_over_roofline"] = r["run_step_s"] / r["roofline_s"] if steps else None
    forwards = [forward_series[i] for i in pure if i < len(forward_series)] if forward_series else []
    r["run_forward_s"] = statistics.median(forwards) if forwards else None
    r["other_cores"] = stats.get("other_cores")
    return r


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _say(line: str) -> None:
    print(line, flush=True)


def _line(workload: str, r: dict[str, Any]) -> str:
    m, s = r["metrics"], r["engine_stats"] or {}
    extra = ""
    if "steps" in s:
        extra = (
            f" | steps {s['steps']}, {s['tokens_per_step']:.0f} tok/step, prefill computed {s['prefill_tokens_computed']}"
            f", sched {100 * (s['scheduler_fraction'] or 0):.1f}%"
        )
        if s["acceptance_rate"] is not None:
            extra += f", accept {s['acceptance_rate']:.0%}"
    rss = r["peak_rss_bytes"]
    return (
        f"{workload:10s} {r['engine']:9s} {r['mode']:5s} {r['variant']:15s} "
        f"{m['output_throughput']:7.1f} out tok/s {m['total_token_throughput']:7.1f} tot tok/s "
        f"TTFT p50 {m['p50_ttft_ms']:.0f} ms TPOT p50 {m['p50_tpot_ms'] or 0:.1f} ms E2E p50 {m['p50_e2el_ms']:.0f} ms "
        f"RSS {(rss or 0) / 2**20:.0f} MiB{extra}"
    )


def _compare(entry: dict[str, Any]) -> None:
    """Ratios of mechserve's output throughput over hf's (exact) and llama.cpp's (the same mode and the best
    mode), greedy agreement between modes and engines, and on
    the prefix workload mechserve's prefill tokens computed with prefix caching over without, and its
    TTFT p50 without over with."""
    runs = entry["runs"]
    cmp: dict[str, Any] = {}
    by = {(r["engine"], r["mode"], r["variant"]): r for r in runs}
    for (engine, mode, variant), r in by.items():
        hf = by.get(("hf", "exact", "default"))
        if engine == "mechserve" and hf:
            key = f"mechserve[{mode},{variant}]/hf[exact]"
            cmp[key] = r["metrics"]["output_throughput"] / hf["metrics"]["output_throughput"]
        peers = [p for (e, m, v), p in by.items() if e == "llama-cpp"]
        if engine == "mechserve" and peers:
            best = max(peers, key=lambda p: p["metrics"]["output_throughput"])
            cmp[f"mechserve[{mode},{variant}]/llama-cpp[best: {best['mode']}]"] = (
                r["metrics"]["output_throughput"] / best["metrics"]["output_throughput"]
            )
        same = by.get(("llama-cpp", mode, "default"))
        if engine == "mechserve" and same:
            cmp[f"mechserve[{mode},{variant}]/llama-cpp[{mode}]"] = (
                r["metrics"]["output_throughput"] / same["metrics"]["output_throughput"]
            )
            cmp[f"mechserve[{mode},{variant}] vs llama-cpp[{mode}] greedy agreement"] = _agreement(
                same["outputs"], r["outputs"]
            )
        exact = by.get((engine, "exact", variant))
        if mode != "exact" and exact:
            cmp[f"{engine}[{variant}] {mode} vs exact greedy agreement"] = _agreement(exact["outputs"], r["outputs"])
        hf_same = by.get(("hf", mode, "default"))
        if engine in ("mechserve", "llama-cpp") and hf_same:
            cmp[f"{engine}[{mode},{variant}] vs hf[{mode}] greedy agreement"] = _agreement(
                hf_same["outputs"], r["outputs"]
            )
    for mode in MODE_NAMES:
        on, off = by.get(("mechserve", mode, "prefix-cache")), by.get(("mechserve", mode, "no-prefix-cache"))
        if not (on and off and on["metrics"]["p50_ttft_ms"] and off["engine_stats"]["prefill_tokens_computed"]):
            continue
        # the prefix workload's two targets: prefill computed <= 1/8 of uncached, TTFT p50 >= 4x better
        cmp[f"mechserve[{mode}] prefill computed prefix-cache/no-prefix-cache"] = (
            on["engine_stats"]["prefill_tokens_computed"] / off["engine_stats"]["prefill_tokens_computed"]
        )
        cmp[f"mechserve[{mode}] TTFT p50 no-prefix-cache/prefix-cache"] = (
            off["metrics"]["p50_ttft_ms"] / on["metrics"]["p50_ttft_ms"]
        )
    entry["comparisons"] = cmp
    for k, v in cmp.items():
        _say(f"  {k}: {v if isinstance(v, dict) else f'{v:.2f}x'}")


def _multiturn(args: argparse.Namespace, loaded: dict[str, Any], path: Path, sizes: dict[str, Any]) -> dict[str, Any]:
    """The multiturn workload (``workloads.make_conversations``) on mechserve: output caching on and off,
    each with and without prompt lookup (``ngram-K``, K = ``--spec-len``, default 4), side by side in one run
    (``runners.run_conversations``); per turn: prompt, new and computed prefill tokens, TTFT p50/p99."""
    import dataclasses

    from mechserve.api.config import SpeculativeConfig, dtype_name
    from mechserve.bench.runners import run_conversations
    from mechserve.bench.timings import turn_summary
    from mechserve.bench.workloads import make_conversations
    from mechserve.model.checkpoint import load_tokenizer

    conversations = make_conversations(quick=args.quick, seed=args.seed, **sizes)
    entry: dict[str, Any] = {"params": _jsonable(conversations.params), "runs": [], "skipped": []}
    for e in args.engine:
        if e != "mechserve":
            msg = f"{e} skipped on the multiturn workload: its turns are built from mechserve's answers"
            print(msg, file=sys.stderr)
            entry["skipped"].append({"engine": e, "reason": msg})
    if "mechserve" not in args.engine:
        return entry
    tokenizer = load_tokenizer(path)
    k = args.spec_len or 4
    page_size = 16
    turns = int(conversations.params["turns"])  # type: ignore[call-overload]
    longest = 96 + turns * (conversations.max_tokens + 64)  # system prompt, then each turn's message and answer
    for mode in args.mode:
        model = dataclasses.replace(loaded[mode], tokenizer=tokenizer)
        base = _engine_settings(args).replace(
            dtype=dtype_name(model.model.dtype),
            page_size=page_size,
            num_pages=len(conversations.messages) * -(-longest // page_size) + 8,
            max_running=None,
        )
        ngram = SpeculativeConfig(num_speculative_tokens=k)  # the default method: prompt lookup
        configs = {
            "output-caching": base,
            "no-output-caching": base.replace(output_caching=False),
            f"output-caching+ngram-{k}": base.replace(speculative=ngram),
            f"no-output-caching+ngram-{k}": base.replace(output_caching=False, speculative=ngram),
        }
        for variant, results in run_conversations(model, conversations, configs).items():
            c = configs[variant]
            record = {
                "engine": "mechserve",
                "variant": variant,
                "mode": mode,
                "settings": {
                    "max_step_tokens": c.max_step_tokens,
                    "page_size": c.page_size,
                    "num_pages": c.num_pages,
                    "output_caching": c.output_caching,
                    "spec_len": c.spec_len,
                },
                "turns": turn_summary(results, page_size),
                "requests": [_jsonable(dataclasses.asdict(r)) for r in results],
            }
            entry["runs"].append(record)
            for t in record["turns"]:
                _say(_turn_line(mode, variant, t))
    entry["comparisons"] = _compare_turns(entry["runs"])
    for key, value in entry["comparisons"].items():
        _say(f"  {key}: {value if isinstance(value, (bool, dict, type(None))) else f'{value:.2f}x'}")
    return entry


def _turn_line(mode: str, variant: str, t: dict[str, Any]) -> str:
    new = "-" if t["new_tokens"] is None else f"{t['new_tokens']:.0f}"
    retok = "" if t["retokenized"] is None else f", retokenized {t['retokenized']:.0%}"
    return (
        f"multiturn  mechserve {mode:5s} {variant:26s} turn {t['turn']}: prompt {t['prompt_tokens']:.0f}, new {new}, "
        f"prefill computed {t['prefill_computed']:.0f}, reused {t['reused']:.0f}, TTFT p50 {t['p50_ttft_ms']:.0f} ms "
        f"p99 {t['p99_ttft_ms']:.0f} ms (CPU p50 {t['p50_ttft_cpu_ms']:.0f} ms){retok}"
    )


def _compare_turns(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and speculation, output caching off over on: TTFT p50 and prefill computed per turn; the two
    targets (from turn 2 on, prefill is the new tokens plus at most one partial block; TTFT p50 at turn 4 at
    least 3x better); and whether every configuration gave the same answers."""
    cmp: dict[str, Any] = {}
    by = {(r["mode"], r["variant"]): r for r in runs}
    for (mode, variant), on in by.items():
        if variant.startswith("no-"):
            continue
        off = by.get((mode, f"no-{variant}"))
        if off is None:
            continue
        for a, b in zip(on["turns"], off["turns"]):
            tag = f"{mode},{variant.replace('output-caching', 'on')} turn {a['turn']}"
            cmp[f"TTFT p50 off/on [{tag}]"] = b["p50_ttft_ms"] / a["p50_ttft_ms"] if a["p50_ttft_ms"] else None
            cpu = a["p50_ttft_cpu_ms"]
            cmp[f"TTFT p50 (CPU time) off/on [{tag}]"] = b["p50_ttft_cpu_ms"] / cpu if cpu else None
            cmp[f"prefill computed on/off [{tag}]"] = (
                a["prefill_computed"] / b["prefill_computed"] if b["prefill_computed"] else None
            )
        later = [t for t in on["turns"] if t["turn"] >= 2]
        cmp[f"target met: turn >= 2 prefill = new + < 1 block [{mode},{variant}]"] = bool(later) and all(
            t["within_one_block"] for t in later
        )
        fourth = [(a, b) for a, b in zip(on["turns"], off["turns"]) if a["turn"] == 4]
        if fourth:
            (a, b), *_ = fourth
            cmp[f"target met: turn 4 TTFT p50 off/on >= 3 [{mode},{variant}]"] = (
                b["p50_ttft_ms"] >= 3 * a["p50_ttft_ms"]
            )
            cmp[f"target met: turn 4 TTFT p50 (CPU time) off/on >= 3 [{mode},{variant}]"] = (
                b["p50_ttft_cpu_ms"] >= 3 * a["p50_ttft_cpu_ms"]
            )
    for mode in dict.fromkeys(r["mode"] for r in runs):
        answers = {json.dumps([q["output_ids"] for q in r["requests"]]) for r in runs if r["mode"] == mode}
        cmp[f"every configuration gave the same answers [{mode}]"] = len(answers) == 1
    return cmp


def _serve(args: argparse.Namespace, workload: Any, entry: dict[str, Any]) -> None:
    """Poisson arrivals against a ``mechserve serve`` started here (mechserve only: hf has no server)."""
    import asyncio
    import socket

    from mechserve.bench import serve_client

    for e in args.engine:
        if e != "mechserve":
            msg = f"{e} skipped on the serve workload: only mechserve has a server here"
            print(msg, file=sys.stderr)
            entry["skipped"].append({"engine": e, "reason": msg})
    if "mechserve" not in args.engine:
        return
    p = workload.params
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for mode in args.mode:
        server = subprocess.Popen(
            _serve_command(args, mode, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:
            _wait_healthy(port, server)
            config = serve_client.BenchConfig(
                url=f"http://127.0.0.1:{port}",
                rate=float(p["rate"]),
                num_requests=int(p["num"]),
                input_len=int(p["prompt_len"]),
                output_len=int(p["output_len"]),
                seed=args.seed,
            )
            report = asyncio.run(serve_client.benchmark(config))
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        entry["serve_reports"] = [*entry.get("serve_reports", []), {"engine": "mechserve", "mode": mode, **report}]
        _say(
            f"serve      mechserve {mode:5s} rate {p['rate']}/s: {report['completed']} done, "
            f"{report['output_throughput']:.1f} out tok/s, TTFT p50 {report['p50_ttft_ms'] or 0:.0f} ms, "
            f"ITL p50 {report['p50_itl_ms'] or 0:.0f} ms"
        )


def _serve_command(args: argparse.Namespace, mode: str, port: int) -> list[str]:
    """The ``mechserve serve`` command line of ``mode`` (``runners.MODES``: its dtype and, for q4_1/q8_0,
    ``--quantization``) on ``port``."""
    from mechserve.api.config import dtype_name
    from mechserve.bench.runners import MODES

    dtype, quantization = MODES[mode]
    return [
        sys.executable,
        "-m",
        "mechserve.cli.main",
        "serve",
        "--model",
        str(args.model),
        "--port",
        str(port),
        "--dtype",
        dtype_name(dtype),
        *(["--quantization", quantization] if quantization else []),
        "--device",
        args.device,
        *(["--compile"] if args.compile else []),
    ]


def _wait_healthy(port: int, server: subprocess.Popen[str], timeout: float = 180.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            err = (server.stderr.read() if server.stderr else "").strip().splitlines()
            raise OSError(f"mechserve serve exited with {server.returncode}: {err[-1] if err else ''}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise OSError(f"mechserve serve did not become healthy within {timeout:.0f} s")
