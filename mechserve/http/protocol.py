"""The OpenAI request bodies the server accepts (pydantic), and their translation into prompts and ``SamplingParams``.

What each field does is decided by one table, ``mechserve.http.fields`` (rendered as
docs/api-fields.md): the models below declare exactly its honoured fields, with their types and
ranges; its refused fields arrive as extra keys (``model_extra``) and ``check_supported`` answers
a non-neutral value with ``UnsupportedField`` naming it.  A key outside the table (at the top) or
not declared by the model of its part (inside: a message, a content part, a tool, ``stream_options``,
``response_format``, ...) is *unknown*: ``unknown_fields`` lists them with their dotted paths, and the
server refuses them with a 400 naming each (``mechserve.http.unknown``; ``serve
--ignore-unknown-fields`` ignores them instead).  Types are strict (``"0.5"`` is not a number, ``1``
is not a boolean), every field takes ``null`` for its default (OpenAI's fields are nullable), ranges are OpenAI's
(``temperature`` in [0, 2], ``top_p`` in (0, 1], ``n`` in [1, 64], at most 16 stop strings) and
every string must be valid Unicode (a lone surrogate such as ``"\\ud800"`` is a 400 naming its
field).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from mechserve.api.errors import ParamError
from mechserve.api.limits import MAX_FILTER_IDS, MAX_LOGPROBS, MAX_NEW_TOKENS, MAX_SAMPLES
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.entrypoints.prompts import Chat, PromptInput, Text, unicode_problem
from mechserve.entrypoints.tools import MAX_TOOLS, ToolPlan, history_message, parse_tool_choice, parse_tools
from mechserve.http.fields import CHAT, COMPLETIONS, fields_for, refused_field
from mechserve.http.unknown import Unknown, each, keys_outside

MAX_STOP = 16
INT64 = 2**63
MAX_DETOKENIZE = 1_000_000  # ids in one /detokenize request
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class UnsupportedField(ValueError):
    """A field this server knows but cannot honour (with this value); ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    """A request body or a part of one.  Keys no field declares are kept (``model_extra``) so that
    ``unknown_fields`` can name them; a top-level body (``endpoint`` set) also keeps its table's refused
    fields there, which are known."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    endpoint: ClassVar[str] = ""

    @classmethod
    def known_names(cls) -> tuple[str, ...]:
        """The keys this part may carry: its declared fields (by their JSON names) and, for a top-level body,
        every row of its endpoint's field table."""
        return _known_names(cls)

    def unknown_fields(self, where: str = "") -> list[Unknown]:
        """Every unknown key of this part and the parts inside it, with its dotted path under ``where`` (``""``
        or a prefix ending in ``.``), in the body's order: extra keys outside ``known_names``, then each
        declared field's (models, lists of models, and the objects ``_unknown_keys`` reads by hand)."""
        found = keys_outside(self.model_extra or {}, self.known_names(), where)
        for name, info in type(self).model_fields.items():
            found += _unknown_inside(getattr(self, name), f"{where}{info.alias or name}.")
        return found + self._unknown_keys(where)

    def _unknown_keys(self, where: str) -> list[Unknown]:
        """The unknown keys of the plain JSON objects this part reads by hand (tools, items); none by default."""
        return []

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Every string of every field must encode as UTF-8 (JSON can spell a lone surrogate, ``"\\ud800"``)."""
        problem = unicode_problem(value)
        if problem is not None:
            raise ValueError(f"not valid Unicode: {problem}")
        return value


@functools.cache
def _known_names(model: type[_Body]) -> tuple[str, ...]:
    declared = [info.alias or name for name, info in model.model_fields.items()]
    rows = [f.name for f in fields_for(model.endpoint)] if model.endpoint else []
    return tuple(sorted(set(declared) | set(rows)))


def _unknown_inside(value: Any, where: str) -> list[Unknown]:
    """The unknown keys of a field's value: a model's own, or each model's of a list (by index)."""
    if isinstance(value, _Body):
        return value.unknown_fields(where)
    if isinstance(value, list):
        return [u for i, item in enumerate(value) for u in _unknown_inside(item, f"{where}{i}.")]
    return []


