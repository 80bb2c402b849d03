"""``ExecutorRequest``: the one record a request crosses the boundary with (issue 25, item 2).

It is plain data: ``to_dict`` gives builtins only (a JSON or msgpack transport carries it; never pickle
from the network), ``from_dict`` gives the same record back (a constrained request's grammar compiled
again by the receiving side), and it pickles as it is for the rank pipes.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.executor.request import ExecutorRequest, bad_words_ids, params_from_dict, params_to_dict

RICH = SamplingParams(
    n=1,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    seed=7,
    max_tokens=33,
    min_tokens=2,
    stop=("\n\n", "END"),
    stop_token_ids=(5, 9),
    ignore_eos=True,
    include_stop_str_in_output=True,
    logprobs=3,
    prompt_logprobs=1,
    skip_special_tokens=False,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    logit_bias={3: 2.5, 11: -100.0},
    allowed_token_ids=(1, 2, 3, 4),
    bad_words=("no", "never"),
    truncate_prompt_tokens=-1,
    structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
)


def builtins_only(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and builtins_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(builtins_only(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool)


@pytest.mark.parametrize(
    "params",
    [
        RICH,
        SamplingParams(),
        SamplingParams(temperature=0.0, structured_outputs={"choice": ["yes", "no"]}),
        SamplingParams(structured_outputs={"regex": "[0-9]+"}),
        SamplingParams(structured_outputs={"json_object": True}),
        SamplingParams(structured_outputs={"grammar": 'start: "a"'}),
    ],
)
def test_params_round_trip_through_json(params: SamplingParams) -> None:
    data = params_to_dict(params)
    assert builtins_only(data)
    assert params_from_dict(json.loads(json.dumps(data))) == params


def test_a_record_round_trips_as_plain_data_and_pickles() -> None:
    plain = SamplingParams(temperature=0.0, bad_words=("x",), logit_bias={2: 1.0})
    record = ExecutorRequest("r1#2", (5, 6, 7), plain, (0, 2), ((9,), (3, 4)))
    data = json.loads(json.dumps(record.to_dict()))
    assert builtins_only(data) and ExecutorRequest.from_dict(data) == record
    assert pickle.loads(pickle.dumps(record)) == record
    assert record.end_ids() == (0, 2) and ExecutorRequest("x", params=RICH, eos_token_ids=(0,)).end_ids() == (5, 9)


def test_a_constrained_record_needs_a_compiler_on_the_receiving_side() -> None:
    constrained = SamplingParams(structured_outputs={"regex": "a+"})
    data = ExecutorRequest("r", (1,), constrained).to_dict()
    assert "grammar" not in data  # the compiled grammar is a function of params and the tokenizer: not sent
    with pytest.raises(ValueError, match="needs a grammar compiler"):
        ExecutorRequest.from_dict(data)
    compiled: list[StructuredOutputsParams] = []

    def compile(so: StructuredOutputsParams) -> Any:
        compiled.append(so)
        return "compiled"

    rebuilt = ExecutorRequest.from_dict(data, compile)
    assert compiled == [constrained.structured_outputs] and rebuilt.grammar == "compiled"
    with pytest.raises(ValueError, match="unknown field"):
        ExecutorRequest.from_dict({**data, "extra": 1})


class Words:
    """A tokenizer that spells a word as its letters' codes (a leading space is its own id, 32)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[ord(c) for c in text])


def test_bad_words_are_derived_with_the_tokenizer_once() -> None:
    assert bad_words_ids(("ab",), Words(), 200) == ((97, 98),)  # " ab" has another first id but more ids
    with pytest.raises(ParamError, match="need a tokenizer"):
        bad_words_ids(("ab",), None, 200)
    with pytest.raises(ParamError, match="outside this model's vocabulary"):
        bad_words_ids(("ab",), Words(), 98)
    record = ExecutorRequest.of(
        "r", [1, 2], SamplingParams(bad_words=("ab",)), tokenizer=Words(), vocab_size=200, eos_token_ids=[0]
    )
    assert record.bad_words_ids == ((97, 98),) and record.eos_token_ids == (0,) and record.prompt_ids == (1, 2)
