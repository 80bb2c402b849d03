"""The Responses and Anthropic Messages APIs end to end on SmolLM2-135M-Instruct, with their official SDKs: a tool
round trip each (a grammar-forced call naming the city asked about, its result sent back, an answer), the
Agents SDK's way of continuing a conversation (``previous_response_id``) served from the prefix cache, a
LangChain-style tool schema without ``additionalProperties`` getting no invented keys, and a streamed answer."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from server_support import serving

from mechserve.entrypoints.async_llm import AsyncLLM

pytestmark = pytest.mark.e2e
NAME = "smollm2"
CITY = {"type": "string", "description": "The city name", "maxLength": 24}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},  # no additionalProperties
}
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def served(smollm2: Any) -> Any:
    with serving(AsyncLLM(smollm2, num_pages=256, max_step_tokens=512, model_name=NAME)) as served:
        yield served


def test_a_responses_tool_round_trip_and_a_continued_conversation(served: Any) -> None:
    client = served.client()
    first = client.responses.create(
        model=NAME,
        input=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = first.output
    arguments = json.loads(call.arguments)
    assert call.type == "function_call" and set(arguments) == {"city"} and "paris" in arguments["city"].lower()
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temperature": "18 C", "sky": "sunny"}',
    }
    answer = client.responses.create(
        model=NAME, previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=30, temperature=0
    )
    assert answer.output_text.strip() and answer.status in ("completed", "incomplete")
    # a plain conversation continued by id: the previous prompt and answer come from the prefix cache
    body = {"instructions": "You are a helpful assistant.", "max_output_tokens": 24, "temperature": 0}
    one = client.responses.create(model=NAME, input="Name a planet of the solar system.", **body)
    two = client.responses.create(model=NAME, input="And a second one?", previous_response_id=one.id, **body)
    cached = two.usage.input_tokens_details.cached_tokens
    assert cached >= one.usage.input_tokens // 16 * 16, (one.usage, two.usage)
    assert cached > one.usage.input_tokens - 16 + min(one.usage.output_tokens, 16), "the answer's pages were reused"
    events = list(client.responses.create(model=NAME, input="Name a colour.", stream=True, **body))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() and events[-1].response.output_text == text


def test_a_messages_tool_round_trip_and_a_stream(served: Any) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    turns: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    first = client.messages.create(
        model=NAME,
        max_tokens=40,
        messages=turns,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    (use,) = first.content
    assert first.stop_reason == "tool_use" and set(use.input) == {"city"} and "paris" in use.input["city"].lower()
    turns += [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]},
    ]
    answer = client.messages.create(
        model=NAME, max_tokens=30, messages=turns, tools=[tool], extra_body={"temperature": 0}
    )
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text.strip()
    with client.messages.stream(
        model=NAME, max_tokens=24, system="Answer briefly.", messages=[{"role": "user", "content": "Name a colour."}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
