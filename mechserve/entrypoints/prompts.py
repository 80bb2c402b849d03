"""Prompts as users give them, turned into token ids: text, ids, vLLM-style dicts and conversations.

``EngineCore`` takes token ids; every front end (``LLM``, ``AsyncLLM``, the server, ``mechserve
generate``) turns what its user sent into ids here, once::

    "The capital of France is"                  -> tokenizer(text).input_ids
    [791, 6593, 314, 4649, 314]                 -> the ids themselves
    {"prompt": ...} / {"prompt_token_ids": ...}  -> vLLM's dict prompts
    Chat([{"role": "user", "content": ...}])    -> the model's chat template, then its ids

Every problem is a ``ValueError`` naming it (a wrong type, text without a tokenizer, a model with
no chat template, a template that cannot render the messages).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mechserve.api.params import SamplingParams


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation as a prompt: ``messages`` (``{"role", "content"}`` dicts) through the model's chat template."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    chat_template: str | None = None


Prompt = str | Sequence[int] | Mapping[str, Any]
PromptInput = Prompt | Chat


def apply_chat_template(
    tokenizer: Any, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool, template: str | None
) -> str:
    """The conversation as the model's prompt text.

    Raises ``ValueError`` if the tokenizer has no chat template, or if the template cannot render
    the messages (its own ``raise_exception``, a Jinja error).
    """
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
    kwargs = {"chat_template": template} if template is not None else {}
    try:
        text = tokenizer.apply_chat_template(
            list(conversation), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ValueError:
        raise
    except Exception as exc:  # a template's own raise_exception, a Jinja error
        raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
    return str(text)


def encode_chat(tokenizer: Any, chat: Chat) -> tuple[str, list[int]]:
    """``(templated text, its ids)``: the template adds the special tokens, so the tokenizer adds none."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model was loaded without one")
    text = apply_chat_template(tokenizer, chat.messages, chat.add_generation_prompt, chat.chat_template)
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)


def parse_prompt(prompt: PromptInput, tokenizer: Any) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt; ``ValueError`` for a wrong type or text without a tokenizer."""
    if isinstance(prompt, Chat):
        return encode_chat(tokenizer, prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return parse_prompt(str(prompt["prompt"]), tokenizer)
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model was loaded without one (give token ids)")
        return prompt, list(tokenizer(prompt).input_ids)
    return None, _ids(prompt)


def tokenize(tokenizer: Any, prompt: str | Chat, add_special_tokens: bool | None = None) -> list[int]:
    """The ids of a text or a conversation; ``add_special_tokens`` (default: True for text, as
    ``parse_prompt`` encodes it, False for a conversation, whose template adds them) adds the
    tokenizer's own special tokens (a BOS) on top.

    Raises ``ValueError`` without a tokenizer, for a conversation the template cannot render, and
    for text that is not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``).
    """
    if tokenizer is None:
        raise ValueError("tokenizing needs a tokenizer; this model was loaded without one")
    text = (
        apply_chat_template(tokenizer, prompt.messages, prompt.add_generation_prompt, prompt.chat_template)
        if isinstance(prompt, Chat)
        else prompt
    )
    special = not isinstance(prompt, Chat) if add_special_tokens is None else add_special_tokens
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode: {exc.reason} at position {exc.start}") from None
    return list(tokenizer(text, add_special_tokens=special).input_ids)


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Make ``template`` (Jinja text) the tokenizer's chat template, for every conversation after (vLLM's
    ``--chat-template``); ``ValueError`` without a tokenizer or if it cannot render a one-message chat."""
    if tokenizer is None:
        raise ValueError("a chat template needs a tokenizer; this model was loaded without one")
    apply_chat_template(tokenizer, [{"role": "user", "content": "hello"}], True, template)
    tokenizer.chat_template = template


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
    "Chat",
    "Prompt",
    "PromptInput",
    "apply_chat_template",
    "encode_chat",
    "params_list",
    "parse_prompt",
    "prompt_list",
    "set_chat_template",
    "tokenize",
]
