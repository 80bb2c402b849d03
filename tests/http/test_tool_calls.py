"""Tool calling through the server, with the official ``openai`` client, on a tiny random byte-level model.

A random model writes no call of its own accord, so these tests force one: ``tool_choice`` ``required`` or a
named function makes the grammar engine (``StructuredOutputsParams(json=...)``) write it, and every call's
arguments must then validate against its function's schema (``jsonschema``).  The two-turn test sends the
first reply's calls back with the tools' results, as an agent does, and checks that the history reached the
prompt.  Auto mode's parsing is ``test_tools.py``'s (a random model's text is not a call).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from server_support import Served, serving
from tool_models import save_byte_model

from mechserve.entrypoints.async_llm import AsyncLLM
from mechserve.model.loader import load_model

NAME = "tiny-tools"
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
            "required": ["zone", "exact"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = save_byte_model(tmp_path_factory.mktemp("tiny-tools"))
    llm = AsyncLLM(load_model(str(path)), page_size=4, num_pages=512, model_name=NAME)
    with serving(llm) as s:
        yield s


def check_calls(calls: Any, names: set[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Every call in OpenAI's shape, its arguments valid under its function's schema; (name, arguments) each."""
    found = []
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    if names is not None:
        assert {n for n, _ in found} <= names
    return found


