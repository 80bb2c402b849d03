"""Every honoured field of the table reaches the engine unchanged; every refused field is refused (issue 20).

``CHECKS`` gives, per honoured row of ``mechserve.http.fields.FIELDS`` and endpoint, request fragments
that set the field away from its default and what each must change in the *engine view*: everything
the server takes from a body (``SamplingParams``, the prompts, ``fit_max_tokens``, the request id, and
the options the response is rendered with).  The walk is over the table, so a new honoured row without
a check fails, and a check compares the whole view, so a field dropped, altered, or leaking into
another field fails.  A request-capturing server then checks that what ``AsyncLLM.add_request``
receives is that same view, so nothing is lost between the model and the engine either.

Refused rows: the row's ``bad`` value raises ``UnsupportedField`` naming it, and null, every neutral
value and (for a rule) any value while its field is off leave the engine view exactly as without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from server_support import TINY_NAME

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_NEW_TOKENS
from mechserve.api.params import SamplingParams
from mechserve.api.params import StructuredOutputsParams as SO
from mechserve.entrypoints.prompts import Chat, Text
from mechserve.entrypoints.tools import FunctionTool, ToolPlan
from mechserve.http.fields import CHAT, COMPLETIONS, ENDPOINT_PATHS, Field, fields_for
from mechserve.http.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedField

BASE: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 2},
    CHAT: {"model": TINY_NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2},
}
MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}
USER = [{"role": "user", "content": "w1"}]


def P(**changes: Any) -> dict[str, Any]:
    """The ``SamplingParams`` fields a fragment must change, and to what."""
    return {"params": changes}


def chat(**changes: Any) -> dict[str, Any]:
    """The base conversation's ``Chat`` with ``changes``."""
    return {"prompts": [dataclasses.replace(Chat(USER), **changes)]}


