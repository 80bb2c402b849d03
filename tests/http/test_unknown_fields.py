"""No request key is silently ignored: a key outside the field table, or one its part of the body does not have,
is a 400 naming its path with the closest known name, on every endpoint and at every depth the server reads; the
official SDKs' request types have no key the server would call unknown; ``serve --ignore-unknown-fields`` ignores
unknown keys instead, logging each once and naming them in ``x-mechserve-ignored-fields`` (through the router
too)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_support import RouterServer, WorkerProcess
from server_support import TINY_NAME, Served, serving

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.http import anthropic_protocol as anthropic_p
from mechserve.http import protocol as openai_p
from mechserve.http import responses_protocol as responses_p
from mechserve.http import unknown
from mechserve.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from mechserve.http.fields import CHAT, COMPLETIONS, COUNT_TOKENS, ENDPOINT_PATHS, FIELDS, MESSAGES, RESPONSES
from mechserve.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from mechserve.http.responses_protocol import ResponsesRequest
from mechserve.http.unknown import IGNORED_HEADER, Unknown, UnknownField, UnknownPolicy
from mechserve.model.loader import LoadedModel

TOKENIZE, TOKENIZE_CHAT, DETOKENIZE = "tokenize", "tokenize-chat", "detokenize"
USER = [{"role": "user", "content": "w1 w2"}]
BASE: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 3, "temperature": 0},
    CHAT: {"model": TINY_NAME, "messages": USER, "max_tokens": 3, "temperature": 0},
    RESPONSES: {"model": TINY_NAME, "input": "w1 w2", "max_output_tokens": 3, "temperature": 0},
    MESSAGES: {"model": TINY_NAME, "messages": USER, "max_tokens": 3, "temperature": 0},
    COUNT_TOKENS: {"model": TINY_NAME, "messages": USER},
    TOKENIZE: {"model": TINY_NAME, "prompt": "w1 w2"},
    TOKENIZE_CHAT: {"model": TINY_NAME, "messages": USER},
    DETOKENIZE: {"model": TINY_NAME, "tokens": [1, 2]},
}
PATHS = {**ENDPOINT_PATHS, TOKENIZE: "/tokenize", TOKENIZE_CHAT: "/tokenize", DETOKENIZE: "/detokenize"}
MODELS: dict[str, Any] = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    RESPONSES: ResponsesRequest,
    MESSAGES: MessagesRequest,
    COUNT_TOKENS: CountTokensRequest,
    TOKENIZE: TokenizeCompletionRequest,
    TOKENIZE_CHAT: TokenizeChatRequest,
    DETOKENIZE: DetokenizeRequest,
}
ANTHROPIC = (MESSAGES, COUNT_TOKENS)
OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (endpoint, body fragment, the first unknown key's path, the closest known name's path or None)
CASES: list[tuple[str, dict[str, Any], str, str | None]] = [
    # the top of each body
    (COMPLETIONS, {"max_token": 5}, "max_token", "max_tokens"),
    (CHAT, {"temprature": 0.5}, "temprature", "temperature"),
    (RESPONSES, {"instruction": "be brief"}, "instruction", "instructions"),
    (MESSAGES, {"stop_sequence": ["w9"]}, "stop_sequence", "stop_sequences"),
    (COUNT_TOKENS, {"sytem": "s"}, "sytem", "system"),
    (TOKENIZE, {"add_special_token": False}, "add_special_token", "add_special_tokens"),
    (TOKENIZE_CHAT, {"add_generaton_prompt": False}, "add_generaton_prompt", "add_generation_prompt"),
    (DETOKENIZE, {"token": [1]}, "token", "tokens"),
    (CHAT, {"frobnicate": 3}, "frobnicate", None),
    # chat's parts
    (
        CHAT,
        {"messages": [{"role": "user", "contnet": "w1", "content": "w1"}]},
        "messages.0.contnet",
        "messages.0.content",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "w1", "txt": "w2"}]}]},
        "messages.0.content.0.txt",
        "messages.0.content.0.text",
    ),
    (
        CHAT,
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{**CALL, "function": {**CALL["function"], "argument": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "w3"},
            ]
        },
        "messages.1.tool_calls.0.function.argument",
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "paramters": OBJECT}}]},
        "tools.0.function.paramters",
        "tools.0.function.parameters",
    ),
    (
        CHAT,
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": OBJECT}, "strict": True}]},
        "tools.0.strict",
        None,
    ),
    (
        CHAT,
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": OBJECT}}],
            "tool_choice": {"type": "function", "function": {"name": "f", "nam": "f"}},
        },
        "tool_choice.function.nam",
        "tool_choice.function.name",
    ),
    (
        CHAT,
        {"stream": True, "stream_options": {"include_usge": True}},
        "stream_options.include_usge",
        "stream_options.include_usage",
    ),
    (
        COMPLETIONS,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJECT, "stric": True}}},
        "response_format.json_schema.stric",
        "response_format.json_schema.strict",
    ),
    (
        CHAT,
        {"response_format": {"type": "json_object", "schema": OBJECT}},
        "response_format.schema",
        "response_format.json_schema",
    ),
    # Responses' parts
    (RESPONSES, {"input": [{"role": "user", "content": "w1", "contnet": "w2"}]}, "input.0.contnet", "input.0.content"),
    (
        RESPONSES,
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "w1", "txt": "w2"}]}]},
        "input.0.content.0.txt",
        "input.0.content.0.text",
    ),
    (
        RESPONSES,
        {
            "input": [
                {"role": "user", "content": "w1"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "call": "x"},
                {"type": "function_call_output", "call_id": "c", "output": "w2"},
            ]
        },
        "input.1.call",
        "input.1.caller",
    ),
    (
        RESPONSES,
        {"text": {"format": {"type": "json_object", "shema": OBJECT}}},
        "text.format.shema",
        "text.format.schema",
    ),
    (RESPONSES, {"text": {"verbosty": "medium"}}, "text.verbosty", "text.verbosity"),
    (
        RESPONSES,
        {"tools": [{"type": "function", "name": "f", "parameters": OBJECT, "paramters": OBJECT}]},
        "tools.0.paramters",
        "tools.0.parameters",
    ),
    # Anthropic's parts
    (
        MESSAGES,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "w1", "cache_contol": {"type": "ephemeral"}}]}
            ]
        },
        "messages.0.content.0.cache_contol",
        "messages.0.content.0.cache_control",
    ),
    (
        MESSAGES,
        {"tools": [{"name": "f", "input_schema": OBJECT, "inputschema": OBJECT}]},
        "tools.0.inputschema",
        "tools.0.input_schema",
    ),
    (MESSAGES, {"metadata": {"user_id": "u", "userid": "u"}}, "metadata.userid", "metadata.user_id"),
    (
        MESSAGES,
        {"tools": [{"name": "f", "input_schema": OBJECT}], "tool_choice": {"type": "auto", "disable_parallel": True}},
        "tool_choice.disable_parallel",
        "tool_choice.disable_parallel_tool_use",
    ),
    (
        COUNT_TOKENS,
        {"messages": [{"role": "user", "content": "w1", "contnet": "w2"}]},
        "messages.0.contnet",
        "messages.0.content",
    ),
    (COUNT_TOKENS, {"system": [{"type": "text", "text": "s", "txt": "x"}]}, "system.0.txt", "system.0.text"),
    (
        TOKENIZE_CHAT,
        {"messages": [{"role": "user", "content": "w1", "nmae": "u"}]},
        "messages.0.nmae",
        "messages.0.name",
    ),
]
IDS = [f"{e}-{path}" for e, _, path, _ in CASES]


def body_of(endpoint: str, fragment: dict[str, Any]) -> dict[str, Any]:
    return {**BASE[endpoint], **fragment}


@pytest.mark.parametrize(("endpoint", "fragment", "path", "close"), CASES, ids=IDS)
def test_a_body_names_its_unknown_keys_with_the_closest_known_name(
    endpoint: str, fragment: dict[str, Any], path: str, close: str | None
) -> None:
    found = MODELS[endpoint].model_validate(body_of(endpoint, fragment)).unknown_fields()
    assert [u.path for u in found] == [path]
    assert found[0].suggestion() == close
    expected = f"unknown field {path!r}" + (f" (did you mean {close!r}?)" if close else "")
    assert found[0].message() == expected


@pytest.mark.parametrize("endpoint", list(MODELS))
def test_a_body_of_known_keys_has_no_unknown_key(endpoint: str) -> None:
    assert MODELS[endpoint].model_validate(BASE[endpoint]).unknown_fields() == []


def test_the_tables_refused_rows_are_known_not_unknown() -> None:
    """A refused row arrives as an extra key like an unknown one; the table makes it known (its own 400 says why)."""
    for f in FIELDS:
        for endpoint in f.endpoints:
            required = ("model", "messages", "max_tokens", "prompt")
            body = body_of(endpoint, {f.name: None}) if f.name not in required else None
            if body is not None:
                assert MODELS[endpoint].model_validate(body).unknown_fields() == [], (endpoint, f.name)


@pytest.mark.parametrize(("endpoint", "fragment", "path", "close"), CASES, ids=IDS)
def test_an_unknown_key_is_a_400_naming_it(
    tiny_server: Served, endpoint: str, fragment: dict[str, Any], path: str, close: str | None
) -> None:
    response = httpx.post(tiny_server.url + PATHS[endpoint], json=body_of(endpoint, fragment), timeout=30)
    assert response.status_code == 400, response.text
    assert IGNORED_HEADER not in response.headers
    if endpoint in ANTHROPIC:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{path}: unknown field {path!r}"), error
    else:
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (path, "unsupported_parameter"), error
        assert error["message"].startswith(f"unknown field {path!r}"), error
    if close is not None:
        assert f"did you mean {close!r}" in response.text


def test_every_unknown_key_is_named_and_the_first_is_the_param(tiny_server: Served) -> None:
    body = body_of(CHAT, {"max_token": 2, "temprature": 0, "messages": [{"role": "user", "content": "w1", "x": 1}]})
    error = httpx.post(tiny_server.url + PATHS[CHAT], json=body, timeout=30).json()["error"]
    assert error["param"] == "max_token"
    assert error["message"] == (
        "unknown field 'max_token' (did you mean 'max_tokens'?); also unknown: 'temprature', 'messages.0.x'"
    )


def test_a_streamed_request_with_an_unknown_key_is_refused_before_it_streams(tiny_server: Served) -> None:
    body = body_of(COMPLETIONS, {"stream": True, "max_token": 2})
    response = httpx.post(tiny_server.url + PATHS[COMPLETIONS], json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_token"
    tiny_server.wait_idle()


def test_many_unknown_keys_make_one_short_message() -> None:
    error = UnknownField([Unknown(f"k{i}") for i in range(20)])
    assert error.param == "k0" and str(error).endswith("'k8' and 11 more") and len(str(error)) < 200


# --- the official SDKs' request types have no key the server calls unknown --------------------------------------


def keys(kind: Any) -> set[str]:
    """A TypedDict's keys (its bases' included), without evaluating its annotations."""
    return set(kind.__required_keys__) | set(kind.__optional_keys__)


def test_every_top_level_field_of_the_official_sdks_is_a_row() -> None:
    """The openai SDK's completions and chat bodies and the anthropic SDK's beta Messages bodies (the plain ones,
    and Responses, are checked by test_fields), so that refusing unknown fields refuses no SDK field; a newer
    SDK's new field fails here, not a user's request."""
    from anthropic.types.beta import message_count_tokens_params as beta_count
    from anthropic.types.beta import message_create_params as beta_create
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    def rows(endpoint: str) -> set[str]:
        return {f.name for f in FIELDS if endpoint in f.endpoints}

    assert keys(completion_create_params.CompletionCreateParamsStreaming) - rows(COMPLETIONS) == set()
    assert keys(completion_create_params.CompletionCreateParamsNonStreaming) - rows(COMPLETIONS) == set()
    assert keys(chat_create_params.CompletionCreateParamsStreaming) - rows(CHAT) == set()
    sampling = {"temperature", "top_p", "top_k"}  # sent through extra_body by this SDK version
    header = {"betas"}  # the beta SDK sends these as the anthropic-beta header, not in the body
    assert keys(beta_create.MessageCreateParamsStreaming) - header - rows(MESSAGES) == set()
    assert keys(beta_count.MessageCountTokensParams) - header - rows(COUNT_TOKENS) == set()
    assert sampling <= rows(MESSAGES)


def _openai_parts() -> list[tuple[Any, tuple[str, ...]]]:
    from openai.types.chat import (
        chat_completion_assistant_message_param,
        chat_completion_content_part_text_param,
        chat_completion_developer_message_param,
        chat_completion_function_tool_param,
        chat_completion_message_function_tool_call_param,
        chat_completion_named_tool_choice_param,
        chat_completion_stream_options_param,
        chat_completion_system_message_param,
        chat_completion_tool_message_param,
        chat_completion_user_message_param,
    )
    from openai.types.responses import (
        easy_input_message_param,
        function_tool_param,
        response_create_params,
        response_format_text_json_schema_config_param,
        response_function_tool_call_param,
        response_input_item_param,
        response_input_text_param,
        response_output_message_param,
        response_output_text_param,
        response_text_config_param,
        tool_choice_function_param,
    )
    from openai.types.shared_params import function_definition, response_format_json_schema

    message = ChatMessage.known_names()
    return [
        (chat_completion_assistant_message_param.ChatCompletionAssistantMessageParam, message),
        (chat_completion_developer_message_param.ChatCompletionDeveloperMessageParam, message),
        (chat_completion_system_message_param.ChatCompletionSystemMessageParam, message),
        (chat_completion_user_message_param.ChatCompletionUserMessageParam, message),
        (chat_completion_tool_message_param.ChatCompletionToolMessageParam, message),
        (chat_completion_content_part_text_param.ChatCompletionContentPartTextParam, openai_p.TextPart.known_names()),
        (
            chat_completion_message_function_tool_call_param.ChatCompletionMessageFunctionToolCallParam,
            openai_p.ToolCallItem.known_names(),
        ),
        (chat_completion_message_function_tool_call_param.Function, openai_p.ToolCallFunction.known_names()),
        (chat_completion_stream_options_param.ChatCompletionStreamOptionsParam, openai_p.StreamOptions.known_names()),
        (response_format_json_schema.ResponseFormatJSONSchema, openai_p.ResponseFormat.known_names()),
        (response_format_json_schema.JSONSchema, openai_p.JsonSchemaFormat.known_names()),
        (chat_completion_function_tool_param.ChatCompletionFunctionToolParam, openai_p.TOOL_KEYS),
        (function_definition.FunctionDefinition, openai_p.FUNCTION_KEYS),
        (chat_completion_named_tool_choice_param.ChatCompletionNamedToolChoiceParam, openai_p.TOOL_KEYS),
        (chat_completion_named_tool_choice_param.Function, ("name",)),
        (easy_input_message_param.EasyInputMessageParam, responses_p.ITEM_KEYS["message"]),
        (response_input_item_param.Message, responses_p.ITEM_KEYS["message"]),
        (response_output_message_param.ResponseOutputMessageParam, responses_p.ITEM_KEYS["message"]),
        (response_function_tool_call_param.ResponseFunctionToolCallParam, responses_p.ITEM_KEYS["function_call"]),
        (response_input_item_param.FunctionCallOutput, responses_p.ITEM_KEYS["function_call_output"]),
        (response_input_text_param.ResponseInputTextParam, responses_p.PART_KEYS["input_text"]),
        (response_output_text_param.ResponseOutputTextParam, responses_p.PART_KEYS["output_text"]),
        (function_tool_param.FunctionToolParam, responses_p.TOOL_KEYS),
        (tool_choice_function_param.ToolChoiceFunctionParam, ("type", "name")),
        (response_text_config_param.ResponseTextConfigParam, responses_p.TextConfig.known_names()),
        (
            response_format_text_json_schema_config_param.ResponseFormatTextJSONSchemaConfigParam,
            responses_p.TextFormat.known_names(),
        ),
        (response_create_params.StreamOptions, responses_p.StreamOptions.known_names()),
    ]


def _anthropic_parts() -> list[tuple[Any, tuple[str, ...]]]:
    from anthropic.types import (
        assistant_message_param,
        cache_control_ephemeral_param,
        json_output_format_param,
        metadata_param,
        output_config_param,
        text_block_param,
        tool_choice_any_param,
        tool_choice_auto_param,
        tool_choice_none_param,
        tool_choice_tool_param,
        tool_param,
        tool_result_block_param,
        tool_use_block_param,
        user_message_param,
    )

    return [
        (user_message_param.UserMessageParam, anthropic_p.MESSAGE_KEYS),
        (assistant_message_param.AssistantMessageParam, anthropic_p.MESSAGE_KEYS),
        (text_block_param.TextBlockParam, anthropic_p.BLOCK_KEYS["text"]),
        (tool_use_block_param.ToolUseBlockParam, anthropic_p.BLOCK_KEYS["tool_use"]),
        (tool_result_block_param.ToolResultBlockParam, anthropic_p.BLOCK_KEYS["tool_result"]),
        (tool_param.ToolParam, anthropic_p.TOOL_KEYS),
        (tool_choice_auto_param.ToolChoiceAutoParam, anthropic_p.TOOL_CHOICE_KEYS),
        (tool_choice_any_param.ToolChoiceAnyParam, anthropic_p.TOOL_CHOICE_KEYS),
        (tool_choice_tool_param.ToolChoiceToolParam, anthropic_p.TOOL_CHOICE_KEYS),
        (tool_choice_none_param.ToolChoiceNoneParam, anthropic_p.TOOL_CHOICE_KEYS),
        (cache_control_ephemeral_param.CacheControlEphemeralParam, anthropic_p.CacheControl.known_names()),
        (metadata_param.MetadataParam, anthropic_p.Metadata.known_names()),
        (output_config_param.OutputConfigParam, anthropic_p.OutputConfig.known_names()),
        (json_output_format_param.JSONOutputFormatParam, anthropic_p.JsonOutputFormat.known_names()),
    ]


def test_every_key_of_the_official_sdks_body_parts_is_known() -> None:
    """Each part the server checks has every key of the SDK type a client builds it from: a message, a content
    part or block, a tool, a tool choice, stream options, a format (a newer SDK's new key fails here)."""
    parts = _openai_parts() + _anthropic_parts()
    assert len(parts) >= 40
    missing = {kind.__name__: sorted(keys(kind) - set(known)) for kind, known in parts}
    assert {name: m for name, m in missing.items() if m} == {}


def test_an_assistant_messages_audio_is_refused() -> None:
    """The SDK's assistant message has ``audio`` (an earlier audio reply's id); text is the only output here."""
    body = body_of(CHAT, {"messages": [*USER, {"role": "assistant", "content": "w2", "audio": {"id": "a"}}, *USER]})
    with pytest.raises(ValueError, match="audio is not supported"):
        ChatCompletionRequest.model_validate(body)


def test_include_obfuscation_is_refused_only_when_true() -> None:
    for endpoint in (COMPLETIONS, CHAT):
        ok = MODELS[endpoint].model_validate(
            body_of(endpoint, {"stream": True, "stream_options": {"include_obfuscation": False}})
        )
        ok.check_supported()
        bad = MODELS[endpoint].model_validate(
            body_of(endpoint, {"stream": True, "stream_options": {"include_obfuscation": True}})
        )
        with pytest.raises(openai_p.UnsupportedField, match="include_obfuscation"):
            bad.check_supported()


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"defer_loading": True}, "tools.0.defer_loading"),
        ({"allowed_callers": ["code_execution_20250825"]}, "tools.0.allowed_callers"),
        ({"input_examples": [{"a": 1}]}, "tools.0.input_examples"),
    ],
)
def test_an_anthropic_tools_options_with_no_meaning_here_are_refused(tool: dict[str, Any], param: str) -> None:
    body = body_of(MESSAGES, {"tools": [{"name": "f", "input_schema": OBJECT, **tool}]})
    with pytest.raises(ValueError) as raised:
        MessagesRequest.model_validate(body).to_chat()
    assert getattr(raised.value, "param", None) == param
    neutral = {"name": "f", "input_schema": OBJECT, "defer_loading": False, "allowed_callers": ["direct"]}
    MessagesRequest.model_validate(body_of(MESSAGES, {"tools": [{**neutral, "input_examples": []}]})).to_chat()


