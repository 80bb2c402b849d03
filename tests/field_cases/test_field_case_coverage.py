"""Every field case in tests/data/field-cases.jsonl is covered by a test, or explicitly pending.

A case ``BCnn-…`` is covered when some test function under ``tests/`` is named ``test_bcnn_…``.  A
case that belongs to the torch backend or the server and has no test yet is listed in ``PENDING``
with the reason; the test fails when a pending case gets a test (take it off the list) and when a
case is neither covered nor pending (a new case cannot be forgotten).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "data" / "field-cases.jsonl"
TEST = re.compile(r"^\s*def test_(bc\d\d)_\w+\(", re.MULTILINE)

PENDING: set[str] = set()


def cases() -> list[dict]:
    return [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]


def covered() -> set[str]:
    """The case numbers (``bc02``) some test under tests/ is named after."""
    return {m.group(1) for path in (ROOT / "tests").rglob("*.py") for m in TEST.finditer(path.read_text())}


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
    assert not forgotten, f"field cases without a test_bcNN_… test and not PENDING: {forgotten}"
    done = sorted(i for i in PENDING if number(i) in tested)
    assert not done, f"PENDING cases that now have a test (take them off the list): {done}"
    unknown = sorted(PENDING - ids)
    assert not unknown, f"PENDING names cases that are not in {CASES.name}: {unknown}"


def test_every_bc_test_names_a_case() -> None:
    numbers = {number(case["id"]) for case in cases()}
    orphans = sorted(covered() - numbers)
    assert not orphans, f"tests named after field cases that do not exist: {orphans}"
