"""The Responses and Anthropic Messages bodies are translations into a chat request: every honoured row of the field
table (endpoints ``responses``, ``messages``, ``count_tokens``) either changes the chat request it becomes exactly as
written here, or is one the response itself honours (named with the served test that checks it), so a new honoured
row without a check fails.  Refused rows are ``test_fields.py``'s (each row's bad value, every neutral value)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mechserve.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from mechserve.http.fields import COUNT_TOKENS, MESSAGES, RESPONSES, fields_for
from mechserve.http.responses_protocol import ResponsesRequest

USER = [{"role": "user", "content": "w1"}]
F = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL_R = {"type": "function", "name": "f", "description": "d", "parameters": F, "strict": True}
TOOL_A = {"name": "f", "description": "d", "input_schema": F}
CHAT_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": F}}

# fragment -> the chat request's fields it changes (compared with the base body's)
RESPONSES_CHECKS: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {
    "model": [({"model": "m2"}, {"model": "m2"})],
    "input": [
        ({"input": "w7"}, {"messages": [{"role": "user", "content": "w7"}]}),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "w7"}]}]},
            {"messages": [{"role": "user", "content": "w7"}]},
        ),
    ],
    "instructions": [({"instructions": "w9"}, {"messages": [{"role": "system", "content": "w9"}, *USER]})],
    "max_output_tokens": [({"max_output_tokens": 7}, {"max_completion_tokens": 7})],
    "temperature": [({"temperature": 0.5}, {"temperature": 0.5})],
    "top_p": [({"top_p": 0.5}, {"top_p": 0.5})],
    "tools": [({"tools": [TOOL_R]}, {"tools": [{**CHAT_TOOL, "function": {**CHAT_TOOL["function"], "strict": True}}]})],
    "tool_choice": [
        (
            {"tools": [TOOL_R], "tool_choice": {"type": "function", "name": "f"}},
            {
                "tools": [{**CHAT_TOOL, "function": {**CHAT_TOOL["function"], "strict": True}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
        ),
        ({"tool_choice": "none"}, {"tool_choice": "none"}),
    ],
    "parallel_tool_calls": [({"parallel_tool_calls": False}, {"parallel_tool_calls": False})],
    "text": [
        ({"text": {"format": {"type": "json_object"}}}, {"response_format": {"type": "json_object"}}),
        (
            {"text": {"format": {"type": "json_schema", "name": "n", "schema": F, "strict": True}}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": F, "strict": True}}},
        ),
        ({"text": {"format": {"type": "text"}, "verbosity": "medium"}}, {}),
    ],
    "include": [({"include": ["message.output_text.logprobs"]}, {"logprobs": True})],
    "top_logprobs": [
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 3})
    ],
    "top_k": [({"top_k": 5}, {"top_k": 5})],
    "min_p": [({"min_p": 0.1}, {"min_p": 0.1})],
    "repetition_penalty": [({"repetition_penalty": 1.2}, {"repetition_penalty": 1.2})],
    "seed": [({"seed": 7}, {"seed": 7})],
    "stop": [({"stop": ["w3"]}, {"stop": ["w3"]})],
    "ignore_eos": [({"ignore_eos": True}, {"ignore_eos": True})],
    "skip_special_tokens": [({"skip_special_tokens": False}, {"skip_special_tokens": False})],
    "include_stop_str_in_output": [({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True})],
    "truncation": [({"truncation": "disabled"}, {})],
    "chat_template": [({"chat_template": "{{ x }}"}, {"chat_template": "{{ x }}"})],
}
# honoured by the response around the chat request, each checked by the served test named
RESPONSES_SERVED = {
    "previous_response_id": "test_a_continued_response_puts_the_previous_turn_before_its_input",
    "store": "test_stored_responses_are_retrieved_and_deleted",
    "background": "test_a_background_response_is_polled_and_cancelled",
    "stream": "test_the_stream_is_openais_events_in_order_numbered_from_zero",
    "stream_options": "test_neutral_values_of_refused_fields_are_accepted",
    "metadata": "test_a_response_is_the_chat_paths_reply_in_the_responses_shape",
    "user": "test_api_translation::test_response_level_fields_are_returned",
    "safety_identifier": "test_api_translation::test_response_level_fields_are_returned",
    "prompt_cache_key": "test_api_translation::test_response_level_fields_are_returned",
    "max_tool_calls": "test_api_translation::test_response_level_fields_are_returned",
    "request_id": "test_api_translation::test_response_level_fields_are_returned",
}

ANTHROPIC_CHECKS: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {
    "model": [({"model": "m2"}, {"model": "m2"})],
    "messages": [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "w7"}]}]},
            {"messages": [{"role": "user", "content": "w7"}]},
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": "w2"}]},
            {
                "messages": [*USER, {"role": "assistant", "content": "w2"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ),
    ],
    "system": [
        ({"system": "w9"}, {"messages": [{"role": "system", "content": "w9"}, *USER]}),
        (
            {"system": [{"type": "text", "text": "w8"}, {"type": "text", "text": "w9"}]},
            {"messages": [{"role": "system", "content": "w8\nw9"}, *USER]},
        ),
    ],
    "max_tokens": [({"max_tokens": 7}, {"max_tokens": 7})],
    "stop_sequences": [({"stop_sequences": ["w3"]}, {"stop": ["w3"]})],
    "temperature": [({"temperature": 0.5}, {"temperature": 0.5})],
    "top_p": [({"top_p": 0.5}, {"top_p": 0.5})],
    "top_k": [({"top_k": 5}, {"top_k": 5})],
    "tools": [({"tools": [TOOL_A]}, {"tools": [CHAT_TOOL]})],
    "tool_choice": [
        ({"tools": [TOOL_A], "tool_choice": {"type": "any"}}, {"tools": [CHAT_TOOL], "tool_choice": "required"}),
        (
            {"tools": [TOOL_A], "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True}},
            {
                "tools": [CHAT_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "parallel_tool_calls": False,
            },
        ),
        ({"tool_choice": {"type": "none"}}, {"tool_choice": "none"}),
        ({"tool_choice": {"type": "auto"}}, {"tool_choice": "auto"}),
    ],
    "output_config": [
        (
            {"output_config": {"format": {"type": "json_schema", "schema": F}}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": F}}},
        )
    ],
    "output_format": [
        (
            {"output_format": {"type": "json_schema", "schema": F}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": F}}},
        )
    ],
    "cache_control": [({"cache_control": {"type": "ephemeral"}}, {})],
    "metadata": [({"metadata": {"user_id": "u"}}, {})],
    "user_profile_id": [({"user_profile_id": "p"}, {})],
    "workspace_id": [({"workspace_id": "w"}, {})],
    "chat_template": [({"chat_template": "{{ x }}"}, {"chat_template": "{{ x }}"})],
}
ANTHROPIC_SERVED = {"stream": "test_the_stream_is_anthropics_event_sequence"}
ACCEPTED = {"cache_control", "metadata", "user_profile_id", "workspace_id", "truncation"}  # change nothing, by design


def chat_of(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    if endpoint == RESPONSES:
        request: Any = ResponsesRequest.model_validate({"model": "m", "input": "w1", **body})
    elif endpoint == MESSAGES:
        request = MessagesRequest.model_validate({"model": "m", "max_tokens": 2, "messages": USER, **body})
    else:
        body = {k: v for k, v in body.items() if k != "max_tokens"}
        request = CountTokensRequest.model_validate({"model": "m", "messages": USER, **body})
    return request.to_chat().model_dump(exclude_none=True, by_alias=True)


def changes(endpoint: str, fragment: dict[str, Any]) -> dict[str, Any]:
    base, changed = chat_of(endpoint, {}), chat_of(endpoint, fragment)
    return {k: v for k, v in changed.items() if base.get(k) != v} | {k: None for k in base if k not in changed}


def checks(endpoint: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    table = RESPONSES_CHECKS if endpoint == RESPONSES else ANTHROPIC_CHECKS
    out = []
    for row in fields_for(endpoint):
        for fragment, expected in table.get(row.name, []) if row.is_honoured else []:
            if endpoint == COUNT_TOKENS and row.name in (
                "max_tokens",
                "stop_sequences",
                "temperature",
                "top_p",
                "top_k",
            ):
                continue
            out.append((row.name, fragment, expected))
    return out


CASES = [(e, *c) for e in (RESPONSES, MESSAGES, COUNT_TOKENS) for c in checks(e)]


@pytest.mark.parametrize(
    ("endpoint", "name", "fragment", "expected"), CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)]
)
def test_an_honoured_field_becomes_the_chat_request_written_here(
    endpoint: str, name: str, fragment: dict[str, Any], expected: dict[str, Any]
) -> None:
    got = changes(endpoint, fragment)
    if endpoint == COUNT_TOKENS:
        expected = {k: v for k, v in expected.items() if k in chat_of(endpoint, fragment) or v is None}
    assert got == expected, json.dumps(got)


@pytest.mark.parametrize("endpoint", [RESPONSES, MESSAGES, COUNT_TOKENS])
def test_every_honoured_row_is_checked(endpoint: str) -> None:
    table = RESPONSES_CHECKS if endpoint == RESPONSES else ANTHROPIC_CHECKS
    served = RESPONSES_SERVED if endpoint == RESPONSES else ANTHROPIC_SERVED
    for row in fields_for(endpoint):
        if not row.is_honoured:
            continue
        assert row.name in table or row.name in served, f"{endpoint}.{row.name}: honoured, with no check"
        if row.name in table and row.name not in ACCEPTED:
            assert any(expected for _, expected in table[row.name]), f"{row.name}: a check must change something"


def test_response_level_fields_are_returned(tiny_server: Any) -> None:
    import httpx

    body = {"model": "tiny", "input": "w1", "max_output_tokens": 1, "user": "u1", "safety_identifier": "s1"}
    body |= {"prompt_cache_key": "k1", "max_tool_calls": 3, "request_id": "my-id-1"}
    reply = httpx.post(tiny_server.url + "/v1/responses", json=body, timeout=30).json()
    assert reply["id"] == "resp_my-id-1" and reply["user"] == "u1" and reply["safety_identifier"] == "s1"
    assert reply["prompt_cache_key"] == "k1" and reply["max_tool_calls"] == 3


# Nothing a client sends is a 500 ----------------------------------------------------------------------------------------

R_FIELDS = [
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "text",
]
R_FIELDS += [
    "include",
    "top_logprobs",
    "metadata",
    "store",
    "previous_response_id",
    "background",
    "truncation",
    "reasoning",
]
M_FIELDS = ["model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools"]
M_FIELDS += ["tool_choice", "metadata", "output_config", "output_format", "thinking", "cache_control"]


def _weird() -> Any:
    from hypothesis import strategies as st
    from test_errors import WEIRD

    keys = st.sampled_from(
        [
            "type",
            "role",
            "content",
            "text",
            "call_id",
            "tool_use_id",
            "name",
            "arguments",
            "input",
            "output",
            "id",
            "parameters",
            "input_schema",
            "schema",
            "format",
            "effort",
        ]
    )
    item = st.dictionaries(
        keys,
        st.one_of(
            WEIRD,
            st.sampled_from(
                [
                    "message",
                    "function_call",
                    "function_call_output",
                    "user",
                    "assistant",
                    "tool_use",
                    "tool_result",
                    "text",
                    "input_text",
                    "function",
                    "json_schema",
                ]
            ),
        ),
        max_size=5,
    )
    return st.one_of(WEIRD, item, st.lists(st.one_of(item, WEIRD), max_size=3))


def test_no_responses_or_messages_body_ever_gets_a_5xx(tiny_server: Any) -> None:
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data(), anthropic=st.booleans())
    def run(data: Any, anthropic: bool) -> None:
        names = M_FIELDS if anthropic else R_FIELDS
        body = data.draw(st.dictionaries(st.sampled_from(names), _weird(), max_size=5))
        limit = "max_tokens" if anthropic else "max_output_tokens"
        body[limit] = body.get(limit) if body.get(limit) in (None, 1, 2) else 2
        body.setdefault("model", "tiny")
        if anthropic:
            body.setdefault("messages", USER)
        path = "/v1/messages" if anthropic else "/v1/responses"
        content = json.dumps(body)  # NaN and Infinity included
        response = httpx.post(tiny_server.url + path, content=content, headers={"content-type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        if response.status_code != 200:
            error = response.json()
            assert (
                (error["type"] == "error" and "message" in error["error"]) if anthropic else "message" in error["error"]
            )

    run()
