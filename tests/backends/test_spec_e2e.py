"""End to end on the embedded SmolLM2-135M: greedy output with speculation is token for token the output without it.

Both proposers (prompt lookup, and the first 4 layers of SmolLM2 as a draft model), at batch 1 and
with all prompts in one batch, copy-heavy prompts included; every prompt's ids must be equal, not
most of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mechserve.backends.models import LoadedModel, load_model
from mechserve.backends.speculative import SpeculativeConfig
from mechserve.llm import LLM
from mechserve.params import SamplingParams

pytestmark = pytest.mark.e2e

PASSAGE = "The quick brown fox jumps over the lazy dog near the river bank, and the dog barks at the fox."
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    f"Repeat the following sentence exactly.\nSentence: {PASSAGE}\nRepeated:",
    "Rename the variable x to total in this code.\n\ndef add(x, y):\n    x = x + y\n    return x\n\nRenamed code:\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Summarize: The meeting moved from Monday to Wednesday because the manager was travelling. "
    "The team will present the quarterly results on Wednesday at 10am in room 4.\nSummary:",
    'Change the age to 31 in this JSON: {"name": "Alice", "age": 30, "city": "Paris"}\nResult:',
    "1. apples\n2. bananas\n3. cherries\n4.",
    "The three primary colors are red, yellow and",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="smollm2:layers=4", adaptive=False)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


def ids(llm: LLM, prompts: Sequence[str], batch: bool) -> list[list[int]]:
    if batch:
        return [o.outputs[0].token_ids for o in llm.generate(list(prompts), PARAMS, use_tqdm=False)]
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def plain(smollm2: LoadedModel) -> list[list[int]]:
    return ids(LLM(smollm2), PROMPTS, batch=True)


CONFIGS = {
    "ngram-adaptive": NGRAM,
    "ngram-fixed": SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
    "draft-4-layers": DRAFT,
}


@pytest.mark.parametrize(
    ("name", "batch"),
    [
        ("ngram-adaptive", True),
        ("ngram-fixed", True),
        ("draft-4-layers", True),
        ("ngram-adaptive", False),
        ("draft-4-layers", False),
    ],
    ids=lambda v: v if isinstance(v, str) else ("batch-9" if v else "batch-1"),
)
def test_speculative_greedy_equals_plain(smollm2: LoadedModel, plain: list[list[int]], name: str, batch: bool) -> None:
    """Batch 9 with a 64-token budget (prefill chunks beside decode windows); batch 1 one prompt at a time
    (later prompts reuse cached pages of earlier ones, draft KV included)."""
    config = CONFIGS[name]
    llm = LLM(smollm2, speculative_config=config, max_step_tokens=64 if batch else 2048)
    got = ids(llm, PROMPTS, batch)
    assert got == plain
    stats = llm.core.executor.stats
    assert stats.proposed > 0
    if config.method == "ngram":
        assert stats.accepted > 0  # the copy-heavy prompts
