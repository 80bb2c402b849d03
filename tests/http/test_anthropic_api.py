"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) with the official ``anthropic`` SDK,
against served tiny models.

The word model (``tiny_server``: no EOS) checks the shapes, the stream's event sequence, stop sequences, the
token count and the translation into the chat path (the same prompt and, greedy, the same text as chat).  The
byte model can spell JSON, so grammar-forced tool calls parse: a tool round trip (tool_use -> tool_result ->
answer) and ``output_config.format``.  Messages and events are validated against the SDK's own types, errors
against Anthropic's error body.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from server_support import TINY_NAME, Served, plant_matcher_failure, serving
from test_disconnect import assert_aborted_and_freed, slowed
from tool_models import save_byte_model

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.model.loader import load_model

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
BYTES = "tiny-bytes"
USER = [{"role": "user", "content": "w1 w2"}]
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": CITY, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
}


def client(served: Served, **options: Any) -> anthropic.Anthropic:
    options.setdefault("api_key", served.api_key)
    return anthropic.Anthropic(base_url=served.url, max_retries=0, timeout=60, **options)


def post(served: Served, body: dict[str, Any], path: str = "/v1/messages", **headers: str) -> httpx.Response:
    cap = {"max_tokens": 2} if path == "/v1/messages" else {}  # count_tokens has no max_tokens (unknown there)
    full = {"model": TINY_NAME, **cap, "messages": USER, **body}
    return httpx.post(served.url + path, json=full, headers=headers, timeout=60)


