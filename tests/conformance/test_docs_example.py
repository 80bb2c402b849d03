"""The example executor of ``docs/executors.md`` runs as written and passes every check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "executors.md"


def example() -> str:
    section = DOC.read_text(encoding="utf-8").split("## A complete example", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "docs/executors.md has no python example"
    return block.group(1)


def test_the_example_executor_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(example(), str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    for check in ("replay", "contract", "kv", "invariance", "ladder"):
        assert f"{check}: PASS" in out, out


def test_the_example_is_a_real_check(capsys: pytest.CaptureFixture[str]) -> None:
    """The same toy with its page-table read off by one position fails the KV audit and invariance."""
    broken = example().replace("(start - 1) // ps], (start - 1) % ps]", "(start - 2) // ps], (start - 2) % ps]")
    broken = broken.replace("assert report.passed", "assert not report.passed")
    assert broken != example()
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(broken, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "kv: FAIL" in out and "invariance: FAIL" in out and "contract: PASS" in out, out
