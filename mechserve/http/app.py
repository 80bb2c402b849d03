"""The OpenAI-compatible HTTP server: a FastAPI app over one ``AsyncLLM``.

Endpoints::

    POST /v1/completions        text or token-id prompts (one or several), n samples, SSE with stream: true
    POST /v1/chat/completions   messages through the model's chat template, SSE with stream: true
    POST /v1/responses          OpenAI's Responses API (mechserve.http.responses_api), GET/DELETE /v1/responses/{id},
                                GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel
    POST /v1/messages           Anthropic's Messages API (mechserve.http.anthropic_api), /v1/messages/count_tokens
    GET  /v1/models, /v1/models/{id}
    POST /tokenize, /detokenize vLLM's: text or messages to ids (count, max_model_len, tokens), ids to text
    GET  /version               {"version": mechserve's version}
    GET  /health                200 while the engine runs, 503 otherwise (never needs the API key)
    GET  /metrics               Prometheus text, or OpenMetrics if asked for (mechserve.entrypoints.metrics)

A request is validated (``mechserve.http.protocol``), submitted and
accepted or refused by the engine before any byte of the response is sent,
so every refusal is a proper status code with an OpenAI error body
(``mechserve.http.errors``).  A streamed response is a series of
``data: {chunk}`` server-sent events ending with ``data: [DONE]``; with
``stream_options.include_usage`` every chunk has ``"usage": null`` and a
last chunk with no choices carries the usage.  A client that goes away,
streaming or not, aborts its requests: their pages return before the next
engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mechserve import __version__
from mechserve.api.errors import EngineDeadError, EngineStepError, ParamError, RequestFailed
from mechserve.api.limits import MAX_REQUEST_BYTES
from mechserve.api.outputs import ABORT, RequestOutput
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.async_llm import AsyncLLM, RequestStream
from mechserve.entrypoints.prompts import Chat, PromptInput
from mechserve.http import responses as r
from mechserve.http.anthropic_api import anthropic_routes
from mechserve.http.chat_path import ChatPath, ChatRun
from mechserve.http.errors import APIError, engine_error, install
from mechserve.http.fields import CHAT, COMPLETIONS
from mechserve.http.instrument import Instrument
from mechserve.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
    UnsupportedField,
)
from mechserve.http.responses_api import MAX_STORED_RESPONSES, responses_routes
from mechserve.http.streaming import ChatStream, CompletionStream, EventStream
from mechserve.http.unknown import IgnoredFieldsHeader, UnknownPolicy, judge_unknown

T = TypeVar("T")
MAX_PROMPTS = 256  # prompts in one completions request


def build_app(
    llm: AsyncLLM,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    trust_request_chat_template: bool = False,
    max_stored_responses: int = MAX_STORED_RESPONSES,
    ignore_unknown_fields: bool = False,
) -> FastAPI:
    """The server's app over ``llm``, answering to ``model_name`` (default ``llm.model_name``).

    With ``api_key`` every path but ``/health`` needs ``Authorization:
    Bearer <api_key>`` (or Anthropic's ``x-api-key: <api_key>``).  A request body over
    ``max_request_bytes`` (default 4 MiB) is a 413 before anything reads it.  A chat template sent
    with a request is refused (400 naming ``chat_template``) unless ``trust_request_chat_template``
    (vLLM's ``--trust-request-chat-template``): then it is rendered in a sandbox process
    (``llm.prompt_policy``, which every endpoint's prompts go through: chat, ``/tokenize``, and the
    Responses and Messages requests translated into chat).  ``/v1/responses`` keeps at most
    ``max_stored_responses`` responses (the oldest go first).  A body key that neither the field table nor
    the model of its part knows is a 400 naming it (``mechserve.http.unknown``), unless
    ``ignore_unknown_fields`` (``--ignore-unknown-fields``, for proxies that add their own keys): then it is
    ignored, logged once and named in the response's ``x-mechserve-ignored-fields`` header.  The app's
    lifespan starts ``llm``'s engine thread if it is not running yet, and then also stops it.
    """
    name = model_name or llm.model_name
    templates = "sandbox" if trust_request_chat_template else "refuse"
    llm.prompt_policy = dataclasses.replace(llm.prompt_policy, request_templates=templates)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = not llm.running
        if owned:
            llm.start()
        try:
            yield
        finally:
            if owned:
                await llm.shutdown()

    app = FastAPI(title="mechserve", version=__version__, lifespan=lifespan)
    app.state.llm = llm
    app.state.model_name = name
    app.state.created = int(time.time())
    app.state.unknown_fields = UnknownPolicy(ignore=ignore_unknown_fields)
    install(app)
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(Guard, api_key=api_key, max_body=max_request_bytes)
    app.add_middleware(Instrument, metrics=llm.metrics)
    _routes(app, llm, name)
    _tokenizer_routes(app, llm, name)
    path = _chat_path(llm, name)
    responses_routes(app, path, max_stored=max_stored_responses)
    anthropic_routes(app, path)
    return app


def _routes(app: FastAPI, llm: AsyncLLM, name: str) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if llm.error is not None:
            raise APIError(503, "the engine is dead; the server is shutting down", code="engine_dead")
        if not llm.running:
            raise APIError(503, "the engine is not running", headers={"Retry-After": "5"})
        degraded = llm.degraded
        if degraded is not None:  # data-parallel replicas: 200 only when every one is alive
            raise APIError(503, f"the server is degraded: {degraded}", code="engine_degraded")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        await llm.metrics.refresh()  # data-parallel replicas answer with their series
        body, content_type = llm.metrics.render(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(app, llm, name)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        _check_model(model_id, name)
        return JSONResponse(_model_card(app, llm, name))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        judge_unknown(request, body, COMPLETIONS)
        model_name = _check_model(body.model, name)
        prompts, params = _prepare(body, body.prompts, llm)
        await _compile(body, params, llm)
        response_id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        handles = await _submit(llm, prompts, params, response_id, fit_max_tokens=body.fit_max_tokens)
        render = _render(body, params, llm)
        shown = [_prompt(h, params, render) for h in handles]
        stream = CompletionStream(handles, response_id, model_name, params, body.include_usage, render, prompts=shown)
        if body.stream:
            return EventStream(stream.chunks(), handles, body.constraint_field)
        outputs = await _unless_disconnected(request, _drain(llm, handles, body.constraint_field), handles)
        shown = [dataclasses.replace(p, logprobs=o.prompt_logprobs) for p, o in zip(shown, outputs)]
        choices = r.completion_choices(outputs, shown, params.n, render)
        result = r.envelope("text_completion", response_id, stream.created, model_name, choices)
        result["usage"] = r.usage((len(h.prompt_token_ids) for h in handles), outputs)
        return JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        judge_unknown(request, body, CHAT)
        response_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        run = await _start_chat(llm, name, body, response_id)
        handles, params, tools, render = run.handles, run.params, run.tools, run.render
        stream = ChatStream(handles, response_id, run.model, params, body.include_usage, render, tools=tools)
        if body.stream:
            return EventStream(stream.chunks(), handles, run.constraint)
        outputs = await _unless_disconnected(request, _drain(llm, handles, run.constraint), handles)
        choices = r.chat_choices(outputs[0], render, tools)
        result = r.envelope("chat.completion", response_id, stream.created, run.model, choices)
        if render.prompt_logprobs:
            result["prompt_logprobs"] = r.vllm_prompt_logprobs(outputs[0].prompt_logprobs)
        if render.token_ids:
            result["prompt_token_ids"] = list(handles[0].prompt_token_ids)
        result["usage"] = r.usage((len(h.prompt_token_ids) for h in handles), outputs)
        return JSONResponse(result)


async def _start_chat(llm: AsyncLLM, name: str, body: ChatCompletionRequest, response_id: str) -> ChatRun:
    """A chat body checked, rendered, compiled and submitted (``ChatPath.start``: chat and the APIs translated
    into it); ``APIError`` for anything refused."""
    model_name = _check_model(body.model, name)
    prompts, params = _prepare(body, lambda: [body.chat()], llm)
    tools = body.tool_plan()
    try:
        await _compile(body, params, llm)
        handles = await _submit(llm, prompts, params, response_id, fit_max_tokens=body.fit_max_tokens)
    except APIError as exc:
        if tools.forced and exc.param == "structured_outputs":
            # the grammar is the tools' schema: a schema it cannot compile is a bad tool definition (named as
            # the body's field, not the structured_outputs.json the grammar engine was given)
            problem = re.sub(r"^structured_outputs(\.\w+)?\s", "their schema ", exc.message)
            raise APIError(
                400,
                f"tools: a function's parameters cannot be forced: {problem}",
                param="tools",
                code="invalid_value",
            ) from None
        raise
    constraint = "tools" if tools.forced else body.constraint_field
    return ChatRun(handles, params, tools, model_name, _render(body, params, llm), constraint)


def _chat_path(llm: AsyncLLM, name: str) -> ChatPath:
    """The chat path's steps for the APIs translated into it (``/v1/responses``, ``/v1/messages``)."""

    async def start(body: ChatCompletionRequest, response_id: str) -> ChatRun:
        return await _start_chat(llm, name, body, response_id)

    async def wait(request: Request, run: ChatRun) -> list[RequestOutput]:
        return await _unless_disconnected(request, _drain(llm, run.handles, run.constraint), run.handles)

    return ChatPath(llm, start, wait, lambda requested: _check_model(requested, name))


def _tokenizer_routes(app: FastAPI, llm: AsyncLLM, name: str) -> None:
    """vLLM's ``/tokenize`` (text or chat), ``/detokenize`` and ``/version``, with its response shapes."""

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        judge_unknown(request, body, "tokenize")
        _check_model(body.model, name)
        prompt: str | Chat = body.prompt if isinstance(body, TokenizeCompletionRequest) else body_chat(body)
        param = "prompt" if isinstance(body, TokenizeCompletionRequest) else "messages"
        ids = await _tokenizer_call(llm.tokenize(prompt, add_special_tokens=body.add_special_tokens), param)
        strings = await _tokenizer_call(llm.token_strings(ids), param) if body.return_token_strs else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids, "token_strs": strings}
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        judge_unknown(request, body, "detokenize")
        _check_model(body.model, name)
        return JSONResponse({"prompt": await _tokenizer_call(llm.detokenize(body.tokens), "tokens")})


def body_chat(body: TokenizeChatRequest) -> Chat:
    """The conversation of a chat ``/tokenize`` body; 400 for a field it cannot honour."""
    try:
        body.check_supported()
    except UnsupportedField as exc:
        raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    return body.chat()


async def _tokenizer_call(work: Awaitable[T], param: str) -> T:
    """``await work``: a ``ValueError`` (text that cannot be encoded, an id outside the vocabulary) is a 400
    naming ``param``; a stopped engine a 503."""
    try:
        return await work
    except EngineDeadError as exc:
        raise engine_error(exc) from None
    except ValueError as exc:
        named = exc.param if isinstance(exc, ParamError) and exc.param != "messages" else param
        raise APIError(400, str(exc), param=named, code="invalid_value") from None


def _model_card(app: FastAPI, llm: AsyncLLM, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": app.state.created,
        "owned_by": "mechserve",
        "max_model_len": llm.max_model_len,
    }


def _check_model(requested: str | None, served: str) -> str:
    """The served model's name; 404 ``model_not_found`` for any other."""
    if requested is None or requested == served:
        return served
    raise APIError(
        404, f"The model `{requested}` does not exist (this server serves `{served}`)", code="model_not_found"
    )


def _prepare(
    body: Any, prompts: Callable[[], Sequence[PromptInput]], llm: AsyncLLM
) -> tuple[list[PromptInput], SamplingParams]:
    """The body's prompts and ``SamplingParams``; a 400 naming the field for anything unsupported or invalid,
    or for a request that could never be admitted (more samples than may wait)."""
    try:
        body.check_supported()
        found = list(prompts())
        params = body.to_params()
    except UnsupportedField as exc:
        raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    except ValueError as exc:
        raise engine_error(exc, param=None) from None
    if len(found) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(found)}", param="prompt")
    limit = llm.core.config.max_waiting
    if limit is not None and len(found) * params.n > limit:
        # all of them wait at once before the next step: over max_waiting, none could ever be admitted
        raise APIError(
            400,
            f"{len(found)} prompt(s) x n={params.n} = {len(found) * params.n} requests can never be admitted: at most "
            f"max_waiting={limit} may wait; send fewer prompts or a smaller n",
            param="n",
            code="invalid_value",
        )
    return found, params


