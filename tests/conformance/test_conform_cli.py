"""``mechserve conform``: the table, ``--json``, ``--checks``, exit statuses and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from mechserve.cli import conform
from mechserve.cli.main import main
from mechserve.conformance import CHECKS, Target

from . import mutants as m


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["conform", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_cli_knows_the_suites_checks() -> None:
    assert conform.CHECKS == CHECKS


def test_a_passing_run_prints_one_row_per_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--model", "tiny", "--workloads", "3", "--seed", "7")
    assert code == 0 and err == ""
    assert "mechserve conform: tiny · seed 7 · 3 workloads per check" in out
    for check in CHECKS:
        row = next(line for line in out.splitlines() if f" {check} " in line)
        assert "PASS" in row, row
    assert "the real runs exercised:" in out


def test_json_is_one_object_with_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--model", "tiny", "--workloads", "2", "--checks", "kv,replay", "--json")
    report = json.loads(out)
    assert code == 0 and err == "" and report["passed"] is True
    assert [c["check"] for c in report["checks"]] == ["replay", "kv"]
    assert all(c["status"] == "PASS" and c["workloads"] == 2 and c["runs"] >= 2 for c in report["checks"])
    assert set(report["checks"][0]["events"]) >= {"preempted", "rolled_back", "reused"}


def test_the_ladder_alone_loads_no_model(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("no model should be loaded for --checks ladder")

    monkeypatch.setattr("mechserve.conformance.target.load_target", refuse)
    code, out, _ = run(capsys, "--checks", "ladder", "--workloads", "2", "--json")
    assert code == 0 and json.loads(out)["target"] == "spec only"


def test_a_failing_check_exits_1_and_shows_the_failing_workload(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mutant: Callable[[type], Target]
) -> None:
    monkeypatch.setattr("mechserve.conformance.target.load_target", lambda model: mutant(m.OneSlotOff))
    code, out, err = run(capsys, "--model", "tiny", "--workloads", "2", "--checks", "contract,replay")
    assert code == 1 and err == ""
    assert "FAIL (" in out and "PASS" in out  # replay cannot see a misplaced write; the contract can
    assert "contract: ContractViolation: contract: step 0, rank 0:" in " ".join(out.split())
    assert '  workload: {"engine": {' in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checks", "replay,bogus"], "--checks: unknown check 'bogus'"),
        (["--checks", ","], "--checks: name at least one check"),
        (["--workloads", "0"], "--workloads: expected an integer in [1, 100000], got '0'"),
        (["--seed", "x"], "--seed: expected an integer in [0, 4294967295], got 'x'"),
        (
            ["--model", "/no/such/model/dir", "--checks", "kv"],
            "model not found: /no/such/model/dir (a directory or a .gguf file)",
        ),
    ],
)
def test_errors_are_one_line_with_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("mechserve: error: ") and message in err and err.count("\n") == 1, err


def test_help_lists_conform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "conform" in capsys.readouterr().out


def test_importing_the_cli_imports_neither_torch_nor_hypothesis() -> None:
    code = (
        "import sys, mechserve.cli.main, mechserve.conformance; "
        "bad = [m for m in ('torch', 'hypothesis') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
