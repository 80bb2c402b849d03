"""The workers a router fronts, and the m15 router that chooses among the live ones.

``WorkerFleet`` owns every worker named by ``--worker-urls`` (its health, its model, its latest
load report) and one ``mechserve.spec.m15_routing.Router`` over the workers that are live now.  The
policy is m15's ``choose``, called through that ``Router``; nothing here decides where a request
goes.  A worker joins when ``/health`` answers 200 and ``/v1/models`` serves the fleet's model
(the first worker to join names it; a worker serving another model is refused, and stays refused
until it serves the fleet's); it leaves when a health check or a request to it fails.

m15's router has a fixed number of replicas, so a change of the live set starts a new ``Router``
over the new set (replica ``i`` is ``live[i]``).  The decision log is the concatenation of segments,
each ``{"config": RouterConfig.to_json(), "workers": [url, ...]}`` followed by that ``Router``'s own
log entries (``route``, ``events``, ``finished``): ``replay_log`` takes every decision again through
m15's ``replay``, one segment at a time.  What a new segment starts from: precise hears again each
live worker's resident blocks (one ``BlockStored`` batch per worker, logged), cache_aware starts an
empty tree (sgl-router also drops a removed worker's tree), outstanding counts start at 0.

The router's fleet step is the load-report epoch: every health round that reads the workers'
``/metrics`` ends epoch ``k`` (the views carry ``step = k``) and the requests routed until the next
round carry ``step = k + 1``, so m15's precise policy adds what the router sent since the report.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from mechserve.spec import m15_routing as m15

log = logging.getLogger("mechserve.router")

POLICIES = ("cache_aware", "precise", "round_robin", "least_loaded")
"""The policies a real router serves (m15's ``oracle`` needs to see inside the engines)."""
TOKENIZED = ("cache_aware", "precise")
"""The policies that read the prompt's block hashes (the others route without tokenizing)."""


@dataclass
class Worker:
    """One ``mechserve serve`` worker: its ``url``, its KV-event endpoint, and what the router knows of it.

    ``state`` is ``"pending"`` (never answered yet), ``"live"``, ``"down"`` (a check or a request
    failed; ``reason`` says which) or ``"refused"`` (it serves another model than the fleet's).
    ``running``/``waiting``/``kv_usage`` are its last ``/metrics`` report (vLLM's gauges) and
    ``resident`` the block hashes its KV events say it holds.
    """

    url: str
    kv_events_endpoint: str | None = None
    state: str = "pending"
    reason: str = ""
    model: str | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    resident: set[int] = field(default_factory=set)
    block_size: int | None = None  # from its BlockStored events

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "reason": self.reason,
            "model": self.model,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "resident_blocks": len(self.resident),
            "kv_events_endpoint": self.kv_events_endpoint,
        }


@dataclass(frozen=True)
class RouterOptions:
    """The router's policy parameters (m15's ``RouterConfig`` less the replica count; precise's weights
    and the hash seed keep m15's defaults, llm-d's)."""

    policy: str = "cache_aware"
    block_size: int = 16
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 26
    load_guard: bool = True

    def config(self, replicas: int) -> m15.RouterConfig:
        """m15's config for a fleet of ``replicas`` live workers; ``ValueError`` for a bad value."""
        return m15.RouterConfig(
            self.policy,
            replicas,
            self.block_size,
            self.cache_threshold,
            self.balance_abs_threshold,
            self.balance_rel_threshold,
            self.max_tree_size,
            load_guard=self.load_guard,
        )


class NoWorker(Exception):
    """No worker is live: the request cannot be routed (an HTTP 503)."""


