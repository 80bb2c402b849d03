"""Every field case in tests/data/field-cases.jsonl is covered by a test, or explicitly pending.

A case ``BCnn-…`` is covered when some test function under ``tests/`` is named ``test_bcnn_…`` and
exercises it: the test asserts something and calls into an engine (a ``mechserve`` module beyond the
data types ``params``/``outputs`` and the workload strategies), read from its source by
``notes_audit`` through the helpers and fixtures it uses; every test so named must do both.  (At run
time ``tests/field_cases/conftest.py`` also checks that engine code executes.)  A case that belongs
to the torch backend or the server and has no test yet is listed in ``PENDING`` with the reason; the
test fails when a pending case gets a test (take it off the list) and when a case is neither covered
nor pending (a new case cannot be forgotten).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from notes.notes_audit import CASE_TEST, Audited, audit

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "data" / "field-cases.jsonl"

PENDING: set[str] = set()


def cases() -> list[dict]:
    return [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]


def faults(info: Audited) -> list[str]:
    """Why ``info`` does not exercise its case: it checks nothing, or never drives an engine."""
    found = []
    if not info.asserts:
        found.append("asserts nothing (no assert, pytest.raises or assertion helper)")
    if not info.reaches_an_engine():
        found.append(f"calls into no engine (only {sorted(info.reaches) or 'nothing of mechserve'})")
    return found


def case_of(info: Audited) -> str:
    m = CASE_TEST.fullmatch(info.name)
    assert m is not None
    return m.group(1)


def covered() -> set[str]:
    """The case numbers (``bc02``) some test under tests/ is named after and exercises."""
    return {case_of(info) for info in audit(CASE_TEST) if not faults(info)}


def named() -> set[str]:
    """The case numbers some test under tests/ is named after, whatever it does."""
    return {case_of(info) for info in audit(CASE_TEST)}


def number(case_id: str) -> str:
    return case_id.split("-", 1)[0].lower()


def test_field_cases_are_well_formed() -> None:
    found = cases()
    assert found, "no field case"
    ids = [case["id"] for case in found]
    assert len(set(ids)) == len(ids), "a case id appears twice"
    assert len({number(i) for i in ids}) == len(ids), "two cases share a number"
    for case in found:
        assert re.fullmatch(r"BC\d\d-[a-z0-9-]+", case["id"]), case["id"]
        assert {"mechanism", "summary", "scenario", "expected"} <= set(case), case["id"]


def test_every_field_case_is_covered_or_pending() -> None:
    ids, tested = {case["id"] for case in cases()}, covered()
    forgotten = sorted(i for i in ids if number(i) not in tested and i not in PENDING)
    assert not forgotten, f"field cases without a test_bcNN_… test that exercises them, and not PENDING: {forgotten}"
    done = sorted(i for i in PENDING if number(i) in tested)
    assert not done, f"PENDING cases that now have a test (take them off the list): {done}"
    unknown = sorted(PENDING - ids)
    assert not unknown, f"PENDING names cases that are not in {CASES.name}: {unknown}"


def test_every_bc_test_names_a_case() -> None:
    numbers = {number(case["id"]) for case in cases()}
    orphans = sorted(named() - numbers)
    assert not orphans, f"tests named after field cases that do not exist: {orphans}"


def test_every_bc_test_asserts_and_drives_an_engine() -> None:
    bad = [f"{info.where}: {'; '.join(f)}" for info in audit(CASE_TEST) if (f := faults(info))]
    assert not bad, "field-case tests that cannot exercise their case:\n" + "\n".join(bad)