def error_of(response: httpx.Response, status: int, kind: str) -> str:
    """Anthropic's error body: its message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def tokenized(served: Served, messages: list[dict[str, Any]], **options: Any) -> int:
    return int(httpx.post(served.url + "/tokenize", json={"messages": messages, **options}, timeout=30).json()["count"])


def raw_events(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events as sent (the SDK drops pings), each ``event:`` name checked against its ``type``; the
    sequence is Anthropic's, with the one ping after the first block's start."""
    full = {"model": TINY_NAME, **body, "stream": True}
    with httpx.stream("POST", served.url + "/v1/messages", json=full, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    names, data = lines[0::2], lines[1::2]
    events = [json.loads(d.removeprefix("data: ")) for d in data]
    assert names == [f"event: {e['type']}" for e in events]
    kinds = [e["type"] for e in events]
    n = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    return events


def greedy(**body: Any) -> dict[str, Any]:
    return {"extra_body": {"temperature": 0}, **body}


# The word model --------------------------------------------------------------------------------------------------------


def test_a_message_is_the_chat_paths_reply_in_anthropics_shape(tiny_server: Served) -> None:
    reply = client(tiny_server).messages.create(
        model=TINY_NAME, max_tokens=4, system="w5", messages=USER, metadata={"user_id": "u1"}, **greedy()
    )
    raw = post(tiny_server, {"max_tokens": 4, "system": "w5", "temperature": 0}).json()
    Message.model_validate(raw)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == TINY_NAME and reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    (block,) = reply.content
    chat = tiny_server.client().chat.completions.create(
        model=TINY_NAME, messages=[{"role": "system", "content": "w5"}, *USER], max_tokens=4, temperature=0
    )
    assert block.type == "text" and block.text == chat.choices[0].message.content == raw["content"][0]["text"]
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens and usage.output_tokens == 4
    assert usage.cache_creation_input_tokens == 0
    counted = client(tiny_server).messages.count_tokens(model=TINY_NAME, system="w5", messages=USER)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_system_blocks_turns_and_prefill_become_the_chat_messages(tiny_server: Served) -> None:
    system = [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6", "cache_control": {"type": "ephemeral"}}]
    turns = [
        {"role": "user", "content": "w1"},
        {"role": "user", "content": [{"type": "text", "text": "w2"}]},  # one turn with the one before, as Anthropic's
        {"role": "assistant", "content": "w3"},  # the last turn is the assistant's: continued (prefill)
    ]
    count = client(tiny_server).messages.count_tokens(model=TINY_NAME, system=system, messages=turns).input_tokens
    chat = [
        {"role": "system", "content": "w5\nw6"},
        {"role": "user", "content": "w1\nw2"},
        {"role": "assistant", "content": "w3"},
    ]
    assert count == tokenized(tiny_server, chat, add_generation_prompt=False, continue_final_message=True)
    reply = client(tiny_server).messages.create(model=TINY_NAME, max_tokens=2, system=system, messages=turns)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == count


def test_the_stream_is_anthropics_event_sequence(tiny_server: Served) -> None:
    events = list(
        client(tiny_server).messages.create(model=TINY_NAME, max_tokens=5, messages=USER, stream=True, **greedy())
    )
    for event in events:
        EVENTS.validate_python(event.model_dump(mode="json", exclude_unset=True))
    kinds = [e.type for e in events]
    n = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * n,  # the SDK drops pings
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    raw = raw_events(tiny_server, {"max_tokens": 5, "messages": USER, "temperature": 0})
    assert "".join(e["delta"]["text"] for e in raw if e["type"] == "content_block_delta") == "".join(
        e.delta.text for e in events if e.type == "content_block_delta"
    )
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.usage.input_tokens > 0
    assert events[1].content_block.type == "text" and events[1].index == 0
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 5
    whole = client(tiny_server).messages.create(model=TINY_NAME, max_tokens=5, messages=USER, **greedy())
    assert whole.content[0].text == text
    with client(tiny_server).messages.stream(model=TINY_NAME, max_tokens=5, messages=USER, **greedy()) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == whole.usage.input_tokens


def test_a_stop_sequence_is_named(tiny_server: Served) -> None:
    whole = client(tiny_server).messages.create(model=TINY_NAME, max_tokens=6, messages=USER, **greedy())
    words = whole.content[0].text.split()
    stop = words[2]
    cut = client(tiny_server).messages.create(
        model=TINY_NAME, max_tokens=6, messages=USER, stop_sequences=[stop], **greedy()
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text.split() == words[: words.index(stop)]
    events = list(
        client(tiny_server).messages.create(
            model=TINY_NAME, max_tokens=6, messages=USER, stop_sequences=[stop], stream=True, **greedy()
        )
    )
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}
                ]
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {"type": "text", "data": "x", "media_type": "text/plain"}}
                        ],
                    }
                ]
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]},
                ]
            },
            "messages.1.content.0.type",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"thinking": {"type": "adaptive"}}, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"messages": [{"role": "system", "content": "w1"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"output_config": {"effort": "low"}}, "output_config"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "not": {}}}}},
            "output_config.format",
        ),
        ({"temperature": 1.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_sequences": ["w1"] * 17}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": "w1 " * 5000}]}, "messages"),  # longer than the context
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"speed": "fast"}, "speed"),
    ],
)
def test_what_cannot_be_honoured_is_an_anthropic_400_naming_it(
    tiny_server: Served, body: dict[str, Any], param: str
) -> None:
    message = error_of(post(tiny_server, body), 400, "invalid_request_error")
    assert message.startswith(param), message
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(tiny_server).messages.create(model=TINY_NAME, max_tokens=2, messages=USER, extra_body=body)
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_required_fields_missing_and_an_unknown_model(tiny_server: Served) -> None:
    for missing in ("max_tokens", "messages", "model"):
        body = {"model": TINY_NAME, "max_tokens": 2, "messages": USER}
        del body[missing]
        response = httpx.post(tiny_server.url + "/v1/messages", json=body, timeout=30)
        assert error_of(response, 400, "invalid_request_error").startswith(missing)
    assert error_of(
        httpx.post(tiny_server.url + "/v1/messages", content=b"{", timeout=30), 400, "invalid_request_error"
    )
    with pytest.raises(anthropic.NotFoundError) as caught:
        client(tiny_server).messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=USER)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert error_of(post(tiny_server, {"model": "claude"}, "/v1/messages/count_tokens"), 404, "not_found_error")


def test_neutral_values_are_accepted(tiny_server: Served) -> None:
    body = {"thinking": {"type": "disabled"}, "service_tier": "auto", "speed": "standard", "mcp_servers": []}
    body |= {"cache_control": {"type": "ephemeral"}, "top_k": 0, "metadata": {"user_id": None}}
    assert post(tiny_server, body).status_code == 200


