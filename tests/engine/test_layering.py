"""The runtime's layering, checked on the source: only ``mechserve.engine`` touches m12's state."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "mechserve"
# What reaching into m12 looks like: its queues, pool and cache, dropping requests, setting spec_len.
REACH = re.compile(
    r"(?<!mechserve)\.(engine|spec_engine)\.(pool|cache|running|waiting|due|live|requests|spec_len|drop_finished|step_counter)\b"
    r"|\bdrop_finished\(|\.engine\.step\("
)
# Packages whose job is to read the spec's own state (pictures, audits), that are the spec, or that run the
# spec with no model (the scale benchmark, the simulated fleet of ``bench fleet``).
READERS = (
    "spec",
    "engine",
    "viz",
    "conformance",
    "workload.py",
    "bench/spec_scale.py",
    "bench/fleet",
    "cli/run.py",
    "cli/demo.py",
)


def test_no_module_outside_the_engine_reaches_into_m12() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(READERS):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if REACH.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_the_spec_engine_handle_goes_only_to_the_viz_recorder() -> None:
    """Outside ``mechserve.engine`` the m12 engine is handed, read-only, to the trace recorder and nothing else."""
    uses = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("engine/", "spec/")):
            continue
        uses += [(rel, line.strip()) for line in path.read_text().splitlines() if "spec_engine" in line]
    assert uses and all("viz.recorder(core.scheduler.spec_engine" in line for _, line in uses), uses