ARGS = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": ARGS}}
CALL = {
    "type": "object",
    "properties": {"name": {"const": "f"}, "arguments": ARGS},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CALLS = {"type": "array", "items": CALL, "minItems": 1}


def PLAN(**fields: Any) -> ToolPlan:
    """The tool plan of a body with ``TOOL`` (written out: what the server must take from the body)."""
    return ToolPlan(tools=(FunctionTool(name="f", description=None, parameters=ARGS, strict=None),), **fields)


# (fragment, expected changes of the engine view); the same checks hold on both endpoints unless named.
SHARED: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {
    "model": [({"model": "other-model"}, {"model": "other-model"})],
    "max_tokens": [({"max_tokens": 3}, P(max_tokens=3)), ({"max_tokens": 0}, P(max_tokens=0))],
    "n": [({"n": 3}, P(n=3))],
    "temperature": [({"temperature": 0.5}, P(temperature=0.5)), ({"temperature": 0}, P(temperature=0.0))],
    "top_p": [({"top_p": 0.5}, P(top_p=0.5))],
    "seed": [({"seed": 7}, P(seed=7)), ({"seed": 0}, P(seed=0)), ({"seed": -1}, {})],
    "stop": [({"stop": "w3"}, P(stop=("w3",))), ({"stop": ["w3", "w4 w5"]}, P(stop=("w3", "w4 w5")))],
    "presence_penalty": [({"presence_penalty": 0.5}, P(presence_penalty=0.5))],
    "frequency_penalty": [({"frequency_penalty": -0.5}, P(frequency_penalty=-0.5))],
    "logit_bias": [({"logit_bias": {"5": 2.5, "7": -100}}, P(logit_bias={5: 2.5, 7: -100}))],
    "stream": [({"stream": True}, {"stream": True})],
    "stream_options": [
        ({"stream": True, "stream_options": {"include_usage": True}}, {"stream": True, "include_usage": True}),
        ({"stream": True, "stream_options": {"include_usage": False}}, {"stream": True}),
    ],
    "user": [({"user": "alice"}, {})],
    "top_k": [({"top_k": 5}, P(top_k=5)), ({"top_k": -1}, P(top_k=-1))],
    "min_p": [({"min_p": 0.25}, P(min_p=0.25))],
    "repetition_penalty": [({"repetition_penalty": 1.5}, P(repetition_penalty=1.5))],
    "min_tokens": [({"min_tokens": 1}, P(min_tokens=1))],
    "ignore_eos": [({"ignore_eos": True}, P(ignore_eos=True)), ({"ignore_eos": False}, {})],
    "stop_token_ids": [({"stop_token_ids": [3, 9]}, P(stop_token_ids=(3, 9)))],
    "include_stop_str_in_output": [({"include_stop_str_in_output": True}, P(include_stop_str_in_output=True))],
    "skip_special_tokens": [({"skip_special_tokens": False}, P(skip_special_tokens=False))],
    "allowed_token_ids": [({"allowed_token_ids": [3, 4]}, P(allowed_token_ids=(3, 4)))],
    "bad_words": [({"bad_words": ["w3", "w4 w5"]}, P(bad_words=("w3", "w4 w5")))],
    "prompt_logprobs": [
        ({"prompt_logprobs": 2}, {**P(prompt_logprobs=2), "show_prompt_logprobs": True}),
        ({"prompt_logprobs": 0}, {**P(prompt_logprobs=0), "show_prompt_logprobs": True}),
    ],
    "truncate_prompt_tokens": [
        ({"truncate_prompt_tokens": 1}, P(truncate_prompt_tokens=1)),
        ({"truncate_prompt_tokens": -1}, P(truncate_prompt_tokens=-1)),
    ],
    "request_id": [({"request_id": "abc-1"}, {"request_id": "abc-1"})],
    "return_tokens_as_token_ids": [({"return_tokens_as_token_ids": True}, {"return_tokens_as_token_ids": True})],
    "return_token_ids": [({"return_token_ids": True}, {"return_token_ids": True})],
    # Structured outputs (issue 16): every spelling becomes one StructuredOutputsParams.
    "structured_outputs": [
        ({"structured_outputs": {"regex": "w[0-9]"}}, P(structured_outputs=SO(regex="w[0-9]"))),
        ({"structured_outputs": {"choice": ["w1", "w2"]}}, P(structured_outputs=SO(choice=("w1", "w2")))),
    ],
    "guided_json": [({"guided_json": {"type": "object"}}, P(structured_outputs=SO(json={"type": "object"})))],
    "guided_regex": [({"guided_regex": "a+"}, P(structured_outputs=SO(regex="a+")))],
    "guided_choice": [({"guided_choice": ["a", "b"]}, P(structured_outputs=SO(choice=("a", "b"))))],
    "guided_grammar": [({"guided_grammar": 'root ::= "a"'}, P(structured_outputs=SO(grammar='root ::= "a"')))],
    "grammar": [({"grammar": 'root ::= "a"'}, P(structured_outputs=SO(grammar='root ::= "a"')))],
    "json_schema": [({"json_schema": {"type": "array"}}, P(structured_outputs=SO(json={"type": "array"})))],
    "response_format": [
        ({"response_format": {"type": "text"}}, {}),
        ({"response_format": {"type": "json_object"}}, P(structured_outputs=SO(json_object=True))),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            P(structured_outputs=SO(json={"type": "object"})),
        ),
    ],
    "n_predict": [
        ({"max_tokens": None, "n_predict": 3}, P(max_tokens=3)),
        ({"max_tokens": None, "n_predict": -1}, {**P(max_tokens=MAX_NEW_TOKENS), "fit_max_tokens": True}),
        ({"n_predict": 2}, {}),
    ],
}

