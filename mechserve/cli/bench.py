"""``mechserve bench BENCHMARK``: the benchmarks, one subcommand each.

A benchmark is a module with ``add_arguments(parser)`` and ``run(args)``
whose top level imports only the standard library and light mechserve
modules, never torch (its heavy imports happen in ``run``; its number flags
are ``mechserve.cli.parser.Bounded``), registered by one row of
``BENCHMARKS``; ``mechserve bench --help`` lists them.
"""

from __future__ import annotations

import argparse
import importlib

HELP = (
    "benchmarks (run: engines side by side; spec: the spec engine at scale; fleet: routing on a simulated fleet; serve: Poisson client; "
    "spec-decode: speculative decoding; tp: tensor-parallel world sizes; perplexity: per mode, beside llama.cpp; "
    "structured: constrained decoding; compile: torch.compile's effect)"
)
# (subcommand, module, help)
BENCHMARKS = (
    (
        "run",
        "mechserve.bench.run",
        "workloads x engines (mechserve, hf, optional others) x modes side by side: JSON results, MFU, plots",
    ),
    (
        "spec",
        "mechserve.bench.spec_scale",
        "the top rung with the scripted executor on 1k/10k/100k requests: time, step-time profile, trace identity",
    ),
    (
        "fleet",
        "mechserve.bench.fleet",
        "routing policies side by side on a simulated fleet (m15, 4-64 scripted replicas, 10k-100k requests): "
        "prefill computed, hit rate, imbalance, queueing, TTFT under a cost model; JSON and plots",
    ),
    (
        "serve",
        "mechserve.bench.serve_client",
        "drive a running server with Poisson arrivals; print requests/s, TTFT, ITL and E2E percentiles as JSON",
    ),
    (
        "tp",
        "mechserve.bench.world_sizes",
        "output tokens/s of one greedy run at several tensor-parallel world sizes (ids compared)",
    ),
    (
        "perplexity",
        "mechserve.bench.perplexity",
        "perplexity of a local text per mode (exact, fast, q4_1, q8_0), beside llama.cpp's llama-perplexity",
    ),
    (
        "compile",
        "mechserve.bench.compile_decode",
        "decode TPOT with and without torch.compile (EngineConfig.compile) at batch 1 and 8, side by side",
    ),
    (
        "spec-decode",
        "mechserve.bench.spec_decode",
        "speculative decoding off / prompt lookup / draft model side by side on copy-heavy and novel prompts, "
        "batch 1 and 8: tokens per target forward, acceptance, speedup",
    ),
    (
        "structured",
        "mechserve.bench.structured",
        "structured outputs: grammar compile time per kind, mask fill and apply per step, constrained vs "
        "unconstrained generation at batch 1 and 32",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subparser per benchmark, with the benchmark module's own arguments."""
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module, help_text in BENCHMARKS:
        sub = benchmarks.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub)
        sub.set_defaults(benchmark_module=module)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    return int(importlib.import_module(args.benchmark_module).run(args) or 0)
