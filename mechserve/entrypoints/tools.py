"""Tool calling: OpenAI's function tools into the chat template, and the model's tool calls out of its text.

A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become one ``ToolPlan``::

    tools                 function tools (OpenAI's ``{"type": "function", "function": {name, description,
                          parameters, strict}}``), rendered into the prompt by the chat template
    tool_choice "none"    the tools are not rendered and nothing is parsed: a plain reply
    tool_choice "auto"    the model may answer with calls in the template's format,
                          ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes / Qwen2.5's),
                          parsed out of the free text; a block that is not a valid call stays text
    tool_choice           the output is forced by the grammar engine (``StructuredOutputsParams(json=...)``)
      "required"          to a JSON list of calls ``[{"name", "arguments"}, ...]`` (at least one; one
                          without ``parallel_tool_calls``), every call's arguments valid under its
                          function's ``parameters`` schema
      {"type": "function", "function": {"name": f}}
                          to the arguments of ``f`` alone (one JSON object valid under its schema)
    parallel_tool_calls   false: at most one call (``auto``: generation stops at the first call's
                          closing tag; ``required``: a list of one)

A reply with calls has ``finish_reason: "tool_calls"`` (when the model stopped by itself; a reply cut
by ``max_tokens`` keeps ``"length"``, and a forced call it cut is a call with the arguments written so
far, as OpenAI returns it, never a JSON fragment in ``content``), ``tool_calls`` in OpenAI's shape (``id``, ``type: "function"``,
``function.name``, ``function.arguments`` a JSON string) and ``content`` the text around the calls
(null if none).  ``ToolStream`` parses a reply as it streams and gives OpenAI's chunk deltas; the
whole reply is the same parse fed at once, so a streamed reply and a non-streamed one agree.
A function's ``parameters`` must be a valid JSON schema of an object (``jsonschema`` checks it); with
``strict: true``, an ``auto`` call whose arguments do not validate under it stays text (a forced call
always validates: the grammar writes it).

The template: the model's own (or ``--chat-template``'s) when it uses ``tools``; else, for a ChatML
model (SmolLM2's template has no tools), ``templates/chatml_tools.jinja`` shipped here; else a 400
(give ``--chat-template`` one that renders tools).  The same choice is made for a conversation
whose history holds an assistant's ``tool_calls`` or ``tool`` messages, so they are never dropped.

The standard library, and ``jsonschema`` for the tools' schemas.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal

from mechserve.api.errors import ParamError

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOLS_TEMPLATE = "chatml_tools.jinja"
EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function tool: ``name``, ``description``, ``parameters`` (a JSON schema of an object), ``strict``."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    strict: bool | None = None

    def as_template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's shape, which transformers passes on unchanged)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request does with tools: its ``tools``, ``mode`` (``none``, ``auto``, ``required`` or
    ``function``: the one named ``name``) and whether several calls may be made (``parallel``)."""

    tools: tuple[FunctionTool, ...] = ()
    mode: Mode = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the reply is parsed for calls (and the tools rendered into the prompt)."""
        return self.mode != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        """Whether the grammar forces a call (``required`` or a named function)."""
        return self.mode in ("required", "function")

    def tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (None under ``none``: the model is not shown them)."""
        return [t.as_template() for t in self.tools] if self.active else None

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the grammar forces the output to (None unless ``forced``)."""
        if self.mode == "function":
            tool = self.tool(self.name or "")
            assert tool is not None
            return dict(tool.parameters)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        schema["minItems"] = 1
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def stop(self) -> tuple[str, ...]:
        """Stop strings the plan adds: ``auto`` without parallel calls ends at the first call's closing tag."""
        return (CLOSE,) if self.mode == "auto" and self.active and not self.parallel else ()


