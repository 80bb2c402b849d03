"""``mechserve bench spec-decode`` on the tiny served model: the report's shape and its exactness check (the
numbers themselves are measured on SmolLM2 by hand, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechserve.cli.main import main


def test_bench_spec_decode_reports_every_cell_and_identical_outputs(capsys, tiny_dir: Path) -> None:
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "6"]
    argv += ["--batches", "1", "2", "--configs", "ngram", "draft", "--draft-layers", "1", "--num-pages", "64", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["cells"]) == {"copy/batch-1", "copy/batch-2", "novel/batch-1", "novel/batch-2"}
    for cell in report["cells"].values():
        assert set(cell) == {"off", "ngram", "draft"}
        assert cell["off"]["speedup"] is None and cell["off"]["proposed"] == 0
        for name in ("ngram", "draft"):
            r = cell[name]
            assert r["identical"], (name, r)  # greedy speculation is exact
            assert r["output_tokens"] == cell["off"]["output_tokens"] and r["target_forwards"] > 0
            # speedup is this configuration's tok/s over off's, tokens per forward its outputs per target forward
            assert r["speedup"] == pytest.approx(r["tok_s"] / cell["off"]["tok_s"], rel=0.02, abs=2e-3)
            assert r["tokens_per_forward"] == pytest.approx(r["output_tokens"] / r["target_forwards"], abs=1e-3)
        assert cell["draft"]["proposed"] > 0 and 0 <= cell["draft"]["accepted"] <= cell["draft"]["proposed"]


@pytest.mark.parametrize(("flag", "value"), [("--batches", "0"), ("--prompts", "9"), ("--configs", "medusa")])
def test_bench_spec_decode_flags_are_checked(capsys, flag: str, value: str) -> None:
    assert main(["bench", "spec-decode", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mechserve: error: ") and flag in err and err.count("\n") == 1
