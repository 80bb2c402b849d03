"""OpenAI's Responses API request body (``POST /v1/responses``), checked, and its translation into a chat request.

What each field does is the field table's (``mechserve.http.fields``, endpoint ``responses``): the model
below declares exactly its honoured fields; refused fields arrive as extra keys and ``check_supported``
answers a non-neutral value with ``UnsupportedField`` naming it.  ``to_chat`` turns the body (and the
conversation of the response it continues) into the ``ChatCompletionRequest`` the chat path runs::

    instructions                      a system message first (a continued response's are not carried over)
    input: "text"                     one user message
    input: [items]                    messages (roles user, system, developer as system, assistant; text
                                      parts), function_call items as an assistant's tool_calls (one
                                      assistant message for a run of them), function_call_output items as
                                      tool messages answering them by call_id
    previous_response_id              that response's input and output before this input
    tools, tool_choice,               chat's function tools and tool_choice (``{"type": "function",
      parallel_tool_calls               "name"}`` names one), rendered and parsed as chat does
    text.format                       chat's response_format (``json_schema``'s name/schema/strict are flat here)
    max_output_tokens                 max_completion_tokens (unset: as many as fit)
    include message.output_text.logprobs, top_logprobs
                                      chat's logprobs and top_logprobs
    chat_template                     chat's chat_template (refused unless the server trusts request templates)

Errors name this API's fields: ``ParamError`` / ``UnsupportedField`` raised here, and ``RESPONSES_NAMES``
renames what the chat path reports (``response_format`` is ``text.format``, ``messages`` is ``input``,
``tools.0.function.name`` is ``tools.0.name``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_LOGPROBS, MAX_NEW_TOKENS
from mechserve.entrypoints.tools import MAX_TOOLS
from mechserve.http.fields import RESPONSES, refused_field
from mechserve.http.protocol import INT64, MAX_STOP, ChatCompletionRequest, UnsupportedField, _Body
from mechserve.http.unknown import Unknown, each, keys_outside

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
TOOL_CHOICES = ("none", "auto", "required")
# What the chat path names, and the Responses field it is (applied in order, to params and messages).
RESPONSES_NAMES: tuple[tuple[str, str], ...] = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("top_logprobs", "top_logprobs"),
    ("messages", "input"),
)
# Input content parts that carry text; the rest (images, files, audio) are refused by name.
TEXT_PARTS = ("input_text", "output_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
# The keys of the JSON objects read by hand, as the openai SDK's types have them (a test checks they agree).
# Besides those the translation reads, these are accepted and change nothing: an item's ``id``, ``status``
# and ``phase`` and an output_text's ``annotations`` and ``logprobs`` (what an earlier response returned),
# a call's ``namespace``, an output's ``name``, a text part's ``prompt_cache_breakpoint`` (the prefix cache
# is automatic).
ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status", "phase"),
    "function_call": ("type", "call_id", "name", "arguments", "id", "status", "caller", "namespace", "async"),
    "function_call_output": ("type", "call_id", "output", "id", "status", "caller", "name", "namespace"),
}
PART_KEYS = {
    "input_text": ("type", "text", "prompt_cache_breakpoint"),
    "output_text": ("type", "text", "annotations", "logprobs"),
}
TOOL_KEYS = (
    "type",
    "name",
    "description",
    "parameters",
    "strict",
    "defer_loading",
    "async",
    "allowed_callers",
    "output_schema",
)


class TextFormat(_Body):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``description``,
    ``strict`` side by side, unlike chat's ``response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    """``text``: the output's ``format``; ``verbosity`` is refused beyond ``medium`` (the models served have none)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(_Body):
    include_obfuscation: bool | None = None


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)
]


