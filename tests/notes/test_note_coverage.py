"""Every numbered line of every mechanism note has a test that tests it, and no test names a missing line.

A numbered line starts with ``N<k>.`` at the beginning of a line in ``mech-notes/NN-*.md``; its test is
a function ``test_mNN_n<k>_<slug>`` anywhere under ``tests/``.  A name is not enough: every such test
must assert something and call into the rung it names, ``mechserve.spec.mNN_*`` (read from its source
by ``notes_audit``, through the helpers and fixtures it uses), and a line counts as covered only by a
test that does.  At run time ``tests/notes/conftest.py`` also checks that the rung's code executes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from notes.notes_audit import NOTE_TEST, Audited, audit

from mechserve.spec import RUNGS

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "mech-notes"
LINE = re.compile(r"^N(\d+)\.\s", re.MULTILINE)


def note_lines() -> dict[tuple[int, int], str]:
    lines = {}
    for note in sorted(NOTES.glob("[0-9][0-9]-*.md")):
        rung = int(note.name[:2])
        for m in LINE.finditer(note.read_text()):
            lines[(rung, int(m.group(1)))] = note.name
    return lines


def key(info: Audited) -> tuple[int, int]:
    m = NOTE_TEST.fullmatch(info.name)
    assert m is not None
    return int(m.group(1)), int(m.group(2))


def faults(info: Audited) -> list[str]:
    """Why ``info`` does not test its line: it checks nothing, or never calls into its rung."""
    rung = key(info)[0]
    found = []
    if not info.asserts:
        found.append("asserts nothing (no assert, pytest.raises or assertion helper)")
    if rung >= len(RUNGS) or not info.reaches_module(f"mechserve.spec.{RUNGS[rung]}"):
        found.append(f"never calls into mechserve.spec.{RUNGS[rung] if rung < len(RUNGS) else f'm{rung:02d}'}")
    return found


def named_tests() -> dict[tuple[int, int], list[Audited]]:
    tests: dict[tuple[int, int], list[Audited]] = {}
    for info in audit(NOTE_TEST):
        tests.setdefault(key(info), []).append(info)
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
    missing = [f"{lines[k]} N{k[1]}" for k in sorted(lines) if not any(not faults(info) for info in tests.get(k, []))]
    assert not missing, f"note lines without a test that asserts and calls into the rung: {missing}"


def test_every_note_test_asserts_and_calls_into_its_rung() -> None:
    bad = [f"{info.where}: {'; '.join(f)}" for infos in named_tests().values() for info in infos if (f := faults(info))]
    assert not bad, "note tests that cannot test their line:\n" + "\n".join(bad)


def test_every_note_test_names_an_existing_line() -> None:
    lines, tests = note_lines(), named_tests()
    orphans = [info.where for k, infos in sorted(tests.items()) if k not in lines for info in infos]
    assert not orphans, f"tests naming a line that does not exist: {orphans}"


@pytest.mark.parametrize("module", RUNGS)
def test_numbering_is_contiguous(module: str) -> None:
    rung = RUNGS.index(module)
    numbers = sorted(n for (r, n) in note_lines() if r == rung)
    assert numbers == list(range(1, len(numbers) + 1)), f"{module}: note lines {numbers} are not 1..k"
