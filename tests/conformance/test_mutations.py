"""Mutation tests of the checkers: every planted fault is caught by the checks that can see it.

The faults live in ``mutants.py``.  Each runs on the fixed ``shared-prefix`` workload (prefix reuse,
same-step adoption, preemption and recompute, speculation with rollbacks, three items per step) on
the tiny model.  A fault a check cannot see by design is asserted to pass it, so the matrix below
is the documented coverage of the five checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mechserve.conformance import (
    FIXED_WORKLOADS,
    ContractViolation,
    InvarianceMismatch,
    KVMismatch,
    ReplayMismatch,
    Target,
    check_contract,
    check_executor,
    check_invariance,
    check_kv,
    check_replay,
    model_workload,
)
from mechserve.conformance.runner import events, run_workload
from mechserve.spec.m16_request_draft_lengths import BoundaryViolation

from . import mutants as m

CHECKS: dict[str, Callable[[Target, dict[str, Any]], Any]] = {
    "replay": check_replay,
    "contract": check_contract,
    "kv": check_kv,
    "invariance": check_invariance,
}


@pytest.fixture(scope="module")
def workload(target: Target) -> dict[str, Any]:
    w = model_workload(FIXED_WORKLOADS["shared-prefix"], target.vocab_size)
    seen = events(run_workload(target, w).records)
    assert seen["preempted"] and seen["rolled_back"] and seen["reused"], seen
    return w


CAUGHT = [
    (
        m.OneSlotOff,
        "contract",
        ContractViolation,
        r"step 0, rank 0: a: planned position 9 \(page 2, offset 1\) was not written",
    ),
    (m.OneSlotOff, "kv", KVMismatch, r"after step 0, rank 0, a: [KV] at position 9 \(page 2, offset 1\), layer 0"),
    (m.OneSlotOff, "invariance", InvarianceMismatch, r"as drawn: \w+ generated .* but alone the reference generates"),
    (m.OverReports, "contract", ContractViolation, r"step 1, rank 0: a: acceptance 4 outside \[0, 3\] \(3 drafted\)"),
    (m.AcceptsWrongGuess, "invariance", InvarianceMismatch, r"as drawn: a generated \[.*\] \(LENGTH\) but alone"),
    (m.OutOfOrder, "contract", ContractViolation, r"step 1, rank 0: outcome 0 is for 'c' where 'a' was planned"),
    (
        m.SkipsToken,
        "contract",
        ContractViolation,
        r"step 0, rank 0: a: planned position 9 \(page 2, offset 1\) was not written",
    ),
    (m.SkipsToken, "kv", KVMismatch, r"after step 0, rank 0, a: [KV] at position 9"),
    (
        m.CorruptsPrefix,
        "contract",
        ContractViolation,
        r"step 1, rank 0: slot \(page 0, offset 0\) was written but no plan item placed a position there "
        r"\(layer 0 K\); it backs a's position 0",
    ),
    (m.CorruptsPrefix, "kv", KVMismatch, r"after step 1, rank 0, a: K at position 0 \(page 0, offset 0\), layer 0"),
    (m.ForgetsRollback, "contract", ContractViolation, r"step 2, rank 0: a: planned position 11 .* was not written"),
    (m.ForgetsRollback, "kv", KVMismatch, r"after step 2, rank 0, a: [KV] at position 11"),
    (m.SkipsToken, "invariance", InvarianceMismatch, r"as drawn: a generated \[66, 44, 57, 21, 62, 49\]"),
    (m.CorruptsPrefix, "invariance", InvarianceMismatch, r"as drawn: a generated \[66, 44, 118,"),
    (m.ForgetsRollback, "invariance", InvarianceMismatch, r"first difference at output index 5"),
    (
        m.LiesAboutTokens,
        "invariance",
        InvarianceMismatch,
        r"as drawn: a generated \[\d+, .*first difference at output index 0",
    ),
]


@pytest.mark.parametrize(
    ("cls", "check", "error", "message"), CAUGHT, ids=[f"{c.__name__}-{check}" for c, check, *_ in CAUGHT]
)
def test_planted_fault_is_caught(
    mutant: Callable[[type], Target], workload: dict[str, Any], cls: type, check: str, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        CHECKS[check](mutant(cls), workload)


PASSED = [
    # The trace does not show where K/V went: a run on broken state is still a spec run.
    (m.OneSlotOff, ("replay",)),
    (m.SkipsToken, ("replay",)),
    (m.CorruptsPrefix, ("replay",)),
    (m.ForgetsRollback, ("replay",)),
    # Self-consistent lies: the engine feeds the reported ids back, the K/V match them, the trace replays.
    (m.LiesAboutTokens, ("replay", "contract", "kv")),
    (m.AcceptsWrongGuess, ("replay", "contract", "kv")),
    # Stale K/V of rejected guesses past the frontier are never read: nothing to catch.
    (m.LeavesRejectedKV, ("replay", "contract", "kv", "invariance")),
]


@pytest.mark.parametrize(("cls", "checks"), PASSED, ids=[c.__name__ for c, _ in PASSED])
def test_what_a_check_cannot_see_it_does_not_flag(
    mutant: Callable[[type], Target], workload: dict[str, Any], cls: type, checks: tuple[str, ...]
) -> None:
    for check in checks:
        CHECKS[check](mutant(cls), workload)


@pytest.mark.parametrize(
    ("cls", "message"),
    [(m.OverReports, r"a: acceptance 4 outside \[0, 3\]"), (m.OutOfOrder, r"outcome for 'c' where 'a' was planned")],
)
def test_a_broken_answer_is_also_refused_by_the_engines_own_commit(
    mutant: Callable[[type], Target], workload: dict[str, Any], cls: type, message: str
) -> None:
    """Without the checker, the top rung's commit (m10 N8, N13) refuses these answers on its own, so every check that
    runs the workload fails with the engine's ``BoundaryViolation``."""
    for check in ("replay", "kv", "invariance"):
        with pytest.raises(BoundaryViolation, match=message) as info:
            CHECKS[check](mutant(cls), workload)
        assert not isinstance(info.value, ContractViolation)


def test_replay_catches_a_real_engine_that_is_not_the_spec(target: Target, workload: dict[str, Any]) -> None:
    with pytest.raises(ReplayMismatch, match=r"first difference: step 1, field scheduled: real=\['c', 'b', 'a'\]"):
        check_replay(target, workload, engine_factory=m.NewestFirst)


@pytest.mark.parametrize(
    ("cls", "check", "message"),
    [
        (m.OneSlotOff, "contract", "was not written"),
        (m.SkipsToken, "kv", "differs from a dense forward"),
        (m.LiesAboutTokens, "invariance", "alone the reference generates"),
    ],
)
def test_the_suite_reports_a_planted_fault(
    mutant: Callable[[type], Target], cls: type, check: str, message: str
) -> None:
    report = check_executor(mutant(cls), workloads=4, seed=3, checks=[check], world_size=(1, 1))
    (result,) = report.results
    assert not report.passed and result.status == "FAIL" and result.failed >= 1
    assert message in result.failures[0].message


@pytest.mark.slow
def test_the_torch_executor_passes_every_check_on_many_workloads(target: Target) -> None:
    report = check_executor(target, workloads=400, seed=11)
    assert report.passed, report.summary()
