"""Issue 28's two tables, with their roofline columns: runs the benchmark and prints them, in one command.

    PYTHONPATH=$PWD python docs/scripts/issue28_tables.py --run bench-results/issue28 [--threads 1,2]
    python docs/scripts/issue28_tables.py bench-results/issue28/results.json     # tables of a finished run

``--run DIR`` runs ``python -m mechserve bench run`` with ``BENCH_ARGS`` (``--workload latency,throughput
--engine mechserve,hf,llama-cpp --mode exact,fast,q4_1,q8_0``, the roofline on) into ``DIR`` (with
``--threads``: once per thread count, into ``DIR/threads-N``, every engine on N threads), then prints
the tables of each results file and writes them to ``issue28_tables.md`` beside it.  Arguments after
``--`` go to ``bench run`` (``-- --quick`` for a smoke run).  The tables, as markdown:

* the mixed workload (``throughput``): output tokens/s of mechserve, llama.cpp in the same mode and hf, the
  ratio to llama.cpp's best mode, TTFT p50, and mechserve's decode step at the run's typical batch: its
  roofline ``max(bytes / bandwidth, FLOPs / peak)``, the step measured at that batch and context, and the
  run's own pure decode steps at that batch (median), each as a multiple of the roofline;
* batch 1 (``latency``): TPOT and TTFT p50 of mechserve and llama.cpp, and the same roofline columns, with
  the bytes per step over the run's own step time (the effective read rate);
* each mode's fixed decode steps (batch 1 at 512, batch 32 at 300: ``run.ROOFLINE_STEPS``) beside their
  roofline.

Standard library only.  A cell whose run is missing reads ``-``.  A ``bench run`` that fails stops the
script with its exit status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_ARGS = (
    "--workload",
    "latency,throughput",
    "--engine",
    "mechserve,hf,llama-cpp",
    "--mode",
    "exact,fast,q4_1,q8_0",
)

LLAMA_CPP_KIND = {"exact": "F32", "fast": "BF16", "q4_1": "Q4_1", "q8_0": "Q8_0"}


def _runs(doc: dict[str, Any], workload: str) -> dict[tuple[str, str], dict[str, Any]]:
    runs = doc.get("workloads", {}).get(workload, {}).get("runs", [])
    return {(r["engine"], r["mode"]): r for r in runs if r["variant"] == "default"}


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _roof_cells(r: dict[str, Any] | None) -> list[str]:
    """typical batch and context, roofline ms (bound), probe ms (x), the run's steps ms (x)."""
    line = (r or {}).get("roofline")
    if not line:
        return ["-"] * 4
    run_ms = line.get("run_step_s")
    run = "-"
    if run_ms is not None:
        extra = ""
        if line.get("run_forward_s") is not None:  # since issue 28's gap: the steps' time in the forward
            extra += f"; forward {line['run_forward_s'] * 1e3:.1f}"
        if line.get("other_cores") is not None:  # and the CPU other processes used during the run
            extra += f"; others {line['other_cores']:.2f} cores"
        run = f"{run_ms * 1e3:.1f} ({line['run_over_roofline']:.2f}x, {line['run_steps']} steps{extra})"
    return [
        f"{line['batch']} @ {line['context']}",
        f"{line['roofline_s'] * 1e3:.1f} ({line['bound']})",
        f"{line['measured_s'] * 1e3:.1f} ({line['measured_over_roofline']:.2f}x)",
        run,
    ]


