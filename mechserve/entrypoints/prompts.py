"""Prompts as users give them, turned into token ids: text, ids, vLLM-style dicts and conversations.

``EngineCore`` takes token ids; every front end (``LLM``, ``AsyncLLM``, the server, ``mechserve
generate``) turns what its user sent into ids here, once::

    "The capital of France is"                  -> tokenizer(text).input_ids
    Text("...", add_special_tokens=False)       -> the same, without the tokenizer's special tokens
    [791, 6593, 314, 4649, 314]                 -> the ids themselves
    {"prompt": ...} / {"prompt_token_ids": ...}  -> vLLM's dict prompts
    Chat([{"role": "user", "content": ...}])    -> the model's chat template, then its ids

Every problem is a ``ValueError`` naming it (a wrong type, text without a tokenizer, text that is
not valid Unicode, a model with no chat template, a template that cannot render the messages);
``ParamError`` when it is one field's fault (``prompt``, ``messages``, ``chat_template_kwargs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.api.errors import ParamError
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.tools import history_has_tools, template_for_tools

# apply_chat_template's own arguments, which chat_template_kwargs may not set.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "return_dict",
        "tools",
    }
)


@dataclass(frozen=True, slots=True)
class Text:
    """Text as a prompt; ``add_special_tokens``: whether the tokenizer adds its own (BOS, ...), as it does by default."""

    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation as a prompt: ``messages`` (``{"role", "content"}`` dicts) through the model's chat template.

    ``add_generation_prompt``: open the assistant's turn; ``continue_final_message``: leave the
    last message open, so the model continues it (not with ``add_generation_prompt``);
    ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``);
    ``add_special_tokens``: let the tokenizer add its special tokens to the templated text too
    (off: the template writes them); ``tools``: function tools for the template (OpenAI's shape,
    ``mechserve.entrypoints.tools``): with them, or with tool calls in the history, a template that
    renders no tools is replaced by the shipped tools template (ChatML) or refused, never used.
    """

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    chat_template: str | None = None
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] | None = None
    add_special_tokens: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None


Prompt = str | Sequence[int] | Mapping[str, Any]
PromptInput = Prompt | Text | Chat


def apply_chat_template(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    template: str | None,
    *,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The conversation as the model's prompt text (``tools``: function tools for the template).

    Raises ``ValueError`` if the tokenizer has no chat template, if the template cannot render
    the messages (its own ``raise_exception``, a Jinja error), and ``ParamError`` for
    ``continue_final_message`` with ``add_generation_prompt`` or ``template_kwargs`` that set one
    of ``apply_chat_template``'s own arguments.
    """
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
    if continue_final_message and add_generation_prompt:
        raise ParamError(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true (give add_generation_prompt: false)",
        )
    extra = dict(template_kwargs or {})
    clash = sorted(TEMPLATE_ARGUMENTS & extra.keys())
    if clash:
        raise ParamError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)}")
    kwargs: dict[str, Any] = {"chat_template": template} if template is not None else {}
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(
            list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs, **extra
        )
    except ValueError as exc:
        raise ParamError("messages", f"the chat template cannot render these messages: {exc}") from exc
    except Exception as exc:  # a template's own raise_exception, a Jinja error
        raise ParamError("messages", f"the chat template cannot render these messages: {exc}") from exc
    return str(text)


def encode_chat(tokenizer: Any, chat: Chat) -> tuple[str, list[int]]:
    """``(templated text, its ids)``: the template adds the special tokens, so by default the tokenizer adds none."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model was loaded without one")
    for i, message in enumerate(chat.messages):
        for key, value in message.items() if isinstance(message, Mapping) else ():
            check_unicode(value, f"messages[{i}].{key}", "messages")
    template = chat.chat_template
    if chat.tools or history_has_tools(chat.messages):
        own = template if template is not None else getattr(tokenizer, "chat_template", None)
        template = template_for_tools(own, "tools" if chat.tools else "messages") or template
    text = apply_chat_template(
        tokenizer,
        chat.messages,
        chat.add_generation_prompt,
        template,
        continue_final_message=chat.continue_final_message,
        template_kwargs=chat.template_kwargs,
        tools=chat.tools,
    )
    return text, list(tokenizer(text, add_special_tokens=chat.add_special_tokens).input_ids)


