"""The long-lived engine: one m12 ``Engine``, one ``TorchExecutor`` and a tokenizer, driven one step at a time.

``EngineCore`` is what ``LLM`` (offline batches), ``mechserve generate`` /
``mechserve run --backend torch`` and a server loop drive.  It is
synchronous, single-threaded and does no I/O: requests go in with
``add_request``, each ``step`` runs one engine step and returns what it
added, ``abort`` removes a request, ``has_unfinished`` says whether stepping
is still needed::

    add_request(prompt_ids, params) --validate--> m12 door --+--> RequestRejected (ValueError)
                                                             +--> n samples: m12 Requests + executor registrations
    step() -> StepOutput: m12 StepRecord
                          + per sample: new ids, streamable text delta, finish  (detokenizer, stop strings)
                          + RequestOutput of every request that ended in this step
    abort(request_id): every live sample leaves the engine now; reported by the next step()

The scheduler is the top rung of the ladder, unchanged: a stop *string*
(text, not an id) is the one ending the spec cannot see, so when one matches
the sample is ended here and ``m12.Engine.abort`` takes it out of the engine
(its trace shows it under ``aborted``; its output says ``"stop"``).

Why a module of its own at the package's top (beside ``llm.py`` and
``detokenizer.py``) and not in ``backends/``: ``backends/`` holds what sits
*behind* the executor boundary; this sits in front of it, owns requests,
text and finish reasons, and is the one piece every front end shares.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mechserve.backends import native
from mechserve.backends.engine import (
    EngineConfig,
    KVMemoryError,
    check_kv_memory,
    draft_page_bytes,
    model_context,
    new_executor,
    page_bytes,
    size_pool,
)
from mechserve.backends.rank_group import RankError, RankGroup
from mechserve.backends.sampling import Sampler, TokenLogprobs
from mechserve.detokenizer import OutputText
from mechserve.outputs import (
    ABORT,
    LENGTH,
    STOP,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SampleDelta,
    StepOutput,
)
from mechserve.params import SamplingParams
from mechserve.spec import m12_admission_control as m12

__all__ = ["EngineCore", "KVMemoryError", "RankError", "RequestRejected"]


class RequestRejected(ValueError):
    """m12's door refused a request.  ``reason`` is the ``RejectReason``; ``detail`` names the limit."""

    def __init__(self, request_id: str, reason: m12.RejectReason, detail: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason.value} ({detail})")
        self.request_id = request_id
        self.reason = reason
        self.detail = detail


