"""``DataParallelLLM``: the ``AsyncLLM`` the API server runs over N engine-core processes (vLLM's DP client).

``serve --data-parallel-size N`` (``-dp N``) starts N replica processes (``mechserve.dp.replica``), each a
whole engine with its own pool and prefix cache on ``threads // N`` CPU threads, and serves them behind
the one API server.  The API server keeps only the tokenizer (it renders and tokenizes prompts and
checks grammars, as ``AsyncLLM`` does off the engine thread) and routes each request with m15's router
through ``mechserve.router.fleet.WorkerFleet``, the same call ``mechserve router`` makes (one copy of
every policy): the replicas' load reports (after every step) are the views, their KV events the
``precise`` index.  All ``n`` samples of a request go to one replica.

Faults: a replica process that exits (killed, or its engine dead) is down at once (its exit is seen
within ``WATCH_S``): every request it held ends with an ``EngineDeadError`` naming it (a stream's error
event, a plain request's 503), the router routes to the others, ``/health`` answers 503 naming it
(``degraded``), and it is not restarted (vLLM does not restart a DP engine either).  Only when every
replica is down is the whole engine dead (``error``), and the server exits with status 1 for its
supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq

from mechserve.api.config import EngineConfig
from mechserve.api.errors import EngineDeadError, EngineStoppedError, RequestRejected
from mechserve.api.params import SamplingParams
from mechserve.dp import available_threads
from mechserve.dp.metrics import FleetMetrics
from mechserve.dp.wire import (
    ENCODER,
    FROM_REPLICA,
    Abort,
    Add,
    Admitted,
    Dead,
    Events,
    Failed,
    Load,
    Metrics,
    Pages,
    Query,
    Ready,
    Refused,
    ReplicaSpec,
    Shutdown,
    StartFailed,
    error_of,
)
from mechserve.engine.admission import Grammars
from mechserve.entrypoints.async_llm import AsyncLLM, RequestStream, prompt_char_limit
from mechserve.entrypoints.events import Admission
from mechserve.entrypoints.prompts import PromptInput, PromptPolicy
from mechserve.router.fleet import TOKENIZED, RouterOptions, WorkerFleet
from mechserve.spec.m16_request_draft_lengths import RejectReason

log = logging.getLogger("mechserve.dp")
T = TypeVar("T")
POLICIES = ("precise", "cache_aware", "round_robin", "least_loaded")
"""``--routing-policy``'s choices (m15's policies a real router serves), the default first."""
WATCH_S = 0.1  # how often the API server looks at the replica processes
START_TIMEOUT_S = 600.0  # a replica loads its model within this
STARTED_GRACE_MS = 1000  # after a replica exited during startup, how long its last message (why) may take to arrive
QUERY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
KEEP_DECISIONS = 10_000  # the router's decision log keeps its newest entries only (a server runs for days)


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s engine config: ``config`` with the seed of its unseeded sampling requests moved to
    ``config.seed + index`` (None stays None: every replica then seeds itself afresh).

    Each replica's sampler draws unseeded requests' randomness from one generator seeded with ``seed``; with
    the same seed everywhere, the k-th unseeded request of two replicas would draw the same numbers, so the
    same prompt sent twice (one copy per replica) would sample the same text.  Megatron-LM seeds its
    data-parallel ranks ``seed + dp_rank`` for the same reason.  Replica 0 keeps ``config.seed``; seeded
    requests (``SamplingParams.seed``) are untouched, so their ids do not depend on the replica."""
    if config.seed is None:
        return config
    return config.replace(seed=config.seed + index)


@dataclass
class Front:
    """What the API server holds of the model in place of an ``EngineCore``: the engine ``config``, the
    ``tokenizer``, the replicas' ``vocab_size`` and ``max_model_len`` and each replica's pool, and the
    grammar compiler that checks a constraint before any replica sees it (``compile_grammar``)."""

    config: EngineConfig
    tokenizer: Any
    vocab_size: int
    max_model_len: int | None
    num_pages: int
    kv_bytes: int
    sized_by: str
    memory: str
    speculative: Any = None
    grammars: Grammars = field(init=False)

    def __post_init__(self) -> None:
        self.grammars = Grammars(
            self.tokenizer, self.vocab_size, allow_additional_properties=self.config.allow_additional_properties
        )

    def compile_grammar(self, so: Any) -> Any:
        """``so`` compiled for the tokenizer (cached); ``ParamError`` as ``EngineCore.compile_grammar``."""
        return self.grammars.compile(so)


