"""Penalties and token filters through ``EngineCore`` on the tiny Llama: vLLM's semantics against transformers'
logits, and the engine's promises: a greedy or seeded request gives the same tokens alone and in a batch, after
preemption, with prefix caching, and with speculation on (prompt lookup, suffix decoding, a draft model or an
EAGLE head)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_engines import answer, core, drafted_and_accepted, drain, eagle_spec, random_prompts, train_tiny_head

from mechserve.api.config import SpeculativeConfig
from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Row, process_logits

# A prompt that repeats itself, so that a model that copies has something to repeat.
REPEATING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


def reference_greedy(hf: Any, prompt: Sequence[int], params: SamplingParams, bad_words=()) -> list[int]:
    """transformers' logits, a full forward per token, processed by the sampler's rules, then the argmax."""
    ids = list(prompt)
    out: list[int] = []
    for k in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1:].float()
        record = ExecutorRequest("r", tuple(prompt), params, bad_words_ids=tuple(tuple(w) for w in bad_words))
        row = Row(params, k, (), tuple(ids), len(prompt), request=record)
        out.append(int(process_logits(logits, [row]).argmax()))
        ids.append(out[-1])
    return out


def generate(c: EngineCore, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
    ids = [c.add_request(list(p), sp) for p, sp in zip(prompts, params)]
    done = {o.request_id: o for out in drain(c) for o in out.finished}
    c.check_pages()
    return [done[i].outputs[0].token_ids for i in ids]


CASES = {
    "repetition-3": {"repetition_penalty": 3.0},
    "repetition-0.5": {"repetition_penalty": 0.5},
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.5},
    "frequency-negative": {"frequency_penalty": -1.0},
    "logit-bias": {"logit_bias": {9: 4.0, 88: -100.0}},
    "allowed": {"allowed_token_ids": [3, 9, 27, 81, 100]},
    "all": {"repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {9: 2.0}},
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_with_penalties_follows_transformers_logits(tiny, tiny_hf, name: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, **CASES[name])
    (got,) = generate(core(tiny, max_step_tokens=5), [REPEATING], [params])
    assert got == reference_greedy(tiny_hf, REPEATING, params)
    (plain,) = generate(core(tiny), [REPEATING], [replace(params, **_neutral())])
    assert got != plain or name == "frequency-negative"  # each rule changes this prompt's greedy text


def _neutral() -> dict[str, Any]:
    return {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": None,
        "allowed_token_ids": None,
    }


def test_repetition_penalty_equals_transformers_generate(tiny, tiny_hf) -> None:
    """HF's ``RepetitionPenaltyLogitsProcessor`` is the same rule (prompt and output, divide or multiply)."""
    for penalty in (1.8, 0.6):
        params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=penalty)
        (got,) = generate(core(tiny), [REPEATING], [params])
        ids = torch.tensor([REPEATING])
        with torch.no_grad():
            want = tiny_hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=0,
            )[0, len(REPEATING) :].tolist()
        assert got == want


def test_bad_words_never_appear(tiny, tiny_hf) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    (plain,) = generate(core(tiny), [REPEATING], [params])
    one, (a, b) = plain[0], plain[2:4]  # a one-token word, and a two-token word the model would write
    banned = replace(params, bad_words=(f"w{one}", f"w{a} w{b}"))
    (got,) = generate(core(tiny), [REPEATING], [banned])
    assert one not in got and all(got[i : i + 2] != [a, b] for i in range(len(got) - 1))
    assert got == reference_greedy(tiny_hf, REPEATING, banned, bad_words=[[one], [a, b]])


def test_logit_bias_forces_a_token_and_ids_are_checked_against_the_vocabulary(tiny) -> None:
    (got,) = generate(core(tiny), [REPEATING], [SamplingParams(temperature=0.0, max_tokens=5, logit_bias={42: 100})])
    assert got == [42] * 5
    c = core(tiny)
    for field, value in (("logit_bias", {128: 1.0}), ("allowed_token_ids", [1, 128]), ("stop_token_ids", [128])):
        with pytest.raises(ParamError, match="not a token id") as err:
            c.add_request([1, 2], SamplingParams(**{field: value}))
        assert err.value.param == field
    with pytest.raises(ParamError) as err:
        EngineCore(replace_tokenizer(tiny, None)).add_request([1], SamplingParams(bad_words=("w1",)))
    assert err.value.param == "bad_words"


def replace_tokenizer(loaded: Any, tokenizer: Any) -> Any:
    from mechserve.model.loader import LoadedModel

    return LoadedModel(loaded.path, loaded.model, tokenizer, loaded.eos_token_ids)


# The engine's promises ------------------------------------------------------------------------------------------------

PENALIZED = [
    SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.7, frequency_penalty=0.6),
    SamplingParams(temperature=0.9, seed=7, max_tokens=9, presence_penalty=1.2, logit_bias={3: 2.0}),
    SamplingParams(temperature=0.0, max_tokens=9, bad_words=("w9", "w5 w6"), presence_penalty=-0.5),
    SamplingParams(temperature=1.2, seed=11, top_k=20, max_tokens=9, repetition_penalty=0.8, frequency_penalty=1.0),
]
SHARED = [5, 6, 7, 8, 5, 6, 7, 8]  # a shared prefix of two pages (page size 4), so later requests reuse it


def promise_prompts() -> list[list[int]]:
    tails = random_prompts([3, 6, 2, 5], seed=4)
    return [SHARED + t for t in tails]


