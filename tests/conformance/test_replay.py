"""Check 1, trace replay: the real run's trace is the spec's trace for its verdicts and ids."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import pytest
from engine_runs import run_engine as generate
from hypothesis import given
from hypothesis import strategies as st

from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.conformance import ReplayMismatch, Target, check_replay, compare, real_workloads
from mechserve.conformance.replay import ReplayExecutor, replay
from mechserve.conformance.runner import build_engine, end_state, run_workload
from mechserve.conformance.strategies import build, cli_valid, prompt_tokens, workloads
from mechserve.spec import m16_request_draft_lengths as m16

from .conftest import CI


@CI
@given(workload=real_workloads(128))
def test_every_real_run_replays_on_the_spec(target: Target, workload: dict[str, Any]) -> None:
    check_replay(target, workload)


def explicit(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload with every prompt as explicit ``tokens`` (as the scripted engine sees it)."""
    reqs = [{**r, "tokens": prompt_tokens(workload, i)} for i, r in enumerate(workload["requests"])]
    return {**workload, "requests": reqs}


@CI
@given(
    workload=st.one_of(
        workloads(prompts="mixed", pool="tight", spec_len=(0, 3), scripts=True, world_size=(1, 3)),
        workloads(prompts="mixed", pool="fits", spec_len=(0, 3), scripts=True, admission=True),
    )
)
def test_the_scripted_executor_replays_itself(workload: dict[str, Any]) -> None:
    """Fed the scripted executor's own verdicts and ids, ``ReplayExecutor`` reproduces its trace exactly,
    accept scripts with out-of-range entries, EOS triggers and stop ids included."""
    engine = build(m16, workload, validate=cli_valid(workload))
    records = engine.run()
    replayed = replay(explicit(workload), records, eos_token_ids=(m16.EOS_TOKEN_ID,))
    compare(records, replayed, real_end=end_state(engine))


def test_the_product_engine_path_replays(target: Target, tiny_pair: Any) -> None:
    """``EngineCore`` (what ``mechserve generate`` and ``LLM`` run) produces a spec trace."""
    model, _ = tiny_pair
    prompts = [[40, 41, 42, 43, 44, 45, 46, 47, 48], [40, 41, 42, 43, 44, 45, 46, 47, 60, 61], [70, 71, 72]]
    fixed = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)  # the workload's spec_len, every step
    config = EngineConfig(max_step_tokens=6, page_size=4, num_pages=9, speculative=fixed)
    result = generate(model, prompts, 7, config=config, arrivals=[0, 1, 1])
    workload = {
        "engine": {
            "max_step_tokens": 6,
            "page_size": 4,
            "num_pages": result.num_pages,
            "spec_len": 2,
            "world_size": 1,
            "max_model_len": 512,
            "hold_shared_prefix": True,  # EngineConfig's default: r1 waits for the prefix r0 is computing
            "output_caching": True,  # EngineConfig's default: generated blocks are published too
        },
        "requests": [
            {"request_id": f"r{i}", "tokens": p, "max_new_tokens": 7, "arrival_step": a}
            for i, (p, a) in enumerate(zip(prompts, [0, 1, 1]))
        ],
    }
    assert any(rec.reused for rec in result.records) and any(rec.rolled_back for rec in result.records)
    assert any("r1 is held back" in line for rec in result.records for line in rec.explain)
    assert any("holding generated tokens" in line for rec in result.records for line in rec.explain)
    compare(result.records, replay(workload, result.records))


def test_a_run_with_aborts_between_steps_replays(target: Target) -> None:
    """Aborts (m12's ``abort`` between steps, as a serving loop does) are replayed from the ``aborted`` field."""
    workload = {
        "engine": {"max_step_tokens": 6, "page_size": 2, "num_pages": 16, "spec_len": 1, "world_size": 1},
        "requests": [
            {"request_id": "a", "tokens": [50, 51, 52, 53, 54], "max_new_tokens": 6},
            {"request_id": "b", "tokens": [50, 51, 52, 60], "max_new_tokens": 6},
            {"request_id": "c", "tokens": [70, 71], "max_new_tokens": 6, "arrival_step": 2},
        ],
    }
    executor = target.make_executor(16, 2)
    engine = build_engine(workload, [executor])
    records = [engine.step(), engine.step()]
    assert engine.abort("b") and engine.abort("c")
    records += engine.run()
    assert records[2].aborted == ("b", "c")
    compare(records, replay(workload, records), real_end=end_state(engine))


def test_a_tampered_trace_is_reported_at_its_step_and_field(target: Target) -> None:
    workload = {
        "engine": {"max_step_tokens": 5, "page_size": 2, "num_pages": 10, "spec_len": 2, "world_size": 1},
        "requests": [
            {"request_id": "a", "tokens": [50, 51, 52, 53], "max_new_tokens": 5},
            {"request_id": "b", "tokens": [60, 61], "max_new_tokens": 4, "arrival_step": 1},
        ],
    }
    real = run_workload(target, workload)
    k = next(i for i, rec in enumerate(real.records) if rec.drafted)
    rec = real.records[k]
    rid = next(iter(rec.drafted))
    forged = dict(rec.executed)
    forged[rid] += 1
    records = list(real.records)
    records[k] = dataclasses.replace(rec, executed=MappingProxyType(forged))
    with pytest.raises(ReplayMismatch, match=rf"first difference: step {k}, field executed: real=") as info:
        compare(records, replay(workload, real.records))
    assert info.value.step == k and info.value.field == "executed"


def test_a_replay_that_runs_out_of_recorded_ids_is_a_difference() -> None:
    item = m16.PlanItem("a", 3, 1, 0, True, ((3, 0, 3),), (9,), True, 1, (0,))
    with pytest.raises(Exception, match="recorded no more ids"):
        ReplayExecutor([]).execute((item,))
