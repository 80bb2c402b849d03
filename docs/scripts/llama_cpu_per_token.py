"""llama.cpp's CPU time per generated token at one thread, robust to a busy machine.

    python docs/scripts/llama_cpu_per_token.py LLAMA_BENCH GGUF [GGUF ...] [--depth 512]

Wall-clock ``llama-bench`` numbers on a shared 2-core machine measure the other jobs as much as
llama.cpp; the CPU time a single-threaded run spends does not (it still shares caches and memory
bandwidth).  Each GGUF runs ``llama-bench -t 1 -p 0 -d DEPTH -r 1`` with 16 and with 80 generated
tokens; the difference of the children's user+system CPU time over 64 is the cost of one token
at context DEPTH, the load, warm-up and depth prefill cancelling out.  Used for docs/benchmarks.md.
"""

import resource
import subprocess
import sys
from pathlib import Path


def cpu_seconds(cmd: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


args = sys.argv[1:]
depth = "512"
if "--depth" in args:
    i = args.index("--depth")
    depth = args[i + 1]
    del args[i : i + 2]
bench, ggufs = args[0], args[1:]
for gguf in ggufs:
    base = [bench, "-m", gguf, "-t", "1", "-p", "0", "-d", depth, "-r", "1"]
    costs = []
    for _ in range(3):
        costs.append((cpu_seconds([*base, "-n", "80"]) - cpu_seconds([*base, "-n", "16"])) / 64)
    print(
        f"{Path(gguf).name}: CPU ms per token at depth {depth}: {', '.join(f'{c * 1e3:.1f}' for c in costs)}",
        flush=True,
    )
