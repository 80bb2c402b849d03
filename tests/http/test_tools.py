"""Tool calling's pure parts (``mechserve.entrypoints.tools``): tool definitions and choices checked with the
field named, the forced schemas, the parser of replies (a streamed reply and the whole one agree, for any split),
and the chat template: tools and tool-call history rendered, never dropped."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tool_models import CHATML, save_byte_model

from mechserve.api.errors import ParamError
from mechserve.entrypoints.prompts import Chat, encode_chat
from mechserve.entrypoints.tools import (
    CLOSE,
    OPEN,
    FunctionTool,
    ToolPlan,
    ToolStream,
    finish_reason,
    parse_tool_choice,
    parse_tools,
    renders_tools,
    shipped_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get-time"}}
TOOLS = parse_tools([WEATHER, TIME])


def fn(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "custom", "custom": {"name": "f"}}], "tools.0.type"),
        (["f"], "tools.0"),
        ([{"type": "function"}], "tools.0.function"),
        ([fn("has space")], "tools.0.function.name"),
        ([fn("x" * 65)], "tools.0.function.name"),
        ([fn("f"), fn("f")], "tools.1.function.name"),
        ([fn("f", description=3)], "tools.0.function.description"),
        ([fn("f", parameters=[])], "tools.0.function.parameters"),
        ([fn("f", parameters={"type": "string"})], "tools.0.function.parameters"),
        ([fn("f", parameters={"type": "object", "properties": {"a": 1}})], "tools.0.function.parameters.properties"),
        ([fn("f", parameters={"type": "object", "required": "a"})], "tools.0.function.parameters.required"),
        ([fn("f", strict="yes")], "tools.0.function.strict"),
        (
            [fn("f", parameters={"type": "object", "properties": {"a": {"type": "nope"}}})],
            "tools.0.function.parameters",
        ),
        ([fn("f", parameters={"type": "object", "minProperties": -1})], "tools.0.function.parameters"),
        ([fn(f"f{i}") for i in range(129)], "tools"),
    ],
)
def test_a_bad_tool_definition_names_its_part(tools: list[Any], param: str) -> None:
    with pytest.raises(ParamError) as caught:
        parse_tools(tools)
    assert caught.value.param == param


def test_a_function_without_parameters_takes_an_empty_object() -> None:
    (tool,) = parse_tools([TIME])
    assert tool == FunctionTool("get-time", None, {"type": "object", "properties": {}}, None)
    assert tool.as_template() == {"type": "function", "function": {"name": "get-time", "parameters": tool.parameters}}


@pytest.mark.parametrize(
    ("choice", "tools", "mode"),
    [
        (None, TOOLS, "auto"),
        (None, (), "none"),
        ("none", TOOLS, "none"),
        ("auto", (), "auto"),
        ("required", TOOLS, "required"),
    ],
)
def test_tool_choice_modes(choice: Any, tools: tuple[FunctionTool, ...], mode: str) -> None:
    plan = parse_tool_choice(choice, tools)
    assert plan.mode == mode and plan.parallel
    assert plan.active == (mode in ("auto", "required") and bool(tools))


@pytest.mark.parametrize(
    ("choice", "tools"),
    [
        ("always", TOOLS),
        ("required", ()),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS),
        ({"type": "function", "function": {"name": "get_weather"}}, ()),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, TOOLS),
        ({"type": "function", "name": "get_weather"}, TOOLS),
        (3, TOOLS),
    ],
)
def test_a_bad_tool_choice_names_it(choice: Any, tools: tuple[FunctionTool, ...]) -> None:
    with pytest.raises(ParamError) as caught:
        parse_tool_choice(choice, tools)
    assert caught.value.param == "tool_choice"


def test_the_forced_schemas() -> None:
    named = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    assert named.forced and named.schema() == WEATHER["function"]["parameters"]  # type: ignore[index]
    required = parse_tool_choice("required", TOOLS, parallel=False).schema()
    assert required is not None and required["type"] == "array"
    assert (required["minItems"], required["maxItems"]) == (1, 1)
    names = [item["properties"]["name"] for item in required["items"]["anyOf"]]
    assert names == [{"const": "get_weather"}, {"const": "get-time"}]
    one = parse_tool_choice("required", TOOLS[:1]).schema()
    assert one is not None and "maxItems" not in one and one["items"]["properties"]["name"] == {"const": "get_weather"}
    assert parse_tool_choice("auto", TOOLS).schema() is None
    assert parse_tool_choice("auto", TOOLS, parallel=False).stop() == (CLOSE,)
    assert parse_tool_choice("auto", TOOLS).stop() == ()


# The parser ----------------------------------------------------------------------------------------------------------

AUTO = ToolPlan(TOOLS, "auto")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3)
CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "get-time"]), ARGUMENTS), max_size=4)
PROSE = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=20)
# pieces that look like the tags without being a call
TRICKY = st.lists(
    st.sampled_from([OPEN, CLOSE, "<", "<tool", "{", "}", '"name"', ":", " ", "\n", "x", "é", '{"name": "nope"}']),
    max_size=12,
).map("".join)


def stream_parse(plan: ToolPlan, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed ``text`` cut at ``cuts`` and accumulate the deltas as OpenAI's client does: (content, calls, ids)."""
    parser = ToolStream(plan)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    pieces = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [parser.finish()]
    for shown, deltas in pieces:
        content += shown
        # OpenAI's stream shape: exactly one entry per call index in each chunk (clients read tool_calls[0])
        assert len({d["index"] for d in deltas}) == len(deltas), deltas
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function", "the first delta of a call opens it once"
                call["id"], call["name"] = d["id"], d["function"]["name"]
            call["arguments"] += d["function"]["arguments"]
    ordered = [calls[i] for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls))), "indices count from 0"
    return content, [(c["name"], c["arguments"]) for c in ordered], [c["id"] for c in ordered]


