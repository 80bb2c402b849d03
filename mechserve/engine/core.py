"""The engine: one scheduler (the top rung, m16), one executor behind the boundary, and the tokenizer.

``EngineCore`` is what every front end drives: ``LLM`` (offline batches), the background stepper
under ``AsyncLLM`` and the server, ``mechserve generate`` and ``mechserve run --backend torch``.
It is synchronous, single-threaded and does no I/O; one step happens in one place, ``step``::

    add_request(prompt_ids, params) ── admission checks ── m12's door ──┬── RequestRejected (ValueError)
                                                                        └── n samples: m14 requests + records
    step()  plan = scheduler.schedule(spec_len, limits)    m16 admits, reuses, drafts, schedules, plans
            outcomes = executor.execute(plan)              every rank's report joined (m11)
            record = scheduler.commit(outcomes, stop)      m14 commits; stop = what the text decided
            settle, release, outputs                       the executor counts what was kept; deltas
    run_until_idle(on_step) ── step() while anything is unfinished; the outputs of the requests that ended
    abort(request_id) ── every live sample leaves now (its pages return); the next step reports it

``stop`` is asked by m14's commit for each request that appended ids, right after they were appended
(m12 N26): the ids are detokenized and searched for stop strings (``Sample.keep``), and a match keeps
the ids up to it and ends the request with STOP inside the commit, so the record that comes back is
already the one the requests kept and nothing rewrites it.  A request the executor reports failed
(its grammar raised inside the step) keeps none of them and ends alone, with its error.

The construction-time checks are ``mechserve.engine.builder``'s; admission's are
``mechserve.engine.admission``'s.  Nothing outside ``mechserve.engine`` touches the scheduler's
state: metrics read ``stats()``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mechserve.api.config import EngineConfig
from mechserve.api.errors import RankError, RequestFailed, RequestRejected
from mechserve.api.outputs import ABORT, PositionLogprobs, RequestOutput, StepOutput, TokenLogprobs
from mechserve.api.params import SamplingParams, StructuredOutputsParams
from mechserve.engine import admission
from mechserve.engine.builder import assemble, load
from mechserve.engine.requests import RequestGroup, Sample
from mechserve.engine.scheduler import PageUsage, Scheduler, Step
from mechserve.executor.protocol import Executor, ExecutorStats, RequestFailure
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.structured import CompiledGrammar
from mechserve.spec import m16_request_draft_lengths as m16

__all__ = ["EngineCore", "EngineStats"]

log = logging.getLogger("mechserve.engine")
FAILED = "error"  # a sample of a failed request (never shown: the request ends with its error, not an output)


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

    The KV cache is allocated here; raises what ``mechserve.engine.builder.assemble`` raises
    (``ValueError``, ``KVMemoryError``, ``NativeKernelError``, ``RankError``).

    Speculation (``config.speculative_config()``): with ``adaptive`` on, every ``step`` first
    chooses the engine's ``spec_len`` (0 .. ``num_speculative_tokens``) and each drafting request's
    draft limit (m16) from what the executor advises for the requests about to draft: the guesses their proposers have, weighed by how
    often their guesses were accepted.  A rank that crashes or hangs raises ``RankError``, a
    disagreement ``m16.GroupViolation``; either shuts the group down.
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
        parts = assemble(loaded, config, executor, rank_timeout_s)
        self.model = parts.loaded.model
        self.tokenizer = parts.loaded.tokenizer
        self.eos_token_ids = tuple(parts.loaded.eos_token_ids)
        self.vocab_size: int = self.model.arch.vocab_size
        self.max_model_len = parts.max_model_len
        self.speculative = parts.speculative
        self.num_pages, self.sized_by, self.kv_bytes = parts.num_pages, parts.sized_by, parts.kv_bytes
        self.executor: Executor = parts.executor
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
        self.grammars = admission.Grammars(
            self.tokenizer,
            self.vocab_size,
            config.world_size,
            allow_additional_properties=config.allow_additional_properties,
        )

    @classmethod
    def open(cls, model: Any, config: EngineConfig | None = None, **kwargs: Any) -> EngineCore:
        """Load ``model`` (``"smollm2"``, a local Hugging Face directory, or an already loaded
        ``LoadedModel``) in ``config.dtype`` (and ``config.quantization``) and build its engine; ``kwargs``
        go to ``EngineCore``.

        With ``world_size > 1`` the driver loads no weights (the rank processes load their shards).
        Raises ``ModelLoadError`` and what ``EngineCore`` raises.
        """
        config = config or EngineConfig()
        return cls(load(model, config), config, **kwargs)

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
        params = admission.checked_params(params)
        ids = admission.prompt_ids(prompt_ids, params, self.vocab_size, self.max_model_len)
        admission.check_ids(params, self.vocab_size)
        grammar = self.compile_grammar(params.structured_outputs) if params.structured_outputs else None
        record = ExecutorRequest.of(
            "",
            ids,
            params,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            grammar=grammar,
        )
        admission.check_samples(params, self.config.max_waiting)
        request_id = self._new_id() if request_id is None else str(request_id)
        if request_id in self._groups:
            raise RequestRejected(request_id, m16.RejectReason.DUPLICATE_ID, "a request with this id is running")
        group = RequestGroup(request_id, prompt, ids, [], time.perf_counter())
        for spec in admission.samples(request_id, params):
            p = spec.params
            reason = self.scheduler.add(
                spec.engine_id,
                ids,
                spec.max_new_tokens,
                arrival_step=arrival_step,
                stop_token_ids=p.stop_token_ids,
                ignore_eos=p.ignore_eos,
            )
            if reason is not None:
                self._unrecorded = True
                for earlier in group.samples:  # only OVERLOADED can refuse a later sample
                    self.scheduler.abort(earlier.engine_id)
                    self.executor.release(earlier.engine_id)
                raise RequestRejected(request_id, reason, self._reject_detail(reason, spec, len(ids)))
            sample = Sample.new(spec.engine_id, spec.index, p, self.tokenizer, ids)
            sample.prompt_only = spec.prompt_only
            group.samples.append(sample)
            self.executor.add_request(replace(record, request_id=spec.engine_id, params=p))
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
        """Run one engine step: schedule, execute, commit (with the stops the text decides), then the outputs:
        the step's record, each touched sample's delta, the requests that ended and those that failed.

        Engine and executor failures propagate (``m16.OutOfPages``, a torch error, ``RankError``,
        ``m16.GroupViolation``: the last two shut the rank group down); ``step_counter`` names the
        failing step.  A request that fails on its own account inside the step ends alone (``failed``).
        """
        plan = self.scheduler.schedule(*self._spec_len())
        outcomes = self._execute(plan)
        failures = {f.request_id: f for f in self.executor.take_failures()}
        now = time.perf_counter()
        step = self.scheduler.commit(outcomes, lambda rid, ids, reason: self._stop(rid, ids, reason, failures, now))
        return self._outputs(step, failures, now)

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

    def _spec_len(self) -> tuple[int | None, dict[str, int | None] | None]:
        """The ``spec_len`` for the coming step and the draft limits of the requests about to draft (m16)
        (adaptive speculation: what the executor advises for them), or ``(None, None)`` to leave both."""
        spec = self.speculative
        if spec is None or not spec.adaptive:
            return None, None
        caps = self.scheduler.drafting(spec.num_speculative_tokens)
        if not caps:
            return 0, None
        advice = self.executor.advise(caps, spec.num_speculative_tokens)
        return advice.spec_len, advice.limits

    def _execute(self, plan: tuple[m16.PlanItem, ...]) -> tuple[m16.Outcome, ...]:
        """The executor's outcomes for ``plan``; a rank group that failed or disagreed is shut down."""
        try:
            return self.executor.execute(plan)
        except (m16.GroupViolation, RankError):
            self.close()  # the ranks' states can no longer be trusted to agree
            raise

    def _stop(
        self,
        engine_id: str,
        ids: tuple[int, ...],
        reason: m16.FinishReason | None,
        failures: dict[str, RequestFailure],
        now: float,
    ) -> int | None:
        """The stop ``commit`` asks for (m12 N26): the ids ``engine_id`` appended go to its sample, whose text
        may end it (``Sample.keep``); a failed request keeps none of them."""
        entry = self._samples.get(engine_id)
        if entry is None:
            return None
        if engine_id in failures:
            return 0
        group, s = entry
        if s.params.prompt_logprobs is not None and group.prompt_logprobs is None:
            # every prompt position is recorded by the step that samples the first token
            found = self.executor.take_prompt_logprobs(engine_id)
            group.prompt_logprobs = [None, *(self._vllm_logprobs(lp) for lp in found)]
        taken = self.executor.take_logprobs(engine_id) if s.logprobs is not None else []
        keep = s.keep(ids, reason, now, taken, self._vllm_logprobs)
        if s.token_ids and group.first_token_time is None:
            group.first_token_time = now
        return keep

    def _outputs(self, step: Step, failures: dict[str, RequestFailure], now: float) -> StepOutput:
        """After the commit: samples that ended, failed requests ended alone, the executor settled and the
        leaving released, then the step's deltas and the requests that ended or failed."""
        record = step.record
        self._unrecorded = False
        for engine_id in record.admitted:
            entry = self._samples.get(engine_id)
            if entry is not None and entry[0].scheduled_time is None:
                entry[0].scheduled_time = now
                entry[0].num_cached_tokens = record.reused.get(engine_id, 0)
        touched: dict[str, None] = dict.fromkeys([*self._ended, *record.tokens, *record.finished, *failures])
        self._ended = []
        for engine_id, reason in record.finished.items():
            if engine_id in self._samples and engine_id not in failures:
                sample = self._samples[engine_id][1]
                sample.end(reason)
                self._leaving.append(engine_id)
        for failure in failures.values():
            self._fail(failure)
        self.executor.settle(record.accepted)  # what each decode window kept: the record is final
        leaving, self._leaving = self._leaving, []
        for engine_id in leaving:
            self.executor.release(engine_id)
        entries = [self._samples[e] for e in touched if e in self._samples]
        deltas = tuple(group.delta(sample) for group, sample in entries if group.error is None)
        finished, failed = self._retire({id(g): g for g, _ in entries}.values(), now)
        return StepOutput(
            record,
            deltas,
            tuple(finished),
            failed,
            prompt_tokens=step.prompt_tokens,
            prefix_hits=step.prefix_hits,
            preemptions=step.preemptions,
        )

    def _fail(self, failure: RequestFailure) -> None:
        """A request failed inside this step (``failure``, reported by the executor): it ends alone with a
        ``RequestFailed``; its other samples end now too.  One log line, never the whole grammar."""
        entry = self._samples.get(failure.request_id)
        if entry is None:
            return
        group = entry[0]
        if group.error is None:
            group.error = RequestFailed(group.request_id, failure.param, failure.message)
            log.warning("request %s failed in step %d: %s", group.request_id, self.step_counter - 1, failure.message)
        for s in group.samples:
            if not s.finished:  # the failed sample (ended by its stop in the commit) and its live siblings
                if self.scheduler.abort(s.engine_id):
                    self._unrecorded = True  # the next record lists the sibling under aborted
                s.finish_reason = FAILED
                self._leaving.append(s.engine_id)

    def _retire(self, groups: Any, now: float) -> tuple[list[RequestOutput], dict[str, RequestFailed]]:
        """Of ``groups``, those whose samples have all ended leave the core: their outputs, and the errors of
        those that failed."""
        done = [g for g in groups if g.finished]
        for group in done:
            del self._groups[group.request_id]
            for s in group.samples:
                self._samples.pop(s.engine_id, None)
        failed = {g.request_id: g.error for g in done if g.error is not None}
        return [g.output(now) for g in done if g.error is None], failed

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

    # Submission ---------------------------------------------------------------------------------------------------

    def compile_grammar(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """``so`` compiled for this model's tokenizer (cached by ``so.key``); safe from any thread.

        ``AsyncLLM`` calls it in a worker thread before it hands a request to the engine thread, so a
        schema is compiled before admission and never on the step loop; ``add_request`` then finds it
        in the cache.  Raises what ``admission.Grammars.compile`` raises (``ParamError``)."""
        return self.grammars.compile(so)

    def _reject_detail(self, reason: m16.RejectReason, spec: admission.SampleSpec, prompt_len: int) -> str:
        return admission.reject_detail(
            reason,
            spec,
            prompt_len,
            page_size=self.config.page_size,
            num_pages=self.num_pages,
            max_model_len=self.max_model_len,
            configured_max_model_len=self.config.max_model_len,
            max_waiting=self.config.max_waiting,
        )

    def _new_id(self) -> str:
        while True:
            candidate = str(next(self._ids))
            if candidate not in self._groups:
                return candidate