ONLY: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = {
    (COMPLETIONS, "prompt"): [
        ({"prompt": [3, 4]}, {"prompts": [[3, 4]]}),
        ({"prompt": ["w3", "w4 w5"]}, {"prompts": [Text("w3"), Text("w4 w5")]}),
        ({"prompt": [[5, 6], [7]]}, {"prompts": [[5, 6], [7]]}),
    ],
    (COMPLETIONS, "max_tokens"): [({"max_tokens": None}, P(max_tokens=16))],
    (COMPLETIONS, "best_of"): [({"n": 2, "best_of": 2}, P(n=2)), ({"best_of": 1}, {})],
    (COMPLETIONS, "logprobs"): [({"logprobs": 2}, P(logprobs=2)), ({"logprobs": 0}, P(logprobs=0))],
    (COMPLETIONS, "echo"): [
        ({"echo": True}, {"echo": True}),
        # vLLM's rule: echo with logprobs scores the prompt too (an explicit prompt_logprobs wins)
        ({"echo": True, "logprobs": 1}, {**P(logprobs=1, prompt_logprobs=1), "echo": True}),
        (
            {"echo": True, "logprobs": 1, "prompt_logprobs": 3},
            {**P(logprobs=1, prompt_logprobs=3), "echo": True, "show_prompt_logprobs": True},
        ),
        ({"echo": False, "logprobs": 1}, P(logprobs=1)),
    ],
    (COMPLETIONS, "add_special_tokens"): [
        ({"add_special_tokens": False}, {"prompts": [Text("w1 w2", False)]}),
        ({"add_special_tokens": False, "prompt": ["w3", "w4"]}, {"prompts": [Text("w3", False), Text("w4", False)]}),
    ],
    (CHAT, "messages"): [
        (
            {
                "messages": [
                    {"role": "system", "content": "w5"},
                    {"role": "developer", "content": [{"type": "text", "text": "w6"}, {"type": "text", "text": " w7"}]},
                    {"role": "user", "content": "w1", "name": "bob"},
                    {"role": "assistant", "content": None},
                ]
            },
            {
                "prompts": [
                    Chat(
                        [
                            {"role": "system", "content": "w5"},
                            {"role": "system", "content": "w6 w7"},
                            {"role": "user", "content": "w1", "name": "bob"},
                            {"role": "assistant", "content": ""},
                        ]
                    )
                ]
            },
        )
    ],
    (CHAT, "max_tokens"): [({"max_tokens": None}, {**P(max_tokens=MAX_NEW_TOKENS), "fit_max_tokens": True})],
    (CHAT, "max_completion_tokens"): [
        ({"max_tokens": None, "max_completion_tokens": 3}, P(max_tokens=3)),
        ({"max_tokens": 3, "max_completion_tokens": 3}, P(max_tokens=3)),  # two equal caps are one
        ({"max_tokens": None, "max_completion_tokens": 0}, P(max_tokens=0)),
    ],
    (CHAT, "logprobs"): [({"logprobs": True}, P(logprobs=0)), ({"logprobs": False}, {})],
    (CHAT, "top_logprobs"): [({"logprobs": True, "top_logprobs": 3}, P(logprobs=3))],
    (CHAT, "tools"): [
        ({"tools": [TOOL]}, {**chat(tools=[TOOL]), "tool_plan": PLAN(mode="auto")}),
        ({"tools": [TOOL], "tool_choice": "none"}, {"tool_plan": PLAN(mode="none")}),
    ],
    (CHAT, "tool_choice"): [
        (
            {"tools": [TOOL], "tool_choice": "required"},
            {**chat(tools=[TOOL]), **P(structured_outputs=SO(json=CALLS)), "tool_plan": PLAN(mode="required")},
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            {**chat(tools=[TOOL]), **P(structured_outputs=SO(json=ARGS)), "tool_plan": PLAN(mode="function", name="f")},
        ),
    ],
    (CHAT, "parallel_tool_calls"): [
        (
            {"tools": [TOOL], "parallel_tool_calls": False},
            {**chat(tools=[TOOL]), **P(stop=("</tool_call>",)), "tool_plan": PLAN(mode="auto", parallel=False)},
        ),
    ],
    (CHAT, "metadata"): [({"metadata": {"a": "b"}}, {})],
    (CHAT, "prompt_cache_key"): [({"prompt_cache_key": "k"}, {})],
    (CHAT, "safety_identifier"): [({"safety_identifier": "s"}, {})],
    (CHAT, "add_special_tokens"): [({"add_special_tokens": True}, chat(add_special_tokens=True))],
    (CHAT, "add_generation_prompt"): [({"add_generation_prompt": False}, chat(add_generation_prompt=False))],
    (CHAT, "continue_final_message"): [
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            chat(add_generation_prompt=False, continue_final_message=True),
        )
    ],
    (CHAT, "chat_template_kwargs"): [({"chat_template_kwargs": {"x": 1}}, chat(template_kwargs={"x": 1}))],
    # reaches the Chat; whether it is rendered is the server's PromptPolicy (test_tokenize.py)
    (CHAT, "chat_template"): [({"chat_template": "{{ messages }}"}, chat(chat_template="{{ messages }}"))],
}