def written(calls: list[tuple[str, dict[str, Any]]], prose: list[str]) -> str:
    """A reply as the template asks for it: prose, then blocks (prose[i] before call i, the rest after)."""
    out = ""
    for i, (name, args) in enumerate(calls):
        out += (
            (prose[i] if i < len(prose) else "")
            + f"{OPEN}\n"
            + json.dumps({"name": name, "arguments": args})
            + f"\n{CLOSE}"
        )
    return out + (prose[len(calls)] if len(prose) > len(calls) else "")


@settings(max_examples=200, deadline=None)
@given(calls=CALLS, prose=st.lists(PROSE, max_size=5), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_auto_finds_every_call_and_a_stream_agrees_with_the_whole(
    calls: list[tuple[str, dict[str, Any]]], prose: list[str], cuts: list[int]
) -> None:
    text = written(calls, prose)
    reply = ToolStream(AUTO).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in reply.calls)
    outside = "".join(p for i, p in enumerate(prose) if i <= len(calls))
    if calls:
        assert (reply.content or "").split() == outside.split(), "the text around the calls, whitespace aside"
        assert reply.content is None or reply.content == reply.content.rstrip()
    else:
        assert reply.content == text
    content, streamed, ids = stream_parse(AUTO, text, cuts)
    assert content == (reply.content or "")
    assert streamed == [(c.name, c.arguments) for c in reply.calls]
    assert len(set(ids)) == len(ids)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(TRICKY, st.text(max_size=30)), cuts=st.lists(st.integers(0, 10_000), max_size=8))
@example(text=OPEN, cuts=[])  # an opening tag that ends the reply was once dropped
def test_text_that_holds_no_valid_call_comes_back_exactly(text: str, cuts: list[int]) -> None:
    """Partial tags, unclosed blocks, calls of unknown functions, bad JSON: all of it stays content, unchanged."""
    reply = ToolStream(AUTO).parse(text)
    if not reply.calls:
        assert reply.content == text
        assert stream_parse(AUTO, text, cuts)[:2] == (text, [])


@pytest.mark.parametrize(
    ("text", "names", "content"),
    [
        (f'{OPEN}{{"name": "get-time", "arguments": {{}}}}{CLOSE}', ["get-time"], None),
        (f'Let me look.\n{OPEN}{{"name": "get-time", "arguments": "{{}}"}}{CLOSE}\n', ["get-time"], "Let me look."),
        (f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}', ["get_weather"], None),  # no close
        (
            f'{OPEN}{{"name": "get_weather", "arguments": [1]}}{CLOSE}',
            [],
            f'{OPEN}{{"name": "get_weather", "arguments": [1]}}{CLOSE}',
        ),
        (
            f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Pa',
            [],
            f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Pa',
        ),
    ],
)
def test_auto_cases(text: str, names: list[str], content: str | None) -> None:
    reply = ToolStream(AUTO).parse(text)
    assert [c.name for c in reply.calls] == names and reply.content == content
    message = reply.message()
    assert ("tool_calls" in message) == bool(names) and message["role"] == "assistant"


