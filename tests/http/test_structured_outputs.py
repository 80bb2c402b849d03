"""Structured outputs over HTTP, on a tiny random model with a byte-level tokenizer: every spelling
(OpenAI's ``response_format`` with the official client, vLLM's ``structured_outputs`` and ``guided_*``,
llama.cpp's ``json_schema`` and ``grammar``) on both endpoints, and the 400s naming the field."""

from __future__ import annotations

import json
import logging
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


FAILING = r"[0-9]{4,9}"


def metric(served: Served, name: str) -> float:
    """The value of gauge ``name`` (no labels but the model's) on ``/metrics``."""
    for line in httpx.get(served.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def test_a_constraint_failing_inside_a_step_fails_its_request_alone(
    byte_server: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31: a grammar that compiles but fails inside the step (planted: its matcher raises on its third
    mask) ends that request alone with a 400 naming the body's field (an error event in a stream) and one log
    line; the requests running beside it finish with the ids they have alone, and /metrics returns to idle."""
    from concurrent.futures import ThreadPoolExecutor

    from mechserve.executor.structured import GrammarMatcher

    def streamed_text(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        events = []
        with httpx.stream("POST", byte_server.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        return text, [e for e in events if "error" in e]

    good = [{"model": NAME, "prompt": f"w{i} said:", "max_tokens": 24, "temperature": 0} for i in range(4)]
    good[1]["stream"] = good[3]["stream"] = True
    good[2]["structured_outputs"] = {"regex": "[a-z ]{3,20}"}

    def send(body: dict[str, Any]) -> Any:
        if body.get("stream"):
            return streamed_text(body)
        return httpx.post(byte_server.url + "/v1/completions", json=body, timeout=60)

    def text(result: Any) -> str:
        if isinstance(result, tuple):
            return str(result[0])
        assert result.status_code == 200, result.text
        return str(result.json()["choices"][0]["text"])

    alone = [text(send(b)) for b in good]
    original = GrammarMatcher.window_masks

    def third_mask_fails(self: GrammarMatcher, *args: Any) -> int:
        if self.grammar.key == ("regex", FAILING):
            self.planted = getattr(self, "planted", 0) + 1  # type: ignore[attr-defined]
            if self.planted == 3:  # type: ignore[attr-defined]
                raise ValueError("planted matcher failure\n" + "grammar dump " * 500)
        return original(self, *args)

    monkeypatch.setattr(GrammarMatcher, "window_masks", third_mask_fails)
    bad_plain = {"model": NAME, "prompt": "n:", "max_tokens": 24, "guided_regex": FAILING}
    bad_stream = {"model": NAME, "prompt": "n:", "max_tokens": 24, "stream": True,
                  "structured_outputs": {"regex": FAILING}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="mechserve.engine"), ThreadPoolExecutor(6) as pool:
        results = list(pool.map(send, [*good, bad_plain, bad_stream]))
    assert [text(r) for r in results[:4]] == alone
    refused = results[4]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "guided_regex" and "planted matcher failure" in error["message"]
    assert "grammar dump" not in error["message"]
    _, errors = results[5]
    assert len(errors) == 1 and errors[0]["error"]["param"] == "structured_outputs", errors
    lines = [r.getMessage() for r in caplog.records if r.name == "mechserve.engine"]
    assert len(lines) == 2 and all("planted matcher failure" in x and "\n" not in x for x in lines), lines
    counts = byte_server.wait_idle()
    assert counts["private"] == 0
    assert metric(byte_server, "vllm:num_requests_running") == 0
    assert metric(byte_server, "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_that_cannot_be_forced_names_tools_not_a_field_never_sent(byte_server: Served, choice) -> None:
    """A forced call's grammar is the tools' schemas: its failure names ``tools`` (it named
    ``structured_outputs.json``, a field the request never sent)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    for stream in (False, True):
        response = chat(byte_server, tools=[tool], tool_choice=choice, stream=stream)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tools" and error["message"].startswith("tools: "), error
        assert "structured_outputs" not in error["message"] and "schema" in error["message"], error
    byte_server.wait_idle()
