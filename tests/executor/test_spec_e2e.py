"""End to end on the embedded SmolLM2-135M: greedy output with speculation is token for token the output without it.

Both proposers (prompt lookup, and the first 4 layers of SmolLM2 as a draft model), at batch 1 and
with all prompts in one batch, copy-heavy prompts included; every prompt's ids must be equal, not
most of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mechserve.api.config import SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.llm import LLM
from mechserve.model.loader import LoadedModel, load_model

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
def test_speculative_greedy_equals_plain(
    smollm2: LoadedModel, plain: list[list[int]], name: str, batch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 9 with a 64-token budget (prefill chunks beside decode windows); batch 1 one prompt at a time
    (later prompts reuse cached pages of earlier ones, draft KV included).  The adaptive governor prices
    guesses with the fixed costs here: with measured ones it may rightly turn speculation off at batch 9 on
    this machine (CI saw 1 guess proposed), and this test is about the guesses' exactness, so it needs them."""
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    config = CONFIGS[name]
    llm = LLM(smollm2, speculative_config=config, max_step_tokens=64 if batch else 2048)
    got = ids(llm, PROMPTS, batch)
    assert got == plain
    stats = llm.core.stats(executor=True).executor
    assert stats.proposed > 0
    if config.method == "ngram":
        assert stats.accepted > 0  # the copy-heavy prompts


@pytest.mark.parametrize("name", ["ngram", pytest.param("draft-4-layers", marks=pytest.mark.slow)])
def test_a_real_speculative_run_replays_on_the_spec(smollm2: LoadedModel, name: str) -> None:
    """Issue 7's trace check: the drafted / accepted / rolled_back of a real SmolLM2 run with real guesses
    (copy-heavy prompts, a pool tight enough to preempt, chunked prefill; the draft model's
    variant is slow, the tiny-model replays in ``test_spec_decode`` cover it in CI) are exactly what m12 decides from
    the same verdicts (the conformance replay compares every field of every step and every plan)."""
    from mechserve.conformance.replay import compare, replay
    from mechserve.conformance.runner import end_state, run_workload
    from mechserve.conformance.target import torch_target

    tok = smollm2.tokenizer
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[6]]
    kwargs: dict[str, object] = {"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=3)}
    if name.startswith("draft"):
        kwargs = {"speculative": DRAFT, "draft_model": smollm2.model.truncated(4)}
    target = torch_target(smollm2.model, name=f"smollm2-{name}", eos_token_ids=smollm2.eos_token_ids, **kwargs)
    requests = [
        {"request_id": f"r{i}", "tokens": tok.encode(p), "max_new_tokens": 16, "arrival_step": i}
        for i, p in enumerate(prompts)
    ]
    longest = max(len(r["tokens"]) for r in requests) + 16
    engine = {"max_step_tokens": 32, "page_size": 4, "num_pages": (longest + 3) // 4 + 8, "spec_len": 3}
    workload = {"engine": engine, "requests": requests}
    real = run_workload(target, workload)
    replayed = replay(workload, real.records, eos_token_ids=target.eos_token_ids)
    compare(real.records, replayed, real_exchanges=real.exchanges, real_end=end_state(real.engine))
    count = {
        f: sum(sum(getattr(rec, f).values()) for rec in real.records) for f in ("drafted", "accepted", "rolled_back")
    }
    assert count["drafted"] > 0 and count["accepted"] > 0 and count["rolled_back"] > 0, count
    assert count["drafted"] == count["accepted"] + count["rolled_back"]
    assert any(rec.preempted for rec in real.records)
