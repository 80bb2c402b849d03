"""OpenAI's Responses API (``/v1/responses``) with the official ``openai`` SDK, against served tiny models.

The word model (``tiny_server``: no EOS, so every reply runs to ``max_output_tokens``) checks the shapes, the
stream's events and their order, the store and the translation into the chat path (the same prompt and, greedy,
the same text as ``/v1/chat/completions``).  The byte model (``tool_models``) can spell JSON, so grammar-forced
tool calls and structured outputs parse: a tool round trip (call -> result -> answer), ``previous_response_id``
reusing the previous turn's KV pages through output caching, and ``text.format``.  Every response object and
event is validated against the SDK's own pydantic types.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from server_support import TINY_NAME, Served, plant_matcher_failure, serving
from test_disconnect import slowed
from tool_models import save_byte_model

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.model.loader import load_model

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
BYTES = "tiny-bytes"
PAGE = 4
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": CITY, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
NAMED = {"type": "function", "name": "get_weather"}
ANSWER = {
    "type": "object",
    "properties": {"city": CITY, "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
    "required": ["city", "population"],
}
FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}


def post(served: Served, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + "/v1/responses", json={"model": TINY_NAME, **body}, timeout=60)


def events(served: Served, **body: Any) -> list[Any]:
    """A streamed response's events, each validated as the SDK's event types."""
    body.setdefault("model", TINY_NAME)
    found = list(served.client().responses.create(stream=True, **body))
    for event in found:
        EVENTS.validate_python(event.model_dump(mode="json", exclude_unset=True, by_alias=True))
    return found


def tokens(served: Served, messages: list[dict[str, Any]], tools: Any = None) -> int:
    """The prompt length of a chat conversation (vLLM's /tokenize)."""
    body: dict[str, Any] = {"messages": messages} | ({"tools": tools} if tools else {})
    return int(httpx.post(served.url + "/tokenize", json=body, timeout=30).json()["count"])


# The word model: shapes, the stream, the store ------------------------------------------------------------------------


def test_a_response_is_the_chat_paths_reply_in_the_responses_shape(tiny_server: Served) -> None:
    client = tiny_server.client()
    reply = client.responses.create(
        model=TINY_NAME, input="w1 w2", instructions="w5", max_output_tokens=4, temperature=0, metadata={"k": "v"}
    )
    raw = post(tiny_server, {"input": "w1 w2", "instructions": "w5", "max_output_tokens": 4, "temperature": 0}).json()
    Response.model_validate(raw)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == TINY_NAME
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"  # no EOS
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete" and [p.type for p in message.content] == ["output_text"]
    chat = client.chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "system", "content": "w5"}, {"role": "user", "content": "w1 w2"}],
        max_tokens=4,
        temperature=0,
    )
    assert reply.output_text == chat.choices[0].message.content == raw["output"][0]["content"][0]["text"]
    usage = reply.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == 4
    assert usage.total_tokens == usage.input_tokens + 4 and usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0
    assert reply.instructions == "w5" and reply.metadata == {"k": "v"} and reply.max_output_tokens == 4
    assert reply.temperature == 0 and reply.tool_choice == "auto" and reply.tools == [] and reply.store is True


def test_input_items_become_the_chat_messages(tiny_server: Served) -> None:
    """Messages (developer as system, text parts), an assistant's function_call and its output: the prompt is the
    chat conversation's, token for token."""
    items = [
        {"role": "developer", "content": "w9"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "w1"}, {"type": "input_text", "text": " w2"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "w3"}]},
        {"role": "user", "content": "w4"},
    ]
    reply = tiny_server.client().responses.create(model=TINY_NAME, input=items, max_output_tokens=1)
    chat = [
        {"role": "system", "content": "w9"},
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w3"},
        {"role": "user", "content": "w4"},
    ]
    assert reply.usage.input_tokens == tokens(tiny_server, chat)


