"""OpenAI's Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, ``GET .../input_items``,
``POST .../cancel``.

A Responses body is translated into a chat request (``mechserve.http.responses_protocol``) and run by
the chat path (``mechserve.http.chat_path``): the same template, tools, grammar, ``SamplingParams``,
400 / 429 rules and aborts on disconnect as ``/v1/chat/completions``.  Its reply is parsed into
output items by ``ReplyBlocks`` (the chat path's tool-call parser, in order): a ``message`` item for
each stretch of text, a ``function_call`` item for each call.  The response object and the stream's
events follow the ``openai`` SDK's types (``openai.types.responses``)::

    response.created, response.in_progress                         (status in_progress)
    per item  response.output_item.added
              message:        response.content_part.added, response.output_text.delta ...,
                              response.output_text.done, response.content_part.done
              function_call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
              response.output_item.done
    response.completed        (status completed)
    response.incomplete       (max_output_tokens cut it: incomplete_details.reason "max_output_tokens";
                               or it was cancelled: status "cancelled")
    error, response.failed    (the engine failed or shut down under it; status "failed")

Every event carries ``sequence_number``, 0 for ``response.created`` and one more for each event after it.

Responses are kept (``store``, default true) in a bounded in-memory ``ResponseStore``, newest
``max_stored`` first out last; ``previous_response_id`` continues one: its input and output (as chat
messages) come before the new input, so with output caching (``EngineConfig.output_caching``, on by
default in ``mechserve serve``; ``--no-output-caching`` turns it off) the prefix cache already holds
the previous turn's pages, answer included, and only the new input is computed
(``usage.input_tokens_details.cached_tokens`` says how many were served).  A ``background`` response
runs after the POST returns it; ``GET`` polls it and ``cancel`` aborts it, as it does a streaming one.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mechserve.api.errors import EngineDeadError, EngineStepError, ParamError, RequestFailed
from mechserve.api.outputs import ABORT, LENGTH, RequestOutput, SampleDelta
from mechserve.http import responses as r
from mechserve.http.chat_path import ChatPath, ChatRun
from mechserve.http.errors import APIError, engine_error
from mechserve.http.fields import RESPONSES
from mechserve.http.protocol import UnsupportedField
from mechserve.http.reply_blocks import BlockEvent, ReplyBlocks, arguments_object
from mechserve.http.responses_protocol import ResponsesRequest, rename
from mechserve.http.streaming import NamedEventStream
from mechserve.http.unknown import judge_unknown

MAX_STORED_RESPONSES = 1024
IN_PROGRESS = "in_progress"


class ResponseState:
    """One response as it is built: its output items, status and usage, from its request's events.

    ``step(delta)`` and ``end(output)`` return the stream events (without ``sequence_number``) that the
    reply's text gives; ``response()`` is the response object as it stands (what ``GET`` returns).
    ``conversation`` is what a response continuing this one puts before its input.
    """

    def __init__(self, body: ResponsesRequest, run: ChatRun, response_id: str, history: list[dict[str, Any]]) -> None:
        self.body = body
        self.run = run
        self.id = response_id
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status = IN_PROGRESS
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.cancelled = False
        self.items: list[dict[str, Any]] = []
        self.input_items = input_items(body.input)
        self._history = history  # chat messages before the output (instructions left out)
        self._blocks = ReplyBlocks(run.tools)
        self._item_of: dict[int, int] = {}  # block index -> item index
        self._logprobs: list[dict[str, Any]] = []  # of the open text item
        self._pending: list[dict[str, Any]] = []  # logprobs not yet sent with a delta
        self._produced = 0  # output tokens the deltas carried so far (a failure's usage)

    @property
    def cancellable(self) -> bool:
        return bool(self.body.background or self.body.stream)

    # Building -----------------------------------------------------------------------------------------------

    def step(self, d: SampleDelta) -> list[dict[str, Any]]:
        """The events of one engine delta of the reply."""
        self._produced += len(d.token_ids)
        if self.run.render.logprobs and d.logprobs:
            self._pending += r.chat_logprobs(d.token_ids, d.logprobs, self.run.render)["content"]
        return self._render(self._blocks.feed(d.text), "completed")

    def end(self, output: RequestOutput | None) -> list[dict[str, Any]]:
        """The events of the reply's end (its ``output``: finish reason and usage), the terminal one last."""
        reason = output.outputs[0].finish_reason if output is not None and output.outputs else ABORT
        if reason == ABORT and not self.cancelled:
            error = APIError(503, "the server shut down before the response finished", code="server_error")
            return self.fail(error, output)
        item_status = "completed" if reason not in (LENGTH, ABORT) else "incomplete"
        events = self._render(self._blocks.finish(), item_status)
        if self.cancelled:
            self.status = "cancelled"
        elif reason == LENGTH:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self._finish(output)
        terminal = "response.completed" if self.status == "completed" else "response.incomplete"
        return [*events, {"type": terminal, "response": self.response()}]

    def fail(self, error: APIError, output: RequestOutput | None = None) -> list[dict[str, Any]]:
        """The events of a failure: open items closed incomplete, then ``error`` and ``response.failed``; its
        usage counts the tokens produced before it (``output``'s, or without one the deltas' so far).

        A server fault is a ``server_error``; a request that failed on its own account (its ``text.format`` or
        forced tool's grammar, inside an engine step: a 4xx ``error``) is an ``invalid_prompt`` naming the
        field (``param``), the error event carrying the chat path's code (``invalid_value``)."""
        events = self._render(self._blocks.finish(), "incomplete")
        self.status = "failed"
        server = error.status >= 500
        self.error = {"code": "server_error" if server else "invalid_prompt", "message": error.message}
        if not server and error.param is not None:
            self.error["param"] = error.param
        self._finish(output)
        code = "server_error" if server else (error.code or "invalid_request_error")
        failed = {"type": "error", "code": code, "message": error.message, "param": None if server else error.param}
        return [*events, failed, {"type": "response.failed", "response": self.response()}]

    def whole(self, output: RequestOutput) -> None:
        """Build the response from the whole reply at once (not streamed)."""
        c = output.outputs[0]
        if self.run.render.logprobs and c.logprobs:
            self._pending = r.chat_logprobs(c.token_ids, c.logprobs, self.run.render)["content"]
        self._render(self._blocks.feed(c.text), "completed")
        self.end(output)

    def cancel(self) -> None:
        """Stop the response (``POST .../cancel``, ``DELETE``): its requests are aborted before the next step."""
        if self.status != IN_PROGRESS:
            return
        self.cancelled = True
        self.status = "cancelled"
        for handle in self.run.handles:
            handle.abort()

    def gone(self) -> None:
        """The stream's client went away before the end: the response stops there."""
        if self.status == IN_PROGRESS:
            self.cancelled = True
            self.status = "cancelled"
            self.completed_at = int(time.time())

    def _finish(self, output: RequestOutput | None) -> None:
        self.completed_at = int(time.time())
        handle = self.run.handles[0]
        prompt = len(handle.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in output.outputs) if output is not None else self._produced
        cached = output.num_cached_tokens if output is not None else 0
        self.usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        }

    def _render(self, events: list[BlockEvent], closing: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if e.kind == "open":
                out += self._open(e)
                continue
            n = self._item_of[e.index]
            item = self.items[n]
            if e.kind == "delta" and e.block.kind == "text":
                logprobs, self._pending = self._pending, []
                self._logprobs += logprobs
                out.append(_at(item, n, "response.output_text.delta", content_index=0, delta=e.text, logprobs=logprobs))
            elif e.kind == "delta":
                out.append(_at(item, n, "response.function_call_arguments.delta", delta=e.text))
            elif e.block.kind == "text":
                self._logprobs, self._pending = self._logprobs + self._pending, []
                part = {"type": "output_text", "text": e.block.text, "annotations": [], "logprobs": self._logprobs}
                self._logprobs = []
                item.update(content=[part], status=closing)
                out.append(
                    _at(
                        item,
                        n,
                        "response.output_text.done",
                        content_index=0,
                        text=e.block.text,
                        logprobs=part["logprobs"],
                    )
                )
                out.append(_at(item, n, "response.content_part.done", content_index=0, part=copy.deepcopy(part)))
                out.append({"type": "response.output_item.done", "output_index": n, "item": copy.deepcopy(item)})
            else:
                item.update(arguments=e.block.text, status=closing)
                out.append(_at(item, n, "response.function_call_arguments.done", arguments=e.block.text))
                out.append({"type": "response.output_item.done", "output_index": n, "item": copy.deepcopy(item)})
        return out

    def _open(self, e: BlockEvent) -> list[dict[str, Any]]:
        n = len(self.items)
        self._item_of[e.index] = n
        if e.block.kind == "text":
            item: dict[str, Any] = {
                "id": "msg_" + secrets.token_hex(16),
                "type": "message",
                "status": IN_PROGRESS,
                "role": "assistant",
                "content": [],
            }
            self.items.append(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [
                {"type": "response.output_item.added", "output_index": n, "item": copy.deepcopy(item)},
                _at(item, n, "response.content_part.added", content_index=0, part=part),
            ]
        item = {
            "id": "fc_" + secrets.token_hex(16),
            "type": "function_call",
            "status": IN_PROGRESS,
            "arguments": "",
            "call_id": e.block.call_id,
            "name": e.block.name,
        }
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": n, "item": copy.deepcopy(item)}]

    # Reading ------------------------------------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        """The response object (``openai.types.responses.Response``) as it stands."""
        body = self.body
        fmt = body.text.format if body.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": bool(body.background),
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "model": self.run.model,
            "output": copy.deepcopy(self.items),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": body.safety_identifier,
            "service_tier": "default",
            "store": body.stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {
                "format": {"type": "text"} if fmt is None else _declared(fmt),
                "verbosity": "medium",
            },
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": list(body.tools or ()),
            "top_logprobs": body.top_logprobs or 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": body.user,
            "metadata": dict(body.metadata or {}),
        }

    def conversation(self) -> list[dict[str, Any]]:
        """This response as chat messages: its history and input, then its output as one assistant message."""
        calls = [b for b in self._blocks.blocks if b.kind == "call"]
        text = "".join(b.text for b in self._blocks.blocks if b.kind == "text")
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = [
                {
                    "id": b.call_id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(arguments_object(b.text), ensure_ascii=False)},
                }
                for b in calls
            ]
        return [*self._history, message]


