"""Greedy ids through the m12 engine and the torch executor equal transformers' ``generate``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from engine_runs import Run as GenerateResult
from engine_runs import run_engine as generate
from tiny_checkpoints import Tiny, hf_greedy, random_prompts

from mechserve.api.config import EngineConfig, SpeculativeConfig

NEW = 12
FIXED_3 = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)  # every window carries 3 guesses


def assert_parity(tiny: Tiny, prompts: Sequence[Sequence[int]], result: GenerateResult, new: int = NEW) -> None:
    for prompt, done in zip(prompts, result.completions):
        assert list(done.token_ids) == hf_greedy(tiny.hf, prompt, new), done.request_id


def total(result: GenerateResult, field: str) -> int:
    return sum(len(v) if isinstance(v, tuple) else sum(v.values()) for v in (getattr(r, field) for r in result.records))


def test_default_config(tiny: Tiny) -> None:
    prompts = random_prompts([5, 17, 9, 30])
    result = generate(tiny.model, prompts, NEW)
    assert_parity(tiny, prompts, result)
    assert all(c.finish_reason == "LENGTH" for c in result.completions)


def test_tiny_budget_chunks_prefill(tiny: Tiny) -> None:
    prompts = random_prompts([23, 14, 9], seed=2)
    result = generate(tiny.model, prompts, NEW, config=EngineConfig(max_step_tokens=5, page_size=4))
    assert_parity(tiny, prompts, result)
    assert any(n < len(p) for r in result.records for rid, n in r.executed.items() for p in [prompts[int(rid[1:])]])


def test_tiny_pool_preempts_and_recomputes(tiny: Tiny) -> None:
    prompts = random_prompts([11, 13, 7, 9], seed=4)
    result = generate(tiny.model, prompts, 16, config=EngineConfig(max_step_tokens=64, page_size=4, num_pages=9))
    assert_parity(tiny, prompts, result, 16)
    assert total(result, "preempted") > 0


def test_prefix_sharing(tiny: Tiny) -> None:
    """Long common prefix, page size 4: late arrivals reuse cached pages; same-step twins adopt them."""
    (common,) = random_prompts([18], seed=5)
    tails = random_prompts([3, 5, 2, 4, 1], seed=6)
    prompts = [common + t for t in tails]
    result = generate(
        tiny.model, prompts, NEW, config=EngineConfig(page_size=4, max_step_tokens=32), arrivals=[0, 0, 1, 3, 3]
    )
    assert_parity(tiny, prompts, result)
    assert total(result, "reused") >= 3 * 16
    assert total(result, "published") > 0


def test_page_size_one(tiny: Tiny) -> None:
    prompts = random_prompts([6, 3, 10], seed=7)
    result = generate(tiny.model, prompts, NEW, config=EngineConfig(page_size=1, max_step_tokens=8))
    assert_parity(tiny, prompts, result)


def test_spec_len_three(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    # the governor's static prices: whether prompt lookup drafts on random ids is then the same on every machine
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    prompts = random_prompts([5, 8, 12, 3], seed=8)
    result = generate(tiny.model, prompts, 20, config=EngineConfig(spec_len=3, page_size=4))
    assert_parity(tiny, prompts, result, 20)
    assert total(result, "drafted") > 0


def test_spec_with_an_oracle_drafter_accepts_across_pages(tiny: Tiny) -> None:
    """A drafter that knows transformers' answer: every guess is accepted, pages fill several at a time."""
    prompts = random_prompts([5, 9], seed=9)
    want = {tuple(p): hf_greedy(tiny.hf, p, 20) for p in prompts}

    def oracle(history: Sequence[int], num: int, max_ngram: int = 3) -> list[int]:
        for p, cont in want.items():
            if tuple(history[: len(p)]) == p:
                full = list(p) + cont
                return (full[len(history) : len(history) + num] + [0] * num)[:num]
        raise AssertionError("unknown history")

    result = generate(tiny.model, prompts, 20, config=EngineConfig(speculative=FIXED_3, page_size=2), proposer=oracle)
    assert_parity(tiny, prompts, result, 20)
    assert total(result, "rolled_back") == 0
    assert total(result, "accepted") == total(result, "drafted") > 0


def test_spec_with_a_wrong_drafter_rolls_back(tiny: Tiny) -> None:
    prompts = random_prompts([7, 4], seed=10)
    want = {tuple(p): hf_greedy(tiny.hf, p, 15) for p in prompts}

    def half_right(history: Sequence[int], num: int, max_ngram: int = 3) -> list[int]:
        for p, cont in want.items():
            if tuple(history[: len(p)]) == p:
                right = (list(p) + cont + [0] * num)[len(history) : len(history) + num]
                return right[:1] + [(t + 1) % 128 for t in right[1:]]
        raise AssertionError("unknown history")

    config = EngineConfig(speculative=FIXED_3, page_size=2, num_pages=12)
    result = generate(tiny.model, prompts, 15, config=config, proposer=half_right)
    assert_parity(tiny, prompts, result, 15)
    assert total(result, "rolled_back") > 0 and total(result, "accepted") > 0


def test_eos_finishes_like_transformers(tiny: Tiny) -> None:
    prompts = random_prompts([6, 10, 4], seed=11)
    eos = hf_greedy(tiny.hf, prompts[0], NEW)[4]
    result = generate(tiny.model, prompts, NEW, eos_token_ids=[eos], config=EngineConfig(spec_len=2))
    for prompt, done in zip(prompts, result.completions):
        assert list(done.token_ids) == hf_greedy(tiny.hf, prompt, NEW, eos_token_id=eos)
    assert result.completions[0].finish_reason == "EOS"
    assert result.completions[0].token_ids[-1] == eos


def test_all_mechanisms_at_once(tiny: Tiny) -> None:
    (common,) = random_prompts([12], seed=12)
    prompts = [common + t for t in random_prompts([2, 9, 1, 6, 3, 11], seed=13)]
    config = EngineConfig(max_step_tokens=10, page_size=2, num_pages=30, spec_len=2)
    result = generate(tiny.model, prompts, 14, config=config, arrivals=[0, 0, 2, 2, 5, 9])
    assert_parity(tiny, prompts, result, 14)
