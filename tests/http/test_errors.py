"""Bad input never reads as a server fault: every error case answers with its status code and an OpenAI error
body, never a 500, and the server keeps serving afterwards (field case BC26 at the server level)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import TINY_NAME, random_prompts, serving

OK = {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 2}
CHAT_OK = {"model": TINY_NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}


def post(served: Any, path: str, body: Any = None, *, content: str | None = None, **headers: str) -> httpx.Response:
    if content is None:
        return httpx.post(served.url + path, json=body, headers=headers, timeout=30)
    return httpx.post(served.url + path, content=content, headers={"content-type": "application/json", **headers})


def assert_error(response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> str:
    """``response`` is ``status`` with an OpenAI error body; returns its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return str(error["message"])


def assert_still_serving(served: Any) -> None:
    out = served.client().completions.create(model=TINY_NAME, prompt="w5 w6", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    assert httpx.get(served.url + "/health").status_code == 200


@pytest.mark.parametrize(
    ("content", "code"),
    [("{bad json", "invalid_json"), ("", "invalid_json"), ("[1, 2]", "invalid_json"), ('"text"', "invalid_json")],
)
def test_malformed_bodies_are_400(tiny_server, content: str, code: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(post(tiny_server, path, content=content), 400, code=code)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("max_tokens", True),
        ("max_tokens", 2.5),
        ("n", "2"),
        ("stop", 5),
        ("stop", [1, 2]),
        ("seed", "x"),
        ("stream", "yes"),
        ("prompt", {"text": "w1"}),
        ("prompt", ["w1", 2]),
        ("prompt", None),
        ("logprobs", "2"),
    ],
)
def test_wrong_types_are_400_naming_the_field(tiny_server, field: str, value: Any) -> None:
    message = assert_error(post(tiny_server, "/v1/completions", {**OK, field: value}), 400, code="invalid_value")
    assert field in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("n", 65),
        ("max_tokens", -1),
        ("logprobs", 21),
        ("seed", 2**64),
        ("min_p", 2),
        ("top_k", -2),
        ("stop", ["w1"] * 17),
        ("presence_penalty", 3),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(tiny_server, field: str, value: Any) -> None:
    assert_error(post(tiny_server, "/v1/completions", {**OK, field: value}), 400, param=field)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "w1"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "w1"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"logprobs": 1}, "logprobs"),
        # A new user's trial: a user message without content was answered 200.
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "w1"}]}, "messages.0"),
    ],
)
def test_bad_chat_bodies_are_400(tiny_server, body: dict[str, Any], param: str | None) -> None:
    assert_error(post(tiny_server, "/v1/chat/completions", {**CHAT_OK, **body}), 400, param=param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"suffix": "w3"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"stop": [""]}, "stop"),
    ],
)
def test_fields_the_server_cannot_honour_are_400_not_ignored(tiny_server, path: str, body: dict, param: str) -> None:
    base = CHAT_OK if "chat" in path else OK
    assert_error(post(tiny_server, path, {**base, **body}), 400, param=param)


def test_unknown_fields_are_refused_naming_them(tiny_server) -> None:
    """They were ignored (``metadata`` is a chat field: completions has none); tests/http/test_unknown_fields.py
    checks every endpoint and depth, and the operator's --ignore-unknown-fields."""
    response = post(tiny_server, "/v1/completions", {**OK, "frobnicate": 3, "metadata": {"a": "b"}})
    message = assert_error(response, 400, param="frobnicate", code="unsupported_parameter")
    assert message == "unknown field 'frobnicate'; also unknown: 'metadata'"


def test_an_unknown_model_is_404(tiny_server) -> None:
    message = assert_error(post(tiny_server, "/v1/completions", {**OK, "model": "gpt-9"}), 404, code="model_not_found")
    assert "gpt-9" in message and TINY_NAME in message
    with pytest.raises(openai.NotFoundError):
        tiny_server.client().chat.completions.create(model="gpt-9", messages=CHAT_OK["messages"])
    assert_error(httpx.get(tiny_server.url + "/v1/models/gpt-9"), 404, code="model_not_found")
    assert post(tiny_server, "/v1/completions", {k: v for k, v in OK.items() if k != "model"}).status_code == 200


