"""What suffix decoding's proposals cost next to the decode step they feed (issue 27: the proposer's tax).

    PYTHONPATH=$PWD python docs/scripts/suffix_cost.py [--mode fast] [--sets chat agent code-edit] [--prompts 2]
                                                       [--max-tokens 96] [--replays 5] [--profile]
                                                       [--baseline GIT_REF]

Runs the spec-decode workloads' sessions at batch 1 through ``LLM`` with ``--spec-method suffix`` (adaptive, 4
guesses), with timers around the executor's step (``TorchExecutor.execute``) and around the proposer's calls
(``propose``, the governor's ``available``, ``release``).  Every call is also recorded, and replayed
``--replays`` times through a fresh ``SuffixProposer`` with no model: the same work without the step's noise
(the median replay is reported); ``--baseline REF`` replays them through ``REF``'s ``SuffixProposer`` too
(its ``proposers_suffix.py`` from git), interleaved with the current one.  ``--profile`` prints cProfile's top functions of one replay.  Reported:
milliseconds per decode step (median and mean) of the step, of the proposer in the step and of the
proposer in the replay, the proposer's share of the median step, and ``amortized_share``: every proposer
second (the prefill steps', which build each request's tree over its prompt, included) over the decode
steps' seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mechserve.api.config import SpeculativeConfig, dtype_name
from mechserve.api.params import SamplingParams
from mechserve.bench.runners import MODES
from mechserve.bench.spec_decode import Tally, run_sessions
from mechserve.bench.spec_workloads import WORKLOADS, workloads
from mechserve.engine.executors import configure_threads
from mechserve.entrypoints.llm import LLM
from mechserve.executor.proposers import Window
from mechserve.executor.proposers_suffix import SuffixProposer
from mechserve.executor.sampling import Row
from mechserve.model.loader import load_model


def timed(sink: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - started)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="fast")
    parser.add_argument("--sets", nargs="+", choices=WORKLOADS, default=["chat", "agent", "code-edit"])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--baseline", default=None, help="a git ref whose SuffixProposer is replayed beside")
    args = parser.parse_args()

    configure_threads()
    dtype, quantization = MODES[args.mode]
    loaded = load_model("smollm2", dtype=dtype, quantization=quantization)
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
    size = {"dtype": dtype_name(loaded.model.dtype), "quantization": getattr(loaded.model, "quantization", None)}
    llm = LLM(loaded, speculative_config=spec, num_pages=512, max_step_tokens=2048, **size)
    executor = llm.core.executor
    proposer = executor.proposer
    assert isinstance(proposer, SuffixProposer)
    calls: list[tuple[str, Any]] = []  # what the proposer was asked, for the replay
    step_s: list[float] = []
    decode: list[bool] = []  # per step: whether it had a decode window
    spent: list[float] = []  # per step: the proposer's seconds in it (available before it, propose in it)
    pending = [0.0]

    real_propose, real_available, real_release = proposer.propose, proposer.available, proposer.release

    def propose(windows: list[Window]) -> Any:
        calls.append(("propose", [(w.request, list(w.history), w.slots) for w in windows]))
        started = time.perf_counter()
        try:
            return real_propose(windows)
        finally:
            pending[0] += time.perf_counter() - started

    def available(request: Any, history: Any, cap: int) -> int:
        calls.append(("available", (request, list(history), cap)))
        started = time.perf_counter()
        try:
            return real_available(request, history, cap)
        finally:
            pending[0] += time.perf_counter() - started

    def release(request: Any, output_ids: Any) -> None:
        calls.append(("release", (request, list(output_ids))))
        real_release(request, output_ids)

    real_execute = executor.execute

    def execute(plan: Any) -> Any:
        started = time.perf_counter()
        try:
            return real_execute(plan)
        finally:
            step_s.append(time.perf_counter() - started)
            decode.append(any(item.decode for item in plan))
            spent.append(pending[0])
            pending[0] = 0.0

    proposer.propose, proposer.available, proposer.release = propose, available, release  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    calls.clear()
    executor.execute = execute  # type: ignore[method-assign]
    every = workloads()
    tally = Tally()
    for name in args.sets:
        for session in every[name][: args.prompts]:
            run_sessions(llm, [session], params, tally)
    executor.execute = real_execute  # type: ignore[method-assign]

    steps = [s for s, d in zip(step_s, decode) if d]
    in_step = [p for p, d in zip(spent, decode) if d]

    def replay(cls: Any = SuffixProposer) -> float:
        fresh = cls(
            proposer.max_tree_depth, proposer.max_cached_requests, proposer.max_spec_factor, proposer.min_token_prob
        )
        started = time.perf_counter()
        for kind, what in calls:
            if kind == "propose":
                fresh.propose([Window(None, h, slots, Row(r.params, 0, request=r)) for r, h, slots in what])  # type: ignore[arg-type]
            elif kind == "available":
                fresh.available(*what)
            else:
                fresh.release(*what)
        return time.perf_counter() - started

    baseline: Any = None
    if args.baseline:
        source = subprocess.run(
            ["git", "show", f"{args.baseline}:mechserve/executor/proposers_suffix.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        path = Path(tempfile.mkdtemp()) / "baseline_suffix.py"
        path.write_text(source)
        spec_ = importlib.util.spec_from_file_location("baseline_suffix", path)
        assert spec_ is not None and spec_.loader is not None
        module = importlib.util.module_from_spec(spec_)
        sys.modules["baseline_suffix"] = module
        spec_.loader.exec_module(module)
        baseline = module.SuffixProposer
    replays, before = [], []
    for _ in range(args.replays):
        replays.append(replay())
        if baseline is not None:
            before.append(replay(baseline))
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(replay)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    per_step = statistics.median(replays) / len(steps)
    report = {
        "mode": args.mode,
        "decode_steps": len(steps),
        "output_tokens": tally.output_tokens,
        "step_ms": {"median": statistics.median(steps) * 1e3, "mean": statistics.mean(steps) * 1e3},
        "proposer_in_step_ms": {"median": statistics.median(in_step) * 1e3, "mean": statistics.mean(in_step) * 1e3},
        "proposer_replay_ms_per_step": per_step * 1e3,
        "share_of_median_step": statistics.median(in_step) / statistics.median(steps),
        # every proposer call (prefill steps' tree building included) over the decode steps' time
        "amortized_share": sum(spent) / sum(steps),
        "replay_share_of_median_step": per_step / statistics.median(steps),
    }
    if before:
        report["baseline_replay_ms_per_step"] = statistics.median(before) / len(steps) * 1e3
        report["baseline_over_current"] = statistics.median(before) / statistics.median(replays)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}, indent=2))


if __name__ == "__main__":
    main()