def test_x_api_key_or_bearer_and_any_anthropic_version(make_llm) -> None:
    with serving(make_llm(), api_key="s3cret") as served:
        ok = client(served).messages.create(model=TINY_NAME, max_tokens=1, messages=USER)  # x-api-key
        assert ok.usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client(served, api_key="wrong").messages.create(model=TINY_NAME, max_tokens=1, messages=USER)
        assert caught.value.body["error"]["type"] == "authentication_error"
        assert post(served, {}, Authorization="Bearer s3cret").status_code == 200
        assert post(served, {}, **{"x-api-key": "s3cret", "anthropic-version": "2023-06-01"}).status_code == 200
        assert post(served, {}, **{"x-api-key": "s3cret", "anthropic-version": "1999-01-01"}).status_code == 200
        error_of(post(served, {}), 401, "authentication_error")
        assert post(served, {}, path="/v1/messages/count_tokens", **{"x-api-key": "s3cret"}).status_code == 200
        # the OpenAI paths take Anthropic's header too, and answer in OpenAI's shape
        response = httpx.get(served.url + "/v1/models", headers={"x-api-key": "nope"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_disconnects_abort_and_a_failure_is_an_error_event(make_llm) -> None:
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.003)) as served:
        body = {"model": TINY_NAME, "max_tokens": 300, "messages": USER, "stream": True}
        with httpx.stream("POST", served.url + "/v1/messages", json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for _ in range(6):
                next(lines)
        message_id = json.loads(first[6:])["message"]["id"]
        assert_aborted_and_freed(served, message_id, 300)
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.005)) as served:
        with pytest.raises(httpx.ReadTimeout):
            body = {"model": TINY_NAME, "max_tokens": 300, "messages": USER}
            httpx.post(served.url + "/v1/messages", json=body, timeout=httpx.Timeout(30, read=0.3))
        (request_id,) = {rid for record in served.llm.trace for rid in record.admitted}
        assert_aborted_and_freed(served, request_id, 300)
    llm = make_llm(num_pages=256)
    real, steps = llm.core.executor.execute, []

    def failing(plan: Any) -> Any:
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("simulated executor failure")
        return real(plan)

    llm.core.executor.execute = failing
    with serving(llm) as served:
        body = {"model": TINY_NAME, "max_tokens": 50, "messages": USER, "stream": True}
        with httpx.stream("POST", served.url + "/v1/messages", json=body, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-2] == "event: error", lines[-4:]
        error = json.loads(lines[-1][6:])
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        message = error["error"]["message"]  # the step and the kind of failure, never its text (the log has that)
        assert "(RuntimeError)" in message and "simulated" not in message, message
        # every step fails, so the engine is dead: a 503 while the server stops, then the socket is closed
        with pytest.raises((anthropic.APIStatusError, anthropic.APIConnectionError)):
            list(client(served).messages.create(**body))


def test_a_full_queue_is_a_rate_limit_error_and_metrics_count_the_endpoint(make_llm) -> None:
    import asyncio

    body = {"model": TINY_NAME, "max_tokens": 3, "messages": USER}
    parked, go = threading.Event(), threading.Event()

    def gate(out: Any) -> None:
        if out.record.admitted and not parked.is_set():
            parked.set()
            go.wait(30)

    with serving(make_llm(max_running=1, max_waiting=1, on_step=gate)) as served:

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
                first = asyncio.ensure_future(http.post("/v1/messages", json=body))
                assert await asyncio.to_thread(parked.wait, 30)
                later = [asyncio.ensure_future(http.post("/v1/messages", json=body)) for _ in range(2)]
                while served.llm._stepper.queued < 2:
                    await asyncio.sleep(0.01)
                go.set()
                return [await first, *[await r for r in later]]

        first, *later = asyncio.run(main())
        assert first.status_code == 200 and sorted(r.status_code for r in later) == [200, 429]
        refused = next(r for r in later if r.status_code == 429)
        assert "max_waiting" in error_of(refused, 429, "rate_limit_error") and refused.headers["Retry-After"] == "1"
        assert post(served, {}, "/v1/messages/count_tokens").status_code == 200
        lines = [
            line
            for line in httpx.get(served.url + "/metrics").text.splitlines()
            if line.startswith("http_requests_total{")
        ]
        assert 'http_requests_total{handler="/v1/messages",method="POST",status="2xx"} 2.0' in lines, lines
        assert 'http_requests_total{handler="/v1/messages",method="POST",status="4xx"} 1.0' in lines, lines
        assert 'http_requests_total{handler="/v1/messages/count_tokens",method="POST",status="2xx"} 1.0' in lines