async def _compile(body: Any, params: SamplingParams, llm: AsyncLLM) -> None:
    """Compile the body's output constraint in a worker thread (cached, so the engine's admission only
    finds it); a 400 naming the body's field (``response_format``, ``guided_json``, ...) when it cannot be."""
    if params.structured_outputs is None:
        return
    try:
        await llm.compile_grammar(params)
    except ParamError as exc:
        field = body.constraint_field or exc.param
        # the body's field is the whole constraint: "structured_outputs.json cannot ..." reads "response_format
        # cannot ..." (Anthropic's messages must start with the field: "output_config.format.json" is no field)
        message = re.sub(r"^structured_outputs(\.\w+)?", field, str(exc), count=1) if field != exc.param else str(exc)
        raise APIError(400, message, param=field, code="invalid_value") from None


def _render(body: Any, params: SamplingParams, llm: AsyncLLM) -> r.Render:
    """How the response shows its choices (logprobs, echo, vLLM's extra fields), from the body."""
    tokenizer = llm.core.tokenizer  # decoding is a pure function of the tokenizer: safe off the engine thread

    def decode(ids: Sequence[int]) -> str:
        return "" if tokenizer is None else str(tokenizer.decode(list(ids)))

    return r.Render(
        logprobs=params.logprobs is not None,
        echo=bool(getattr(body, "echo", False)),
        prompt_logprobs=body.prompt_logprobs is not None,
        token_ids=bool(body.return_token_ids),
        ids_as_tokens=bool(body.return_tokens_as_token_ids),
        top_n=params.logprobs or 0,
        decode=decode,
    )


