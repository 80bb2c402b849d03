"""``LLM(data_parallel_size=N)``: the offline API over N replica processes.

``OfflineReplicas`` runs a ``DataParallelLLM`` on an event loop of its own (a daemon thread), so that
``LLM.generate`` and ``LLM.chat`` stay synchronous: a batch is submitted at once, each request routed by
m15's policy to one replica, and the call returns when every request has ended.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from mechserve.api.config import EngineConfig
from mechserve.api.outputs import RequestOutput
from mechserve.api.params import SamplingParams
from mechserve.dp.client import DataParallelLLM

T = TypeVar("T")


class OfflineReplicas:
    """``size`` replicas of ``model`` under ``config``, routed by ``routing_policy``, on a private event loop.

    Raises what ``DataParallelLLM`` raises (``ValueError`` for a bad size, policy or thread count, or a
    replica that failed to start)."""

    def __init__(
        self, model: Any, size: int, config: EngineConfig, routing_policy: str = "precise", threads: int | None = None
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mechserve-dp-offline", daemon=True)
        self._thread.start()
        try:
            self.client = DataParallelLLM(
                model, data_parallel_size=size, config=config, routing_policy=routing_policy, threads=threads
            )
        except BaseException:
            self._stop_loop()
            raise
        self._call(self._start())
        self.closed = False

    async def _start(self) -> None:
        self.client.start()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    @property
    def core(self) -> Any:
        """What ``LLM`` reads of its engine: the config and the tokenizer (``mechserve.dp.client.Front``)."""
        return self.client.core

    def run(
        self, items: Sequence[tuple[str | None, list[int]]], params: Sequence[SamplingParams]
    ) -> tuple[list[RequestOutput | None], dict[int, ValueError]]:
        """Every ``(text, ids)`` prompt with its params, all at once: the outputs in input order (None for one that
        was refused or failed) and each such prompt's ``ValueError`` by index.  Raises ``EngineDeadError`` when a
        replica died under a request (no output can be trusted to be complete)."""

        async def one(text: str | None, ids: list[int], p: SamplingParams) -> RequestOutput:
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if text is not None:
                prompt["prompt"] = text
            return await self.client.generate(prompt, p)

        async def every() -> list[RequestOutput | BaseException]:
            return await asyncio.gather(*(one(t, i, p) for (t, i), p in zip(items, params)), return_exceptions=True)

        outputs: list[RequestOutput | None] = []
        errors: dict[int, ValueError] = {}
        for i, result in enumerate(self._call(every())):
            if isinstance(result, ValueError):
                errors[i] = result
                outputs.append(None)
            elif isinstance(result, BaseException):
                raise result
            else:
                outputs.append(result)
        return outputs, errors

    def close(self) -> None:
        """Stop the replicas (each aborts what it holds and exits) and the loop."""
        if self.closed:
            return
        self.closed = True
        try:
            self._call(self.client.shutdown())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
