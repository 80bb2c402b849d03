"""Tool calling end to end on SmolLM2-135M-Instruct, whose own template renders no tools: the shipped ChatML
tools template renders them, a named choice forces a call whose arguments follow the schema (and, greedy,
name the city asked about), the call and its result go back as history, and a streamed call is the whole one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from server_support import serving

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.entrypoints.tools import renders_tools

pytestmark = pytest.mark.e2e
NAME = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(smollm2: Any) -> Any:
    with serving(AsyncLLM(smollm2, num_pages=256, max_step_tokens=512, model_name=NAME)) as served:
        yield served


def test_a_forced_call_then_the_answer(served: Any, smollm2: Any) -> None:
    assert not renders_tools(smollm2.tokenizer.chat_template)
    client = served.client()
    first = client.chat.completions.create(
        model=NAME, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=40, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    assert call.function.name == "get_weather" and "paris" in arguments["city"].lower()
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": "18 C", "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=30, temperature=0)
    reply = second.choices[0]
    assert reply.message.tool_calls or reply.message.content
    tokens = httpx.post(served.url + "/tokenize", json={"messages": history, "tools": [WEATHER]}).json()
    assert second.usage.prompt_tokens == tokens["count"]
    text = smollm2.tokenizer.decode(tokens["tokens"])
    assert "<tools>" in text and call.function.name in text and "<tool_response>" in text and "sunny" in text


def test_a_streamed_forced_call_is_the_whole_one(served: Any) -> None:
    body: dict[str, Any] = {"model": NAME, "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED}
    body |= {"max_tokens": 40, "temperature": 0}
    whole = served.client().chat.completions.create(**body).choices[0].message.tool_calls[0]
    arguments = ""
    for chunk in served.client().chat.completions.create(**body, stream=True):
        for d in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            arguments += d.function.arguments or ""
    assert arguments == whole.function.arguments
