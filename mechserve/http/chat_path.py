"""The chat path that the server's other APIs are translations of: one request in, the engine's outputs back.

``/v1/responses`` (``mechserve.http.responses_api``) and ``/v1/messages`` (``mechserve.http.anthropic_api``)
turn their bodies into a ``ChatCompletionRequest`` and go through exactly what ``/v1/chat/completions``
does (``ChatPath``, built by ``mechserve.http.app`` from its own steps): the model name checked, the
conversation rendered by the chat template with its tools, ``SamplingParams``, the output constraint
compiled, the request submitted (the same 400 / 429 rules), then the same ``RequestStream`` s to stream
or wait on (a client that disconnects aborts them).  Each API then renders the same outputs in its own
shapes, parsing tool calls with the same ``ToolStream``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from mechserve.api.outputs import RequestOutput
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.async_llm import AsyncLLM, RequestStream
from mechserve.entrypoints.tools import ToolPlan
from mechserve.http.protocol import ChatCompletionRequest
from mechserve.http.responses import Render


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request the engine accepted: its ``handles`` (one: a chat has one conversation), the
    ``params`` it runs with, its ``tools`` plan, the served ``model`` name, how logprobs are shown, and the
    chat body's ``constraint`` field (``response_format``, ``tools`` for a forced call, ...; None without
    one): what an error names when the request's grammar fails inside an engine step."""

    handles: list[RequestStream]
    params: SamplingParams
    tools: ToolPlan
    model: str
    render: Render
    constraint: str | None = None


@dataclass(frozen=True, slots=True)
class ChatPath:
    """The chat path's steps, as the app runs them for ``/v1/chat/completions``.

    ``start(body, request_id)`` checks, renders, compiles and submits (raising ``APIError`` with
    OpenAI's field names: a 400 for a bad body or a prompt the engine refuses, a 404 for another
    model, a 429 when overloaded); ``wait(request, run)`` returns the final outputs of ``run.handles`` unless
    the client disconnects first (then it aborts them and raises a 499), a 503 if the server shut down under
    them, a 400 naming ``run.constraint`` if the request failed alone inside a step on its grammar;
    ``check_model(name)`` is the served name, or a 404 for another.
    """

    llm: AsyncLLM
    start: Callable[[ChatCompletionRequest, str], Awaitable[ChatRun]]
    wait: Callable[[Request, ChatRun], Awaitable[list[RequestOutput]]]
    check_model: Callable[[str | None], str]


__all__ = ["ChatPath", "ChatRun"]
