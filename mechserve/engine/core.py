"""The engine: one scheduler (the top rung, m14), one executor behind the boundary, and the tokenizer.

``EngineCore`` is what every front end drives: ``LLM`` (offline batches), the background stepper
under ``AsyncLLM`` and the server, ``mechserve generate`` and ``mechserve run --backend torch``.
It is synchronous, single-threaded and does no I/O; one step happens in one place, ``step``::

    add_request(prompt_ids, params) ── validate ── m12's door ──┬── RequestRejected (ValueError)
                                                                └── n samples: m14 requests + executor registrations
    step() ── advise spec_len (adaptive speculation)
           ── scheduler.step(): m14 schedules, the executor runs the plan, m14 commits the outcomes
           ── per sample: keep the new ids, detokenize, find stop strings (a match finishes it: STOP)
           ── the record with every stop cut applied ── executor.settle(its accepted): what each decode
              window kept is what the executor counts ── release the samples that ended
           ── deltas; the RequestOutput of each request that ended
    run_until_idle(on_step) ── step() while anything is unfinished; the outputs of the requests that ended
    abort(request_id) ── every live sample leaves now (its pages return); the next step reports it

Nothing outside ``mechserve.engine`` touches the scheduler's state: metrics read ``stats()``.
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mechserve.api.config import EngineConfig, dtype_name
from mechserve.api.errors import ParamError, RankError, RequestRejected
from mechserve.api.outputs import ABORT, LENGTH, STOP, PositionLogprobs, RequestOutput, StepOutput, TokenLogprobs
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.engine.detokenizer import OutputText
from mechserve.engine.executors import build_executor, configure_threads, load_draft, place_model
from mechserve.engine.pool import check_kv_memory, draft_page_bytes, model_context, page_bytes, size_pool
from mechserve.engine.requests import RequestGroup, Sample
from mechserve.engine.scheduler import PageUsage, Scheduler
from mechserve.executor.protocol import Executor, ExecutorStats
from mechserve.executor.structured import CompiledGrammar, GrammarCompiler
from mechserve.kv import native
from mechserve.model import linear as linear_kernel
from mechserve.spec import m14_forced_runs as m14

__all__ = ["EngineCore", "EngineStats"]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine between two steps: ``running`` and ``waiting`` requests, the ``pages`` of the KV pool,
    ``steps`` run so far and, when asked for, the executor's counters (``ExecutorStats``, else None)."""

    running: int
    waiting: int
    pages: PageUsage
    steps: int
    executor: ExecutorStats | None = None