def mixed_table(doc: dict[str, Any]) -> list[str]:
    runs = _runs(doc, "throughput")
    peers = [r for (engine, _), r in runs.items() if engine == "llama-cpp"]
    best = max(peers, key=lambda r: r["metrics"]["output_throughput"], default=None)
    best_name = f"{LLAMA_CPP_KIND[best['mode']]}, {best['metrics']['output_throughput']:.1f}" if best else "-"
    out = [
        f"| mixed, out tok/s | mechserve | llama.cpp (same GGUF kind) | hf | mechserve / llama.cpp's best ({best_name}) "
        "| TTFT p50 mechserve / llama.cpp (s) | typical decode batch @ context | roofline ms | probe ms | "
        "the run's decode steps ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in LLAMA_CPP_KIND:
        ms, peer, hf = runs.get(("mechserve", mode)), runs.get(("llama-cpp", mode)), runs.get(("hf", mode))
        if ms is None:
            continue
        tput = ms["metrics"]["output_throughput"]
        ratio = tput / best["metrics"]["output_throughput"] if best else None

        def ttft(r: dict[str, Any] | None) -> str:
            return "-" if r is None else f"{r['metrics']['p50_ttft_ms'] / 1e3:.1f}"

        out.append(
            f"| {mode} | {tput:.1f} | {_num(peer and peer['metrics']['output_throughput'], '.1f')} | "
            f"{_num(hf and hf['metrics']['output_throughput'], '.1f')} | {_num(ratio, '.2f')}{'x' if ratio else ''} | "
            f"{ttft(ms)} / {ttft(peer)} | " + " | ".join(_roof_cells(ms)) + " |"
        )
    return out


def batch1_table(doc: dict[str, Any]) -> list[str]:
    runs = _runs(doc, "latency")
    out = [
        "| batch 1 | TPOT p50 mechserve ms | llama.cpp | TTFT p50 mechserve ms | llama.cpp | decode @ context | "
        "roofline ms | probe ms | the run's decode steps ms | effective GB/s (bytes / the run's step) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, kind in LLAMA_CPP_KIND.items():
        ms, peer = runs.get(("mechserve", mode)), runs.get(("llama-cpp", mode))
        if ms is None:
            continue
        line = ms.get("roofline") or {}
        rate = line["bytes"] / line["run_step_s"] / 1e9 if line.get("run_step_s") else None
        out.append(
            f"| {mode} / {kind} | {_num(ms['metrics']['p50_tpot_ms'], '.1f')} | "
            f"{_num(peer and peer['metrics']['p50_tpot_ms'], '.1f')} | {ms['metrics']['p50_ttft_ms']:.0f} | "
            f"{_num(peer and peer['metrics']['p50_ttft_ms'], '.0f')} | "
            + " | ".join(_roof_cells(ms))
            + f" | {_num(rate, '.1f')} |"
        )
    return out


def fixed_steps_table(doc: dict[str, Any]) -> list[str]:
    out = [
        "| mode | decode step | bytes MB | GFLOP | roofline ms (bound) | measured ms | measured / roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in doc.get("roofline", {}).items():
        for line in r.get("decode_rooflines", []):
            out.append(
                f"| {mode} | batch {line['batch']} @ {line['context']} | {line['bytes'] / 1e6:.0f} | "
                f"{line['flops'] / 1e9:.2f} | {line['roofline_s'] * 1e3:.1f} ({line['bound']}) | "
                f"{line['measured_s'] * 1e3:.1f} | {line['measured_over_roofline']:.2f}x |"
            )
    return out


def tables(doc: dict[str, Any]) -> str:
    """The header line (machine, threads, load, commit) and the three tables of one results file, as markdown."""
    m = doc.get("machine", {})
    head = (
        f"{m.get('cpu')}, {m.get('torch_threads')} threads; load average at start {m.get('load_average_at_start')}, "
        f"at end {m.get('load_average_at_end')}; commit {doc.get('git', {}).get('commit')} "
        f"(dirty: {doc.get('git', {}).get('dirty')})"
    )
    return "\n\n".join([head, *("\n".join(t) for t in (mixed_table(doc), batch1_table(doc), fixed_steps_table(doc)))])


def _thread_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads takes positive integers separated by commas, got {text!r}")
    return counts


def run(out: Path, threads: list[int] | None, extra: list[str]) -> list[Path]:
    """``bench run`` with ``BENCH_ARGS`` and ``extra`` into ``out`` (or ``out/threads-N`` per thread count);
    the results files written.  Exits with ``bench run``'s status if it fails."""
    paths = []
    for n in threads or [None]:
        where = out if n is None else out / f"threads-{n}"
        cmd = [sys.executable, "-m", "mechserve", "bench", "run", *BENCH_ARGS, "--out", str(where)]
        cmd += ([] if n is None else ["--threads", str(n)]) + extra
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        done = subprocess.run(cmd)
        if done.returncode:
            sys.exit(done.returncode)
        paths.append(where / "results.json")
    return paths


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description="issue 28's tables from mechserve bench run")
    parser.add_argument("results", nargs="*", type=Path, help="results.json files of finished runs")
    parser.add_argument("--run", type=Path, metavar="DIR", help="run the benchmark into DIR first")
    parser.add_argument("--threads", type=_thread_counts, help="with --run: one run per thread count, e.g. 1,2")
    args = parser.parse_args(argv)
    if bool(args.run) == bool(args.results):
        parser.error("give either --run DIR or results.json files")
    if (args.threads or extra) and not args.run:
        parser.error("--threads and arguments after -- go with --run")
    paths = run(args.run, args.threads, extra) if args.run else args.results
    for path in paths:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            parser.exit(2, f"{parser.prog}: error: cannot read {path}: {e}\n")
        text = tables(doc)
        print(f"## {path}\n\n{text}\n")
        if args.run:
            (path.parent / "issue28_tables.md").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
