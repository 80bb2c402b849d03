"""Issue 27's table: every spec-decode workload x configuration at batch 1 and 8 with llama.cpp beside, and the
issue's targets met or missed, in one command.

    PYTHONPATH=$PWD python docs/scripts/issue27_table.py [--quick] [--out bench-results/issue27] [-- BENCH ARGS]
    python docs/scripts/issue27_table.py bench-results/issue27/spec-decode.json     # the table of a finished run

Runs ``python -m mechserve bench spec-decode --mode fast --batches 1 8 --configs off ngram suffix draft
[eagle eagle-adaptive] --llama-cpp --json`` (the eagle ones where the bench has them; llama.cpp in BF16, Q8_0 and
Q4_1, so it must be built: ``make llama-cpp``), all workloads but the copy set, 8 sessions of 128 new tokens
each (``--quick``: 2 sessions of 32, a smoke run whose batch "8" holds 2 sessions); arguments after ``--`` go
to the bench and come last (``-- --prompts 4``).  Writes the report to ``OUT/spec-decode.json``
(``spec-decode-quick.json``) and the table to ``issue27_table.md`` beside it, and prints the table.

The table, as markdown, one per batch size: per workload, each configuration's output tok/s, its speedup over
``off`` in the same run (with more than one repeat, the lowest and highest repeat's beside it: the run's
noise), its tok/s over llama.cpp's best GGUF on the same turns (``x llama.cpp``), the kept tokens per decode step and the acceptance at each draft position; then llama.cpp's GGUFs.  The targets (the
issue's, in fast mode): at batch 1 the best proposer per workload at >= 1.8x ``off`` on chat, agent and
code-edit, >= 1.3x on summarise, >= 0.97x on novel, and >= 1.5x llama.cpp's best on chat, agent and code-edit;
the trained head (``eagle``) at >= 2.0 kept tokens per step on novel at batch 1; at batch 8 no adaptive
configuration (``ngram``, ``suffix``, ``eagle-adaptive``: those the governor sizes) slower than ``off`` on any workload
(``draft`` runs a fixed 3 guesses and ``eagle`` a fixed 4: not the governor's, shown, not judged).  A miss prints its acceptance per
position beside it.  The figures are only as good as the machine was idle: say so when it was not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKLOADS = ("chat", "agent", "code-edit", "summarise", "novel")
ADAPTIVE = ("ngram", "suffix", "eagle-adaptive")
# (workload, least speedup over off of the best proposer at batch 1)
SPEEDUP_TARGETS = (("chat", 1.8), ("agent", 1.8), ("code-edit", 1.8), ("summarise", 1.3), ("novel", 0.97))
LLAMA_TARGETS = (("chat", 1.5), ("agent", 1.5), ("code-edit", 1.5))
EAGLE_KEPT = 2.0


def configs() -> list[str]:
    """off ngram suffix draft, and eagle (fixed length) and eagle-adaptive where the bench knows them."""
    from mechserve.bench.spec_decode import CONFIGS

    return ["off", "ngram", "suffix", "draft", *(c for c in ("eagle", "eagle-adaptive") if c in CONFIGS)]


def bench_command(quick: bool, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "mechserve", "bench", "spec-decode", "--mode", "fast", "--batches", "1", "8"]
    cmd += ["--sets", *WORKLOADS, "--configs", *configs(), "--llama-cpp", "--json"]
    cmd += ["--prompts", "2", "--max-tokens", "32"] if quick else ["--prompts", "8", "--max-tokens", "128"]
    return cmd + extra


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _positions(r: dict[str, Any]) -> str:
    return " / ".join(f"{a:.2f}" for a in r.get("acceptance_by_position") or []) or "-"


def table(report: dict[str, Any], batch: int) -> str:
    """The markdown table of one batch size."""
    from mechserve.bench.spec_decode import spread

    peer = report.get("llama_cpp", {}).get("cells", {})
    lines = [
        f"**Batch {batch}** ({report.get('mode', 'exact')} mode, {report['prompts_per_set']} sessions per workload, "
        f"{report['max_tokens']} new tokens at most per turn, {report['threads']} threads)",
        "",
        "| workload | configuration | tok/s | speedup | x llama.cpp | kept tokens / step | acceptance by position |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for workload in WORKLOADS:
        key = f"{workload}/batch-{batch}"
        cell = report["cells"].get(key)
        if cell is None:
            continue
        side = peer.get(key, {})
        best = side.get("best", {})
        theirs = best.get("llama_cpp_tok_s")
        for name, r in cell.items():
            ratio = r["tok_s"] / theirs if theirs else None
            speedup = _num(1.0 if name == "off" else r["speedup"], ".2f")
            by_repeat = r.get("speedup_by_repeat") or []
            if len(by_repeat) > 1:  # the run's noise: the lowest and highest repeat
                speedup += f" ({spread(by_repeat)})"
            lines.append(
                f"| {workload} | {name} | {r['tok_s']:.1f} | {speedup} | {_num(ratio, '.2f')} | "
                f"{_num(r['tokens_per_decode_step'], '.2f')} | {_positions(r)} |"
            )
        for kind, r in side.items():
            if kind == "best":
                continue
            mark = " (best)" if kind == best.get("llama_cpp") else ""
            lines.append(
                f"| {workload} | llama.cpp {kind}{mark} | {r['tok_s']:.1f} | | "
                f"{_num(r['tok_s'] / theirs if theirs else None, '.2f')} | | "
                f"same ids: {r['identical']}/{r['requests']} |"
            )
    return "\n".join(lines)


def targets(report: dict[str, Any]) -> list[str]:
    """One line per target: met or missed, the figure, and for a miss the acceptance that explains it."""
    cells = report["cells"]
    peer = report.get("llama_cpp", {}).get("cells", {})
    out = []

    def best_of(cell: dict[str, Any], names: Any) -> tuple[str, dict[str, Any]] | None:
        found = [(n, cell[n]) for n in names if n in cell]
        return max(found, key=lambda nr: nr[1]["tok_s"]) if found else None

    def line(ok: bool, text: str, r: dict[str, Any] | None = None) -> str:
        why = (
            ""
            if ok or r is None
            else f"; acceptance by position {_positions(r)}, kept/step {r['tokens_per_decode_step']}"
        )
        return f"- [{'met' if ok else 'MISSED'}] {text}{why}"

    for workload, least in SPEEDUP_TARGETS:
        cell = cells.get(f"{workload}/batch-1")
        top = best_of(cell, [n for n in cell if n != "off"]) if cell else None
        if top is None:
            out.append(f"- [not measured] batch 1 {workload}: >= {least}x off")
            continue
        name, r = top
        out.append(
            line(r["speedup"] >= least, f"batch 1 {workload}: best {name} {r['speedup']:.2f}x off (>= {least}x)", r)
        )
    for workload, least in LLAMA_TARGETS:
        side = peer.get(f"{workload}/batch-1", {}).get("best")
        if not side:
            out.append(f"- [not measured] batch 1 {workload}: >= {least}x llama.cpp's best (no llama.cpp in the run)")
            continue
        r = cells[f"{workload}/batch-1"][side["config"]]
        out.append(
            line(
                side["ratio"] is not None and side["ratio"] >= least,
                f"batch 1 {workload}: {side['config']} {side['config_tok_s']:.1f} tok/s = {_num(side['ratio'], '.2f')}x "
                f"llama.cpp {side['llama_cpp']} {side['llama_cpp_tok_s']:.1f} (>= {least}x)",
                r,
            )
        )
    novel = cells.get("novel/batch-1", {}).get("eagle")
    if novel is None:
        out.append(
            f"- [not measured] batch 1 novel: eagle >= {EAGLE_KEPT} kept tokens per step (no eagle configuration)"
        )
    else:
        kept = novel["tokens_per_decode_step"] or 0.0
        out.append(
            line(kept >= EAGLE_KEPT, f"batch 1 novel: eagle {kept:.2f} kept tokens per step (>= {EAGLE_KEPT})", novel)
        )
    for workload in WORKLOADS:
        cell = cells.get(f"{workload}/batch-8")
        if cell is None:
            out.append(f"- [not measured] batch 8 {workload}: no adaptive configuration slower than off")
            continue
        judged = [(n, cell[n]) for n in ADAPTIVE if n in cell]
        worst = min(judged, key=lambda nr: nr[1]["speedup"]) if judged else None
        if worst is None:
            out.append(f"- [not measured] batch 8 {workload}: no adaptive configuration in the run")
            continue
        name, r = worst
        listed = ", ".join(f"{n} {x['speedup']:.2f}x" for n, x in judged)
        out.append(line(r["speedup"] >= 1.0, f"batch 8 {workload}: slowest adaptive {name} ({listed}; >= 1.0x)", r))
    return out


def render(report: dict[str, Any]) -> str:
    peer = report.get("llama_cpp")
    head = [
        f"Model {report['model']}; llama.cpp: "
        + (f"{', '.join(peer['ggufs'].values())} ({peer['version']})" if peer else "not run")
    ]
    parts = ["\n".join(head)] + [table(report, b) for b in (1, 8)] + ["Targets:\n" + "\n".join(targets(report))]
    return "\n\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="?", help="a finished run's JSON report: print its table only")
    parser.add_argument("--quick", action="store_true", help="2 sessions of 32 new tokens per workload (a smoke run)")
    parser.add_argument("--out", default="bench-results/issue27")
    argv, extra = sys.argv[1:], []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = parser.parse_args(argv)
    if args.report:
        print(render(json.loads(Path(args.report).read_text())), end="")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = bench_command(args.quick, extra)
    print("running:", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    started = time.time()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        return done.returncode
    report = json.loads(done.stdout)
    report["command"] = cmd[1:]
    report["wall_s"] = round(time.time() - started, 1)
    path = out / ("spec-decode-quick.json" if args.quick else "spec-decode.json")
    path.write_text(json.dumps(report, indent=1))
    text = render(report)
    (out / "issue27_table.md").write_text(text)
    print(text, end="")
    print(f"wrote {path} and {out / 'issue27_table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
