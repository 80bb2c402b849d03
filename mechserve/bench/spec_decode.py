"""Speculative decoding benchmark: speculation off, prompt lookup and a draft model, side by side in one run.

``python -m mechserve.bench.spec_decode`` (``--help`` for the knobs) runs two prompt sets through
``LLM`` with greedy sampling:

* ``copy``: tasks whose answer copies its input (repeat or lightly edit a passage, rename a variable,
  edit a JSON object, reformat a list), where prompt lookup should find most of the answer;
* ``novel``: open-ended questions, where it should find little and speculation must not cost much;

each at batch 1 (one prompt at a time) and batch 8 (all prompts in one call), for every
configuration (``off``, ``ngram`` adaptive, ``ngram-fixed``, ``draft`` = the first
``--draft-layers`` layers of the model, fixed ``spec_len``).  Configurations are interleaved (prompt
by prompt at batch 1, round by round at batch 8) so that a noisy machine slows them alike.  Greedy
speculation is exact, so every configuration must produce the same ids (``identical``).

Per (set, batch, configuration) the report has: ``wall_s``, ``output_tokens``, ``tok_s``,
``speedup`` (tok/s over ``off`` in the same run), ``target_forwards``, ``tokens_per_forward``
(output tokens per target forward, prefill steps included), ``tokens_per_decode_step`` (ids a
decode window appended, on average), ``proposed`` / ``accepted`` guesses (``acceptance``: their
ratio) and the trace's ``drafted`` / ``spec_accepted`` (m09's counts: with the adaptive spec_len a
window drafts only what the governor allows).  ``--json`` writes the whole report as one JSON object
on stdout (the per-cell tables go to stderr as each cell finishes).

``--costs`` instead measures what a target step of M rows costs (batch 1 and 8), the numbers
behind ``speculative.Governor``'s cost model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PASSAGE = (
    "The old lighthouse stood at the end of the pier for more than a hundred years. Every evening the keeper "
    "climbed its narrow stairs, lit the lamp and watched the fishing boats come home before the storm."
)
CODE = (
    "def average(values):\n"
    "    total = 0\n"
    "    for v in values:\n"
    "        total = total + v\n"
    "    return total / len(values)\n"
)
COPY_PROMPTS = [
    f"Repeat the following text exactly, word for word.\n\n{PASSAGE}",
    "Fix the spelling mistakes in this text and return the corrected text only.\n\n"
    + PASSAGE.replace("lighthouse", "lighthuose").replace("evening", "evenning").replace("storm", "strom"),
    f"Rename the variable `total` to `acc` in this Python function. Return only the code.\n\n{CODE}",
    f"Add a docstring to this Python function. Return the full function.\n\n{CODE}",
    'Change the city to "Lyon" in this JSON object and return the whole object.\n\n'
    '{"name": "Alice Martin", "age": 34, "city": "Paris", "email": "alice.martin@example.com", '
    '"languages": ["French", "English", "Spanish"]}',
    "Rewrite the following text, replacing the word 'keeper' with 'guardian'.\n\n" + PASSAGE,
    "Put each item of this list on its own line, keeping the order: apples, bananas, cherries, dates, "
    "elderberries, figs, grapes, honeydew melons, kiwis, lemons.",
    f"Copy the second sentence of this text.\n\n{PASSAGE}",
]
NOVEL_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue.",
    "Give three tips for staying productive when working from home.",
    "What are the health benefits of regular exercise?",
    "Describe a sunset over the ocean.",
    "How do airplanes stay in the air?",
    "Suggest a name for a new coffee shop and explain your choice.",
    "What should I pack for a weekend hiking trip?",
]
SETS = {"copy": COPY_PROMPTS, "novel": NOVEL_PROMPTS}
CONFIGS = ("off", "ngram", "ngram-fixed", "draft", "draft-adaptive")


@dataclass
class Tally:
    """What one configuration did on one (set, batch) cell."""

    wall_s: float = 0.0
    output_tokens: int = 0
    forwards: int = 0
    windows: int = 0
    emitted: int = 0
    proposed: int = 0
    accepted: int = 0
    drafted: int = 0
    spec_accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def report(self, off: Tally | None) -> dict[str, Any]:
        tok_s = self.output_tokens / self.wall_s if self.wall_s else 0.0
        base = off.output_tokens / off.wall_s if off is not None and off.wall_s else None
        return {
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.output_tokens,
            "tok_s": round(tok_s, 2),
            "speedup": round(tok_s / base, 3) if base else None,
            "target_forwards": self.forwards,
            "tokens_per_forward": round(self.output_tokens / self.forwards, 3) if self.forwards else None,
            "tokens_per_decode_step": round(self.emitted / self.windows, 3) if self.windows else None,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.proposed, 3) if self.proposed else None,
            "drafted": self.drafted,
            "spec_accepted": self.spec_accepted,
            "identical": off is None or self.outputs == off.outputs,
        }


def configurations(args: argparse.Namespace) -> dict[str, Any]:
    """Name -> ``SpeculativeConfig`` (None: off) for ``args.configs``."""
    from mechserve.api.config import SpeculativeConfig

    k = args.spec_len
    every = {
        "off": None,
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=k),
        "ngram-fixed": SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False),
        "draft": SpeculativeConfig(
            method="draft",
            num_speculative_tokens=min(k, 3),
            draft_model=f"{args.model}:layers={args.draft_layers}",
            adaptive=False,
        ),
        "draft-adaptive": SpeculativeConfig(
            method="draft", num_speculative_tokens=min(k, 3), draft_model=f"{args.model}:layers={args.draft_layers}"
        ),
    }
    names = ["off", *[c for c in args.configs if c != "off"]]
    unknown = [c for c in names if c not in every]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {sorted(every)}")
    return {name: every[name] for name in names}


def one_call(llm: Any, prompts: Sequence[str], params: Any, tally: Tally) -> None:
    """Generate ``prompts`` in one call (chat template) and add what it cost and did to ``tally``."""
    stats = llm.core.stats(executor=True).executor
    before = (stats.forwards, stats.windows, stats.emitted, stats.proposed, stats.accepted)
    started = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    tally.wall_s += time.perf_counter() - started
    stats = llm.core.stats(executor=True).executor
    after = (stats.forwards, stats.windows, stats.emitted, stats.proposed, stats.accepted)
    delta = [a - b for a, b in zip(after, before)]
    tally.forwards += delta[0]
    tally.windows += delta[1]
    tally.emitted += delta[2]
    tally.proposed += delta[3]
    tally.accepted += delta[4]
    for o in outs:
        tally.output_tokens += len(o.outputs[0].token_ids)
        tally.outputs.append(list(o.outputs[0].token_ids))
    for rec in llm.trace:
        tally.drafted += sum(rec.drafted.values())
        tally.spec_accepted += sum(rec.accepted.values())


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (set, batch, configuration) cell; return the report."""
    from mechserve.api.params import SamplingParams
    from mechserve.engine.executors import configure_threads
    from mechserve.entrypoints.llm import LLM
    from mechserve.model.loader import load_model

    threads = configure_threads()
    loaded = load_model(args.model)
    configs = configurations(args)
    llms = {
        name: LLM(loaded, speculative_config=cfg, num_pages=args.num_pages, max_step_tokens=args.max_step_tokens)
        for name, cfg in configs.items()
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up: first-call allocations, kernels
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    cells: dict[str, dict[str, Any]] = {}
    for set_name in args.sets:
        prompts = SETS[set_name][: args.prompts]
        for batch in args.batches:
            tallies = {name: Tally() for name in llms}
            if batch == 1:
                for p in prompts:
                    for name, llm in llms.items():
                        one_call(llm, [p], params, tallies[name])
            else:
                for _ in range(args.repeats):
                    for start in range(0, len(prompts), batch):
                        for name, llm in llms.items():
                            one_call(llm, prompts[start : start + batch], params, tallies[name])
            off = tallies["off"]
            cell = {name: t.report(None if name == "off" else off) for name, t in tallies.items()}
            cells[f"{set_name}/batch-{batch}"] = cell
            # with --json the tables still show progress, on stderr
            print(table(f"{set_name}, batch {batch}", cell), file=sys.stderr if args.json else sys.stdout, flush=True)
    return {
        "model": args.model,
        "threads": threads,
        "max_tokens": args.max_tokens,
        "spec_len": args.spec_len,
        "draft_layers": args.draft_layers,
        "prompts_per_set": args.prompts,
        "cells": cells,
    }


def table(title: str, cell: dict[str, dict[str, Any]]) -> str:
    """One cell as a small text table."""
    head = (
        f"{'config':<15}{'tok/s':>8}{'speedup':>9}{'tok/fwd':>9}{'tok/step':>10}{'accept':>8}"
        f"{'proposed':>10}{'forwards':>10}{'same':>6}"
    )
    lines = [f"== {title}", head]
    for name, r in cell.items():

        def fmt(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        lines.append(
            f"{name:<15}{fmt(r['tok_s'], '.1f'):>8}{fmt(r['speedup'], '.2f'):>9}{fmt(r['tokens_per_forward'], '.2f'):>9}"
            f"{fmt(r['tokens_per_decode_step'], '.2f'):>10}{fmt(r['acceptance'], '.2f'):>8}{r['proposed']:>10}"
            f"{r['target_forwards']:>10}{'yes' if r['identical'] else 'NO':>6}"
        )
    return "\n".join(lines)


def costs(args: argparse.Namespace) -> dict[str, Any]:
    """Median time of a target forward of ``batch`` decode windows of M rows each (context ~300),
    relative to one row at batch 1; ``row_cost``/``jump_cost`` fitted as the ``Governor`` uses them."""
    import torch

    from mechserve.engine.executors import configure_threads
    from mechserve.kv.paged import Span, build_attention_batch
    from mechserve.model.loader import load_model

    configure_threads()
    model = load_model(args.model, tokenizer=False).model
    ps, ctx = 16, 300
    shapes = [(b, m) for b in (1, 8) for m in (1, 2, 3, 4, 5, 6, 8)]
    prepared = {}
    for b, m in shapes:
        per = (ctx + m) // ps + 1
        cache = model.new_cache(b * per, ps)
        spans: list[Any] = []
        slots: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        for i in range(b):
            table_ = list(range(i * per, (i + 1) * per))
            spans.append(Span(len(ids), ctx, m, table_))
            for j in range(m):
                slots.append(table_[(ctx + j) // ps] * ps + (ctx + j) % ps)
                ids.append(100 + j)
                pos.append(ctx + j)
        a = model.arch
        batch = build_attention_batch(spans, slots, ps, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows)
        prepared[(b, m)] = (torch.tensor(ids), torch.tensor(pos), cache, batch, torch.arange(len(ids)))
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for _ in range(args.repeats * 4):
        for s in shapes:
            started = time.perf_counter()
            model.forward(*prepared[s]).argmax(-1).tolist()
            times[s].append(time.perf_counter() - started)
    unit = statistics.median(times[(1, 1)])
    rel = {f"batch {b}, {m} row(s) each": round(statistics.median(times[(b, m)]) / unit, 3) for b, m in shapes}
    rows8 = [(8 * m, statistics.median(times[(8, m)]) / unit) for m in (1, 2, 3, 4, 5, 6, 8)]
    slope = statistics.linear_regression([r for r, _ in rows8], [t for _, t in rows8]).slope
    jump = statistics.median(times[(1, 4)]) / unit - 1 - 3 * slope
    return {"unit_ms": round(unit * 1e3, 2), "relative": rel, "row_cost": round(slope, 4), "jump_cost": round(jump, 3)}


def _count(low: int, high: int) -> Any:
    """An argparse ``type=``: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``mechserve bench spec-decode --help``)."""
    add = parser.add_argument
    add("--model", default="smollm2", help="'smollm2' (default), a local model directory or a GGUF file")
    add("--sets", nargs="+", choices=sorted(SETS), default=["copy", "novel"], help="prompt sets (both)")
    add("--batches", nargs="+", type=_count(1, 64), default=[1, 8], help="batch sizes (1 8)")
    add(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=["off", "ngram", "ngram-fixed", "draft"],
        help="off, ngram, ngram-fixed, draft, draft-adaptive (default: all but draft-adaptive)",
    )
    add("--prompts", type=_count(1, len(COPY_PROMPTS)), default=8, help="prompts per set (at most 8)")
    add("--max-tokens", type=_count(1, 4096), default=128, help="new tokens per request (128)")
    add("--spec-len", type=_count(1, 16), default=4, help="guesses per window (4; the draft model uses at most 3)")
    add("--draft-layers", type=_count(1, 1024), default=4, help="layers the draft model keeps (4)")
    add("--repeats", type=_count(1, 100), default=1, help="rounds at batch > 1 (1); --costs: x4 timing rounds")
    add("--num-pages", type=_count(1, 1 << 20), default=512, help="KV pages per engine (512)")
    add("--max-step-tokens", type=_count(1, 1 << 16), default=2048, help="token budget per step (2048)")
    add("--json", action="store_true", help="print only the report, as one JSON object")
    add("--costs", action="store_true", help="measure the cost of a step by rows instead")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or ``--costs``); print the tables or the JSON report; returns 0."""
    report = costs(args) if args.costs else bench(args)
    if args.json or args.costs:
        print(json.dumps(report, indent=None if args.json else 2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mechserve.bench.spec_decode", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