def alone(tiny: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    (ids,) = generate(core(tiny, prefix_caching=False), [prompt], [params])
    return ids


CONFIGS: dict[str, dict[str, Any]] = {
    "batch": {},
    "chunked-tight-pool": {"max_step_tokens": 3, "num_pages": 9},  # preemption
    "prefix-cache": {"prefix_caching": True},
    "prompt-lookup": {"speculative": SpeculativeConfig(num_speculative_tokens=3, adaptive=False)},
    "suffix-decoding": {
        "speculative": SpeculativeConfig(method="suffix", num_speculative_tokens=3, adaptive=False),
        "prefix_caching": True,
    },
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_penalized_requests_give_the_same_tokens_in_every_configuration(tiny, config: str) -> None:
    prompts = promise_prompts()
    want = [alone(tiny, p, sp) for p, sp in zip(prompts, PENALIZED)]
    c = core(tiny, **CONFIGS[config])
    records: list[Any] = []
    ids = [c.add_request(p, sp) for p, sp in zip(prompts, PENALIZED)]
    outs = drain(c)
    records = [out.record for out in outs]
    done = {o.request_id: o.outputs[0].token_ids for out in outs for o in out.finished}
    assert [done[i] for i in ids] == want
    if config == "chunked-tight-pool":
        assert any(r.preempted for r in records)
    if config == "prefix-cache":
        assert any(r.reused for r in records)
    if config in ("prompt-lookup", "suffix-decoding"):
        assert sum(sum(r.drafted.values()) for r in records) > 0


def test_greedy_penalized_requests_are_unchanged_by_a_draft_model(tiny) -> None:
    prompts = promise_prompts()
    greedy = [p for p in PENALIZED if p.greedy]
    want = [alone(tiny, p, sp) for p, sp in zip(prompts, greedy)]
    spec = SpeculativeConfig(
        method="draft", draft_model=f"{tiny.path}:layers=1", num_speculative_tokens=3, adaptive=False
    )
    c = core(tiny, speculative=spec)
    assert generate(c, prompts, greedy) == want


EAGLE_CONFIGS: dict[str, dict[str, Any]] = {
    "batch": {"prefix_caching": False},
    "chunked-tight-pool": {"max_step_tokens": 5, "num_pages": 9, "prefix_caching": False},  # preemption
    "prefix-and-output-cache": {"prefix_caching": True, "output_caching": True},
}


@pytest.fixture(scope="module")
def penalized_turns(tiny) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Two turns of the penalized requests, each alone: (prompts, outputs); the second turn's prompts hold the
    first's answers."""
    prompts = promise_prompts()
    first = [alone(tiny, p, sp) for p, sp in zip(prompts, PENALIZED)]
    follow = [[*p, *a, 9, 10] for p, a in zip(prompts, first)]
    return [(prompts, first), (follow, [alone(tiny, p, sp) for p, sp in zip(follow, PENALIZED)])]


@pytest.fixture(scope="module")
def penalized_head(tiny, penalized_turns, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A head trained on the model's own penalized outputs (``train-draft``'s self-distillation on these requests):
    its guesses are mostly right, so verification with penalties runs over accepted guesses."""
    sequences = [(p, o) for prompts, outs in penalized_turns for p, o in zip(prompts, outs)]
    return train_tiny_head(tiny.model, tmp_path_factory.mktemp("penalized-head"), sequences, steps=120)


@pytest.mark.parametrize("config", list(EAGLE_CONFIGS))
def test_penalized_requests_are_unchanged_by_an_eagle_head(tiny, penalized_turns, penalized_head, config: str) -> None:
    """Repetition, presence and frequency penalties, logit bias and bad words, greedy and seeded: the guesses of an
    EAGLE head change no id, in a batch, under preemption and with the prefix and output caches (a second turn
    holding the first's answers), with guesses both accepted and rejected."""
    (prompts, want), (follow, want_next) = penalized_turns
    c = core(tiny, speculative=eagle_spec(penalized_head), **EAGLE_CONFIGS[config])
    got, records = answer(c, prompts, PENALIZED)
    assert got == want
    if config == "chunked-tight-pool":
        assert any(r.preempted for r in records)
    if config == "prefix-and-output-cache":
        again, later = answer(c, follow, PENALIZED)
        assert again == want_next
        assert sum(sum(r.reused.values()) for r in later) > sum(len(p) for p in prompts)  # the answers were reused
        records += later
    drafted, accepted = drafted_and_accepted(records)
    assert 0 < accepted < drafted


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    repetition=st.sampled_from([1.0, 0.7, 2.0]),
    frequency=st.sampled_from([0.0, 1.0, -0.5]),
    presence=st.sampled_from([0.0, 1.5]),
    seed=st.one_of(st.none(), st.integers(0, 100)),
    spec_len=st.sampled_from([0, 2]),
    budget=st.sampled_from([3, 64]),
)
def test_a_request_alone_equals_it_in_any_batch(
    tiny, repetition: float, frequency: float, presence: float, seed: int | None, spec_len: int, budget: int
) -> None:
    temperature = 0.0 if seed is None else 1.0
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=7,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    prompts = promise_prompts()
    want = alone(tiny, prompts[0], params)
    spec = SpeculativeConfig(num_speculative_tokens=spec_len, adaptive=False) if spec_len else None
    c = core(tiny, max_step_tokens=budget, speculative=spec)
    others = [replace(PENALIZED[1], seed=3), PENALIZED[0], SamplingParams(temperature=0.0, max_tokens=4)]
    got = generate(c, prompts, [params, *others])
    assert got[0] == want