def _declared(fmt: Any) -> dict[str, Any]:
    """``text.format`` as returned with the response: its declared fields that were set (an ignored unknown key,
    under ``--ignore-unknown-fields``, is not echoed as if it had been honoured)."""
    extra = fmt.model_extra or {}
    return {k: v for k, v in fmt.model_dump(by_alias=True, exclude_none=True).items() if k not in extra}


def input_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A response's ``input`` as the items ``GET /v1/responses/{id}/input_items`` lists: each with an id (its own,
    or a new one), text content as parts, status ``completed``.  ``given`` was already checked."""
    if given is None:
        return []
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    out = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            part = "output_text" if role == "assistant" else "input_text"
            content = item["content"]
            parts = [{"type": part, "text": content}] if isinstance(content, str) else [dict(p) for p in content]
            if role == "assistant":
                parts = [{"annotations": [], **p} for p in parts]
            found = {"id": item.get("id") or "msg_" + secrets.token_hex(16), "type": "message", "role": role}
            out.append({**found, "content": parts, "status": "completed"})
        elif kind == "function_call":
            fields = {k: item[k] for k in ("call_id", "name", "arguments")}
            out.append(
                {"id": item.get("id") or "fc_" + secrets.token_hex(16), "type": kind, **fields, "status": "completed"}
            )
        else:
            fields = {k: item[k] for k in ("call_id", "output")}
            out.append(
                {"id": item.get("id") or "fco_" + secrets.token_hex(16), "type": kind, **fields, "status": "completed"}
            )
    return out


def _at(item: dict[str, Any], n: int, kind: str, **fields: Any) -> dict[str, Any]:
    """An event about item ``n`` (its ``item_id`` and ``output_index``)."""
    return {"type": kind, "item_id": item["id"], "output_index": n, **fields}


class ResponseStore:
    """The newest ``capacity`` stored responses, by id, in memory; a response still in progress is evicted
    only when every stored one is (background tasks keep a reference to theirs until they end)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"max_stored_responses must be at least 1, got {capacity}")
        self.capacity = capacity
        self._states: OrderedDict[str, ResponseState] = OrderedDict()
        self.tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._states)

    def get(self, response_id: str) -> ResponseState | None:
        return self._states.get(response_id)

    def put(self, state: ResponseState) -> None:
        self._states[state.id] = state
        while len(self._states) > self.capacity:
            done = next((k for k, s in self._states.items() if s.status != IN_PROGRESS), None)
            del self._states[done if done is not None else next(iter(self._states))]

    def pop(self, response_id: str) -> ResponseState | None:
        return self._states.pop(response_id, None)


