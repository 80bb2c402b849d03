"""Anthropic's Messages API request bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``), checked, and
their translation into a chat request.

What each field does is the field table's (``mechserve.http.fields``, endpoints ``messages`` and
``count_tokens``): the models below declare exactly its honoured fields; refused fields arrive as
extra keys and ``check_supported`` answers a non-neutral value with ``UnsupportedField`` naming it.
``to_chat`` turns a body into the ``ChatCompletionRequest`` the chat path runs::

    system                          a system message first (text blocks joined by newlines)
    messages                        user and assistant turns (consecutive turns of one role are one turn);
                                    text blocks joined by newlines; an assistant's tool_use blocks as its
                                    tool_calls (the input as JSON text); a user's tool_result blocks as tool
                                    messages answering them by tool_use_id, before the user's text; a last
                                    assistant turn is continued (continue_final_message)
    tools                           chat's function tools (input_schema is the parameters)
    tool_choice                     auto -> auto, any -> required, tool -> the named function, none -> none;
                                    disable_parallel_tool_use -> parallel_tool_calls false
    output_config.format            chat's response_format json_schema
    max_tokens, stop_sequences,     max_tokens, stop, temperature, top_p, top_k
      temperature, top_p, top_k
    chat_template                   chat's chat_template (mechserve's; refused unless the server trusts
                                    request templates)

Errors name this API's fields: ``ParamError`` / ``UnsupportedField`` raised here, and ``rename`` maps what
the chat path reports (``tools.0.function.parameters`` is ``tools.0.input_schema``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_NEW_TOKENS
from mechserve.entrypoints.tools import MAX_TOOLS
from mechserve.http.fields import COUNT_TOKENS, MESSAGES, refused_field
from mechserve.http.protocol import MAX_STOP, ChatCompletionRequest, UnsupportedField, _Body
from mechserve.http.unknown import Unknown, each, keys_outside

MEDIA_BLOCKS = ("image", "document", "search_result")
THINKING_BLOCKS = ("thinking", "redacted_thinking")
# The keys of the JSON objects read by hand, as the anthropic SDK's types have them (a test checks they agree).
# Besides those the translation reads, these are accepted and change nothing: ``cache_control`` (the prefix
# cache is automatic), a call's ``caller`` and ``toolset_name``, a tool's ``eager_input_streaming`` (a
# call's input streams as it is generated either way).
MESSAGE_KEYS = ("role", "content")
BLOCK_KEYS = {
    "text": ("type", "text", "cache_control", "citations"),
    "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
    "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
}
TOOL_KEYS = (
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
    "strict",
    "allowed_callers",
    "defer_loading",
    "eager_input_streaming",
    "input_examples",
)
TOOL_CHOICE_KEYS = ("type", "name", "disable_parallel_tool_use")


class CacheControl(_Body):
    """``{"type": "ephemeral", "ttl"}``: accepted (the prefix cache is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Metadata(_Body):
    user_id: str | None = None


class JsonOutputFormat(_Body):
    """``{"type": "json_schema", "schema"}``: the reply's text is JSON valid under ``schema``."""

    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class _AnthropicBody(_Body):
    """The fields ``/v1/messages`` and ``/v1/messages/count_tokens`` share."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    endpoint: ClassVar[str] = COUNT_TOKENS

    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None
    cache_control: CacheControl | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    chat_template: str | None = None  # vLLM's chat field (refused unless --trust-request-chat-template)

    def _unknown_keys(self, where: str) -> list[Unknown]:
        """The keys of the messages and their blocks (``MESSAGE_KEYS``, ``BLOCK_KEYS``), of the system blocks, of
        client tools (``TOOL_KEYS``) and of ``tool_choice``; blocks and tools of other types are refused by type
        when translated."""
        found: list[Unknown] = []
        for i, message in each(self.messages):
            found += keys_outside(message, MESSAGE_KEYS, f"{where}messages.{i}.")
            if isinstance(message, dict):
                found += _block_keys(message.get("content"), f"{where}messages.{i}.content.")
        found += _block_keys(self.system, f"{where}system.")
        for i, tool in each(self.tools):
            if isinstance(tool, dict) and tool.get("type") in (None, "custom"):
                found += keys_outside(tool, TOOL_KEYS, f"{where}tools.{i}.")
        return found + keys_outside(self.tool_choice, TOOL_CHOICE_KEYS, f"{where}tool_choice.")

    def check_supported(self) -> None:
        """Raises ``UnsupportedField`` for a refused field (the table's) or an honoured field's refused value."""
        extra = self.model_extra or {}
        row = refused_field(self.endpoint, {**extra, **self.model_dump(exclude_unset=True)}, list(extra))
        if row is not None:
            raise UnsupportedField(row.name, row.refusal())
        if self.output_config is not None and self.output_config.effort is not None:
            raise UnsupportedField(
                "output_config", "output_config.effort is not supported: the models served do not reason"
            )
        if self.output_format is not None and self.output_config is not None and self.output_config.format is not None:
            raise UnsupportedField(
                "output_format", "output_format and output_config.format both set the format; give one"
            )

    @property
    def format_field(self) -> str:
        """The field the output format came in (for errors)."""
        return "output_format" if self.output_format is not None else "output_config.format"

    def chat_messages(self) -> tuple[list[dict[str, Any]], bool]:
        """The system prompt and turns as chat messages, and whether the last turn is the assistant's (prefill)."""
        out: list[dict[str, Any]] = []
        system = system_text(self.system)
        if system is not None:
            out.append({"role": "system", "content": system})
        turns = anthropic_turns(self.messages)
        prefill = bool(turns) and turns[-1]["role"] == "assistant"
        if prefill and turns[-1].get("tool_calls"):
            raise ParamError(
                f"messages.{len(self.messages) - 1}",
                "the last message is an assistant's tool_use: answer it with a user message of tool_result blocks",
            )
        return out + turns, prefill

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        return [chat_tool(tool, f"tools.{i}") for i, tool in enumerate(self.tools)]

    def chat_tool_choice(self) -> tuple[str | dict[str, Any] | None, bool | None]:
        """``tool_choice`` as chat's ``tool_choice`` and ``parallel_tool_calls``."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        kind = choice.get("type")
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise ParamError(
                "tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use must be a boolean"
            )
        single = None if parallel is None else not parallel
        if kind in ("any", "tool") and not self.tools:
            raise ParamError("tool_choice", f"tool_choice {{type: {kind}}} needs tools")
        if kind == "auto":
            return "auto", single
        if kind == "any":
            return "required", single
        if kind == "none":
            return "none", None
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str):
                raise ParamError("tool_choice.name", "tool_choice {type: tool} needs the tool's name")
            return {"type": "function", "function": {"name": name}}, single
        raise ParamError("tool_choice", f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}")

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.output_format or (self.output_config.format if self.output_config is not None else None)
        if fmt is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}

    def sampling(self) -> dict[str, Any]:
        """The chat fields of sampling (none for a token count)."""
        return {}

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this body is; ``ParamError`` / ``UnsupportedField`` naming this API's field."""
        self.check_supported()
        messages, prefill = self.chat_messages()
        choice, parallel = self.chat_tool_choice()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": self.chat_tools(),
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "response_format": self.response_format(),
            "add_generation_prompt": False if prefill else None,
            "continue_final_message": True if prefill else None,
            "chat_template": self.chat_template,
            **self.sampling(),
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ParamError("messages", f"messages: the conversation is not valid ({where}: {first['msg']})") from None

    def rename(self, param: str | None, message: str) -> tuple[str | None, str]:
        """A chat path error's field and message in this API's names."""
        names = (
            ("max_completion_tokens", "max_tokens"),
            ("response_format", self.format_field),
            ("stop", "stop_sequences"),
        )

        def ours(text: str) -> str:
            text = re.sub(r"\btools\.(\d+)\.function\.parameters\b", r"tools.\1.input_schema", text)
            text = re.sub(r"\btools\.(\d+)\.function\.", r"tools.\1.", text)
            for chat, name in names:
                text = re.sub(rf"(?<![\w.]){re.escape(chat)}\b", name, text)
            return text

        return (None if param is None else ours(param)), ours(message)


class CountTokensRequest(_AnthropicBody):
    """``POST /v1/messages/count_tokens``: the prompt tokens of a Messages body (without its sampling fields)."""

    endpoint: ClassVar[str] = COUNT_TOKENS


class MessagesRequest(_AnthropicBody):
    """``POST /v1/messages``: one conversation answered once, through the chat path."""

    endpoint: ClassVar[str] = MESSAGES

    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None

    def sampling(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }


def _block_keys(blocks: Any, where: str) -> list[Unknown]:
    """The unknown keys of content blocks (``BLOCK_KEYS``; a tool_result's text blocks too)."""
    found: list[Unknown] = []
    for j, block in each(blocks):
        if not isinstance(block, dict) or block.get("type") not in BLOCK_KEYS:
            continue  # not a block, or a block of another type: refused by its type
        found += keys_outside(block, BLOCK_KEYS[block["type"]], f"{where}{j}.")
        if block["type"] == "tool_result":
            found += _block_keys(block.get("content"), f"{where}{j}.content.")
    return found


def system_text(system: str | Sequence[Any] | None) -> str | None:
    """The system prompt: a string, or text blocks joined by newlines; ``ParamError`` naming another block."""
    if system is None or isinstance(system, str):
        return system
    return "\n".join(_text(block, f"system.{j}") for j, block in enumerate(system))


def anthropic_turns(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages (see the module's table); ``ParamError`` naming ``messages.N...``."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, Mapping):
            raise ParamError(where, f"{where} must be an object with role and content")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ParamError(f"{where}.role", f"{where}.role must be 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ParamError(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, at))
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(block, at))
            else:
                texts.append(_text(block, at))
        out += results
        text = "\n".join(texts)
        if not texts and not calls:
            continue
        last = out[-1] if out else None
        if last is not None and last["role"] == role and not results and not last.get("tool_calls"):
            last["content"] = "\n".join(t for t in (last["content"] or "", text) if t)  # one turn, as Anthropic's
            if calls:
                last["tool_calls"] = calls
            continue
        turn: dict[str, Any] = {"role": role, "content": text if texts or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _text(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind == "text" and isinstance(block.get("text"), str):
        if block.get("citations"):
            raise ParamError(f"{where}.citations", f"{where}.citations are not supported (no documents)")
        return str(block["text"])
    if kind in MEDIA_BLOCKS:
        raise ParamError(f"{where}.type", f"{where}: {kind} blocks are not supported: the models served read text only")
    if kind in THINKING_BLOCKS:
        raise ParamError(
            f"{where}.type", f"{where}: {kind} blocks are not supported: extended thinking (the models do not reason)"
        )
    if kind in ("tool_use", "tool_result"):
        side = "an assistant" if kind == "tool_use" else "a user"
        raise ParamError(f"{where}.type", f"{where}: a {kind} block belongs to {side} message")
    if isinstance(kind, str):
        raise ParamError(
            f"{where}.type",
            f"{where}: {kind} blocks are not supported (text, tool_use and tool_result are; no server tools)",
        )
    raise ParamError(where, f"{where} must be a content block ({{'type': 'text', 'text': ...}}), got {str(block)[:80]}")


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise ParamError(f"{where}.{key}", f"{where}.{key} must be a non-empty string")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise ParamError(f"{where}.input", f"{where}.input must be an object")
    caller = block.get("caller")
    if caller is not None and not (isinstance(caller, Mapping) and caller.get("type") == "direct"):
        raise ParamError(f"{where}.caller", f"{where}.caller: programmatic tool calls are not supported")
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": text}}


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise ParamError(f"{where}.tool_use_id", f"{where}.tool_use_id must name the tool_use it answers")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text(part, f"{where}.content.{k}") for k, part in enumerate(content))
    if not isinstance(content, str):
        raise ParamError(f"{where}.content", f"{where}.content must be a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise ParamError(f"{where}.is_error", f"{where}.is_error must be a boolean")
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {content}" if is_error else content}


def chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """An Anthropic client tool (``name``, ``description``, ``input_schema``) in chat's shape; ``ParamError``
    naming ``where`` for a server or Anthropic-defined tool."""
    if not isinstance(tool, Mapping):
        raise ParamError(where, f"{where} must be an object, got {type(tool).__name__}")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise ParamError(
            f"{where}.type",
            f"{where}.type {kind!r} is not supported: only client tools (name, description, input_schema); there "
            "are no server or Anthropic-defined tools",
        )
    if "input_schema" not in tool:
        raise ParamError(f"{where}.input_schema", f"{where}.input_schema is required")
    if tool.get("defer_loading"):
        raise ParamError(f"{where}.defer_loading", f"{where}.defer_loading is not supported (no tool search)")
    if tool.get("allowed_callers") not in (None, ["direct"]):
        raise ParamError(f"{where}.allowed_callers", f"{where}.allowed_callers: only direct calls are supported")
    if tool.get("input_examples"):
        raise ParamError(
            f"{where}.input_examples", f"{where}.input_examples is not supported (the template shows no examples)"
        )
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    for key in ("description", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


__all__ = ["CountTokensRequest", "MessagesRequest", "anthropic_turns", "chat_tool", "system_text"]