class StreamOptions(_Body):
    """``stream_options``: ``include_usage``; ``include_obfuscation`` is refused when true (none is sent)."""

    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: ``{"name", "description", "schema", "strict"}``."""

    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The body fields that constrain the output, in the order they are looked at; at most one may be set.
CONSTRAINT_FIELDS = (
    "structured_outputs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",
    "grammar",
)


class _Request(_Body):
    """The fields both endpoints share; refused fields stay in ``model_extra`` for ``check_supported``."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    endpoint: ClassVar[str] = ""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_FILTER_IDS)] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_FILTER_IDS)] | None = None
    bad_words: Annotated[list[str], Field(max_length=128)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=MAX_NEW_TOKENS)] | None = None
    add_special_tokens: bool | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # llama.cpp's name for max_tokens
    n_predict: Annotated[int, Field(ge=-1, le=MAX_NEW_TOKENS)] | None = None
    # Structured outputs: vLLM's, OpenAI's and llama.cpp's spellings (``constraint``)
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = (
        None
    )
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None

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
        if self.n_predict is not None and self.max_tokens is not None and self.n_predict != self.max_tokens:
            raise UnsupportedField("n_predict", "n_predict and max_tokens disagree; give one of them")
        if self.stream and self.samples > 1 and self.prompt_logprobs is not None:
            raise UnsupportedField("prompt_logprobs", "prompt_logprobs with stream and n > 1 is not supported yet")
        given = [name for name in CONSTRAINT_FIELDS if self._constraint_value(name) is not None]
        if len(given) > 1:
            raise UnsupportedField(given[1], f"{given[1]} and {given[0]} both constrain the output; give one of them")

    def _constraint_value(self, name: str) -> Any:
        value = getattr(self, name)
        if name == "response_format" and value is not None and value.type == "text":
            return None
        return value

    @property
    def constraint_field(self) -> str | None:
        """The body field that constrains the output (``CONSTRAINT_FIELDS``), or None."""
        return next((n for n in CONSTRAINT_FIELDS if self._constraint_value(n) is not None), None)

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint the body asks for; ``ParamError`` naming the field for a bad one.

        ``response_format``: ``json_object`` is any JSON object, ``json_schema`` its ``schema``
        (``strict`` true or false: the output follows the schema either way, since it is enforced
        token by token)."""
        name = self.constraint_field
        if name is None:
            return None
        value = getattr(self, name)
        try:
            if name == "structured_outputs":
                return StructuredOutputsParams.from_value(value)
            if name == "response_format":
                if value.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                spec = value.json_schema
                if spec is None or spec.schema_ is None:
                    raise ParamError(name, 'response_format of type "json_schema" needs json_schema.schema')
                return StructuredOutputsParams(json=spec.schema_)
            if name in ("guided_json", "json_schema"):
                return StructuredOutputsParams(json=value)
            if name == "guided_regex":
                return StructuredOutputsParams(regex=value)
            if name == "guided_choice":
                return StructuredOutputsParams(choice=tuple(value))
            return StructuredOutputsParams(grammar=value)
        except ParamError as exc:
            raise ParamError(name, re.sub(r"^structured_outputs(\.\w+)?", name, str(exc), count=1)) from None

    @property
    def samples(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def fit_max_tokens(self) -> bool:
        """Whether ``max_tokens`` is "as many as fit" (the engine lowers it to what the prompt leaves)."""
        return self.requested_max_tokens is None

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_tokens``, else llama.cpp's ``n_predict`` (-1: None, as many as fit)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return None if self.n_predict is None or self.n_predict < 0 else self.n_predict

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The ``SamplingParams`` of this body; ``ParamError`` (naming the field) for a combination they refuse."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            n=self.samples,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=None if self.seed == -1 else self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            bad_words=tuple(self.bad_words or ()),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.constraint(),
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"<token id>": bias}`` with int keys; ``ParamError`` for a key that is not a token id."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise ParamError("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        out[int(key)] = value
    return out


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt or several (text or token ids), each completed ``n`` times."""

    endpoint: ClassVar[str] = COMPLETIONS

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.samples:
            raise UnsupportedField("best_of", "best_of is not supported by this server (leave it unset or equal n)")
        if self.echo and self.stream and self.samples > 1 and self.logprobs is not None:
            raise UnsupportedField("echo", "echo with logprobs, stream and n > 1 together is not supported yet")

    def prompts(self) -> list[PromptInput]:
        """The prompts, one per engine request (``[]`` is one prompt of no token ids, which the engine refuses)."""
        p = self.prompt
        special = True if self.add_special_tokens is None else self.add_special_tokens
        if isinstance(p, str):
            return [Text(p, special)]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return [Text(x, special) if isinstance(x, str) else list(x) for x in p]  # type: ignore[arg-type]

    def to_params(self) -> SamplingParams:
        requested = self.requested_max_tokens
        max_tokens = 16 if requested is None and self.n_predict is None else requested
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # vLLM's rule: echo with logprobs scores the prompt too
        return self.sampling_params(
            MAX_NEW_TOKENS if max_tokens is None else max_tokens, self.logprobs, prompt_logprobs
        )

    @property
    def fit_max_tokens(self) -> bool:
        return self.n_predict == -1 and self.max_tokens is None


