"""The router's ears for ``precise``: one ZeroMQ SUB socket per worker's ``--kv-events-endpoint``.

Each message is vLLM's ``[topic, sequence, payload]`` (``mechserve.kv_events``); the payload is
decoded with the schema and handed to the fleet as that worker's batch (``WorkerFleet.observe``:
m15's router indexes it).  A sequence number that goes back means the worker restarted: what the
router knew of its cache is dropped first.  A gap means batches were lost (a full queue): it is
logged, since no replay socket is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from mechserve.kv_events import decode_batch
from mechserve.router.fleet import Worker, WorkerFleet
from mechserve.spec import m15_routing as m15

log = logging.getLogger("mechserve.router")


class EventSubscriber:
    """Subscribes to every worker's KV events (``topic``, vLLM's default ``""``) while started."""

    def __init__(self, fleet: WorkerFleet, topic: str = "") -> None:
        self.fleet = fleet
        self.topic = topic.encode()
        self._context = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self.received = 0  # batches heard, for tests and /workers

    def start(self) -> None:
        for worker in self.fleet.workers:
            if worker.kv_events_endpoint is not None:
                self._tasks.append(asyncio.create_task(self._listen(worker)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._context.term()

    async def _listen(self, worker: Worker) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(worker.kv_events_endpoint or "")
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        last: int | None = None
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("KV events from %s: a message of %d frame(s), not vLLM's 3", worker.url, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big")
                try:
                    batch = decode_batch(frames[2])
                except ValueError as exc:
                    log.warning("KV events from %s: %s", worker.url, exc)
                    continue
                if last is not None and seq <= last:  # the worker restarted: its old cache is gone
                    self.fleet.observe(worker, m15.KVEventBatch(batch.ts, (m15.AllBlocksCleared(),)))
                elif last is not None and seq > last + 1:
                    log.warning("KV events from %s: %d batch(es) lost", worker.url, seq - last - 1)
                last = seq
                self.fleet.observe(worker, batch)
                self.received += 1
        finally:
            sock.close()