def test_a_request_longer_than_the_context_is_400_naming_the_limit(tiny_server) -> None:
    message = assert_error(
        post(tiny_server, "/v1/completions", {**OK, "max_tokens": 600}), 400, code="context_length_exceeded"
    )
    assert "512" in message and "602" in message
    long_prompt = " ".join(["w1"] * 520)
    message = assert_error(
        post(tiny_server, "/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": long_prompt}]}),
        400,
        code="context_length_exceeded",
    )
    assert "512" in message
    with pytest.raises(openai.BadRequestError, match="context"):
        tiny_server.client().completions.create(model=TINY_NAME, prompt="w1", max_tokens=10_000)


def test_a_prompt_that_can_never_fit_the_pool_is_400_naming_the_pool(make_llm) -> None:
    with serving(make_llm(num_pages=4)) as served:
        message = assert_error(
            post(served, "/v1/completions", {**OK, "prompt": random_prompts([20])[0], "max_tokens": 4}),
            400,
            code="context_length_exceeded",
        )
        assert "the pool has 4" in message
        assert_still_serving(served)


def test_a_token_id_outside_the_vocabulary_is_400(tiny_server) -> None:
    message = assert_error(post(tiny_server, "/v1/completions", {**OK, "prompt": [1, 2, 128]}), 400)
    assert "128" in message and "vocabulary" in message


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], ["w1", ""]])
@pytest.mark.parametrize("stream", [False, True])
def test_bc26_empty_prompt_is_refused_and_the_server_keeps_serving(tiny_server, prompt: Any, stream: bool) -> None:
    response = post(tiny_server, "/v1/completions", {**OK, "prompt": prompt, "stream": stream})
    assert_error(response, 400, param="prompt", code="empty_prompt")
    assert_still_serving(tiny_server)
    assert tiny_server.wait_idle()["private"] == 0


def test_wrong_method_and_unknown_path(tiny_server) -> None:
    assert_error(httpx.get(tiny_server.url + "/v1/completions"), 405)
    assert_error(httpx.get(tiny_server.url + "/v2/nothing"), 404)
    assert_error(post(tiny_server, "/v1/embeddings", {"input": "w1"}), 404)