# The byte model: tools and structured output --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = save_byte_model(tmp_path_factory.mktemp("tiny-bytes"))
    llm = AsyncLLM(load_model(str(path)), page_size=4, num_pages=1024, model_name=BYTES)
    with serving(llm) as s:
        yield s


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_tool_round_trip_tool_use_result_answer(served: Served) -> None:
    c = client(served)
    forced = {"type": "tool", "name": "get_weather"}
    first = c.messages.create(model=BYTES, max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice=forced, **greedy())
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, {**WEATHER["input_schema"], "additionalProperties": False})
    turns = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees, sunny"}]},
    ]
    answer = c.messages.create(
        model=BYTES, max_tokens=8, messages=turns, tools=[WEATHER], tool_choice={"type": "none"}, **greedy()
    )
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    chat = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees, sunny"},
    ]
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == tokenized(served, chat)
    counted = c.messages.count_tokens(model=BYTES, messages=turns, tools=[WEATHER], tool_choice={"type": "none"})
    assert counted.input_tokens == tokenized(served, chat)
    with_tools = c.messages.count_tokens(model=BYTES, messages=turns, tools=[WEATHER]).input_tokens
    assert with_tools > counted.input_tokens, "auto renders the tools; none leaves them out"
    failed = [
        *turns[:2],
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "down", "is_error": True}],
        },
    ]
    errored = c.messages.count_tokens(model=BYTES, messages=failed, tool_choice={"type": "none"}, tools=[WEATHER])
    assert errored.input_tokens == tokenized(
        served, [*chat[:2], {"role": "tool", "tool_call_id": use.id, "content": "Error: down"}]
    )