def test_a_programmatic_tool_use_caller_is_refused() -> None:
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}, "caller": {"type": "code_execution_20250825"}}
    turns = [*USER, {"role": "assistant", "content": [use]}]
    with pytest.raises(ValueError) as raised:
        anthropic_p.anthropic_turns(turns)
    assert getattr(raised.value, "param", None) == "messages.1.content.0.caller"
    anthropic_p.anthropic_turns([*USER, {"role": "assistant", "content": [{**use, "caller": {"type": "direct"}}]}])


# --- the operator's escape hatch: --ignore-unknown-fields -------------------------------------------------------


def test_the_policy_refuses_by_default_and_ignores_on_the_operators_word(caplog: pytest.LogCaptureFixture) -> None:
    found = [Unknown("x_trace"), Unknown("messages.0.id"), Unknown("messages.1.id")]
    with pytest.raises(UnknownField) as raised:
        UnknownPolicy().judge(found, CHAT)
    assert raised.value.param == "x_trace"
    policy = UnknownPolicy(ignore=True)
    with caplog.at_level(logging.WARNING, logger="mechserve.http"):
        assert policy.judge(found, CHAT) == ["x_trace", "messages.*.id"]
        assert policy.judge(found, CHAT) == ["x_trace", "messages.*.id"]
        assert policy.judge(found[:1], RESPONSES) == ["x_trace"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # each pattern once per endpoint
    assert "'messages.*.id' of chat bodies" in lines[1] and "--ignore-unknown-fields" in lines[1]
    assert policy.judge([], CHAT) == []


def test_the_log_of_ignored_keys_is_bounded(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A client inventing a new key per request cannot grow the log or the server's memory without bound."""
    monkeypatch.setattr(unknown, "MAX_LOGGED", 3)
    policy = UnknownPolicy(ignore=True)
    with caplog.at_level(logging.WARNING, logger="mechserve.http"):
        for i in range(10):
            assert policy.judge([Unknown(f"k{i}")], CHAT) == [f"k{i}"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and "further ones are ignored without a log line" in lines[-1], lines


def test_the_header_is_printable_ascii_and_bounded() -> None:
    value = unknown._value(["a\r\nX-Evil: 1", "é", *[f"k{i}" for i in range(40)]]).decode("ascii")
    assert "\r" not in value and "\n" not in value and value.isprintable()
    assert value.startswith("a\\r\\nX-Evil: 1, \\xe9, k0") and value.endswith(", ... 10 more")


def test_an_ignored_tool_call_key_does_not_reach_the_template() -> None:
    function = {"name": "f", "arguments": "{}", "argument_hint": "secret"}
    message = ChatMessage.model_validate({"role": "assistant", "tool_calls": [{**CALL, "function": function, "x": 1}]})
    assert "secret" not in json.dumps(message.as_template_message())


@pytest.fixture(scope="module")
def lenient_server(tiny: LoadedModel) -> Iterator[Served]:
    """A server run with --ignore-unknown-fields (``build_app(ignore_unknown_fields=True)``)."""
    llm = AsyncLLM(tiny, page_size=4, num_pages=256, model_name=TINY_NAME)
    with serving(llm, ignore_unknown_fields=True) as served:
        yield served


def answer(endpoint: str, reply: httpx.Response) -> Any:
    """What a reply says, without what differs between two identical requests (ids, times)."""
    body = reply.json()
    if endpoint in (COMPLETIONS, CHAT):
        return [c.get("text") or c["message"]["content"] for c in body["choices"]], body["usage"]["completion_tokens"]
    if endpoint == RESPONSES:
        return body["output"][0]["content"][0]["text"], body["text"]
    if endpoint == MESSAGES:
        return body["content"], body["usage"]["output_tokens"]
    return body


PROXY_KEYS: dict[str, tuple[dict[str, Any], str]] = {
    COMPLETIONS: ({"litellm_trace": "t1", "max_token": 9}, "litellm_trace, max_token"),
    CHAT: (
        {"litellm_trace": "t1", "messages": [{"role": "user", "content": "w1 w2", "id": 7, "opts": {}}]},
        "litellm_trace, messages.*.id, messages.*.opts",
    ),
    RESPONSES: (
        {"litellm_trace": "t1", "text": {"format": {"type": "text", "x": 1}}},
        "litellm_trace, text.format.x",
    ),
    MESSAGES: (
        {"litellm_trace": "t1", "messages": [{"role": "user", "content": "w1 w2", "id": 7}]},
        "litellm_trace, messages.*.id",
    ),
    COUNT_TOKENS: ({"litellm_trace": "t1"}, "litellm_trace"),
    TOKENIZE: ({"litellm_trace": "t1"}, "litellm_trace"),
    TOKENIZE_CHAT: ({"litellm_trace": "t1"}, "litellm_trace"),
    DETOKENIZE: ({"litellm_trace": "t1"}, "litellm_trace"),
}


@pytest.mark.parametrize("endpoint", list(PROXY_KEYS))
def test_ignored_keys_change_nothing_and_are_named_in_the_header(lenient_server: Served, endpoint: str) -> None:
    fragment, header = PROXY_KEYS[endpoint]
    url = lenient_server.url + PATHS[endpoint]
    plain = httpx.post(url, json=BASE[endpoint], timeout=60)
    proxied = httpx.post(url, json=body_of(endpoint, fragment), timeout=60)
    assert plain.status_code == proxied.status_code == 200, proxied.text
    assert IGNORED_HEADER not in plain.headers
    assert proxied.headers[IGNORED_HEADER] == header
    assert answer(endpoint, proxied) == answer(endpoint, plain)


def test_a_stream_carries_the_header_and_known_keys_are_still_judged(lenient_server: Served) -> None:
    body = body_of(CHAT, {"stream": True, "proxy_id": "p"})
    with httpx.stream("POST", lenient_server.url + PATHS[CHAT], json=body, timeout=60) as stream:
        assert stream.status_code == 200 and stream.headers[IGNORED_HEADER] == "proxy_id"
        assert "data: [DONE]" in stream.read().decode()
    refused = httpx.post(lenient_server.url + PATHS[CHAT], json=body_of(CHAT, {"mirostat": 2, "x": 1}), timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mirostat"
    assert refused.headers[IGNORED_HEADER] == "x"  # the error's response says what was ignored too
    bad = httpx.post(lenient_server.url + PATHS[CHAT], json=body_of(CHAT, {"temperature": 5, "x": 1}), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    lenient_server.wait_idle()


def test_the_serve_flag_reaches_the_server_and_the_router_passes_the_header_back(tiny_dir: Path) -> None:
    """``mechserve serve --ignore-unknown-fields`` in a real process, behind ``mechserve router``; the router
    forwards bodies as they are, so a strict worker's 400 and a lenient one's header both reach the client."""
    from mechserve.cli.main import parse

    assert parse(["serve"]).ignore_unknown_fields is False
    assert parse(["serve", "--ignore-unknown-fields"]).ignore_unknown_fields is True
    lenient = WorkerProcess(tiny_dir, None, TINY_NAME, "--ignore-unknown-fields")
    strict = WorkerProcess(tiny_dir)
    try:
        lenient.wait_ready()
        strict.wait_ready()
        cache_control = {"type": "text", "text": "w1 w2", "cache_control": {"type": "ephemeral"}}
        messages = body_of(MESSAGES, {"messages": [{"role": "user", "content": [cache_control]}], "proxy": 1})
        for worker, status in ((lenient, 200), (strict, 400)):
            with RouterServer([worker.url], "cache_aware") as router:
                reply = httpx.post(router.url + PATHS[CHAT], json=body_of(CHAT, {"max_token": 2}), timeout=60)
                assert reply.status_code == status, reply.text
                if status == 200:
                    assert reply.headers[IGNORED_HEADER] == "max_token"
                    streamed = body_of(COMPLETIONS, {"stream": True, "x": 1})
                    with httpx.stream("POST", router.url + PATHS[COMPLETIONS], json=streamed, timeout=60) as s:
                        assert s.status_code == 200 and s.headers[IGNORED_HEADER] == "x"
                        s.read()
                    reply = httpx.post(router.url + "/tokenize", json=body_of(TOKENIZE, {"x": 1}), timeout=60)
                    assert reply.status_code == 200 and reply.headers[IGNORED_HEADER] == "x"
                else:
                    assert reply.json()["error"]["param"] == "max_token", reply.text
                # a block's cache_control is known to Messages (and the router's own /tokenize of it works)
                reply = httpx.post(router.url + PATHS[MESSAGES], json=messages, timeout=60)
                assert reply.status_code == status, reply.text
    finally:
        lenient.stop()
        strict.stop()


def test_the_routers_tokenize_query_keeps_a_text_blocks_text_alone() -> None:
    from mechserve.router.app import chat_messages

    block = {"type": "text", "text": "w1", "cache_control": {"type": "ephemeral"}}
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    body = {
        "system": [block],
        "messages": [{"role": "user", "content": [block]}, {"role": "assistant", "content": [use]}],
    }
    assert chat_messages("/v1/messages", body) == [
        {"role": "system", "content": [{"type": "text", "text": "w1"}]},
        {"role": "user", "content": [{"type": "text", "text": "w1"}]},
        {"role": "assistant", "content": [use]},
    ]


def test_the_unknown_keys_of_function_tools_and_a_named_tool_choice_are_each_found() -> None:
    """Every level of chat's function tools and named ``tool_choice`` (OpenAI's keys), in the body's order; a tool
    of another type is refused by its type (``parse_tools``), not for its keys; /tokenize's tools likewise."""
    tools = [
        {"type": "function", "function": {"name": "f", "x1": 1}, "y": 2},
        {"type": "function", "function": {"name": "g"}, "z": 3},
    ]
    choice = {"type": "function", "function": {"name": "f", "w": 1}, "v": 2}
    body = body_of(CHAT, {"tools": tools, "tool_choice": choice})
    found = ChatCompletionRequest.model_validate(body).unknown_fields()
    assert [u.path for u in found] == [
        "tools.0.y",
        "tools.0.function.x1",
        "tools.1.z",
        "tool_choice.v",
        "tool_choice.function.w",
    ]
    other = body_of(CHAT, {"tools": [{"type": "custom", "custom": {"name": "x"}}], "tool_choice": "auto"})
    assert ChatCompletionRequest.model_validate(other).unknown_fields() == []
    tokenize = TokenizeChatRequest.model_validate({"messages": USER, "tools": tools})
    assert [u.path for u in tokenize.unknown_fields()] == ["tools.0.y", "tools.0.function.x1", "tools.1.z"]
