"""Every failure as an OpenAI-style error body, ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
under ``/v1/messages``).

Status codes, so that bad input never reads as a server fault::

    400 invalid_request_error   malformed JSON, a wrong type, a value out of range, an unsupported field,
                                text that is not valid Unicode, a prompt the engine refuses (empty, too
                                long, never fits the KV pool, a token id outside the vocabulary), a
                                request that could never be admitted (more samples than max_waiting)
    401 invalid_request_error   a missing or wrong API key (code invalid_api_key)
    404 invalid_request_error   an unknown model (code model_not_found) or path
    405, 413                    wrong method, body over --max-request-bytes (before anything reads it)
    429 overloaded_error        max_waiting requests already wait (m12's OVERLOADED); Retry-After is set
    400 invalid_value           a request whose own constraint failed inside an engine step (it alone ended;
                                param: the body's constraint field)
    500 server_error            an engine step failed under the request (a bug or out of memory); the body
                                names the step and the kind of failure, never its text (which may hold a
                                rank's pid or a grammar): the server's log has that, once
    503 server_error            the engine is not running: code shutting_down once the server is stopping
                                (a request that arrives then, or a non-streaming request aborted by it;
                                a stream ends with a finish_reason "abort" chunk), code engine_dead when
                                it died after a failure

Under ``/v1/messages`` (Anthropic's Messages API) the same statuses carry Anthropic's error body,
``{"type": "error", "error": {"type", "message"}}``, whose message starts with the field it names
(``max_tokens: Field required``), as Anthropic's do; the type follows the status (``ANTHROPIC_TYPES``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mechserve.api.errors import (
    EngineDeadError,
    EngineStepError,
    EngineStoppedError,
    ParamError,
    RequestFailed,
    RequestRejected,
)
from mechserve.spec.m16_request_draft_lengths import RejectReason

log = logging.getLogger("mechserve.http")
RETRY_AFTER_SECONDS = 1
# m12's door refusal -> (status, code)
_REJECT = {
    RejectReason.EMPTY_PROMPT: (400, "empty_prompt"),
    RejectReason.TOO_LONG: (400, "context_length_exceeded"),
    RejectReason.NEVER_FITS: (400, "context_length_exceeded"),
    RejectReason.BAD_MAX_NEW_TOKENS: (400, "invalid_value"),
    RejectReason.DUPLICATE_ID: (400, "duplicate_request_id"),
    RejectReason.OVERLOADED: (429, "overloaded"),
}


ANTHROPIC_PREFIX = "/v1/messages"  # the paths whose errors take Anthropic's shape
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors); any other 5xx is api_error.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body: the type from the status, the message led by the field it names."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = self.message
        if self.param and not message.startswith(self.param):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response_for(self, path: str) -> JSONResponse:
        """The response for a request to ``path``: Anthropic's body under ``/v1/messages``, else OpenAI's."""
        body = self.anthropic_body() if is_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's (``/v1/messages``, ``/v1/messages/count_tokens``)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def engine_error(exc: Exception, param: str | None = "prompt", constraint: str | None = None) -> APIError:
    """What ``AsyncLLM.add_request`` (or a stream) raised, as an ``APIError``; ``constraint``: the body field
    that gave the request its ``structured_outputs`` (``response_format``, ``guided_json``, ``tools``, ...)."""
    if isinstance(exc, RequestFailed):
        if exc.param is None:
            return APIError(500, str(exc))
        named = constraint if exc.param == "structured_outputs" and constraint else exc.param
        return APIError(400, str(exc).replace(exc.param, named, 1), param=named, code="invalid_value")
    if isinstance(exc, RequestRejected):
        status, code = _REJECT.get(exc.reason, (400, None))
        if exc.reason is RejectReason.OVERLOADED:
            return APIError(
                429,
                f"the server is overloaded: {exc.detail}; retry later",
                type="overloaded_error",
                code=code,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        return APIError(status, _reject_text(exc.reason, exc.detail), param=param, code=code)
    if isinstance(exc, EngineStoppedError):
        return APIError(503, f"the server is shutting down: {exc}", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}", code="engine_dead", headers={"Retry-After": "5"})
    if isinstance(exc, EngineStepError):
        return APIError(500, _step_failure(exc), code="engine_step_failed")
    if isinstance(exc, ParamError):
        named = exc.param
        if param == "messages" and named == "prompt":  # a chat's prompt is its messages
            named = "messages"
        return APIError(400, str(exc), param=named, code="invalid_value")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param, code="invalid_value")
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


def _step_failure(exc: EngineStepError) -> str:
    """What a client learns of a failed step: which step and what kind of error, not its message."""
    cause = exc.__cause__
    step = str(exc).split(":", 1)[0]  # "engine step N failed"
    kind = f" ({type(cause).__name__})" if cause is not None else ""
    return f"{step}{kind} while running this request; the request ended, the server's log has the details"


def _reject_text(reason: RejectReason, detail: str) -> str:
    if reason is RejectReason.EMPTY_PROMPT:
        return f"{detail}; give a prompt that encodes to at least one token"
    if reason is RejectReason.TOO_LONG:
        return f"the request does not fit the model's context: {detail}; shorten the prompt or lower max_tokens"
    if reason is RejectReason.NEVER_FITS:
        return f"the request can never fit the KV cache: {detail}; shorten the prompt or lower max_tokens"
    return f"the request was refused ({reason.value}): {detail}"


# FastAPI's detail for a body json.loads failed on with anything but JSONDecodeError (a RecursionError: too deep).
FASTAPI_PARSE_ERROR = "There was an error parsing the body"


def validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's most telling complaint about the body as a 400 naming the field.

    A union (``stop``: a string or a list of strings) fails once per member;
    a constraint broken by the member the value has the type of (a list too
    long) says more than "not a string", so it is reported first.  Union
    member tags (``str``, ``list[str]``, a model's name) are left out of the
    field's path.
    """
    errors = sorted(exc.errors(), key=lambda e: str(e.get("type", "")).endswith("_type"))
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    loc = [str(part) for part in first.get("loc", ())[1:] if not _UNION_TAG.match(str(part))]
    if not loc:
        return APIError(400, f"the request body must be a JSON object ({first.get('msg')})", code="invalid_json")
    param = ".".join(loc)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, f"{param}: {first.get('msg')}{more}", param=param, code="invalid_value")


# What pydantic puts in an error's location for the member of a union: str, list[int], TextPart, function-after[...]
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*[\[\]-].*)$")


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` with an OpenAI error body (and never a stack trace)."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, bytes) and exc.body:  # FastAPI reads a body as JSON only under a JSON content type
            content_type = request.headers.get("content-type", "")
            error = APIError(
                400,
                f"the request body was sent as Content-Type {content_type!r}: send it as JSON with "
                "'Content-Type: application/json'",
                code="invalid_content_type",
            )
            return error.response_for(request.url.path)
        return validation_error(exc).response_for(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 400 and exc.detail == FASTAPI_PARSE_ERROR:  # json.loads failed past JSONDecodeError
            cause = exc.__cause__
            why = "it is nested too deeply" if isinstance(cause, RecursionError) else type(cause).__name__
            message = f"the request body could not be parsed as JSON: {why}"
            return APIError(400, message, code="invalid_json").response_for(request.url.path)
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "error"
        message = (
            exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else f"{phrase}: {request.url.path}"
        )
        kind = "not_found_error" if status == 404 else None
        error = APIError(status, message, type=kind, headers=getattr(exc, "headers", None))
        return error.response_for(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path, exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response_for(request.url.path)
