"""Streamed responses: OpenAI's chunks as server-sent events, over the events of a response's requests.

``CompletionStream`` / ``ChatStream`` turn ``RequestStream`` events into
OpenAI chunk dicts (a chat stream starts with one role chunk per choice; a
choice that ends with tool calls gets its finish reason in a chunk of its own,
after the last arguments, as OpenAI sends it);
``EventStream`` sends them as ``data: {chunk}`` lines and ends with
``data: [DONE]``.  Events that piled up while the server was busy are merged
into one chunk (``RequestStream.coalesced``), so a slow server sends fewer,
larger chunks and never drops text.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mechserve.api.errors import EngineDeadError, EngineStepError, RequestFailed
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.async_llm import RequestStream
from mechserve.entrypoints.tools import ToolPlan, ToolStream, finish_reason
from mechserve.http import responses as r
from mechserve.http.errors import engine_error

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """Server-sent events: one ``data:`` line per chunk, an error event if the engine fails or the request fails
    alone inside a step (``constraint`` names the body field of its grammar), then ``[DONE]``.

    However the response ends (done, the client gone, the task cancelled),
    its requests are aborted at once and its generators closed in this task,
    not whenever the garbage collector finds them: Starlette stops iterating
    a body without closing it.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[dict[str, Any], None],
        handles: Sequence[RequestStream],
        constraint: str | None = None,
    ) -> None:
        self.chunks = chunks
        self.handles = handles
        self.constraint = constraint  # the body field a failed grammar is named by
        super().__init__(self._events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _events(self) -> AsyncIterator[str]:
        try:
            async for chunk in self.chunks:
                yield _data(chunk)
        except (EngineStepError, EngineDeadError, RequestFailed) as exc:
            yield _data(engine_error(exc, constraint=self.constraint).body())
        yield "data: [DONE]\n\n"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self.handles:
                handle.abort()
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.chunks.aclose()


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class NamedEventStream(EventStream):
    """Server-sent events named by their ``type``: ``event: <type>`` and ``data: {event}`` per event, no
    ``[DONE]`` (the Responses and Anthropic Messages streams); the generator ends its own stream, failures
    included.  Like ``EventStream``, however it ends, its requests are aborted and its generator closed."""

    async def _events(self) -> AsyncIterator[str]:
        async for event in self.chunks:
            yield f"event: {event['type']}\n{_data(event)}"


class _Stream:
    """The chunks of one streamed response over its requests' events (in prompt order)."""

    kind = ""

    def __init__(
        self,
        handles: Sequence[RequestStream],
        response_id: str,
        model: str,
        params: SamplingParams,
        usage: bool,
        render: r.Render | None = None,
    ) -> None:
        self.handles = handles
        self.response_id = response_id
        self.model = model
        self.params = params
        self.include_usage = usage
        self.render = render or r.Render(logprobs=params.logprobs is not None, top_n=params.logprobs or 0)
        self.created = int(time.time())

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = r.envelope(self.kind, self.response_id, self.created, self.model, choices)
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        outputs = [h.output for h in self.handles if h.output is not None]
        out = r.envelope(self.kind, self.response_id, self.created, self.model, [])
        out["usage"] = r.usage((len(h.prompt_token_ids) for h in self.handles), outputs)
        return out


class CompletionStream(_Stream):
    kind = "text_completion"

    def __init__(self, *args: Any, prompts: list[r.Prompt] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts = prompts or []  # per prompt, what its choices echo (with render.echo)

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        render = self.render
        offsets: dict[int, int] = {}  # sample index -> length of its text so far
        for i, handle in enumerate(self.handles):
            async for event in handle.coalesced():
                for d in event.samples:
                    first = d.index not in offsets
                    if not (first or d.text or d.finished or (render.logprobs and d.token_ids)):
                        continue
                    prompt = self.prompts[i] if first and self.prompts else None
                    echo = dataclasses.replace(prompt, logprobs=d.prompt_logprobs) if prompt and render.echo else None
                    offset = offsets.get(d.index, 0)
                    choice = r.completion_choice(
                        i * self.params.n + d.index,
                        d,
                        render,
                        echo=echo,
                        prompt_ids=prompt.token_ids if prompt else None,
                        offset=offset,
                        prompt_logprobs=d.prompt_logprobs,
                    )
                    yield self.chunk([choice])
                    offsets[d.index] = offset + len(choice["text"])
            offsets.clear()
        if self.include_usage:
            yield self.usage_chunk()


class ChatStream(_Stream):
    """A chat stream; with ``tools`` (an active ``ToolPlan``) each choice's text is parsed for tool calls as it
    arrives (``ToolStream``): their deltas go out as ``delta.tool_calls``, the rest as ``delta.content``."""

    kind = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolPlan | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools if tools is not None and tools.active else None

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        render = self.render
        parsers: dict[int, ToolStream] = {}
        yield self.chunk([r.chat_role_choice(j) for j in range(self.params.n)])
        async for event in self.handles[0].coalesced():
            for d in event.samples:
                delta: dict[str, Any] | None = None
                finish = None
                if self.tools is not None:
                    parser = parsers.setdefault(d.index, ToolStream(self.tools))
                    content, calls = parser.feed(d.text)
                    if d.finished:
                        more, last = parser.finish()
                        content, calls = content + more, calls + last
                        finish = finish_reason(d.finish_reason, bool(parser.calls))
                    delta = {"content": content} if content else {}
                    if calls:
                        delta["tool_calls"] = calls
                shown = delta if delta is not None else d.text
                ending: dict[str, Any] | None = None
                if d.finished and delta is not None and delta.get("tool_calls"):
                    # OpenAI's order: the last arguments, then a chunk of its own with the finish reason
                    ending = r.chat_finish_choice(d, render, finish)
                    d = dataclasses.replace(d, finished=False, finish_reason=None, stop_reason=None)
                if shown or d.finished or (render.logprobs and d.token_ids) or d.prompt_logprobs is not None:
                    chunk = self.chunk([r.chat_chunk_choice(d, render, delta, finish)])
                    if render.prompt_logprobs and d.prompt_logprobs is not None:
                        chunk["prompt_logprobs"] = r.vllm_prompt_logprobs(d.prompt_logprobs)
                    yield chunk
                if ending is not None:
                    yield self.chunk([ending])
        if self.include_usage:
            yield self.usage_chunk()