@settings(max_examples=100, deadline=None)
@given(calls=CALLS.filter(bool), cuts=st.lists(st.integers(0, 10_000), max_size=8), indent=st.sampled_from([None, 1]))
def test_required_parses_the_forced_list(
    calls: list[tuple[str, dict[str, Any]]], cuts: list[int], indent: int | None
) -> None:
    plan = ToolPlan(TOOLS, "required")
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls], indent=indent)
    reply = ToolStream(plan).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == calls and reply.content is None
    content, streamed, _ = stream_parse(plan, text, cuts)
    assert content == "" and streamed == [(c.name, c.arguments) for c in reply.calls]


def test_required_cut_short_is_a_cut_call_never_content() -> None:
    """Issue 31: max_tokens cutting a forced call left the JSON fragment in ``content``.  As OpenAI answers a cut
    call (finish_reason "length"), the call is returned with the arguments written so far; a cut before its
    name is whole is no call; ``content`` stays null either way, streamed or not."""
    plan = ToolPlan(TOOLS, "required")
    text = '[{"name": "get-time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci'
    reply = ToolStream(plan).parse(text)
    assert [(c.name, c.arguments) for c in reply.calls] == [("get-time", "{}"), ("get_weather", '{"ci')]
    assert reply.content is None
    assert stream_parse(plan, text, [5, 40, 60])[:2] == ("", [("get-time", "{}"), ("get_weather", '{"ci')])
    for cut in (
        '[{"name": "get_wea',
        '[{"name": "get-time", "arguments": {}}, {"na',
        '[{"name": "nope", "arguments": {',
    ):
        reply = ToolStream(plan).parse(cut)
        assert reply.content is None and [c.name for c in reply.calls] == (["get-time"] if "}}" in cut else [])


@pytest.mark.parametrize("tail", [",", ", ", ",\n", ", ]"])
def test_required_cut_after_a_separator_has_no_content(tail: str) -> None:
    """Found by a new user's trial: max_tokens cutting the forced list right after a call's "," gave content ","."""
    text = '[{"name": "get-time", "arguments": {}}' + tail
    reply = ToolStream(ToolPlan(TOOLS, "required")).parse(text)
    assert [c.name for c in reply.calls] == ["get-time"] and reply.content is None


@given(text=st.text(max_size=30), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_a_named_function_streams_its_arguments_as_they_come(text: str, cuts: list[int]) -> None:
    plan = ToolPlan(TOOLS, "function", "get_weather")
    reply = ToolStream(plan).parse(text)
    assert [(c.name, c.arguments) for c in reply.calls] == [("get_weather", text)] and reply.content is None
    assert stream_parse(plan, text, cuts)[:2] == ("", [("get_weather", text)])


def test_a_named_functions_first_chunk_is_one_entry_with_the_first_arguments() -> None:
    """The failing input of issue 29: the first chunk of a forced call carried two entries for index 0 (id and
    name with empty arguments, then the arguments), so a client reading ``delta.tool_calls[0]`` lost the first
    piece."""
    parser = ToolStream(ToolPlan(TOOLS, "function", "get_weather"))
    content, deltas = parser.feed('{"city": "Pa')
    (first,) = deltas
    assert content == "" and first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert parser.feed('ris"}') == ("", [{"index": 0, "function": {"arguments": 'ris"}'}}])
    assert parser.feed("") == ("", []) and parser.finish() == ("", [])


@settings(max_examples=200, deadline=None)
@given(calls=CALLS, prose=st.lists(PROSE, max_size=5), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_the_ordered_pieces_are_the_chat_pieces_in_the_replys_order(
    calls: list[tuple[str, dict[str, Any]]], prose: list[str], cuts: list[int]
) -> None:
    """``feed_ordered``/``finish_ordered`` (the Responses and Anthropic APIs' view) hold exactly what ``feed``/``finish``
    give chat, with each stretch of prose before the call it preceded."""
    text = written(calls, prose)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    ordered, plain = ToolStream(AUTO), ToolStream(AUTO)
    pieces: list[Any] = []
    for a, b in itertools.pairwise(bounds):
        got = ordered.feed_ordered(text[a:b])
        content, deltas = plain.feed(text[a:b])
        assert "".join(p for p in got if isinstance(p, str)) == content
        assert [p["function"] for p in got if isinstance(p, dict)] == [d["function"] for d in deltas]
        pieces += got
    pieces += ordered.finish_ordered()
    assert all(p for p in pieces), "no empty content pieces"
    names = [p["function"]["name"] for p in pieces if isinstance(p, dict)]
    assert names == [name for name, _ in calls]
    for i in range(len(calls)):  # the prose written before call i comes before it
        before = "".join(
            p for p in pieces[: [j for j, p in enumerate(pieces) if isinstance(p, dict)][i]] if isinstance(p, str)
        )
        assert "".join(prose[: i + 1]).split() == before.split()


def test_a_strict_functions_auto_call_must_follow_its_schema() -> None:
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    for tools, calls in (([strict], []), ([WEATHER], ["get_weather"])):
        plan = ToolPlan(parse_tools(tools), "auto")
        bad = f'{OPEN}{{"name": "get_weather", "arguments": {{"town": "Paris"}}}}{CLOSE}'
        reply = ToolStream(plan).parse(bad)
        assert [c.name for c in reply.calls] == calls and reply.content == (None if calls else bad)
        good = ToolStream(plan).parse(f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}{CLOSE}')
        assert [c.name for c in good.calls] == ["get_weather"]


def test_finish_reason() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"


# The template --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tokenizer with SmolLM2's ChatML template, which renders no tools."""
    from transformers import AutoTokenizer

    path = save_byte_model(tmp_path_factory.mktemp("byte-tok"))
    return AutoTokenizer.from_pretrained(path)


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "tool", "content": "rain", "tool_call_id": "c2"},
]


