"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages body is translated into a chat request (``mechserve.http.anthropic_protocol``) and run by the
chat path (``mechserve.http.chat_path``): the same template, tools, grammar, ``SamplingParams``, 400 /
429 rules and aborts on disconnect as ``/v1/chat/completions``; errors take Anthropic's body
(``mechserve.http.errors``), and ``x-api-key`` authenticates as well as ``Authorization: Bearer``
(``mechserve.http.app.Guard``).  ``anthropic-version`` and ``anthropic-beta`` headers are accepted: a
beta only unlocks fields, and each field is judged by the field table.

The reply is parsed into content blocks by ``ReplyBlocks`` (the chat path's tool-call parser, in order):
``text`` blocks and ``tool_use`` blocks (``id`` ``toolu_...``, ``input`` the call's arguments).  The
message and the stream follow the ``anthropic`` SDK's types::

    message_start                 the message with no content, usage.input_tokens the prompt's
    per block  content_block_start, content_block_delta (text_delta / input_json_delta) ..., content_block_stop
               (one ping after the first block's start)
    message_delta                 stop_reason, stop_sequence, usage (output_tokens, and the input split into
                                  input_tokens + cache_read_input_tokens)
    message_stop
    error                         instead, if the engine fails or shuts down under the request

``stop_reason``: ``tool_use`` (the reply made calls), ``stop_sequence`` (one of ``stop_sequences``,
named in ``stop_sequence``), ``max_tokens``, else ``end_turn``.  Usage is Anthropic's:
``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those the prefix cache
served (their sum is the prompt, ``count_tokens``'s answer), ``cache_creation_input_tokens`` 0 (pages are
cached as a side effect of every request, never written on request).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mechserve.api.errors import EngineDeadError, EngineStepError, ParamError, RequestFailed
from mechserve.api.outputs import ABORT, LENGTH, RequestOutput
from mechserve.entrypoints.tools import CLOSE
from mechserve.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from mechserve.http.chat_path import ChatPath, ChatRun
from mechserve.http.errors import APIError, engine_error
from mechserve.http.fields import COUNT_TOKENS, MESSAGES
from mechserve.http.protocol import UnsupportedField
from mechserve.http.reply_blocks import Block, BlockEvent, ReplyBlocks, arguments_object
from mechserve.http.streaming import NamedEventStream
from mechserve.http.unknown import judge_unknown


class MessageState:
    """One message as it is built from its request's events: its blocks, stop reason and usage."""

    def __init__(self, body: MessagesRequest, run: ChatRun, message_id: str) -> None:
        self.body = body
        self.run = run
        self.id = message_id
        self._blocks = ReplyBlocks(run.tools)
        self.pinged = False

    def start(self) -> dict[str, Any]:
        """``message_start``: the message with no content yet."""
        prompt = len(self.run.handles[0].prompt_token_ids)
        message = self.message([], None, None, _usage(prompt, 0, 0))
        return {"type": "message_start", "message": message}

    def step(self, text: str) -> list[dict[str, Any]]:
        """The events of the reply's next text."""
        return self._render(self._blocks.feed(text))

    def end(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events of the reply's end: the last block's stop, ``message_delta``, ``message_stop``."""
        events = self._render(self._blocks.finish())
        if not self.pinged:
            events.append({"type": "ping"})
        reason, sequence = self.stop(output)
        usage = self.usage(output)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [*events, {"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        """The message from the whole reply at once (not streamed)."""
        self._blocks.feed(output.outputs[0].text)
        self._blocks.finish()
        reason, sequence = self.stop(output)
        return self.message([_block(b) for b in self._blocks.blocks], reason, sequence, self.usage(output))

    def stop(self, output: RequestOutput) -> tuple[str, str | None]:
        """Anthropic's ``stop_reason`` and ``stop_sequence`` for the engine's finish."""
        c = output.outputs[0]
        if c.finish_reason == ABORT:
            raise APIError(503, "the server shut down before the message finished", code="shutting_down")
        if c.finish_reason == LENGTH:
            return "max_tokens", None
        if self._blocks.calls:
            return "tool_use", None
        stops = self.body.stop_sequences or ()
        if isinstance(c.stop_reason, str) and c.stop_reason in stops and c.stop_reason != CLOSE:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def usage(self, output: RequestOutput) -> dict[str, Any]:
        prompt = len(output.prompt_token_ids)
        return _usage(prompt, output.num_cached_tokens, sum(len(c.token_ids) for c in output.outputs))

    def message(
        self, content: list[dict[str, Any]], reason: str | None, sequence: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.run.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def _render(self, events: list[BlockEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if e.kind == "open":
                start = {"type": "text", "text": ""} if e.block.kind == "text" else _tool_use(e.block, {})
                out.append({"type": "content_block_start", "index": e.index, "content_block": start})
                if not self.pinged:
                    self.pinged = True
                    out.append({"type": "ping"})
            elif e.kind == "delta":
                delta = (
                    {"type": "text_delta", "text": e.text}
                    if e.block.kind == "text"
                    else {"type": "input_json_delta", "partial_json": e.text}
                )
                out.append({"type": "content_block_delta", "index": e.index, "delta": delta})
            else:
                out.append({"type": "content_block_stop", "index": e.index})
        return out


def _usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def _tool_use(block: Block, arguments: dict[str, Any]) -> dict[str, Any]:
    call_id = "toolu_" + block.call_id.removeprefix("call_")
    return {"type": "tool_use", "id": call_id, "name": block.name, "input": arguments}


def _block(block: Block) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return _tool_use(block, arguments_object(block.text))


def anthropic_routes(app: FastAPI, path: ChatPath) -> None:
    """Register the Messages API's routes on ``app``, running requests through ``path``."""

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        judge_unknown(request, body, MESSAGES)
        message_id = "msg_" + secrets.token_hex(12)
        run = await _start(path, body, message_id)
        state = MessageState(body, run, message_id)
        if body.stream:
            return NamedEventStream(_stream(state), run.handles)
        try:
            outputs = await path.wait(request, run)
        except APIError as exc:
            raise _named(body, exc) from None
        return JSONResponse(state.whole(outputs[0]))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
        judge_unknown(request, body, COUNT_TOKENS)
        chat = _translated(body)
        path.check_model(chat.model)
        try:
            chat.check_supported()
            prompt = chat.chat()
        except UnsupportedField as exc:
            raise _named(body, APIError(400, str(exc), param=exc.param, code="unsupported_parameter")) from None
        except ParamError as exc:
            raise _named(body, APIError(400, str(exc), param=exc.param, code="invalid_value")) from None
        try:
            ids = await path.llm.tokenize(prompt)
        except EngineDeadError as exc:
            raise engine_error(exc) from None
        except ValueError as exc:  # the field a ParamError names (chat_template refused), else the messages
            named = exc.param if isinstance(exc, ParamError) and exc.param != "prompt" else "messages"
            raise _named(body, APIError(400, str(exc), param=named, code="invalid_value")) from None
        return JSONResponse({"input_tokens": len(ids)})


def _translated(body: CountTokensRequest | MessagesRequest) -> Any:
    try:
        return body.to_chat()
    except UnsupportedField as exc:
        raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


def _named(body: CountTokensRequest | MessagesRequest, exc: APIError) -> APIError:
    """``exc`` (the chat path's) with this API's field names."""
    param, message = body.rename(exc.param, exc.message)
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


async def _start(path: ChatPath, body: MessagesRequest, message_id: str) -> ChatRun:
    chat = _translated(body)
    try:
        return await path.start(chat, message_id)
    except APIError as exc:
        raise _named(body, exc) from None


async def _stream(state: MessageState) -> AsyncGenerator[dict[str, Any], None]:
    """The message's events; an ``error`` event instead of the end if the engine fails or shuts down."""
    yield state.start()
    try:
        async for event in state.run.handles[0].coalesced():
            for d in event.samples:
                for e in state.step(d.text):
                    yield e
            if event.output is not None:
                for e in state.end(event.output):
                    yield e
    except (EngineStepError, EngineDeadError, RequestFailed) as exc:
        yield _named(state.body, engine_error(exc, constraint=state.run.constraint)).anthropic_body()
    except APIError as exc:  # aborted by a shutdown
        yield exc.anthropic_body()


__all__ = ["MessageState", "anthropic_routes"]
