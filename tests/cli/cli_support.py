"""Shared helpers of the CLI tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"
EXAMPLES = sorted((DATA / "examples").glob("*.json"))
# The trace fields of the contract, in contract order (MECHANISMS 4.3).
CONTRACT_FIELDS = (
    "step",
    "admitted",
    "scheduled",
    "executed",
    "sampled",
    "finished",
    "preempted",
    "reused",
    "published",
    "evicted",
    "drafted",
    "accepted",
    "rolled_back",
)


@dataclass
class Result:
    """What one ``mechserve`` invocation returned and printed."""

    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]


def assert_one_error_line(result: Result, *needles: str) -> str:
    """Exit status 2, exactly one stderr line ``mechserve: error: ...`` containing ``needles``, no traceback."""
    assert result.code == 2, (result.code, result.err)
    err_lines = result.err.splitlines()
    assert len(err_lines) == 1, result.err
    assert err_lines[0].startswith("mechserve: error: "), result.err
    assert "Traceback" not in result.err + result.out
    for needle in needles:
        assert needle in err_lines[0], (needle, err_lines[0])
    return err_lines[0]


def load_example(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