class EngineCore:
    """One m14 scheduler over one executor, with the tokenizer that turns ids into text.

    ``loaded`` is a ``LoadedModel`` (or anything with ``model``, ``tokenizer``, ``eos_token_ids``
    and, for ranks or a draft model of the same checkpoint, ``path``; the tokenizer needs
    ``decode(ids, skip_special_tokens=...)`` and may be None, giving empty texts).  ``config``
    sizes the engine (``EngineConfig``; the pool: ``num_pages``, else ``kv_memory``, else
    automatic, see ``mechserve.engine.pool``).  ``executor`` replaces the one built from
    ``loaded`` (a ``TorchExecutor``, or a ``RankGroup`` for ``world_size > 1``): anything that
    implements ``mechserve.executor.protocol.Executor`` over a pool of ``num_pages`` pages.
    ``keep_finished`` keeps requests that left in ``summary()`` (a finite run); otherwise a
    request is dropped once its end has been reported.  ``rank_timeout_s``: the longest a rank may
    take to answer one step (default ``MECHSERVE_RANK_TIMEOUT``).

    The KV cache is allocated here.  Raises ``ValueError`` for bad sizes, a ``config.dtype`` or
    ``config.quantization`` other than the model's, or a draft model that cannot serve this model, ``KVMemoryError`` when the cache exceeds ``kv_memory`` or the
    available memory or cannot be allocated, ``NativeKernelError`` when ``MECHSERVE_ATTENTION=native``
    and the kernel cannot be built, ``RankError`` when a rank cannot start.

    Speculation (``config.speculative_config()``): with ``adaptive`` on, every ``step`` first
    chooses the engine's ``spec_len`` (0 .. ``num_speculative_tokens``) from what the executor
    advises for the requests about to draft: the guesses their proposers have, weighed by how
    often their guesses were accepted.  A rank that crashes or hangs raises ``RankError``, a
    disagreement ``m14.GroupViolation``; either shuts the group down.
    """

    def __init__(
        self,
        loaded: Any,
        config: EngineConfig | None = None,
        *,
        executor: Executor | None = None,
        keep_finished: bool = False,
        rank_timeout_s: float | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        # Settle the attention and linear paths now: a bad MECHSERVE_ATTENTION / MECHSERVE_LINEAR or a
        # kernel that cannot be built in ``native`` mode fails here, at load time, not at the first step.
        native.enabled()
        linear_kernel.enabled()
        if executor is None:  # weights and KV pool on config.device, the one place a model is moved
            placed = place_model(loaded.model, config)
            if placed is not loaded.model:
                loaded = copy.copy(loaded)
                loaded.model = placed
        self.model = loaded.model
        loaded_as = dtype_name(getattr(self.model, "dtype", config.dtype))
        if loaded_as != config.dtype:
            raise ValueError(
                f"the model was loaded in {loaded_as} but the config asks for dtype {config.dtype!r}: "
                f"give dtype={loaded_as!r}, or load the model in {config.dtype}"
            )
        loaded_q = getattr(self.model, "quantization", None)
        if loaded_q != config.quantization:
            raise ValueError(
                f"the model was loaded with quantization {loaded_q} but the config asks for {config.quantization}: "
                "load it with the config's quantization (EngineCore.open does)"
            )
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.eos_token_ids)
        self.vocab_size: int = self.model.arch.vocab_size
        context = model_context(self.model)
        if config.max_model_len and context is not None and config.max_model_len > context:
            # as vLLM: positions past the model's RoPE range were never trained and its cos/sin tables end there
            raise ValueError(
                f"max_model_len {config.max_model_len} is more than the model's context of {context} positions "
                "(max_position_embeddings in its config.json)"
            )
        self.max_model_len = config.max_model_len or context
        self.speculative = config.speculative_config()
        if config.world_size > 1 and self.speculative is not None and self.speculative.method == "draft":
            raise ValueError("a draft model with world_size > 1 is not supported (use prompt lookup or one rank)")
        draft = None if executor is not None else load_draft(loaded, self.speculative)
        if draft is not None:
            draft = place_model(draft, config)
        self.num_pages, self.sized_by = size_pool(self.model, config, self.max_model_len)
        per_page = page_bytes(self.model, config.page_size) + draft_page_bytes(draft, config.page_size)
        self.kv_bytes = self.num_pages * per_page
        check_kv_memory(config, self.num_pages, self.kv_bytes, self.sized_by)
        self.world_size = config.world_size
        self.executor: Executor = executor or build_executor(
            loaded, config, self.num_pages, self.sized_by, self.speculative, draft, rank_timeout_s
        )
        self.scheduler = Scheduler(
            config,
            num_pages=self.num_pages,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            executors=self.executor.rank_executors(),
            keep_finished=keep_finished,
        )
        self._groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, tuple[RequestGroup, Sample]] = {}  # engine id -> its request and sample
        self._ended: list[str] = []  # engine ids ended outside a step (aborts), reported by the next step
        self._leaving: list[str] = []  # engine ids that ended in this step: released after the step's settle
        self._unrecorded = False  # a door refusal or abort the next step record will show
        self._ids = itertools.count()
        self._token_text: dict[int, str] = {}  # decoded_token of each id a logprob has named
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    @classmethod
    def open(cls, model: Any, config: EngineConfig | None = None, **kwargs: Any) -> EngineCore:
        """Load ``model`` (``"smollm2"``, a local Hugging Face directory, or an already loaded
        ``LoadedModel``) in ``config.dtype`` (and ``config.quantization``) and build its engine; ``kwargs``
        go to ``EngineCore``.

        With ``world_size > 1`` the driver loads no weights (the rank processes load their shards).
        Raises ``ModelLoadError`` and what ``EngineCore`` raises.
        """
        from mechserve.model.loader import LoadedModel, load_model, torch_dtype

        config = config or EngineConfig()
        configure_threads()
        loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                os.fspath(model),
                dtype=torch_dtype(config.dtype),
                weights=config.world_size == 1,
                quantization=config.quantization,
            )
        )
        return cls(loaded, config, **kwargs)

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

        ``request_id`` defaults to the next of ``"0"``, ``"1"``, ...; ``prompt`` is only carried
        into the output; ``arrival_step`` is the engine step from which it may be admitted (0: at
        once).  Sample ``j`` of ``n > 1`` runs as m14 request ``"<id>#<j>"`` with
        ``params.for_sample(j)``; only sample 0 computes prompt logprobs.  A prompt longer than
        ``params.truncate_prompt_tokens`` keeps its last that many ids.  A request for prompt
        logprobs with ``max_tokens`` 0 runs its prompt (m14 sees one new token, never kept).
        Raises ``ParamError`` (a ``ValueError`` naming the field) for a prompt id, stop token id,
        ``logit_bias`` or ``allowed_token_ids`` id outside the vocabulary, bad words without a
        tokenizer, ``n`` over ``max_waiting`` (it could never be admitted), ``ValueError`` for
        params that are not a ``SamplingParams``, and ``RequestRejected`` (a ``ValueError``) when
        m12's door refuses it (empty prompt, longer than ``max_model_len``, never fitting the pool,
        too many waiting, an id in use).  A refused request leaves nothing behind; everything
        already submitted keeps running.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._truncated(self._check_ids(prompt_ids, params), params)
        bad_words = self._bad_words_ids(params)
        grammar = self.compile_grammar(params.structured_outputs) if params.structured_outputs else None
        constrained = {} if grammar is None else {"grammar": grammar}
        limit = self.config.max_waiting
        if limit is not None and params.n > limit:
            raise ParamError(
                "n",
                f"n={params.n} samples can never be admitted: at most max_waiting={limit} requests may wait "
                f"(each sample is one request); lower n",
            )
        request_id = self._new_id() if request_id is None else str(request_id)
        if request_id in self._groups:
            raise RequestRejected(request_id, m14.RejectReason.DUPLICATE_ID, "a request with this id is running")
        group = RequestGroup(request_id, prompt, ids, [], time.perf_counter())
        prompt_only = params.prompt_logprobs is not None and params.max_tokens == 0
        max_new = 1 if prompt_only else params.max_tokens
        for j in range(params.n):
            sample_params = params.for_sample(j) if params.n > 1 else params
            if j > 0 and sample_params.prompt_logprobs is not None:  # one sample computes them for all
                sample_params = replace(sample_params, prompt_logprobs=None)
            engine_id = request_id if params.n == 1 else f"{request_id}#{j}"
            reason = self.scheduler.add(
                engine_id,
                ids,
                max_new if j == 0 else sample_params.max_tokens,
                arrival_step=arrival_step,
                stop_token_ids=sample_params.stop_token_ids,
                ignore_eos=sample_params.ignore_eos,
            )
            if reason is not None:
                self._unrecorded = True
                for earlier in group.samples:  # only OVERLOADED can refuse a later sample
                    self.scheduler.abort(earlier.engine_id)
                    self.executor.release(earlier.engine_id)
                raise RequestRejected(request_id, reason, self._reject_detail(reason, len(ids), max_new, prompt_only))
            sample = Sample(engine_id, j, sample_params, self._output_text(ids, sample_params))
            sample.prompt_only = prompt_only and j == 0
            if sample_params.logprobs is not None:
                sample.logprobs = []
            group.samples.append(sample)
            self.executor.add_request(
                engine_id, ids, sample_params, eos_token_ids=self.eos_token_ids, bad_words_ids=bad_words, **constrained
            )
        self._groups[request_id] = group
        for sample in group.samples:
            self._samples[sample.engine_id] = (group, sample)
        return request_id

    def abort(self, request_id: str) -> bool:
        """End every live sample of ``request_id`` now (finish reason ``"abort"``); False if none is live.

        Its private pages return at once, its published prompt pages stay cached; the next
        ``step`` reports the end.
        """
        group = self._groups.get(request_id)
        live = [s for s in group.samples if not s.finished] if group else []
        for sample in live:
            self.scheduler.abort(sample.engine_id)
            self.executor.release(sample.engine_id)
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

        Engine and executor failures propagate (``m14.OutOfPages``, a torch error, ``RankError``);
        ``step_counter`` names the failing step.
        """
        spec_len = None
        if self.speculative is not None and self.speculative.adaptive:
            spec_len = self._advised_spec_len(self.speculative.num_speculative_tokens)
        try:
            step = self.scheduler.step(spec_len)
        except (m14.GroupViolation, RankError):
            self.close()  # the ranks' states can no longer be trusted to agree
            raise
        now = time.perf_counter()
        record = step.record
        self._unrecorded = False
        for engine_id in record.admitted:
            group = self._samples[engine_id][0] if engine_id in self._samples else None
            if group is not None and group.scheduled_time is None:
                group.scheduled_time = now
                group.num_cached_tokens = record.reused.get(engine_id, 0)
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
        deltas = [self._samples[engine_id][0].delta(self._samples[engine_id][1]) for engine_id in touched]
        groups = {id(g): g for g, _ in (self._samples[engine_id] for engine_id in touched)}
        record = self.scheduler.cut(record)
        # The executor counts and learns from what the requests kept, then forgets the ones that ended.
        self.executor.settle(record.accepted)
        leaving, self._leaving = self._leaving, []
        for engine_id in leaving:
            self.executor.release(engine_id)
        return StepOutput(
            record,
            tuple(deltas),
            tuple(self._retire(groups.values(), now)),
            prompt_tokens=step.prompt_tokens,
            prefix_hits=step.prefix_hits,
            preemptions=step.preemptions,
        )

    def run_until_idle(self, on_step: Callable[[StepOutput], None] | None = None) -> list[RequestOutput]:
        """``step`` until nothing is unfinished; return the outputs of the requests that ended, in the
        order they ended.  ``on_step`` sees every ``StepOutput`` as soon as it exists (progress, a
        printed trace).  A failure propagates after the steps before it were seen."""
        finished: list[RequestOutput] = []
        while self.has_unfinished():
            out = self.step()
            finished += out.finished
            if on_step is not None:
                on_step(out)
        return finished

    def _append(self, engine_id: str, ids: Sequence[int], reason: m14.FinishReason | None, now: float) -> None:
        """Keep the ids a step appended, up to a stop string's last character; end the sample if it ended."""
        group, s = self._samples[engine_id]
        taken = self.executor.take_logprobs(engine_id) if s.logprobs is not None else []
        if s.params.prompt_logprobs is not None and group.prompt_logprobs is None:
            # every prompt position is recorded by the step that samples the first token
            found = self.executor.take_prompt_logprobs(engine_id)
            group.prompt_logprobs = [None, *(self._vllm_logprobs(lp) for lp in found)]
        ends_with_stop_id = reason in (m14.FinishReason.EOS, m14.FinishReason.STOP)
        kept = 0 if s.prompt_only else len(ids)
        stop: str | None = None
        for k, token_id in enumerate(ids[:kept]):
            is_end_id = ends_with_stop_id and k == len(ids) - 1
            stop = s.text.push(token_id, detokenize=not is_end_id or s.params.include_stop_str_in_output)
            if stop is not None:
                kept = k + 1
                break
        s.new_ids += ids[:kept]
        s.token_ids += ids[:kept]
        s.token_times += [now] * kept
        if s.logprobs is not None:
            entries = [self._vllm_logprobs(lp) for lp in taken[:kept]]
            s.new_logprobs += entries
            s.logprobs += entries
            s.cumulative_logprob += sum(lp.logprob for lp in taken[:kept])
        if kept and group.first_token_time is None:
            group.first_token_time = now
        if s.prompt_only:
            self.scheduler.trim(engine_id, 0)
        if stop is not None:
            self.scheduler.finish(engine_id, kept, generated=len(s.token_ids))
            self._leaving.append(engine_id)
            s.finish_reason, s.stop_reason = STOP, stop
        elif reason is not None:
            self._end(s, reason)

    def _end(self, s: Sample, reason: m14.FinishReason) -> None:
        """The engine ended ``s``: its finish reason, then the last held-back characters (which may hold a stop).

        Its executor state is released after the step's ``settle``."""
        self._leaving.append(s.engine_id)
        if reason is m14.FinishReason.LENGTH:
            s.finish_reason, s.stop_reason = LENGTH, None
        else:
            s.finish_reason = STOP
            s.stop_reason = s.token_ids[-1] if reason is m14.FinishReason.STOP and s.token_ids else None
        stop = s.text.finish()
        if stop is not None:
            s.stop_reason = stop
            s.finish_reason = STOP

    def _vllm_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        """An executor's record as vLLM's ``dict[int, Logprob]``, each id's text decoded once."""
        return lp.to_dict(self._decoded_token)

    def _decoded_token(self, token_id: int) -> str | None:
        tok = self.tokenizer
        if tok is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(tok.decode([token_id]))
        return text

    def _advised_spec_len(self, max_k: int) -> int:
        """The ``spec_len`` for the coming step: what the executor advises for the requests about to draft."""
        caps = self.scheduler.drafting(max_k)
        return self.executor.advise(caps, max_k) if caps else 0

    def _retire(self, groups: Any, now: float) -> list[RequestOutput]:
        """Outputs of those of ``groups`` whose samples have all ended; they leave the core."""
        done = [g for g in groups if g.finished]
        for group in done:
            del self._groups[group.request_id]
            for s in group.samples:
                self._samples.pop(s.engine_id, None)
        return [group.output(now) for group in done]

    # Reading ------------------------------------------------------------------------------------------------------

    @property
    def step_counter(self) -> int:
        """The number of the next step (while a step raises: the failing one)."""
        return self.scheduler.step_counter

    def stats(self, *, executor: bool = False) -> EngineStats:
        """Requests running and waiting and the pool's pages (O(1), plus a walk of the running page tables for
        the shared pages); with ``executor``, also the executor's counters (for a rank group, a round trip
        to rank 0)."""
        running, waiting = self.scheduler.counts()
        counters = self.executor.stats() if executor else None
        return EngineStats(running, waiting, self.scheduler.page_usage(), self.step_counter, counters)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        """The prompt ids a live request runs with (after ``truncate_prompt_tokens``)."""
        return list(self._groups[request_id].prompt_ids)

    def summary(self) -> list[dict[str, Any]]:
        """The scheduler's end-of-run summary (``request_id``, ``state``, ``generated``, ``computed``,
        ``finish_reason`` per request; a stop-string finish is ``FINISHED``/``STOP``)."""
        return self.scheduler.summary()

    def check_pages(self) -> None:
        """Raise ``AssertionError`` unless the pool is consistent (m14's check) and, with no request
        in the engine, every page is free or cache-owned."""
        self.scheduler.check()

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` can have: what it leaves of the model's context
        and of the page pool (at least 1, so that m12's door names the limit when nothing is left)."""
        room = self.num_pages * self.config.page_size - prompt_len + 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - prompt_len)
        return max(room, 1)

    def close(self) -> None:
        """Stop what the executor runs outside this process (rank processes); no steps after it."""
        self.executor.close()

    # Submission checks --------------------------------------------------------------------------------------------

    def compile_grammar(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """``so`` compiled for this model's tokenizer (cached by ``so.key``); safe from any thread.

        ``AsyncLLM`` calls it in a worker thread before it hands a request to the engine thread, so a
        schema is compiled before admission and never on the step loop; ``add_request`` then finds
        it in the cache.  Raises ``ParamError("structured_outputs", ...)`` naming the problem (a
        schema keyword llguidance does not implement, a bad regex or grammar), or when this engine
        cannot constrain (no tokenizer, ``world_size > 1``)."""
        if self.world_size > 1:
            raise ParamError("structured_outputs", "structured outputs are not supported with world_size > 1 yet")
        if self.tokenizer is None or not hasattr(self.tokenizer, "backend_tokenizer"):
            raise ParamError(
                "structured_outputs", "structured outputs need the model's Hugging Face tokenizer; this one has none"
            )
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer,
                    self.vocab_size,
                    allow_additional_properties=self.config.allow_additional_properties,
                )
            grammars = self._grammars
        return grammars.compile(so)

    def _check_ids(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints; raises ``ParamError`` for an id outside the vocabulary in the
        prompt, ``stop_token_ids``, ``logit_bias`` or ``allowed_token_ids``."""
        if isinstance(prompt_ids, str | bytes):
            raise ParamError("prompt", "prompt_ids must be a sequence of token ids, not text (encode it first)")
        ids = list(prompt_ids)
        vocab = f"vocabulary of {self.vocab_size}: 0..{self.vocab_size - 1}"
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ParamError(
                    "prompt", f"prompt token id {t!r} at position {pos} is not a token id of this model ({vocab})"
                )
        fields = {
            "stop_token_ids": params.stop_token_ids,
            "logit_bias": tuple(params.logit_bias or ()),
            "allowed_token_ids": params.allowed_token_ids or (),
        }
        for name, found in fields.items():
            bad = next((t for t in found if t >= self.vocab_size), None)
            if bad is not None:
                raise ParamError(name, f"{name}: {bad} is not a token id of this model ({vocab})")
        return ids

    def _truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The last ``params.truncate_prompt_tokens`` ids (-1: the model's context), as vLLM truncates."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 and self.max_model_len is not None else keep
        return ids[-keep:] if 0 < keep < len(ids) else ids

    def _bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """``params.bad_words`` as token ids, vLLM's way (``SamplingParams.update_from_tokenizer``): each
        word as given (leading spaces stripped), and with one leading space when that spells it with
        as many tokens but another first token (a word inside the text, not at its start)."""
        if not params.bad_words:
            return []
        tok = self.tokenizer
        if tok is None:
            raise ParamError("bad_words", "bad_words need a tokenizer; this model was loaded without one")
        found: list[list[int]] = []
        for word in params.bad_words:
            plain = list(tok(word.lstrip(), add_special_tokens=False).input_ids)
            spaced = list(tok(" " + word.lstrip(), add_special_tokens=False).input_ids)
            if plain:
                found.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                found.append(spaced)
        bad = next((t for w in found for t in w if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError("bad_words", f"bad_words: token {bad} is outside this model's vocabulary")
        return found

    def _reject_detail(
        self, reason: m14.RejectReason, prompt_len: int, max_tokens: int, prompt_only: bool = False
    ) -> str:
        """The limit behind a door refusal, in words."""
        ps = self.config.page_size
        if reason is m14.RejectReason.EMPTY_PROMPT:
            return "the prompt has no tokens"
        if reason is m14.RejectReason.TOO_LONG:
            limit = (
                f"max_model_len {self.max_model_len}"
                if self.config.max_model_len
                else f"the model's context of {self.max_model_len} positions"
            )
            extra = " (prompt logprobs with max_tokens 0 compute one position past the prompt)" if prompt_only else ""
            return (
                f"a prompt of {prompt_len} token(s) + {max_tokens} new token(s) = {prompt_len + max_tokens}, "
                f"over {limit}{extra}"
            )
        if reason is m14.RejectReason.NEVER_FITS:
            need = m14.pages_for(prompt_len + max_tokens - 1, ps)
            return f"needs {need} pages of {ps} positions, the pool has {self.num_pages}"
        if reason is m14.RejectReason.OVERLOADED:
            return f"{self.config.max_waiting} request(s) already wait (max_waiting)"
        if reason is m14.RejectReason.DUPLICATE_ID:
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
