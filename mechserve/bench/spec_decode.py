"""Speculative decoding benchmark: speculation off and every proposer, side by side in one run.

``mechserve bench spec-decode`` (``python -m mechserve.bench.spec_decode``; ``--help`` for the knobs)
runs the shipped workloads of ``mechserve.bench.spec_workloads`` through ``LLM`` with greedy sampling:
multi-turn chat (4 turns), an agent loop calling one JSON tool, code edits, summaries of a shipped text,
novel writing, and the copy-heavy set.  A session's turns are sent one after another, each with the
earlier answers in its conversation.  Each workload runs at batch 1 (one session at a time) and batch 8
(8 sessions together, turn by turn), for every configuration (``off``; ``ngram`` and ``suffix``
adaptive; ``ngram-fixed`` and ``suffix-fixed``; ``draft`` = the first ``--draft-layers`` layers of the
model, fixed ``spec_len``; ``draft-adaptive``).  Configurations are interleaved (session by session at
batch 1, round by round at batch 8) so that a noisy machine slows them alike.  Greedy speculation is
exact, so every configuration must produce the same ids (``identical``).  Every repeat (and each batch
size) sends the same prompts, so before each one suffix decoding's proposer forgets the requests that left
(``SuffixProposer.forget_finished``): its global tree would otherwise draft each answer from the same
prompt's earlier answer, which measures memorisation, not speculation on new text.

Per (workload, batch, configuration) the report has: ``wall_s``, ``output_tokens``, ``tok_s``,
``speedup`` (tok/s over ``off`` in the same run), ``target_forwards``, ``tokens_per_forward``
(output tokens per target forward, prefill steps included), ``tokens_per_decode_step`` (the kept
tokens per step: ids a decode window appended, on average), ``proposed`` / ``accepted`` guesses
(``acceptance``: their ratio), ``acceptance_by_position`` (of the windows that drafted a guess at
position j, the share that accepted it: m09's ``drafted``/``accepted`` per window) and the trace's
``drafted`` / ``spec_accepted``.  ``--json`` writes the whole report as one JSON object on stdout (the
per-cell tables go to stderr as each cell finishes).

``--mode`` runs the model as ``bench run``'s modes do (exact: float32; fast: bfloat16; q4_1, q8_0: GGUF
blocks); ``--llama-cpp`` runs llama-server beside every cell, on the same prompt ids and the same number of
new ids per request, in each of ``--llama-cpp-modes`` (``mechserve.bench.spec_llama_cpp``), and reports its
tok/s per GGUF and the best proposer's tok/s over llama.cpp's best (``llama_cpp`` in the JSON report).

``--costs`` instead measures what a target step of M rows costs (batch 1 and 8), relative to one row: the
shape of ``executor.costs.StaticCosts`` (the adaptive engine measures its own steps and draft rounds, in its
mode, when it starts and as it runs: ``executor.costs``).
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

from mechserve.bench.spec_workloads import WORKLOADS, Session, workloads
from mechserve.cli.parser import Bounded

CONFIGS = (
    "off", "ngram", "ngram-fixed", "suffix", "suffix-fixed", "draft", "draft-adaptive", "eagle", "eagle-fr",
    "eagle-adaptive",
)  # fmt: skip
DEFAULT_CONFIGS = ("off", "ngram", "suffix", "draft")


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
    calls: list[list[tuple[list[int], list[int]]]] = field(default_factory=list)  # per call: (prompt ids, output ids)
    drafted_at: list[int] = field(default_factory=list)  # [j]: windows that drafted a guess at position j + 1
    accepted_at: list[int] = field(default_factory=list)  # [j]: windows that accepted it
    repeats: list[tuple[int, float]] = field(default_factory=list)  # per repeat: (output tokens, seconds)

    def report(self, off: Tally | None) -> dict[str, Any]:
        tok_s = self.output_tokens / self.wall_s if self.wall_s else 0.0
        base = off.output_tokens / off.wall_s if off is not None and off.wall_s else None
        return {
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.output_tokens,
            "tok_s": round(tok_s, 2),
            "speedup": round(tok_s / base, 3) if base else None,
            "speedup_by_repeat": (
                [
                    round((n / w) / (n0 / w0), 3)
                    for (n, w), (n0, w0) in zip(self.repeats, off.repeats)
                    if w > 0 and w0 > 0 and n0 > 0
                ]
                if off is not None
                else []
            ),
            "target_forwards": self.forwards,
            "tokens_per_forward": round(self.output_tokens / self.forwards, 3) if self.forwards else None,
            "tokens_per_decode_step": round(self.emitted / self.windows, 3) if self.windows else None,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.proposed, 3) if self.proposed else None,
            "acceptance_by_position": [round(a / d, 3) for a, d in zip(self.accepted_at, self.drafted_at) if d],
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
        "suffix": SpeculativeConfig(method="suffix", num_speculative_tokens=k),
        "suffix-fixed": SpeculativeConfig(method="suffix", num_speculative_tokens=k, adaptive=False),
        "draft": SpeculativeConfig(
            method="draft",
            num_speculative_tokens=min(k, 3),
            draft_model=f"{args.model}:layers={args.draft_layers}",
            adaptive=False,
        ),
        "draft-adaptive": SpeculativeConfig(
            method="draft", num_speculative_tokens=min(k, 3), draft_model=f"{args.model}:layers={args.draft_layers}"
        ),
        # the EAGLE head `mechserve train-draft` wrote for the model (whole vocabulary; FR-Spec's top 8192 ids)
        "eagle": SpeculativeConfig(method="eagle", num_speculative_tokens=k, adaptive=False),
        "eagle-fr": SpeculativeConfig(method="eagle", num_speculative_tokens=k, adaptive=False, eagle_draft_vocab=8192),
        "eagle-adaptive": SpeculativeConfig(method="eagle", num_speculative_tokens=k),
    }
    names = ["off", *[c for c in args.configs if c != "off"]]
    unknown = [c for c in names if c not in every]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {sorted(every)}")
    return {name: every[name] for name in names}


def rotated(names: list[str], repeat: int) -> list[str]:
    """``names`` starting at ``repeat`` (mod their count): each repeat of a batch starts with a different
    configuration, so none always runs first (right after the previous cell or repeat).  The cyclic order
    stays: each configuration still follows the same other one whenever it is not first."""
    if not names:
        return names
    r = repeat % len(names)
    return names[r:] + names[:r]


def one_call(llm: Any, conversations: Sequence[list[dict[str, str]]], params: Any, tally: Tally) -> list[str]:
    """Answer ``conversations`` in one call (chat template); add what it cost and did to ``tally``; the answers."""
    stats = llm.core.stats(executor=True).executor
    before = (stats.forwards, stats.windows, stats.emitted, stats.proposed, stats.accepted)
    started = time.perf_counter()
    outs = llm.chat(list(conversations), params, use_tqdm=False)
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
    tally.calls.append([(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs])
    for rec in llm.trace:
        tally.drafted += sum(rec.drafted.values())
        tally.spec_accepted += sum(rec.accepted.values())
        for rid, drafted in rec.drafted.items():
            while len(tally.drafted_at) < drafted:
                tally.drafted_at.append(0)
                tally.accepted_at.append(0)
            for j in range(drafted):
                tally.drafted_at[j] += 1
                tally.accepted_at[j] += j < rec.accepted.get(rid, 0)
    return [o.outputs[0].text for o in outs]


def forget_finished(llm: Any) -> None:
    """Make ``llm``'s proposer forget the requests that left, if it remembers them (suffix decoding's global
    tree): each repeat, and each batch size, runs the same prompts, and a proposer that drafted a prompt's
    answer from its own earlier answer would measure memorisation, not speculation on new text."""
    from mechserve.executor.proposers_suffix import SuffixProposer

    proposer = getattr(llm.core.executor, "proposer", None)
    if isinstance(proposer, SuffixProposer):
        proposer.forget_finished()


def run_sessions(llm: Any, sessions: Sequence[Session], params: Any, tally: Tally) -> None:
    """``sessions`` together, turn by turn: turn k of each (that has one) in one call, with its earlier answers."""
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": s.system}] if s.system else [] for s in sessions
    ]
    for k in range(max(len(s.turns) for s in sessions)):
        live = [i for i, s in enumerate(sessions) if k < len(s.turns)]
        for i in live:
            conversations[i].append({"role": "user", "content": sessions[i].turns[k]})
        answers = one_call(llm, [conversations[i] for i in live], params, tally)
        for i, answer in zip(live, answers):
            conversations[i].append({"role": "assistant", "content": answer})


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (set, batch, configuration) cell; return the report.

    Raises ``SystemExit`` (one line naming the configuration) when a configuration's engine cannot be built:
    no EAGLE head trained for the model (``eagle*``: run ``mechserve train-draft``), or a draft model that
    cannot serve it (``--draft-layers`` past the model's layers), before anything is measured."""
    from mechserve.api.config import dtype_name
    from mechserve.api.errors import ModelLoadError
    from mechserve.api.params import SamplingParams
    from mechserve.bench import spec_llama_cpp
    from mechserve.bench.runners import MODES
    from mechserve.engine.executors import configure_threads
    from mechserve.entrypoints.llm import LLM
    from mechserve.model.loader import load_model

    peer_modes = check_llama_cpp_flags(args)
    threads = configure_threads()
    configs = configurations(args)
    peer = None
    if args.llama_cpp:  # asked for: found and its GGUFs made before anything runs, or one error
        try:
            peer = spec_llama_cpp.LlamaCppBeside(args.model, peer_modes, threads)
        except (OSError, ValueError) as exc:
            raise SystemExit(str(exc)) from None
    dtype, quantization = MODES[args.mode]
    loaded = load_model(args.model, dtype=dtype, quantization=quantization)
    size: dict[str, Any] = {
        "dtype": dtype_name(loaded.model.dtype),
        "quantization": getattr(loaded.model, "quantization", None),
    }
    llms: dict[str, Any] = {}
    for name, cfg in configs.items():
        try:
            llms[name] = LLM(
                loaded, speculative_config=cfg, num_pages=args.num_pages, max_step_tokens=args.max_step_tokens, **size
            )
        except (ModelLoadError, ValueError) as exc:  # an EAGLE head or a draft model that cannot serve the model
            raise SystemExit(f"configuration {name}: {exc}") from None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up: first-call allocations, kernels
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    cells: dict[str, dict[str, Any]] = {}
    beside: dict[str, dict[str, Any]] = {}
    every = workloads()
    out = sys.stderr if args.json else sys.stdout  # with --json the tables still show progress, on stderr
    try:
        for set_name in args.sets:
            sessions = every[set_name][: args.prompts]
            for batch in args.batches:
                tallies = {name: Tally() for name in llms}
                peers = {kind: spec_llama_cpp.PeerTally() for kind in peer.kinds} if peer else {}
                for repeat in range(1 if batch == 1 else args.repeats):
                    for llm in llms.values():
                        forget_finished(llm)
                    before = {name: (t.output_tokens, t.wall_s) for name, t in tallies.items()}
                    for start in range(0, len(sessions), batch):
                        done = len(tallies["off"].calls)
                        for name in rotated(list(llms), repeat):
                            run_sessions(llms[name], sessions[start : start + batch], params, tallies[name])
                        if peer is not None:  # the same turns, right after ours
                            try:
                                peer.run(batch, tallies["off"].calls[done:], peers, loaded.eos_token_ids)
                            except OSError as exc:
                                raise SystemExit(f"llama.cpp: {exc}") from None
                    for name, t in tallies.items():
                        t.repeats.append((t.output_tokens - before[name][0], t.wall_s - before[name][1]))
                off = tallies["off"]
                cell = {name: t.report(None if name == "off" else off) for name, t in tallies.items()}
                key = f"{set_name}/batch-{batch}"
                cells[key] = cell
                shown = table(f"{set_name}, batch {batch}", cell)
                if peer is not None:
                    side = {kind: t.report() for kind, t in peers.items()}
                    beside[key] = {**side, "best": spec_llama_cpp.best(cell, side)}
                    shown += "\n" + spec_llama_cpp.lines(side, beside[key]["best"])
                print(shown, file=out, flush=True)
        version = peer.version() if peer is not None else None
    finally:
        if peer is not None:
            peer.close()
    report: dict[str, Any] = {
        "model": args.model,
        "mode": args.mode,
        "threads": threads,
        "max_tokens": args.max_tokens,
        "spec_len": args.spec_len,
        "draft_layers": args.draft_layers,
        "prompts_per_set": args.prompts,
        "cells": cells,
    }
    if peer is not None:
        report["llama_cpp"] = {
            "ggufs": {kind: path.name for kind, path in peer.ggufs.items()},
            "version": version,
            "threads": threads,
            "cache_prompt": True,
            "cells": beside,
        }
    return report


