"""Forced runs (m14) side by side: greedy decoding with and without a scripted forcer, in one process.

``python -m mechserve.bench.forced_runs [--model smollm2] [--new 48] [--threads 1]`` runs 1 and 8
chat prompts asking for JSON greedily to ``--new`` tokens, then again with a ``ScriptedForcer`` per
request that forces, after every 8th output id, the next 4 ids of the plain run (half the output:
a stand-in for a schema's keys and punctuation until the grammar matcher is the source), and prints
for each batch: ids identical, forced ids, target forwards, tokens per forward, wall and CPU time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from mechserve.api.params import SamplingParams
from mechserve.executor.forcing import ForcedSource, ScriptedForcer
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.model.loader import load_model
from mechserve.spec import m16_request_draft_lengths as m16

TEXTS = (
    'Give a JSON object with keys "name", "age" and "city" for a person.',
    "List three fruits as a JSON array.",
    "Write a JSON object describing a car.",
    "Return JSON with fields id and title.",
    "Describe a cat in JSON.",
    "A JSON config with host and port.",
    "JSON for a book: title, author, year.",
    "Give a JSON list of colors.",
)


def run(
    loaded: Any, prompts: Sequence[Sequence[int]], new: int, forcers: Sequence[ForcedSource] | None = None
) -> tuple[list[list[int]], Any, float, float]:
    """Greedy ``prompts`` on m14 over one ``TorchExecutor``: (output ids, stats, wall s, CPU s)."""
    ex = TorchExecutor(loaded.model, 256, 16)
    reqs = []
    for i, p in enumerate(prompts):
        ex.add_request(ExecutorRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=new)))
        if forcers:
            ex.set_forcer(f"r{i}", forcers[i])
        reqs.append(m16.Request(f"r{i}", list(p), new))
    eng = m16.Engine(reqs, 512, 16, 256, executors=[ex], eos_token_ids=loaded.eos_token_ids)
    wall, cpu = time.perf_counter(), time.process_time()

    def done(rec: m16.StepRecord) -> None:
        for rid in rec.finished:
            ex.release(rid)

    eng.run(done)
    return [r.output_ids for r in reqs], ex.stats(), time.perf_counter() - wall, time.process_time() - cpu


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tok: Any = loaded.tokenizer
    if tok is None:
        raise SystemExit(f"{args.model} has no tokenizer")
    prompts = [
        list(
            tok(
                tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            ).input_ids
        )
        for t in TEXTS
    ]
    runs = {i: 4 for i in range(0, args.new, 8)}
    for b in (1, 8):
        ids, st0, w0, c0 = run(loaded, prompts[:b], args.new)
        ids1, st1, w1, c1 = run(loaded, prompts[:b], args.new, [ScriptedForcer(o, runs) for o in ids])
        toks = sum(len(o) for o in ids)
        print(
            f"batch {b}: same ids {ids == ids1}; tokens {toks}; forced {st1.forced}; "
            f"forwards {st0.forwards} -> {st1.forwards}; tokens/forward {toks / st0.forwards:.2f} -> "
            f"{toks / st1.forwards:.2f}; wall {w0:.2f}s -> {w1:.2f}s ({w0 / w1:.2f}x); "
            f"cpu {c0:.2f}s -> {c1:.2f}s ({c0 / c1:.2f}x)"
        )


if __name__ == "__main__":
    main()
