"""End to end on the embedded SmolLM2-135M (9 Q heads, 3 KV heads): two ranks generate what one does."""

from __future__ import annotations

import pytest

from mechserve.entrypoints.llm import LLM, SamplingParams
from mechserve.model.loader import load_model
from mechserve.model.sharded import HeadSplit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
]


def test_world_size_2_greedy_equals_world_size_1_on_smollm2() -> None:
    loaded = load_model("smollm2")
    arch = loaded.model.arch
    assert (arch.num_heads, arch.num_kv_heads) == (9, 3)
    assert [HeadSplit.of(9, 3, 2, r).kv for r in range(2)] == [(0, 2), (1, 3)]  # KV head 1 on both ranks
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(loaded, num_pages=64).generate(PROMPTS, params, use_tqdm=False)]
    with LLM(loaded, num_pages=64, world_size=2) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], params, use_tqdm=False)]
    assert two == one
    assert again == one[:1]  # prefix caching on the ranks' pages