def check_llama_cpp_flags(args: argparse.Namespace) -> list[str]:
    """The bench modes llama.cpp runs (``--llama-cpp-modes``, default ``spec_llama_cpp.DEFAULT_MODES``; none
    without ``--llama-cpp``).  Raises ``SystemExit`` (one line) for ``--llama-cpp-modes`` without
    ``--llama-cpp`` or with a GGUF ``--model`` (run as it is), and for a block mode with a GGUF ``--model``."""
    from mechserve.bench.spec_llama_cpp import DEFAULT_MODES
    from mechserve.model.gguf_file import is_gguf

    gguf = is_gguf(args.model)
    if gguf and args.mode not in ("exact", "fast"):
        raise SystemExit(f"--mode {args.mode}: a GGUF file runs its weights as it stores them; choose exact or fast")
    if args.llama_cpp_modes is not None and not args.llama_cpp:
        raise SystemExit("--llama-cpp-modes needs --llama-cpp")
    if args.llama_cpp_modes is not None and gguf:
        raise SystemExit("--llama-cpp-modes: llama.cpp runs a GGUF --model as it is, in one mode")
    if not args.llama_cpp:
        return []
    return list(dict.fromkeys(args.llama_cpp_modes or DEFAULT_MODES))


def spread(speedups: Sequence[float]) -> str:
    """The lowest and highest of a configuration's speedups by repeat ("0.94-1.03"), "-" with fewer than two."""
    return f"{min(speedups):.2f}-{max(speedups):.2f}" if len(speedups) > 1 else "-"


