"""A step in which no request drafts is the step without speculation (issue 27): same rows, same forward, same ids.

In bfloat16 a matrix product's rounding depends on how many rows it multiplies, so a speculating engine whose
governor proposes nothing must lay out exactly ``off``'s rows and run exactly ``off``'s forward for its ids
(and their logprobs, bit for bit) to be ``off``'s.  Checked for every proposer on a tiny random model loaded in
bfloat16 (``--mode fast``'s dtype), at batch 1 and batch 5, through ``EngineCore`` with adaptive speculation
(the governor forced to answer 0 every step): the EAGLE path still asks the forward for the final hidden states
(``hidden_out``) and hands them to its head, and must not change the logits by doing so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import random_prompts
from tiny_engines import core, drain, greedy_sequences, train_tiny_head
from tiny_models import save_tiny, save_word_tokenizer, tiny_config

from mechserve.api.config import SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.executor.governor import Candidate, Governor
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model.llama import LlamaModel
from mechserve.model.loader import LoadedModel, load_model

PROMPTS = random_prompts([7, 12, 5, 9, 15], seed=83)
METHODS = ("ngram", "suffix", "draft", "eagle")


@dataclass
class Checkpoint:
    path: Path
    fast: LoadedModel  # bfloat16, as ``--mode fast`` loads it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    path = tmp_path_factory.mktemp("tiny-bf16")
    save_tiny(path, tiny_config(), 3)
    save_word_tokenizer(path)
    return Checkpoint(path, load_model(str(path), dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def head(checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head for the checkpoint (trained on its float32 load, which the bfloat16 one shares: the head's
    fingerprint rounds the weights to bfloat16).  What it guesses does not matter: it is never asked to."""
    exact = load_model(str(checkpoint.path), tokenizer=False).model
    return train_tiny_head(exact, tmp_path_factory.mktemp("bf16-head"), greedy_sequences(exact, PROMPTS, 8), steps=5)


def never_guess(self: Governor, candidates: Sequence[Candidate], max_k: int) -> tuple[int, list[int | None]]:
    """A governor's answer that speculation never pays: ``spec_len`` 0, every request limited to 0."""
    return 0, [0] * len(candidates)


def spec_config(method: str, checkpoint: Checkpoint, head: Path) -> SpeculativeConfig:
    extra: dict[str, Any] = {}
    if method == "draft":
        extra["draft_model"] = f"{checkpoint.path}:layers=1"
    if method == "eagle":
        extra["eagle_head"] = str(head)
    return SpeculativeConfig(method=method, num_speculative_tokens=3, **extra)


def outputs(c: EngineCore, prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], list[Any]]]:
    """Each prompt's output ids and sampled logprobs (every prompt submitted at once); checks the pages."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    ids = [c.add_request(list(p), params) for p in prompts]
    done = {o.request_id: o.outputs[0] for out in drain(c) for o in out.finished}
    c.check_pages()
    return [(list(done[i].token_ids), list(done[i].logprobs or [])) for i in ids]


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("method", METHODS)
def test_a_step_with_no_guess_gives_the_ids_of_no_speculation(
    checkpoint: Checkpoint, head: Path, method: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")  # no calibration: the governor is forced anyway
    monkeypatch.setattr(Governor, "decide", never_guess)
    off = core(checkpoint.fast, dtype="bfloat16", num_pages=256)
    spec = core(checkpoint.fast, dtype="bfloat16", num_pages=256, speculative=spec_config(method, checkpoint, head))
    prompts = PROMPTS[:batch]
    want = outputs(off, prompts)
    got = outputs(spec, prompts)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert got == want  # the logprobs too, bit for bit: the same logits
    before, after = off.stats(executor=True).executor, spec.stats(executor=True).executor
    assert after.proposed == 0
    assert (after.forwards, after.rows) == (before.forwards, before.rows)  # the same rows, step by step


def one_step(model: LlamaModel, hidden: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A prefill of two prompts and the logits of each one's last row: (logits, the KV pool, hidden_out)."""
    a, b = PROMPTS[1], PROMPTS[3]
    page = 4
    pages_a = -(-len(a) // page)
    spans = [
        Span(0, 0, len(a), tuple(range(pages_a))),
        Span(len(a), 0, len(b), tuple(range(pages_a, pages_a + -(-len(b) // page)))),
    ]
    slots = [*range(len(a)), *(pages_a * page + i for i in range(len(b)))]
    arch = model.arch
    batch = build_attention_batch(
        spans, slots, page, arch.num_heads // arch.num_kv_heads, model.distinct_sliding_windows
    )
    cache = model.new_cache(16, page)
    found: list[torch.Tensor] = []
    logits = model.forward(
        torch.tensor([*a, *b], dtype=torch.int64),
        torch.tensor([*range(len(a)), *range(len(b))], dtype=torch.int64),
        cache,
        batch,
        torch.tensor([len(a) - 1, len(a) + len(b) - 1], dtype=torch.int64),
        hidden_out=found if hidden else None,
    )
    return logits, torch.cat([cache.k.flatten(), cache.v.flatten()]), found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_forward_that_returns_hidden_states_is_the_plain_forward(
    checkpoint: Checkpoint, dtype: torch.dtype
) -> None:
    """``hidden_out`` only reads: logits and K/V are bit for bit the plain forward's, and the hidden states are
    the very rows the LM head multiplied (after the final norm), in float32."""
    model = load_model(str(checkpoint.path), dtype=dtype, tokenizer=False).model
    plain, plain_kv, none = one_step(model, hidden=False)
    logits, kv, hidden = one_step(model, hidden=True)
    assert none == [] and len(hidden) == 1
    assert torch.equal(logits, plain) and torch.equal(kv, plain_kv)
    (h,) = hidden
    assert h.dtype == torch.float32 and h.shape == (2, model.arch.hidden_size)
    from mechserve.model.linear import linear

    again = linear(h.to(dtype), model.lm_head, out_dtype=torch.float32)
    assert torch.equal(again, plain)


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_after_drafting_a_step_with_no_guess_still_gives_the_ids_of_no_speculation(
    checkpoint: Checkpoint, head: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that drafted, then proposes nothing, answers the same prompts again with ``off``'s ids and
    logprobs, bit for bit, where no K/V its verify windows computed is shared: output caching off, so that only
    prompt blocks (computed by the same prefill rows as ``off``'s) are published.  With output caching on, a
    request whose output repeats an earlier one adopts the resident pages of that output (m08 D2, first publisher
    wins), whose K/V the earlier verify windows computed; in bfloat16 a window of 1 + k rows rounds them
    differently from ``off``'s one row per step, so the ids may then differ (docs/benchmarks.md, issue 27)."""
    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    guesses = {"k": 3}

    def decide(self: Governor, candidates: Sequence[Candidate], max_k: int) -> tuple[int, list[int | None]]:
        k = guesses["k"]
        return (k, [None] * len(candidates)) if k else never_guess(self, candidates, max_k)

    monkeypatch.setattr(Governor, "decide", decide)
    config = dict(dtype="bfloat16", num_pages=256, output_caching=False)
    off = core(checkpoint.fast, **config)
    spec = core(checkpoint.fast, **config, speculative=spec_config(method, checkpoint, head))
    outputs(off, PROMPTS)
    outputs(spec, PROMPTS)
    drafted = spec.stats(executor=True).executor.proposed
    assert drafted > 0
    guesses["k"] = 0
    want = outputs(off, PROMPTS)
    got = outputs(spec, PROMPTS)
    assert got == want
    assert spec.stats(executor=True).executor.proposed == drafted  # the second round guessed nothing
