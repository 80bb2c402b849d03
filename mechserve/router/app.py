"""``mechserve router``'s HTTP side: an OpenAI-compatible front over any number of ``mechserve serve`` workers.

Routes::

    POST /v1/completions, /v1/chat/completions   routed by m15's policy, passed through (streams chunk by chunk)
    POST /v1/messages, /v1/responses             routed alike; /v1/responses only with "store": false (a stored
                                                 response lives on one worker: the router keeps no map of them)
    GET|DELETE /v1/responses/{id}, .../cancel,   refused (400 saying why): only the worker that stored a response
      .../input_items                            has it
    POST /tokenize, /detokenize,                 passed to a live worker
      /v1/messages/count_tokens
    GET  /v1/models, /v1/models/{id}             the fleet's model (a live worker's card)
    GET  /health                                 200 while a worker is live, else 503
    GET  /workers                                every worker: state, model, last load report

A worker that fails under a request ends it with a clear error naming the worker and why: a stream with
its API's error event (OpenAI's and ``data: [DONE]``; Anthropic's ``event: error`` on /v1/messages), a plain request with 502 (it failed while answering)
or 503 (it could not be reached), and the worker leaves the live set at once.  Health checks
(``/health``, then ``/v1/models`` and ``/metrics``) run every ``health_interval`` seconds; a worker
that stops answering them also ends its requests in flight, so none waits on a worker that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from mechserve.http.errors import APIError, install
from mechserve.http.unknown import IGNORED_HEADER
from mechserve.router.events import EventSubscriber
from mechserve.router.fleet import TOKENIZED, NoWorker, Worker, WorkerFleet

log = logging.getLogger("mechserve.router")

ROUTED = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
# Streams of named events (``event: <type>``), whose failure is an ``event: error`` of their own, not ``data:``.
NAMED_EVENTS = ("/v1/messages", "/v1/responses")
NOT_STORED = (
    "the router keeps no stored responses: a stored response lives on the one worker that made it, and "
    "GET, DELETE, cancel and previous_response_id need that worker"
)
PASSED_HEADERS = ("authorization", "content-type", "accept")
# What a worker's answer says that the client must see too: the unknown keys it ignored (--ignore-unknown-fields).
PASSED_BACK = (IGNORED_HEADER,)


class Proxy:
    """The router's work: health rounds, tokenizing for the policy, forwarding, failing cleanly.

    ``fleet`` holds the workers and m15's router; ``client`` is the one httpx client for every call
    to a worker; ``worker_api_key`` is sent on the router's own calls (health, models, metrics,
    tokenize); a client's ``Authorization`` header is passed through on its requests.
    """

    def __init__(
        self,
        fleet: WorkerFleet,
        *,
        health_interval: float = 0.5,
        health_timeout: float = 1.0,
        request_timeout: float = 1800.0,
        worker_api_key: str | None = None,
        kv_events_topic: str = "",
    ) -> None:
        self.fleet = fleet
        self.events = EventSubscriber(fleet, kv_events_topic) if fleet.options.policy == "precise" else None
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.request_timeout = request_timeout
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=health_timeout))
        self.headers = {"Authorization": f"Bearer {worker_api_key}"} if worker_api_key else {}
        self.open: dict[int, set[httpx.Response]] = {}  # id(worker) -> upstream responses being read
        self.waiting: dict[int, set[asyncio.Future[httpx.Response]]] = {}  # id(worker) -> sends awaiting headers
        self._task: asyncio.Task[None] | None = None

    # health ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.events is not None:
            self.events.start()
        await self.check_all()
        self._task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.events is not None:
            await self.events.stop()
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_all()
            except Exception:  # a health round must never end the loop
                log.exception("health round failed")

    async def check_all(self) -> None:
        """One health round over every worker, then the epoch ends (the reports become m15's views)."""
        models = await asyncio.gather(*(self.check(w) for w in self.fleet.workers))
        # joined in --worker-urls order, not in the order the checks came back: the first listed worker that
        # answers names the fleet's model, so which of two models a fleet serves never depends on a race
        for worker, model in zip(self.fleet.workers, models):
            if model is not None and (worker.state != "live" or model != self.fleet.model):
                self.fleet.joined(worker, model, apply=False)  # joins, or was restarted with another model
        self.fleet.apply_live()
        self.fleet.end_epoch()

    async def check(self, worker: Worker) -> str | None:
        """``/health``, ``/v1/models``, ``/metrics`` of ``worker``: take it down if they fail, else record its
        load and return the model it serves (``check_all`` joins or refuses it)."""
        try:
            health = await self.client.get(worker.url + "/health", timeout=self.health_timeout)
            if health.status_code != 200:
                raise WorkerFailed(f"/health answered {health.status_code}")
            models = await self.client.get(worker.url + "/v1/models", headers=self.headers, timeout=self.health_timeout)
            if models.status_code != 200:
                raise WorkerFailed(f"/v1/models answered {models.status_code}")
            model = str(models.json()["data"][0]["id"])
            metrics = await self.client.get(worker.url + "/metrics", headers=self.headers, timeout=self.health_timeout)
            if metrics.status_code != 200:
                raise WorkerFailed(f"/metrics answered {metrics.status_code}")
            running, waiting, kv_usage = load_report(metrics.text)
        except (httpx.HTTPError, WorkerFailed, ValueError, KeyError, IndexError) as exc:
            if worker.state in ("live", "pending"):
                why = describe(exc)
                if isinstance(exc, httpx.TimeoutException):  # a hung worker: name the limit it broke
                    why = f"no answer within {self.health_timeout:g} s (--health-check-timeout-secs): {why}"
                await self.take_down(worker, f"health check failed: {why}")
            return None
        self.fleet.reported(worker, running, waiting, kv_usage)
        return model

    async def take_down(self, worker: Worker, reason: str) -> None:
        """Mark ``worker`` down and end every request still reading from it (each ends with its error)."""
        self.fleet.down(worker, reason)
        for sending in list(self.waiting.get(id(worker), ())):
            sending.cancel()
        for response in list(self.open.get(id(worker), ())):
            await response.aclose()

    # tokenizing ------------------------------------------------------------------------------------

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the workers see them (a live worker's ``/tokenize``), for the
        policies that read them; ``[]`` when the policy does not, or the prompt cannot be tokenized
        (the worker then answers the request with the error that names the field)."""
        if self.fleet.options.policy not in TOKENIZED or not self.fleet.live:
            return []
        if path != "/v1/completions":
            messages = chat_messages(path, body)
            if messages is None:
                return []
            query: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch goes where its first prompt is cached
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            query = {"prompt": prompt}
        worker = self.fleet.live[0]
        try:
            reply = await self.client.post(worker.url + "/tokenize", json=query, headers=self.headers)
        except httpx.HTTPError:
            return []
        if reply.status_code != 200:
            return []
        tokens = reply.json().get("tokens", [])
        return [int(t) for t in tokens]

    # forwarding ------------------------------------------------------------------------------------

    async def forward(self, request: Request, path: str) -> Response:
        """Route one completions or chat request and pass the worker's answer through."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        if path == "/v1/responses":
            refuse_stored(body)
        tokens = await self.prompt_tokens(path, body)
        request_id = f"route-{uuid.uuid4().hex}"
        try:
            worker, _ = self.fleet.route(request_id, tokens)
        except NoWorker:
            self.fleet.finish(request_id)
            raise APIError(
                503, "no worker is available: every worker is down or refused", headers={"Retry-After": "1"}
            ) from None
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        upstream = self.client.build_request("POST", worker.url + path, content=raw, headers=headers)
        sending = asyncio.ensure_future(self.client.send(upstream, stream=True))
        waiting = self.waiting.setdefault(id(worker), set())
        waiting.add(sending)
        try:
            response = await sending
        except httpx.ConnectError as exc:
            self.fleet.finish(request_id)
            await self.take_down(worker, f"a request could not reach it: {describe(exc)}")
            raise APIError(
                503, f"worker {worker.url} is unavailable: {describe(exc)}", code="worker_unavailable"
            ) from None
        except httpx.HTTPError as exc:
            self.fleet.finish(request_id)
            await self.take_down(worker, f"it failed while answering: {describe(exc)}")
            raise APIError(
                502, f"worker {worker.url} failed while answering: {describe(exc)}", code="worker_failed"
            ) from None
        except asyncio.CancelledError:
            self.fleet.finish(request_id)
            task = asyncio.current_task()
            if not sending.cancelled() or (task is not None and task.cancelling()):
                sending.cancel()
                raise  # the client went away
            raise APIError(  # take_down cancelled it: the worker stopped answering
                502, f"worker {worker.url} failed while answering: {worker.reason}", code="worker_failed"
            ) from None
        finally:
            waiting.discard(sending)
        self.open.setdefault(id(worker), set()).add(response)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                self._stream(worker, request_id, response, path),
                status_code=response.status_code,
                media_type="text/event-stream",
                headers=passed_back(response.headers),
            )
        try:
            content = await response.aread()
        except (httpx.HTTPError, httpx.StreamError) as exc:
            why = self.failure(worker, exc)
            await self.take_down(worker, f"it failed while answering: {why}")
            raise APIError(502, f"worker {worker.url} failed while answering: {why}", code="worker_failed") from None
        finally:
            await self._close(worker, request_id, response)
        return Response(
            content,
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            headers=passed_back(response.headers),
        )

    async def _stream(
        self, worker: Worker, request_id: str, response: httpx.Response, path: str
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except (httpx.HTTPError, httpx.StreamError) as exc:
            why = self.failure(worker, exc)
            await self.take_down(worker, f"it failed mid-stream: {why}")
            error = APIError(502, f"worker {worker.url} failed mid-stream: {why}", code="worker_failed")
            if path in NAMED_EVENTS:  # the API's own error event: Anthropic's body, or the Responses API's
                event = (
                    error.anthropic_body()
                    if path == "/v1/messages"
                    else {"type": "error", "code": error.code, "message": error.message, "param": None}
                )
                yield b"\n\nevent: error\ndata: " + json.dumps(event).encode() + b"\n\n"
            else:
                yield b"\n\ndata: " + json.dumps(error.body()).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await self._close(worker, request_id, response)

    def failure(self, worker: Worker, exc: BaseException) -> str:
        """Why reading from ``worker`` failed, for people: the health round's reason when it took the worker
        down under the read (a hung worker: its checks timed out), a timeout named with its limit, else the
        exception."""
        if worker.state == "down" and worker.reason:
            return f"it was taken down ({worker.reason})"
        if isinstance(exc, httpx.TimeoutException):
            return f"it sent nothing for {self.request_timeout:g} s (--request-timeout-secs): {describe(exc)}"
        return describe(exc)

    async def _close(self, worker: Worker, request_id: str, response: httpx.Response) -> None:
        self.open.get(id(worker), set()).discard(response)
        await response.aclose()
        self.fleet.finish(request_id)

    async def pass_through(self, request: Request, path: str) -> Response:
        """A request any worker answers alike (tokenize, models): sent to the first live worker."""
        if not self.fleet.live:
            raise APIError(503, "no worker is available: every worker is down or refused", headers={"Retry-After": "1"})
        worker = self.fleet.live[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}
        try:
            reply = await self.client.request(
                request.method, worker.url + path, content=await request.body(), headers=headers
            )
        except httpx.HTTPError as exc:
            await self.take_down(worker, f"a request could not reach it: {describe(exc)}")
            raise APIError(
                503, f"worker {worker.url} is unavailable: {describe(exc)}", code="worker_unavailable"
            ) from None
        return Response(
            reply.content,
            status_code=reply.status_code,
            media_type=reply.headers.get("content-type"),
            headers=passed_back(reply.headers),
        )


def passed_back(headers: httpx.Headers) -> dict[str, str]:
    """The worker's answer's headers the client sees too (``PASSED_BACK``)."""
    return {name: headers[name] for name in PASSED_BACK if name in headers}


def refuse_stored(body: dict[str, Any]) -> None:
    """``APIError`` 400 naming the field of a ``/v1/responses`` body that needs a stored response (module
    docstring): ``store`` left out or true (OpenAI's default is true), ``background`` or ``previous_response_id``."""
    if body.get("previous_response_id") is not None:
        raise APIError(400, f"previous_response_id: {NOT_STORED}", param="previous_response_id")
    if body.get("background"):
        raise APIError(400, f"background: {NOT_STORED}; send it to a worker directly", param="background")
    if body.get("store", True) is not False:
        raise APIError(400, f'store: {NOT_STORED}; send "store": false, or send it to a worker directly', param="store")


def chat_messages(path: str, body: dict[str, Any]) -> list[Any] | None:
    """The chat messages ``/tokenize`` reads for a chat, Messages or Responses body (the prompt the policy
    routes by), or None when the body's shape is not one the router reads (the policy then routes without it)."""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        return [_text_only(m) for m in messages] if isinstance(messages, list) else None
    if path == "/v1/messages":
        messages, system = body.get("messages"), body.get("system")
        if not isinstance(messages, list):
            return None
        head = [{"role": "system", "content": system}] if isinstance(system, (str, list)) and system else []
        return [_text_only(m) for m in head + messages]
    given, instructions = body.get("input"), body.get("instructions")
    head = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
    if isinstance(given, str):
        return [*head, {"role": "user", "content": given}]
    if isinstance(given, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in given):
        return head + [{"role": m["role"], "content": m["content"]} for m in given]
    return None


def _text_only(message: Any) -> Any:
    """A message as ``/tokenize`` reads it: a text part's (block's) text alone, without the keys a chat
    message's part does not have (Anthropic's ``cache_control``, which ``/tokenize`` refuses as unknown)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    text = ("type", "text")
    parts = [
        {k: p[k] for k in text if k in p} if isinstance(p, dict) and p.get("type") == "text" else p for p in content
    ]
    return {**message, "content": parts}


class WorkerFailed(Exception):
    """A worker answered a check with something other than success."""


def describe(exc: BaseException) -> str:
    """One line for a failure: its class and message (httpx's often have none)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_report(text: str) -> tuple[int, int, float]:
    """``(running, waiting, kv_usage)`` from a worker's Prometheus text: vLLM's ``num_requests_running``,
    ``num_requests_waiting`` and ``kv_cache_usage_perc`` gauges, summed over engines (usage: the mean).
    Raises ``ValueError`` when one is missing."""
    found: dict[str, list[float]] = {}
    wanted = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            found[family.name] = [s.value for s in family.samples]
    missing = wanted - {k for k, v in found.items() if v}
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(sorted(missing))}")
    usage = found["vllm:kv_cache_usage_perc"]
    return (
        int(sum(found["vllm:num_requests_running"])),
        int(sum(found["vllm:num_requests_waiting"])),
        sum(usage) / len(usage),
    )


def build_router_app(proxy: Proxy) -> FastAPI:
    """The router's FastAPI app over ``proxy`` (started and stopped with the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="mechserve router", lifespan=lifespan)
    install(app)
    fleet = proxy.fleet

    @app.get("/health")
    async def health() -> JSONResponse:
        live = len(fleet.live)
        return JSONResponse({"live_workers": live}, status_code=200 if live else 503)

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"model": fleet.model, "policy": fleet.options.policy, "workers": _cards(fleet.workers)})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.pass_through(request, "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await proxy.pass_through(request, f"/v1/models/{model_id}")

    for path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens"):
        app.add_api_route(path, _passed(proxy, path), methods=["POST"])
    for path in ROUTED:
        app.add_api_route(path, _routed(proxy, path), methods=["POST"])

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.post("/v1/responses/{response_id}/cancel")
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored(response_id: str) -> Response:
        raise APIError(400, f"{NOT_STORED}; ask that worker directly", code="unsupported_by_router")

    return app


def _cards(workers: Sequence[Worker]) -> list[dict[str, Any]]:
    return [w.to_json() for w in workers]


def _routed(proxy: Proxy, path: str) -> Any:
    async def route(request: Request) -> Response:
        return await proxy.forward(request, path)

    return route


def _passed(proxy: Proxy, path: str) -> Any:
    async def passed(request: Request) -> Response:
        return await proxy.pass_through(request, path)

    return passed