def _prompt(handle: RequestStream, params: SamplingParams, render: r.Render) -> r.Prompt:
    """A completions choice's prompt: its ids, and the text ``echo`` shows (as sent; decoded from the ids
    when it was ids or was truncated, and only when echoed)."""
    ids = handle.prompt_token_ids
    text = handle.prompt if handle.prompt is not None and params.truncate_prompt_tokens is None else None
    if text is None:
        text = render.decode(ids) if render.echo else ""
    return r.Prompt(text, ids)


async def _submit(
    llm: AsyncLLM, prompts: Sequence[PromptInput], params: SamplingParams, response_id: str, *, fit_max_tokens: bool
) -> list[RequestStream]:
    """Submit every prompt at once (one engine step takes them all); all are accepted, or none is kept."""
    ids = [response_id] if len(prompts) == 1 else [f"{response_id}-{i}" for i in range(len(prompts))]
    results = await asyncio.gather(
        *(llm.add_request(p, params, request_id=i, fit_max_tokens=fit_max_tokens) for p, i in zip(prompts, ids)),
        return_exceptions=True,
    )
    handles = [x for x in results if isinstance(x, RequestStream)]
    failure = next((x for x in results if isinstance(x, BaseException)), None)
    if failure is None:
        return handles
    for handle in handles:
        handle.abort()
    if not isinstance(failure, Exception):
        raise failure
    raise engine_error(failure, param="messages" if isinstance(prompts[0], Chat) else "prompt")


