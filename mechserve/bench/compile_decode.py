"""``mechserve bench compile``: decode TPOT with and without ``torch.compile``, side by side in one run.

::

    mechserve bench compile [--model smollm2] [--batch 1,8] [--prompt-len 64] [--output-len 32]
                            [--repeats 2] [--device cpu] [--json]

For each batch size, ``batch`` prompts of ``prompt_len`` ordinary ids (seeded) are generated greedily
(``output_len`` tokens each, EOS ignored) by two engines over the same loaded model: ``eager``
(``EngineConfig.compile`` off) and ``compiled`` (on).  Each engine first runs the whole batch once
as a warm-up; the compiled engine's warm-up includes compiling (``warmup_s``: its wall time, beside
the eager warm-up's), then the timed runs alternate eager / compiled ``repeats`` times, so that a
noisy machine slows both alike.  TPOT is each request's (last token time - first token time) /
(tokens - 1), the median over the batch, then the median over the repeats; ``ratio`` is eager TPOT
over compiled TPOT (above 1: compile pays).  ``identical`` says whether the compiled greedy ids equal
the eager ones.  The machine's load average is recorded before and after (the figures are only
comparable within one run).  The top level imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from mechserve.cli.parser import Bounded


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(not 1 <= v <= 256 for v in values):
        raise argparse.ArgumentTypeError(f"each batch size must be in [1, 256], got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded, default), a local Hugging Face model directory or a GGUF file",
    )
    add("--batch", type=_int_list, default=[1, 8], help="comma-separated batch sizes (default 1,8)")
    add("--prompt-len", type=Bounded(int, ge=1, le=4096), default=64, help="prompt tokens per request (default 64)")
    add("--output-len", type=Bounded(int, ge=1, le=4096), default=32, help="generated tokens per request (default 32)")
    add("--repeats", type=Bounded(int, ge=1, le=4096), default=2, help="timed runs per engine, alternated (default 2)")
    add("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    add("--seed", type=int, default=0, help="prompt seed (default 0)")
    add("--json", action="store_true", help="print the whole report as one JSON object on stdout")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _tpot(outputs: list[Any]) -> float:
    """Median over requests of (last - first token time) / (tokens - 1), in seconds."""
    per = []
    for o in outputs:
        times = o.metrics.token_times[0]
        if len(times) > 1:
            per.append((times[-1] - times[0]) / (len(times) - 1))
    return statistics.median(per)


def _generate(core: Any, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], float, float]:
    """All ``prompts`` at once through ``core``: their ids, the wall time and the median TPOT."""
    from mechserve.api.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [core.add_request(p, params) for p in prompts]
    done = {o.request_id: o for o in core.run_until_idle()}
    wall = time.perf_counter() - start
    outs = [done[i] for i in ids]
    return [list(o.outputs[0].token_ids) for o in outs], wall, _tpot(outs)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison ``args`` asks for; return the report (see the module docstring)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mechserve.api.config import EngineConfig
    from mechserve.engine.core import EngineCore
    from mechserve.engine.executors import configure_threads
    from mechserve.model.loader import load_model

    threads = configure_threads()
    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, bool, list))},
        "torch_threads": threads,
        "load_average_before": _loadavg(),
        "cells": [],
    }
    loaded = load_model(args.model, tokenizer=False)  # ids in, ids out: a directory without a tokenizer will do
    vocab = loaded.model.arch.vocab_size
    special = set(loaded.eos_token_ids)
    rng = random.Random(args.seed)
    for batch in args.batch:
        prompts = [
            [t for t in (rng.randrange(200, vocab) for _ in range(args.prompt_len)) if t not in special]
            for _ in range(batch)
        ]
        longest = args.prompt_len + args.output_len
        cores = {}
        warm = {}
        for variant in ("eager", "compiled"):
            config = EngineConfig(
                num_pages=batch * -(-longest // 16) + 8,
                max_running=None,
                prefix_caching=False,  # every timed run computes the same work
                seed=0,
                device=args.device,
                compile=variant == "compiled",
            )
            cores[variant] = EngineCore(loaded, config)
            _, warm[variant], _ = _generate(cores[variant], prompts, args.output_len)
        tpots: dict[str, list[float]] = {"eager": [], "compiled": []}
        ids: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for variant in ("eager", "compiled"):
                ids[variant], _, tpot = _generate(cores[variant], prompts, args.output_len)
                tpots[variant].append(tpot)
        eager, compiled = statistics.median(tpots["eager"]), statistics.median(tpots["compiled"])
        cell = {
            "batch": batch,
            "tpot_ms": {"eager": eager * 1e3, "compiled": compiled * 1e3},
            "tpot_ms_runs": {v: [round(t * 1e3, 2) for t in ts] for v, ts in tpots.items()},
            "ratio": eager / compiled,
            "warmup_s": {v: round(w, 2) for v, w in warm.items()},
            "identical": ids["eager"] == ids["compiled"],
        }
        report["cells"].append(cell)
        print(
            f"batch {batch}: TPOT eager {eager * 1e3:.1f} ms, compiled {compiled * 1e3:.1f} ms "
            f"(eager/compiled {cell['ratio']:.2f}x); warm-up eager {warm['eager']:.1f} s, compiled "
            f"{warm['compiled']:.1f} s (compiling); ids identical: {cell['identical']}",
            file=sys.stderr,
        )
        for core in cores.values():
            core.close()
    report["load_average_after"] = _loadavg()
    return report


def run(args: argparse.Namespace) -> int:
    report = benchmark(args)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mechserve.bench.compile_decode", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
