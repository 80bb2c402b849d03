"""Rank processes behind m11's group: each rank a ``ShardedLlama`` and its executor, the scheduler once.

The control side (m12's engine, in the driver) freezes one plan per step; the group hands the same
plan to every rank and gives m12 one executor per rank, so m11's join compares the N real reports
and raises ``GroupViolation`` unless all N are equal::

    driver: m12.Engine ──plan──> ExecutorGroup ──> proxy 0 ─┐ first call: send (queued commands, plan)
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

Commands that need no answer (``add_request``, ``release``) are queued per rank and travel with
the next command that does, so a decode step costs one round trip.

Backend: ``gloo`` (CPU).  The torch backend computes on the CPU only, so ``nccl`` is not offered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mechserve.backends import native
from mechserve.backends.engine import first_line
from mechserve.backends.llama import LlamaArch
from mechserve.backends.sampling import Sampler, TokenLogprobs
from mechserve.backends.speculative import SpeculativeConfig
from mechserve.backends.tensor_parallel import ShardedLlama
from mechserve.backends.torch_executor import SpecStats, TorchExecutor
from mechserve.params import GREEDY, SamplingParams
from mechserve.spec import m12_admission_control as m12

# Seconds a rank may take to answer one command (a step) or to start; MECHSERVE_RANK_TIMEOUT overrides.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_START_TIMEOUT_S = 300.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FAULTS = ("disagree", "hang", "crash", "raise")


class RankError(RuntimeError):
    """A rank crashed, hung past the timeout or raised; the group was shut down and serves no more."""


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank builds: the checkpoint directory ``path``, weights/KV ``dtype`` (torch name),
    the pool (``num_pages`` of ``page_size``), the shared sampling ``seed``, ``speculative`` (not
    a draft model), ``threads`` (torch intra-op threads per rank), ``native_attention`` (the
    driver's resolved choice, so every rank attends the same way and a failed kernel build is
    reported once, by the driver) and, if known, the model's ``arch`` and ``rope`` (see
    ``ShardedLlama``)."""

    path: str
    dtype: str = "float32"
    num_pages: int = 64
    page_size: int = 16
    seed: int | None = 0
    speculative: SpeculativeConfig | None = None
    threads: int = 1
    native_attention: bool = False
    arch: LlamaArch | None = None
    rope: tuple[torch.Tensor, float] | None = None


def rank_timeout() -> float:
    """``MECHSERVE_RANK_TIMEOUT`` seconds if set (a positive number), else ``DEFAULT_TIMEOUT_S``."""
    raw = os.environ.get("MECHSERVE_RANK_TIMEOUT")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"MECHSERVE_RANK_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"MECHSERVE_RANK_TIMEOUT must be > 0, got {raw!r}")
    return value


