"""Forced runs (m14) on real tensors: the torch executor fills ``Outcome.forced`` from a per-request source.

A ``ScriptedForcer`` forces ids the greedy run without forcing produces (a grammar that allows only
what the model would choose anyway), so with forcing on the greedy ids must be identical, token for
token, while the engine runs fewer target forwards: each forced id is appended without a sampling
step and computed, with the ids around it, in one chunk.  Also under prompt-lookup speculation,
chunked prefill and preemption, through ``EngineCore``, and with a stop id inside a forced run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch
from engine_runs import run_engine
from tiny_checkpoints import Tiny, random_prompts

from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.executor.forcing import ForcedSource, ScriptedForcer
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.spec import m16_request_draft_lengths as m16

PROMPTS = random_prompts([5, 9, 12], seed=7)
NEW = 20
RUNS = {2: 4, 8: 6, 15: 3}  # after output index i, force the next RUNS[i] greedy ids
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Run:
    outputs: dict[str, list[int]]
    finish: dict[str, str | None]
    records: list[m16.StepRecord]
    executor: TorchExecutor


def run(
    tiny: Tiny,
    prompts: Sequence[Sequence[int]],
    *,
    forcers: dict[str, ForcedSource] | None = None,
    spec: SpeculativeConfig | None = None,
    budget: int = 64,
    page_size: int = 4,
    num_pages: int = 96,
    stop_token_ids: tuple[int, ...] = (),
    logprobs: int | None = None,
) -> Run:
    ex = TorchExecutor(tiny.model, num_pages, page_size, speculative=spec)
    requests = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=logprobs)
        ex.add_request(ExecutorRequest(f"r{i}", p, params))
        if forcers and f"r{i}" in forcers:
            ex.set_forcer(f"r{i}", forcers[f"r{i}"])
        requests.append(m16.Request(f"r{i}", list(p), NEW, stop_token_ids=stop_token_ids))
    engine = m16.Engine(
        requests, budget, page_size, num_pages, spec_len=spec.num_speculative_tokens if spec else 0, executors=[ex]
    )

    def done(record: m16.StepRecord) -> None:
        engine.check_invariants()
        ex.settle(record.accepted)
        for rid in record.finished:
            ex.release(rid)

    records = engine.run(done)
    return Run(
        {r.request_id: list(r.output_ids) for r in requests},
        {r.request_id: r.finish_reason.value if r.finish_reason else None for r in requests},
        records,
        ex,
    )


def forcers_for(plain: Run) -> dict[str, ForcedSource]:
    return {rid: ScriptedForcer(ids, RUNS) for rid, ids in plain.outputs.items()}


@pytest.fixture(scope="module")
def plain(tiny: Tiny) -> Run:
    return run(tiny, PROMPTS)


def test_forcing_greedy_ids_changes_no_id_and_saves_forwards(tiny: Tiny, plain: Run) -> None:
    forced = run(tiny, PROMPTS, forcers=forcers_for(plain))
    assert forced.outputs == plain.outputs and forced.finish == plain.finish
    stats, base = forced.executor.stats(), plain.executor.stats()
    assert stats.forced == len(PROMPTS) * sum(RUNS.values())
    assert sum(sum(r.forced.values()) for r in forced.records) == stats.forced
    # every forced id is one sampling step fewer for its request; at batch 1 one forward fewer
    assert stats.forwards < base.forwards
    one = run(tiny, PROMPTS[:1], forcers={"r0": ScriptedForcer(plain.outputs["r0"], RUNS)})
    assert one.outputs["r0"] == plain.outputs["r0"]
    alone = run(tiny, PROMPTS[:1])
    assert one.executor.stats().forwards == alone.executor.stats().forwards - sum(RUNS.values())


def test_a_forced_run_is_computed_as_one_chunk_with_no_guesses(tiny: Tiny, plain: Run) -> None:
    forced = run(tiny, PROMPTS[:1], forcers={"r0": ScriptedForcer(plain.outputs["r0"], RUNS)}, spec=NGRAM)
    assert forced.outputs["r0"] == plain.outputs["r0"]
    steps = [r for r in forced.records if r.forced]
    assert steps
    for rec in steps:
        after = forced.records[rec.step + 1]
        assert after.executed["r0"] == 1 + rec.forced["r0"] and "r0" not in after.drafted


@pytest.mark.parametrize(
    "shape",
    [
        {"spec": NGRAM},
        {"budget": 5},  # chunked prefill, forced runs split over steps
        {"page_size": 2, "num_pages": 24, "budget": 24},  # preemption by recompute
    ],
)
def test_forcing_is_exact_under_speculation_chunking_and_preemption(tiny: Tiny, plain: Run, shape: dict) -> None:
    got = run(tiny, PROMPTS, forcers=forcers_for(plain), **shape)
    assert got.outputs == plain.outputs
    assert got.executor.stats().forced > 0
    if "num_pages" in shape:
        assert any(r.preempted for r in got.records)


def test_a_stop_id_inside_a_forced_run_ends_the_request_at_it(tiny: Tiny, plain: Run) -> None:
    ids = plain.outputs["r0"]
    stop = ids[10]  # inside the run forced after index 8
    assert stop not in ids[:10]
    got = run(tiny, PROMPTS[:1], forcers={"r0": ScriptedForcer(ids, RUNS)}, stop_token_ids=(stop,))
    assert got.outputs["r0"] == ids[:11] and got.finish["r0"] == "STOP"


def test_a_request_that_asks_for_logprobs_is_not_forced(tiny: Tiny, plain: Run) -> None:
    got = run(tiny, PROMPTS[:1], forcers={"r0": ScriptedForcer(plain.outputs["r0"], RUNS)}, logprobs=1)
    assert got.outputs["r0"] == plain.outputs["r0"] and got.executor.stats().forced == 0


def test_engine_core_streams_forced_ids_as_outputs(tiny: Tiny, plain: Run) -> None:
    ex = TorchExecutor(tiny.model, 96, 16)
    for i, ids in enumerate(plain.outputs.values()):
        ex.set_forcer(f"r{i}", ScriptedForcer(ids, RUNS))
    got = run_engine(tiny.model, PROMPTS, NEW, config=EngineConfig(num_pages=96, page_size=16), executor=ex)
    assert [list(c.token_ids) for c in got.completions] == list(plain.outputs.values())
    assert ex.stats().forced == len(PROMPTS) * sum(RUNS.values())
