"""Issue 30's per-file table: mechserve and llama.cpp on the same GGUF files of the embedded model.

For each file kind (default q4_k_m, q5_k_m, q6_k, q8_0 and the shipped q4_1; made once by ``llama-quantize``
from the shipped file, ``mechserve.bench.llama_cpp.ensure_gguf``) it runs, one after another:

* ``mechserve bench run --model FILE --mode fast --engine mechserve,llama-cpp --workload latency,throughput``
  (mechserve in a fresh process per run, bfloat16 activations and KV; ``llama-server`` with 32 slots on the
  same file): batch-1 TPOT p50 (``latency``), mixed output tokens/s (``throughput``: 32 requests at once)
  and each engine's peak RSS during the mixed run, and the two engines' greedy agreement;
* ``mechserve bench perplexity --model FILE --mode fast --engine mechserve,llama-cpp`` (the shipped text,
  256-token chunks, beside ``llama-perplexity`` on the file, and mechserve's ids against ``llama-tokenize``'s);

then prints the markdown table and writes it with every JSON to ``--out`` (``OUT/KIND/results.json``,
``OUT/KIND/perplexity.json``, ``OUT/table.md``).  The machine's load average at start and end is printed:
run it on an idle machine.  ``--quick`` runs the small workloads and the text's first 4,000 characters (a
check that everything runs, not figures to report).

``python docs/scripts/gguf_files_table.py [--kinds q4_k_m,q8_0] [--out bench-results/gguf] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

KINDS = "q4_k_m,q5_k_m,q6_k,q8_0,q4_1"


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _find(runs: list[dict[str, Any]], engine: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["engine"] == engine and r.get("variant", "default") == "default"), None)


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.0f}"


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return "—" if not a or not b else f"{a / b:.{digits}f}x"


def row(kind: str, gguf: Path, bench: dict[str, Any], ppl: dict[str, Any]) -> str:
    """One table row of a file's ``results.json`` and ``perplexity.json``."""
    lat = bench["workloads"]["latency"]["runs"]
    mix = bench["workloads"]["throughput"]
    ours_lat, theirs_lat = _find(lat, "mechserve"), _find(lat, "llama-cpp")
    ours_mix, theirs_mix = _find(mix["runs"], "mechserve"), _find(mix["runs"], "llama-cpp")

    def metric(r: dict[str, Any] | None, key: str) -> float | None:
        return None if r is None else r["metrics"].get(key)

    tpot = (metric(ours_lat, "p50_tpot_ms"), metric(theirs_lat, "p50_tpot_ms"))
    tput = (metric(ours_mix, "output_throughput"), metric(theirs_mix, "output_throughput"))
    rss = (
        None if ours_mix is None else ours_mix["peak_rss_bytes"],
        None if theirs_mix is None else theirs_mix["peak_rss_bytes"],
    )
    p_ours = next((r for r in ppl["runs"] if r["engine"] == "mechserve"), None)
    p_theirs = next((r for r in ppl["runs"] if r["engine"] == "llama-cpp"), None)
    agree = next((v for k, v in mix.get("comparisons", {}).items() if "vs llama-cpp" in k and "agreement" in k), None)
    tok = ppl.get("tokenizer", {})

    def fmt(v: float | None, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    return (
        " | ".join(
            [
                f"| {gguf.name}",
                f"{fmt(tpot[0], '.1f')} / {fmt(tpot[1], '.1f')} ({_ratio(tpot[0], tpot[1])})",
                f"{fmt(tput[0], '.1f')} / {fmt(tput[1], '.1f')} ({_ratio(tput[0], tput[1])})",
                f"{fmt(p_ours and p_ours['perplexity'], '.3f')} / "
                f"{fmt(p_theirs and p_theirs['perplexity'], '.3f')} ± {fmt(p_theirs and p_theirs['error'], '.3f')}",
                f"{_mib(rss[0])} / {_mib(rss[1])} ({_ratio(rss[0], rss[1])})",
                "—" if agree is None else f"{agree['identical_requests']:.2f}",
                "—"
                if "identical" not in tok
                else ("yes" if tok["identical"] else f"no (first at {tok['first_difference']})"),
            ]
        )
        + " |"
    )


HEADER = (
    "| file | TPOT p50 ms, batch 1: mechserve / llama.cpp | mixed out tok/s: mechserve / llama.cpp "
    "| perplexity: mechserve / llama.cpp ± its error | peak RSS MiB, mixed: mechserve / llama-server "
    "| greedy: identical share (mixed) | ids = llama-tokenize |\n|---|---|---|---|---|---|---|"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=KINDS, help=f"comma-separated GGUF kinds (default {KINDS})")
    parser.add_argument("--out", type=Path, default=Path("bench-results/gguf"))
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that it runs")
    parser.add_argument("--threads", type=int, default=None, help="threads for both engines (default all)")
    args = parser.parse_args()

    from mechserve.bench import llama_cpp

    print(f"load average at start: {os.getloadavg()}", flush=True)
    py = [sys.executable, "-m", "mechserve", "bench"]
    text = Path(__file__).resolve().parents[2] / "mechserve" / "bench" / "data" / "declaration-of-independence.txt"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        short = args.out / "text-4000.txt"
        short.write_text(text.read_text("utf-8")[:4000], "utf-8")
        text = short
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    rows = []
    for kind in args.kinds.split(","):
        gguf = llama_cpp.ensure_gguf(kind)
        out = args.out / kind
        run = [*py, "run", "--model", str(gguf), "--mode", "fast", "--engine", "mechserve,llama-cpp"]
        run += ["--workload", "latency,throughput", "--no-roofline", "--no-plots", "--out", str(out), *threads]
        _run(run + (["--quick"] if args.quick else []))
        ppl = [*py, "perplexity", "--model", str(gguf), "--mode", "fast", "--engine", "mechserve,llama-cpp"]
        _run([*ppl, "--text", str(text), "--out", str(out)])
        bench = json.loads((out / "results.json").read_text())
        perplexity = json.loads((out / "perplexity.json").read_text())
        rows.append(row(kind, gguf, bench, perplexity))
    table = HEADER + "\n" + "\n".join(rows) + "\n"
    (args.out / "table.md").write_text(table)
    print(table)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
