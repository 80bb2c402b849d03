"""``SamplingParams``'s penalties, token filters and prompt logprobs: vLLM's names and defaults, each bad value a
``ParamError`` naming its field (the server's 400 ``param``, the CLI's flag)."""

from __future__ import annotations

import pytest

from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams


def test_the_defaults_change_nothing() -> None:
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words, p.prompt_logprobs) == (None, None, (), None)
    assert not p.filtered and not p.penalized


def test_lists_and_maps_are_normalised() -> None:
    p = SamplingParams(logit_bias={3: 1}, allowed_token_ids=[4, 5], bad_words="w1", repetition_penalty=1.1)
    assert p.logit_bias == {3: 1.0} and p.allowed_token_ids == (4, 5) and p.bad_words == ("w1",)
    assert p.filtered and p.penalized and hash(p) == hash(SamplingParams(**{**_fields(p), "logit_bias": {9: 2.0}}))


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__dataclass_fields__}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {1: 101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"1": 1.0}),
        ("logit_bias", [(1, 2.0)]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("bad_words", [""]),
        ("bad_words", ["  "]),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)
def test_each_bad_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ParamError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in str(err.value)


def test_structured_outputs_takes_exactly_one_kind_and_a_dict() -> None:
    from mechserve.api.errors import ParamError
    from mechserve.api.params import StructuredOutputsParams

    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    assert p.structured_outputs.kind == "choice"
    assert StructuredOutputsParams(json='{"b": 1, "a": 2}').key == StructuredOutputsParams(json={"a": 2, "b": 1}).key
    bad = [
        {},
        {"regex": "a", "choice": ["b"]},
        {"json": "{not json"},
        {"json": "[1]"},
        {"choice": []},
        {"choice": ["", "x"]},
        {"regex": ""},
        {"json_object": "yes"},
        {"jsn": {}},
    ]
    for value in bad:
        with pytest.raises(ParamError) as info:
            SamplingParams(structured_outputs=value)
        assert info.value.param == "structured_outputs", value


@pytest.mark.parametrize("name", ["stop", "stop_token_ids", "bad_words", "allowed_token_ids"])
@pytest.mark.parametrize("value", [123, 1.5, {"a": 1}, b"w1", {3}])
def test_a_list_field_given_something_else_is_a_param_error_naming_it(name: str, value: object) -> None:
    """Found by a new user's trial: ``SamplingParams(stop=123)`` was a bare ``TypeError: 'int' object is not
    iterable``; every list field refuses a non-list with a ``ParamError`` naming the field."""
    with pytest.raises(ParamError) as caught:
        SamplingParams(**{name: value})
    assert caught.value.param == name and name in str(caught.value)


def test_input_the_engine_pays_for_every_step_is_bounded_and_never_echoed_whole() -> None:
    """Issue 31: a stop string's held-back suffix is searched every step and a logit_bias is applied to every
    sampled row, so both have limits; a refusal names the field and shows a list by its length and head
    (the choice 400 echoed the whole list)."""
    from mechserve.api.limits import MAX_CHOICES, MAX_LOGIT_BIAS_IDS, MAX_STOP_CHARS

    SamplingParams(stop=["s" * MAX_STOP_CHARS], logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_IDS)})
    with pytest.raises(ParamError, match=f"at most {MAX_STOP_CHARS} characters") as info:
        SamplingParams(stop=["ok", "s" * (MAX_STOP_CHARS + 1)])
    assert info.value.param == "stop" and len(str(info.value)) < 200
    with pytest.raises(ParamError, match=f"at most {MAX_LOGIT_BIAS_IDS} token ids, got {MAX_LOGIT_BIAS_IDS + 1}"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_IDS + 1)})
    for value in ({"choice": [f"c{i}" for i in range(2 * MAX_CHOICES)]}, {"choice": ["x" * 10_000, ""]}):
        with pytest.raises(ParamError) as info:
            SamplingParams(structured_outputs=value)
        assert len(str(info.value)) < 200 and "c1500" not in str(info.value)
    with pytest.raises(ParamError) as info:
        SamplingParams(allowed_token_ids=[-1] * 50_000)
    assert len(str(info.value)) < 200
