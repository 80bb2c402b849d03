"""``mechserve bench structured`` on the byte-level tiny model: the report's shape, every constrained output
parses, and constraining costs mask time only on constrained steps."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from mechserve.bench.structured import PERSON, constraints, person
from mechserve.cli.main import main


def test_the_persons_are_valid_instances() -> None:
    import jsonschema

    for i in range(8):
        jsonschema.validate(json.loads(person(i)), PERSON)


def test_bench_structured_reports_compile_mask_and_e2e(byte_dir: Path) -> None:
    out = io.StringIO()
    argv = ["bench", "structured", "--model", str(byte_dir), "--batches", "1", "3", "--max-tokens", "8", "--reps", "1"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    report = json.loads(out.getvalue())
    assert set(report["compile_ms"]) == set(constraints())
    assert all(v > 0 for v in report["compile_ms"].values())
    for b in ("batch_1", "batch_3"):
        mask = report["mask"][b]
        assert mask["steps"] > 50 and mask["fill_cpu_us"] > 0 and mask["apply_cpu_us"] > 0
        e2e = report["e2e"][b]
        assert e2e["unconstrained"]["mask_ms_per_step"] == 0 < e2e["constrained"]["mask_ms_per_step"]
        assert e2e["constrained"]["output_tokens"] > 0