@dataclass(eq=False)
class _Replica:
    index: int
    process: subprocess.Popen[bytes]
    inbox: zmq.Socket[bytes]
    pid: int = 0
    threads: int = 0
    alive: bool = True
    reason: str = ""


@dataclass(eq=False)
class _Request:
    stream: RequestStream
    replica: int
    admitted: asyncio.Future[Admission]


class _Aborter:
    """What a ``RequestStream`` calls to abort its request: the abort goes to the request's replica."""

    def __init__(self, client: DataParallelLLM) -> None:
        self.client = client

    def abort(self, request_id: str) -> Future[bool]:
        return self.client._abort(request_id)


class DataParallelLLM(AsyncLLM):
    """``data_parallel_size`` engine-core processes behind one ``AsyncLLM`` interface (see the module docstring).

    ``model`` must be loadable by path in another process (``"smollm2"``, a directory, a GGUF file, or a
    ``LoadedModel`` with its ``path``); ``config`` is every replica's engine config, but for the seed of
    unseeded requests, ``seed + index`` on replica ``index`` (``replica_config``); ``threads`` (default
    every CPU this process may use, at least one per replica) is split evenly, ``threads // data_parallel_size`` per replica;
    ``routing_policy`` is one of ``POLICIES``.  ``kv_events`` (a ``KVEventPublisher``, optional) republishes
    every replica's KV events with its ``data_parallel_rank``.  The replicas start here and this returns
    once each has loaded its model.  Raises ``ValueError`` for fewer threads than replicas, an unknown
    policy, or a replica that failed to start (its one-line reason).
    """

    def __init__(
        self,
        model: Any = "smollm2",
        *,
        data_parallel_size: int,
        config: EngineConfig,
        model_name: str | None = None,
        routing_policy: str = "precise",
        threads: int | None = None,
        prompt_policy: PromptPolicy | None = None,
        kv_events: Any = None,
        start_timeout: float = START_TIMEOUT_S,
    ) -> None:
        from mechserve.model.checkpoint import resolve_model
        from mechserve.model.loader import tokenizer_of

        size = data_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {size!r}")
        if routing_policy not in POLICIES:
            raise ValueError(f"unknown routing policy {routing_policy!r}; choose from {', '.join(POLICIES)}")
        threads = max(available_threads(), size) if threads is None else threads
        if threads < size:
            raise ValueError(
                f"--threads {threads} is fewer than --data-parallel-size {size}: each replica needs at least one thread"
            )
        path = getattr(model, "path", None)
        model_arg = str(path) if path is not None else os.fspath(model)
        tokenizer = tokenizer_of(resolve_model(model_arg))
        self.model_name = model_name or model_arg
        self.size = size
        self.policy = routing_policy
        self.kv_events = kv_events
        self.threads_each = threads // size
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="mechserve-dp-")
        self._outbox = self._context.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(f"ipc://{self._dir}/out")
        self._replicas: list[_Replica] = []
        self._requests: dict[str, _Request] = {}
        self._queries: dict[int, tuple[int, asyncio.Future[Any]]] = {}
        self._next_query = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self._started = False
        self._closed = False
        self._error: EngineDeadError | None = None
        self._sandbox = None
        try:
            ready = self._spawn(model_arg, config, start_timeout)
        except BaseException:
            self._close()
            raise
        first = ready[0]
        self.core = Front(  # type: ignore[assignment]  # the API server holds no engine: see Front
            config,
            tokenizer,
            first.vocab_size,
            first.max_model_len,
            first.num_pages,
            first.kv_bytes,
            first.sized_by,
            first.weights,
            speculative=config.speculative,
        )
        self.fleet_metrics = FleetMetrics(self.model_name, size)
        self.fleet_metrics.refresher = self.refresh_metrics
        self.metrics = self.fleet_metrics  # type: ignore[assignment]  # the server's render/observe_http/refresh
        limit = prompt_char_limit(tokenizer, first.max_model_len)
        self.prompt_policy = prompt_policy or PromptPolicy(max_prompt_chars=limit)
        self.fleet = WorkerFleet(
            [f"engine {i}" for i in range(size)],
            RouterOptions(routing_policy, block_size=config.page_size),
            keep_log=KEEP_DECISIONS,
        )
        self._worker_index = {id(w): i for i, w in enumerate(self.fleet.workers)}
        for worker in self.fleet.workers:
            self.fleet.joined(worker, self.model_name, apply=False)
        self.fleet.apply_live()

    # Startup ------------------------------------------------------------------------------------------------------

    def _spawn(self, model: str, config: EngineConfig, timeout: float) -> list[Ready]:
        """Start every replica and wait for each one's ``Ready``; ``ValueError`` for one that fails."""
        import mechserve

        # the replicas import the same mechserve as this process, wherever it was imported from
        source = os.path.dirname(os.path.dirname(os.path.abspath(mechserve.__file__)))
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads_each), "PYTHONPATH": path}
        for i in range(self.size):
            inbox = self._context.socket(zmq.PUSH)
            inbox.setsockopt(zmq.LINGER, 0)
            inbox.bind(f"ipc://{self._dir}/in-{i}")
            spec = ReplicaSpec(
                model, replica_config(config, i), i, self.size, self.threads_each, self.model_name,
                f"ipc://{self._dir}/in-{i}", f"ipc://{self._dir}/out",
            )  # fmt: skip
            argv = [sys.executable, "-m", "mechserve.dp.replica", msgspec.json.encode(spec).decode()]
            # a session of its own: a terminal's Ctrl-C or a signal to the server's process group reaches the
            # server alone, which then shuts the replicas down in order (each exits by itself if the server dies)
            process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            self._replicas.append(_Replica(i, process, inbox))
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.size:
            for r in self._replicas:
                # a replica that failed to start sends why (StartFailed) before it exits: read that first
                if r.index not in ready and r.process.poll() is not None and not self._outbox.poll(STARTED_GRACE_MS):
                    raise ValueError(
                        f"data-parallel replica {r.index} exited with status {r.process.returncode} before it was ready"
                    )
            if time.monotonic() > deadline:
                raise ValueError(f"data-parallel replicas not ready after {timeout:g} s")
            if not self._outbox.poll(100):
                continue
            header, payload = self._outbox.recv_multipart()
            index = int.from_bytes(header, "big")
            message = FROM_REPLICA.decode(payload)
            if isinstance(message, StartFailed):
                raise ValueError(message.message)
            if isinstance(message, Ready):
                ready[index] = message
                self._replicas[index].pid = message.pid
                self._replicas[index].threads = message.threads
        return [ready[i] for i in range(self.size)]

    # Lifecycle ----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start taking requests: the socket reader and the replicas' watcher, on the running event loop."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="mechserve-dp-reader", daemon=True)
        self._reader.start()
        self._watcher = asyncio.ensure_future(self._watch())

    async def drain(self) -> None:
        """Refuse new requests and abort every live one: each replica aborts what it holds (their streams end
        with ``"abort"``) and exits; returns once they have."""
        if self._sandbox is not None:
            self._sandbox.close()
        if self._stopping:
            return
        self._stopping = True
        for r in self._replicas:
            if r.alive:
                self._send(r, Shutdown())
        await asyncio.to_thread(self._wait_exits, STOP_TIMEOUT_S)
        await asyncio.sleep(0.05)  # the reader's last messages reach the loop
        for rid in list(self._requests):
            self._end(rid, EngineStoppedError("the engine shut down"))

    async def shutdown(self) -> None:
        """``drain``, then stop the reader and the watcher, close the sockets and remove the socket folder."""
        await self.drain()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        self._close()

    def _wait_exits(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for r in self._replicas:
            try:
                r.process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("data-parallel replica %d did not exit; killing it", r.index)
                r.process.kill()
                r.process.wait()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self._replicas:
            if r.process.poll() is None:
                r.process.kill()
                with contextlib.suppress(Exception):
                    r.process.wait(10)
        if self._reader is not None:
            self._reader.join(2)
        for r in self._replicas:
            r.inbox.close()
        self._outbox.close()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        """Whether the replicas take requests (started, not stopping, at least one alive)."""
        return self._started and not self._stopping and self._error is None

    @property
    def error(self) -> BaseException | None:
        """``EngineDeadError`` once every replica is down (the server then exits with status 1)."""
        return self._error

    @property
    def degraded(self) -> str | None:
        """Which replicas are down and why (``/health`` answers 503 with it), or None when all are alive."""
        down = [r for r in self._replicas if not r.alive]
        if not down:
            return None
        named = "; ".join(f"replica {r.index} (pid {r.pid}) is down: {r.reason}" for r in down)
        return f"{named} ({self.size - len(down)} of {self.size} data-parallel replicas serve)"

    @property
    def trace(self) -> list[Any]:
        return []

    @property
    def max_model_len(self) -> int | None:
        return self.core.max_model_len

    def replica_pids(self) -> list[int]:
        """Each replica's process id, in replica order."""
        return [r.pid for r in self._replicas]

    # Requests -----------------------------------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        fit_max_tokens: bool = False,
    ) -> RequestStream:
        """``AsyncLLM.add_request``, on the replica m15's router chooses (all ``n`` samples on that one)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not self.running:
            raise self.refusal()
        if params.structured_outputs is not None:
            await self.compile_grammar(params)
        text, ids = await asyncio.to_thread(self.encode, prompt)
        if not self.running:
            raise self.refusal()
        rid = f"req-{uuid.uuid4().hex}" if request_id is None else str(request_id)
        if rid in self._requests:
            raise RequestRejected(rid, RejectReason.DUPLICATE_ID, "a request with this id is still running")
        try:
            worker, _ = self.fleet.route(rid, ids if self.policy in TOKENIZED else ())
        except Exception as exc:  # NoWorker: every replica is down
            raise EngineDeadError(f"no data-parallel replica is alive: {exc}") from None
        replica = self._replicas[self._worker_index[id(worker)]]
        stream = RequestStream(rid, _Aborter(self))  # type: ignore[arg-type]  # what it calls is abort()
        admitted: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._requests[rid] = _Request(stream, replica.index, admitted)
        if not self._send(replica, Add(rid, text, ids, params, fit_max_tokens, time.perf_counter())):
            self._forget(rid)
            raise EngineDeadError(f"data-parallel replica {replica.index} takes no requests: its queue is full")
        try:
            admission = await admitted
        except asyncio.CancelledError:
            self._abort(rid)
            raise
        stream._accept(admission)
        return stream

    def refusal(self) -> EngineDeadError:
        if self._error is not None:
            return self._error
        if self._stopping:
            return EngineStoppedError("the engine is not running: it was stopped (the server is shutting down)")
        return EngineDeadError("the engine is not running")

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        """Send an abort to the request's replica; the future says whether the request was live here."""
        return asyncio.wrap_future(self._abort(request_id))

    def _abort(self, request_id: str) -> Future[bool]:
        done: Future[bool] = Future()
        req = self._requests.get(request_id)
        if req is not None and self._replicas[req.replica].alive:
            self._send(self._replicas[req.replica], Abort(request_id))
        done.set_result(req is not None)
        return done

    def _send(self, replica: _Replica, message: Any) -> bool:
        """One message to ``replica`` (event loop thread); never blocks: False when its queue is full (a replica
        that stopped reading), the message dropped."""
        try:
            replica.inbox.send(ENCODER.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    # The replicas' messages (reader thread -> event loop) ------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: each replica's messages, decoded against the schema, in order, to the loop."""
        loop = self._loop
        assert loop is not None
        while not self._closed:
            try:
                if not self._outbox.poll(100):
                    continue
                header, payload = self._outbox.recv_multipart()
            except zmq.ZMQError:  # closed under us at shutdown
                return
            try:
                message = FROM_REPLICA.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("a replica's message that does not follow the schema: %s", exc)
                continue
            try:
                loop.call_soon_threadsafe(self._on_message, int.from_bytes(header, "big"), message)
            except RuntimeError:  # the loop is closed
                return

    def _on_message(self, index: int, message: Any) -> None:
        if isinstance(message, Events):
            for event in message.events:
                req = self._requests.get(event.request_id)
                if req is None:
                    continue
                req.stream._put(event)
                if event.output is not None:
                    self._forget(event.request_id)
        elif isinstance(message, Load):
            self._load(index, message)
        elif isinstance(message, Admitted):
            req = self._requests.get(message.request_id)
            if req is not None and not req.admitted.done():
                admission = Admission(message.request_id, message.prompt, message.prompt_token_ids, message.params)
                req.admitted.set_result(admission)
        elif isinstance(message, Refused | Failed):
            self._end(message.request_id, error_of(message.error, message.request_id))
        elif isinstance(message, Pages | Metrics):
            pending = self._queries.pop(message.query_id, None)
            if pending is not None and not pending[1].done():
                pending[1].set_result(message)
        elif isinstance(message, Dead):
            self._lost(index, message.message)

    def _load(self, index: int, load: Load) -> None:
        from mechserve.kv_events import decode_batch

        worker = self.fleet.workers[index]
        self.fleet.reported(worker, load.running, load.waiting, load.kv_usage)
        self.fleet.end_epoch()
        if load.kv_events is not None:
            batch = decode_batch(load.kv_events)
            self.fleet.observe(worker, batch)
            if self.kv_events is not None:
                self.kv_events.publish(list(batch.events), rank=index)

    def _end(self, request_id: str, error: BaseException) -> None:
        """``request_id`` ends with ``error``: before admission its ``add_request`` raises it, after it its stream."""
        req = self._requests.get(request_id)
        if req is None:
            return
        if not req.admitted.done():
            req.admitted.set_exception(error)
        else:
            req.stream._put(error)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self.fleet.finish(request_id)

    # Faults -------------------------------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Every ``WATCH_S``: a replica process that exited while serving is down at once."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self._stopping:
                return
            for r in self._replicas:
                if r.alive and r.process.poll() is not None:
                    self._lost(r.index, f"its process exited with status {r.process.returncode}")

    def _lost(self, index: int, reason: str) -> None:
        """Replica ``index`` is down: its requests end with an error naming it, the router drops it."""
        r = self._replicas[index]
        if not r.alive or self._stopping:
            return
        r.alive, r.reason = False, reason
        log.error("data-parallel replica %d (pid %d) is down: %s; the others keep serving", index, r.pid, reason)
        self.fleet.down(self.fleet.workers[index], reason)
        self.fleet_metrics.down(index)
        for rid, req in list(self._requests.items()):
            if req.replica == index:
                self._end(rid, EngineDeadError(f"data-parallel replica {index} (pid {r.pid}) is down: {reason}"))
        for qid, (replica, future) in list(self._queries.items()):
            if replica == index and not future.done():
                self._queries.pop(qid)
                future.set_exception(EngineDeadError(f"data-parallel replica {index} is down: {reason}"))
        if not any(x.alive for x in self._replicas):
            self._error = EngineDeadError(f"every data-parallel replica is down (the last, replica {index}: {reason})")
        if r.process.poll() is None:  # its engine died but the process lingers: end it
            r.process.kill()

    # Queries ------------------------------------------------------------------------------------------------------

    async def _ask(self, index: int, what: str) -> Any:
        r = self._replicas[index]
        if not r.alive:
            raise EngineDeadError(f"data-parallel replica {index} is down: {r.reason}")
        qid = self._next_query
        self._next_query += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queries[qid] = (index, future)
        self._send(r, Query(qid, what))  # type: ignore[arg-type]
        try:
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        finally:
            self._queries.pop(qid, None)

    async def replica_pages(self) -> list[Pages]:
        """Each live replica's pool, read between two of its steps, asked over its socket (tests, debugging)."""
        return [await self._ask(r.index, "pages") for r in self._replicas if r.alive]

    async def refresh_metrics(self) -> None:
        """Ask every live replica for its metrics (``/metrics`` calls this first); a down replica keeps its last
        counters and histograms (``FleetMetrics.down``)."""
        results = await asyncio.gather(
            *(self._ask(r.index, "metrics") for r in self._replicas if r.alive), return_exceptions=True
        )
        live = [r.index for r in self._replicas if r.alive]
        for index, result in zip(live, results):
            if isinstance(result, Metrics):
                self.fleet_metrics.update(index, result.families)

    # The engine, between steps (one process has none) ---------------------------------------------------------------

    async def run_in_engine(self, fn: Callable[[Any], T]) -> T:
        raise NotImplementedError("a data-parallel engine runs in its replica processes; use replica_pages()")

    def call_in_engine(self, fn: Callable[[Any], T]) -> Future[T]:
        raise NotImplementedError("a data-parallel engine runs in its replica processes; use replica_pages()")

    async def check_pages(self) -> None:
        """Every live replica's pool check (``AssertionError`` naming the replica on a problem)."""
        for r, pages in zip([r for r in self._replicas if r.alive], await self.replica_pages()):
            if pages.problem is not None:
                raise AssertionError(f"replica {r.index}: {pages.problem}")
