"""Issue 28's two tables, with their roofline columns, from a ``mechserve bench run`` results file.

    python docs/scripts/issue28_tables.py bench-results/issue28/results.json

Reads the run of ``--workload latency,throughput --engine mechserve,hf,llama-cpp --mode exact,fast,q4_1,q8_0``
(with the roofline, so without ``--no-roofline``) and prints, as markdown:

* the mixed workload (``throughput``): output tokens/s of mechserve, llama.cpp in the same mode and hf, the
  ratio to llama.cpp's best mode, TTFT p50, and mechserve's decode step at the run's typical batch: its
  roofline ``max(bytes / bandwidth, FLOPs / peak)``, the step measured at that batch and context, and the
  run's own pure decode steps at that batch (median), each as a multiple of the roofline;
* batch 1 (``latency``): TPOT and TTFT p50 of mechserve and llama.cpp, and the same roofline columns, with
  the bytes per step over the run's own step time (the effective read rate);
* each mode's fixed decode steps (batch 1 at 512, batch 32 at 300: ``run.ROOFLINE_STEPS``) beside their
  roofline.

Standard library only.  A cell whose run is missing reads ``-``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

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
    return [
        f"{line['batch']} @ {line['context']}",
        f"{line['roofline_s'] * 1e3:.1f} ({line['bound']})",
        f"{line['measured_s'] * 1e3:.1f} ({line['measured_over_roofline']:.2f}x)",
        "-" if run_ms is None else f"{run_ms * 1e3:.1f} ({line['run_over_roofline']:.2f}x, {line['run_steps']} steps)",
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


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    m = doc.get("machine", {})
    print(
        f"{m.get('cpu')}, {m.get('torch_threads')} threads; load average at start {m.get('load_average_at_start')}, "
        f"at end {m.get('load_average_at_end')}; commit {doc.get('git', {}).get('commit')} "
        f"(dirty: {doc.get('git', {}).get('dirty')})\n"
    )
    for table in (mixed_table(doc), batch1_table(doc), fixed_steps_table(doc)):
        print("\n".join(table) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python docs/scripts/issue28_tables.py RESULTS.json")
    main(sys.argv[1])
