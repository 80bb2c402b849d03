"""One data-parallel replica: an engine-core process (``python -m mechserve.dp.replica SPEC``).

vLLM's ``EngineCoreProc`` for ``--data-parallel-size``: the process loads the model on its share of the
CPU threads (``torch.set_num_threads``), builds one ``EngineCore`` with its own pool and prefix cache,
and steps it on a ``Stepper`` thread exactly as ``AsyncLLM`` does in one process.  Its main thread runs
an asyncio loop that owns the PUSH socket to the API server; a reader thread owns the PULL socket and
hands each decoded message to the loop::

    API server ──PUSH──> inbox (PULL, reader thread) ──> loop: Add / Abort / Query / Shutdown
                                                          │  Stepper (engine thread): step, deliver
    API server <──PULL── outbox (PUSH, loop thread) <─────┘  Admitted/Refused, Load, Events, Failed, ...

Order on the socket is the order on the engine thread: a request's ``Admitted`` before its first
``Events``, a step's ``Load`` (with its KV events) before its ``Events``.  The process exits after
``Shutdown``, when its engine dies (``Dead``), or when the API server's process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from mechserve.dp.wire import (
    ENCODER,
    TO_REPLICA,
    Abort,
    Add,
    Admitted,
    Dead,
    Events,
    Failed,
    Family,
    Load,
    Metrics,
    Pages,
    Query,
    Ready,
    Refused,
    ReplicaSpec,
    Sample,
    Shutdown,
    StartFailed,
    wire_error,
)

log = logging.getLogger("mechserve.dp")
WATCH_S = 0.2  # how often the loop looks for a dead engine or a gone API server
SEND_LINGER_MS = 2000  # at exit, the last messages still go out


class Replica:
    """The loop side of a replica process: applies the API server's messages to its ``Stepper`` and sends
    what the engine thread produces.  Every method runs on the loop's thread but ``_on_step`` and the
    futures' callbacks, which hand over with ``call_soon_threadsafe``."""

    def __init__(self, core: Any, spec: ReplicaSpec, out: zmq.Socket[bytes], loop: asyncio.AbstractEventLoop) -> None:
        from mechserve.entrypoints.metrics import ServingMetrics
        from mechserve.entrypoints.stepper import Stepper
        from mechserve.kv_events import CacheEventRecorder

        self.core = core
        self.index = spec.index
        self.loop = loop
        self._out = out
        self._header = spec.index.to_bytes(2, "big")
        self.metrics = ServingMetrics(
            spec.model_name, core.max_model_len, engine=str(spec.index), process=False, http=False
        )
        self.recorder = CacheEventRecorder(core.config.page_size)
        self.stepper = Stepper(core, self.metrics, on_step=self._on_step, name=f"mechserve-engine-{spec.index}")
        self._pending: list[Any] = []  # this loop iteration's events, sent as one Events message
        self._flush_scheduled = False
        self._compiling: set[str] = set()
        self._cancelled: set[str] = set()
        self.done = asyncio.Event()
        self._shutting_down = False
        self._shutdown_task: asyncio.Future[None] | None = None

    # sending (loop thread) ----------------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        if self._pending and not isinstance(message, Events):
            self._flush()  # whatever came first goes first
        self._out.send_multipart([self._header, ENCODER.encode(message)])

    def _event(self, item: Any) -> None:
        """A stream's event, delivered by the ``Stepper`` on this loop: sent with the loop iteration's others."""
        self._pending.append(item)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._pending:
            events, self._pending = self._pending, []
            self._out.send_multipart([self._header, ENCODER.encode(Events(events))])

    # the engine thread's hook -------------------------------------------------------------------------------

    def _on_step(self, out: Any) -> None:
        """After each step, on the engine thread: the replica's load and its prefix cache's changes."""
        from mechserve.kv_events import encode_batch
        from mechserve.spec import m15_routing as m15

        stats = self.core.stats()
        pages = stats.pages
        payload = None
        if out.record.published or out.record.evicted:
            changes = self.recorder.changes(self.core.scheduler.prefix_cache)
            if changes:
                payload = encode_batch(m15.KVEventBatch(time.time(), tuple(changes), self.index))
        usage = pages.in_use / pages.total if pages.total else 0.0
        self.loop.call_soon_threadsafe(self.send, Load(stats.running, stats.waiting, usage, payload))

    # the API server's messages (loop thread) ----------------------------------------------------------------

    def handle(self, message: Any) -> None:
        if isinstance(message, Add):
            self._add(message)
        elif isinstance(message, Abort):
            if message.request_id in self._compiling:
                self._cancelled.add(message.request_id)
            else:
                self.stepper.abort(message.request_id)
        elif isinstance(message, Query):
            self._query(message)
        elif isinstance(message, Shutdown) and not self._shutting_down:
            self._shutting_down = True
            self._shutdown_task = asyncio.ensure_future(self.shutdown())

    def _add(self, message: Add) -> None:
        so = message.params.structured_outputs
        if so is None:
            self._submit(message)
            return
        # compiled off the engine thread (as AsyncLLM does), so a new schema never stalls a step
        self._compiling.add(message.request_id)
        future = self.loop.run_in_executor(None, self.core.compile_grammar, so)
        future.add_done_callback(lambda f: self._compiled(message, f))

    def _compiled(self, message: Add, future: asyncio.Future[Any]) -> None:
        rid = message.request_id
        self._compiling.discard(rid)
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            self.send(Refused(rid, wire_error(ValueError(f"request {rid!r} was aborted before it was admitted"))))
            return
        error = future.exception()
        if error is not None:
            self.send(Refused(rid, wire_error(error)))
            return
        self._submit(message)

    def _submit(self, message: Add) -> None:
        from mechserve.entrypoints.stepper import AddCommand

        rid = message.request_id
        prompt: dict[str, Any] = {"prompt_token_ids": message.prompt_token_ids}
        if message.prompt is not None:
            prompt["prompt"] = message.prompt
        command = AddCommand(
            rid,
            prompt,
            message.params,
            self._deliverer(rid),
            self.loop,
            fit_max_tokens=message.fit_max_tokens,
            arrival=message.arrival,
        )
        # the answer is handed to the loop from the engine thread when the command is applied, so it is
        # queued before any event of the request's first step
        self.stepper.add(command).add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._admitted, rid, f))

    def _deliverer(self, rid: str) -> Callable[[Any], None]:
        def deliver(item: Any) -> None:
            if isinstance(item, BaseException):
                self.send(Failed(rid, wire_error(item)))
            else:
                self._event(item)

        return deliver

    def _admitted(self, rid: str, future: Future[Any]) -> None:
        error = future.exception()
        if error is not None:
            self.send(Refused(rid, wire_error(error)))
            return
        a = future.result()
        self.send(Admitted(rid, a.prompt, list(a.prompt_token_ids), a.params))

    def _query(self, query: Query) -> None:
        if query.what == "metrics":
            self.send(Metrics(query.query_id, families(self.metrics.registry)))
            return

        def pages(core: Any) -> Pages:
            problem = None
            try:
                core.check_pages()
            except AssertionError as exc:
                problem = str(exc) or "the pool check failed"
            p = core.stats().pages
            idle = not (core.has_unfinished() or core.scheduler.has_live())
            return Pages(query.query_id, p.total, p.free, p.cached, p.private, idle, problem)

        def answer(f: Future[Pages]) -> None:
            error = f.exception()
            if error is not None:
                self.send(Pages(query.query_id, 0, 0, 0, 0, False, f"the engine cannot answer: {error}"))
            else:
                self.send(f.result())

        self.stepper.call(pages).add_done_callback(lambda f: self.loop.call_soon_threadsafe(answer, f))

    # lifetime -----------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Abort every request (their last events go out), stop the engine thread, end the loop."""
        await asyncio.to_thread(self.stepper.stop)
        await asyncio.sleep(0)  # the aborts' events, handed to this loop, go out first
        self._flush()
        self.done.set()

    async def watch(self, parent: int) -> None:
        """End the process when its engine died (``Dead`` first) or its API server is gone."""
        while not self.done.is_set():
            await asyncio.sleep(WATCH_S)
            if self.stepper.error is not None:
                self._flush()
                self.send(Dead(f"data-parallel replica {self.index}: {self.stepper.error}"))
                self.done.set()
            elif os.getppid() != parent:
                log.warning("replica %d: the API server is gone; exiting", self.index)
                self.stepper.stop(timeout=5)
                self.done.set()


