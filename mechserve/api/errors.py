"""The errors a caller of mechserve can meet, in one place (standard library and the spec only).

Each names what went wrong in its message; the CLI prints it as one line (exit status 2) and the
HTTP server turns it into an OpenAI-style 4xx/5xx body::

    ValueError
      ParamError          a request field (a SamplingParams field, a prompt) is invalid; param names it
      RequestRejected     m12's door refused a request (reason: the spec's RejectReason)
      RequestFailed       a request failed inside a step on its own account (its grammar); it alone ended
      KVMemoryError       the KV cache does not fit (the budget, the available memory, or allocation)
    ModelLoadError        a model could not be resolved or loaded
      HeadError           an EAGLE draft head is missing, unreadable or not for the loaded model (also a
                          ValueError: a bad ``speculative_config``)
    RuntimeError
      EngineDeadError     the background stepper is not running (never started, shut down, dead)
        EngineStoppedError  ... because its owner stopped it (a server shutting down): not a failure
      EngineStepError     an engine step raised; every request in flight ended with it
      RankError           a tensor-parallel rank crashed, hung or raised; the group was shut down
      NativeKernelError   a native kernel (paged attention, few-row linear) could not be built or loaded
"""

from __future__ import annotations

from mechserve.spec.m16_request_draft_lengths import RejectReason


class ParamError(ValueError):
    """A request's field is invalid; ``param`` is the field's name (``"logit_bias"``, ``"prompt"``, ...).

    The HTTP server answers it with a 400 whose ``param`` is this name; the CLI maps it to its flag.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class RequestRejected(ValueError):
    """m12's door refused a request.  ``reason`` is the ``RejectReason``; ``detail`` names the limit."""

    def __init__(self, request_id: str, reason: RejectReason, detail: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason.value} ({detail})")
        self.request_id = request_id
        self.reason = reason
        self.detail = detail


class RequestFailed(ValueError):
    """A request failed inside an engine step on its own account (its grammar's matcher raised, its logits
    processing raised): it alone ended, returning its pages, and every other request goes on.

    ``param`` names the request field behind it (``"structured_outputs"``) or is None; the HTTP server
    answers a 400 naming that field (a 500 without one), a stream ends with an error event.
    """

    def __init__(self, request_id: str, param: str | None, message: str) -> None:
        what = f"its {param} " if param else ""
        super().__init__(f"request {request_id!r} failed: {what}failed inside an engine step: {message}")
        self.request_id = request_id
        self.param = param
        self.detail = message


class KVMemoryError(ValueError):
    """The KV cache would not fit: over the ``kv_memory`` budget, over the available memory, or its
    allocation failed.  ``sized_by`` says what chose ``num_pages``: ``"num_pages"``, ``"kv_memory"``
    or ``"auto"``."""

    def __init__(self, message: str, *, kv_bytes: int, num_pages: int, sized_by: str) -> None:
        super().__init__(message)
        self.kv_bytes = kv_bytes
        self.num_pages = num_pages
        self.sized_by = sized_by


class ModelLoadError(Exception):
    """A model could not be resolved or loaded; the message names the problem."""


class HeadError(ModelLoadError, ValueError):
    """An EAGLE draft head (``--spec-method eagle``, ``mechserve.model.eagle``) cannot serve the loaded model:
    none was trained for it, its directory or files are missing or unreadable, it was trained for another
    model or shape, or ``eagle_draft_vocab`` asks for more ids than it ranks.

    The message is one line naming the head's directory and the fix (which ``mechserve train-draft`` to
    run).  A ``ModelLoadError`` (the CLI prints it as one line, exit status 2) and a ``ValueError`` (a
    ``speculative_config`` that cannot be served), raised when the engine is built: ``LLM``/``AsyncLLM``
    raise it and the server refuses to start.
    """


class EngineDeadError(RuntimeError):
    """The background stepper is not running (never started, shut down, or dead after a failed step)."""


class EngineStoppedError(EngineDeadError):
    """The background stepper is not running because its owner stopped it (``AsyncLLM.drain``/``shutdown``: a
    server shutting down), not because it failed; the HTTP server answers it with a 503 ``shutting_down``."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at that moment ends with this error."""


class RankError(RuntimeError):
    """A rank crashed, hung past the timeout or raised; the group was shut down and serves no more."""


class NativeKernelError(RuntimeError):
    """The native kernel could not be built or loaded (no compiler, a compile error, an ABI mismatch)."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, at most 200 characters (its type's name if it has none)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line = lines[0].strip()
    return line if len(line) <= 200 else line[:197] + "..."


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch (or Python) failing to allocate memory."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "alloc" in str(exc).lower()


__all__ = [
    "EngineDeadError",
    "EngineStepError",
    "EngineStoppedError",
    "HeadError",
    "KVMemoryError",
    "ModelLoadError",
    "NativeKernelError",
    "ParamError",
    "RankError",
    "RequestFailed",
    "RequestRejected",
    "first_line",
    "is_allocation_failure",
]