class RankExecutor(TorchExecutor):
    """A ``TorchExecutor`` over one rank's ``ShardedLlama``; tokens are chosen once, on rank 0.

    Every rank holds the same all-gathered logits, but only rank 0 samples; the ids are broadcast,
    so every rank builds the same outcome from the same ids.  ``fault`` plants one failure in the
    next ``execute`` (tests): ``"disagree"`` changes this rank's last reported id, ``"hang"``
    sleeps forever, ``"crash"`` exits the process.
    """

    def __init__(self, model: ShardedLlama, rank: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self.rank = rank
        self.fault: str | None = None

    def _targets(self, step: Any, logits: torch.Tensor) -> list[int]:
        ids = torch.empty(len(step.rows), dtype=torch.int64)
        if self.rank == 0:
            ids = torch.tensor(super()._targets(step, logits), dtype=torch.int64)
        if ids.numel():
            dist.broadcast(ids, src=0)
        return ids.tolist()

    def execute(self, plan: tuple[m12.PlanItem, ...]) -> tuple[m12.Outcome, ...]:
        fault, self.fault = self.fault, None
        if fault == "hang":
            while True:
                time.sleep(3600)
        if fault == "crash":
            os._exit(3)
        if fault == "raise":
            raise RuntimeError("planted rank failure")
        outcomes = super().execute(plan)
        if fault == "disagree":
            i = next((j for j, o in enumerate(outcomes) if o.token_ids), None)
            if i is not None:
                ids = outcomes[i].token_ids
                changed = (*ids[:-1], (ids[-1] + 1) % self.model.full_arch.vocab_size)  # type: ignore[attr-defined]
                outcomes = (*outcomes[:i], dataclasses.replace(outcomes[i], token_ids=changed), *outcomes[i + 1 :])
        return outcomes


class RankServer:
    """One rank: its shard, its executor and the commands the driver sends it."""

    def __init__(self, spec: RankSpec, rank: int, world_size: int) -> None:
        torch.set_num_threads(max(1, spec.threads))
        os.environ["MECHSERVE_ATTENTION"] = "native" if spec.native_attention else "torch"
        native.enabled.cache_clear()
        model = ShardedLlama(spec.path, rank, world_size, getattr(torch, spec.dtype), arch=spec.arch, rope=spec.rope)
        self.executor = RankExecutor(
            model, rank, spec.num_pages, spec.page_size, sampler=Sampler(spec.seed), speculative=spec.speculative
        )

    def handle(self, command: tuple[Any, ...]) -> Any:
        """Run one command: ``("execute", plan)``, ``("add", request_id, prompt_ids, params, eos, stop)``,
        ``("release", request_id)``, ``("logprobs", request_id)``, ``("advise", caps, max_k)``,
        ``("stats",)``, ``("params",)``, ``("fault", kind)``.  Raises ``ValueError`` for anything else."""
        name, args = command[0], command[1:]
        ex = self.executor
        if name == "execute":
            return ex.execute(args[0])
        if name == "add":
            rid, prompt_ids, params, eos, stop = args
            return ex.add_request(rid, prompt_ids, params, eos_token_ids=eos, stop_token_ids=stop)
        if name == "release":
            return ex.release(args[0])
        if name == "logprobs":
            return ex.take_logprobs(args[0])
        if name == "advise":
            return ex.advise(*args)
        if name == "stats":
            return dataclasses.replace(ex.stats)
        if name == "params":
            return ex.model.parameter_counts()  # type: ignore[attr-defined]
        if name == "fault":
            ex.fault = args[0]
            return None
        raise ValueError(f"unknown rank command {name!r}")


class Channel(Protocol):
    def recv(self) -> tuple[list[tuple[Any, ...]], bool] | None: ...

    def reply(self, message: tuple[str, Any]) -> None: ...


def serve_rank(server: RankServer, channel: Channel, rank: int) -> None:
    """Answer command lists until ``("stop",)``, end of input, or the rank's own error (then reported)."""
    while True:
        message = channel.recv()
        if message is None:
            return
        commands, want_reply = message
        if commands and commands[-1][0] == "stop":
            return
        try:
            result = None
            for command in commands:
                result = server.handle(command)
        except Exception as exc:
            if os.environ.get("MECHSERVE_TRACEBACK"):
                traceback.print_exc()  # the whole story on the rank's stderr; the driver gets one line
            channel.reply(("error", f"rank {rank}: {type(exc).__name__}: {first_line(exc)}"))
            return
        if want_reply:
            channel.reply(("ok", result))


class _PipeChannel:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def recv(self) -> tuple[list[tuple[Any, ...]], bool] | None:
        try:
            message: tuple[list[tuple[Any, ...]], bool] = self.conn.recv()
            return message
        except (EOFError, OSError):  # the driver is gone
            return None

    def reply(self, message: tuple[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the driver is gone
            self.conn.send(message)


def _spawned_rank(rank: int, world_size: int, port: int, spec: RankSpec, conn: Connection, timeout_s: float) -> None:
    """A spawned rank's main: join the group through the driver's store, build the shard, serve."""
    channel = _PipeChannel(conn)
    try:
        # The driver's deadline comes first; this one only frees a rank whose driver is gone.
        timeout = timedelta(seconds=2 * timeout_s + 10)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        server = RankServer(spec, rank, world_size)
    except Exception as exc:
        channel.reply(("error", f"rank {rank} could not start: {type(exc).__name__}: {first_line(exc)}"))
        return
    channel.reply(("ok", "ready"))
    try:
        serve_rank(server, channel, rank)
    finally:
        dist.destroy_process_group()


class _RankProxy:
    """Rank ``rank``'s executor as m12 sees it: its report for the plan the group fanned out."""

    def __init__(self, group: RankGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def execute(self, plan: tuple[m12.PlanItem, ...]) -> tuple[m12.Outcome, ...]:
        return self.group.report(self.rank, plan)


class RankGroup:
    """The driver's handle on ``world_size`` ranks; the executor API ``EngineCore`` uses, once for all.

    ``executors()`` are the m12 rank executors; ``add_request``/``release`` reach every rank (queued
    until the next round trip); ``take_logprobs``, ``advise`` and ``stats`` ask rank 0 (every rank
    holds the same).  Any failure raises ``RankError`` and shuts the group down.
    """

    world_size: int

    def __init__(self) -> None:
        self._queues: list[list[tuple[Any, ...]]] = [[] for _ in range(self.world_size)]
        self._plan: tuple[m12.PlanItem, ...] | None = None
        self._reports: dict[int, tuple[m12.Outcome, ...]] = {}
        self.closed = False

    # m12's side
    def executors(self) -> list[_RankProxy]:
        return [_RankProxy(self, r) for r in range(self.world_size)]

    def report(self, rank: int, plan: tuple[m12.PlanItem, ...]) -> tuple[m12.Outcome, ...]:
        """Rank ``rank``'s outcomes for ``plan``; the first proxy asked sends the plan to every rank."""
        if not plan:
            return ()
        if plan is not self._plan:
            self._plan = plan
            self._reports = dict(enumerate(self._round(("execute", plan))))
        report = self._reports.pop(rank, None)
        if report is None:
            raise RankError(f"rank {rank}'s report for this plan was asked for twice")
        if not self._reports:
            self._plan = None
        return tuple(report)

    # the executor API EngineCore uses
    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int] | None = None,
        params: SamplingParams = GREEDY,
        *,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        ids = None if prompt_ids is None else list(prompt_ids)
        self._queue(("add", request_id, ids, params, tuple(eos_token_ids), tuple(stop_token_ids)))

    def release(self, request_id: str) -> None:
        if not self.closed:
            self._queue(("release", request_id))

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        result: list[TokenLogprobs] = self._ask(("logprobs", request_id))
        return result

    def advise(self, caps: Sequence[tuple[str, int]], max_k: int) -> int:
        return int(self._ask(("advise", list(caps), max_k)))

    @property
    def stats(self) -> SpecStats:
        result: SpecStats = self._ask(("stats",))
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
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False
        )
        self._store = store  # the rendezvous lives as long as the group
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
            if p.exitcode is not None and not (crashed_only and p.exitcode == 0):
                raise self._fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode} before {what!r}")

    def _exited(self, rank: int, what: str) -> RankError:
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
                    # A rank that reported its own error exits cleanly (code 0); that is not a death.
                    wait([p.sentinel for p in self.procs], timeout=1.0)
                    self._check_alive(what, crashed_only=True)
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


class _DistChannel:
    """A non-zero rank's view of ``DistGroup``: its commands by broadcast, its reports by gather."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def recv(self) -> tuple[list[tuple[Any, ...]], bool] | None:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0][self.rank], True

    def reply(self, message: tuple[str, Any]) -> None:
        dist.gather_object(message, None, dst=0)


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (the ``env://`` variables are all set)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def start_group(spec: RankSpec, world_size: int, *, timeout_s: float | None = None) -> RankGroup:
    """The rank group for ``world_size`` ranks: a ``DistGroup`` under ``torchrun``, else a ``SpawnGroup``.

    Under ``torchrun`` the ranks other than 0 never return: they serve, then exit with status 0
    when rank 0 closes the group.  Raises ``ValueError`` when ``torchrun``'s ``WORLD_SIZE``
    differs from ``world_size``, ``RankError`` when a rank cannot start.
    """
    timeout = timeout_s if timeout_s is not None else rank_timeout()
    if not under_torchrun():
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


__all__ = ["DistGroup", "RankError", "RankExecutor", "RankGroup", "RankSpec", "SpawnGroup", "start_group"]