def responses_routes(app: FastAPI, path: ChatPath, *, max_stored: int = MAX_STORED_RESPONSES) -> None:
    """Register the Responses API's routes on ``app``, running requests through ``path``."""
    store = ResponseStore(max_stored)
    app.state.responses = store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        judge_unknown(request, body, RESPONSES)
        response_id = f"resp_{body.request_id or uuid.uuid4().hex}"
        history = _history(store, body.previous_response_id)
        try:
            chat = body.to_chat(history)
            conversation = chat.model_dump(exclude_none=True)["messages"]
        except UnsupportedField as exc:
            raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
        except ParamError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        if body.instructions is not None:
            conversation = conversation[1:]  # a continued response does not carry instructions over
        run = await _start(path, chat, response_id)
        state = ResponseState(body, run, response_id, conversation)
        if body.stored:
            store.put(state)
        if body.background:
            task = asyncio.ensure_future(_drive(state))
            store.tasks.add(task)
            task.add_done_callback(store.tasks.discard)
            return JSONResponse(state.response())
        if body.stream:
            return NamedEventStream(_stream(state), run.handles)
        try:
            outputs = await path.wait(request, run)
        except APIError as exc:
            exc = _renamed(exc)
            if exc.status == 499:  # the client went away: the response stops there, as a stream's does
                state.gone()
            else:
                state.fail(exc)
            raise exc from None
        state.whole(outputs[0])
        return JSONResponse(state.response())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> JSONResponse:
        query = request.query_params
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(
                400,
                "stream is not supported: a stored response is returned whole",
                param="stream",
                code="unsupported_parameter",
            )
        for name in ("include", "include[]"):
            if query.getlist(name):
                raise APIError(
                    400,
                    f"include {query.getlist(name)} is not supported here",
                    param="include",
                    code="unsupported_parameter",
                )
        return JSONResponse(_stored(store, response_id).response())

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> JSONResponse:
        items = _stored(store, response_id).input_items
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order", code="invalid_value")
        limit_text = query.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise APIError(400, f"limit must be 1..100, got {limit_text!r}", param="limit", code="invalid_value")
        if query.getlist("include") or query.getlist("include[]"):
            raise APIError(400, "include is not supported here", param="include", code="unsupported_parameter")
        ordered = items if order == "asc" else items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in ordered]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in this response", param="after")
            ordered = ordered[ids.index(after) + 1 :]
        page = ordered[: int(limit_text)]
        return JSONResponse(
            {
                "object": "list",
                "data": copy.deepcopy(page),
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(ordered) > len(page),
            }
        )

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        state = _stored(store, response_id)
        store.pop(response_id)
        state.cancel()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        state = _stored(store, response_id)
        if not state.cancellable:
            raise APIError(
                400,
                f"response {response_id!r} is not a background or streaming response: only those can be cancelled "
                "(a client waiting for a plain response aborts it by closing the connection)",
                param="response_id",
                code="invalid_value",
            )
        state.cancel()
        return JSONResponse(state.response())