def test_the_stream_is_openais_events_in_order_numbered_from_zero(tiny_server: Served) -> None:
    found = events(tiny_server, input="w1 w2", max_output_tokens=5, temperature=0)
    kinds = [e.type for e in found]
    deltas = [e for e in found if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it: OpenAI's terminal event for that
    ]
    assert [e.sequence_number for e in found] == list(range(len(found)))
    assert found[0].response.status == "in_progress" and found[0].response.output == []
    item = found[2].item
    assert item.type == "message" and item.status == "in_progress" and item.content == []
    assert all(e.item_id == item.id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    done = found[-4]
    assert done.text == text and found[-3].part.text == text and found[-2].item.content[0].text == text
    final = found[-1].response
    assert final.status == "incomplete" and final.output_text == text and final.usage.output_tokens == 5
    whole = tiny_server.client().responses.create(model=TINY_NAME, input="w1 w2", max_output_tokens=5, temperature=0)
    assert whole.output_text == text


def test_logprobs_are_included_when_asked(tiny_server: Served) -> None:
    body = {"input": "w1 w2", "max_output_tokens": 3, "temperature": 0, "include": ["message.output_text.logprobs"]}
    reply = tiny_server.client().responses.create(model=TINY_NAME, top_logprobs=2, **body)
    logprobs = reply.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    streamed = [
        lp
        for e in events(tiny_server, top_logprobs=2, **body)
        if e.type == "response.output_text.delta"
        for lp in e.logprobs
    ]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    plain = tiny_server.client().responses.create(model=TINY_NAME, input="w1", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


def test_stored_responses_are_retrieved_and_deleted(tiny_server: Served) -> None:
    client = tiny_server.client()
    reply = client.responses.create(model=TINY_NAME, input="w1", max_output_tokens=2, temperature=0)
    got = client.responses.retrieve(reply.id)
    assert got.model_dump() == reply.model_dump()
    Response.model_validate(httpx.get(f"{tiny_server.url}/v1/responses/{reply.id}").json())
    deleted = httpx.delete(f"{tiny_server.url}/v1/responses/{reply.id}").json()
    assert deleted == {"id": reply.id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(reply.id), lambda: client.responses.delete(reply.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=TINY_NAME, input="w1", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=TINY_NAME, input="w2", max_output_tokens=2, previous_response_id=unstored.id)
    assert caught.value.param == "previous_response_id" and caught.value.code == "previous_response_not_found"
    response = httpx.get(f"{tiny_server.url}/v1/responses/{got.id}x?stream=true")
    assert response.status_code in (400, 404)


def test_a_responses_input_items_are_listed(served: Served) -> None:
    from openai.types.responses import ResponseItemList

    client = served.client()
    items = [
        {"role": "developer", "content": "w9"},
        {"role": "user", "content": [{"type": "input_text", "text": "w1"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_mine"},
        {"type": "function_call_output", "call_id": "call_1", "output": "w2"},
        {"role": "assistant", "content": "w3"},
    ]
    reply = client.responses.create(model=BYTES, input=items, max_output_tokens=1)
    raw = httpx.get(f"{served.url}/v1/responses/{reply.id}/input_items?order=asc").json()
    ResponseItemList.model_validate(raw)
    listed = raw["data"]
    assert [i["type"] for i in listed] == ["message", "message", "function_call", "function_call_output", "message"]
    assert listed[2]["id"] == "fc_mine" and listed[3]["output"] == "w2" and listed[1]["content"][0]["text"] == "w1"
    newest = client.responses.input_items.list(reply.id)  # default order: newest first
    assert [i.id for i in newest.data] == [i["id"] for i in listed][::-1]
    page = client.responses.input_items.list(reply.id, order="asc", limit=2, after=listed[0]["id"])
    assert [i.id for i in page.data] == [listed[1]["id"], listed[2]["id"]] and page.has_more
    again = httpx.get(f"{served.url}/v1/responses/{reply.id}/input_items?order=asc").json()["data"]
    assert [i["id"] for i in again] == [i["id"] for i in listed], "ids are stable"
    bad = httpx.get(f"{served.url}/v1/responses/{reply.id}/input_items?limit=0")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_the_store_is_bounded(make_llm) -> None:
    with serving(make_llm(), max_stored_responses=2) as served:
        client = served.client()
        ids = [client.responses.create(model=TINY_NAME, input="w1", max_output_tokens=1).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the oldest went first
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        with pytest.raises(openai.BadRequestError, match="evicted"):
            client.responses.create(model=TINY_NAME, input="w2", max_output_tokens=1, previous_response_id=ids[0])


def test_a_continued_response_puts_the_previous_turn_before_its_input(tiny_server: Served) -> None:
    client = tiny_server.client()
    first = client.responses.create(model=TINY_NAME, input="w1", instructions="w7", max_output_tokens=3, temperature=0)
    second = client.responses.create(
        model=TINY_NAME, input="w2", instructions="w8", max_output_tokens=3, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    # the previous instructions are not carried over (OpenAI's rule); the new ones lead
    conversation = [
        {"role": "system", "content": "w8"},
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "w2"},
    ]
    assert second.usage.input_tokens == tokens(tiny_server, conversation)


# Refusals --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.0.type"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": [{"role": "robot", "content": "w1"}]}, "input.0.role"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        (
            {
                "tools": [
                    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}
                ]
            },
            "tools.0.type",
        ),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools.0.defer_loading"),
        ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0.name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"background": True, "store": False}, "background"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options"),
        ({"input": "w1 " * 5000}, "input"),  # longer than the context
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(tiny_server: Served, body: dict[str, Any], param: str) -> None:
    response = post(tiny_server, {"input": "w1", "max_output_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().responses.create(**{"model": TINY_NAME, "input": "w1", "max_output_tokens": 2, **body})
    assert caught.value.param == param


def test_neutral_values_of_refused_fields_are_accepted(tiny_server: Served) -> None:
    """What the Agents SDK and other clients send by default."""
    body = {"reasoning": {"effort": None, "summary": None}, "include": [], "truncation": "disabled", "store": True}
    body |= {"service_tier": "auto", "prompt_cache_retention": "in_memory", "parallel_tool_calls": True, "tools": []}
    body |= {"text": {"format": {"type": "text"}, "verbosity": "medium"}, "top_logprobs": 0, "tool_choice": "auto"}
    assert post(tiny_server, {"input": "w1", "max_output_tokens": 2, **body}).status_code == 200


def test_an_unknown_model_is_404(tiny_server: Served) -> None:
    with pytest.raises(openai.NotFoundError):
        tiny_server.client().responses.create(model="gpt-6", input="w1")


# Background, cancel, disconnect, failure ------------------------------------------------------------------------------


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_background_response_is_polled_and_cancelled(make_llm) -> None:
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.005)) as served:
        client = served.client()
        short = client.responses.create(model=TINY_NAME, input="w1", max_output_tokens=3, background=True)
        assert short.background is True and short.status in ("in_progress", "incomplete")
        wait_for(lambda: client.responses.retrieve(short.id).status != "in_progress")
        done = client.responses.retrieve(short.id)
        assert done.status == "incomplete" and done.usage.output_tokens == 3 and done.output_text
        long = client.responses.create(model=TINY_NAME, input="w2", max_output_tokens=400, background=True)
        cancelled = client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        counts = served.wait_idle()
        assert counts["private"] == 0
        assert any(long.id in record.aborted for record in served.llm.trace)
        after = client.responses.retrieve(long.id)
        assert after.status == "cancelled" and (after.usage is None or after.usage.output_tokens < 400)
        assert client.responses.cancel(long.id).status == "cancelled", "cancelling again returns it"
        plain = client.responses.create(model=TINY_NAME, input="w1", max_output_tokens=1)
        with pytest.raises(openai.BadRequestError, match="background or streaming"):
            client.responses.cancel(plain.id)


def test_a_streaming_response_is_cancelled_by_id(make_llm) -> None:
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.005)) as served:
        stream = served.client().responses.create(model=TINY_NAME, input="w3", max_output_tokens=400, stream=True)
        first = next(stream)
        assert first.type == "response.created"
        cancelled = served.client().responses.cancel(first.response.id)
        assert cancelled.status == "cancelled"
        rest = list(stream)
        assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
        assert rest[-1].response.usage.output_tokens < 400
        assert served.wait_idle()["private"] == 0


def test_a_stream_closed_early_aborts_and_a_waiting_client_too(make_llm) -> None:
    from test_disconnect import assert_aborted_and_freed

    with serving(slowed(make_llm(num_pages=256, trace=True), 0.003)) as served:
        stream = served.client().responses.create(model=TINY_NAME, input="w4", max_output_tokens=300, stream=True)
        got = [next(stream) for _ in range(5)]
        stream.close()
        assert_aborted_and_freed(served, got[0].response.id, 300)
        assert served.client().responses.retrieve(got[0].response.id).status == "cancelled"
    with serving(slowed(make_llm(num_pages=256, trace=True), 0.005)) as served:
        with pytest.raises(httpx.ReadTimeout):
            body = {"model": TINY_NAME, "input": "w6", "max_output_tokens": 300}
            httpx.post(served.url + "/v1/responses", json=body, timeout=httpx.Timeout(30, read=0.3))
        (request_id,) = {rid for record in served.llm.trace for rid in record.admitted}
        assert_aborted_and_freed(served, request_id, 300)
        assert served.client().responses.retrieve(request_id).status == "cancelled"


def test_an_engine_failure_ends_the_stream_with_error_and_response_failed(make_llm) -> None:
    llm = make_llm(num_pages=256)
    real, steps = llm.core.executor.execute, []

    def failing(plan: Any) -> Any:
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("simulated executor failure")
        return real(plan)

    llm.core.executor.execute = failing
    with serving(llm) as served:
        found = events(served, input="w1", max_output_tokens=50)
        assert [e.type for e in found[-2:]] == ["error", "response.failed"]
        message = found[-2].message  # the step and the kind of failure, never its text (the log has that)
        assert "(RuntimeError)" in message and "simulated" not in message and found[-2].code == "server_error"
        failed = found[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert [e.sequence_number for e in found] == list(range(len(found)))
        deltas = [e for e in found if e.type == "response.output_text.delta"]
        assert deltas and failed.usage.output_tokens >= len(deltas)  # what was produced, not 0


def test_a_full_queue_is_429_and_metrics_count_the_endpoint(make_llm) -> None:
    body = {"model": TINY_NAME, "input": "w1", "max_output_tokens": 3}
    parked, go = threading.Event(), threading.Event()

    def gate(out: Any) -> None:
        if out.record.admitted and not parked.is_set():
            parked.set()
            go.wait(30)

    with serving(make_llm(max_running=1, max_waiting=1, on_step=gate)) as served:

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
                first = asyncio.ensure_future(client.post("/v1/responses", json=body))
                assert await asyncio.to_thread(parked.wait, 30)
                later = [asyncio.ensure_future(client.post("/v1/responses", json=body)) for _ in range(2)]
                while served.llm._stepper.queued < 2:
                    await asyncio.sleep(0.01)
                go.set()
                return [await first, *[await r for r in later]]

        first, *later = asyncio.run(main())
        assert first.status_code == 200 and sorted(r.status_code for r in later) == [200, 429]
        refused = next(r for r in later if r.status_code == 429)
        error = refused.json()["error"]
        assert (
            error["type"] == "overloaded_error" and error["code"] == "overloaded" and "max_waiting" in error["message"]
        )
        assert refused.headers["Retry-After"] == "1"
        assert (
            httpx.post(served.url + "/v1/responses", json={**body, "reasoning": {"effort": "high"}}).status_code == 400
        )
        text = httpx.get(served.url + "/metrics").text
        lines = [line for line in text.splitlines() if line.startswith("http_requests_total{")]
        assert 'http_requests_total{handler="/v1/responses",method="POST",status="2xx"} 2.0' in lines, lines
        assert 'http_requests_total{handler="/v1/responses",method="POST",status="4xx"} 2.0' in lines, lines
        assert not any('handler="/metrics"' in line for line in lines), "the scrapes are not counted"


# The byte model: tools, structured output, KV reuse --------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = save_byte_model(tmp_path_factory.mktemp("tiny-bytes"))
    llm = AsyncLLM(load_model(str(path)), page_size=PAGE, num_pages=1024, model_name=BYTES)
    with serving(llm) as s:
        yield s


def test_a_tool_round_trip_call_result_answer(served: Served) -> None:
    client = served.client()
    ask = "What is the weather in Paris?"
    first = client.responses.create(
        model=BYTES, input=ask, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=60, temperature=0
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}
    # the agent's next turn, through the stored response ...
    answer = client.responses.create(
        model=BYTES,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    assert answer.output[0].type == "message" and answer.output_text
    # ... and stateless, the items sent back: the same prompt
    items = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), result]
    stateless = client.responses.create(
        model=BYTES, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=6, temperature=0, store=False
    )
    assert stateless.usage.input_tokens == answer.usage.input_tokens
    assert stateless.output_text == answer.output_text
    history = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"},
    ]
    assert answer.usage.input_tokens == tokens(served, history)


def test_a_streamed_call_and_required_calls(served: Served) -> None:
    body = {"input": "Weather?", "tools": [WEATHER], "tool_choice": NAMED, "max_output_tokens": 60, "temperature": 0}
    whole = served.client().responses.create(model=BYTES, **body)
    found = events(served, model=BYTES, **body)
    kinds = [e.type for e in found]
    deltas = [e for e in found if e.type == "response.function_call_arguments.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = found[2].item, found[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.name == "get_weather"
    assert "".join(d.delta for d in deltas) == found[-3].arguments == done.arguments == whole.output[0].arguments
    assert done.call_id == added.call_id and done.status == "completed"
    with served.client().responses.stream(model=BYTES, **body) as stream:
        final = stream.get_final_response()
    assert final.output[0].arguments == whole.output[0].arguments
    several = served.client().responses.create(
        model=BYTES,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=200,
        extra_body={"seed": 1},
    )
    calls = [item for item in several.output if item.type == "function_call"]
    assert calls and all(jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"]) is None for c in calls)
    one = served.client().responses.create(
        model=BYTES,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body={"seed": 1},
    )
    assert len(one.output) == 1 and one.parallel_tool_calls is False


class City(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    population: Annotated[int, Field(ge=0, le=99999)]


def test_structured_output_through_text_format(served: Served) -> None:
    client = served.client()
    reply = client.responses.create(model=BYTES, input="A city?", text=FORMAT, max_output_tokens=80, temperature=0)
    assert reply.status == "completed", reply
    jsonschema.validate(json.loads(reply.output_text), {**ANSWER, "additionalProperties": False})
    assert reply.text.format.type == "json_schema" and reply.text.format.name == "answer"
    anything = client.responses.create(
        model=BYTES,
        input="A city?",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        extra_body={"seed": 3},
    )
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    parsed = client.responses.parse(model=BYTES, input="A city?", text_format=City, max_output_tokens=80, temperature=0)
    assert isinstance(parsed.output_parsed, City)
    bad = post(
        served,
        {
            "model": BYTES,
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "not": {}}}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text


def test_previous_response_id_reuses_the_previous_turns_kv_pages(served: Served, tmp_path_factory) -> None:
    """Output caching publishes the answer's pages too, so the continued conversation's prefix (the previous prompt
    and answer) comes from the prefix cache; without it only the previous prompt's pages would."""
    client = served.client()
    body = {"instructions": "Answer in JSON.", "text": FORMAT, "max_output_tokens": 80, "temperature": 0}
    first = client.responses.create(model=BYTES, input="The capital of France?", **body)
    second = client.responses.create(model=BYTES, input="And of Italy?", previous_response_id=first.id, **body)
    assert first.status == second.status == "completed"
    prompt, answer = first.usage.input_tokens, first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert answer > 2 * PAGE
    assert cached >= (prompt + answer - 1) // PAGE * PAGE, (prompt, answer, cached)
    assert served.llm.core.config.output_caching


def test_without_output_caching_only_the_prompt_is_reused(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = save_byte_model(tmp_path_factory.mktemp("tiny-bytes-no-oc"))
    llm = AsyncLLM(load_model(str(path)), page_size=PAGE, num_pages=512, model_name=BYTES, output_caching=False)
    with serving(llm) as s:
        client = s.client()
        body = {"instructions": "Answer in JSON.", "text": FORMAT, "max_output_tokens": 80, "temperature": 0}
        first = client.responses.create(model=BYTES, input="The capital of France?", **body)
        second = client.responses.create(model=BYTES, input="And of Italy?", previous_response_id=first.id, **body)
        assert second.usage.input_tokens_details.cached_tokens <= first.usage.input_tokens


PLANTED = {
    "type": "object",
    "properties": {"planted_note": {"type": "string", "maxLength": 40}},
    "required": ["planted_note"],
}


def test_a_format_failing_inside_a_step_fails_its_response_alone(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 on /v1/responses: a response whose ``text.format`` (or forced tool) fails inside an engine step
    ends alone, in this API's shape: waited for, a 400 naming ``text.format`` (``tools``); streamed, an ``error``
    event then ``response.failed``; in the background, a stored ``failed`` response with its error.  The
    responses running beside it get the text they get alone, and the engine returns to idle."""
    from concurrent.futures import ThreadPoolExecutor

    client = served.client()
    good = [{"input": f"Say w{i}.", "max_output_tokens": 16, "temperature": 0} for i in range(3)]
    good[1]["stream"] = True
    good[2]["text"] = {"format": {"type": "json_schema", "name": "a", "schema": ANSWER}}

    def send(body: dict[str, Any]) -> Any:
        if body.get("stream"):
            return events(served, model=BYTES, **{k: v for k, v in body.items() if k != "stream"})
        if body.get("background"):
            created = client.responses.create(model=BYTES, **body)
            deadline = time.monotonic() + 60
            while created.status in ("queued", "in_progress") and time.monotonic() < deadline:
                time.sleep(0.05)
                created = client.responses.retrieve(created.id)
            return created
        return httpx.post(served.url + "/v1/responses", json={"model": BYTES, **body}, timeout=60)

    def text(result: Any) -> str:
        if isinstance(result, list):
            assert result[-1].type == "response.completed" or result[-1].type == "response.incomplete"
            return "".join(e.delta for e in result if e.type == "response.output_text.delta")
        assert result.status_code == 200, result.text
        return str(Response.model_validate(result.json()).output_text)

    alone = [text(send(b)) for b in good]
    plant_matcher_failure(monkeypatch)
    formatted = {"format": {"type": "json_schema", "name": "p", "schema": PLANTED}}
    planted_tool = {**WEATHER, "name": "planted_tool", "parameters": {**PLANTED, "additionalProperties": False}}
    bad = [
        {"input": "Note.", "max_output_tokens": 30, "text": formatted},
        {"input": "Note.", "max_output_tokens": 30, "text": formatted, "stream": True},
        {"input": "Note.", "max_output_tokens": 30, "text": formatted, "background": True},
        {"input": "Note.", "max_output_tokens": 30, "tools": [planted_tool],
         "tool_choice": {"type": "function", "name": "planted_tool"}},
    ]  # fmt: skip
    with ThreadPoolExecutor(7) as pool:
        results = list(pool.map(send, [*good, *bad]))
    assert [text(r) for r in results[:3]] == alone
    waited, streamed, background, tool = results[3:]
    for refused, param in ((waited, "text.format"), (tool, "tools")):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_value", error
        assert "planted matcher failure" in error["message"] and "grammar dump" not in error["message"]
    assert [e.type for e in streamed[-2:]] == ["error", "response.failed"]
    assert streamed[-2].param == "text.format" and "planted matcher failure" in streamed[-2].message
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    for failed in (streamed[-1].response, background):
        assert failed.status == "failed" and failed.error.code == "invalid_prompt", failed
        assert "planted matcher failure" in failed.error.message and "grammar dump" not in failed.error.message
    assert client.responses.retrieve(streamed[-1].response.id).status == "failed"
    counts = served.wait_idle()
    assert counts["private"] == 0
