"""Every numbered line of every mechanism note has a test named after it, and no test names a missing line.

A numbered line starts with ``N<k>.`` at the beginning of a line in ``mech-notes/NN-*.md``; its test is
a function ``test_mNN_n<k>_<slug>`` anywhere under ``tests/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mechserve.spec import RUNGS

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "mech-notes"
LINE = re.compile(r"^N(\d+)\.\s", re.MULTILINE)
TEST = re.compile(r"^\s*def (test_m(\d\d)_n(\d+)_\w+)\(", re.MULTILINE)


def note_lines() -> dict[tuple[int, int], str]:
    lines = {}
    for note in sorted(NOTES.glob("[0-9][0-9]-*.md")):
        rung = int(note.name[:2])
        for m in LINE.finditer(note.read_text()):
            lines[(rung, int(m.group(1)))] = note.name
    return lines


def named_tests() -> dict[tuple[int, int], list[str]]:
    tests: dict[tuple[int, int], list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        for m in TEST.finditer(path.read_text()):
            tests.setdefault((int(m.group(2)), int(m.group(3))), []).append(f"{path.name}::{m.group(1)}")
    return tests


def test_every_rung_has_a_note() -> None:
    for i, module in enumerate(RUNGS):
        assert list(NOTES.glob(f"{i:02d}-*.md")), f"no note for {module}"


def test_every_note_has_numbered_lines() -> None:
    lines = note_lines()
    for note in NOTES.glob("[0-9][0-9]-*.md"):
        assert any(name == note.name for name in lines.values()), f"{note.name} has no numbered line"


def test_every_numbered_line_has_a_test() -> None:
    lines, tests = note_lines(), named_tests()
    missing = [f"{lines[key]} N{key[1]}" for key in sorted(lines) if key not in tests]
    assert not missing, f"note lines without a test: {missing}"


def test_every_note_test_names_an_existing_line() -> None:
    lines, tests = note_lines(), named_tests()
    orphans = [name for key, names in sorted(tests.items()) if key not in lines for name in names]
    assert not orphans, f"tests naming a line that does not exist: {orphans}"


@pytest.mark.parametrize("module", RUNGS)
def test_numbering_is_contiguous(module: str) -> None:
    rung = RUNGS.index(module)
    numbers = sorted(n for (r, n) in note_lines() if r == rung)
    assert numbers == list(range(1, len(numbers) + 1)), f"{module}: note lines {numbers} are not 1..k"