def test_a_streamed_tool_use_and_any(served: Served) -> None:
    c = client(served)
    body = {
        "model": BYTES,
        "max_tokens": 60,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    whole = c.messages.create(**body, **greedy())
    events = list(c.messages.create(**body, stream=True, **greedy()))
    kinds = [e.type for e in events]
    n = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    raw = raw_events(served, {**body, "temperature": 0})
    assert raw[1]["content_block"] == events[1].content_block.model_dump(exclude_none=True) | {
        "id": raw[1]["content_block"]["id"]
    }
    start = events[1].content_block
    assert start.type == "tool_use" and start.input == {} and start.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == whole.content[0].input and events[-2].delta.stop_reason == "tool_use"
    with c.messages.stream(**body, **greedy()) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == whole.content[0].input and final.stop_reason == "tool_use"
    for parallel in (False, True):
        reply = c.messages.create(
            model=BYTES,
            max_tokens=200,
            messages=ASK,
            tools=[WEATHER],
            tool_choice={"type": "any", "disable_parallel_tool_use": not parallel},
            extra_body={"temperature": 1.0},
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses and reply.stop_reason == "tool_use"
        if not parallel:
            assert len(uses) == 1


def test_structured_output_through_output_config(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"city": CITY, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["city", "n"],
    }
    reply = client(served).messages.create(
        model=BYTES,
        max_tokens=60,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **greedy(),
    )
    assert reply.stop_reason == "end_turn", reply
    jsonschema.validate(json.loads(reply.content[0].text), {**schema, "additionalProperties": False})
    beta = post(
        served,
        {
            "model": BYTES,
            "max_tokens": 60,
            "messages": ASK,
            "temperature": 0,
            "output_format": {"type": "json_schema", "schema": schema},
        },
    ).json()
    assert beta["content"][0]["text"] == reply.content[0].text


def test_a_shutdown_ends_every_response_in_flight_in_its_apis_shape(make_llm) -> None:
    """The drain (Ctrl-C or SIGTERM) aborts what runs: a Responses stream ends with error and response.failed, a
    Messages stream with an error event, a waiting Messages client gets a 503 in Anthropic's body."""
    import asyncio

    llm = slowed(make_llm(num_pages=256), 0.01)
    with serving(llm) as served:
        started = threading.Barrier(4)
        results: dict[str, Any] = {}

        def responses_stream() -> None:
            body = {"model": TINY_NAME, "input": "w1", "max_output_tokens": 400, "stream": True}
            with httpx.stream("POST", served.url + "/v1/responses", json=body, timeout=60) as response:
                lines = response.iter_lines()
                started.wait(30)
                results["responses"] = [line for line in lines if line.startswith("data: ")]

        def messages_stream() -> None:
            body = {"model": TINY_NAME, "max_tokens": 400, "messages": USER, "stream": True}
            with httpx.stream("POST", served.url + "/v1/messages", json=body, timeout=60) as response:
                lines = response.iter_lines()
                started.wait(30)
                results["messages"] = [line for line in lines if line]

        def messages_wait() -> None:
            body = {"model": TINY_NAME, "max_tokens": 400, "messages": USER}
            with httpx.Client(timeout=60) as http:
                future = threading.Thread(
                    target=lambda: results.setdefault("plain", http.post(served.url + "/v1/messages", json=body))
                )
                future.start()
                wait_running(served, 3)
                started.wait(30)
                future.join(60)

        threads = [threading.Thread(target=f) for f in (responses_stream, messages_stream, messages_wait)]
        for t in threads:
            t.start()
        started.wait(30)
        asyncio.run(llm.drain())
        for t in threads:
            t.join(60)
    last = json.loads(results["responses"][-1][6:])
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert json.loads(results["responses"][-2][6:])["type"] == "error"
    # its usage counts what was produced (it said 0 after 84 deltas): at least a token per delta
    deltas = [line for line in results["responses"] if '"response.output_text.delta"' in line]
    assert deltas and last["response"]["usage"]["output_tokens"] >= len(deltas)
    assert results["messages"][-2] == "event: error"
    error_of(results["plain"], 503, "api_error")


def wait_running(served: Served, n: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while served.llm.metrics.snapshot()["running"] < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


PLANTED = {
    "type": "object",
    "properties": {"planted_note": {"type": "string", "maxLength": 40}},
    "required": ["planted_note"],
}


def test_a_format_failing_inside_a_step_fails_its_message_alone(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 on /v1/messages: a message whose output format (or forced tool) fails inside an engine step ends
    alone, in Anthropic's shape: waited for, a 400 ``invalid_request_error`` naming ``output_config.format``
    (``output_format``, ``tools``); streamed, an ``error`` event.  The messages running beside it get the text
    they get alone, and the engine returns to idle."""
    from concurrent.futures import ThreadPoolExecutor

    good = [{"model": BYTES, "max_tokens": 16, "messages": [{"role": "user", "content": f"Say w{i}."}],
             "temperature": 0} for i in range(3)]  # fmt: skip
    good[1]["stream"] = True
    city = {"type": "object", "properties": {"city": CITY}, "required": ["city"]}
    good[2]["output_config"] = {"format": {"type": "json_schema", "schema": city}}

    def send(body: dict[str, Any]) -> Any:
        if body.get("stream"):
            with httpx.stream("POST", served.url + "/v1/messages", json=body, timeout=60) as response:
                assert response.status_code == 200
                lines = [line for line in response.iter_lines() if line]
            return [json.loads(d.removeprefix("data: ")) for d in lines[1::2]]
        return post(served, body)

    def text(result: Any) -> str:
        if isinstance(result, list):
            assert result[-1]["type"] == "message_stop", result[-3:]
            return "".join(e["delta"]["text"] for e in result if e["type"] == "content_block_delta")
        assert result.status_code == 200, result.text
        return "".join(b.text for b in Message.model_validate(result.json()).content if b.type == "text")

    alone = [text(send(b)) for b in good]
    plant_matcher_failure(monkeypatch)
    ask = {"model": BYTES, "max_tokens": 30, "messages": ASK}
    planted_format = {"format": {"type": "json_schema", "schema": PLANTED}}
    planted_tool = {"name": "planted_tool", "description": "A note", "input_schema": PLANTED}
    bad = [
        {**ask, "output_config": planted_format},
        {**ask, "output_format": planted_format["format"]},
        {**ask, "output_config": planted_format, "stream": True},
        {**ask, "tools": [planted_tool], "tool_choice": {"type": "tool", "name": "planted_tool"}},
    ]
    with ThreadPoolExecutor(7) as pool:
        results = list(pool.map(send, [*good, *bad]))
    assert [text(r) for r in results[:3]] == alone
    waited, beta, streamed, tool = results[3:]
    for refused, field in ((waited, "output_config.format"), (beta, "output_format"), (tool, "tools")):
        message = error_of(refused, 400, "invalid_request_error")
        assert message.startswith(field) and "planted matcher failure" in message, message
        assert "grammar dump" not in message
    assert streamed[-1]["type"] == "error", streamed[-3:]
    assert streamed[-1]["error"]["type"] == "invalid_request_error"
    assert "planted matcher failure" in streamed[-1]["error"]["message"]
    assert streamed[-1]["error"]["message"].startswith("output_config.format")
    assert not any(e["type"] == "message_stop" for e in streamed)
    counts = served.wait_idle()
    assert counts["private"] == 0
