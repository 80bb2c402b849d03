"""The top rung at scale: 10,000 requests (``tests/data/scale-10k.json``, a copy of the shared case).

Every request fits the pool on its own, so every request must finish (D2: no ``OutOfPages``), within
the step bound, with the budget respected every step and the pages conserved along the way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ladder_harness import MODULES, Run, check_pages, check_summary, step_bound

from mechserve.conformance.strategies import build, fits_alone
from mechserve.spec import TOP

SCALE = Path(__file__).resolve().parents[1] / "data" / "scale-10k.json"


@pytest.mark.slow
def test_top_rung_finishes_every_request_of_scale_10k() -> None:
    workload = json.loads(SCALE.read_text())
    assert len(workload["requests"]) == 10_000 and fits_alone(workload)
    engine = build(MODULES[TOP], workload)
    bound = step_bound(workload)
    records = []

    def on_step(record) -> None:
        records.append(record)
        assert sum(record.executed.values()) <= engine.max_step_tokens
        assert len(records) <= bound, "still running past the step bound"
        if len(records) % 50 == 0:
            engine.check_invariants()
            check_pages(engine)

    engine.run(on_step=on_step)
    engine.check_invariants()
    check_pages(engine)
    assert all(r.state.value == "FINISHED" for r in engine.requests)
    check_summary(Run(TOP, workload, engine, records))
    assert sum(r.generated for r in engine.requests) == sum(
        sum(rec.accepted.values()) + sum(v.value == "TOKEN" for v in rec.sampled.values()) for rec in records
    )
