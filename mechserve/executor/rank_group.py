"""Rank processes behind m11's group: each rank a ``ShardedLlama`` and its executor, the scheduler once.

The control side (m14's engine, in the driver) freezes one plan per step; the group hands the same
plan to every rank and gives m14 one executor per rank, so m11's join compares the N real reports
and raises ``GroupViolation`` unless all N are equal::

    driver: m16.Engine ──plan──> ExecutorGroup ──> proxy 0 ─┐ first call: send (queued commands, plan)
                                                   proxy 1 ─┤ to every rank, wait for every report
                                                   ...      ┘ (deadline, process sentinels)
    rank r: (queued add/release..., execute plan) ─> ShardedLlama forward (all-reduce / all-gather)
            ─> rank 0 samples, broadcasts the ids ─> outcomes ─> report

Two launchers, one rank loop (``serve_rank``):

* ``SpawnGroup`` (one machine): ``world_size`` processes from ``torch.multiprocessing``'s spawn
  context, a pipe each.  The driver hosts the rendezvous ``TCPStore`` on a port the OS picks
  (port 0), so concurrent groups never collide.  A rank that exits is seen at once (its process
  sentinel); one that does not answer within ``timeout_s`` is a hang.  Either way, and on a
  rank's own exception, the driver raises ``RankError`` and kills the group; ``close`` stops it
  cleanly; a finalizer and the daemon flag reap the processes if the driver forgets or dies.
* ``DistGroup`` (``torchrun``, one or several machines): every process runs the same command;
  ``init_process_group`` reads the standard ``env://`` variables (``MASTER_ADDR``,
  ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).  Rank 0 is the driver and rank 0's executor in one
  process; it broadcasts each command list (``broadcast_object_list``) and gathers the reports
  (``gather_object``); the other ranks serve inside ``start_group`` and exit when rank 0 closes
  the group.  A dead or hung rank surfaces through the process group's timeout.

Commands that need no answer (``add_request``, ``release``, ``settle``) are queued per rank and travel with
the next command that does, so a decode step costs one round trip.

Backend: ``gloo`` (CPU).  The torch backend computes on the CPU only, so ``nccl`` is not offered.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from mechserve.api.env import rank_timeout
from mechserve.api.errors import RankError, first_line
from mechserve.api.outputs import TokenLogprobs
from mechserve.executor.governor import Advice
from mechserve.executor.protocol import ExecutorStats, RequestFailure
from mechserve.executor.rank import FAULTS, RankServer, RankSpec, _DistChannel, _spawned_rank, serve_rank
from mechserve.executor.request import ExecutorRequest
from mechserve.spec import m16_request_draft_lengths as m16

# Seconds the ranks may take to start (load their shards).
DEFAULT_START_TIMEOUT_S = 300.0
# A spawned rank that finds itself importing a script without a main guard exits with this, quietly.
NO_MAIN_GUARD_EXIT = 87
NO_MAIN_GUARD = (
    "the rank processes could not start: the script that asks for world_size > 1 has no "
    '`if __name__ == "__main__":` guard, so each rank (started with spawn, which imports the script again) ran '
    "it and asked for ranks of its own; put the script's code under that guard (docs/parallelism.md)"
)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _RankProxy:
    """Rank ``rank``'s executor as m14 sees it: its report for the plan the group fanned out."""

    def __init__(self, group: RankGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        return self.group.report(self.rank, plan)


class RankGroup:
    """The driver's handle on ``world_size`` ranks; the executor API ``EngineCore`` uses, once for all.

    ``rank_executors()`` are the m14 rank executors and ``execute`` joins their reports as m11 does;
    ``add_request`` (the request's record), ``release`` and ``settle`` reach every rank (queued until the
    next round trip); ``take_logprobs``, ``take_prompt_logprobs``, ``advise`` and ``stats`` ask rank 0
    (every rank holds the same); ``take_failures`` gives what rank 0 reported with its last outcomes
    (rank 0 samples for all).  Any failure of a rank raises ``RankError`` and shuts the group down.
    """

    world_size: int

    def __init__(self) -> None:
        self._queues: list[list[tuple[Any, ...]]] = [[] for _ in range(self.world_size)]
        self._plan: tuple[m16.PlanItem, ...] | None = None
        self._reports: dict[int, tuple[m16.Outcome, ...]] = {}
        self._failures: list[RequestFailure] = []
        self.closed = False

    # m14's side
    def rank_executors(self) -> list[_RankProxy]:
        """One proxy per rank: m14's group fans each plan out to them and joins their reports (m11)."""
        return [_RankProxy(self, r) for r in range(self.world_size)]

    def execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        """Every rank's outcomes for ``plan``, joined as m11 joins them (``GroupViolation`` on disagreement)."""
        return m16.ExecutorGroup(self.rank_executors()).execute(plan)

    def report(self, rank: int, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        """Rank ``rank``'s outcomes for ``plan``; the first proxy asked sends the plan to every rank."""
        if not plan:
            return ()
        if plan is not self._plan:
            self._plan = plan
            answers = self._round(("execute", plan))
            self._reports = {rank: outcomes for rank, (outcomes, _) in enumerate(answers)}
            self._failures += answers[0][1]
        report = self._reports.pop(rank, None)
        if report is None:
            raise RankError(f"rank {rank}'s report for this plan was asked for twice")
        if not self._reports:
            self._plan = None
        return tuple(report)

    # the executor API EngineCore uses
    def add_request(self, request: ExecutorRequest) -> None:
        self._queue(("add", request))

    def take_failures(self) -> list[RequestFailure]:
        """The failures rank 0 reported with the last plan's outcomes (no round trip)."""
        failures, self._failures = self._failures, []
        return failures

    def release(self, request_id: str) -> None:
        if not self.closed:
            self._queue(("release", request_id))

    def settle(self, windows: Mapping[str, int]) -> None:
        """Every rank learns what each decode window kept (queued, like ``release``), so their counters and
        acceptance estimates stay equal."""
        if not self.closed and windows:
            self._queue(("settle", dict(windows)))

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        result: list[TokenLogprobs] = self._ask(("logprobs", request_id))
        return result

    def take_prompt_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        result: list[TokenLogprobs] = self._ask(("prompt_logprobs", request_id))
        return result

    def advise(self, caps: Sequence[tuple[str, int]], max_k: int) -> Advice:
        result: Advice = self._ask(("advise", list(caps), max_k))
        return result

    def stats(self) -> ExecutorStats:
        """Rank 0's counters (every rank counts the same)."""
        result: ExecutorStats = self._ask(("stats",))
        return result

    def parameter_counts(self) -> list[dict[str, int]]:
        """Each rank's ``ShardedLlama.parameter_counts()``, rank order."""
        return self._round(("params",))

    def plant(self, rank: int, fault: str) -> None:
        """Make rank ``rank`` fail its next step on purpose (``FAULTS``; for tests)."""
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self._queues[rank].append(("fault", fault))

    def _queue(self, command: tuple[Any, ...]) -> None:
        for q in self._queues:
            q.append(command)

    def _take(self, rank: int, command: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        commands, self._queues[rank] = [*self._queues[rank], command], []
        return commands

    def _round(self, command: tuple[Any, ...]) -> list[Any]:
        """Send each rank its queue plus ``command``, return every rank's answer (rank order)."""
        if self.closed:
            raise RankError("the rank group is shut down")
        return self._exchange([self._take(r, command) for r in range(self.world_size)])

    def _ask(self, command: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def _exchange(self, messages: list[list[tuple[Any, ...]]]) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reap(procs: list[Any], conns: list[Connection], grace_s: float) -> None:
    """Stop the rank processes: ask, wait up to ``grace_s``, then terminate, then kill."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(([("stop",)], False))
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)
    for conn in conns:
        conn.close()


class SpawnGroup(RankGroup):
    """``world_size`` spawned rank processes on this machine (see the module docstring).

    ``timeout_s``: the longest one answer may take (default ``rank_timeout()``);
    ``start_timeout_s``: the longest the ranks may take to load their shards.  Raises
    ``RankError`` when a rank cannot start (its error in the message).
    """

    def __init__(
        self,
        spec: RankSpec,
        world_size: int,
        *,
        timeout_s: float | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a rank group needs world_size >= 2, got {world_size}")
        self.world_size = world_size
        super().__init__()
        self.timeout_s = timeout_s if timeout_s is not None else rank_timeout()
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
        self._store = store  # the rendezvous lives as the group
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.conns, 0.0)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, store.port, spec, child, self.timeout_s)
            p = ctx.Process(target=_spawned_rank, args=args, daemon=True, name=f"mechserve-rank{rank}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._receive(range(world_size), start_timeout_s, "start")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check_alive(self) -> None:
        """``RankError`` (and the group shut down) if a rank's process has exited: what the engine asks between
        steps, so that a rank killed while the engine is idle is found before the next request meets it."""
        if self.closed:
            raise RankError("the rank group is shut down")
        self._check_alive("the next step")

    def _ask(self, command: tuple[Any, ...]) -> Any:
        if self.closed:
            raise RankError("the rank group is shut down")
        self._check_alive(command[0])
        self._send(0, self._take(0, command))
        return self._receive([0], self.timeout_s, command[0])[0]

    def _exchange(self, messages: list[list[tuple[Any, ...]]]) -> list[Any]:
        what = messages[0][-1][0]
        self._check_alive(what)
        for rank, commands in enumerate(messages):
            self._send(rank, commands)
        return self._receive(range(self.world_size), self.timeout_s, what)

    def _send(self, rank: int, commands: list[tuple[Any, ...]]) -> None:
        try:
            self.conns[rank].send((commands, True))
        except (OSError, ValueError) as exc:
            self._check_alive("a send")
            raise self._fail(f"rank {rank} (pid {self.procs[rank].pid}) cannot be reached ({exc})") from None

    def _check_alive(self, what: str, crashed_only: bool = False) -> None:
        """``RankError`` naming the first rank whose process has exited (with ``crashed_only``: with a
        non-zero code or a signal), if any."""
        for r, p in enumerate(self.procs):
            if p.exitcode == NO_MAIN_GUARD_EXIT:
                raise self._fail(NO_MAIN_GUARD)
            if p.exitcode is not None and not (crashed_only and p.exitcode == 0):
                raise self._fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode} before {what!r}")

    def _exited(self, rank: int, what: str) -> RankError:
        if self.procs[rank].exitcode == NO_MAIN_GUARD_EXIT:
            return self._fail(NO_MAIN_GUARD)
        return self._fail(
            f"rank {rank} (pid {self.procs[rank].pid}) exited with code {self.procs[rank].exitcode} during {what!r}"
        )

    def _receive(self, ranks: Sequence[int], timeout_s: float, what: str) -> list[Any]:
        """One answer from each of ``ranks`` (in that order) within ``timeout_s``, else ``RankError``."""
        answers: dict[int, Any] = {}
        waiting = {self.conns[r]: r for r in ranks}
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                late = sorted(waiting.values())
                raise self._fail(f"rank(s) {late} did not answer {what!r} within {timeout_s:g} s (hung?)")
            sentinels = {self.procs[r].sentinel: r for r in waiting.values()}
            for ready in wait([*waiting, *sentinels], timeout=left):
                if ready in sentinels:
                    r = sentinels[ready]
                    if not self.conns[r].poll():
                        self.procs[r].join(1)
                        raise self._exited(r, what)
                    continue
                if ready not in waiting:
                    continue
                assert isinstance(ready, Connection)
                r = waiting[ready]
                try:
                    status, value = ready.recv()
                except (EOFError, OSError):
                    self.procs[r].join(1)
                    raise self._exited(r, what) from None
                if status != "ok":
                    # a rank whose peer died fails inside a collective: name the dead rank, the cause.
                    # A rank that reported its own error exits cleanly (code 0); that is not a death.  The
                    # peer's socket closes before its process can be reaped, so the report may come first:
                    # wait (up to 1 s) for the ranks still running, not for any rank (the reporting rank's
                    # own clean exit ended the wait at once and the dead rank went unnamed).
                    settle = time.monotonic() + 1.0
                    while True:
                        self._check_alive(what, crashed_only=True)
                        running = [p.sentinel for p in self.procs if p.exitcode is None]
                        left = settle - time.monotonic()
                        if not running or left <= 0:
                            break
                        wait(running, timeout=left)
                    raise self._fail(str(value).strip())
                answers[r] = value
                del waiting[ready]
        return [answers[r] for r in ranks]

    def _fail(self, message: str) -> RankError:
        """Shut the group down at once and return the error to raise."""
        self._shutdown(grace_s=0.0)
        return RankError(f"{message}; the rank group was shut down")

    def _shutdown(self, grace_s: float) -> None:
        if not self.closed:
            self.closed = True
            self._finalizer.detach()
            _reap(self.procs, self.conns, grace_s)

    def close(self) -> None:
        """Stop every rank (they finish the command in hand), then make sure none is left."""
        self._shutdown(grace_s=10.0)


class DistGroup(RankGroup):
    """The group under ``torchrun``: this process is rank 0 (driver and rank 0's executor).

    Built by ``start_group`` once ``init_process_group`` has run; the other ranks are in
    ``serve_rank`` with a ``_DistChannel``.
    """

    def __init__(self, server: RankServer, world_size: int) -> None:
        self.world_size = world_size
        super().__init__()
        self.server = server

    def _ask(self, command: tuple[Any, ...]) -> Any:
        # rank 0 answers alone: it applies its queue now; the others keep theirs for the next round
        if self.closed:
            raise RankError("the rank group is shut down")
        for c in self._take(0, command):
            result = self.server.handle(c)
        return result

    def _exchange(self, messages: list[list[tuple[Any, ...]]]) -> list[Any]:
        try:
            box: list[Any] = [messages]
            dist.broadcast_object_list(box, src=0)
            mine: Any = ("ok", None)
            try:
                for c in messages[0]:
                    mine = ("ok", self.server.handle(c))
            except Exception as exc:
                mine = ("error", f"rank 0: {type(exc).__name__}: {first_line(exc)}")
            gathered: list[Any] = [None] * self.world_size
            dist.gather_object(mine, gathered, dst=0)
        except RuntimeError as exc:  # a peer died or timed out inside the collective
            self.closed = True
            raise RankError(f"the rank group failed: {exc}") from None
        for status, value in gathered:
            if status != "ok":
                self.closed = True
                raise RankError(f"{str(value).strip()}; the rank group is shut down")
        return [value for _, value in gathered]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            dist.broadcast_object_list([[[("stop",)]] * self.world_size], src=0)
        finally:
            dist.destroy_process_group()


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (the ``env://`` variables are all set)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def start_group(spec: RankSpec, world_size: int, *, timeout_s: float | None = None) -> RankGroup:
    """The rank group for ``world_size`` ranks: a ``DistGroup`` under ``torchrun``, else a ``SpawnGroup``.

    Under ``torchrun`` the ranks other than 0 never return: they serve, then exit with status 0
    when rank 0 closes the group.  Spawned ranks import the caller's script again (Python's spawn), so
    a script without an ``if __name__ == "__main__":`` guard would ask for ranks inside each rank: such
    a rank exits at once and the driver raises one ``RankError`` that says to add the guard.  Raises ``ValueError`` when ``torchrun``'s ``WORLD_SIZE``
    differs from ``world_size``, ``RankError`` when a rank cannot start.
    """
    timeout = timeout_s if timeout_s is not None else rank_timeout()
    if not under_torchrun():
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # This is a spawned rank importing a script that has no main guard: the script asked for ranks
            # again.  Leave at once and quietly; the driver names the problem (NO_MAIN_GUARD).
            os._exit(NO_MAIN_GUARD_EXIT)
        return SpawnGroup(spec, world_size, timeout_s=timeout)
    env_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if env_size != world_size:
        raise ValueError(f"torchrun started {env_size} processes but world_size is {world_size}")
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout))
    server = RankServer(spec, rank, world_size)
    if rank == 0:
        return DistGroup(server, world_size)
    try:
        serve_rank(server, _DistChannel(rank), rank)
    finally:
        dist.destroy_process_group()
    raise SystemExit(0)


__all__ = ["DistGroup", "RankGroup", "SpawnGroup", "start_group", "under_torchrun"]
