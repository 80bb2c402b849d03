"""What crosses between the API server and a data-parallel replica: msgspec structs, msgpack on ZeroMQ.

Every message is one tagged struct, decoded against its union (``ToReplica`` / ``FromReplica``), so
msgspec checks every field's type on the way in; nothing read from a socket is unpickled.  The API
server PUSHes to each replica's PULL socket; every replica PUSHes to the server's one PULL socket as
two frames, ``[replica index (2 bytes, big-endian), payload]``::

    API server -> replica      Add (a request: prompt ids, SamplingParams with its structured outputs and n,
                               its arrival time), Abort, Query (pages or metrics), Shutdown
    replica -> API server      Ready / StartFailed (once), Admitted / Refused (per Add), Events (one per step:
                               every request's StreamEvent), Failed (a request that ended with an error),
                               Load (after each step: running, waiting, KV usage and the step's KV events as
                               vLLM's KVEventBatch payload), Pages / Metrics (a Query's answer), Dead

The request and output types are the engine's own dataclasses (``SamplingParams``, ``StreamEvent``
with its ``SampleDelta`` and ``RequestOutput``): msgspec encodes and validates dataclasses, so the
schema is theirs and there is no second copy of it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mechserve.api.config import EngineConfig
from mechserve.api.errors import (
    EngineDeadError,
    EngineStepError,
    EngineStoppedError,
    ParamError,
    RequestFailed,
    RequestRejected,
)
from mechserve.api.params import SamplingParams
from mechserve.entrypoints.events import StreamEvent
from mechserve.spec.m16_request_draft_lengths import RejectReason

# The API server's messages --------------------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, frozen=True):
    """Submit one request (all ``params.n`` samples run on this replica); ``arrival`` is the API server's
    ``time.perf_counter()`` when it was submitted (CLOCK_MONOTONIC: one clock for every process here)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    fit_max_tokens: bool
    arrival: float


class Abort(msgspec.Struct, tag=True, frozen=True):
    """Take ``request_id`` out of the replica's engine before its next step (its pages return)."""

    request_id: str


class Query(msgspec.Struct, tag=True, frozen=True):
    """Ask the replica for its pages (``"pages"``, read between two steps) or its metrics (``"metrics"``)."""

    query_id: int
    what: Literal["pages", "metrics"]


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """Abort every request (their streams end with ``"abort"``) and exit."""


ToReplica = Add | Abort | Query | Shutdown

# The replica's messages -----------------------------------------------------------------------------------------


class WireError(msgspec.Struct, frozen=True):
    """An exception that ended a request or refused it, by kind (``error_of`` gives it back)."""

    kind: str
    message: str
    param: str | None = None
    reason: str | None = None
    detail: str | None = None


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The replica loaded its model and allocated its pool: what the server's startup line and checks need."""

    pid: int
    max_model_len: int | None
    vocab_size: int
    num_pages: int
    kv_bytes: int
    sized_by: str
    threads: int
    weights: str


class StartFailed(msgspec.Struct, tag=True, frozen=True):
    """The replica could not start (its model, its pool): ``message`` is the one line to print."""

    message: str


