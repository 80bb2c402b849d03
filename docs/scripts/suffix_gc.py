"""What Python's cyclic garbage collector costs suffix decoding's trees (issue 27), this checkout's
``SuffixTree`` beside ``--baseline REF``'s (its ``proposers_suffix.py`` from git), in one process.

    PYTHONPATH=$PWD python docs/scripts/suffix_gc.py [--baseline main] [--mode fast] [--repeats 8]
                                                     [--outputs 400] [--no-model | --replay]

With the model loaded (``--no-model``: without it; the heap the collector walks is then almost only the
trees) and the collector on, as in a server:

    prompts   milliseconds to add the 8 ``summarise`` prompts (through the chat template) to fresh trees of
              depth 24, the last 16 trees kept alive (``SuffixProposer.FINISHED_KEPT``), repeats interleaved
    off       the same with the collector off (the tree work alone), and for text that repeats itself (each
              prompt's first 60 ids over to its length: mostly nodes that exist, where a prompt makes new ones)
    collect   milliseconds of one full collection (``gc.collect()``) with no tree, then with a global tree over
              ``--outputs`` outputs of 128 ids (Pareto-distributed ids below 8000, seeded); each tree after a
              measurement without one

``--replay``: one ``summarise`` batch-8 run's proposer calls replayed through each ``SuffixProposer`` (``replay``).

Prints one line per measurement: the CPU time of the measuring thread (``time.thread_time``: the work itself,
what a loaded machine's other processes take does not count) and the wall-clock time beside it.
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mechserve.bench.spec_workloads import workloads
from mechserve.executor import proposers_suffix


def baseline_module(ref: str) -> Any:
    """``ref``'s ``mechserve/executor/proposers_suffix.py``, imported as ``baseline_suffix``."""
    source = subprocess.run(
        ["git", "show", f"{ref}:mechserve/executor/proposers_suffix.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_suffix.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_suffix", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_suffix"] = module
    spec.loader.exec_module(module)
    return module


def prompt_ids(args: argparse.Namespace) -> tuple[list[list[int]], Any]:
    """The summarise prompts' ids through the chat template, and the loaded model (kept: it is the heap)."""
    from mechserve.bench.runners import MODES
    from mechserve.model.loader import load_model

    dtype, quantization = MODES[args.mode]
    loaded = load_model("smollm2", dtype=dtype, quantization=quantization)
    ids = []
    for session in workloads()["summarise"][:8]:
        chat = [{"role": "user", "content": session.turns[0]}]
        got = loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids.append(list(got["input_ids"] if hasattr(got, "keys") else got))
    return ids, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="main", help="the git ref whose SuffixTree is measured beside")
    parser.add_argument("--mode", default="fast")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--outputs", type=int, default=400)
    parser.add_argument("--no-model", action="store_true", help="random prompt ids, no model loaded")
    parser.add_argument("--replay", action="store_true", help="also replay a summarise batch-8 run's calls")
    args = parser.parse_args()
    if args.replay and args.no_model:
        parser.error("--replay needs the model: drop --no-model")

    module = baseline_module(args.baseline)
    trees = {"baseline": module.SuffixTree, "current": proposers_suffix.SuffixTree}
    rng = random.Random(0)
    if args.no_model:
        prompts, loaded = [[int(rng.paretovariate(1.0)) % 8000 for _ in range(250)] for _ in range(8)], None
    else:
        prompts, loaded = prompt_ids(args)
    print(f"prompt ids {[len(p) for p in prompts]}, objects the collector tracks {len(gc.get_objects())}")

    kept: dict[str, collections.deque[Any]] = {name: collections.deque(maxlen=16) for name in trees}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for rep in range(args.repeats):
        for name in list(trees) if rep % 2 == 0 else list(trees)[::-1]:
            started, cpu = time.perf_counter(), time.thread_time()
            for ids in prompts:
                tree = trees[name](24)
                tree.add(ids)
                kept[name].append(tree)
            times[name].append(((time.thread_time() - cpu) * 1e3, (time.perf_counter() - started) * 1e3))
    for name, got in times.items():
        each = " ".join(f"{c:.0f}/{w:.0f}" for c, w in got)
        cpu, wall = statistics.median(c for c, _ in got), statistics.median(w for _, w in got)
        print(f"prompts {name:8}: add 8 prompts, CPU/wall ms by repeat {each}; median {cpu:.0f}/{wall:.0f}")
    for held in kept.values():
        held.clear()

    gc.disable()  # the tree work alone: the prompts, and text that repeats itself (each prompt's first 60 ids over)
    repeats = [(ids[:60] * (len(ids) // 60 + 1))[: len(ids)] for ids in prompts]
    for label, seqs in (("prompts", prompts), ("repeats", repeats)):
        alone: dict[str, float] = {name: float("inf") for name in trees}
        for rep in range(args.repeats):
            for name in list(trees) if rep % 2 == 0 else list(trees)[::-1]:
                cpu = time.thread_time()
                for ids in seqs:
                    trees[name](24).add(ids)
                alone[name] = min(alone[name], (time.thread_time() - cpu) * 1e3)
        each = ", ".join(f"{name} {ms:.1f}" for name, ms in alone.items())
        print(f"collector off, {label}: add 8, CPU ms (least of {args.repeats}) {each}")
    gc.enable()

    def collect_ms() -> str:
        spent = []
        for _ in range(3):
            started, cpu = time.perf_counter(), time.thread_time()
            gc.collect()
            spent.append(f"{(time.thread_time() - cpu) * 1e3:.0f}/{(time.perf_counter() - started) * 1e3:.0f}")
        return " ".join(spent)

    outputs = [[int(rng.paretovariate(1.0)) % 8000 for _ in range(128)] for _ in range(args.outputs)]
    for name, cls in trees.items():
        print(f"collect no tree : gc.collect() CPU/wall ms {collect_ms()}")
        tree = cls(24)
        for ids in outputs:
            tree.add(ids)
        print(
            f"collect {name:8}: global tree over {args.outputs} outputs, {tree.nodes} nodes: CPU/wall ms {collect_ms()}"
        )
        del tree
        gc.collect()
    if args.replay:
        replay(args, loaded, {"baseline": module.SuffixProposer, "current": proposers_suffix.SuffixProposer})
    del loaded


def replay(args: argparse.Namespace, loaded: Any, proposers: dict[str, Any]) -> None:
    """Record the proposer calls of one ``summarise`` batch-8 run (suffix, adaptive, 4 guesses, 128 new tokens),
    then replay them through each proposer class in turn, ``--repeats`` times, every replay's proposer kept
    alive (a server's heap grows as they do): CPU and wall ms per call kind."""
    from mechserve.api.config import SpeculativeConfig, dtype_name
    from mechserve.api.params import SamplingParams
    from mechserve.bench.spec_decode import Tally, run_sessions
    from mechserve.engine.executors import configure_threads
    from mechserve.entrypoints.llm import LLM
    from mechserve.executor.proposers import Window
    from mechserve.executor.sampling import Row

    configure_threads()
    size = {"dtype": dtype_name(loaded.model.dtype), "quantization": getattr(loaded.model, "quantization", None)}
    llm = LLM(loaded, speculative_config=SpeculativeConfig(method="suffix", num_speculative_tokens=4), **size)
    proposer = llm.core.executor.proposer
    calls: list[tuple[str, Any]] = []
    real = proposer.propose, proposer.available, proposer.release

    def propose(windows: list[Window]) -> Any:
        calls.append(("propose", [(w.request, list(w.history), w.slots) for w in windows]))
        return real[0](windows)

    def available(request: Any, history: Any, cap: int) -> int:
        calls.append(("available", (request, list(history), cap)))
        return real[1](request, history, cap)

    def release(request: Any, output_ids: Any) -> None:
        calls.append(("release", (request, list(output_ids))))
        real[2](request, output_ids)

    proposer.propose, proposer.available, proposer.release = propose, available, release
    params = SamplingParams(temperature=0.0, max_tokens=128)
    run_sessions(llm, workloads()["summarise"][:8], params, Tally())
    print(f"replay: {dict(collections.Counter(kind for kind, _ in calls))} calls recorded")
    options = (proposer.max_tree_depth, proposer.max_cached_requests, proposer.max_spec_factor)
    alive = []
    for rep in range(args.repeats):
        for name in list(proposers) if rep % 2 == 0 else list(proposers)[::-1]:
            fresh = proposers[name](*options, proposer.min_token_prob)
            alive.append(fresh)
            cpu: collections.Counter[str] = collections.Counter()
            wall: collections.Counter[str] = collections.Counter()
            for kind, what in calls:
                started, used = time.perf_counter(), time.thread_time()
                if kind == "propose":
                    fresh.propose([Window(None, h, slots, Row(r.params, 0, request=r)) for r, h, slots in what])
                elif kind == "available":
                    fresh.available(*what)
                else:
                    fresh.release(*what)
                cpu[kind] += time.thread_time() - used
                wall[kind] += time.perf_counter() - started
            each = " ".join(f"{k}={cpu[k] * 1e3:.0f}/{wall[k] * 1e3:.0f}" for k in sorted(cpu))
            total = f"{sum(cpu.values()) * 1e3:.0f}/{sum(wall.values()) * 1e3:.0f}"
            print(f"replay {name:8} {rep}: CPU/wall ms total {total}, {each}")


if __name__ == "__main__":
    main()
