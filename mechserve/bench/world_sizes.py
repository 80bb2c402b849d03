"""Tensor-parallel benchmark: output tokens/s of the same greedy run at several world sizes.

``python -m mechserve.bench.world_sizes`` (or ``mechserve bench tp``; ``--help`` for the knobs)
builds one ``LLM`` per world size (``--world-sizes 1 2``), runs the same prompts through it at
batch 1 (one prompt per call) and at batch N (all prompts in one call), and reports per world size
and batch: ``wall_s`` (the generate calls only), ``output_tokens``, ``tok_s``, ``start_s`` (building
the engine: spawning the ranks and loading their shards) and ``identical`` (the ids equal world
size 1's; greedy tensor parallelism changes only the order of float sums, so they should be).
World sizes run one after the other, each with ``--repeats`` timed rounds (the best is kept).

On a CPU-only machine with few cores the ranks share the cores the single process had, and every
layer adds two all-reduces through gloo, so expect world size 2 to be *slower* here: the point of
the number is the cost of the distributed path, not a speed-up (see docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from mechserve.cli.parser import Bounded

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what is it known for?",
    "Describe how a bicycle works to a child.",
    "Give a one-paragraph summary of the water cycle.",
    "What are prime numbers? Give examples.",
    "Suggest a name for a friendly robot and explain it.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2", help="'smollm2' (default) or a local Hugging Face directory")
    add(
        "--world-sizes",
        type=Bounded(int, ge=1),
        nargs="+",
        default=[1, 2],
        metavar="N",
        help="world sizes to compare (default 1 2)",
    )
    add(
        "--prompts",
        type=Bounded(int, ge=1, le=len(PROMPTS)),
        default=4,
        metavar="N",
        help=f"prompts per batch (at most {len(PROMPTS)}; default 4)",
    )
    add("--max-tokens", type=Bounded(int, ge=1), default=64, metavar="N", help="new tokens per prompt (default 64)")
    add(
        "--repeats",
        type=Bounded(int, ge=1),
        default=2,
        metavar="N",
        help="timed rounds per world size, best kept (default 2)",
    )
    add("--num-pages", type=Bounded(int, ge=1), default=256, metavar="N", help="KV pages of 16 positions (default 256)")
    add(
        "--threads",
        type=Bounded(int, ge=1),
        default=None,
        metavar="N",
        help="torch intra-op threads of the whole run (default: one per CPU); each rank gets N // world_size",
    )
    add("--json", action="store_true", help="print the report as one JSON object")


def _timed(llm: Any, prompts: list[str], params: Any, batch: int) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    ids: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        ids += [list(o.outputs[0].token_ids) for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False)]
    return time.perf_counter() - began, ids


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The report: one entry per (world size, batch)."""
    import torch

    from mechserve.entrypoints.llm import LLM, SamplingParams

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = PROMPTS[: args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    reference: dict[int, list[list[int]]] = {}
    for world_size in args.world_sizes:
        began = time.perf_counter()
        with LLM(args.model, world_size=world_size, num_pages=args.num_pages) as llm:
            start_s = time.perf_counter() - began
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
            for batch in (1, len(prompts)):
                best, ids = min(_timed(llm, prompts, params, batch) for _ in range(args.repeats))
                tokens = sum(len(x) for x in ids)
                reference.setdefault(batch, ids)
                rows.append(
                    {
                        "world_size": world_size,
                        "batch": batch,
                        "wall_s": round(best, 3),
                        "output_tokens": tokens,
                        "tok_s": round(tokens / best, 2),
                        "start_s": round(start_s, 2),
                        "identical": ids == reference[batch],
                    }
                )
    return {
        "model": args.model,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "results": rows,
    }


def run(args: argparse.Namespace) -> int:
    report = measure(args)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"model {report['model']}, {report['prompts']} prompts x {report['max_tokens']} tokens, greedy, "
        f"{report['threads']} thread(s) in all"
    )
    print(f"{'world':>5} {'batch':>5} {'wall_s':>8} {'tokens':>7} {'tok/s':>8} {'start_s':>8} identical")
    for r in report["results"]:
        print(
            f"{r['world_size']:>5} {r['batch']:>5} {r['wall_s']:>8} {r['output_tokens']:>7} {r['tok_s']:>8} "
            f"{r['start_s']:>8} {r['identical']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mechserve.bench.world_sizes", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