class WorkerFleet:
    """The workers, the live set and m15's router over it; single-threaded (the router's event loop).

    ``log_file`` (optional) receives the decision log as JSON lines, flushed per entry.  ``keep_log``
    (optional) bounds the log kept in memory to its newest entries (a long-running server; the file, if
    any, still gets every entry).  Raises ``ValueError`` from ``RouterOptions.config`` for a bad option.
    """

    def __init__(
        self,
        urls: Sequence[str],
        options: RouterOptions,
        kv_events_endpoints: Sequence[str] = (),
        log_file: IO[str] | None = None,
        keep_log: int | None = None,
    ) -> None:
        options.config(1)  # refuse a bad option before anything starts
        endpoints: list[str | None] = list(kv_events_endpoints) or [None] * len(urls)
        self.workers = [Worker(url, ep) for url, ep in zip(urls, endpoints)]
        self.options = options
        self.model: str | None = None
        self.epoch = 0
        self.live: list[Worker] = []
        self.router: m15.Router | None = None
        self.log: list[dict[str, Any]] | deque[dict[str, Any]] = [] if keep_log is None else deque(maxlen=keep_log)
        self._keep_log = keep_log
        self._log_file = log_file
        self._logged = 0  # entries of the current Router's log already written
        self.placed: dict[str, Worker] = {}

    # membership ------------------------------------------------------------------------------------

    def joined(self, worker: Worker, model: str, apply: bool = True) -> bool:
        """``worker`` answered its checks serving ``model``: make it live, or refuse it (another model).

        With ``apply`` False the live set changes at the next ``apply_live`` (a health round joins
        every worker that passed it at once, so m15's router is rebuilt once)."""
        if self.model is None:
            self.model = model
        worker.model = model
        if model != self.model:
            if worker.state != "refused":
                log.warning("refusing worker %s: it serves %r, the fleet serves %r", worker.url, model, self.model)
            worker.state, worker.reason = "refused", f"it serves model {model!r}, the fleet serves {self.model!r}"
        else:
            if worker.state == "down":  # logged as its going down was (a warning: the default log level shows it)
                log.warning(
                    "worker %s rejoined: it answers its checks again (it was down: %s)", worker.url, worker.reason
                )
            worker.state, worker.reason = "live", ""
        if apply:
            self.apply_live()
        return worker.state == "live"

    def down(self, worker: Worker, reason: str) -> None:
        """``worker`` failed (``reason``): no request goes to it until it passes its checks again."""
        if worker.state == "live":
            log.warning("worker %s is down: %s", worker.url, reason)
        elif worker.state == "pending":  # down from the start: it never answered its checks
            log.warning(
                "worker %s is down at start (requests go to the others until it answers): %s", worker.url, reason
            )
        worker.state, worker.reason = "down", reason
        worker.resident = set()
        self.apply_live()

    def apply_live(self) -> None:
        """Make the workers in state live the live set; a change starts a new m15 router (a log segment)."""
        live = [w for w in self.workers if w.state == "live"]
        if live == self.live and self.router is not None:
            return
        self._flush()
        self.live = live
        if not live:
            self.router = None
            return
        config = self.options.config(len(live))
        self.router = m15.Router(config, log=True)
        self._logged = 0
        self._write({"config": config.to_json(), "workers": [w.url for w in live]})
        for i, w in enumerate(live):  # precise starts from what each worker holds
            if w.resident and self.options.policy == "precise":
                self.router.observe(self._batch(i, (m15.BlockStored(tuple(sorted(w.resident)), None, (), 0),)))
        self._flush()

    # decisions -------------------------------------------------------------------------------------

    def views(self) -> list[m15.ReplicaView]:
        """Each live worker's last report, as m15's views (step: the epoch the report ended)."""
        return [m15.ReplicaView(i, self.epoch, w.running, w.waiting, w.kv_usage) for i, w in enumerate(self.live)]

    def route(self, request_id: str, tokens: Sequence[int]) -> tuple[Worker, m15.Decision]:
        """Choose the worker for ``request_id`` (prompt ``tokens``, empty for a policy that does not read
        them) by m15's policy; raises ``NoWorker`` when none is live."""
        if self.router is None:
            raise NoWorker("no worker is live")
        request = m15.RouteRequest.from_tokens(request_id, tokens, self.options.block_size, step=self.epoch + 1)
        decision = self.router.route(request, self.views())
        self._flush()
        worker = self.live[decision.replica]
        self.placed[request_id] = worker
        return worker, decision

    def finish(self, request_id: str) -> None:
        """``request_id``'s response ended (or failed): it no longer counts as outstanding."""
        self.placed.pop(request_id, None)
        if self.router is not None:
            self.router.finish(request_id)
            self._flush()

    def reported(self, worker: Worker, running: int, waiting: int, kv_usage: float) -> None:
        """``worker``'s ``/metrics`` said this; the next ``end_epoch`` makes it what ``choose`` sees."""
        worker.running, worker.waiting, worker.kv_usage = running, waiting, kv_usage

    def end_epoch(self) -> None:
        """A health round read every live worker's load: requests from now on are routed after it."""
        self.epoch += 1

    def observe(self, worker: Worker, batch: m15.KVEventBatch) -> None:
        """``worker``'s KV events: kept as its resident set and, when it is live, heard by m15's router."""
        for event in batch.events:
            if isinstance(event, m15.BlockStored):
                worker.resident.update(event.block_hashes)
                worker.block_size = event.block_size
            elif isinstance(event, m15.BlockRemoved):
                worker.resident.difference_update(event.block_hashes)
            else:
                worker.resident = set()
        if self.router is not None and worker in self.live:
            self.router.observe(self._batch(self.live.index(worker), batch.events, batch.ts))
            self._flush()

    def _batch(self, replica: int, events: Iterable[m15.KVEvent], ts: float = 0.0) -> m15.KVEventBatch:
        return m15.KVEventBatch(ts, tuple(events), replica)

    # the log ---------------------------------------------------------------------------------------

    def _write(self, entry: dict[str, Any]) -> None:
        self.log.append(entry)
        if self._log_file is not None:
            self._log_file.write(json.dumps(entry) + "\n")
            self._log_file.flush()

    def _flush(self) -> None:
        if self.router is None or self.router.log is None:
            return
        for entry in self.router.log[self._logged :]:
            self._write(entry)
        self._logged = len(self.router.log)
        if self._keep_log is not None:  # the router's own copy is not kept either
            self.router.log.clear()
            self._logged = 0


def replay_log(entries: Iterable[Mapping[str, Any]]) -> tuple[list[m15.Decision], list[m15.Decision]]:
    """``(logged, replayed)``: every decision a router's log records, and the same decisions taken again
    by m15's ``replay`` from each segment's config.  Raises ``ValueError`` for a log that does not
    start with a config entry."""
    segments: list[tuple[m15.RouterConfig, list[Mapping[str, Any]]]] = []
    for entry in entries:
        if "config" in entry:
            segments.append((m15.RouterConfig.from_json(entry["config"]), []))
        elif not segments:
            raise ValueError("a router log starts with a config entry")
        else:
            segments[-1][1].append(entry)
    logged: list[m15.Decision] = []
    replayed: list[m15.Decision] = []
    for config, body in segments:
        logged += [m15.Decision.from_json(e["decision"]) for e in body if "route" in e]
        replayed += m15.replay(config, body)
    return logged, replayed
