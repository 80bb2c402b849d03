"""End to end on the embedded SmolLM2-135M: the four real-model checks on a fixed set of workloads.

References come from transformers loading the same converted weights (float32); the KV audit's
tolerance is 1e-3 + 1e-3·|dense| over 30 layers (the observed error is about 5e-5).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from mechserve.cli.main import main
from mechserve.conformance import (
    FIXED_WORKLOADS,
    ContractViolation,
    KVMismatch,
    Target,
    check_contract,
    check_invariance,
    check_kv,
    check_replay,
    load_target,
    model_workload,
)
from mechserve.conformance.invariance import with_stops

from . import mutants as m
from .conftest import with_executor

pytestmark = pytest.mark.e2e

CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "replay": check_replay,
    "contract": check_contract,
    "kv": check_kv,
    "invariance": check_invariance,
}


@pytest.fixture(scope="module")
def smollm2() -> Target:
    return load_target("smollm2")


def fixed(target: Target, name: str) -> dict[str, Any]:
    workload = model_workload(FIXED_WORKLOADS[name], target.vocab_size)
    return with_stops(target, workload, {"b": 1, "q": 2})


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", list(FIXED_WORKLOADS))
def test_smollm2_conforms(smollm2: Target, name: str, check: str) -> None:
    stats = CHECKS[check](smollm2, fixed(smollm2, name))
    assert stats["runs"] >= 1 and stats["steps"] > 0


@pytest.mark.parametrize(
    ("cls", "check", "error", "message"),
    [
        (m.OneSlotOff, "contract", ContractViolation, r"step 0, rank 0: a: planned position 9 .* was not written"),
        (m.CorruptsPrefix, "kv", KVMismatch, r"after step 1, rank 0, a: K at position 0"),
    ],
)
def test_planted_faults_are_caught_on_smollm2(
    smollm2: Target, cls: type, check: str, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        CHECKS[check](with_executor(smollm2, cls), fixed(smollm2, "shared-prefix"))


def test_the_command_on_smollm2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mechserve.engine.executors.configure_threads", lambda: 1)
    code = main(["conform", "--workloads", "2", "--checks", "replay,contract,kv", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["target"] == "smollm2"
