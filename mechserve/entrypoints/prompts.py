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

A ``PromptPolicy`` says how far the caller is trusted (an ``LLM`` trusts its caller; the server does
not): whether a conversation may bring its own chat template (``"refuse"``; ``"sandbox"``: rendered
in a ``TemplateSandbox`` child process with a time, memory and output bound; ``"trust"``), the
longest text it may send (checked before anything is tokenized), and whether special-token strings
in message content become special ids.  By default they do not: ``"hi<|im_end|>\n<|im_start|>system"``
in a user's content is encoded as the text it is, so no message can forge a turn; the template's
own special tokens are unaffected (``encode_chat``).  vLLM and llama-server parse them (both
tokenize the rendered prompt with special-token parsing on); ``special_tokens_in_content=True``
restores that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import copy
from dataclasses import dataclass
from typing import Any, Protocol

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

REQUEST_TEMPLATES = ("trust", "sandbox", "refuse")


@dataclass(frozen=True, slots=True)
class PromptPolicy:
    """How far the sender of a prompt is trusted.

    ``request_templates``: what a ``Chat`` with its own ``chat_template`` gets: ``"trust"`` (rendered
    like the model's, the default of ``LLM``), ``"sandbox"`` (rendered in a ``TemplateSandbox``: a
    time, memory and output bound; the server with ``--trust-request-chat-template``) or
    ``"refuse"`` (``ParamError("chat_template")``; the server's default, as vLLM's).
    ``special_tokens_in_content``: special-token strings in message content (and tools, template
    variables) become special ids, as in vLLM and llama-server; by default they stay text.
    ``max_prompt_chars``: the longest prompt text, or rendered conversation, in characters; a longer
    one is a ``ParamError`` before any tokenization (None: no limit).  ``ValueError`` for a bad value.
    """

    request_templates: str = "trust"
    special_tokens_in_content: bool = False
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        if self.request_templates not in REQUEST_TEMPLATES:
            raise ValueError(f"request_templates must be one of {REQUEST_TEMPLATES}, got {self.request_templates!r}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or None, got {self.max_prompt_chars}")


TRUSTED = PromptPolicy()
TRUST_FLAG = "--trust-request-chat-template"


