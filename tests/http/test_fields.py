"""The field table (``mechserve.http.fields``) is the server's single source: the docs are its rendering, the
request models declare exactly its honoured fields, every row's bad value is a 400 naming that row's field,
every refused row's neutral values and every field's null are accepted, and fields outside it are refused
(tests/http/test_unknown_fields.py checks them at every depth)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_support import TINY_NAME

from mechserve.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from mechserve.http.fields import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    ENDPOINT_PATHS,
    FIELDS,
    MESSAGES,
    RESPONSES,
    Field,
    honoured_names,
    render_markdown,
)
from mechserve.http.protocol import ChatCompletionRequest, CompletionRequest
from mechserve.http.responses_protocol import ResponsesRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "api-fields.md"
USER = [{"role": "user", "content": "w1"}]
BASE = {
    COMPLETIONS: {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 2},
    CHAT: {"model": TINY_NAME, "messages": USER, "max_tokens": 2},
    RESPONSES: {"model": TINY_NAME, "input": "w1", "max_output_tokens": 2},
    MESSAGES: {"model": TINY_NAME, "messages": USER, "max_tokens": 2},
    COUNT_TOKENS: {"model": TINY_NAME, "messages": USER},
}
REQUIRED = {COMPLETIONS: {"prompt"}, CHAT: {"messages"}, MESSAGES: {"model", "messages", "max_tokens"}}
REQUIRED |= {COUNT_TOKENS: {"model", "messages"}, RESPONSES: {"input"}}
MODELS = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    RESPONSES: ResponsesRequest,
    MESSAGES: MessagesRequest,
    COUNT_TOKENS: CountTokensRequest,
}
ANTHROPIC = (MESSAGES, COUNT_TOKENS)


def post(served: Any, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + ENDPOINT_PATHS[endpoint], json={**BASE[endpoint], **body}, timeout=30)


def refusal(endpoint: str, response: httpx.Response) -> tuple[str, str, str | None]:
    """A 400's ``(param, message, code)``: OpenAI's body names the field in ``param``; Anthropic's at the start of
    its message (``thinking: ...``), with no code."""
    body = response.json()
    if endpoint in ANTHROPIC:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        message = body["error"]["message"]
        return message.split(":", 1)[0].split(" ", 1)[0], message, None
    error = body["error"]
    return str(error["param"]), error["message"], error["code"]


def rows() -> list[tuple[str, Field]]:
    return [(e, f) for f in FIELDS for e in f.endpoints]


def test_the_docs_are_the_table_rendered() -> None:
    assert DOC.read_text() == render_markdown(), "run: make api-fields"


@pytest.mark.parametrize("endpoint", list(MODELS))
def test_the_request_models_declare_exactly_the_honoured_fields(endpoint: str) -> None:
    assert set(MODELS[endpoint].model_fields) == honoured_names(endpoint)


def test_every_row_is_complete_and_names_are_unique_per_endpoint() -> None:
    seen = set()
    for endpoint, f in rows():
        assert (endpoint, f.name) not in seen, f.name
        seen.add((endpoint, f.name))
        assert bool(f.honoured) != bool(f.why), f"{f.name}: honoured or refused, with a reason"
        assert f.name in f.bad, f"{f.name}: its bad value must set it"


@pytest.mark.parametrize(("endpoint", "row"), rows(), ids=[f"{e}-{f.name}" for e, f in rows()])
def test_each_rows_bad_value_is_a_400_naming_it(tiny_server, endpoint: str, row: Field) -> None:
    response = post(tiny_server, endpoint, dict(row.bad))
    assert response.status_code == 400, response.text
    param, message, code = refusal(endpoint, response)
    assert param == row.name or param.startswith(row.name + "."), response.text
    if not row.honoured:
        assert code in ("unsupported_parameter", None) and row.name in message


NEUTRAL = [(e, f, v) for e, f in rows() for v in (None, *f.neutral) if f.name not in REQUIRED.get(e, ())]


@pytest.mark.parametrize(("endpoint", "row", "value"), NEUTRAL, ids=[f"{e}-{f.name}-{v!r}" for e, f, v in NEUTRAL])
def test_null_and_neutral_values_are_accepted(tiny_server, endpoint: str, row: Field, value: Any) -> None:
    body = {row.name: value}
    response = post(tiny_server, endpoint, body)
    assert response.status_code == 200, (body, response.text)


def test_a_rule_makes_any_value_neutral_while_its_field_is_off(tiny_server) -> None:
    """llama.cpp's web UI sends its defaults: repeat_last_n 64 with no penalty, mirostat 0 with its tau."""
    llama_cpp = {"repeat_last_n": 64, "repeat_penalty": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1}
    llama_cpp |= {"dry_multiplier": 0, "dry_base": 1.75, "xtc_probability": 0, "xtc_threshold": 0.1, "n_probs": 0}
    assert post(tiny_server, COMPLETIONS, {**llama_cpp, "cache_prompt": True, "typical_p": 1.0}).status_code == 200
    refused = post(tiny_server, COMPLETIONS, {**llama_cpp, "presence_penalty": 0.5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repeat_last_n"


def test_required_fields_refuse_null(tiny_server) -> None:
    required = [(e, n) for e, names in REQUIRED.items() for n in sorted(names)]
    for endpoint, name in required:
        response = post(tiny_server, endpoint, {name: None})
        assert response.status_code == 400, (endpoint, name, response.text)
        assert refusal(endpoint, response)[0] == name, response.text


@pytest.mark.parametrize("endpoint", list(MODELS))
def test_fields_outside_the_table_are_refused_naming_them(tiny_server, endpoint: str) -> None:
    """They were ignored, as vLLM does: a typo such as ``max_token`` was answered as if it had not been sent."""
    response = post(tiny_server, endpoint, {"frobnicate": 3, "x_trace": {"a": "b"}})
    assert response.status_code == 400, response.text
    param, message, code = refusal(endpoint, response)
    assert param == "frobnicate" and code in ("unsupported_parameter", None), response.text
    assert "unknown field 'frobnicate'" in message and "'x_trace'" in message


def test_what_common_clients_send_by_default_is_accepted(tiny_server) -> None:
    """The defaults of the openai client, LangChain and llama.cpp's UI, spelled out as they send them."""
    defaults = {
        "n": None,
        "stream": None,
        "echo": None,
        "logprobs": None,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
        "stop": None,
        "seed": None,
        "top_p": 1,
        "user": None,
        "best_of": None,
        "suffix": None,
        "stream_options": None,
        "use_beam_search": False,
    }
    assert post(tiny_server, COMPLETIONS, defaults).status_code == 200
    chat = {k: v for k, v in defaults.items() if k not in ("echo", "best_of", "suffix", "use_beam_search")}
    chat |= {"logprobs": False, "top_logprobs": None, "tools": None, "tool_choice": "none", "parallel_tool_calls": True}
    chat |= {"response_format": {"type": "text"}, "max_completion_tokens": None, "modalities": ["text"], "store": False}
    assert post(tiny_server, CHAT, chat).status_code == 200


def _float_fields(endpoint: str) -> list[str]:
    scalar = lambda a: "float" in a and not any(c in a for c in ("dict", "list", "Dict", "List"))  # noqa: E731
    return sorted(n for n, f in MODELS[endpoint].model_fields.items() if scalar(str(f.annotation)))


FLOATS = [(e, n, v) for e in MODELS for n in _float_fields(e) for v in ("NaN", "Infinity")]


@pytest.mark.parametrize(("endpoint", "name", "value"), FLOATS, ids=[f"{e}-{n}-{v}" for e, n, v in FLOATS])
def test_non_finite_numbers_are_a_400_naming_the_field(tiny_server, endpoint: str, name: str, value: str) -> None:
    """JSON's NaN / Infinity (Python's json accepts them) are refused as not finite, not checked against a range
    (``temperature: NaN`` used to be told it must be ``<= 2``)."""
    assert len(FLOATS) >= 8  # temperature, top_p, the penalties, ... on both endpoints
    body = json.dumps({**BASE[endpoint], name: 0.5}).replace("0.5", value)
    response = httpx.post(
        tiny_server.url + ENDPOINT_PATHS[endpoint], content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    param, message, _ = refusal(endpoint, response)
    assert param == name and "finite" in message, response.text


def _sdk_fields(kind: Any) -> set[str]:
    import typing

    return set(typing.get_type_hints(kind))


def test_every_field_of_the_official_sdks_request_types_is_a_row() -> None:
    """Issue 29: each field the ``openai`` SDK sends to ``/v1/responses`` and the ``anthropic`` SDK to ``/v1/messages``
    and ``/v1/messages/count_tokens`` is in the table, honoured or refused (Anthropic's sampling fields, which this
    SDK version leaves to ``extra_body``, and its beta fields included)."""
    import inspect

    from anthropic.resources import Messages
    from anthropic.types import message_count_tokens_params, message_create_params
    from openai.types.responses import response_create_params

    def rows_of(endpoint: str) -> set[str]:
        return {f.name for f in FIELDS if endpoint in f.endpoints}

    openai_fields = _sdk_fields(response_create_params.ResponseCreateParamsStreaming)
    assert openai_fields - rows_of(RESPONSES) == set()
    create = _sdk_fields(message_create_params.MessageCreateParamsStreaming) | {"temperature", "top_p", "top_k"}
    count = _sdk_fields(message_count_tokens_params.MessageCountTokensParams)
    count |= set(inspect.signature(Messages.count_tokens).parameters) - {
        "self",
        "extra_headers",
        "extra_query",
        "extra_body",
        "timeout",
    }
    assert create - rows_of(MESSAGES) == set()
    assert count - rows_of(COUNT_TOKENS) == set()
