"""Prompt logprobs (vLLM's ``prompt_logprobs``) through ``EngineCore``: equal to transformers' log-softmax of the
same positions within float32 tolerance, whether the prompt runs in one step or in chunks, comes partly from the
prefix cache (recomputed), is preempted and recomputed, or is scored alone with ``max_tokens`` 0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from tiny_engines import core, drain, random_prompts

from mechserve.api.config import SpeculativeConfig
from mechserve.api.outputs import RequestOutput
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.spec import m16_request_draft_lengths as m16

ATOL = 1e-4  # float32 forward, paged and chunked, against transformers' dense one


def hf_logprobs(hf: Any, prompt: Sequence[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] float64: the log-softmax at each position, predicting the next prompt token."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt)])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1)


def check(out: RequestOutput, hf: Any, top: int) -> None:
    """``out.prompt_logprobs`` is vLLM's shape and equals transformers' values at every position."""
    prompt = out.prompt_token_ids
    ref = hf_logprobs(hf, prompt)
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry, row, token = entries[pos], ref[pos - 1], prompt[pos]
        assert entry is not None and next(iter(entry)) == token  # the prompt token first
        assert all(abs(lp.logprob - float(row[t])) < ATOL for t, lp in entry.items())
        rank = entry[token].rank
        assert rank is not None and int((row > row[token] + ATOL).sum()) < rank <= int((row >= row[token] - ATOL).sum())
        assert len(entry) in (top, top + 1) or (top == 0 and len(entry) == 1)
        tops = [t for t in entry if t != token]
        if tops:  # the top N: none of them less likely than transformers' N-th
            assert min(float(row[t]) for t in tops) >= float(row.topk(top).values[-1]) - ATOL
        assert entry[token].decoded_token == f"w{token}"


def run(
    c: EngineCore, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> tuple[list[RequestOutput], list[Any]]:
    ids = [c.add_request(list(p), params) for p in prompts]
    outs = drain(c)
    done = {o.request_id: o for out in outs for o in out.finished}
    c.check_pages()
    return [done[i] for i in ids], [out.record for out in outs]


PARAMS = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3)


@pytest.mark.parametrize("budget", [64, 5, 1])
def test_prompt_logprobs_equal_transformers_in_one_step_or_in_chunks(tiny, tiny_hf, budget: int) -> None:
    prompts = random_prompts([13, 2, 21], seed=3)
    outputs, records = run(core(tiny, max_step_tokens=budget), prompts, PARAMS)
    if budget < 13:
        assert any(0 < n < 13 for r in records for n in r.executed.values())  # the prompts ran in chunks
    for out in outputs:
        check(out, tiny_hf, 3)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny, tiny_hf) -> None:
    """The second request's prefix comes from the cache (m08 reuse skips computing it); its logprobs are the same."""
    shared = random_prompts([12], seed=5)[0]
    c = core(tiny, max_step_tokens=64)
    (first,), _ = run(c, [[*shared, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    assert first.prompt_logprobs is None  # not asked for
    forwards = c.stats(executor=True).executor.forwards
    outputs, records = run(c, [[*shared, 9, 4], [*shared, 3]], PARAMS)
    assert sum(r.reused.get(i, 0) for r in records for i in r.reused) >= 8
    assert c.stats(executor=True).executor.forwards > forwards + 3  # the steps, plus a recompute per request
    for out in outputs:
        check(out, tiny_hf, 3)


def test_preemption_records_every_prompt_position_once(tiny, tiny_hf) -> None:
    prompts = random_prompts([10, 11, 9], seed=8)
    outputs, records = run(
        core(tiny, max_step_tokens=4, num_pages=8),
        prompts,
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1),
    )
    assert any(r.preempted for r in records)
    for out in outputs:
        check(out, tiny_hf, 1)


def test_speculation_and_n_samples_keep_prompt_logprobs(tiny, tiny_hf) -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    (out,), _ = run(
        core(tiny, speculative=spec), [prompt], SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2)
    )
    check(out, tiny_hf, 2)
    params = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=4, prompt_logprobs=0)
    (out,), _ = run(core(tiny), [prompt], params)
    check(out, tiny_hf, 0)
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)


def test_max_tokens_0_scores_the_prompt_only(tiny, tiny_hf) -> None:
    """m12 finishes a request of no new token at admission; a prompt-logprobs request still runs its prompt and
    keeps no token: a stop from outside keeping none of the one token it samples (m12 N26), so the record and
    the summary say STOP with nothing generated, while the user sees finish reason "length" as vLLM reports
    max_tokens 0."""
    prompt = random_prompts([9], seed=1)[0]
    c = EngineCore(tiny, core(tiny).config, keep_finished=True)
    rid = c.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2, logprobs=1))
    outs = drain(c)
    (out,) = [o for step in outs for o in step.finished]
    check(out, tiny_hf, 2)
    done = out.outputs[0]
    assert (done.token_ids, done.text, done.finish_reason, done.logprobs) == ([], "", "length", [])
    assert not any(step.record.tokens.get(rid) for step in outs)
    assert [step.record.finished[rid] for step in outs if rid in step.record.finished] == [m16.FinishReason.STOP]
    (entry,) = c.summary()
    assert (entry["state"], entry["finish_reason"], entry["generated"]) == ("FINISHED", "STOP", 0)
    deltas = [d for step in outs for d in step.deltas]
    assert [d.prompt_logprobs is not None for d in deltas] == [True]  # the first (and only) delta carries them
    c.check_pages()