def checks_for(endpoint: str, name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return SHARED.get(name, []) + ONLY.get((endpoint, name), [])


def honoured_rows() -> list[tuple[str, Field]]:
    return [(e, f) for e in (COMPLETIONS, CHAT) for f in fields_for(e) if f.is_honoured]


def refused_rows() -> list[tuple[str, Field]]:
    return [(e, f) for e in (COMPLETIONS, CHAT) for f in fields_for(e) if not f.is_honoured]


def build(endpoint: str, fragment: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    return MODELS[endpoint].model_validate({**BASE[endpoint], **fragment})


def engine_view(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """Everything the server takes from the body (mechserve.http.app: ``_prepare``, ``_submit``, ``_render``)."""
    req.check_supported()
    prompts = req.prompts() if isinstance(req, CompletionRequest) else [req.chat()]
    return {
        "params": req.to_params(),
        "prompts": prompts,
        "fit_max_tokens": req.fit_max_tokens,
        "request_id": req.request_id,
        "model": req.model,
        "stream": bool(req.stream),
        "include_usage": req.include_usage,
        "echo": bool(getattr(req, "echo", False)),
        "show_prompt_logprobs": req.prompt_logprobs is not None,
        "return_token_ids": bool(req.return_token_ids),
        "return_tokens_as_token_ids": bool(req.return_tokens_as_token_ids),
        "tool_plan": req.tool_plan() if isinstance(req, ChatCompletionRequest) else None,
    }


def expected_view(endpoint: str, changes: dict[str, Any]) -> dict[str, Any]:
    view = engine_view(build(endpoint, {}))
    changes = dict(changes)
    params = changes.pop("params", {})
    assert set(changes) <= set(view), f"unknown view keys {set(changes) - set(view)}"
    return {**view, **changes, "params": dataclasses.replace(view["params"], **params)}


CASES = [(e, f.name, frag, exp) for e, f in honoured_rows() for frag, exp in checks_for(e, f.name)]
CASE_IDS = [f"{e}-{name}-{i}" for i, (e, name, _, _) in enumerate(CASES)]


def test_the_base_view_is_the_defaults() -> None:
    """What a body with nothing set reaches the engine as: SamplingParams' defaults but max_tokens."""
    for endpoint in (COMPLETIONS, CHAT):
        view = engine_view(build(endpoint, {}))
        assert view["params"] == SamplingParams(max_tokens=2)
        assert not any(view[k] for k in ("fit_max_tokens", "stream", "include_usage", "echo", "show_prompt_logprobs"))
        assert view["request_id"] is None and view["model"] == TINY_NAME
    assert engine_view(build(COMPLETIONS, {}))["prompts"] == [Text("w1 w2", True)]
    assert engine_view(build(CHAT, {}))["prompts"] == [Chat(USER)]


@pytest.mark.parametrize(("endpoint", "row"), honoured_rows(), ids=[f"{e}-{f.name}" for e, f in honoured_rows()])
def test_every_honoured_row_has_a_check_that_changes_something(endpoint: str, row: Field) -> None:
    """A new honoured row without a check fails here; "changes nothing" must be the row's stated meaning."""
    found = checks_for(endpoint, row.name)
    assert found, f"add a check for {endpoint} {row.name} to tests/http/test_field_layer.py"
    for fragment, _ in found:
        assert row.name in fragment, (row.name, fragment)
    if all(not changes for _, changes in found):
        assert "changes nothing" in row.honoured or "accepted" in row.honoured or row.name in {"response_format"}, (
            f"{row.name}: every check expects no change, but the row says it does something"
        )


def test_no_check_for_a_row_outside_the_table() -> None:
    names = {(e, f.name) for e, f in honoured_rows()}
    assert {(e, n) for e, n in ONLY} <= names
    assert all(any((e, n) in names for e in (COMPLETIONS, CHAT)) for n in SHARED)


@pytest.mark.parametrize(("endpoint", "name", "fragment", "changes"), CASES, ids=CASE_IDS)
def test_an_honoured_field_reaches_the_engine_view_unchanged(
    endpoint: str, name: str, fragment: dict[str, Any], changes: dict[str, Any]
) -> None:
    assert engine_view(build(endpoint, fragment)) == expected_view(endpoint, changes)


# Bad values only the engine or the chat template can judge (the vocabulary, the template's own arguments,
# a message left open under an opened turn); tests/http/test_fields.py sends them to a server.
# A constraint's bad value (an unclosed regex group, an unknown rule, a schema keyword llguidance lacks)
# is judged when the grammar engine compiles it, before admission: tests/http/test_structured_outputs.py.
JUDGED_LATER = {"stop_token_ids", "continue_final_message", "chat_template_kwargs", "logit_bias", "model"} | {
    "chat_template",  # refused by the server's PromptPolicy unless it trusts request templates
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "grammar",
    "json_schema",
}
JUDGED_HERE = [(e, f) for e, f in honoured_rows() if f.name not in JUDGED_LATER]


def test_every_row_judged_later_is_sent_to_a_server_by_test_fields() -> None:
    """The rows this file leaves out are each in the table with a bad value (tests/http/test_fields.py and
    test_structured_outputs.py send it to a served model); none is a name outside the table."""
    rows = {f.name: f for _, f in honoured_rows()}
    assert set(rows) >= JUDGED_LATER
    assert all(rows[name].bad for name in JUDGED_LATER)


@pytest.mark.parametrize(("endpoint", "row"), JUDGED_HERE, ids=[f"{e}-{f.name}" for e, f in JUDGED_HERE])
def test_an_honoured_rows_bad_value_is_refused_naming_it(endpoint: str, row: Field) -> None:
    try:
        engine_view(build(endpoint, dict(row.bad)))
    except ValidationError as exc:
        assert exc.errors()[0]["loc"][0] == row.name, exc.errors()
    except (UnsupportedField, ParamError) as exc:
        # a tool definition's error names its part: tools.0.function.name
        assert exc.param == row.name or exc.param.startswith(row.name + "."), exc
    else:
        pytest.fail(f"{endpoint} {row.name}: {row.bad} was accepted")


@pytest.mark.parametrize(("endpoint", "row"), refused_rows(), ids=[f"{e}-{f.name}" for e, f in refused_rows()])
def test_a_refused_row_is_refused_naming_it(endpoint: str, row: Field) -> None:
    with pytest.raises(UnsupportedField) as caught:
        engine_view(build(endpoint, dict(row.bad)))
    assert caught.value.param == row.name and str(caught.value) == row.refusal()
    assert row.name in str(caught.value) and row.why in str(caught.value)


@pytest.mark.parametrize(("endpoint", "row"), refused_rows(), ids=[f"{e}-{f.name}" for e, f in refused_rows()])
def test_a_refused_rows_neutral_values_change_nothing(endpoint: str, row: Field) -> None:
    base = engine_view(build(endpoint, {}))
    values = [None, *row.neutral]
    if row.when_neutral is not None:
        values.append(row.bad[row.name])  # any value while the field the rule names is off
    for value in values:
        assert engine_view(build(endpoint, {row.name: value})) == base, (row.name, value)


def test_tool_choice_needs_tools_unless_it_calls_nothing() -> None:
    """``required`` or a named function without tools is a 400 naming tool_choice; "none"/"auto" are not."""
    for value in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(ParamError) as caught:
            build(CHAT, {"tool_choice": value}).check_supported()
        assert caught.value.param == "tool_choice"
    for value in ("none", "auto", None):
        build(CHAT, {"tool_choice": value}).check_supported()


# --- the same views, captured where the engine receives them ---------------------------------------------------


@pytest.fixture
def captured(tiny_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every ``AsyncLLM.add_request`` call of the server (prompt, params, request id, fit_max_tokens)."""
    llm = tiny_server.llm
    real = llm.add_request
    calls: list[dict[str, Any]] = []

    async def add_request(prompt: Any, params: Any = None, *, request_id: Any = None, fit_max_tokens: bool = False):
        calls.append({"prompt": prompt, "params": params, "request_id": request_id, "fit": fit_max_tokens})
        return await real(prompt, params, request_id=request_id, fit_max_tokens=fit_max_tokens)

    monkeypatch.setattr(llm, "add_request", add_request)
    yield calls


# Another model's name is a 404 before the engine; a constraint needs a byte-level tokenizer, which the word
# model has not, nor a template that renders tools (tests/http/test_structured_outputs.py and test_tool_calls.py
# serve those on their own tiny models); a request's chat_template only on a server that trusts them
# (tests/http/test_tokenize.py).
SERVED_IDS = [
    (c, i)
    for c, i in zip(CASES, CASE_IDS)
    if c[1] not in ("model", "chat_template")
    and "structured_outputs" not in c[3].get("params", {})
    and "tools" not in c[2]
]
SERVED = [c for c, _ in SERVED_IDS]


@pytest.mark.parametrize(("endpoint", "name", "fragment", "changes"), SERVED, ids=[i for _, i in SERVED_IDS])
def test_the_engine_receives_the_view(
    tiny_server: Any,
    captured: list[dict[str, Any]],
    endpoint: str,
    name: str,
    fragment: dict[str, Any],
    changes: dict[str, Any],
) -> None:
    want = expected_view(endpoint, changes)
    body = {**BASE[endpoint], **fragment}
    response = httpx.post(tiny_server.url + ENDPOINT_PATHS[endpoint], json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert [c["prompt"] for c in captured] == want["prompts"]
    assert all(c["params"] == want["params"] for c in captured), (captured[0]["params"], want["params"])
    assert all(c["fit"] == want["fit_max_tokens"] for c in captured)
    if want["request_id"] is not None:
        prefix = "cmpl-" if endpoint == COMPLETIONS else "chatcmpl-"
        assert all(c["request_id"].startswith(prefix + want["request_id"]) for c in captured)


# --- the table's own machinery (mutation testing, docs/mutation.md) ----------------------------------------------


def test_a_refusal_names_the_field_why_and_what_is_accepted() -> None:
    rows = {(e, f.name): f for e, f in refused_rows()}
    assert rows[(CHAT, "function_call")].refusal() == (
        'function_call is not supported: the deprecated functions API; give `tool_choice` (accepted: null, "none", "auto")'
    )
    assert rows[(COMPLETIONS, "guided_decoding_backend")].refusal() == (
        "guided_decoding_backend is not supported: the grammar engine is llguidance "
        '(accepted: null, "guidance", "llguidance", "auto")'
    )
    assert rows[(COMPLETIONS, "mirostat_tau")].refusal() == (
        "mirostat_tau is not supported: no Mirostat sampling (accepted: null; any value while mirostat is 0)"
    )
    assert rows[(COMPLETIONS, "length_penalty")].refusal().endswith("(accepted: null, 1, 1.0)")


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (COMPLETIONS, {"use_beam_search": 0}),  # false is neutral, 0 is not: JSON keeps booleans apart
        (COMPLETIONS, {"priority": False}),  # and the other way round
        (CHAT, {"functions": ""}),  # an empty string is not the empty list
        (COMPLETIONS, {"logits_processors": {}}),  # nor is an empty object
        (CHAT, {"modalities": "t"}),
    ],
)
def test_a_neutral_value_must_have_the_neutral_values_type(endpoint: str, body: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedField) as caught:
        build(endpoint, body).check_supported()
    assert caught.value.param == next(iter(body))


def test_an_unset_rule_is_true_while_each_field_is_absent_null_or_neutral() -> None:
    from mechserve.http.fields import _unset

    rule = _unset("a", "b", neutral={"a": 0})
    assert rule({}) and rule({"a": None, "b": None}) and rule({"a": 0}) and rule({"a": 0.0, "c": 5})
    assert not rule({"a": 1}) and not rule({"b": 0}) and not rule({"a": False}) and not rule({"a": 0, "b": 1})
    assert not _unset("a")({"a": 0}) and _unset("a")({"x": 1})


def test_a_row_is_built_with_what_it_was_given() -> None:
    from mechserve.http.fields import VLLM, _f

    assert _f("x", (CHAT,), VLLM, why="w") == Field("x", (CHAT,), VLLM, why="w", bad={})
    assert _f("x", (CHAT,), VLLM, why="w", bad={"x": 1}).bad == {"x": 1}


def test_json_equality_keeps_booleans_apart_inside_objects_too() -> None:
    from mechserve.http.fields import _same

    assert _same({"a": [1, {"b": False}], "c": "x"}, {"a": [1.0, {"b": False}], "c": "x"})
    assert not _same({"a": False}, {"a": 0}) and not _same({"a": 1}, {"b": 1}) and not _same({"a": 1}, {"a": 2})


# The rows below are built when the module is imported, before a mutant is switched on: called here, their
# builders are checked like ``_f`` (docs/mutation.md, the end-to-end run's `fields`).


def test_a_llama_cpp_samplers_options_are_neutral_while_its_switch_is_off() -> None:
    from mechserve.http.fields import BOTH, LLAMA_CPP, _sampler

    switch, tau, eta = _sampler("s", "not supported: no S", (0, 0.0), 1, tau=5.0, eta=0.1)
    assert switch == Field("s", BOTH, LLAMA_CPP, why="not supported: no S", neutral=(0, 0.0), bad={"s": 1})
    for row, name, value in ((tau, "tau", 5.0), (eta, "eta", 0.1)):
        assert (row.name, row.endpoints, row.origin, row.why, row.neutral) == (name, BOTH, LLAMA_CPP, switch.why, ())
        assert row.neutral_note == "any value while s is 0" and row.bad == {name: value, "s": 1}
        assert row.when_neutral is not None
        assert row.when_neutral({}) and row.when_neutral({"s": 0}) and row.when_neutral({"s": None, name: 3})
        assert not row.when_neutral({"s": 1}) and not row.when_neutral({"s": False})


def test_a_request_template_row_is_honoured_only_for_a_trusted_template() -> None:
    from mechserve.http import fields

    row = fields._request_template((CHAT,), "on the way: ")
    assert row == Field(
        "chat_template",
        (CHAT,),
        fields.VLLM,
        honoured="on the way: " + fields._REQUEST_TEMPLATE,
        refused_values="any template, with a 400 naming the flag, unless the server trusts request templates",
        bad={"chat_template": "{{ x }}"},
    )
    assert fields._request_template((CHAT,)).honoured == fields._REQUEST_TEMPLATE


def test_a_responses_row_taken_from_chat_is_chats_row_word_for_word() -> None:
    from mechserve.http.fields import FIELDS, RESPONSES, _as_chat

    for name in ("min_p", "service_tier"):
        (chat_row,) = (f for f in FIELDS if f.name == name and CHAT in f.endpoints)
        assert _as_chat(name) == dataclasses.replace(chat_row, endpoints=(RESPONSES,))


def test_reasoning_and_thinking_that_ask_for_nothing_are_neutral() -> None:
    from mechserve.http.fields import _reasoning_off, _thinking_off

    for off in ({}, {"effort": None, "summary": None}, {"effort": "none"}):
        assert _reasoning_off({"reasoning": off}), off
    for on in ({"effort": "low"}, {"summary": "none"}, {"effort": "none", "summary": "auto"}):
        assert not _reasoning_off({"reasoning": on}), on
    assert not _reasoning_off({"reasoning": "none"}) and not _reasoning_off({})
    assert _thinking_off({"thinking": {"type": "disabled"}})
    assert not _thinking_off({"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert not _thinking_off({"thinking": "disabled"}) and not _thinking_off({"thinking": {}}) and not _thinking_off({})


def test_the_rendered_table_escapes_pipes_and_newlines(monkeypatch: pytest.MonkeyPatch) -> None:
    from mechserve.http import fields

    row = Field("odd", (CHAT,), fields.VLLM, why="a | b\nc", bad={"odd": 1})
    monkeypatch.setattr(fields, "FIELDS", (row,))
    assert "| `odd` | chat | — | a \\| b c | `null` |" in fields.render_markdown().splitlines()


# --- /tokenize and /detokenize bodies (vLLM's shapes) ------------------------------------------------------------


def test_tokenize_bodies_are_told_apart_and_translated() -> None:
    from pydantic import TypeAdapter

    from mechserve.http.protocol import TokenizeChatRequest, TokenizeCompletionRequest, TokenizeRequest

    adapter = TypeAdapter(TokenizeRequest)
    text = adapter.validate_python({"prompt": "w1", "add_special_tokens": False, "return_token_strs": True})
    assert isinstance(text, TokenizeCompletionRequest)
    assert (text.prompt, text.add_special_tokens, text.return_token_strs) == ("w1", False, True)
    assert TokenizeCompletionRequest(prompt="w1").add_special_tokens is True
    conversation = [{"role": "developer", "content": "w5"}, {"role": "user", "content": "w1"}]
    body = adapter.validate_python({"messages": conversation})
    assert isinstance(body, TokenizeChatRequest)
    body.check_supported()
    assert body.chat() == Chat([{"role": "system", "content": "w5"}, {"role": "user", "content": "w1"}])
    options = {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "add_special_tokens": True,
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"x": 1},
    }
    assert adapter.validate_python({"messages": USER, **options}).chat() == Chat(
        USER,
        add_generation_prompt=False,
        chat_template="{{ messages }}",
        continue_final_message=True,
        template_kwargs={"x": 1},
        add_special_tokens=True,
    )


@pytest.mark.parametrize("name", ["mm_processor_kwargs"])  # tools are rendered (issue 16)
def test_tokenize_refuses_what_it_cannot_do(name: str) -> None:
    from mechserve.http.protocol import TokenizeChatRequest

    value = [{"type": "function"}] if name == "tools" else {"a": 1}
    with pytest.raises(UnsupportedField) as caught:
        TokenizeChatRequest.model_validate({"messages": USER, name: value}).check_supported()
    assert caught.value.param == name and str(caught.value) == f"{name} is not supported by this server's /tokenize"
    TokenizeChatRequest.model_validate({"messages": USER, name: None}).check_supported()


def test_detokenize_takes_token_ids_only() -> None:
    from mechserve.http.protocol import DetokenizeRequest

    assert DetokenizeRequest.model_validate({"tokens": [0, 5]}).tokens == [0, 5]
    for bad in ([-1], [2**31], ["w1"]):
        with pytest.raises(ValidationError):
            DetokenizeRequest.model_validate({"tokens": bad})


# --- honoured fields' refused values and combinations (the table's `refused_values`) ---------------------------

COMBINATIONS = [
    (
        COMPLETIONS,
        {"stream_options": {"include_usage": True}},
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    (
        CHAT,
        {"stream": False, "stream_options": {}},
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    (COMPLETIONS, {"n_predict": 3}, "n_predict", "n_predict and max_tokens disagree; give one of them"),
    (CHAT, {"n_predict": -1}, "n_predict", "n_predict and max_tokens disagree; give one of them"),
    (
        CHAT,
        {"stream": True, "n": 2, "prompt_logprobs": 0},
        "prompt_logprobs",
        "prompt_logprobs with stream and n > 1 is not supported yet",
    ),
    (
        COMPLETIONS,
        {"echo": True, "stream": True, "n": 2, "logprobs": 0},
        "echo",
        "echo with logprobs, stream and n > 1 together is not supported yet",
    ),
    (COMPLETIONS, {"best_of": 3}, "best_of", "best_of is not supported by this server (leave it unset or equal n)"),
    (
        COMPLETIONS,
        {"n": 3, "best_of": 1},
        "best_of",
        "best_of is not supported by this server (leave it unset or equal n)",
    ),
    (
        CHAT,
        {"guided_regex": "a", "guided_choice": ["a"]},
        "guided_choice",
        "guided_choice and guided_regex both constrain the output; give one of them",
    ),
    (
        CHAT,
        {"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"},
        "tool_choice",
        "tool_choice 'required' forces the output to a tool call; it cannot be combined with another output constraint",
    ),
    (
        CHAT,
        {"max_completion_tokens": 3},
        "max_completion_tokens",
        "max_completion_tokens (3) and max_tokens (2) disagree; give one of them (max_tokens is the older name)",
    ),
    (
        CHAT,
        {"max_tokens": None, "max_completion_tokens": 2, "n_predict": 5},
        "max_completion_tokens",
        "max_completion_tokens (2) and n_predict (5) disagree; give one of them (max_tokens is the older name)",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        'response_format of type "json_schema" needs json_schema.schema',
    ),
    (
        CHAT,
        {"response_format": {"type": "json_schema"}},
        "response_format",
        'response_format of type "json_schema" needs json_schema.schema',
    ),
    (  # the constraint's own error, said of the field it came in (not of structured_outputs.json)
        COMPLETIONS,
        {"guided_json": "{not json"},
        "guided_json",
        "guided_json is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
    ),
    (
        CHAT,
        {"stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options",
        "stream_options.include_obfuscation true is not supported: no obfuscation is sent",
    ),
    (CHAT, {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    (CHAT, {"top_logprobs": 2, "logprobs": False}, "top_logprobs", "top_logprobs needs logprobs: true"),
    (
        COMPLETIONS,
        {"logit_bias": {"x": 1}},
        "logit_bias",
        "logit_bias keys must be token ids (non-negative integers), got 'x'",
    ),
    (
        CHAT,
        {"logit_bias": {"-1": 1}},
        "logit_bias",
        "logit_bias keys must be token ids (non-negative integers), got '-1'",
    ),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "message"), COMBINATIONS)
def test_a_refused_combination_names_its_field(endpoint: str, body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises((UnsupportedField, ParamError)) as caught:
        engine_view(build(endpoint, body))
    assert (caught.value.param, str(caught.value)) == (param, message)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}}),
        (CHAT, {"stream": True, "n": 1, "prompt_logprobs": 0}),
        (CHAT, {"stream": False, "n": 2, "prompt_logprobs": 0}),
        (CHAT, {"stream": True, "n": 2}),
        (COMPLETIONS, {"echo": True, "stream": True, "n": 1, "logprobs": 0}),
        (COMPLETIONS, {"echo": True, "stream": True, "n": 2}),
        (COMPLETIONS, {"echo": True, "stream": False, "n": 2, "logprobs": 0}),
        (COMPLETIONS, {"echo": False, "stream": True, "n": 2, "logprobs": 0}),
        (COMPLETIONS, {"n": 3, "best_of": 3}),
        (CHAT, {"top_logprobs": 2, "logprobs": True}),
        (CHAT, {"max_completion_tokens": 2}),
        (CHAT, {"max_tokens": None, "max_completion_tokens": 2, "n_predict": 2}),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    ],
)
def test_the_combinations_next_to_a_refused_one_are_served(endpoint: str, body: dict[str, Any]) -> None:
    engine_view(build(endpoint, body))


def test_a_tool_call_history_reaches_the_template_as_openai_has_it() -> None:
    """An assistant turn's ``tool_calls`` (arguments as objects, the templates' shape) and a tool turn's
    ``tool_call_id``, in the conversation the chat template renders."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    turns = [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    assert build(CHAT, {"messages": turns}).chat().messages == [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]


def test_a_tokenize_conversations_tools_are_rendered_and_a_bad_one_is_refused_by_path() -> None:
    from mechserve.http.protocol import TokenizeChatRequest

    body = TokenizeChatRequest.model_validate({"messages": USER, "tools": [TOOL]})
    body.check_supported()
    assert body.chat().tools == [TOOL]
    assert TokenizeChatRequest.model_validate({"messages": USER}).chat().tools is None
    bad = TokenizeChatRequest.model_validate({"messages": USER, "tools": [{"type": "function", "function": {}}]})
    with pytest.raises(ParamError) as caught:
        bad.check_supported()
    assert caught.value.param == "tools.0.function.name"
