"""Tensor-parallel ranks behind m11's group: real processes (gloo), real shards, the join's checks.

The tiny model has 6 Q heads in 3 KV groups of 2, so world size 2 splits a group (KV head 1 is
replicated and each rank pads one short group) and world size 4 gives ranks of 1 and 2 heads
with KV head 2 replicated.  Spawning ranks costs seconds, so each group is started once per
module and shared.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_checkpoints import random_prompts, save_tiny, tiny_config

from mechserve.api.config import EngineConfig
from mechserve.api.errors import RankError
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.model.loader import LoadedModel, load_model
from mechserve.model.sharded import HeadSplit, RankShape, full_parameter_count
from mechserve.spec import m16_request_draft_lengths as m16

HEADS, KV_HEADS, HIDDEN = 6, 3, 48
CONFIG = EngineConfig(num_pages=48, page_size=4, max_step_tokens=16, spec_len=2)
PROMPTS = random_prompts([5, 17, 9, 12])
# Greedy, greedy with prompt lookup, a seeded sampled request, a shared prefix (prefix caching).
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=8),
    SamplingParams(temperature=0.0, max_tokens=6),
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("tiny-tp")
    config = tiny_config(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, hidden_size=HIDDEN)
    save_tiny(path, config)
    return load_model(str(path), tokenizer=False)


def generate(core: EngineCore, *, plant: tuple[int, str] | None = None) -> dict[str, list[int]]:
    """Every prompt (the last one sharing the second's prefix) to the end; ids per request id."""
    prompts = [*PROMPTS[:3], PROMPTS[1][:8] + PROMPTS[3]]
    for i, (p, params) in enumerate(zip(prompts, PARAMS)):
        core.add_request(p, params, request_id=f"r{i}")
    if plant is not None:
        assert core.executor is not None
        core.executor.plant(*plant)
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        step = core.step()
        out.update((o.request_id, o.outputs[0].token_ids) for o in step.finished)
    return out


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> dict[str, list[int]]:
    return generate(EngineCore(loaded, CONFIG))


@pytest.fixture(scope="module")
def cores(loaded: LoadedModel) -> Iterator[dict[int, EngineCore]]:
    """World-size-N cores, started on first use and shared by the module's tests."""
    started: dict[int, EngineCore] = {}
    yield started
    for core in started.values():
        core.close()


def core_of(cores: dict[int, EngineCore], loaded: LoadedModel, world_size: int) -> EngineCore:
    core = cores.get(world_size)
    if core is None or core.executor is None or core.executor.closed:
        core = cores[world_size] = EngineCore(loaded, CONFIG.replace(world_size=world_size))
    return core


def gone(pids: list[int]) -> bool:
    """Whether none of ``pids`` is a live process of ours (zombies reaped by join count as gone)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


# The split itself (no processes) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv", "world"), [(9, 3, 2), (9, 3, 4), (6, 3, 2), (6, 3, 4), (8, 2, 4), (4, 4, 2)])
def test_heads_partition_the_q_heads_and_each_rank_holds_the_kv_heads_it_reads(heads, kv, world) -> None:
    g = heads // kv
    splits = [HeadSplit.of(heads, kv, world, r) for r in range(world)]
    assert [q for s in splits for q in range(*s.q)] == list(range(heads))
    for s in splits:
        assert {q // g for q in range(*s.q)} == set(range(*s.kv))  # exactly the KV heads its Q heads read
        assert abs(s.num_q - heads / world) < 1
        slots = s.slots if s.slots is not None else tuple(range(s.num_q))
        assert len(set(slots)) == s.num_q and max(slots) < s.num_kv * s.group
        for q, slot in zip(range(*s.q), slots):  # a Q head's padded slot lies in its KV head's group
            assert slot // s.group == q // g - s.kv[0]
    # A KV head is held once more for every rank boundary that falls inside its group of Q heads.
    inner_boundaries = sum(1 for s in splits[1:] if s.q[0] % g != 0)
    assert sum(s.num_kv for s in splits) - kv == inner_boundaries
    if (heads, kv, world) == (9, 3, 2):  # SmolLM2: rank 0 Q0-4 / KV 0,1, rank 1 Q5-8 / KV 1,2
        assert [(s.q, s.kv) for s in splits] == [((0, 5), (0, 2)), ((5, 9), (1, 3))]
    if kv % world == 0:
        assert inner_boundaries == 0 and all(s.slots is None for s in splits)


def test_a_world_larger_than_the_heads_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(ValueError, match="world size 8 exceeds the model's 6 attention heads"):
        RankShape.of(loaded.model.arch, 8, 0)
    with pytest.raises(ValueError, match="exceeds the model's 6 attention heads"):
        EngineCore(loaded, EngineConfig(num_pages=8, world_size=8))


# Real ranks -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_generate_what_one_process_generates(cores, loaded, reference, world_size: int) -> None:
    core = core_of(cores, loaded, world_size)
    assert generate(core) == reference
    assert core.scheduler.spec_engine.world_size == world_size
    core.check_pages()


def test_ranks_apply_penalties_and_record_prompt_logprobs_as_one_process(cores, loaded) -> None:
    """Penalties need each rank's history, prompt logprobs the extra LM-head rows and, for a cached prefix,
    the recompute (a collective forward every rank runs): all of it gives one process's results."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=2.0, prompt_logprobs=2),
        SamplingParams(temperature=0.9, seed=5, max_tokens=6, frequency_penalty=1.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, presence_penalty=1.5),  # cached prefix
    ]
    prompts = [PROMPTS[1], PROMPTS[2], [*PROMPTS[1][:12], 7, 8]]

    def outputs(core: EngineCore) -> list[tuple[list[int], list[tuple[float, ...]]]]:
        got = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            core.add_request(p, sp, request_id=f"p{i}")
            while core.has_unfinished():  # one at a time, so the third reuses the first's prompt pages
                for o in core.step().finished:
                    lps = (
                        [tuple(lp.logprob for lp in e.values()) for e in o.prompt_logprobs[1:]]
                        if o.prompt_logprobs
                        else []
                    )
                    got.append((o.outputs[0].token_ids, lps))
        return got

    want = outputs(EngineCore(loaded, CONFIG))
    got = outputs(core_of(cores, loaded, 2))
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert len(a) == len(b) and all(abs(x - y) < 1e-4 for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_ranks_count_speculation_as_one_process_does(cores, loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``settle`` reaches every rank: rank 0's counters after a speculative run (prompt lookup, spec_len 2)
    are the one-process executor's, decode window for decode window (the governor on the static cost model
    in both, so that both choose the same spec_len: measured costs differ between two processes)."""
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    # Both fresh: a core that ran these prompts before has their blocks cached (prefix and output caching),
    # so its windows would differ from a fresh one's for a reason that is not the ranks.
    one = EngineCore(loaded, CONFIG)
    two = EngineCore(loaded, CONFIG.replace(world_size=2))
    try:
        assert generate(one) == generate(two)
        ranks = two.stats(executor=True).executor
        alone = one.stats(executor=True).executor
    finally:
        two.close()
    for name in ("windows", "slots", "proposed", "accepted", "emitted"):
        assert getattr(ranks, name) == getattr(alone, name), name
    assert alone.windows > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shards_sum_to_the_model_with_replicated_kv_heads_and_norms(cores, loaded, world_size: int) -> None:
    """Exact relation: sharded parts partition the model; each replicated KV head is counted once per
    rank that holds it; norms (and row-parallel biases) are whole on every rank."""
    arch = loaded.model.arch
    counts = core_of(cores, loaded, world_size).executor.parameter_counts()  # type: ignore[union-attr]
    kv_per_head = arch.num_layers * 2 * arch.head_dim * arch.hidden_size  # K and V rows of one KV head
    replicated = arch.num_layers * 2 * arch.hidden_size + arch.hidden_size  # two norms per layer, final norm
    kv_held = sum(HeadSplit.of(HEADS, KV_HEADS, world_size, r).num_kv for r in range(world_size))
    assert kv_held > KV_HEADS  # this model's split does replicate
    full = full_parameter_count(loaded.model)
    assert all(c["replicated"] == replicated for c in counts)
    assert sum(c["kv"] for c in counts) == kv_held * kv_per_head
    assert sum(c["sharded"] for c in counts) == full - KV_HEADS * kv_per_head - replicated
    total = sum(sum(c.values()) for c in counts)
    assert total == full + (world_size - 1) * replicated + (kv_held - KV_HEADS) * kv_per_head


def test_a_planted_disagreement_is_a_group_violation_and_stops_the_group(cores, loaded) -> None:
    core = core_of(cores, loaded, 2)
    assert core.executor is not None
    pids = core.executor.pids  # type: ignore[attr-defined]
    with pytest.raises(m16.GroupViolation, match="rank 1 disagrees with rank 0"):
        generate(core, plant=(1, "disagree"))
    assert core.executor.closed and gone(pids)


def test_a_rank_error_is_reported_as_itself(loaded, capfd) -> None:
    """A rank that fails answers with its error and exits cleanly: the driver names that error, not
    the clean exit (which once hid it), and the rank prints no traceback."""
    core = EngineCore(loaded, CONFIG.replace(world_size=2), rank_timeout_s=60)
    assert core.executor is not None
    pids = core.executor.pids  # type: ignore[attr-defined]
    with pytest.raises(RankError, match="rank 1: RuntimeError: planted rank failure") as info:
        generate(core, plant=(1, "raise"))
    assert "exited" not in str(info.value)
    assert core.executor.closed and gone(pids)
    assert "Traceback" not in capfd.readouterr().err


def test_a_killed_rank_is_an_error_not_a_hang(loaded) -> None:
    core = EngineCore(loaded, CONFIG.replace(world_size=2), rank_timeout_s=60)
    assert core.executor is not None
    pids = core.executor.pids  # type: ignore[attr-defined]
    core.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    core.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        while core.has_unfinished():
            core.step()
    assert core.executor.closed and gone(pids)
    with pytest.raises(RankError, match="shut down"):
        core.executor.stats()


@pytest.mark.slow
def test_a_hung_rank_is_an_error_after_the_timeout(loaded) -> None:
    core = EngineCore(loaded, CONFIG.replace(world_size=2), rank_timeout_s=3)
    assert core.executor is not None
    pids = core.executor.pids  # type: ignore[attr-defined]
    core.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))
    core.step()
    core.executor.plant(0, "hang")
    with pytest.raises(RankError, match=r"did not answer 'execute' within 3 s"):  # the timeout, not a kill
        core.step()
    assert core.executor.closed and gone(pids)


def test_closing_stops_every_rank(cores, loaded) -> None:
    core = core_of(cores, loaded, 4)
    assert core.executor is not None
    pids = core.executor.pids  # type: ignore[attr-defined]
    assert not gone(pids)
    core.close()
    core.close()  # idempotent
    assert gone(pids)
    with pytest.raises(RankError, match="shut down"):
        core.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
        core.step()


def test_a_draft_model_with_ranks_is_refused(loaded) -> None:
    from mechserve.api.config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_model=f"{loaded.path}:layers=1")
    with pytest.raises(ValueError, match=r"draft model.* does not run with world_size > 1"):
        EngineCore(loaded, EngineConfig(num_pages=8, speculative=spec, world_size=2))


def test_the_path_is_needed(loaded) -> None:
    fake = LoadedModel(Path("/nonexistent"), loaded.model, None, ())
    fake.path = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="loaded from a directory"):
        EngineCore(fake, EngineConfig(num_pages=8, world_size=2))


def test_a_model_without_weights_is_only_for_a_driver_of_ranks(loaded) -> None:
    shape = load_model(str(loaded.path), tokenizer=False, weights=False)
    assert shape.model.arch == loaded.model.arch and not hasattr(shape.model, "layers")
    with pytest.raises(ValueError, match="needs world_size > 1"):
        EngineCore(shape, EngineConfig(num_pages=8))


def test_ranks_speculate_with_suffix_decoding_as_one_process_does(loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """Suffix decoding keeps state across steps and requests (its trees) and only rank 0 answers the governor's
    ``advise``: every rank must still draft the same guesses, so two ranks generate and count what one
    process does (the governor on the static cost model in both, as above)."""
    from mechserve.api.config import SpeculativeConfig

    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    config = CONFIG.replace(spec_len=0, speculative=SpeculativeConfig(method="suffix", num_speculative_tokens=3))
    one = EngineCore(loaded, config)
    two = EngineCore(loaded, config.replace(world_size=2))
    try:
        assert generate(one) == generate(two)
        assert generate(one) == generate(two)  # again: the global trees now hold the first round's outputs
        ranks = two.stats(executor=True).executor
        alone = one.stats(executor=True).executor
    finally:
        two.close()
    for name in ("windows", "slots", "proposed", "accepted", "emitted"):
        assert getattr(ranks, name) == getattr(alone, name), name
    assert alone.proposed > 0
