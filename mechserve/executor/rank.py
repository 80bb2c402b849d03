"""One tensor-parallel rank: its shard, its executor, and the loop that answers the driver's commands.

A rank process builds a ``ShardedLlama`` (its slices of the weights) and a ``RankExecutor`` over it
(its KV heads' pages), then answers command lists from the driver (``serve_rank``) until told to
stop, over a pipe (``SpawnGroup``) or torch.distributed collectives (``DistGroup`` under
``torchrun``); see ``mechserve.executor.rank_group`` for the driver's side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mechserve.api.config import SpeculativeConfig
from mechserve.api.env import traceback_wanted
from mechserve.api.errors import first_line
from mechserve.executor.sampling import Sampler
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.kv import native
from mechserve.model.arch import LlamaArch
from mechserve.model.loader import load_shard
from mechserve.model.sharded import ShardedLlama
from mechserve.spec import m16_request_draft_lengths as m16

# Failures a test can plant in a rank's next step (RankGroup.plant).
FAULTS = ("disagree", "hang", "crash", "raise")


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

    def execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
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
        model = load_shard(spec.path, rank, world_size, getattr(torch, spec.dtype), arch=spec.arch, rope=spec.rope)
        # no calibration at start (its forwards would need every rank at once): rank 0's governor measures online
        self.executor = RankExecutor(
            model,
            rank,
            spec.num_pages,
            spec.page_size,
            sampler=Sampler(spec.seed),
            speculative=spec.speculative,
            calibrate=False,
        )

    def handle(self, command: tuple[Any, ...]) -> Any:
        """Run one command: ``("execute", plan)`` (answers ``(outcomes, failures)``), ``("add", request)`` (an
        ``ExecutorRequest``), ``("release", request_id)``, ``("settle", windows)``, ``("logprobs", request_id)``,
        ``("prompt_logprobs", request_id)``, ``("advise", caps, max_k)``, ``("stats",)``, ``("params",)``,
        ``("fault", kind)``.  Raises ``ValueError`` for anything else."""
        name, args = command[0], command[1:]
        ex = self.executor
        if name == "execute":
            return ex.execute(args[0]), ex.take_failures()
        if name == "add":
            return ex.add_request(args[0])
        if name == "release":
            return ex.release(args[0])
        if name == "settle":
            return ex.settle(args[0])
        if name == "logprobs":
            return ex.take_logprobs(args[0])
        if name == "prompt_logprobs":
            return ex.take_prompt_logprobs(args[0])
        if name == "advise":
            return ex.advise(*args)
        if name == "stats":
            return ex.stats()
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
            if traceback_wanted():
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
    # Ctrl-C in a terminal reaches the whole process group; the driver ends its ranks itself (it may be
    # draining a server), so a rank must not die of it with a traceback in the middle of a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = _PipeChannel(conn)
    try:
        # The driver's deadline comes first; this one only frees a rank whose driver is gone.
        timeout = timedelta(seconds=2 * timeout_s + 10)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
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


__all__ = ["FAULTS", "RankExecutor", "RankServer", "RankSpec", "serve_rank"]
