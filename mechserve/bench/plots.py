"""PNG plots of a ``bench run`` results document (matplotlib, headless ``Agg`` backend).

* ``throughput.png``: output tokens/s per engine run, one panel per workload;
* ``latency.png``: TTFT, TPOT, ITL and E2E percentiles (p50 bar, p99 whisker) per run;
* ``tokens_per_step.png``: computed tokens in each engine step over the run (mechserve runs);
* ``multiturn.png``: prefill tokens computed and TTFT p50 per turn, one line per configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _runs(results: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The workloads whose runs have request metrics (the multiturn workload's have per-turn figures)."""
    return [
        (name, w["runs"])
        for name, w in results["workloads"].items()
        if w.get("runs") and all("metrics" in r for r in w["runs"])
    ]


def _label(run: dict[str, Any]) -> str:
    variant = "" if run["variant"] == "default" else f"\n{run['variant']}"
    return f"{run['engine']} {run['mode']}{variant}"


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Write the plots for ``results`` into ``out``; return the files written (none without runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = _runs(results)
    written = _multiturn(results, out, plt)
    if not workloads:
        return written

    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], workloads):
        ax.bar([_label(r) for r in runs], [r["metrics"]["output_throughput"] for r in runs], color="tab:blue")
        ax.set_title(f"{name}: output tokens/s")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    kinds = ("ttft", "tpot", "itl", "e2el")
    fig, axes = plt.subplots(len(workloads), len(kinds), figsize=(16, 3.2 * len(workloads)), squeeze=False)
    for row, (name, runs) in zip(axes, workloads):
        for ax, kind in zip(row, kinds):
            labels = [_label(r) for r in runs]
            p50 = [r["metrics"][f"p50_{kind}_ms"] or 0.0 for r in runs]
            p99 = [r["metrics"][f"p99_{kind}_ms"] or 0.0 for r in runs]
            ax.bar(labels, p50, color="tab:orange", label="p50")
            ax.errorbar(labels, p50, yerr=[[0] * len(p50), [b - a for a, b in zip(p50, p99)]], fmt="none", ecolor="k")
            ax.set_title(f"{name}: {kind} ms (p50, whisker p99)", fontsize=9)
            ax.tick_params(axis="x", labelsize=6)
    fig.tight_layout()
    written.append(out / "latency.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    traced = [
        (name, r)
        for name, runs in workloads
        for r in runs
        if (r.get("engine_stats") or {}).get("tokens_per_step_series")
    ]
    if traced:
        fig, ax = plt.subplots(figsize=(9, 4))
        for name, r in traced:
            ax.plot(r["engine_stats"]["tokens_per_step_series"], label=f"{name}: {_label(r)}".replace("\n", " "), lw=1)
        ax.set_xlabel("engine step")
        ax.set_ylabel("tokens computed")
        ax.set_title("mechserve: tokens per step over the run")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "tokens_per_step.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def _multiturn(results: dict[str, Any], out: Path, plt: Any) -> list[Path]:
    """``multiturn.png`` when the results hold the multiturn workload's runs."""
    runs = (results["workloads"].get("multiturn") or {}).get("runs") or []
    if not runs:
        return []
    fig, (computed, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        turns = [t["turn"] for t in r["turns"]]
        label = f"{r['variant']} ({r['mode']})"
        computed.plot(turns, [t["prefill_computed"] for t in r["turns"]], marker="o", label=label)
        ttft.plot(turns, [t["p50_ttft_ms"] for t in r["turns"]], marker="o", label=label)
    computed.set_title("multiturn: prefill tokens computed per turn (mean)", fontsize=9)
    ttft.set_title("multiturn: TTFT p50 per turn (ms)", fontsize=9)
    for ax in (computed, ttft):
        ax.set_xlabel("turn")
        ax.set_xticks(sorted({t["turn"] for r in runs for t in r["turns"]}))
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "multiturn.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_step_times(series: dict[str, list[float]], path: Path) -> Path:
    """Step time (ms) against step, one line per labelled series (``bench spec``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for label, times in series.items():
        ax.plot([1000 * t for t in times], label=label, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title("m12 with the scripted executor: step time against step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
