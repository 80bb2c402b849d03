"""The OpenAI request bodies the server accepts (pydantic), and their translation into ``SamplingParams``.

Types are strict (``"0.5"`` is not a number, ``1`` is not a boolean) and
ranges are OpenAI's: ``temperature`` in [0, 2], ``top_p`` in (0, 1],
``n`` in [1, 64], at most 16 stop strings.  vLLM's extensions are accepted
too (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``;
with the openai client, pass them in ``extra_body``).  Fields this server
does not know are ignored, as vLLM does; fields it knows but cannot honour
(``echo``, ``suffix``, ``best_of`` other than ``n``, ``logit_bias``, a
non-zero presence or frequency penalty, ``tools``, a ``response_format``
other than text) are refused with a 400 naming the field, rather than
silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from mechserve.api.limits import MAX_LOGPROBS
from mechserve.api.params import SamplingParams

MAX_N = 64
MAX_STOP = 16
MAX_TOKENS = 1_000_000_000  # the engine's own limit (m12's door then names the model's context)
INT64 = 2**63
MAX_DETOKENIZE = 1_000_000  # ids in one /detokenize request


class UnsupportedField(ValueError):
    """A field this server knows but cannot honour; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=1024)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def check_supported(self) -> None:
        """Raises ``UnsupportedField`` for a field set to something this server cannot do."""
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise UnsupportedField(name, f"{name} is not supported by this server (use 0)")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported by this server")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The ``SamplingParams`` of this body; ``ValueError`` for a combination they refuse."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt or several (text or token ids), each completed ``n`` times."""

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedField("echo", "echo is not supported by this server")
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", "best_of is not supported by this server (leave it unset or equal n)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request (``[]`` is one prompt of no token ids, which the engine refuses)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_params(self) -> SamplingParams:
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        """Only an assistant message may leave ``content`` out (OpenAI's rule: it may carry tool calls instead)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it: ``developer`` as ``system``, text parts joined."""
        content = self.content
        text = "".join(part.text for part in content) if isinstance(content, list) else content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: one conversation through the model's chat template, answered ``n`` times."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise UnsupportedField("tools", "tools are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise UnsupportedField("tool_choice", "tool_choice is not supported by this server")
        if self.response_format is not None and self.response_format.type != "text":
            raise UnsupportedField("response_format", "response_format other than 'text' is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else None (as many as fit)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_params(self) -> SamplingParams:
        requested = self.requested_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(MAX_TOKENS if requested is None else requested, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]


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
    tools: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raises ``UnsupportedField`` for a field set to something ``/tokenize`` cannot do."""
        for name in ("continue_final_message", "chat_template_kwargs", "tools", "mm_processor_kwargs"):
            if getattr(self, name):
                raise UnsupportedField(name, f"{name} is not supported by this server's /tokenize")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]


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