async def _drain(llm: AsyncLLM, handles: Sequence[RequestStream], constraint: str | None = None) -> list[RequestOutput]:
    """Every request's final output; a 503 if the server aborted them because it is shutting down (a
    stream says so with its ``"abort"`` chunk); a 400 naming ``constraint`` (the body's field) when one
    failed alone inside a step on its grammar (the others are aborted: the response is one)."""
    try:
        outputs = [await handle.result() for handle in handles]
    except (EngineStepError, EngineDeadError, RequestFailed) as exc:
        for handle in handles:
            handle.abort()
        raise engine_error(exc, constraint=constraint) from None
    if not llm.running and any(c.finish_reason == ABORT for o in outputs for c in o.outputs):
        raise APIError(
            503, "the server is shutting down; the request was aborted before it finished", code="shutting_down"
        )
    return outputs


async def _unless_disconnected(request: Request, work: Awaitable[T], handles: Sequence[RequestStream]) -> T:
    """``await work``, unless the client disconnects first: then abort ``handles`` (the response goes nowhere)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            for handle in handles:
                handle.abort()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the request")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Guard:
    """ASGI middleware: the API key (``Authorization: Bearer`` or Anthropic's ``x-api-key``) on every path but
    ``/health``, and a cap on the body size.

    A body declared (``Content-Length``) or found (chunked) to be over ``max_body`` bytes is a 413
    before the app reads any of it, so no oversized prompt is ever parsed or tokenized.
    """

    def __init__(self, app: ASGIApp, api_key: str | None = None, max_body: int = MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            error = self._check(scope["path"], headers)
            if error is None and b"content-length" not in headers and scope.get("method") in ("POST", "PUT", "PATCH"):
                receive, error = await self._buffered(receive)
            if error is not None:
                await error.response_for(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _buffered(self, receive: Receive) -> tuple[Receive, APIError | None]:
        """Read a body of undeclared length, up to the cap; a ``receive`` that replays it, or the 413."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return receive, self._too_large()
            chunks.append(chunk)
            more = message.get("more_body", False)
        replay: list[Any] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Any:
            return replay.pop() if replay else await receive()

        return replayed, None

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is over {self.max_body} bytes (the server's --max-request-bytes)",
            param=None,
            code="body_too_large",
        )

    def _check(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        if self.api_key is not None and path != "/health":
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)
            anthropic = secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), self.api_key)
            if not (bearer or anthropic):
                return APIError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        return None
