"""Streamed responses: OpenAI's chunks as server-sent events, over the events of a response's requests.

``CompletionStream`` / ``ChatStream`` turn ``RequestStream`` events into
OpenAI chunk dicts (a chat stream starts with one role chunk per choice);
``EventStream`` sends them as ``data: {chunk}`` lines and ends with
``data: [DONE]``.  Events that piled up while the server was busy are merged
into one chunk (``RequestStream.coalesced``), so a slow server sends fewer,
larger chunks and never drops text.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mechserve.api.errors import EngineDeadError, EngineStepError
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.async_llm import RequestStream
from mechserve.http import responses as r
from mechserve.http.errors import engine_error

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """Server-sent events: one ``data:`` line per chunk, an error event if the engine fails, then ``[DONE]``.

    However the response ends (done, the client gone, the task cancelled),
    its requests are aborted at once and its generators closed in this task,
    not whenever the garbage collector finds them: Starlette stops iterating
    a body without closing it.
    """

    def __init__(self, chunks: AsyncGenerator[dict[str, Any], None], handles: Sequence[RequestStream]) -> None:
        self.chunks = chunks
        self.handles = handles
        super().__init__(self._events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _events(self) -> AsyncIterator[str]:
        try:
            async for chunk in self.chunks:
                yield _data(chunk)
        except (EngineStepError, EngineDeadError) as exc:
            yield _data(engine_error(exc).body())
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


class _Stream:
    """The chunks of one streamed response over its requests' events (in prompt order)."""

    kind = ""

    def __init__(
        self, handles: Sequence[RequestStream], response_id: str, model: str, params: SamplingParams, usage: bool
    ) -> None:
        self.handles = handles
        self.response_id = response_id
        self.model = model
        self.params = params
        self.include_usage = usage
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

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        logprobs = self.params.logprobs is not None
        offsets: dict[int, int] = {}
        for i, handle in enumerate(self.handles):
            async for event in handle.coalesced():
                for d in event.samples:
                    if not (d.text or d.finished or (logprobs and d.token_ids)):
                        continue
                    offset = offsets.get(d.index, 0) if logprobs else None
                    yield self.chunk([r.completion_chunk_choice(i, self.params.n, d, event.token_text, offset)])
                    offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
            offsets.clear()
        if self.include_usage:
            yield self.usage_chunk()


class ChatStream(_Stream):
    kind = "chat.completion.chunk"

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        logprobs = self.params.logprobs is not None
        yield self.chunk([r.chat_role_choice(j) for j in range(self.params.n)])
        async for event in self.handles[0].coalesced():
            for d in event.samples:
                if d.text or d.finished or (logprobs and d.token_ids):
                    yield self.chunk([r.chat_chunk_choice(d, event.token_text, logprobs)])
        if self.include_usage:
            yield self.usage_chunk()