class Admitted(msgspec.Struct, tag=True, frozen=True):
    """``Add`` accepted: the prompt ids it runs with and its params (``max_tokens`` as fitted)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class Refused(msgspec.Struct, tag=True, frozen=True):
    """``Add`` refused (m12's door, a bad id, a grammar that cannot be compiled, an engine shutting down)."""

    request_id: str
    error: WireError


class Events(msgspec.Struct, tag=True, frozen=True):
    """One step's events, one per request it touched, in step order (the last carries the output)."""

    events: list[StreamEvent]


class Failed(msgspec.Struct, tag=True, frozen=True):
    """``request_id`` ended with an error (failed alone inside a step, a failed step, a shutdown)."""

    request_id: str
    error: WireError


class Load(msgspec.Struct, tag=True, frozen=True):
    """After a step: requests ``running`` and ``waiting``, ``kv_usage`` (vLLM's ``kv_cache_usage_perc``),
    and the prefix cache's changes in that step as vLLM's ``KVEventBatch`` msgpack (``mechserve.kv_events``),
    or None when it published and evicted nothing."""

    running: int
    waiting: int
    kv_usage: float
    kv_events: bytes | None = None


class Pages(msgspec.Struct, tag=True, frozen=True):
    """A ``pages`` query's answer: the pool (``total``, ``free``, ``cached``, ``private``), whether the engine
    holds no request (``idle``) and m14's pool check (``problem``: None when it passed)."""

    query_id: int
    total: int
    free: int
    cached: int
    private: int
    idle: bool
    problem: str | None


class Sample(msgspec.Struct, array_like=True, frozen=True):
    name: str
    labels: dict[str, str]
    value: float


class Family(msgspec.Struct, array_like=True, frozen=True):
    """One Prometheus metric family as ``prometheus_client`` collects it."""

    name: str
    documentation: str
    type: str
    unit: str
    samples: list[Sample]


class Metrics(msgspec.Struct, tag=True, frozen=True):
    """A ``metrics`` query's answer: every family of the replica's registry (its series carry ``engine``)."""

    query_id: int
    families: list[Family]


class Dead(msgspec.Struct, tag=True, frozen=True):
    """The replica's engine died (a step it could not recover from); it exits after this message."""

    message: str


FromReplica = Ready | StartFailed | Admitted | Refused | Events | Failed | Load | Pages | Metrics | Dead


class ReplicaSpec(msgspec.Struct, frozen=True):
    """How a replica process starts (JSON on its command line): the model, its engine config, its index
    among ``size`` replicas, its torch threads and the two ZeroMQ endpoints (it connects to both)."""

    model: str
    config: EngineConfig
    index: int
    size: int
    threads: int
    model_name: str
    inbox: str
    outbox: str


# Encoding ---------------------------------------------------------------------------------------------------------

ENCODER = msgspec.msgpack.Encoder()
TO_REPLICA = msgspec.msgpack.Decoder(ToReplica)
FROM_REPLICA = msgspec.msgpack.Decoder(FromReplica)

_ERRORS = ("RequestRejected", "RequestFailed", "ParamError", "EngineStoppedError", "EngineDeadError", "EngineStepError")


def wire_error(exc: BaseException) -> WireError:
    """``exc`` as a ``WireError`` (its kind, message and the fields the HTTP layer reads)."""
    kind = type(exc).__name__
    if isinstance(exc, RequestRejected):
        return WireError("RequestRejected", str(exc), reason=exc.reason.value, detail=exc.detail)
    if isinstance(exc, RequestFailed):
        return WireError("RequestFailed", str(exc), param=exc.param, detail=exc.detail)
    if isinstance(exc, ParamError):
        return WireError("ParamError", str(exc), param=exc.param)
    if isinstance(exc, EngineStepError):
        cause = exc.__cause__
        return WireError("EngineStepError", str(exc), detail=None if cause is None else type(cause).__name__)
    if kind in _ERRORS:
        return WireError(kind, str(exc))
    if isinstance(exc, EngineDeadError):
        return WireError("EngineDeadError", str(exc))
    if isinstance(exc, ValueError):
        return WireError("ValueError", str(exc))
    return WireError("EngineStepError", f"{kind}: {exc}", detail=kind)


def error_of(wire: WireError, request_id: str) -> Exception:
    """The exception a ``WireError`` stands for, raised where the request's caller reads it."""
    if wire.kind == "RequestRejected" and wire.reason is not None:
        return RequestRejected(request_id, RejectReason(wire.reason), wire.detail or "")
    if wire.kind == "RequestFailed":
        return RequestFailed(request_id, wire.param, wire.detail or "")
    if wire.kind == "ParamError":
        return ParamError(wire.param or "prompt", wire.message)
    if wire.kind == "EngineStoppedError":
        return EngineStoppedError(wire.message)
    if wire.kind == "EngineDeadError":
        return EngineDeadError(wire.message)
    if wire.kind == "EngineStepError":
        error = EngineStepError(wire.message)
        if wire.detail:  # the HTTP layer names the cause's kind, never its message
            error.__cause__ = type(wire.detail, (Exception,), {})()
        return error
    return ValueError(wire.message)