def test_the_shipped_template_renders_tools_calls_and_results(chatml: Any) -> None:
    assert not renders_tools(CHATML) and renders_tools(shipped_template())
    tools = [t.as_template() for t in TOOLS]
    text, ids = encode_chat(chatml, Chat(HISTORY, tools=tools))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and text.endswith("<|im_start|>assistant\n")
    for tool in tools:
        assert json.dumps(tool["function"]) in text
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    assert text.count("<|im_start|>") == text.count("<|im_end|>") + 1
    assert ids == chatml(text, add_special_tokens=False).input_ids
    # what the template writes for a call is what the parser reads back
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    reply = ToolStream(ToolPlan(TOOLS, "auto")).parse(turn)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]


def test_history_with_tool_calls_alone_uses_the_tools_template(chatml: Any) -> None:
    text, _ = encode_chat(chatml, Chat(HISTORY[1:]))
    assert "<tools>" not in text and '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert "<tool_response>\nrain\n</tool_response>" in text
    plain, _ = encode_chat(chatml, Chat(HISTORY[1:2]))
    assert plain == "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n", (
        "its own otherwise"
    )


def test_a_template_that_renders_tools_is_used_as_it_is(chatml: Any) -> None:
    own = "{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    text, _ = encode_chat(chatml, Chat(HISTORY[1:2], chat_template=own, tools=[t.as_template() for t in TOOLS]))
    assert text == "T:get_weather;T:get-time;Weather in Paris and Rome?"


def test_a_template_that_cannot_render_tools_is_refused(chatml: Any) -> None:
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ParamError) as caught:
        encode_chat(chatml, Chat(HISTORY[1:2], chat_template=plain, tools=[t.as_template() for t in TOOLS]))
    assert caught.value.param == "tools" and "--chat-template" in str(caught.value)
    with pytest.raises(ParamError) as caught:
        encode_chat(chatml, Chat(HISTORY[1:], chat_template=plain))
    assert caught.value.param == "messages"


def test_the_template_is_package_data() -> None:
    import mechserve.entrypoints

    assert (Path(mechserve.entrypoints.__file__).parent / "templates" / "chatml_tools.jinja").is_file()


def test_llm_chat_renders_tools_as_the_server_does(tmp_path: Path) -> None:
    from mechserve.api.params import SamplingParams
    from mechserve.entrypoints.llm import LLM

    llm = LLM(str(save_byte_model(tmp_path)), page_size=4, num_pages=512)
    (out,) = llm.chat(HISTORY[1:2], SamplingParams(max_tokens=1), use_tqdm=False, tools=[WEATHER])
    assert out.prompt == encode_chat(llm.core.tokenizer, Chat(HISTORY[1:2], tools=[TOOLS[0].as_template()]))[0]
    assert "<tools>" in out.prompt and '"name": "get_weather"' in out.prompt
    with pytest.raises(ParamError):
        llm.chat(HISTORY[1:2], use_tqdm=False, tools=[fn("bad name")])