def test_a_two_turn_tool_conversation_with_the_openai_client(served: Served) -> None:
    client = served.client()
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = check_calls(choice.message.tool_calls, {"get_weather"})
    # the agent runs the tool and answers the call by its id
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "18 degrees, sunny"},
    ]
    second = client.chat.completions.create(
        model=NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    # the history reached the prompt: the call and its result, rendered by the tools template
    ids = httpx.post(served.url + "/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(served.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert json.dumps({"name": name, "arguments": arguments}) in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert second.usage.prompt_tokens == len(ids), "tool_choice none: the tools are not rendered"
    with_tools = httpx.post(served.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["count"]
    assert with_tools > len(ids)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_forces_valid_calls(served: Served, parallel: bool) -> None:
    client = served.client()
    for seed in range(3):
        reply = client.chat.completions.create(
            model=NAME,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=200,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(calls) == 1


def stream(served: Served, **body: Any) -> tuple[list[Any], dict[int, dict[str, Any]], str | None]:
    """A streamed reply's chunks, its calls accumulated from the deltas as OpenAI's docs show, its finish reason."""
    chunks = list(served.client().chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, stream=True, **body))
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
    return chunks, calls, finish


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_streamed_call_is_the_non_streamed_one(served: Served, choice: Any) -> None:
    body = {"tool_choice": choice, "max_tokens": 120, "temperature": 0}
    whole = served.client().chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, **body)
    chunks, calls, finish = stream(served, **body)
    assert finish == "tool_calls" == whole.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert not any(c.choices and c.choices[0].delta.content for c in chunks), "a forced reply has no content"
    if choice == NAMED:
        assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2, "arguments stream"


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_streamed_call_has_openais_chunk_shape(served: Served, choice: Any) -> None:
    """Issue 29: one ``delta.tool_calls`` entry per call index per chunk; the first entry of a call carries its id,
    type and name (and may carry arguments), the later ones arguments only; the finish reason comes in a chunk of
    its own after the last arguments.  Both ways clients read such a stream get the whole arguments: the openai
    SDK's accumulating ``stream()`` helper, and instructor's partial mode, which reads ``delta.tool_calls[0]``."""
    body: dict[str, Any] = {"tool_choice": choice, "max_tokens": 120, "temperature": 0}
    whole = served.client().chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, **body)
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    chunks, calls, finish = stream(served, **body)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    opened: set[int] = set()
    with_calls = [k for k, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls]
    for chunk in chunks:
        entries = chunk.choices[0].delta.tool_calls or () if chunk.choices else ()
        assert len({e.index for e in entries}) == len(entries), chunk
        for e in entries:
            if e.index not in opened:
                assert e.id and e.type == "function" and e.function.name, e
                opened.add(e.index)
            else:
                assert e.id is None and e.type is None and e.function.name is None, e
    last = chunks[with_calls[-1] + 1]
    assert last.choices[0].finish_reason == "tool_calls" and not last.choices[0].delta.tool_calls
    assert not last.choices[0].delta.content and all(
        not c.choices[0].finish_reason for c in chunks[: with_calls[-1] + 1]
    )
    assert finish == "tool_calls"
    # the openai SDK's own accumulation
    with served.client().chat.completions.stream(model=NAME, messages=ASK, tools=TOOLS, **body) as events:
        final = events.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == expected
    # instructor's partial mode: the arguments of delta.tool_calls[0], chunk by chunk (one call: parallel off)
    if choice == NAMED:
        read = "".join(
            c.choices[0].delta.tool_calls[0].function.arguments or ""
            for c in chunks
            if c.choices and c.choices[0].delta.tool_calls
        )
        assert read == expected[0][1]


def test_a_schema_without_additional_properties_gets_no_invented_keys(served: Served) -> None:
    """Issue 29: LangChain strips ``additionalProperties: false`` from tool schemas unless ``strict``; the grammar
    then treats the object as closed (vLLM's default backend does), so a forced call has only the listed keys."""
    open_params = {"type": "object", "properties": {"city": CITY}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": open_params}}
    for seed in range(4):
        reply = served.client().chat.completions.create(
            model=NAME, messages=ASK, tools=[tool], tool_choice=NAMED, max_tokens=60, seed=seed
        )
        (call,) = reply.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city"}, call.function.arguments


def test_n_choices_each_carry_their_calls(served: Served) -> None:
    reply = served.client().chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", n=3, max_tokens=200, seed=7
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)


def test_a_stream_of_n_choices_keeps_each_choices_calls_apart(served: Served) -> None:
    body: dict[str, Any] = {"model": NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 2}
    body |= {"parallel_tool_calls": False, "max_tokens": 200, "seed": 11}
    whole = served.client().chat.completions.create(**body)
    calls: dict[int, dict[str, str]] = {}
    finish: dict[int, str] = {}
    for chunk in served.client().chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            finish[choice.index] = choice.finish_reason or finish.get(choice.index, "")
            for d in choice.delta.tool_calls or ():
                assert d.index == 0, "one call per choice"
                call = calls.setdefault(choice.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        assert calls[choice.index] == {"name": call.function.name, "arguments": call.function.arguments}


def test_auto_returns_text_when_the_reply_holds_no_call(served: Served) -> None:
    reply = served.client().chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, max_tokens=6, temperature=0, stop=["<"]
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.tool_calls is None
    plain = served.client().chat.completions.create(model=NAME, messages=ASK, max_tokens=6, temperature=0, stop=["<"])
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens, "the tools are in the prompt"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
        (  # a schema keyword the grammar engine does not implement: named as the tool's problem
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(served: Served, body: dict[str, Any], param: str) -> None:
    response = httpx.post(served.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_pages_all_return(served: Served) -> None:
    pages = served.wait_idle()
    assert pages["private"] == 0


def test_the_shipped_template_path(tmp_path: Path) -> None:
    """The fixture's model has SmolLM2's ChatML template, which renders no tools: the shipped one is used."""
    from mechserve.entrypoints.tools import renders_tools

    tok = load_model(str(save_byte_model(tmp_path))).tokenizer
    assert not renders_tools(tok.chat_template) and "<|im_start|>" in tok.chat_template


# auto: a random model writes no call, so vLLM's structured_outputs (h16's field) writes one in the template's format
CALL = r'<tool_call>\{"name":"get_time","arguments":\{"zone":"(UTC|CET)","exact":(true|false)\}\}</tool_call>'
TWO_CALLS = {"regex": r"Checking\.\n" + CALL + r"\n" + CALL}


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_parses_calls_out_of_the_text(served: Served, parallel: bool) -> None:
    body: dict[str, Any] = {"model": NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 200}
    body |= {"parallel_tool_calls": parallel, "extra_body": {"structured_outputs": TWO_CALLS}}
    reply = served.client().chat.completions.create(**body, seed=3)
    choice = reply.choices[0]
    calls = check_calls(choice.message.tool_calls, {"get_time"})
    assert len(calls) == (2 if parallel else 1), "without parallel calls, the reply stops at the first call's end"
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    chunks = list(served.client().chat.completions.create(**body, seed=3, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [d.function.arguments for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert content == "Checking." and streamed == [c.function.arguments for c in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