@dataclass(eq=False)
class _Sample:
    """One sample of a request: an m12 request, its kept ids and its text."""

    engine_id: str
    index: int
    params: SamplingParams
    text: OutputText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Kept since the last delta (ids and logprobs).
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Group:
    """One submitted request: its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    samples: list[_Sample]
    arrival_time: float
    first_token_time: float | None = None


class EngineCore:
    """One m12 engine over one ``TorchExecutor``, with the tokenizer that turns ids into text.

    ``loaded`` is a ``LoadedModel`` (or anything with ``model``,
    ``tokenizer`` and ``eos_token_ids``; the tokenizer needs ``decode(ids,
    skip_special_tokens=...)`` and may be None, giving empty texts).
    ``config`` sizes the engine (``EngineConfig``; the pool: ``num_pages``,
    else ``kv_memory``, else automatic, see ``size_pool``).  ``seed`` seeds
    the generator that unseeded sampling requests share.  The KV cache is
    allocated here (with a draft model, its KV too).  Raises ``ValueError``
    for bad sizes or a draft model that cannot serve this model, and
    ``KVMemoryError`` when the cache exceeds ``kv_memory``, the available
    memory, or cannot be allocated.

    Speculation (``config.speculative_config()``): with ``adaptive`` on,
    every ``step`` first sets the engine's ``spec_len`` (between 0 and
    ``num_speculative_tokens``) to what the executor advises for the
    requests about to draft (``TorchExecutor.advise``): the guesses their
    proposers have, weighed by how often their guesses were accepted.

    Ranks (``config.world_size > 1``): the executor is a ``RankGroup`` of tensor-parallel rank
    processes that load their shards from ``loaded.path`` (``rank_timeout_s``: the longest a
    step may take, default ``rank_group.rank_timeout()``); m11's join checks their reports.
    A rank that crashes or hangs raises ``RankError``, a disagreement ``m12.GroupViolation``;
    either shuts the group down.  ``close`` stops the ranks (also done at exit).  A draft model
    is not supported with ranks (``ValueError``).
    """

    def __init__(
        self,
        loaded: Any,
        config: EngineConfig | None = None,
        *,
        seed: int | None = 0,
        rank_timeout_s: float | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        # Settle the attention path now: a bad MECHSERVE_ATTENTION or a kernel that cannot be built
        # in ``native`` mode fails here, at load time, not at the first step.
        native.enabled()
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size: int = self.model.arch.vocab_size
        self.max_model_len = config.max_model_len or model_context(self.model)
        self.speculative = config.speculative_config()
        if config.world_size > 1 and self.speculative is not None and self.speculative.method == "draft":
            raise ValueError("a draft model with world_size > 1 is not supported (use prompt lookup or one rank)")
        draft = self._draft_model(loaded)
        self.num_pages, self.sized_by = size_pool(self.model, config, self.max_model_len)
        per_page = page_bytes(self.model, config.page_size) + draft_page_bytes(draft, config.page_size)
        self.kv_bytes = self.num_pages * per_page
        check_kv_memory(config, self.num_pages, self.kv_bytes, self.sized_by)
        self.world_size = config.world_size
        if self.world_size == 1 and not hasattr(self.model, "forward"):
            raise ValueError("a model loaded without weights (load_model(weights=False)) needs world_size > 1")
        self.group: RankGroup | None = None
        self.executor: Any
        if self.world_size > 1:
            # m11: the ranks hold the shards; this process only schedules and joins their reports.
            self.executor = self.group = self._start_group(loaded, seed, rank_timeout_s)
            executors: list[Any] = self.group.executors()
        else:
            self.executor = new_executor(
                self.model,
                self.num_pages,
                config.page_size,
                sized_by=self.sized_by,
                sampler=Sampler(seed),
                speculative=self.speculative,
                draft_model=draft,
            )
            executors = [self.executor]
        self.engine = m12.Engine(
            [],
            max_step_tokens=config.max_step_tokens,
            page_size=config.page_size,
            num_pages=self.num_pages,
            spec_len=config.spec_len,
            world_size=self.world_size,
            prefix_caching=config.prefix_caching,
            hold_shared_prefix=config.hold_shared_prefix,
            executors=executors,
            eos_token_ids=self.eos_token_ids,
            max_waiting=config.max_waiting,
            max_running=config.max_running,
            max_model_len=self.max_model_len,
        )
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Group, _Sample]] = {}  # engine id -> its request and sample
        self._ended: list[str] = []  # engine ids ended outside a step (aborts), reported by the next step
        self._unrecorded = False  # a door refusal or abort the next step record will show
        self._ids = itertools.count()

    # Requests in --------------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        arrival_step: int = 0,
    ) -> str:
        """Submit one request (``params.n`` samples); return its id.

        ``request_id`` defaults to the next of ``"0"``, ``"1"``, ...;
        ``prompt`` is only carried into the output; ``arrival_step`` is the
        engine step from which it may be admitted (0: at once).  Sample ``j``
        of ``n > 1`` runs as m12 request ``"<id>#<j>"`` with
        ``params.for_sample(j)``.  Raises ``ValueError`` for params that are
        not a ``SamplingParams``, a prompt id or stop token id outside the
        vocabulary, or an id already in use, and ``RequestRejected`` (a
        ``ValueError``) when m12's door refuses it (empty prompt, longer than
        ``max_model_len``, never fitting the pool, too many waiting).  A
        refused request leaves nothing behind; everything already submitted
        keeps running.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._check_ids(prompt_ids, params)
        request_id = self._new_id() if request_id is None else str(request_id)
        if request_id in self._groups:
            raise RequestRejected(request_id, m12.RejectReason.DUPLICATE_ID, "a request with this id is running")
        group = _Group(request_id, prompt, ids, [], time.perf_counter())
        for j in range(params.n):
            sample_params = params.for_sample(j) if params.n > 1 else params
            engine_id = request_id if params.n == 1 else f"{request_id}#{j}"
            request = m12.Request(
                engine_id,
                list(ids),
                sample_params.max_tokens,
                arrival_step=arrival_step,
                stop_token_ids=sample_params.stop_token_ids,
                ignore_eos=sample_params.ignore_eos,
            )
            reason = self.engine.add_request(request)
            if reason is not None:
                self._unrecorded = True
                for earlier in group.samples:  # only OVERLOADED can refuse a later sample
                    self.engine.abort(earlier.engine_id)
                    self._forget(earlier.engine_id)
                raise RequestRejected(request_id, reason, self._reject_detail(reason, len(ids), params.max_tokens))
            sample = _Sample(engine_id, j, sample_params, self._output_text(ids, sample_params))
            if sample_params.logprobs is not None:
                sample.logprobs = []
            group.samples.append(sample)
            self._register(engine_id, ids, sample_params)
        self._groups[request_id] = group
        for sample in group.samples:
            self._samples[sample.engine_id] = (group, sample)
        return request_id

    def abort(self, request_id: str) -> bool:
        """End every live sample of ``request_id`` now (finish reason ``"abort"``); False if none is live.

        Its private pages return at once; the next ``step`` reports the end.
        """
        group = self._groups.get(request_id)
        live = [s for s in group.samples if not s.finished] if group else []
        for sample in live:
            self.engine.abort(sample.engine_id)
            self._forget(sample.engine_id)
            sample.finish_reason = ABORT
            self._ended.append(sample.engine_id)
            self._unrecorded = True
        return bool(live)

    def has_unfinished(self) -> bool:
        """Whether ``step`` still has something to do or to report."""
        return bool(self._groups) or self._unrecorded

    # One step -----------------------------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Run one engine step; return its record, each touched sample's delta and the requests that ended.

        Engine and executor failures propagate (``m12.OutOfPages``, a torch
        error); the engine's ``step_counter`` names the failing step.
        """
        if self.speculative is not None and self.speculative.adaptive:
            self.engine.spec_len = self._advised_spec_len(self.speculative.num_speculative_tokens)
        try:
            record = self.engine.step()
        except (m12.GroupViolation, RankError):
            self.close()  # the ranks' states can no longer be trusted to agree
            raise
        now = time.perf_counter()
        self._unrecorded = False
        touched: dict[str, None] = dict.fromkeys(self._ended)
        self._ended = []
        for engine_id, ids in record.tokens.items():
            if engine_id in self._samples:
                self._append(engine_id, ids, record.finished.get(engine_id), now)
                touched[engine_id] = None
        for engine_id, reason in record.finished.items():
            if engine_id in self._samples and engine_id not in touched:  # max_tokens 0: ended with no token
                self._end(self._samples[engine_id][1], reason)
                touched[engine_id] = None
        deltas = [self._delta(engine_id) for engine_id in touched]
        groups = {id(g): g for g, _ in (self._samples[engine_id] for engine_id in touched)}
        return StepOutput(record, tuple(deltas), tuple(self._retire(groups.values(), now)))

    def _append(self, engine_id: str, ids: Sequence[int], reason: m12.FinishReason | None, now: float) -> None:
        """Keep the ids a step appended, up to a stop string's last character; end the sample if it ended."""
        group, s = self._samples[engine_id]
        taken = self._logprobs(engine_id) if s.logprobs is not None else []
        ends_with_stop_id = reason in (m12.FinishReason.EOS, m12.FinishReason.STOP)
        kept = len(ids)
        stop: str | None = None
        for k, token_id in enumerate(ids):
            is_end_id = ends_with_stop_id and k == len(ids) - 1
            stop = s.text.push(token_id, detokenize=not is_end_id or s.params.include_stop_str_in_output)
            if stop is not None:
                kept = k + 1
                break
        s.new_ids += ids[:kept]
        s.token_ids += ids[:kept]
        s.token_times += [now] * kept
        if s.logprobs is not None:
            s.new_logprobs += taken[:kept]
            s.logprobs += taken[:kept]
        if kept and group.first_token_time is None:
            group.first_token_time = now
        if stop is not None:
            if reason is None:  # still live in the engine: take it out
                self.engine.abort(engine_id)
                self._unrecorded = True
            self._forget(engine_id)
            s.finish_reason, s.stop_reason = STOP, stop
        elif reason is not None:
            self._end(s, reason)

    def _end(self, s: _Sample, reason: m12.FinishReason) -> None:
        """The engine ended ``s``: its finish reason, then the last held-back characters (which may hold a stop)."""
        self._forget(s.engine_id)
        if reason is m12.FinishReason.LENGTH:
            s.finish_reason, s.stop_reason = LENGTH, None
        else:
            s.finish_reason = STOP
            s.stop_reason = s.token_ids[-1] if reason is m12.FinishReason.STOP and s.token_ids else None
        stop = s.text.finish()
        if stop is not None:
            s.stop_reason = stop
            s.finish_reason = STOP

    def _advised_spec_len(self, max_k: int) -> int:
        """The ``spec_len`` for the coming step: what the executor advises for the requests about to
        draft (m09's rule: caught up except for the last sampled token; ``cap`` is their draft cap)."""
        caps = [
            (r.request_id, min(max_k, r.max_new_tokens - r.generated - 1))
            for r in self.engine.running
            if r.generated >= 1 and r.computed == r.target - 1
        ]
        return self.executor.advise(caps, max_k) if caps else 0

    def _start_group(self, loaded: Any, seed: int | None, timeout_s: float | None) -> RankGroup:
        """The rank processes for ``world_size`` ranks; ``ValueError`` for a setup they cannot serve."""
        from mechserve.backends.engine import configure_threads
        from mechserve.backends.rank_group import RankSpec, start_group
        from mechserve.backends.tensor_parallel import RankShape

        for rank in range(self.world_size):  # refuse a split the model cannot take before starting anything
            RankShape.of(self.model.arch, self.world_size, rank)
        path = getattr(loaded, "path", None)
        if path is None:
            raise ValueError("world_size > 1 needs a model loaded from a directory (the ranks load their shards)")
        spec = RankSpec(
            path=str(path),
            dtype=str(self.model.dtype).removeprefix("torch."),
            num_pages=self.num_pages,
            page_size=self.config.page_size,
            seed=seed,
            speculative=self.speculative,
            threads=max(1, configure_threads() // self.world_size),
            native_attention=native.enabled(),
            arch=getattr(self.model, "arch", None),
            rope=(self.model.inv_freq, self.model.rope_scaling) if hasattr(self.model, "inv_freq") else None,
        )
        return start_group(spec, self.world_size, timeout_s=timeout_s)

    def close(self) -> None:
        """Stop the rank processes (nothing with one rank); the core serves no more steps after it."""
        if self.group is not None:
            self.group.close()

    def _draft_model(self, loaded: Any) -> Any:
        """The draft ``LlamaModel`` the speculative config names (None unless its method is ``"draft"``)."""
        spec = self.speculative
        if spec is None or spec.method != "draft" or spec.draft_model is None:
            return None
        from mechserve.backends.speculative import load_draft_model

        return load_draft_model(
            spec.draft_model, self.model, target_path=getattr(loaded, "path", None), target_tokenizer=self.tokenizer
        )

    def _delta(self, engine_id: str) -> SampleDelta:
        group, s = self._samples[engine_id]
        delta = SampleDelta(
            request_id=group.request_id,
            index=s.index,
            token_ids=s.new_ids,
            text=s.text.take(final=s.finished),
            finished=s.finished,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=s.new_logprobs if s.logprobs is not None else None,
        )
        s.new_ids, s.new_logprobs = [], []
        return delta

    def _retire(self, groups: Iterable[_Group], now: float) -> list[RequestOutput]:
        """Outputs of those of ``groups`` whose samples have all ended; they leave the core."""
        done = [g for g in groups if all(s.finished for s in g.samples)]
        for group in done:
            del self._groups[group.request_id]
            for s in group.samples:
                self._samples.pop(s.engine_id, None)
        return [self.output(group, now) for group in done]

    # Outputs ------------------------------------------------------------------------------------------------------

    def output(self, group: _Group, now: float | None = None) -> RequestOutput:
        """The ``RequestOutput`` of ``group`` as it stands (``now``: its end time, if it has ended)."""
        finished = all(s.finished for s in group.samples)
        completions = [
            CompletionOutput(
                index=s.index,
                text=s.text.text,
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=sum(lp.logprob for lp in s.logprobs) if s.logprobs is not None else None,
            )
            for s in group.samples
        ]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_token_time=group.first_token_time,
            finished_time=now if finished else None,
            token_times=tuple(tuple(s.token_times) for s in group.samples),
        )
        return RequestOutput(group.request_id, group.prompt, list(group.prompt_ids), completions, finished, metrics)

    # Pages --------------------------------------------------------------------------------------------------------

    def page_counts(self) -> dict[str, int]:
        """``{"free": ..., "cached": ..., "private": ...}`` pages of the pool (they sum to ``num_pages``)."""
        owners = self.engine.pool.owner
        cached = sum(1 for o in owners if o is m12.CACHE)
        free = len(self.engine.pool.free)
        return {"free": free, "cached": cached, "private": self.num_pages - free - cached}

    def check_pages(self) -> None:
        """Raise ``AssertionError`` unless the pool is consistent (m12's check) and, with no request
        in the engine, every page is free or cache-owned (free + cached == num_pages)."""
        self.engine.check_invariants()
        if not self.engine.live:
            counts = self.page_counts()
            assert counts["free"] + counts["cached"] == self.num_pages, f"pages leaked: {counts}"

    # Submission checks --------------------------------------------------------------------------------------------

    def _check_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints; raises ``ValueError`` for an id or stop token id outside the vocabulary."""
        if isinstance(prompt_ids, str | bytes):
            raise ValueError("prompt_ids must be a sequence of token ids, not text (encode it first)")
        ids = list(prompt_ids)
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t!r} at position {pos} is not a token id of this model "
                    f"(vocabulary of {self.vocab_size}: 0..{self.vocab_size - 1})"
                )
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids: {t} is not a token id of this model (vocabulary of {self.vocab_size}: "
                    f"0..{self.vocab_size - 1})"
                )
        return ids

    def _reject_detail(self, reason: m12.RejectReason, prompt_len: int, max_tokens: int) -> str:
        """The limit behind a door refusal, in words."""
        ps = self.config.page_size
        if reason is m12.RejectReason.EMPTY_PROMPT:
            return "the prompt has no tokens"
        if reason is m12.RejectReason.TOO_LONG:
            limit = (
                f"max_model_len {self.max_model_len}"
                if self.config.max_model_len
                else f"the model's context of {self.max_model_len} positions"
            )
            return (
                f"a prompt of {prompt_len} token(s) + {max_tokens} new token(s) = {prompt_len + max_tokens}, "
                f"over {limit}"
            )
        if reason is m12.RejectReason.NEVER_FITS:
            need = m12.pages_for(prompt_len + max_tokens - 1, ps)
            return f"needs {need} pages of {ps} positions, the pool has {self.num_pages}"
        if reason is m12.RejectReason.OVERLOADED:
            return f"{self.config.max_waiting} request(s) already wait (max_waiting)"
        if reason is m12.RejectReason.DUPLICATE_ID:
            return "a request with this id is running"
        return str(reason.value)

    def _new_id(self) -> str:
        while True:
            candidate = str(next(self._ids))
            if candidate not in self._groups:
                return candidate

    def _output_text(self, prompt_ids: list[int], params: SamplingParams) -> OutputText:
        tok = self.tokenizer
        skip = params.skip_special_tokens

        def decode(ids: Sequence[int]) -> str:
            return "" if tok is None else str(tok.decode(list(ids), skip_special_tokens=skip))

        return OutputText(decode, prompt_ids, params.stop, params.include_stop_str_in_output, params.min_tokens)

    # The executor's request API (TorchExecutor.add_request / take_logprobs / release): every call is here.

    def _register(self, engine_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.executor.add_request(engine_id, prompt_ids, params, eos_token_ids=self.eos_token_ids)

    def _logprobs(self, engine_id: str) -> list[TokenLogprobs]:
        return list(self.executor.take_logprobs(engine_id))

    def _forget(self, engine_id: str) -> None:
        self.executor.release(engine_id)