class Renderer(Protocol):
    """Renders a chat template outside the process (``mechserve.entrypoints.sandbox.TemplateSandbox``)."""

    def render(
        self,
        conversation: Sequence[Mapping[str, Any]],
        template: str,
        variables: Mapping[str, Any],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str: ...


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


def encode_chat(
    tokenizer: Any, chat: Chat, policy: PromptPolicy = TRUSTED, sandbox: Renderer | None = None
) -> tuple[str, list[int]]:
    """``(templated text, its ids)``: the template adds the special tokens, so by default the tokenizer adds none.

    ``policy`` (``PromptPolicy``) decides whether ``chat.chat_template`` may be used and how (``sandbox``
    renders it when the policy says ``"sandbox"``), the longest text, and whether special-token
    strings in the messages become special ids (by default they are encoded as text).  Raises
    ``ParamError`` naming ``chat_template`` (refused, or its render failed a bound), ``messages``
    (too long, not renderable) and what ``apply_chat_template`` raises."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model was loaded without one")
    for i, message in enumerate(chat.messages):
        for key, value in message.items() if isinstance(message, Mapping) else ():
            check_unicode(value, f"messages[{i}].{key}", "messages")
    limit = policy.max_prompt_chars
    if limit is not None:
        check_length(_chars(chat.messages) + _chars(chat.tools), limit, "messages", "the messages")
    own = chat.chat_template
    if own is not None and policy.request_templates == "refuse":
        raise ParamError(
            "chat_template",
            f"chat_template: this server does not render chat templates sent with a request (the operator can "
            f"allow it with {TRUST_FLAG}); leave it out to use the model's template",
        )
    template = own
    if chat.tools or history_has_tools(chat.messages):
        model_template = template if template is not None else getattr(tokenizer, "chat_template", None)
        template = template_for_tools(model_template, "tools" if chat.tools else "messages") or template
    sandboxed = own is not None and template == own and policy.request_templates == "sandbox"
    if sandboxed and sandbox is None:
        raise ValueError("a sandboxed chat template needs a TemplateSandbox")

    def render(messages: Sequence[Mapping[str, Any]], tools: Any, kwargs: Mapping[str, Any] | None) -> str:
        if sandboxed:
            assert sandbox is not None and template is not None
            return sandbox.render(
                messages,
                template,
                {**template_variables(tokenizer), **(kwargs or {})},
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tools=tools,
            )
        return apply_chat_template(
            tokenizer,
            messages,
            chat.add_generation_prompt,
            template,
            continue_final_message=chat.continue_final_message,
            template_kwargs=kwargs,
            tools=tools,
        )

    text = render(chat.messages, chat.tools, chat.template_kwargs)
    if limit is not None:
        check_length(len(text), limit, "messages", "the templated conversation")
    ids = list(tokenizer(text, add_special_tokens=chat.add_special_tokens).input_ids)
    if not policy.special_tokens_in_content:
        ids = _content_as_text(tokenizer, text, ids, chat, render)
    return text, ids


def template_variables(tokenizer: Any) -> dict[str, Any]:
    """What ``apply_chat_template`` gives every template besides the messages: the special tokens' strings."""
    return {k: v for k, v in dict(getattr(tokenizer, "special_tokens_map", {}) or {}).items() if isinstance(v, str)}


def check_length(chars: int, limit: int, param: str, what: str) -> None:
    """``ParamError(param)`` when ``chars`` is over ``limit``: no longer text can fit the model's context."""
    if chars > limit:
        raise ParamError(
            param,
            f"{what}: {chars} characters; this server takes at most {limit} (no longer text fits the model's "
            "context: its longest token times max_model_len)",
        )


def _chars(value: Any) -> int:
    """How many characters the strings in ``value`` (strings, lists and dicts of them) hold together."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_chars(v) for v in value)
    return 0


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _masked(value: Any, specials: Sequence[str], fill: str) -> Any:
    """``value`` with every special-token string in its strings replaced by ``fill`` characters of its length."""
    if isinstance(value, str):
        for s in specials:
            if s in value:
                value = value.replace(s, fill * len(s))
        return value
    if isinstance(value, Mapping):
        return {k: _masked(v, specials, fill) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(v, specials, fill) for v in value]
    return value


def _content_as_text(
    tokenizer: Any,
    text: str,
    ids: list[int],
    chat: Chat,
    render: Callable[[Sequence[Mapping[str, Any]], Any, Mapping[str, Any] | None], str],
) -> list[int]:
    """``ids`` with every special token that came from the caller's strings (messages, tools, template
    variables) replaced by the ids of its text.

    The tokenizer splits the text at special tokens before anything else, so the ids around one are
    those of the text before and after it either way: swapping the special's id for the ids of its
    string (encoded with special tokens off) changes nothing else.  Which occurrences are the caller's:
    the conversation is rendered once more with those strings masked (same length, no special token);
    the two texts differ exactly there.  When the template changes the masked strings' length (an
    escaping filter), the two cannot be lined up: ``ParamError("messages")``, never a silent forge.
    """
    text_ids = special_text_ids(tokenizer)
    if not text_ids:
        return ids
    specials = sorted({s for s, _ in text_ids.values()}, key=len, reverse=True)
    data = (chat.messages, chat.tools, chat.template_kwargs)
    if not any(s in u for u in _strings(data) for s in specials):
        return ids  # the common case: nothing to tell apart
    fill = next(c for c in "x#~@" if all(c not in s for s in specials))
    masked = render(
        _masked(chat.messages, specials, fill),
        _masked(chat.tools, specials, fill),
        _masked(chat.template_kwargs, specials, fill),
    )
    found = [s for s in specials if s in text]
    if len(masked) != len(text):
        raise ParamError(
            "messages",
            f"the messages hold special-token text ({', '.join(found[:3])}) that this chat template changes, so it "
            "cannot be kept apart from the template's own tokens; remove it",
        )
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    shift = len(ids) - len(offsets)  # a BOS the tokenizer added in front
    out: list[int] = ids[:shift]
    for token, (start, end) in zip(ids[shift:], offsets):
        entry = text_ids.get(token)
        if entry is not None and end > start and masked[start:end] != text[start:end]:
            out += entry[1]
        else:
            out.append(token)
    return out


_TEXT_IDS: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, list[int]]]] = weakref.WeakKeyDictionary()
_TEXT_IDS_LOCK = threading.Lock()


def special_text_ids(tokenizer: Any) -> dict[int, tuple[str, list[int]]]:
    """``{special id: (its string, the ids of that string as text)}`` for the tokenizer's special added tokens
    (a fast tokenizer's backend copy with ``encode_special_tokens`` on; computed once per tokenizer)."""
    with _TEXT_IDS_LOCK:
        try:
            cached = _TEXT_IDS.get(tokenizer)
        except TypeError:  # not weak-referenceable
            cached = None
        if cached is not None:
            return cached
        found: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        if backend is not None:
            plain = copy(backend)
            plain.no_padding()
            plain.no_truncation()
            plain.encode_special_tokens = True
            for token_id, token in added.items():
                content = getattr(token, "content", None)
                if getattr(token, "special", False) and content:
                    text_ids = list(plain.encode(content, add_special_tokens=False).ids)
                    if text_ids and token_id not in text_ids:
                        found[int(token_id)] = (content, text_ids)
        with contextlib.suppress(TypeError):
            _TEXT_IDS[tokenizer] = found
        return found


def parse_prompt(
    prompt: PromptInput, tokenizer: Any, policy: PromptPolicy = TRUSTED, sandbox: Renderer | None = None
) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt; ``ValueError`` for a wrong type, text without a
    tokenizer, or text that is not valid Unicode (``ParamError`` naming ``prompt``); ``policy`` and
    ``sandbox`` as for ``encode_chat`` (text over ``policy.max_prompt_chars`` is a ``ParamError``)."""
    if isinstance(prompt, Chat):
        return encode_chat(tokenizer, prompt, policy, sandbox)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return parse_prompt(str(prompt["prompt"]), tokenizer, policy, sandbox)
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        prompt = Text(prompt)
    if isinstance(prompt, Text):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model was loaded without one (give token ids)")
        check_unicode(prompt.text, "prompt")
        if policy.max_prompt_chars is not None:
            check_length(len(prompt.text), policy.max_prompt_chars, "prompt", "the prompt")
        return prompt.text, list(tokenizer(prompt.text, add_special_tokens=prompt.add_special_tokens).input_ids)
    return None, _ids(prompt)


def tokenize(
    tokenizer: Any,
    prompt: str | Chat,
    add_special_tokens: bool | None = None,
    policy: PromptPolicy = TRUSTED,
    sandbox: Renderer | None = None,
) -> list[int]:
    """The ids the engine runs for a text or a conversation (as ``parse_prompt`` encodes them);
    ``add_special_tokens`` (default: True for text, the conversation's own setting, off, for a chat,
    whose template writes them) adds the tokenizer's special tokens (a BOS) on top.

    Raises ``ValueError`` without a tokenizer, for a conversation the template cannot render, and
    ``ParamError`` (a ``ValueError``) for text that is not valid Unicode (a lone UTF-16 surrogate
    such as ``"\\ud800"``) or longer than ``policy.max_prompt_chars``.
    """
    if tokenizer is None:
        raise ValueError("tokenizing needs a tokenizer; this model was loaded without one")
    if isinstance(prompt, Chat):
        if add_special_tokens is not None:
            prompt = dataclasses.replace(prompt, add_special_tokens=add_special_tokens)
        return encode_chat(tokenizer, prompt, policy, sandbox)[1]
    special = True if add_special_tokens is None else add_special_tokens
    return parse_prompt(Text(prompt, special), tokenizer, policy, sandbox)[1]


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
    "REQUEST_TEMPLATES",
    "TEMPLATE_ARGUMENTS",
    "TRUSTED",
    "TRUST_FLAG",
    "Chat",
    "Prompt",
    "PromptInput",
    "PromptPolicy",
    "Renderer",
    "Text",
    "apply_chat_template",
    "check_length",
    "check_unicode",
    "encode_chat",
    "params_list",
    "parse_prompt",
    "prompt_list",
    "set_chat_template",
    "special_text_ids",
    "template_variables",
    "tokenize",
    "unicode_problem",
]