def families(registry: Any) -> list[Family]:
    """Every family a ``prometheus_client`` registry collects now, as wire structs."""
    out = []
    for metric in registry.collect():
        samples = [Sample(s.name, dict(s.labels), float(s.value)) for s in metric.samples]
        out.append(Family(metric.name, metric.documentation, metric.type, metric.unit, samples))
    return out


def _reader(inbox: zmq.Socket[bytes], loop: asyncio.AbstractEventLoop, replica: Replica) -> None:
    """The reader thread: every message from the API server, decoded against the schema, to the loop."""
    while not replica.done.is_set():
        if not inbox.poll(200):
            continue
        payload = inbox.recv()
        try:
            message = TO_REPLICA.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("replica %d: a message that does not follow the schema: %s", replica.index, exc)
            continue
        try:
            loop.call_soon_threadsafe(replica.handle, message)
        except RuntimeError:  # the loop closed
            return


def _start_failure(exc: BaseException) -> str:
    from mechserve.api.errors import KVMemoryError

    if isinstance(exc, KVMemoryError):
        from mechserve.cli.generate import kv_message

        return kv_message(exc)
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


async def _serve(core: Any, spec: ReplicaSpec, out: zmq.Socket[bytes], inbox: zmq.Socket[bytes], parent: int) -> None:
    loop = asyncio.get_running_loop()
    replica = Replica(core, spec, out, loop)
    replica.stepper.start()
    reader = threading.Thread(target=_reader, args=(inbox, loop, replica), name="mechserve-dp-reader", daemon=True)
    reader.start()
    watcher = asyncio.ensure_future(replica.watch(parent))
    await replica.done.wait()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    reader.join(2)


def main(argv: list[str] | None = None) -> int:
    """Start one replica from its ``ReplicaSpec`` (JSON, the one argument); returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(args[0], type=ReplicaSpec)
    parent = os.getppid()
    logging.basicConfig(level=logging.WARNING, format=f"replica {spec.index}: %(levelname)s %(message)s")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    out.connect(spec.outbox)
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(spec.inbox)
    header = spec.index.to_bytes(2, "big")
    try:
        import torch

        from mechserve.engine.core import EngineCore

        torch.set_num_threads(spec.threads)
        core = EngineCore.open(spec.model, spec.config)
    except Exception as exc:
        out.send_multipart([header, ENCODER.encode(StartFailed(_start_failure(exc)))])
        out.close()
        context.term()
        return 1
    from mechserve.cli.serve import describe_memory

    ready = Ready(
        os.getpid(),
        core.max_model_len,
        core.vocab_size,
        core.num_pages,
        core.kv_bytes,
        core.sized_by,
        torch.get_num_threads(),
        describe_memory(core),
    )
    out.send_multipart([header, ENCODER.encode(ready)])
    try:
        asyncio.run(_serve(core, spec, out, inbox, parent))
    finally:
        with contextlib.suppress(Exception):
            core.close()
        inbox.close()
        out.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
