"""``mechserve demo``: the canned workload of MECHANISMS 4.1, printed like ``run``.

On m15 (routing) the demo is a fleet's instead: two replicas behind ``precise``, two tenants whose
requests share a system prompt, so the routing decisions follow the replicas' KV events.
"""

from __future__ import annotations

import argparse
from typing import Any

from mechserve.cli.run import add_output_arguments, execute
from mechserve.cli.viz import VizOutputs
from mechserve.workload import fit_rung, load_rung, parse_workload, rung_label

# Three requests with staggered arrivals, chunked prefill, page contention and a
# scripted speculative verdict, on a 4-rank executor group.
DEMO_WORKLOAD: dict[str, Any] = {
    "engine": {"max_step_tokens": 8, "page_size": 4, "num_pages": 8, "spec_len": 3, "world_size": 4},
    "requests": [
        {"request_id": "r0", "prompt_len": 6, "max_new_tokens": 4},
        {"request_id": "r1", "prompt_len": 4, "max_new_tokens": 3, "arrival_step": 1},
        {"request_id": "r2", "prompt_len": 10, "max_new_tokens": 5, "arrival_step": 2, "accept_script": [1, 2]},
    ],
}


# m15: two tenants (system prompts 1..8 and 50..57) on two replicas; t0's later requests find its
# blocks by the replica's BlockStored events, and u1 arrives with u0 in one step, before any event.
_TENANT_T = list(range(1, 9))
_TENANT_U = list(range(50, 58))
DEMO_FLEET: dict[str, Any] = {
    "engine": {"max_step_tokens": 16, "page_size": 4, "num_pages": 12},
    "fleet": {"replicas": 2, "routing_policy": "precise"},
    "requests": [
        {"request_id": "t0", "tokens": [*_TENANT_T, 100, 101], "max_new_tokens": 3},
        {"request_id": "u0", "tokens": [*_TENANT_U, 110, 111, 112], "max_new_tokens": 2, "arrival_step": 1},
        {"request_id": "u1", "tokens": [*_TENANT_U, 120], "max_new_tokens": 2, "arrival_step": 1},
        {"request_id": "t1", "tokens": [*_TENANT_T, 130, 131, 132], "max_new_tokens": 2, "arrival_step": 2},
        {"request_id": "t2", "tokens": [*_TENANT_T, 140], "max_new_tokens": 2, "arrival_step": 3},
    ],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mech``, ``--json``, ``--explain``, ``--viz`` and ``--plot``."""
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the demo on the chosen rung.

    A rung without speculative decoding or parallelism runs the demo without
    them (the text view says so); m15 runs ``DEMO_FLEET`` (m16, the one-engine top rung, the engine demo).  Raises ``WorkloadError``
    for an unknown rung and ``CliError`` if the engine fails.
    """
    rung = load_rung(args.mech)
    viz = VizOutputs.from_args(args)
    workload, notes = fit_rung(rung, parse_workload(DEMO_FLEET if rung_label(rung) == "m15" else DEMO_WORKLOAD))
    return execute(rung, workload, as_json=args.json, explain=args.explain, notes=notes, viz=viz)