def parse_tools(raw: Sequence[Any] | None) -> tuple[FunctionTool, ...]:
    """OpenAI's ``tools`` list as ``FunctionTool`` s.

    Raises ``ParamError`` naming the part (``tools.2.function.name``) for anything but a function
    tool (``custom`` tools are refused), a name that is not 1..64 of ``[A-Za-z0-9_-]``, a name given
    twice, ``parameters`` that are not a JSON schema of an object, or more than ``MAX_TOOLS`` tools.
    """
    if not raw:
        return ()
    if len(raw) > MAX_TOOLS:
        raise ParamError("tools", f"at most {MAX_TOOLS} tools, got {len(raw)}")
    found: list[FunctionTool] = []
    for i, item in enumerate(raw):
        where = f"tools.{i}"
        if not isinstance(item, Mapping):
            raise ParamError(where, f"{where} must be an object, got {type(item).__name__}")
        kind = item.get("type")
        if kind != "function":
            raise ParamError(
                f"{where}.type", f"{where}.type {kind!r} is not supported: only function tools (type 'function')"
            )
        function = item.get("function")
        if not isinstance(function, Mapping):
            raise ParamError(f"{where}.function", f"{where}.function must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ParamError(
                f"{where}.function.name",
                f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
            )
        if any(t.name == name for t in found):
            raise ParamError(f"{where}.function.name", f"two tools are named {name!r}")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ParamError(f"{where}.function.description", f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        parameters = dict(EMPTY_PARAMETERS) if parameters is None else parameters
        _check_parameters(parameters, f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ParamError(f"{where}.function.strict", f"{where}.function.strict must be a boolean")
        found.append(FunctionTool(name, description, parameters, strict))
    return tuple(found)


def _check_parameters(schema: Any, where: str) -> None:
    """A function's ``parameters``: a JSON schema of an object (OpenAI's rule); the grammar engine checks the rest
    when it compiles it."""
    if not isinstance(schema, Mapping):
        raise ParamError(where, f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
    kind = schema.get("type", "object")
    if kind != "object":
        raise ParamError(where, f"{where} must be the schema of an object (type 'object'), got type {kind!r:.40}")
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping) or not all(isinstance(v, Mapping | bool) for v in properties.values()):
        raise ParamError(f"{where}.properties", f"{where}.properties must map names to schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ParamError(f"{where}.required", f"{where}.required must be a list of property names")
    jsonschema = _jsonschema()
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ParamError(where, f"{where} is not a valid JSON schema: {exc.message}") from None


def _jsonschema() -> Any:
    """``jsonschema``, imported when a tool is first checked (the server's dependency, not the package's)."""
    import jsonschema  # type: ignore[import-untyped]

    return jsonschema


def valid_arguments(tool: FunctionTool, arguments: Mapping[str, Any]) -> bool:
    """Whether ``arguments`` validate under ``tool``'s ``parameters`` (``jsonschema``)."""
    validator = _jsonschema().validators.validator_for(tool.parameters)(tool.parameters)
    return bool(validator.is_valid(arguments))


def parse_tool_choice(raw: Any, tools: tuple[FunctionTool, ...], parallel: bool | None = None) -> ToolPlan:
    """The request's ``ToolPlan``: ``tool_choice`` (default ``auto`` with tools, ``none`` without) over
    ``tools``; ``parallel`` is ``parallel_tool_calls`` (default true).

    Raises ``ParamError("tool_choice", ...)`` for another string or shape, ``required`` or a named
    function without tools, and a name that is not one of the tools.
    """
    par = True if parallel is None else parallel
    if raw is None:
        return ToolPlan(tools, "auto" if tools else "none", None, par)
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ParamError(
                "tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got {raw!r}"
            )
        if raw == "required" and not tools:
            raise ParamError("tool_choice", "tool_choice 'required' needs tools")
        return ToolPlan(tools, raw, None, par)  # type: ignore[arg-type]
    function = raw.get("function") if isinstance(raw, Mapping) else None
    if not isinstance(raw, Mapping) or raw.get("type") != "function" or not isinstance(function, Mapping):
        raise ParamError(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {json.dumps(raw)[:80]}",
        )
    name = function.get("name")
    if not any(t.name == name for t in tools):
        known = ", ".join(t.name for t in tools) or "no tools were given"
        raise ParamError("tool_choice", f"tool_choice names function {name!r}, which is not among the tools ({known})")
    return ToolPlan(tools, "function", str(name), par)


# The template ----------------------------------------------------------------------------------------------------------


@cache
def shipped_template() -> str:
    """The Jinja text of ``templates/chatml_tools.jinja``, mechserve's tools template for ChatML models."""
    return resources.files("mechserve.entrypoints").joinpath("templates", TOOLS_TEMPLATE).read_text(encoding="utf-8")


def renders_tools(template: str) -> bool:
    """Whether a chat template uses the ``tools`` variable (a template that does not would drop them)."""
    return re.search(r"\btools\b", template) is not None


def template_for_tools(template: str | None, param: str) -> str | None:
    """The template to render a conversation with tools (or tool calls in its history): None (``template``
    itself) when it renders tools, the shipped ChatML tools template when ``template`` is ChatML; else
    ``ParamError(param)``: nothing could render the tools without dropping them."""
    if template is not None and renders_tools(template):
        return None
    if template is not None and "<|im_start|>" in template:
        return shipped_template()
    raise ParamError(
        param,
        "this model's chat template renders no tools (and is not ChatML, for which mechserve ships one); "
        "serve it with --chat-template naming a template that uses `tools`",
    )


def history_has_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a conversation holds an assistant's ``tool_calls`` or a ``tool`` message."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages if isinstance(m, Mapping))


# Parsing the reply ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: ``id`` (``call_`` and 24 hex digits), the function's ``name``, its ``arguments``
    as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Reply:
    """A whole parsed reply: ``content`` (null when only calls were made and no text around them) and ``calls``."""

    content: str | None
    calls: list[ToolCall]

    def message(self) -> dict[str, Any]:
        """The chat response's ``message``: ``tool_calls`` only when there are calls."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [c.as_openai() for c in self.calls]
        return out


def finish_reason(reason: str | None, calls: bool) -> str | None:
    """``"tool_calls"`` when the model stopped by itself having made calls; otherwise the engine's reason."""
    return "tool_calls" if calls and reason == "stop" else reason


Piece = str | dict[str, Any]  # a reply's content text, or one ``delta.tool_calls`` entry


class ToolStream:
    """Parses one reply (one choice) for tool calls as its text arrives.

    ``feed(text)`` and ``finish()`` each return ``(content, deltas)``: the text to show now as
    ``delta.content`` and the ``delta.tool_calls`` entries, in OpenAI's stream shape: exactly one entry
    per call index per call of ``feed``/``finish``; the first entry of call ``i`` carries ``index``,
    ``id``, ``type`` and ``function.name`` (with its ``function.arguments`` so far, possibly ``""``),
    later ones ``index`` and the next ``function.arguments`` piece.  ``feed_ordered`` /
    ``finish_ordered`` give the same pieces in the order the reply wrote them (content text and call
    entries interleaved), for APIs whose output is a sequence of blocks (Responses, Anthropic Messages).
    Text that might still turn out to be part of a call (a partial ``<tool_call>`` tag, a block not
    closed yet, whitespace that only separates calls) is held back until it is known.  ``parse(text)``
    is the whole reply at once.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text not yet shown nor parsed
        self._space = ""  # trailing whitespace of the content, held until text follows it
        self._inside = False  # within <tool_call> ... (auto)
        self._text = ""  # everything fed (required, function)
        self._pos = 0  # required: where the next list item starts in _text
        self._opened = False  # function: whether the call's first delta went out

    def parse(self, text: str) -> Reply:
        content, _ = self.feed(text)
        more, _ = self.finish()
        text_out = content + more
        plain = not self.calls and not self.plan.forced  # a forced reply is calls only, even when cut short
        return Reply(text_out if text_out or plain else None, list(self.calls))

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return _split(self.feed_ordered(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return _split(self.finish_ordered())

    def feed_ordered(self, text: str) -> list[Piece]:
        """``feed``'s content and call entries as one list, in the order the reply wrote them."""
        if self.plan.mode == "function":
            return list(self._feed_function(text))
        if self.plan.mode == "required":
            self._text += text
            return list(self._required_items(final=False))
        self._buffer += text
        return self._scan(final=False)

    def finish_ordered(self) -> list[Piece]:
        """``finish``'s content and call entries as one list, in the order the reply wrote them."""
        if self.plan.mode == "function":
            return []
        if self.plan.mode == "required":
            pieces: list[Piece] = list(self._required_items(final=True))
            # A call the grammar did not get to close (max_tokens cut it) is never content: as OpenAI does,
            # it is a call whose arguments are the text so far (not valid JSON; finish_reason stays "length"),
            # once its name is whole; before that it is nothing.
            cut = _CUT_CALL.match(self._text, self._pos)
            if cut is not None and self.plan.tool(json.loads(f'"{cut.group(1)}"')) is not None:
                pieces += self._emit(ToolCall(json.loads(f'"{cut.group(1)}"'), cut.group(2)))
                self._pos = len(self._text)
            return pieces
        pieces = self._scan(final=True)
        if not self.calls and self._space:
            pieces.append(self._space)
        self._space = ""
        return pieces

    # auto: <tool_call> blocks in free text

    def _scan(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        shown: list[str] = []
        while self._buffer or (final and self._inside):
            if not self._inside:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, OPEN)
                    shown.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                shown.append(self._buffer[:at])
                self._buffer = self._buffer[at + len(OPEN) :]
                self._inside = True
            end = self._buffer.find(CLOSE)
            if end < 0 and not final:
                break
            block = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(CLOSE) :]
            self._inside = False
            call = self._call(block)
            if call is None:  # not a call of these tools: it stays text
                shown.append(OPEN + block + ("" if end < 0 else CLOSE))
            else:
                pieces.append(self._content("".join(shown)))
                shown = []
                pieces += self._emit(call)
        pieces.append(self._content("".join(shown)))
        return [p for p in pieces if p != ""]

    def _content(self, text: str) -> str:
        """Content to show now: whitespace at the end is held (it may only separate calls)."""
        text = self._space + text
        stripped = text.rstrip()
        self._space = text[len(stripped) :]
        return stripped

    def _call(self, block: str) -> ToolCall | None:
        try:
            found = json.loads(block)
        except ValueError:
            return None
        return self._as_call(found)

    def _as_call(self, found: Any) -> ToolCall | None:
        if not isinstance(found, dict) or not isinstance(found.get("name"), str):
            return None
        tool = self.plan.tool(found["name"])
        if tool is None:
            return None
        arguments = found.get("arguments", found.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        if tool.strict and self.plan.mode == "auto" and not valid_arguments(tool, arguments):
            return None  # a strict function's call must follow its schema (forced choices always do)
        return ToolCall(found["name"], json.dumps(arguments, ensure_ascii=False))

    def _emit(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.calls)
        self.calls.append(call)
        return [
            {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ]

    # required: a JSON list of {"name", "arguments"}, forced by the grammar

    def _required_items(self, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        text = self._text
        decoder = json.JSONDecoder()
        while True:
            pos = self._pos
            while pos < len(text) and text[pos] in " \t\r\n[,":
                pos += 1
            if pos >= len(text) or text[pos] == "]":
                return deltas
            try:
                found, end = decoder.raw_decode(text, pos)
            except ValueError:
                return deltas  # not complete yet (or cut short: finish shows the rest)
            if end == len(text) and not final and isinstance(found, int | float):
                return deltas  # a number may still grow
            call = self._as_call(found)
            if call is None:
                return deltas
            deltas += self._emit(call)
            self._pos = end

    # function: the output is the named function's arguments

    def _feed_function(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        deltas: list[dict[str, Any]] = []
        if not self._opened:
            # the call's first entry: id, type and name, with the arguments' first piece in the same entry
            self._opened = True
            call = ToolCall(str(self.plan.name), "")
            self.calls.append(call)
            deltas.append(
                {"index": 0, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": text}}
            )
        elif text:
            deltas.append({"index": 0, "function": {"arguments": text}})
        self.calls[0] = ToolCall(self.calls[0].name, self._text, self.calls[0].id)
        return deltas


def _split(pieces: list[Piece]) -> tuple[str, list[dict[str, Any]]]:
    """Ordered pieces as chat's ``(content, tool call entries)``."""
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, dict)]


# required: the call a max_tokens cut left open, ``{"name": "f", "arguments": <the rest>``
_CUT_CALL = re.compile(r'[\s\[,]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\Z', re.DOTALL)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def history_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant's ``tool_calls`` as chat templates read them: each call's ``function.arguments`` as the
    object its JSON text holds (transformers' and vLLM's convention: templates write it with ``tojson``).

    Raises ``ParamError`` naming the call when ``arguments`` is not the JSON text of an object.
    """
    out = dict(message)
    calls = []
    for j, call in enumerate(message.get("tool_calls") or ()):
        function = dict(call["function"])
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ParamError(
                f"tool_calls.{j}.function.arguments", "a tool call's arguments must be the JSON text of an object"
            )
        function["arguments"] = arguments
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    return out


__all__ = [
    "CLOSE",
    "MAX_TOOLS",
    "OPEN",
    "FunctionTool",
    "Piece",
    "Reply",
    "ToolCall",
    "ToolPlan",
    "ToolStream",
    "finish_reason",
    "history_has_tools",
    "history_message",
    "parse_tool_choice",
    "parse_tools",
    "renders_tools",
    "shipped_template",
    "template_for_tools",
]