def table(title: str, cell: dict[str, dict[str, Any]]) -> str:
    """One cell as a small text table (``repeats``: the lowest and highest speedup of one repeat)."""
    head = (
        f"{'config':<15}{'tok/s':>8}{'speedup':>9}{'repeats':>12}{'tok/fwd':>9}{'tok/step':>10}{'accept':>8}"
        f"{'proposed':>10}{'forwards':>10}{'same':>6}  accepted by position"
    )
    lines = [f"== {title}", head]
    for name, r in cell.items():

        def fmt(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        lines.append(
            f"{name:<15}{fmt(r['tok_s'], '.1f'):>8}{fmt(r['speedup'], '.2f'):>9}{spread(r['speedup_by_repeat']):>12}"
            f"{fmt(r['tokens_per_forward'], '.2f'):>9}"
            f"{fmt(r['tokens_per_decode_step'], '.2f'):>10}{fmt(r['acceptance'], '.2f'):>8}{r['proposed']:>10}"
            f"{r['target_forwards']:>10}{'yes' if r['identical'] else 'NO':>6}  "
            + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        )
    return "\n".join(lines)


def costs(args: argparse.Namespace) -> dict[str, Any]:
    """Median time of a target forward of ``batch`` decode windows of M rows each (context ~300, ``--mode``),
    relative to one row at batch 1; ``row_cost``/``jump_cost`` fitted as ``executor.costs.StaticCosts`` uses
    them (the adaptive engine measures its own at start: ``executor.costs.calibrate``)."""
    from mechserve.bench.runners import MODES
    from mechserve.engine.executors import configure_threads
    from mechserve.executor.costs import step_inputs
    from mechserve.model.loader import load_model

    configure_threads()
    dtype, quantization = MODES[args.mode]
    model = load_model(args.model, dtype=dtype, tokenizer=False, quantization=quantization).model
    shapes = [(b, m) for b in (1, 8) for m in (1, 2, 3, 4, 5, 6, 8)]
    prepared = {(b, m): step_inputs(model, b, m, 300, 16) for b, m in shapes}
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``mechserve bench spec-decode --help``)."""
    add = parser.add_argument
    add("--model", default="smollm2", help="'smollm2' (default), a local model directory or a GGUF file")
    add(
        "--sets",
        nargs="+",
        choices=WORKLOADS,
        default=[w for w in WORKLOADS if w != "copy"],
        help=f"workloads ({', '.join(WORKLOADS)}; default: all but copy)",
    )
    add("--batches", nargs="+", type=Bounded(int, ge=1, le=64), default=[1, 8], help="batch sizes (1 8)")
    add(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(DEFAULT_CONFIGS),
        help=f"{', '.join(CONFIGS)} (default: {' '.join(DEFAULT_CONFIGS)}: no speculation and every proposer)",
    )
    add("--prompts", type=Bounded(int, ge=1, le=8), default=8, help="sessions per workload (at most 8)")
    add("--max-tokens", type=Bounded(int, ge=1, le=4096), default=128, help="new tokens per request (128)")
    add(
        "--spec-len",
        type=Bounded(int, ge=1, le=16),
        default=4,
        help="guesses per window (4; the draft model uses at most 3)",
    )
    add("--draft-layers", type=Bounded(int, ge=1, le=1024), default=4, help="layers the draft model keeps (4)")
    add(
        "--repeats",
        type=Bounded(int, ge=1, le=100),
        default=1,
        help="rounds at batch > 1 (1); --costs: x4 timing rounds",
    )
    add("--num-pages", type=Bounded(int, ge=1, le=1 << 20), default=512, help="KV pages per engine (512)")
    add("--max-step-tokens", type=Bounded(int, ge=1, le=1 << 16), default=2048, help="token budget per step (2048)")
    add("--mode", choices=("exact", "fast", "q4_1", "q8_0"), default="exact", help="as bench run's (exact)")
    add(
        "--llama-cpp",
        action="store_true",
        help="llama-server beside every cell (the same prompt ids and new ids per request; an error if not built)",
    )
    add(
        "--llama-cpp-modes",
        nargs="+",
        choices=("exact", "fast", "q4_1", "q8_0"),
        default=None,
        help="the GGUFs llama.cpp runs, by bench mode (fast q8_0 q4_1: BF16, Q8_0, Q4_1)",
    )
    add("--json", action="store_true", help="print only the report, as one JSON object")
    add("--costs", action="store_true", help="measure the cost of a step by rows instead")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or ``--costs``); print the tables or the JSON report; returns 0."""
    if args.costs and (args.llama_cpp or args.llama_cpp_modes is not None):
        raise SystemExit("--llama-cpp: not with --costs (which times our steps alone)")
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
