"""Check 3, the KV audit: K/V read back through every page table equal a dense forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given

from mechserve.conformance import KVAuditor, KVMismatch, Target, check_kv, real_workloads
from mechserve.conformance.runner import RealRun, run_workload
from mechserve.spec import m16_request_draft_lengths as m16

from .conftest import CI


@CI
@given(workload=real_workloads(128))
def test_paged_state_equals_a_dense_forward_after_every_step(target: Target, workload: dict[str, Any]) -> None:
    check_kv(target, workload)


SPECULATIVE = {
    "engine": {"max_step_tokens": 16, "page_size": 4, "num_pages": 12, "spec_len": 3, "world_size": 2},
    "requests": [
        {"request_id": "a", "tokens": [40, 41, 42, 43, 44, 45, 46], "max_new_tokens": 9},
        {"request_id": "b", "tokens": [40, 41, 42, 43, 44, 45, 90], "max_new_tokens": 6, "arrival_step": 1},
    ],
}


def test_stale_kv_of_rejected_guesses_past_the_frontier_is_not_flagged(target: Target) -> None:
    """After a rollback the first rolled-back slot still holds the rejected guess's K/V, which differs
    from the dense K/V of the id that now sits at that position; the audit reads only [0, computed)."""
    stale: list[tuple[int, str]] = []
    auditor = KVAuditor(target)

    def on_step(run: RealRun, record: m16.StepRecord) -> None:
        auditor.snapshot(run, record)
        ps = run.engine.pool.page_size
        for r in run.engine.running:
            p = r.computed
            if record.rolled_back.get(r.request_id) and p // ps < len(r.page_table):
                k, _ = target.kv_of(run.executors[0])
                held = k[:, r.page_table[p // ps], p % ps]
                want, _ = target.dense_kv([*r.tokens, *r.output_ids][: p + 1])
                if not torch.allclose(held, want[:, p], atol=1e-3):
                    stale.append((record.step, r.request_id))

    run_workload(target, SPECULATIVE, on_step=on_step)
    assert stale, "the workload should leave a rejected guess's K/V past a frontier"
    assert auditor.verify() > 0


def test_the_audit_covers_every_rank_and_cache_page(target: Target) -> None:
    auditor = KVAuditor(target)
    run = run_workload(target, SPECULATIVE, on_step=auditor.snapshot)
    auditor.verify()
    assert {c.rank for c in auditor.copies} == {0, 1}
    assert any(c.label.startswith("cache page") for c in auditor.copies)
    assert any(rec.reused for rec in run.records)


def test_the_audit_covers_generated_blocks_in_the_cache(target: Target) -> None:
    """With output caching the cache holds blocks of generated ids; the audit compares each against the dense
    K/V of the prompt and output ids its key chain spells, and catches one corrupted after publishing."""
    workload = {**SPECULATIVE, "engine": {**SPECULATIVE["engine"], "output_caching": True, "world_size": 1}}
    auditor = KVAuditor(target)
    run = run_workload(target, workload, on_step=auditor.snapshot)
    assert auditor.verify() > 0
    prompts = {tuple(r.tokens) for r in run.engine.requests}
    generated = [
        c
        for c in auditor.copies
        if c.label.startswith("cache page")
        and not any(c.tokens[: len(p)] == p and len(c.tokens) <= len(p) for p in prompts)
    ]
    assert generated, "no cached block holding generated ids was audited"
    corrupted = KVAuditor(target)
    hit: list[int] = []

    def on_step(run: RealRun, record: m16.StepRecord) -> None:
        a = run.engine.requests[0]
        cached = [p for p in a.page_table if run.engine.pool.owner[p] is m16.CACHE]
        if not hit and len(cached) * 4 > len(a.tokens):  # a's first block past its prompt is cached
            k, _ = target.kv_of(run.executors[0])
            k[0, cached[-1], 3] += 0.5
            hit.append(cached[-1])
        corrupted.snapshot(run, record)

    run_workload(target, workload, on_step=on_step)
    assert hit
    # position 7, a's first generated id, read by a and by the cache's audit alike (a is reported: same step)
    pattern = rf"rank 0, (a|cache page {hit[0]}): K at position 7 \(page {hit[0]}, offset 3\), layer 0"
    with pytest.raises(KVMismatch, match=pattern):
        corrupted.verify()


def test_a_mismatch_names_step_rank_request_position_and_tolerance(target: Target) -> None:
    """Corrupt one cached page between steps (behind the executor's back): the audit reports it."""
    auditor = KVAuditor(target)

    def on_step(run: RealRun, record: m16.StepRecord) -> None:
        if record.step == 1:
            k, _ = target.kv_of(run.executors[1])
            page = run.engine.requests[0].page_table[0]
            k[1, page, 2] += 0.5
        auditor.snapshot(run, record)

    # Rank 1 now reads different K/V than rank 0, so the ranks disagree at the next step (m11's join).
    with pytest.raises(m16.GroupViolation, match="rank 1 disagrees with rank 0"):
        run_workload(target, SPECULATIVE, on_step=on_step)
    pattern = r"kv: after step 1, rank 1, a: K at position 2 \(page \d+, offset 2\), layer 1"
    with pytest.raises(KVMismatch, match=pattern) as info:
        auditor.verify()
    assert "tolerance 0.0001 + 0.0001·|dense|" in str(info.value)


def test_an_auditor_needs_tensors_and_a_reference(target: Target) -> None:
    import dataclasses

    with pytest.raises(Exception, match="cannot run"):
        KVAuditor(dataclasses.replace(target, dense_kv=None))