class TextPart(_Body):
    """A text content part; ``prompt_cache_breakpoint`` is accepted (the prefix cache is automatic)."""

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class ToolCallFunction(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        """The arguments a call was made with: the JSON text of an object (OpenAI's shape)."""
        try:
            found = json.loads(value)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise ValueError("a tool call's arguments must be the JSON text of an object")
        return value


class ToolCallItem(_Body):
    """One call of an assistant's ``tool_calls`` in the history (what an earlier reply returned)."""

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: ToolCallFunction

    def as_template_call(self) -> dict[str, Any]:
        """The call in OpenAI's shape, its declared fields only (an ignored unknown key is not passed on)."""
        function = {"name": self.function.name, "arguments": self.function.arguments}
        return {"id": self.id, "type": self.type, "function": function}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # In the history, OpenAI's clients send what earlier replies had: an assistant's tool calls, and the
    # tools' results as tool messages answering them by id.
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None
    audio: Any = None

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("an assistant message's audio is not supported: text is the only output")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value:
            raise ValueError(
                "an assistant message's function_call (the deprecated functions API) is not supported: give tool_calls"
            )
        return value

    @field_validator("refusal")
    @classmethod
    def _no_refusal(cls, value: Any) -> Any:
        if value:
            raise ValueError("an assistant message's refusal is not supported: give it as content")
        return value

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        """Only an assistant message may leave ``content`` out (OpenAI's rule: it may carry tool calls instead);
        a tool message answers a call by its ``tool_call_id``; only an assistant makes calls."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls (only an assistant's can)")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it: ``developer`` as ``system``, text parts joined, an
        assistant's ``tool_calls`` with their arguments as objects, a tool message's ``tool_call_id``."""
        content = self.content
        text = "".join(part.text for part in content) if isinstance(content, list) else content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_call() for c in self.tool_calls]
            message = history_message(message)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: one conversation through the model's chat template, answered ``n`` times."""

    endpoint: ClassVar[str] = CHAT

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_NEW_TOKENS)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server trusts request templates (PromptPolicy)
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def _unknown_keys(self, where: str) -> list[Unknown]:
        """The keys of a function tool (``type``, ``function``: ``name``, ``description``, ``parameters``,
        ``strict``) and of a named ``tool_choice`` (``type``, ``function``: ``name``), as OpenAI's types
        have them; tools of another type are refused by type (``parse_tools``)."""
        return function_tool_keys(self.tools, where) + function_choice_keys(self.tool_choice, where)

    def check_supported(self) -> None:
        super().check_supported()
        self.tool_plan()
        # vLLM takes max_completion_tokens over max_tokens without a word; two different caps are refused
        for other in ("max_tokens", "n_predict"):
            value = getattr(self, other)
            if self.max_completion_tokens is not None and value is not None and value != self.max_completion_tokens:
                raise UnsupportedField(
                    "max_completion_tokens",
                    f"max_completion_tokens ({self.max_completion_tokens}) and {other} ({value}) disagree; give one "
                    "of them (max_tokens is the older name)",
                )
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else ``n_predict``, else None (as many as fit)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().requested_max_tokens

    def tool_plan(self) -> ToolPlan:
        """What the request does with tools (``mechserve.entrypoints.tools``); ``ParamError`` naming the field
        (``tools.0.function.name``, ``tool_choice``) for a bad definition or choice."""
        return parse_tool_choice(self.tool_choice, parse_tools(self.tools), self.parallel_tool_calls)

    def to_params(self) -> SamplingParams:
        requested = self.requested_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(
            MAX_NEW_TOKENS if requested is None else requested, logprobs, self.prompt_logprobs
        )
        plan = self.tool_plan()
        if plan.stop():
            params = dataclasses.replace(params, stop=(*params.stop, *plan.stop()))
        schema = plan.schema()
        if schema is not None:
            # required / a named function: the grammar engine forces a call valid under the tools' schemas
            if params.structured_outputs is not None:
                raise ParamError(
                    "tool_choice",
                    f"tool_choice {self.tool_choice!r} forces the output to a tool call; "
                    "it cannot be combined with another output constraint",
                )
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
        return params

    def chat(self) -> Chat:
        """The conversation as a prompt, with the template options of the body (and its tools, unless
        ``tool_choice`` is ``none``)."""
        return Chat(
            [m.as_template_message() for m in self.messages],
            add_generation_prompt=True if self.add_generation_prompt is None else self.add_generation_prompt,
            chat_template=self.chat_template,
            continue_final_message=bool(self.continue_final_message),
            template_kwargs=self.chat_template_kwargs,
            add_special_tokens=bool(self.add_special_tokens),
            tools=self.tool_plan().template_tools(),
        )


TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def function_tool_keys(tools: Any, where: str) -> list[Unknown]:
    """The unknown keys of chat's function tools (``TOOL_KEYS``, ``FUNCTION_KEYS``) under ``where``."""
    found: list[Unknown] = []
    for i, tool in each(tools):
        if isinstance(tool, dict) and tool.get("type") == "function":
            found += keys_outside(tool, TOOL_KEYS, f"{where}tools.{i}.")
            found += keys_outside(tool.get("function"), FUNCTION_KEYS, f"{where}tools.{i}.function.")
    return found


def function_choice_keys(choice: Any, where: str) -> list[Unknown]:
    """The unknown keys of chat's named ``tool_choice`` (``{"type": "function", "function": {"name"}}``)."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return []
    inner = keys_outside(choice.get("function"), ("name",), f"{where}tool_choice.function.")
    return keys_outside(choice, TOOL_KEYS, f"{where}tool_choice.") + inner


# /tokenize and /detokenize: vLLM's request shapes (vllm/entrypoints/openai/protocol.py).


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` with ``prompt``: the ids of the text (a BOS added unless ``add_special_tokens`` is false)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    """``POST /tokenize`` with ``messages``: the ids of the conversation through the chat template
    (``chat_template`` replaces the model's; nothing added on top unless ``add_special_tokens``)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def _unknown_keys(self, where: str) -> list[Unknown]:
        return function_tool_keys(self.tools, where)

    def check_supported(self) -> None:
        """Raises ``UnsupportedField`` for a field set to something ``/tokenize`` cannot do, ``ParamError`` for
        a bad tool definition."""
        if self.mm_processor_kwargs:
            raise UnsupportedField(
                "mm_processor_kwargs", "mm_processor_kwargs is not supported by this server's /tokenize"
            )
        parse_tools(self.tools)

    def chat(self) -> Chat:
        """The conversation as a prompt, with the template options of the body."""
        return Chat(
            [m.as_template_message() for m in self.messages],
            add_generation_prompt=self.add_generation_prompt,
            chat_template=self.chat_template,
            continue_final_message=self.continue_final_message,
            template_kwargs=self.chat_template_kwargs,
            add_special_tokens=self.add_special_tokens,
            tools=[t.as_template() for t in parse_tools(self.tools)] or None,
        )


def _tokenize_kind(body: Any) -> str:
    """A body with ``messages`` is the chat form (vLLM tells them apart the same way)."""
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Body):
    """``POST /detokenize``: the text of ``tokens`` (ids of this model's vocabulary)."""

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=MAX_DETOKENIZE)]
