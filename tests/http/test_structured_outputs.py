"""Structured outputs over HTTP, on a tiny random model with a byte-level tokenizer: every spelling
(OpenAI's ``response_format`` with the official client, vLLM's ``structured_outputs`` and ``guided_*``,
llama.cpp's ``json_schema`` and ``grammar``) on both endpoints, and the 400s naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from server_support import Served, serving
from tiny_models import BYTE_VOCAB, save_byte_tokenizer, save_tiny, tiny_config

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.model.loader import LoadedModel, load_model

NAME = "tiny-bytes"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path: Path = tmp_path_factory.mktemp("tiny-bytes-server")
    save_tiny(path, tiny_config(vocab_size=BYTE_VOCAB, eos_token_id=0, bos_token_id=0), seed=3)
    save_byte_tokenizer(path)
    loaded = load_model(str(path))
    loaded = LoadedModel(loaded.path, loaded.model, loaded.tokenizer, (0,))
    with serving(AsyncLLM(loaded, page_size=4, num_pages=256, model_name=NAME)) as served:
        yield served


def post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + path, json={"model": NAME, "max_tokens": 60, **body}, timeout=60)


def chat(served: Served, **body: Any) -> httpx.Response:
    return post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a person"}], **body})


def completion(served: Served, **body: Any) -> httpx.Response:
    return post(served, "/v1/completions", {"prompt": "a person:", **body})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_openai_client_json_schema_on_chat_and_completions(byte_server: Served) -> None:
    client = byte_server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "a person"}], response_format=fmt, max_tokens=60, seed=1
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)
    done = client.completions.create(
        model=NAME, prompt="a person:", max_tokens=60, temperature=0, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    obj = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "anything"}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
        extra_body={"json_schema": None},
    )
    assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("endpoint", [chat, completion], ids=["chat", "completions"])
def test_every_spelling_is_honoured(byte_server: Served, endpoint: Any) -> None:
    jsonschema.validate(json.loads(text_of(endpoint(byte_server, structured_outputs={"json": PERSON}))), PERSON)
    jsonschema.validate(json.loads(text_of(endpoint(byte_server, guided_json=json.dumps(PERSON)))), PERSON)
    jsonschema.validate(json.loads(text_of(endpoint(byte_server, json_schema=PERSON))), PERSON)
    assert re.fullmatch(r"[0-9]{2}-[a-c]+", text_of(endpoint(byte_server, guided_regex=r"[0-9]{2}-[a-c]+")))
    assert text_of(endpoint(byte_server, guided_choice=["red", "green"], temperature=1.0)) in {"red", "green"}
    assert text_of(endpoint(byte_server, structured_outputs={"choice": ["x", "yy"]})) in {"x", "yy"}
    assert re.fullmatch(r"a(,a)*!", text_of(endpoint(byte_server, grammar='root ::= "a" ("," "a")* "!"')))
    assert re.fullmatch(r"\(b+\)", text_of(endpoint(byte_server, guided_grammar='start: "(" /b+/ ")"')))


def test_streaming_a_constrained_chat(byte_server: Served) -> None:
    client = byte_server.client()
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=60,
        stream=True,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("body", "param", "problem"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
            "not",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
        ({"guided_json": {"type": "string", "format": "zip"}}, "guided_json", "zip"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),
        ({"json_schema": {"type": "object"}, "guided_regex": "a"}, "json_schema", "both constrain"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_problem(byte_server: Served, body, param, problem) -> None:
    for send in (chat, completion):
        response = send(byte_server, **body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and problem in error["message"], error
    byte_server.wait_idle()