def parse_prompt(prompt: PromptInput, tokenizer: Any) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt; ``ValueError`` for a wrong type, text without a
    tokenizer, or text that is not valid Unicode (``ParamError`` naming ``prompt``)."""
    if isinstance(prompt, Chat):
        return encode_chat(tokenizer, prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return parse_prompt(str(prompt["prompt"]), tokenizer)
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        prompt = Text(prompt)
    if isinstance(prompt, Text):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model was loaded without one (give token ids)")
        check_unicode(prompt.text, "prompt")
        return prompt.text, list(tokenizer(prompt.text, add_special_tokens=prompt.add_special_tokens).input_ids)
    return None, _ids(prompt)


def tokenize(tokenizer: Any, prompt: str | Chat, add_special_tokens: bool | None = None) -> list[int]:
    """The ids the engine runs for a text or a conversation (as ``parse_prompt`` encodes them);
    ``add_special_tokens`` (default: True for text, the conversation's own setting, off, for a chat,
    whose template writes them) adds the tokenizer's special tokens (a BOS) on top.

    Raises ``ValueError`` without a tokenizer, for a conversation the template cannot render, and
    ``ParamError`` (a ``ValueError``) for text that is not valid Unicode (a lone UTF-16 surrogate
    such as ``"\\ud800"``).
    """
    if tokenizer is None:
        raise ValueError("tokenizing needs a tokenizer; this model was loaded without one")
    if isinstance(prompt, Chat):
        if add_special_tokens is not None:
            prompt = dataclasses.replace(prompt, add_special_tokens=add_special_tokens)
        return encode_chat(tokenizer, prompt)[1]
    check_unicode(prompt, "prompt")
    special = True if add_special_tokens is None else add_special_tokens
    return list(tokenizer(prompt, add_special_tokens=special).input_ids)


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Make ``template`` (Jinja text) the tokenizer's chat template, for every conversation after (vLLM's
    ``--chat-template``); ``ValueError`` without a tokenizer or if it cannot render a one-message chat."""
    if tokenizer is None:
        raise ValueError("a chat template needs a tokenizer; this model was loaded without one")
    apply_chat_template(tokenizer, [{"role": "user", "content": "hello"}], True, template)
    tokenizer.chat_template = template


def check_unicode(value: Any, where: str, param: str | None = None) -> None:
    """Raise ``ParamError`` (``param``, default ``where``) if a string in ``value`` (a string, or lists and
    dicts of them) is not valid Unicode: a lone UTF-16 surrogate, such as JSON's ``"\\ud800"`` or an
    undecodable byte in a command-line argument, cannot be encoded as UTF-8 or tokenized."""
    bad = unicode_problem(value)
    if bad is not None:
        raise ParamError(param or where, f"{where} is not valid Unicode: {bad}")


def unicode_problem(value: Any) -> str | None:
    """What is wrong with the first string in ``value`` that cannot be encoded as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = value[exc.start]
            return f"a lone surrogate {char.encode('unicode_escape').decode()} at character {exc.start}"
        return None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    for item in items:
        bad = unicode_problem(item)
        if bad is not None:
            return bad
    return None


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or many, as a list: a string, a list of ints or a dict is one prompt."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(_is_int(t) for t in items):
        return [items]
    return items


def params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt; ``ValueError`` for a list of another length, ``TypeError`` for
    anything that is not ``SamplingParams`` (a string is not a sequence of them)."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, (str, bytes, Mapping)) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {type(params).__name__}")
    found = list(params)
    wrong = next((p for p in found if not isinstance(p, SamplingParams)), None)
    if wrong is not None:
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got a {type(wrong).__name__} in it")
    if len(found) != count:
        raise ValueError(f"{len(found)} SamplingParams for {count} prompt(s); give one, or one per prompt")
    return found


def _ids(value: object) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not all(_is_int(t) for t in value):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(value).__name__}")
    return list(value)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = [
    "TEMPLATE_ARGUMENTS",
    "Chat",
    "Prompt",
    "PromptInput",
    "Text",
    "apply_chat_template",
    "check_unicode",
    "encode_chat",
    "params_list",
    "parse_prompt",
    "prompt_list",
    "set_chat_template",
    "tokenize",
    "unicode_problem",
]