def test_a_declared_body_over_the_limit_is_413(tiny_server) -> None:
    host, port = tiny_server.server.host, tiny_server.server.port
    with socket.create_connection((host, port), timeout=10) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {1 << 30}\r\n\r\n{{}}".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.decode().partition("\r\n")
    assert status_line.split()[1] == "413"
    error = json.loads(rest.split("\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "body_too_large" and "bytes" in error["message"]


# The API key -------------------------------------------------------------------------------------------------------


def test_the_api_key_guards_every_endpoint_but_health(make_llm) -> None:
    with serving(make_llm(), api_key="s3cret") as served:
        for path in ("/v1/models", "/metrics", "/version"):
            assert_error(httpx.get(served.url + path), 401, code="invalid_api_key")
            bad = httpx.get(served.url + path, headers={"Authorization": "Bearer nope"})
            assert_error(bad, 401, code="invalid_api_key")
            assert httpx.get(served.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert_error(post(served, "/v1/completions", OK, Authorization="Basic s3cret"), 401)
        assert httpx.get(served.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            served.client(api_key="wrong").completions.create(model=TINY_NAME, prompt="w1", max_tokens=1)
        out = served.client().completions.create(model=TINY_NAME, prompt="w1", max_tokens=2)
        assert out.usage.completion_tokens == 2


# Overload ------------------------------------------------------------------------------------------------------------


def test_a_full_waiting_queue_answers_429_with_retry_after(make_llm) -> None:
    parked, go = threading.Event(), threading.Event()

    def gate(out: Any) -> None:
        if out.record.admitted and not parked.is_set():  # the first request runs; park the engine
            parked.set()
            go.wait(30)

    with serving(make_llm(max_running=1, max_waiting=1, on_step=gate)) as served:

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
                first = asyncio.ensure_future(client.post("/v1/completions", json={**OK, "max_tokens": 6}))
                assert await asyncio.to_thread(parked.wait, 30)
                later = [
                    asyncio.ensure_future(client.post("/v1/completions", json={**OK, "max_tokens": 3}))
                    for _ in range(2)
                ]
                while served.llm._stepper.queued < 2:  # both wait for the parked engine's next step boundary
                    await asyncio.sleep(0.01)
                go.set()
                return [await first, *[await r for r in later]]

        first, *later = asyncio.run(main())
        assert first.status_code == 200
        assert sorted(r.status_code for r in later) == [200, 429]
        refused = next(r for r in later if r.status_code == 429)
        message = assert_error(refused, 429, code="overloaded")
        assert "max_waiting" in message and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "overloaded_error"
        assert_still_serving(served)


# Nothing a client sends is a 500 -------------------------------------------------------------------------------------

WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=300), max_size=4),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "stream",
    "min_tokens",
]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=st.dictionaries(st.sampled_from(FIELDS), WEIRD, max_size=6), chat=st.booleans())
def test_no_request_body_ever_gets_a_5xx(tiny_server, body: dict[str, Any], chat: bool) -> None:
    body = {**body, "max_tokens": body.get("max_tokens") if body.get("max_tokens") in (None, 0, 1, 2) else 2}
    if chat:
        body = {**body, "messages": body.pop("prompt", [{"role": "user", "content": "w1"}])}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = json.dumps(body)  # NaN and Infinity included: Python's json reads them
    response = httpx.post(tiny_server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        assert_error(response, response.status_code)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("headers", [{}, {"content-type": "text/plain"}, {"content-type": "application/json"}])
def test_a_missing_body_is_a_client_error(tiny_server, path: str, headers: dict[str, str]) -> None:
    """No body at all (with or without a content type) is the client's fault: 400 with an OpenAI error body."""
    response = httpx.post(tiny_server.url + path, headers=headers, timeout=30)
    assert_error(response, 400)
    assert_still_serving(tiny_server)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ({"max_tokens": 2, "max_completion_tokens": 5}, ["max_completion_tokens (5)", "max_tokens (2)"]),
        ({"n_predict": 2, "max_completion_tokens": 5}, ["max_completion_tokens (5)", "n_predict (2)"]),
    ],
)
def test_two_different_token_caps_are_400_naming_both(tiny_server, extra: dict[str, Any], needles: list[str]) -> None:
    body = {key: value for key, value in CHAT_OK.items() if key != "max_tokens"} | extra
    message = assert_error(post(tiny_server, "/v1/chat/completions", body), 400, param="max_completion_tokens")
    assert all(n in message for n in needles), message
    same = {**CHAT_OK, "max_tokens": 3, "max_completion_tokens": 3, "temperature": 0}
    assert post(tiny_server, "/v1/chat/completions", same).json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_over_the_context_is_400_naming_it(tiny_server, path: str) -> None:
    body = {**(OK if path == "/v1/completions" else CHAT_OK), "truncate_prompt_tokens": 100000}
    message = assert_error(post(tiny_server, path, body), 400, param="truncate_prompt_tokens")
    assert "max_model_len" in message, message
    # at most the context, more than the prompt: the whole prompt is kept (vLLM's rule)
    body = {**OK, "truncate_prompt_tokens": 50, "temperature": 0}
    assert post(tiny_server, "/v1/completions", body).json()["usage"]["prompt_tokens"] == 2
    assert_still_serving(tiny_server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_body_nested_too_deeply_is_400_invalid_json(tiny_server, path: str) -> None:
    deep = '{"model": "x", "metadata": ' + "[" * 1000 + "]" * 1000 + "}"
    message = assert_error(post(tiny_server, path, content=deep), 400, code="invalid_json")
    assert "nested too deeply" in message, message
    assert_still_serving(tiny_server)


def test_a_deep_body_on_the_anthropic_endpoint_is_invalid_json_in_its_shape(tiny_server) -> None:
    deep = '{"model": "x", "metadata": ' + "[" * 1000 + "]" * 1000 + "}"
    response = post(tiny_server, "/v1/messages", content=deep)
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_json_sent_as_text_plain_names_the_content_type(tiny_server, path: str) -> None:
    response = httpx.post(
        tiny_server.url + path, content=json.dumps(CHAT_OK), headers={"content-type": "text/plain"}, timeout=30
    )
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "Content-Type 'text/plain'" in message and "application/json" in message, message


def test_the_prediction_refusal_names_every_speculative_alternative(tiny_server) -> None:
    body = {**CHAT_OK, "prediction": {"type": "content", "content": "w1"}}
    message = assert_error(post(tiny_server, "/v1/chat/completions", body), 400, param="prediction")
    assert all(m in message for m in ("prompt lookup", "suffix decoding", "draft model")), message