def _history(store: ResponseStore, previous: str | None) -> list[dict[str, Any]]:
    """The conversation a response continues (``previous_response_id``); a 400 naming it when it cannot."""
    if previous is None:
        return []
    state = store.get(previous)
    if state is None:
        raise APIError(
            400,
            f"Previous response with id {previous!r} not found (never stored, stored with store: false, deleted, or "
            f"evicted: this server keeps the newest {store.capacity})",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if state.status == IN_PROGRESS:
        raise APIError(
            400, f"response {previous!r} is still in progress; continue it once it ended", param="previous_response_id"
        )
    return state.conversation()


def _stored(store: ResponseStore, response_id: str) -> ResponseState:
    state = store.get(response_id)
    if state is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id", code="not_found")
    return state


async def _start(path: ChatPath, chat: Any, response_id: str) -> ChatRun:
    """``path.start``, with the chat path's errors in this API's field names."""
    try:
        return await path.start(chat, response_id)
    except APIError as exc:
        raise _renamed(exc) from None


def _renamed(exc: APIError) -> APIError:
    """A chat path error in this API's field names (``rename``)."""
    param, message = rename(exc.param, exc.message)
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code, headers=exc.headers)


async def _stream(state: ResponseState) -> AsyncGenerator[dict[str, Any], None]:
    """The response's events, numbered."""
    numbers = itertools.count()

    def numbered(event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = next(numbers)
        return event

    yield numbered({"type": "response.created", "response": state.response()})
    yield numbered({"type": "response.in_progress", "response": state.response()})
    try:
        try:
            async for event in state.run.handles[0].coalesced():
                for d in event.samples:
                    for e in state.step(d):
                        yield numbered(e)
                if event.output is not None:
                    for e in state.end(event.output):
                        yield numbered(e)
        except (EngineStepError, EngineDeadError, RequestFailed) as exc:
            for e in state.fail(_renamed(engine_error(exc, constraint=state.run.constraint))):
                yield numbered(e)
    finally:
        state.gone()


async def _drive(state: ResponseState) -> None:
    """A background response's run: its events build it, nobody reads them."""
    try:
        async for event in state.run.handles[0].coalesced():
            for d in event.samples:
                state.step(d)
            if event.output is not None:
                state.end(event.output)
    except (EngineStepError, EngineDeadError, RequestFailed) as exc:
        state.fail(_renamed(engine_error(exc, constraint=state.run.constraint)))


__all__ = ["MAX_STORED_RESPONSES", "ResponseState", "ResponseStore", "responses_routes"]
