"""The async engine: ``AsyncLLM``, the m12 engine serving requests that arrive while it runs.

One background thread owns the ``EngineCore`` and steps it
(``mechserve.serving.engine_thread``); an asyncio program submits requests,
streams their tokens and aborts them, and its event loop never waits on a
forward pass::

    >>> async with AsyncLLM("smollm2") as llm:
    ...     async for event in llm.stream("The capital of France is", SamplingParams(temperature=0, max_tokens=8)):
    ...         print(event.text, end="", flush=True)
    ...     out = await llm.generate("def fibonacci(n):", SamplingParams(max_tokens=32))

A request is accepted or refused at once (``RequestRejected`` names the
limit: empty prompt, too long, never fits the pool, ``max_waiting`` requests
already waiting); an accepted one yields one ``StreamEvent`` per engine step
that gave it text or tokens, the last one carrying its ``RequestOutput``.
``abort`` (or leaving a ``stream`` early) takes it out of the engine before
the next step: its private pages return, its cached prompt pages stay cached,
the step record lists it under ``aborted``.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

from mechserve.backends.engine import DEFAULT_MAX_STEP_TOKENS, EngineConfig
from mechserve.backends.models import EMBEDDED, LoadedModel
from mechserve.backends.speculative import SpeculativeConfig
from mechserve.engine_core import EngineCore, RequestRejected
from mechserve.llm import open_engine, speculative
from mechserve.outputs import RequestOutput, SampleDelta, StepOutput
from mechserve.params import SamplingParams
from mechserve.serving.engine_thread import AddCommand, EngineThread
from mechserve.serving.events import (
    Admission,
    Chat,
    EngineDeadError,
    EngineStepError,
    PromptInput,
    StreamEvent,
)
from mechserve.serving.metrics import ServingMetrics

__all__ = [
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MAX_WAITING",
    "AsyncLLM",
    "Chat",
    "EngineDeadError",
    "EngineStepError",
    "RequestRejected",
    "RequestStream",
    "StreamEvent",
    "merge_events",
]

T = TypeVar("T")
# A long-lived engine bounds both queues: at most this many requests run at once, this many more may wait.
DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_WAITING = 256


class RequestStream:
    """One accepted request's events, in step order; iterate it once (``async for``) or ``await result()``.

    ``prompt``, ``prompt_token_ids`` and ``params`` (with ``max_tokens``
    as fitted) are set on acceptance; ``output`` once the last event has
    been read.  Iterating raises ``EngineStepError`` / ``EngineDeadError`` if
    the engine failed or shut down under the request.
    """

    def __init__(self, request_id: str, engine: EngineThread) -> None:
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.params: SamplingParams | None = None
        self.output: RequestOutput | None = None
        self._engine = engine
        self._items: deque[StreamEvent | BaseException] = deque()  # delivered, not yet read
        self._ready = asyncio.Event()
        self._done = False

    @property
    def finished(self) -> bool:
        """Whether the last event (or an error) has been read."""
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.output is not None:
            self._done = True
            self.output = item.output
        return item

    def coalesced(self) -> AsyncIterator[StreamEvent]:
        """Like iterating, but every event already waiting when the consumer comes back is merged into one
        (a slow consumer, such as a busy HTTP server, sends fewer, larger chunks; nothing is lost)."""
        return _Coalesced(self)

    async def result(self) -> RequestOutput:
        """Read the remaining events; return the final ``RequestOutput``."""
        async for _ in self:
            pass
        assert self.output is not None
        return self.output

    def abort(self) -> None:
        """Take the request out of the engine before its next step, unless it already ended; returns at once."""
        if not self._done:
            self._engine.abort(self.request_id)

    def _accept(self, admission: Admission) -> None:
        self.prompt = admission.prompt
        self.prompt_token_ids = admission.prompt_token_ids
        self.params = admission.params

    def _put(self, item: StreamEvent | BaseException) -> None:
        self._items.append(item)
        self._ready.set()


class _Coalesced:
    """``RequestStream.coalesced()``: an iterator object, not a generator, so there is nothing to close."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def __aiter__(self) -> _Coalesced:
        return self

    async def __anext__(self) -> StreamEvent:
        s = self.stream
        events = [await s.__anext__()]
        while not s.finished and s._items and not isinstance(s._items[0], BaseException):
            events.append(await s.__anext__())
        return merge_events(events)


