"""The async engine: ``AsyncLLM``, the m13 engine serving requests that arrive while it runs.

One background thread owns the ``EngineCore`` and steps it
(``mechserve.entrypoints.stepper``); an asyncio program submits requests,
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

Request input never runs on the engine thread nor on the event loop: prompts are checked against
``prompt_policy`` (its ``max_prompt_chars`` before any tokenization), rendered and tokenized in a
worker thread (a request's own chat template, where the policy allows it, in a ``TemplateSandbox``
child process), and grammars are compiled in a worker thread too; the engine thread only admits
ids.  ``error`` tells a dead engine: a failed step it could not recover from, or a rank that died
(``EngineDeadError`` for every request after).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar

from mechserve.api.config import EngineConfig, engine_config
from mechserve.api.errors import EngineDeadError, EngineStepError, RequestRejected
from mechserve.api.limits import MIN_PROMPT_CHARS
from mechserve.api.outputs import RequestOutput, SampleDelta, StepOutput
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore, EngineStats
from mechserve.entrypoints.events import Admission, StreamEvent
from mechserve.entrypoints.metrics import ServingMetrics
from mechserve.entrypoints.prompts import Chat, PromptInput, PromptPolicy, parse_prompt, tokenize
from mechserve.entrypoints.sandbox import TemplateSandbox
from mechserve.entrypoints.stepper import AddCommand, Stepper
from mechserve.model.checkpoint import EMBEDDED
from mechserve.model.loader import LoadedModel

__all__ = [
    "AsyncLLM",
    "Chat",
    "EngineDeadError",
    "EngineStepError",
    "RequestRejected",
    "RequestStream",
    "StreamEvent",
    "merge_events",
    "prompt_char_limit",
]

T = TypeVar("T")


class RequestStream:
    """One accepted request's events, in step order; iterate it once (``async for``) or ``await result()``.

    ``prompt``, ``prompt_token_ids`` and ``params`` (with ``max_tokens``
    as fitted) are set on acceptance; ``output`` once the last event has
    been read.  Iterating raises ``RequestFailed`` if the request failed alone
    inside a step (its grammar), ``EngineStepError`` / ``EngineDeadError`` if
    the engine failed or shut down under the request.
    """

    def __init__(self, request_id: str, engine: Stepper) -> None:
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.params: SamplingParams | None = None
        self.output: RequestOutput | None = None
        self._stepper = engine
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
            self._stepper.abort(self.request_id)

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
    last = events[-1]
    samples = tuple(merged[i] for i in sorted(merged))
    return StreamEvent(last.request_id, samples, last.output)


def _join(a: SampleDelta, b: SampleDelta) -> SampleDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or ()), *(b.logprobs or ())]
    return replace(
        b,
        token_ids=[*a.token_ids, *b.token_ids],
        text=a.text + b.text,
        logprobs=logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


def prompt_char_limit(tokenizer: Any, max_model_len: int | None) -> int | None:
    """The most characters a prompt can have and still fit ``max_model_len`` tokens: the longest vocabulary
    entry (for byte-level and SentencePiece vocabularies, at least as many characters as its text) times
    ``max_model_len``, and at least ``MIN_PROMPT_CHARS``; None without a tokenizer or a context length."""
    if tokenizer is None or not max_model_len or not hasattr(tokenizer, "get_vocab"):
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max(longest * max_model_len, MIN_PROMPT_CHARS)


class AsyncLLM:
    """A model served by the m13 engine to requests that arrive while it runs; an async context manager.

    ``model`` and the engine settings are ``LLM``'s, with the same defaults (``"smollm2"``, a local
    Hugging Face directory or a ``LoadedModel``; any field of ``EngineConfig``, vLLM's names for
    them, ``speculative_config``, or a whole ``config``): among them the admission limits,
    ``max_running`` requests run at once (the rest wait) and at most ``max_waiting`` wait, beyond
    which a request is refused ``OVERLOADED`` (None lifts a limit).  ``trace=True`` keeps every
    step record in ``trace``; ``on_step`` sees every ``StepOutput`` on the engine thread.
    ``model_name`` names the model in metrics and in the server.  ``prompt_policy`` (a ``PromptPolicy``)
    says how far prompts are trusted; by default a conversation's own template is rendered in process
    (the caller is trusted: ``build_app`` makes the server refuse them) and text over
    ``prompt_char_limit`` (its longest token times ``max_model_len`` characters) is refused.

    The model is loaded and the KV cache allocated here; the engine thread starts with
    ``start()`` or ``async with`` and stops with ``shutdown()`` (or leaving the block), which
    aborts what is still running.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel = EMBEDDED,
        *,
        trace: bool = False,
        on_step: Callable[[StepOutput], None] | None = None,
        model_name: str | None = None,
        config: EngineConfig | None = None,
        prompt_policy: PromptPolicy | None = None,
        **engine_args: Any,
    ) -> None:
        self.core = EngineCore.open(model, engine_config(config, engine_args))
        loaded_name = model.path.name if isinstance(model, LoadedModel) else os.fspath(model)
        self.model_name = model_name or loaded_name
        self.metrics = ServingMetrics(self.model_name, self.core.max_model_len)
        self._stepper = Stepper(self.core, self.metrics, on_step=on_step, keep_trace=trace)
        limit = prompt_char_limit(self.core.tokenizer, self.core.max_model_len)
        self.prompt_policy = prompt_policy or PromptPolicy(max_prompt_chars=limit)
        self._sandbox: TemplateSandbox | None = None

    # Lifecycle ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (once)."""
        self._stepper.start()

    async def drain(self) -> None:
        """Refuse new requests (``EngineDeadError``) and abort every live one, then stop the engine thread;
        returns once the aborts' last events (finish reason ``"abort"``) are on their way to their streams.
        A server calls it when it begins to shut down, so that every response in flight can still end
        properly; ``shutdown`` then only releases what is left.  A request template being rendered in the
        sandbox is stopped too (its request is refused at once)."""
        if self._sandbox is not None:
            self._sandbox.close()
        await asyncio.to_thread(self._stepper.stop)

    async def shutdown(self) -> None:
        """Abort every live request and stop the engine thread (joined off the event loop); end the template
        sandbox."""
        if self._sandbox is not None:
            self._sandbox.close()
        await self.drain()
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
        return self._stepper.alive

    @property
    def error(self) -> BaseException | None:
        """The failure that killed the engine, if it is dead."""
        return self._stepper.error

    @property
    def degraded(self) -> str | None:
        """What part of the engine is down while the rest serves (data-parallel replicas), or None."""
        return None

    @property
    def trace(self) -> list[Any]:
        """Every step record so far (with ``trace=True``; else empty)."""
        return list(self._stepper.trace or ())

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
        A ``params.structured_outputs`` constraint is compiled in a worker
        thread before the engine sees the request (``ParamError`` when it
        cannot be).  Raises ``RequestRejected`` (a ``ValueError``) when m12's door refuses
        it, ``ValueError`` for a prompt that cannot be encoded or a token id
        outside the vocabulary, ``EngineDeadError`` when the engine is not
        running.  Cancelled while waiting, it aborts the request.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not self.running:
            raise self._stepper.refusal()
        if params.structured_outputs is not None:
            # Compile (or find cached) here, in a worker thread, so that the engine thread's add_request
            # only hits the cache: a new schema never stalls the step loop (ParamError: a 400).
            await self.compile_grammar(params)
        # Render and tokenize here too: the engine thread only admits ids.
        text, ids = await asyncio.to_thread(self.encode, prompt)
        request_id = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
        stream = RequestStream(request_id, self._stepper)
        encoded = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
        command = AddCommand(
            request_id, encoded, params, stream._put, asyncio.get_running_loop(), fit_max_tokens=fit_max_tokens
        )
        future = self._stepper.add(command)
        try:
            admission = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._stepper.abort(request_id)  # queued after the add: it cannot miss it
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
        return asyncio.wrap_future(self._stepper.abort(request_id))

    # Request input, off the engine thread and the event loop ------------------------------------------------------

    def encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """``(text or None, ids)`` of one prompt under ``prompt_policy`` (``parse_prompt``); blocking, for a
        worker thread (``add_request`` runs it in one).  Raises what ``parse_prompt`` raises."""
        return parse_prompt(prompt, self.core.tokenizer, self.prompt_policy, self._template_sandbox())

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` in a worker thread (cached: the engine's admission then finds
        it); ``ParamError("structured_outputs")`` when it cannot be compiled or served."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.core.compile_grammar, params.structured_outputs)

    def _template_sandbox(self) -> TemplateSandbox | None:
        if self.prompt_policy.request_templates != "sandbox":
            return None
        if self._sandbox is None:
            limit = self.prompt_policy.max_prompt_chars
            self._sandbox = TemplateSandbox(max_chars=limit) if limit is not None else TemplateSandbox()
        return self._sandbox

    # The tokenizer ------------------------------------------------------------------------------------------------

    async def tokenize(self, prompt: str | Chat, *, add_special_tokens: bool | None = None) -> list[int]:
        """The ids the engine would run for ``prompt`` (text, or a ``Chat`` through the chat template);
        ``add_special_tokens`` as ``mechserve.entrypoints.prompts.tokenize``, under ``prompt_policy``.  Runs in
        a worker thread.  Raises ``ValueError`` for a prompt that cannot be encoded (``ParamError`` naming
        the field for one too long or a refused chat template)."""
        sandbox = self._template_sandbox()
        return await asyncio.to_thread(
            tokenize, self.core.tokenizer, prompt, add_special_tokens, self.prompt_policy, sandbox
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens kept); ``ValueError`` for an id outside the vocabulary."""
        core = self.core

        def decode() -> str:
            ids = list(token_ids)
            bad = next(
                (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < core.vocab_size), None
            )
            if bad is not None:
                raise ValueError(f"tokens: {bad!r} is not a token id of this model (0..{core.vocab_size - 1})")
            if core.tokenizer is None:
                raise ValueError("detokenizing needs a tokenizer; this model was loaded without one")
            return str(core.tokenizer.decode(ids))

        return await asyncio.to_thread(decode)

    async def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The tokenizer's string for each id (``convert_ids_to_tokens``: byte-level pieces, not decoded text)."""
        tokenizer = self.core.tokenizer
        return await asyncio.to_thread(lambda: [str(t) for t in tokenizer.convert_ids_to_tokens(list(token_ids))])

    # The engine, between steps ------------------------------------------------------------------------------------

    async def run_in_engine(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread between two steps and return its result (tests, debugging)."""
        return await asyncio.wrap_future(self._stepper.call(fn))

    def call_in_engine(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """``run_in_engine`` for any thread: a ``concurrent.futures.Future`` of ``fn(core)``."""
        return self._stepper.call(fn)

    async def stats(self) -> EngineStats:
        """``EngineCore.stats()`` read between two steps: requests running and waiting, pages, counters."""
        return await self.run_in_engine(lambda core: core.stats())

    async def check_pages(self) -> None:
        """``EngineCore.check_pages`` between two steps: raises ``AssertionError`` on a leak or inconsistency."""
        await self.run_in_engine(lambda core: core.check_pages())
