"""``mechserve bench spec-decode`` on the tiny served model: the report's shape and its exactness check (the
numbers themselves are measured on SmolLM2 by hand, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechserve.cli.main import main


def test_bench_spec_decode_reports_every_cell_and_identical_outputs(capsys, tiny_dir: Path) -> None:
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "6"]
    argv += ["--batches", "1", "2", "--configs", "ngram", "suffix-fixed", "draft", "--draft-layers", "1"]
    argv += ["--sets", "copy", "novel", "--num-pages", "64", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["cells"]) == {"copy/batch-1", "copy/batch-2", "novel/batch-1", "novel/batch-2"}
    for cell in report["cells"].values():
        assert set(cell) == {"off", "ngram", "suffix-fixed", "draft"}
        assert cell["off"]["speedup"] is None and cell["off"]["proposed"] == 0
        for name in ("ngram", "suffix-fixed", "draft"):
            r = cell[name]
            assert r["identical"], (name, r)  # greedy speculation is exact
            assert r["output_tokens"] == cell["off"]["output_tokens"] and r["target_forwards"] > 0
            # speedup is this configuration's tok/s over off's, tokens per forward its outputs per target forward
            assert r["speedup"] == pytest.approx(r["tok_s"] / cell["off"]["tok_s"], rel=0.02, abs=2e-3)
            assert r["tokens_per_forward"] == pytest.approx(r["output_tokens"] / r["target_forwards"], abs=1e-3)
        assert cell["draft"]["proposed"] > 0 and 0 <= cell["draft"]["accepted"] <= cell["draft"]["proposed"]
        # the draft model fills every window (fixed spec_len 3): a rate for each of its 3 positions, falling
        by_position = cell["draft"]["acceptance_by_position"]
        assert len(by_position) == 3 and all(0 <= a <= 1 for a in by_position)
        assert by_position == sorted(by_position, reverse=True)


def test_bench_spec_decode_runs_multi_turn_sessions_turn_by_turn(capsys, tiny_dir: Path) -> None:
    """The chat and agent workloads: 4 turns per session, each with the earlier answers; every configuration
    answers them identically, and the kept tokens per step are reported."""
    argv = ["bench", "spec-decode", "--model", str(tiny_dir), "--prompts", "2", "--max-tokens", "4"]
    argv += ["--batches", "1", "2", "--configs", "suffix", "--sets", "chat", "agent", "--num-pages", "128", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["cells"]) == {f"{w}/batch-{b}" for w in ("chat", "agent") for b in (1, 2)}
    for cell in report["cells"].values():
        assert cell["suffix"]["identical"]
        assert cell["off"]["output_tokens"] == 2 * 4 * 4  # 2 sessions x 4 turns x 4 tokens (EOS aside)
        assert cell["suffix"]["tokens_per_decode_step"] >= 1.0


def test_the_shipped_workloads_are_fixed() -> None:
    from mechserve.bench.spec_workloads import workloads

    every = workloads()
    assert set(every) == {"chat", "agent", "code-edit", "summarise", "novel", "copy"}
    assert all(len(sessions) == 8 for sessions in every.values())
    assert all(len(s.turns) == 4 for s in every["chat"] + every["agent"])
    assert len({s.system for s in every["agent"]}) == 1 and "get_weather" in (every["agent"][0].system or "")
    assert workloads() == every  # nothing drawn at run time


@pytest.mark.parametrize(
    ("flag", "value"), [("--batches", "0"), ("--prompts", "9"), ("--configs", "medusa"), ("--sets", "poetry")]
)
def test_bench_spec_decode_flags_are_checked(capsys, flag: str, value: str) -> None:
    assert main(["bench", "spec-decode", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mechserve: error: ") and flag in err and err.count("\n") == 1