class ResponsesRequest(_Body):
    """``POST /v1/responses``: one conversation (``input`` after ``instructions`` and the response it continues)
    answered once, through the chat path."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    endpoint: ClassVar[str] = RESPONSES

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extensions (its ResponsesRequest's sampling fields)
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    # vLLM's chat field, on every API translated into chat (refused unless --trust-request-chat-template)
    chat_template: str | None = None

    def _unknown_keys(self, where: str) -> list[Unknown]:
        """The keys of the input items and their text parts (``ITEM_KEYS``, ``PART_KEYS``), of function tools
        (``TOOL_KEYS``) and of a named ``tool_choice``; items, parts and tools of other types are refused by
        type when translated."""
        found: list[Unknown] = []
        for i, item in each(self.input):
            at = f"{where}input.{i}."
            kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
            if kind not in ITEM_KEYS or not isinstance(item, dict):
                continue
            found += keys_outside(item, ITEM_KEYS[kind], at)
            parts = item.get("output") if kind == "function_call_output" else item.get("content")
            field = "output" if kind == "function_call_output" else "content"
            found += _part_keys(parts, f"{at}{field}.")
        for i, tool in each(self.tools):
            if isinstance(tool, dict) and tool.get("type") == "function":
                found += keys_outside(tool, TOOL_KEYS, f"{where}tools.{i}.")
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            found += keys_outside(choice, ("type", "name"), f"{where}tool_choice.")
        return found

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        return value

    def check_supported(self) -> None:
        """Raises ``UnsupportedField`` for a refused field (the table's) or an honoured field's refused value."""
        extra = self.model_extra or {}
        row = refused_field(self.endpoint, {**extra, **self.model_dump(exclude_unset=True)}, list(extra))
        if row is not None:
            raise UnsupportedField(row.name, row.refusal())
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise UnsupportedField(
                "stream_options", "stream_options.include_obfuscation true is not supported: no obfuscation is sent"
            )
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise UnsupportedField("text", f"text.verbosity {self.text.verbosity!r} is not supported (only 'medium')")
        if self.truncation == "auto":
            raise UnsupportedField(
                "truncation",
                "truncation 'auto' is not supported: no item of the conversation is dropped; a conversation "
                "longer than the context is a 400 (truncation 'disabled')",
            )
        for value in self.include or ():
            if value != LOGPROBS_INCLUDE:
                raise UnsupportedField(
                    "include",
                    f"include {value!r} is not supported (only {LOGPROBS_INCLUDE!r}: there are no built-in tools)",
                )
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedField("top_logprobs", f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
        if self.background and self.stream:
            raise UnsupportedField("background", "background with stream is not supported: stream, or poll GET")
        if self.background and self.store is False:
            raise UnsupportedField("background", "background needs store (a background response is fetched by id)")
        if self.input is None and self.previous_response_id is None:
            raise ParamError("input", "input is required (a string or a list of input items)")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def stored(self) -> bool:
        """Whether the response is kept for ``GET`` and ``previous_response_id`` (``store``, default true)."""
        return self.store is not False

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (``instructions`` not included); ``ParamError`` naming the item's part."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_messages(self.input)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` in chat's shape; ``ParamError`` naming ``tools.N...`` for a built-in tool or an unsupported
        option."""
        if self.tools is None:
            return None
        return [chat_tool(tool, f"tools.{i}") for i, tool in enumerate(self.tools)]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """``tool_choice`` in chat's shape; ``ParamError("tool_choice")`` for a choice with no chat equivalent."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            if isinstance(choice, str) and choice not in TOOL_CHOICES:
                raise ParamError(
                    "tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}"
                )
            return choice
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        if kind == "allowed_tools":
            raise ParamError(
                "tool_choice", "tool_choice 'allowed_tools' is not supported: give the tools to allow as tools"
            )
        raise ParamError(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}; '
            f"{json.dumps(choice)[:80]} is not supported (there are no built-in, MCP or custom tools)",
        )

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise ParamError("text.format", 'text.format of type "json_schema" needs schema')
        spec = {
            "name": fmt.name or "response",
            "schema": fmt.schema_,
            "description": fmt.description,
            "strict": fmt.strict,
        }
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def to_chat(self, history: Sequence[Mapping[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat request this body is: ``history`` (the continued response's conversation, instructions left
        out), then ``input``, after ``instructions``.  Raises ``ParamError`` / ``UnsupportedField`` naming this
        API's field."""
        self.check_supported()
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        messages += [dict(m) for m in history]
        messages += self.input_messages()
        if not messages:
            raise ParamError("input", "the conversation is empty: give input")
        if self.logprobs and self.tools and self.tool_choice != "none":
            raise UnsupportedField("include", f"include {LOGPROBS_INCLUDE!r} together with tools is not supported yet")
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "logprobs": True if self.logprobs else None,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "chat_template": self.chat_template,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ParamError("input", f"input: the conversation is not valid ({where}: {first['msg']})") from None


def _part_keys(parts: Any, where: str) -> list[Unknown]:
    found: list[Unknown] = []
    for j, part in each(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in PART_KEYS:
            found += keys_outside(part, PART_KEYS[kind], f"{where}{j}.")
    return found


def input_messages(items: Sequence[Any]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages, a run of ``function_call`` items as one assistant
    message with ``tool_calls`` (after the assistant's text, if it came just before), ``function_call_output``
    items as tool messages.  Raises ``ParamError`` naming ``input.N`` (and the part) for anything else."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, Mapping):
            raise ParamError(where, f"{where} must be an input item (an object), got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant":  # the same turn as the assistant's text or calls before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_call_output(item, where))
        elif kind == "item_reference":
            raise ParamError(f"{where}.type", f"{where}: item_reference is not supported: give the item itself")
        elif kind == "reasoning":
            raise ParamError(
                f"{where}.type", f"{where}: reasoning items are not supported: the models served do not reason"
            )
        else:
            raise ParamError(
                f"{where}.type",
                f"{where}: input items of type {kind!r} are not supported (messages, function_call and "
                "function_call_output are; there are no built-in tools)",
            )
    return out


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ParamError(
            f"{where}.role", f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}"
        )
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_text_part(part, f"{where}.content.{j}") for j, part in enumerate(content))
    else:
        raise ParamError(f"{where}.content", f"{where}.content must be a string or a list of content parts")
    return {"role": "system" if role == "developer" else role, "content": text}


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind in MEDIA_PARTS:
        raise ParamError(f"{where}.type", f"{where}: {kind} is not supported: the models served read text only")
    if kind == "refusal":
        raise ParamError(
            f"{where}.type", f"{where}: an assistant's refusal part is not supported: give it as output_text"
        )
    raise ParamError(
        where, f"{where} must be a text part ({{'type': 'input_text', 'text': ...}}), got {str(part)[:80]}"
    )


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise ParamError(f"{where}.{key}", f"{where}.{key} must be a non-empty string")
    try:
        arguments = json.loads(item["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ParamError(f"{where}.arguments", f"{where}.arguments must be the JSON text of an object")
    caller = item.get("caller")
    if caller is not None and not (isinstance(caller, Mapping) and caller.get("type") == "direct"):
        raise ParamError(f"{where}.caller", f"{where}.caller: programmatic tool calls are not supported")
    if item.get("async"):
        raise ParamError(f"{where}.async", f"{where}.async is not supported (no asynchronous tool calls)")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _function_call_output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ParamError(f"{where}.call_id", f"{where}.call_id must name the call it answers")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_text_part(p, f"{where}.output.{j}") for j, p in enumerate(output))
    if not isinstance(output, str):
        raise ParamError(f"{where}.output", f"{where}.output must be a string or a list of text parts")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """A Responses function tool (``{"type": "function", "name", "description", "parameters", "strict"}``) in chat's
    shape; ``ParamError`` naming ``where`` for a built-in tool or an option with no meaning here."""
    if not isinstance(tool, Mapping):
        raise ParamError(where, f"{where} must be an object, got {type(tool).__name__}")
    kind = tool.get("type")
    if kind != "function":
        raise ParamError(
            f"{where}.type",
            f"{where}.type {kind!r} is not supported: only function tools (there are no built-in tools such as "
            "web_search, file_search or computer, no MCP and no custom tools)",
        )
    if tool.get("defer_loading"):
        raise ParamError(f"{where}.defer_loading", f"{where}.defer_loading is not supported (no tool search)")
    if tool.get("async"):
        raise ParamError(f"{where}.async", f"{where}.async is not supported")
    if tool.get("allowed_callers") not in (None, ["direct"]):
        raise ParamError(f"{where}.allowed_callers", f"{where}.allowed_callers: only direct calls are supported")
    if tool.get("output_schema") is not None:
        raise ParamError(
            f"{where}.output_schema", f"{where}.output_schema is not supported (the template shows no outputs)"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def rename(param: str | None, message: str) -> tuple[str | None, str]:
    """A chat path error's field and message in the Responses API's names (``RESPONSES_NAMES``; chat's
    ``tools.N.function.x`` is ``tools.N.x``)."""

    def responses_name(text: str) -> str:
        text = re.sub(r"\btools\.(\d+)\.function\.", r"tools.\1.", text)
        for chat, ours in RESPONSES_NAMES:
            text = re.sub(rf"\b{re.escape(chat)}\b", ours, text)
        return text

    return (None if param is None else responses_name(param)), responses_name(message)


__all__ = [
    "LOGPROBS_INCLUDE",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "chat_tool",
    "input_messages",
    "rename",
]