def merge_events(events: Sequence[StreamEvent]) -> StreamEvent:
    """Consecutive events of one request as one: per sample, ids, text and logprobs joined, the last finish."""
    if len(events) == 1:
        return events[0]
    merged: dict[int, SampleDelta] = {}
    for event in events:
        for d in event.samples:
            a = merged.get(d.index)
            merged[d.index] = d if a is None else _join(a, d)
    token_text = {k: v for event in events for k, v in event.token_text.items()}
    last = events[-1]
    samples = tuple(merged[i] for i in sorted(merged))
    return StreamEvent(last.request_id, samples, last.output, MappingProxyType(token_text))


def _join(a: SampleDelta, b: SampleDelta) -> SampleDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or ()), *(b.logprobs or ())]
    return replace(b, token_ids=[*a.token_ids, *b.token_ids], text=a.text + b.text, logprobs=logprobs)


class AsyncLLM:
    """A model served by the m12 engine to requests that arrive while it runs; an async context manager.

    ``model`` and the engine sizes are ``LLM``'s (``"smollm2"``, a local
    Hugging Face directory or a ``LoadedModel``; ``dtype``,
    ``max_step_tokens``, ``page_size``, ``num_pages`` / ``kv_memory``,
    ``prefix_caching``, ``hold_shared_prefix``, ``spec_len``, ``speculative_config``, ``max_model_len``,
    ``seed``), plus the
    admission limits: ``max_running`` requests run at once (the rest wait)
    and at most ``max_waiting`` wait; beyond that a request is refused
    ``OVERLOADED`` (None lifts a limit).  ``trace=True`` keeps every step
    record in ``trace``; ``on_step`` sees every ``StepOutput`` on the engine
    thread.  ``model_name`` names the model in metrics and in the server.
    ``world_size``: tensor-parallel rank processes (see ``EngineCore``).

    The model is loaded and the KV cache allocated here; the engine thread
    starts with ``start()`` or ``async with`` and stops with ``shutdown()``
    (or leaving the block), which aborts what is still running.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel = EMBEDDED,
        *,
        dtype: str = "float32",
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory: int | None = None,
        prefix_caching: bool = True,
        hold_shared_prefix: bool = True,
        spec_len: int = 0,
        max_running: int | None = DEFAULT_MAX_RUNNING,
        max_waiting: int | None = DEFAULT_MAX_WAITING,
        max_model_len: int | None = None,
        seed: int | None = 0,
        trace: bool = False,
        on_step: Callable[[StepOutput], None] | None = None,
        model_name: str | None = None,
        world_size: int = 1,
        speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
    ) -> None:
        config = EngineConfig(
            max_step_tokens=max_step_tokens,
            page_size=page_size,
            num_pages=num_pages,
            spec_len=spec_len,
            kv_memory=kv_memory,
            max_model_len=max_model_len,
            prefix_caching=prefix_caching,
            hold_shared_prefix=hold_shared_prefix,
            max_running=max_running,
            max_waiting=max_waiting,
            world_size=world_size,
            speculative=speculative(speculative_config),
        )
        loaded, self.core = open_engine(model, dtype, config, seed)
        self.model_name = model_name or (os.fspath(model) if not isinstance(model, LoadedModel) else loaded.path.name)
        self.metrics = ServingMetrics(self.model_name)
        self._engine = EngineThread(self.core, self.metrics, on_step=on_step, keep_trace=trace)

    # Lifecycle ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (once)."""
        self._engine.start()

    async def shutdown(self) -> None:
        """Abort every live request and stop the engine thread (joined off the event loop)."""
        await asyncio.to_thread(self._engine.stop)
        self.core.close()

    async def __aenter__(self) -> AsyncLLM:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    @property
    def running(self) -> bool:
        """Whether the engine thread runs and takes requests."""
        return self._engine.alive

    @property
    def error(self) -> BaseException | None:
        """The failure that killed the engine, if it is dead."""
        return self._engine.error

    @property
    def trace(self) -> list[Any]:
        """Every step record so far (with ``trace=True``; else empty)."""
        return list(self._engine.trace or ())

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + output a request may have."""
        return self.core.max_model_len

    # Requests -----------------------------------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        fit_max_tokens: bool = False,
    ) -> RequestStream:
        """Submit one request; return its ``RequestStream`` once the engine has accepted it.

        ``prompt``: text, token ids, a vLLM-style dict (``{"prompt": ...}``
        or ``{"prompt_token_ids": [...]}``) or a ``Chat``.  ``params``
        default to vLLM's (temperature 1.0, max_tokens 16).
        ``fit_max_tokens`` lowers ``max_tokens`` to what the prompt leaves of
        the model's context and of the pool (OpenAI chat's "as many as fit").
        Raises ``RequestRejected`` (a ``ValueError``) when m12's door refuses
        it, ``ValueError`` for a prompt that cannot be encoded or a token id
        outside the vocabulary, ``EngineDeadError`` when the engine is not
        running.  Cancelled while waiting, it aborts the request.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
        stream = RequestStream(request_id, self._engine)
        command = AddCommand(
            request_id, prompt, params, stream._put, asyncio.get_running_loop(), fit_max_tokens=fit_max_tokens
        )
        future = self._engine.add(command)
        try:
            admission = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._engine.abort(request_id)  # queued after the add: it cannot miss it
            raise
        stream._accept(admission)
        return stream

    async def stream(
        self, prompt: PromptInput, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[StreamEvent]:
        """Submit a request and yield its events as the engine produces them; leaving early aborts it.

        Raises what ``add_request`` raises, before the first event.
        """
        handle = await self.add_request(prompt, params, request_id=request_id)
        try:
            async for event in handle:
                yield event
        finally:
            handle.abort()

    async def generate(
        self, prompt: PromptInput, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestOutput:
        """Submit a request and return its ``RequestOutput`` when it ends; cancelling the call aborts it."""
        handle = await self.add_request(prompt, params, request_id=request_id)
        try:
            return await handle.result()
        finally:
            handle.abort()

    async def chat(
        self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None, **kwargs: Any
    ) -> RequestOutput:
        """``generate`` on one conversation through the model's chat template."""
        return await self.generate(Chat(messages), params, **kwargs)

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Take a request out of the engine before its next step; await it to learn whether it was live.

        Its private pages return at once, its cached prompt pages stay
        cached; its stream ends with finish reason ``"abort"``.
        """
        return asyncio.wrap_future(self._engine.abort(request_id))

    # The engine, between steps ------------------------------------------------------------------------------------

    async def run_in_engine(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread between two steps and return its result (tests, debugging)."""
        return await asyncio.wrap_future(self._engine.call(fn))

    def call_in_engine(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """``run_in_engine`` for any thread: a ``concurrent.futures.Future`` of ``fn(core)``."""
        return self._engine.call(fn)

    async def page_counts(self) -> dict[str, int]:
        """``{"free", "cached", "private"}`` pages of the pool, read between two steps."""
        return await self.run_in_engine(lambda core: core.page_counts())

    async def check_pages(self) -> None:
        """``EngineCore.check_pages`` between two steps: raises ``AssertionError`` on a leak or inconsistency."""
        await self.run_in_engine(lambda core: core.check_pages())
