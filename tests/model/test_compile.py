"""``EngineConfig.compile``: the compiled decoder blocks give the eager model's greedy tokens.

Compiling takes a minute or more on the 2-core machine (inductor builds C++ for each graph), hence
``slow``.  The CPU's measured effect is in docs/benchmarks.md ("torch.compile of the decode step").
"""

from __future__ import annotations

import pytest
from engine_runs import run_engine
from tiny_checkpoints import Tiny, hf_greedy, random_prompts

from mechserve.api.config import EngineConfig


@pytest.mark.slow
def test_compiled_greedy_equals_eager_and_transformers(tiny: Tiny) -> None:
    # 1-token decode rows, 2-3 row decode steps (linear's padding) and long prefill chunks: each graph
    prompts = random_prompts([5, 17, 9, 30], seed=14)
    for config in (EngineConfig(compile=True), EngineConfig(compile=True, spec_len=3, page_size=4)):
        run = run_engine(tiny.model, prompts, 12, config=config)
        eager = run_engine(tiny.model, prompts, 12, config=config.replace(compile=False))
        assert [c.token_ids for c in run.completions] == [c.token_ids for c in eager.completions]
        for prompt, done in zip(prompts, run.completions):
            assert list(done.token_ids) == hf_greedy(tiny.hf, prompt, 12)
    (one,) = random_prompts([7], seed=15)
    alone = run_engine(tiny.model, [one], 6, config=EngineConfig(compile=True))  # batch 1: the T=1 graph
    assert list(alone.completions[0].token_ids) == hf_greedy(tiny.hf, one, 6)
