"""The background stepper: one thread owns an ``EngineCore`` and steps it while requests arrive.

Nothing but this thread touches the core (its scheduler, its executor, its
tokenizer), so the core stays what it is, synchronous and single-threaded,
and an event loop never waits on a forward pass::

    any thread                                  the engine thread
    ──────────                                  ─────────────────
    add / abort / call ──> commands (deque) ──┐ waits on a condition while idle (no busy loop)
                           + notify           └─> applies every queued command between two steps
                                                  core.step() -> StepOutput
                                                  metrics (the step, core.stats()), trace, on_step
    deliver(event) <── loop.call_soon_threadsafe <─ one StreamEvent per request the step touched

A command answers through a ``concurrent.futures.Future`` (``asyncio.wrap_future``
makes it awaitable, ``.result()`` waits for it from any other thread).  An
accepted request's events go to the ``deliver`` callback it came with, on the
event loop it came from, in step order; its last event carries its
``RequestOutput``.  A request that fails inside a step on its own account
(its grammar) ends alone with its ``RequestFailed``; a step that raises ends
every request in flight with an ``EngineStepError``; if the engine cannot then
be brought back to a consistent, empty state it is dead (``error``) and
refuses everything after.
A step that fails because the executor itself is gone (a tensor-parallel rank
died: ``RankError``, or the executor says it is ``closed``) kills the engine at
once: every request in flight ends with an ``EngineDeadError`` and the failure
is logged once, with one traceback (vLLM's ``EngineDeadError``); whoever runs
the engine (the server) then stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from mechserve.api.errors import EngineDeadError, EngineStepError, EngineStoppedError, RankError
from mechserve.api.outputs import SampleDelta, StepOutput
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.entrypoints.events import Admission, StreamEvent
from mechserve.entrypoints.metrics import ServingMetrics
from mechserve.entrypoints.prompts import PromptInput, parse_prompt

__all__ = ["AddCommand", "Stepper", "fitted"]

log = logging.getLogger("mechserve.engine")
T = TypeVar("T")
IDLE_CHECK_S = 0.5  # while idle, the engine thread asks its executor this often whether it is still whole


Deliver = Callable[[StreamEvent | BaseException], None]


@dataclass(eq=False)
class AddCommand:
    """Submit a request; ``deliver`` (called on ``loop``) receives its events, or the error that ended it."""

    request_id: str
    prompt: PromptInput
    params: SamplingParams
    deliver: Deliver
    loop: asyncio.AbstractEventLoop
    fit_max_tokens: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    future: Future[Admission] = field(default_factory=Future)


@dataclass(eq=False)
class _Command:
    """Abort a request (``request_id``) or run ``fn(core)`` on the engine thread."""

    fn: Callable[[EngineCore], Any]
    future: Future[Any] = field(default_factory=Future)


@dataclass(eq=False)
class _Live:
    """An accepted request as the engine thread follows it: where its events go and its timings."""

    deliver: Deliver
    loop: asyncio.AbstractEventLoop
    arrival: float
    engine_ids: list[str]
    max_tokens: int
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)  # sample index -> time of its last tokens


class Stepper:
    """Steps ``core`` on a background thread; ``add``, ``abort`` and ``call`` may be used from any thread.

    ``metrics`` receives every step and request timing; ``on_step`` (if
    given) sees every ``StepOutput`` on the engine thread, before the
    step's events are delivered; with ``keep_trace`` every step record is
    appended to ``trace``.
    """

    def __init__(
        self,
        core: EngineCore,
        metrics: ServingMetrics | None = None,
        *,
        on_step: Callable[[StepOutput], None] | None = None,
        keep_trace: bool = False,
        name: str = "mechserve-engine",
    ) -> None:
        self.core = core
        self.metrics = metrics or ServingMetrics()
        self.on_step = on_step
        self.trace: list[Any] | None = [] if keep_trace else None
        self.error: BaseException | None = None
        self._commands: deque[AddCommand | _Command] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._live: dict[str, _Live] = {}
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._gauges()

    # Any thread ---------------------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the thread runs and takes requests (started, not stopping, not dead)."""
        return self._thread.is_alive() and not self._stopping and self.error is None

    @property
    def queued(self) -> int:
        """Commands waiting for the next step boundary."""
        with self._cv:
            return len(self._commands)

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def add(self, command: AddCommand) -> Future[Admission]:
        """Queue a request; the future gives its ``Admission`` or the ``ValueError`` that refused it."""
        self._submit(command)
        return command.future

    def abort(self, request_id: str) -> Future[bool]:
        """Queue an abort; the future says whether the request was still live."""
        return self.call(lambda core: core.abort(request_id))

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run ``fn(core)`` on the engine thread between two steps; the future gives its result."""
        command = _Command(fn)
        self._submit(command)
        return command.future

    def stop(self, timeout: float | None = None) -> None:
        """Abort every live request (their streams end with finish reason ``"abort"``) and join the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _submit(self, command: AddCommand | _Command) -> None:
        with self._cv:
            if self._stopping or self.error is not None or not self._thread.is_alive():
                command.future.set_exception(self.refusal())
                return
            self._commands.append(command)
            self._cv.notify()

    def refusal(self) -> EngineDeadError:
        """Why a request is refused now: ``EngineStoppedError`` once its owner stopped the engine (``stop``), else
        ``EngineDeadError`` (dead after a failure, or never started)."""
        if self.error is None and self._stopping:
            return EngineStoppedError("the engine is not running: it was stopped (the server is shutting down)")
        if self.error is not None:
            return EngineDeadError("the engine is dead after a failed step")
        return EngineDeadError("the engine is not running")

    # The engine thread --------------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug of this module: nobody must wait for ever
            log.critical("the engine thread died", exc_info=exc)
            self.error = EngineDeadError(f"the engine thread died: {type(exc).__name__}: {exc}")
            with self._cv:
                pending, self._commands = list(self._commands), deque()
            for command in pending:
                if command.future.set_running_or_notify_cancel():
                    command.future.set_exception(self.error)
            self._deliver([(live, self.error) for live in self._live.values()])
            self._live.clear()

    def _loop(self) -> None:
        while True:
            with self._cv:
                idle = not (self._commands or self._stopping or self._has_work())
                if idle:
                    self._cv.wait(IDLE_CHECK_S)
                commands, stopping = list(self._commands), self._stopping
                self._commands.clear()
            if idle and not (commands or stopping):
                self._check_executor()
                continue
            for command in commands:
                self._apply(command)
            if stopping:
                self._shutdown()
                return
            if self._has_work():
                self._step()

    def _check_executor(self) -> None:
        """Between steps, while idle: an executor that can tell it lost a part (a rank group whose process died,
        ``check_alive``) kills the engine now, not at the next request."""
        check = getattr(self.core.executor, "check_alive", None)
        if self.error is not None or check is None:
            return
        try:
            check()
        except Exception as exc:
            self._fail(exc, idle=True)

    def _has_work(self) -> bool:
        return self.error is None and self.core.has_unfinished()

    def _apply(self, command: AddCommand | _Command) -> None:
        if not command.future.set_running_or_notify_cancel():  # its caller was cancelled before it ran
            return
        if isinstance(command, _Command):
            try:
                command.future.set_result(command.fn(self.core))
            except Exception as exc:
                command.future.set_exception(exc)
            return
        try:
            if self._stopping or self.error is not None:
                raise self.refusal()
            admission = self._admit(command)
        except Exception as exc:
            command.future.set_exception(exc)
            return
        command.future.set_result(admission)

    def _admit(self, c: AddCommand) -> Admission:
        """Encode the prompt, fit ``max_tokens`` if asked, and submit it to the core (which may refuse it)."""
        text, ids = parse_prompt(c.prompt, self.core.tokenizer)
        params = fitted(c.params, len(ids), self.core) if c.fit_max_tokens else c.params
        request_id = self.core.add_request(ids, params, request_id=c.request_id, prompt=text)
        engine_ids = [request_id] if params.n == 1 else [f"{request_id}#{j}" for j in range(params.n)]
        self._live[request_id] = _Live(c.deliver, c.loop, c.arrival, engine_ids, params.max_tokens)
        return Admission(request_id, text, self.core.prompt_token_ids(request_id), params)

    def _step(self) -> None:
        try:
            out = self.core.step()
        except Exception as exc:
            self._fail(exc)
            return
        now = time.perf_counter()
        if self.trace is not None:
            self.trace.append(out.record)
        if self.on_step is not None:
            try:
                self.on_step(out)
            except Exception:
                log.exception("on_step raised; ignored")
        events = self._events(out, now)
        self.metrics.observe_step(out, now)
        self._gauges()
        self._deliver(events)  # last: whoever reads an event sees the metrics of its step

    def _events(self, out: StepOutput, now: float) -> list[tuple[_Live, StreamEvent | BaseException]]:
        """One event per request the step touched (its error for a request that failed alone); timings to the
        metrics; ended requests forgotten."""
        events: list[tuple[_Live, StreamEvent | BaseException]] = []
        for request_id, error in out.failed.items():
            failed = self._live.get(request_id)
            if failed is not None:
                self._forget(request_id)
                events.append((failed, error))
        deltas: dict[str, list[SampleDelta]] = {}
        for d in out.deltas:
            deltas.setdefault(d.request_id, []).append(d)
        finished = {o.request_id: o for o in out.finished}
        for request_id in dict.fromkeys([*deltas, *finished]):
            live = self._live.get(request_id)
            if live is None:
                continue
            samples = tuple(sorted(deltas.get(request_id, ()), key=lambda d: d.index))
            self._time(live, samples, now)
            output = finished.get(request_id)
            if output is not None:
                self._forget(request_id)
                self.metrics.observe_finished(output, live.arrival, now, live.max_tokens)
            events.append((live, StreamEvent(request_id, samples, output)))
        return events

    def _time(self, live: _Live, samples: Sequence[SampleDelta], now: float) -> None:
        gaps = []
        for d in samples:
            if not d.token_ids:
                continue
            if live.first_token is None:
                live.first_token = now
                self.metrics.observe_ttft(now - live.arrival)
            if d.index in live.last_token:
                gaps.append(now - live.last_token[d.index])
            live.last_token[d.index] = now
        if gaps:
            self.metrics.observe_itl(gaps)

    def _forget(self, request_id: str) -> None:
        self._live.pop(request_id)

    def _deliver(self, events: Sequence[tuple[_Live, StreamEvent | BaseException]]) -> None:
        """Hand each event to its request's loop; one ``call_soon_threadsafe`` per loop and step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Deliver, StreamEvent | BaseException]]] = {}
        for live, event in events:
            by_loop.setdefault(live.loop, []).append((live.deliver, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                for _, event in items:
                    request_id = getattr(event, "request_id", None)
                    if request_id in self._live:
                        self.core.abort(request_id)

    def _gauges(self) -> None:
        """The engine's state after the step: requests running and waiting, pages by owner."""
        self.metrics.observe_engine(self.core.stats())

    def _fail(self, exc: Exception, idle: bool = False) -> None:
        """A step raised (``idle``: the executor failed its check between steps): end every request in flight
        with the error, then try to get back to an empty engine (unless the executor is gone: then the engine
        is dead at once)."""
        step = self.core.step_counter
        what = "the executor failed its check while idle" if idle else f"engine step {step} failed"
        log.error("%s", what, exc_info=exc)
        if isinstance(exc, RankError) or getattr(self.core.executor, "closed", False):
            dead = EngineDeadError(f"the engine is dead: {what} ({type(exc).__name__}: its executor is gone)")
            dead.__cause__ = exc
            self.error = dead
            self._deliver([(live, dead) for live in self._live.values()])
            for request_id in list(self._live):  # their pages go back to the (driver's) pool
                with contextlib.suppress(Exception):
                    self.core.abort(request_id)
            self._live.clear()
            self._gauges()
            return
        error = EngineStepError(f"engine step {step} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        ended = list(self._live.items())
        self._deliver([(live, error) for _, live in ended])
        for request_id, _ in ended:
            self._forget(request_id)
        try:
            for request_id, _ in ended:
                self.core.abort(request_id)
            for _ in range(3):  # the aborts' record; nothing else is left to run
                if not self.core.has_unfinished():
                    break
                self.core.step()
            self.core.check_pages()
            assert not self.core.has_unfinished(), "the engine still has work after aborting everything"
        except Exception as again:  # whatever it is, the engine cannot go on
            log.error("the engine could not recover; it refuses every request from now on", exc_info=again)
            self.error = error
        self._gauges()

    def _shutdown(self) -> None:
        """Abort what is left, deliver the aborts' last events, refuse anything queued later."""
        if self.error is None:
            for request_id in list(self._live):
                self.core.abort(request_id)
            while self._has_work():  # one step records the aborts (a failing step ends them with its error)
                self._step()
        ended = EngineStoppedError("the engine shut down") if self.error is None else self.refusal()
        leftover = [(live, ended) for live in self._live.values()]
        self._deliver(leftover)
        self._live.clear()


def fitted(params: SamplingParams, prompt_len: int, core: EngineCore) -> SamplingParams:
    """``params`` with ``max_tokens`` lowered to what a prompt of ``prompt_len`` leaves of the model's context
    and of the page pool (``EngineCore.max_new_tokens_for``); to 1 when nothing is left (m12's door then
    names the limit)."""
    room = core.max_new_tokens_for(prompt_len)
    if params.max_tokens <= room:
        return params
    return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


def _deliver_all(items: Sequence[tuple[Deliver, StreamEvent | BaseException]]) -> None:
    for deliver, event in items:
        deliver(event)
