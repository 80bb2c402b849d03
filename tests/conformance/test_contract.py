"""Check 2, the executor contract, measured from the tensors on every step of a real run."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given

from mechserve.conformance import CheckedExecutor, ContractViolation, Target, check_contract, real_workloads
from mechserve.conformance.contract import check_outcomes, check_writes
from mechserve.conformance.runner import build_engine, run_workload
from mechserve.spec import m16_request_draft_lengths as m16

from . import mutants as m
from .conftest import CI


@CI
@given(workload=real_workloads(128))
def test_the_torch_executor_keeps_the_contract_on_every_step(target: Target, workload: dict[str, Any]) -> None:
    check_contract(target, workload)


def state(engine: Any) -> Any:
    """Everything the commit, resolve and sample phases of a step could change."""
    return (
        engine.step_counter,
        [
            (r.request_id, r.state, r.computed, r.generated, list(r.output_ids), r.finish_reason)
            for r in engine.requests
        ],
        copy.deepcopy(engine.pool.slots),
        list(engine.pool.free),
        list(engine.pool.owner),
    )


class Snapshot:
    """Records the engine's state when the plan reaches the executor (after residency, before commit)."""

    def __init__(self, inner: Any, engine: Callable[[], Any]) -> None:
        self.inner, self.engine, self.at_execute = inner, engine, None

    def execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        self.at_execute = state(self.engine())
        return self.inner.execute(plan)


@pytest.mark.parametrize("cls", [m.OneSlotOff, m.OutOfOrder, m.CorruptsPrefix, m.OverReports])
def test_a_violation_raises_the_boundary_error_and_commits_nothing(tiny_pair: Any, target: Target, cls: type) -> None:
    model, _ = tiny_pair
    workload = {
        "engine": {"max_step_tokens": 12, "page_size": 4, "num_pages": 8, "spec_len": 2, "world_size": 1},
        "requests": [
            {"request_id": "a", "tokens": [40, 41, 42, 43, 44, 45], "max_new_tokens": 4},
            {"request_id": "b", "tokens": [40, 41, 42, 43, 44, 50], "max_new_tokens": 4, "arrival_step": 1},
        ],
    }
    holder: list[Any] = []
    checked = CheckedExecutor(cls(model, 8, 4), target.kv_of)
    snap = Snapshot(checked, lambda: holder[0])
    engine = build_engine(workload, [snap])
    holder.append(engine)
    with pytest.raises(m16.BoundaryViolation) as info:
        engine.run()
    assert isinstance(info.value, ContractViolation)
    assert state(engine) == snap.at_execute


def item(rid: str = "a", start: int = 4, n: int = 3, decode: bool = True, sample: bool = True) -> m16.PlanItem:
    placements = tuple((p, 1, p % 4) for p in range(start, start + n))
    return m16.PlanItem(rid, start, n, n - 1 if decode else 0, decode, placements, (7,), sample, 1, (0, 1))


def outcome(it: m16.PlanItem, **changes: Any) -> m16.Outcome:
    base = m16.Outcome(it.request_id, it.start_position, it.num_tokens, 0, it.placements, (5,) if it.sample else ())
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("plan", "outcomes", "message"),
    [
        ((item(),), (), r"0 outcome\(s\) for 1 plan item\(s\)"),
        ((item(), item("b")), (outcome(item("b")), outcome(item())), r"outcome 0 is for 'b' where 'a' was planned"),
        ((item(),), (outcome(item(), start_position=5),), r"a: outcome starts at 5, planned 4"),
        ((item(),), (outcome(item(), executed_tokens=2),), r"a: executed 2 token\(s\), planned 3"),
        ((item(),), (outcome(item(), writes=item().placements[:2]),), r"a: reported writes differ"),
        ((item(),), (outcome(item(), accepted_draft_tokens=3, token_ids=(1,) * 4),), r"acceptance 3 outside \[0, 2\]"),
        ((item(),), (outcome(item(), accepted_draft_tokens=-1, token_ids=()),), r"acceptance -1 outside \[0, 2\]"),
        (
            (item(decode=False),),
            (outcome(item(decode=False), accepted_draft_tokens=1, token_ids=(1, 2)),),
            r"acceptance 1 outside \[0, 0\] \(not a decode window\)",
        ),
        ((item(),), (outcome(item(), token_ids=(1, 2)),), r"2 token id\(s\) appended, expected 1"),
        (
            (item(sample=False),),
            (outcome(item(sample=False), token_ids=(1,)),),
            r"1 token id\(s\) appended, expected 0",
        ),
        ((item(),), (outcome(item(), token_ids=(128,)),), r"appended id 128 is not a token id"),
    ],
)
def test_each_answer_rule_has_its_message(plan: Any, outcomes: Any, message: str) -> None:
    with pytest.raises(ContractViolation, match=message):
        check_outcomes(plan, outcomes, vocab_size=128)


def test_a_non_float_cache_counts_a_changed_slot_as_written() -> None:
    plan = (item(n=2),)
    k = torch.zeros(1, 2, 4, 1, dtype=torch.int32)
    before = (k.clone(), k.clone())
    k[0, 1, 0] = 3  # position 4 written, position 5 not
    with pytest.raises(ContractViolation, match=r"planned position 5 \(page 1, offset 1\) was not written"):
        check_writes(plan, (k, k.clone()), before, poisoned=False)


SPECULATIVE = {
    "engine": {"max_step_tokens": 16, "page_size": 2, "num_pages": 16, "spec_len": 3, "world_size": 1},
    "requests": [
        {"request_id": "a", "tokens": [40, 41, 42, 43, 44], "max_new_tokens": 7},
        {"request_id": "b", "tokens": [40, 41, 42, 50], "max_new_tokens": 6, "arrival_step": 1},
    ],
}


def test_skipped_rejected_guesses_pass_unless_strict(mutant: Callable[[type], Target]) -> None:
    """Not writing a rejected guess's slot is unobservable (the step rolls it back), so it is allowed;
    ``strict`` names it."""
    lazy = mutant(m.SkipsRejectedGuesses)
    check_contract(lazy, SPECULATIVE)
    with pytest.raises(
        ContractViolation, match=r"step 1, rank 0: a: planned position 6 \(page 3, offset 0\) was not written"
    ):
        check_contract(lazy, SPECULATIVE, strict=True)


def test_the_check_leaves_the_cache_as_the_executor_would(target: Target) -> None:
    plain = run_workload(target, SPECULATIVE)
    checked = run_workload(target, SPECULATIVE, wrap=lambda rank, ex: CheckedExecutor(ex, target.kv_of))
    assert [r.to_json() for r in plain.records] == [r.to_json() for r in checked.records]
    for a, b in zip(target.kv_of(plain.executors[0]), target.kv_of(checked.executors[0])):
        assert torch.equal(a, b)
