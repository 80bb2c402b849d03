"""The offline Python API, as in vLLM: ``LLM(model=...)``, ``llm.generate(prompts, params)``, ``llm.chat(messages)``.

Every request runs under the top rung of the ladder (m14) through one
long-lived ``EngineCore``; ``llm.trace`` holds the step records the spec
prints::

    >>> from mechserve import LLM, SamplingParams
    >>> llm = LLM("smollm2")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text, out[0].outputs[0].finish_reason
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mechserve.api.config import EngineConfig, SpeculativeConfig, engine_config
from mechserve.api.errors import KVMemoryError, RequestFailed, RequestRejected
from mechserve.api.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepOutput
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.entrypoints.prompts import Chat, Prompt, encode_chat, params_list, parse_prompt, prompt_list
from mechserve.entrypoints.tools import parse_tools
from mechserve.model.checkpoint import EMBEDDED
from mechserve.model.loader import LoadedModel
from mechserve.spec.m16_request_draft_lengths import StepRecord

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "KVMemoryError",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RequestsRejected",
    "SamplingParams",
    "SpeculativeConfig",
]


class RequestsRejected(ValueError):
    """Some prompts of one ``generate``/``chat`` call were rejected at submission, or failed alone inside a
    step (``RequestFailed``: their grammar); the others completed.

    ``errors`` maps each such prompt's index to its ``ValueError`` (a ``RequestRejected`` when m12's door
    refused it); ``outputs`` is the call's result in input order, None at those indices.
    """

    def __init__(self, errors: dict[int, ValueError], outputs: list[RequestOutput | None]) -> None:
        lines = "; ".join(f"prompt {i}: {exc}" for i, exc in errors.items())
        ran = len(outputs) - len(errors)
        failed = sum(isinstance(exc, RequestFailed) for exc in errors.values())
        how = "rejected at submission" if not failed else f"rejected at submission or failed ({failed} failed)"
        super().__init__(
            f"{len(errors)} of {len(outputs)} prompt(s) {how} ({lines}); "
            f"the other {ran} ran to completion (their outputs are in .outputs)"
        )
        self.errors = errors
        self.outputs = outputs


class LLM:
    """A model served by the m14 engine on a paged KV cache, for offline batches.

    ``model``: ``"smollm2"`` (the embedded SmolLM2-135M-Instruct), a local Hugging Face
    directory, a GGUF file (``"path/to/model.Q4_K_M.gguf"``: llama, qwen2 or qwen3, its weights run
    as the file stores them, tokenizer and chat template from its metadata), or an already loaded
    ``LoadedModel``.  Every other keyword is an engine setting,
    the same for ``LLM`` and ``AsyncLLM`` with the same defaults: a field of ``EngineConfig``
    (``dtype``, ``max_step_tokens``, ``page_size``, ``num_pages`` or ``kv_memory`` (bytes or
    ``"512MiB"``), ``max_model_len``, ``prefix_caching``, ``hold_shared_prefix``,
    ``max_running``, ``max_waiting``, ``spec_len``, ``seed``, ``world_size``, ...), vLLM's name for
    one (``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
    ``tensor_parallel_size``, ``block_size``), or ``speculative_config`` (a ``SpeculativeConfig``
    or a dict of its fields, vLLM's names ``prompt_lookup_min``/``prompt_lookup_max``/``model``
    accepted), e.g. ``{"method": "draft", "num_speculative_tokens": 4, "draft_model":
    "smollm2:layers=4"}``.  ``config`` gives a whole ``EngineConfig`` instead.  With
    ``world_size > 1`` each rank is a process holding its shard of the weights and KV pages;
    ``close()`` (or ``with LLM(...) as llm``) stops them, and they are stopped at exit anyway.

    ``data_parallel_size=N`` (vLLM's keyword) runs N engine processes instead of one, each with the
    same settings, its own KV pool and prefix cache and ``1/N`` of the CPU threads, each request routed
    by ``routing_policy`` (``"precise"`` by default; see docs/fleet.md); the model must then be loadable
    by path, ``close()`` stops them, and ``trace`` stays empty (the step records live in the replicas).
    ``llm.trace`` is the list of m14 ``StepRecord``s of the most recent ``generate``/``chat``
    call; with ``trace=True`` it keeps the records of every call since construction instead (it
    then grows without bound).

    Raises ``TypeError`` for an unknown keyword, ``ModelLoadError`` for a model that cannot be
    loaded, ``ValueError`` for a bad size or dtype, ``KVMemoryError`` when the KV cache does not fit.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | LoadedModel = EMBEDDED,
        *,
        trace: bool = False,
        config: EngineConfig | None = None,
        data_parallel_size: int = 1,
        routing_policy: str | None = None,
        **engine_args: Any,
    ) -> None:
        self.keep_all_records = trace
        self.trace: list[StepRecord] = []
        self._replicas: Any = None
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        if data_parallel_size == 1:
            if routing_policy is not None:
                raise ValueError(
                    "routing_policy routes between data-parallel replicas: it needs data_parallel_size > 1"
                )
            self.core = EngineCore.open(model, engine_config(config, engine_args))
            return
        from mechserve.dp.offline import OfflineReplicas

        self._replicas = OfflineReplicas(
            model, data_parallel_size, engine_config(config, engine_args), routing_policy or "precise"
        )
        self.core = self._replicas.core

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        return self.core.config

    def close(self) -> None:
        """Stop the rank processes (``world_size > 1``) or the replica processes (``data_parallel_size > 1``)."""
        if self._replicas is not None:
            self._replicas.close()
        else:
            self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None for a model loaded without one)."""
        return self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; return one ``RequestOutput`` per prompt, in input order.

        ``prompts``: a string, a list of strings, one prompt as token ids
        (a list of ints), a list of such lists, or vLLM-style dicts
        (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``).
        ``sampling_params``: one for all, one per prompt, or None (vLLM's
        defaults: temperature 1.0, max_tokens 16).  ``use_tqdm`` shows a
        progress bar (requests done, output tokens/s) on stderr.

        A prompt that cannot be served (empty, a token id outside the
        vocabulary, a stop token id outside it, too long for the model, never
        fitting the KV pool) is rejected when it is submitted, and one whose
        grammar fails inside a step ends alone (``RequestFailed``); the others
        run to completion, then ``RequestsRejected`` (a ``ValueError`` that
        carries their outputs) is raised.  Raises ``ValueError`` at once for a
        prompt of the wrong type, text without a tokenizer, or a params list
        of the wrong length.
        """
        items = [parse_prompt(p, self.core.tokenizer) for p in prompt_list(prompts)]
        return self._run(items, params_list(sampling_params, len(items)), use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them.

        Each conversation goes through the tokenizer's chat template
        (``apply_chat_template``, or ``chat_template`` if given) with
        ``add_generation_prompt``; the templated text is the output's
        ``prompt``.  ``tools``: OpenAI's function tools, rendered as the server renders them
        (``mechserve.entrypoints.tools``: the model's template if it uses them, else the shipped ChatML
        tools template); the reply is text, as vLLM's ``LLM.chat`` returns it (``ToolStream(plan).parse``
        finds the calls in it).  Otherwise as ``generate``.  Raises ``ValueError`` if the tokenizer
        has no chat template, ``ParamError`` for a bad tool or a template that cannot render tools.
        """
        conversations: list[Any] = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tok = self.core.tokenizer
        rendered = [t.as_template() for t in parse_tools(tools)] or None
        items: list[tuple[str | None, list[int]]] = [
            encode_chat(tok, Chat(conversation, add_generation_prompt, chat_template, tools=rendered))
            for conversation in conversations
        ]
        return self._run(items, params_list(sampling_params, len(items)), use_tqdm)

    def _run_replicas(
        self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        """``_run`` over data-parallel replicas: every request at once, each on the replica its router chose."""
        outputs, failed = self._replicas.run(items, params)
        if failed:
            raise RequestsRejected(failed, outputs) from next(iter(failed.values()))
        return [o for o in outputs if o is not None]

    def _run(
        self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Submit ``items``, run the engine until it is idle, return the outputs in input order."""
        if self._replicas is not None:
            return self._run_replicas(items, params)
        request_ids: list[str | None] = []
        errors: dict[int, ValueError] = {}
        for i, ((text, ids), p) in enumerate(zip(items, params)):
            try:
                request_ids.append(self.core.add_request(ids, p, prompt=text))
            except ValueError as exc:
                request_ids.append(None)
                errors[i] = exc
        mine = {rid for rid in request_ids if rid is not None}
        records: list[StepRecord] = []
        done: dict[str, RequestOutput] = {}
        failed: dict[str, RequestFailed] = {}
        try:
            with _progress(use_tqdm, len(mine)) as advance:

                def seen(out: StepOutput) -> None:
                    records.append(out.record)
                    done.update((o.request_id, o) for o in out.finished if o.request_id in mine)
                    failed.update((rid, exc) for rid, exc in out.failed.items() if rid in mine)
                    ended = sum(1 for o in out.finished if o.request_id in mine) + len(out.failed)
                    advance(ended, sum(len(d.token_ids) for d in out.deltas))

                self.core.run_until_idle(seen)
        except BaseException:
            for rid in mine - done.keys() - failed.keys():
                self.core.abort(rid)
            raise
        finally:
            self.trace = self.trace + records if self.keep_all_records else records
        outputs = [done.get(rid) if rid is not None else None for rid in request_ids]
        errors.update((i, failed[rid]) for i, rid in enumerate(request_ids) if rid in failed)
        errors = dict(sorted(errors.items()))
        if errors:
            raise RequestsRejected(errors, outputs) from next(iter(errors.values()))
        return [o for o in outputs if o is not None]


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """A rich progress bar on stderr (requests done, output tokens/s); yields ``advance(requests, tokens)``."""
    if not enabled or total == 0:
        yield lambda requests, tokens: None
        return
    started, produced = time.perf_counter(), 0
    columns = (
        TextColumn("[bold]generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests · {task.fields[speed]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("generate", total=total, speed="0.0 output tok/s")

        def advance(requests: int, tokens: int) -> None:
            nonlocal produced
            produced += tokens
            speed = produced / max(time.perf_counter() - started, 1e-9)
            bar.update(task, advance=requests, speed=f"{speed:.1f} output tok/s")

        yield advance
