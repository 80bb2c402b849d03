"""The torch executor: real weights and real paged KV tensors behind the m10 boundary.

Each ``execute(plan)`` asks the proposer for each decode window's guesses, runs one target forward
over every plan item (see ``paged_kv`` for the flat-batch layout), then returns one outcome per item::

    item (start s, n tokens, k known ids)     positions s .. s+k-1: known ids
                                              positions s+k .. s+n-1: guesses (decode windows only)
    sampling item:  logits rows s+k-1 .. s+n-1  ->  targets; row j chooses output token generated + j
                    verdict: a leading guesses accepted, token_ids = guesses[:a] + [t_a]
    other item:     no logits, no ids

Verification is speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", ICML; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling"): accept guess ``g`` with probability ``min(1, p(g) / q(g))``, else draw from
``norm(max(0, p - q))``; after the last accepted guess of a window the bonus token is drawn from
``p``.  ``p`` and ``q`` are the target's and the draft's distributions after the request's own
min_tokens bans, temperature, top-k, top-p and min-p.

* Point-mass drafts (prompt lookup, any greedy request): accepting with probability ``p(g)`` and
  otherwise drawing from ``p`` without ``g`` is exactly: draw ``t ~ p`` at the row and accept iff
  ``t == g``; the first mismatch ``t`` is the correction.  Greedy is the case where ``p`` is the
  argmax: accept while the guesses equal the target's argmax, so the output is token for token the
  non-speculative greedy output.  Each row draws from the request's ``(seed, token index)``
  generator, so a seeded request's ids do not depend on speculation at all.
* Sampled drafts (a draft model on a sampling request, ``q`` given): ``verify_draft`` with one
  acceptance uniform per guess (stream ``STREAM_ACCEPT``) and the residual or bonus drawn from
  the plain sampling stream.  Every emitted id is distributed as the target's own sampling.  A
  seeded request is reproducible for one run configuration (its guesses come from the seeded
  ``STREAM_DRAFT``), but which token indices are drafted depends on the windows (batchmates,
  budget, preemption, the adaptive spec_len and draft limits), so its ids may differ between configurations,
  unlike the point-mass case.

The boundary requires every planned position to be computed and written, so a point-mass proposal
shorter than its window is padded with the last known id (a pad is verified like any guess).
Proposing fewer guesses than the window holds therefore saves nothing here; the control side
avoids it by sizing each request's window: ``advise`` (used by ``EngineCore``) returns the step's
``spec_len`` and, per request about to draft, m16's draft limit (the guesses its proposer has, or 0
when its guesses do not pay), so a batchmate with nothing to propose costs one plain decode row.
The pad stays for a window whose proposer proposes fewer than its limit allows.

Each registered request has one state object (``_RequestState``): its record (``ExecutorRequest``:
prompt, params, end ids, bad-word ids, compiled grammar), its token history (known ids from the plans,
plus its own accepted outputs) for the proposer and the filters, its logprobs not yet taken, its
prompt-logprobs progress, its grammar matcher and its source of forced ids.  A plan may begin
mid-prompt after a prefix-cache hit: positions it never saw are kept as unknown (-1) unless the prompt
was registered with ``add_request``.  The control side decides what stays (rollback, EOS, stop ids,
freeing pages).  Requests that ask for ``logprobs`` get one ``TokenLogprobs`` per appended id on a
side channel, ``take_logprobs``.

A request that fails on its own account inside ``execute`` fails alone (the protocol's
``take_failures``): its grammar matcher raising while its rows are masked or its forced ids are found
(the request's rows are then unmasked, it forces nothing), or its row's logits processing raising
(``RowError``: its rows are chosen again as plain greedy rows).  Its item still gets a valid outcome,
every other request's outcome is the one it would have had, and the control side ends it keeping
nothing of this step.
``stats()`` counts target forwards, proposed and accepted guesses (``ExecutorStats``).  A decode
window's guesses are counted, and fed to the acceptance estimates, only when the control side says
how many of them the request kept (``settle``, after the step's cuts at an EOS or stop id or a stop
string): an accepted window ``[a, EOS, b, c]`` counts 1 accepted guess and 2 emitted ids, not 4 and 5.

Penalties and token filters (``SamplingParams.filtered``) need each sampling row's history: row j
of a window is given the request's known ids followed by the window's first j guesses, so a
guess is verified with exactly the penalties the tokens before it imply, and speculation (prompt
lookup or a draft) changes no token.

Prompt logprobs (``SamplingParams.prompt_logprobs``): the logits of every prompt position but the
last are computed in the step that computes the position (extra LM-head rows of the same
forward), so a chunked prompt records them chunk by chunk.  Positions the engine never computes
for this request, because its prompt prefix came from the prefix cache (m08 reuse), are
**recomputed**: one extra forward over the prompt up to the first computed position, for this
request only, into a scratch KV cache (the shared cached pages are never written).  A position
is recorded once, so a recompute after preemption records nothing twice; ``take_prompt_logprobs``
hands them over.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from mechserve.api.config import SpeculativeConfig
from mechserve.api.env import spec_costs_mode
from mechserve.api.errors import first_line
from mechserve.api.outputs import TokenLogprobs
from mechserve.api.params import GREEDY
from mechserve.api.proposers import DEFAULT_MODEL_METHOD, ProposerContext, ProposerMethod, proposer_method
from mechserve.executor.costs import MeasuredCosts, StaticCosts
from mechserve.executor.costs import calibrate as measure_costs
from mechserve.executor.forcing import ForcedSource
from mechserve.executor.governor import Acceptance, Advice, Candidate, Governor
from mechserve.executor.proposers import CallableProposer, Draft, Proposer, Window
from mechserve.executor.protocol import ExecutorStats, RequestFailure
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Row, RowError, Sampler, sampling_logits, token_logprobs
from mechserve.executor.structured import GrammarMatcher, allowed_rows, new_bitmask
from mechserve.executor.verify import verify_draft
from mechserve.kv.paged import AttentionBatch, Span, build_attention_batch
from mechserve.model.protocol import Model
from mechserve.spec.m16_request_draft_lengths import Outcome, PlanItem

# (history, num) -> up to num point-mass guesses; the executor pads a short proposal with the last known id.
ProposerFn = Callable[[Sequence[int], int], Sequence[int]]
T = TypeVar("T")


@dataclass(slots=True)
class _PromptLogprobs:
    """A request's prompt logprobs: ``num_top`` alternatives, its ``prompt``, the ``next`` prompt position to
    record (1 .. len(prompt); position 0 has none), and what was recorded but not yet taken."""

    num_top: int
    prompt: tuple[int, ...]
    next: int = 1
    found: list[TokenLogprobs] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def pending(self) -> bool:
        return self.next < self.prompt_len


@dataclass(slots=True)
class _RequestState:
    """Everything this executor keeps for one request (module docstring), built from its record.

    ``banned``: the ids min_tokens bans (its end ids, while the output is shorter than min_tokens);
    ``history``: its ids by position (-1 = unknown); ``logprobs``: recorded, not yet taken;
    ``prompt_logprobs``: with ``params.prompt_logprobs`` and a prompt; ``matcher``: its grammar's
    matcher (a constrained request); ``forcer``: another source of forced ids (m14; ``set_forcer``);
    ``failed``: it failed in this step (its hooks are skipped until it leaves).
    """

    record: ExecutorRequest
    banned: tuple[int, ...] = ()
    history: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: _PromptLogprobs | None = None
    matcher: GrammarMatcher | None = None
    forcer: ForcedSource | None = None
    failed: bool = False

    @classmethod
    def of(cls, record: ExecutorRequest) -> _RequestState:
        """A registered request's state: its prompt as the first ids of its history."""
        p = record.params
        state = cls(record, record.end_ids() if p.min_tokens > 0 else (), list(record.prompt_ids))
        if p.prompt_logprobs is not None and record.prompt_ids:
            state.prompt_logprobs = _PromptLogprobs(p.prompt_logprobs, record.prompt_ids)
        if record.grammar is not None:
            if not record.prompt_ids:
                raise ValueError(f"{record.request_id}: a constrained request must be registered with its prompt")
            state.matcher = record.grammar.matcher(record.eos_token_ids)
        return state

    @property
    def output(self) -> list[int]:
        """The output ids this executor knows (``history`` after the prompt)."""
        return self.history[self.record.prompt_len :]

    def row(self, token_index: int, history: Sequence[int]) -> Row:
        """The sampling row of output token ``token_index``; ``history``: every id before it (only kept
        when the params need it)."""
        r = self.record
        if not r.params.filtered:
            return Row(r.params, token_index, self.banned, request=r)
        return Row(r.params, token_index, self.banned, tuple(history), r.prompt_len, request=r)


@dataclass(slots=True)
class _Step:
    """One step's flat batch.

    ``input_ids``/``positions``: [T] int64; ``logit_rows``: [R] int64 rows that sample, with ``rows``
    (R entries); ``guesses``: per item, the ids placed after its known ids; ``sampled``: the windows
    drafted from a distribution, as (index of their first of the R rows, draft); ``logprob_rows``:
    per item, the indices into the R rows whose logprobs are recorded (empty for items that do not
    ask), and ``num_logprobs`` the N of each of those rows; ``prompt_rows``: per request recording
    prompt logprobs this step, ``(request_id, first prompt position, count)``, whose logits follow
    the R sampling rows in order (``logit_rows`` holds them after the R).  ``rows`` is replaced in
    place for a request that fails (``_isolated``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    logit_rows: torch.Tensor
    rows: list[Row]
    guesses: list[list[int]]
    sampled: list[tuple[int, Draft]]
    logprob_rows: list[range]
    num_logprobs: list[int]
    prompt_rows: list[tuple[str, int, int]] = field(default_factory=list)


MAX_FORCED_RUN = 256  # ids one sampling item may force (m14); the control side cuts at max_tokens anyway


class TorchExecutor:
    """One rank executor running ``model`` on a paged KV cache of ``num_pages`` x ``page_size`` slots.

    The cache geometry must equal the engine's (the engine's page ids index this cache).
    ``kv_dtype`` defaults to the model's dtype; ``sampler`` chooses tokens (default: a ``Sampler``
    with a fresh seed for unseeded requests).  Guesses come from ``proposer`` (a ``(history, num) ->
    ids`` function; tests rig drafts with it), else from the method of ``speculative`` (default:
    prompt lookup with ``SpeculativeConfig``'s n-gram bounds), built by its entry in the registry of
    proposers (``mechserve.api.proposers``) with ``draft_model`` when the method has a model (a
    ``Model`` with the target's vocabulary, its KV in its own pages of the same geometry).
    ``governor`` prices guesses for ``advise``.  Default: the method's (``ProposerMethod.new_governor``),
    and with an adaptive ``speculative`` config its costs measured (``executor.costs.MeasuredCosts``, the
    method's own prices as the prior): with ``calibrate``, target steps and draft rounds are timed once here
    (``costs.calibrate``: 4.2 s for SmolLM2 in bfloat16 at ``spec_len`` 4 on 2 cores; off on tensor-parallel ranks, where a forward
    needs every rank), and every step times its proposal and its target step by ``clock`` (seconds;
    default ``time.perf_counter``; tests inject a synthetic one) into the same estimates (a given
    ``governor`` whose costs are a ``MeasuredCosts`` is fed too); ``MECHSERVE_SPEC_COSTS=static`` keeps the
    method's static prices (reproducible decisions).  Raises ``ValueError`` for a draft model
    with another vocabulary, a model given to a model-free method, or a method that needs a model without
    one.
    """

    def __init__(
        self,
        model: Model,
        num_pages: int,
        page_size: int,
        *,
        kv_dtype: torch.dtype | None = None,
        sampler: Sampler | None = None,
        proposer: ProposerFn | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: Model | None = None,
        governor: Governor | None = None,
        clock: Callable[[], float] = time.perf_counter,
        calibrate: bool = True,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.cache = model.new_cache(num_pages, page_size, kv_dtype)
        self.sampler = sampler or Sampler()
        self.speculative = speculative
        spec = speculative or SpeculativeConfig()
        # without a config, a draft model given means the model-based method
        method = proposer_method(DEFAULT_MODEL_METHOD if speculative is None and draft_model else spec.method)
        self._draft = draft_model
        self.proposer: Proposer = self._new_proposer(method, spec, num_pages, proposer, draft_model)
        # the method's proposer is fed the target's final hidden states at the kept rows (an EAGLE head)
        self._hidden = method.hidden and proposer is None
        self.clock = clock
        if governor is None:
            governor = (
                Governor()
                if proposer is not None
                else self._new_governor(method, spec, speculative is not None and spec.adaptive, calibrate)
            )
        self.governor = governor
        # the estimates this executor's timed steps feed (``execute``)
        self.costs = governor.costs if isinstance(governor.costs, MeasuredCosts) else None
        self.acceptance = Acceptance()
        self.counters = ExecutorStats()
        self._proposed: list[int] = []  # this step's proposal lengths, per item (before padding)
        self._windows: dict[str, tuple[int, int]] = {}  # this step's decode windows: (slots, proposed), until settled
        self._requests: dict[str, _RequestState] = {}
        self._failures: list[RequestFailure] = []
        # Structured outputs' cost on the step: seconds spent syncing matchers and filling and unpacking
        # masks (``_mask_rows``; read by ``mechserve bench structured``).
        self.grammar_mask_s = 0.0

    def _new_governor(
        self, method: ProposerMethod, spec: SpeculativeConfig, measure: bool, calibrate: bool
    ) -> Governor:
        """The method's governor for its own proposer; with ``measure`` (an adaptive config) its costs measured
        (the method's as the prior), calibrated now when ``calibrate``, unless ``MECHSERVE_SPEC_COSTS=static``
        (``api.env.spec_costs_mode``; raises its ``ValueError``)."""
        max_k = spec.num_speculative_tokens
        governor: Governor = method.new_governor(self.proposer, self._draft, self.model, max_k)
        if not measure or spec_costs_mode() == "static" or not isinstance(governor.costs, StaticCosts):
            return governor
        governor.costs = costs = MeasuredCosts(governor.costs)
        if calibrate and max_k > 0:
            measure_costs(
                self.model,
                self.proposer,
                costs,
                max_k=max_k,
                page_size=self.page_size,
                kv_dtype=self.kv_dtype,
                hidden=self._hidden,
                clock=self.clock,
            )
        return governor

    def _new_proposer(
        self,
        method: ProposerMethod,
        spec: SpeculativeConfig,
        num_pages: int,
        fn: ProposerFn | None,
        draft: Model | None,
    ) -> Proposer:
        if draft is not None:
            if not method.needs_model:
                raise ValueError(f'a draft model was given but the speculative method "{method.name}" uses none')
            if draft.arch.vocab_size != self.model.arch.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.arch.vocab_size} ids) differs from the target's "
                    f"({self.model.arch.vocab_size})"
                )
        elif method.needs_model:
            raise ValueError(f'speculative method "{method.name}" needs a draft_model')
        if fn is not None:
            return CallableProposer(fn)
        context = ProposerContext(spec, self.model, draft, num_pages, self.page_size, self.sampler, self.kv_dtype)
        proposer: Proposer = method.builder()(context)
        return proposer

    def rank_executors(self) -> list[TorchExecutor]:
        """One rank: this executor alone."""
        return [self]

    def stats(self) -> ExecutorStats:
        """A copy of the counters (``ExecutorStats``)."""
        return dataclasses.replace(self.counters)

    def close(self) -> None:
        """Nothing to stop: the model and the KV cache live in this process."""

    # Requests -----------------------------------------------------------------------------------------------------

    def add_request(self, request: ExecutorRequest) -> None:
        """Register a request's record (``ExecutorRequest``): its sampling params, end ids, prompt (for
        drafting, penalties and prompt logprobs), bad words as token ids and compiled grammar.

        A constrained request (``request.grammar``) gets its own matcher, and every sampling row of it is
        masked by the grammar; it needs its prompt.  While fewer than ``params.min_tokens`` tokens exist,
        its stop ids and, unless ``params.ignore_eos``, its EOS ids are never chosen.  An unregistered
        request is greedy with no min_tokens.  Raises ``ValueError`` for a constrained request without a
        prompt.
        """
        state = _RequestState.of(request)
        earlier = self._requests.get(request.request_id)
        if earlier is not None:  # a source of forced ids given before the request was registered stays
            state.forcer = earlier.forcer
        self._requests[request.request_id] = state

    def _state(self, request_id: str) -> _RequestState:
        """The state of ``request_id``, made (greedy, no prompt) for a request never registered."""
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState(ExecutorRequest(request_id))
        return state

    def matcher(self, request_id: str) -> GrammarMatcher | None:
        """The grammar matcher of a constrained request (None for another), e.g. for its ``forced_tokens()``.

        Its state is synced to the request's output at each of its sampling rows; between steps it is
        the state after the ids this executor last saw kept (call ``sync_matcher`` for the current
        output)."""
        state = self._requests.get(request_id)
        return None if state is None else state.matcher

    def sync_matcher(self, request_id: str) -> GrammarMatcher | None:
        """The matcher of ``request_id`` brought to the state after every output id this executor knows."""
        state = self._requests.get(request_id)
        if state is None or state.matcher is None:
            return None
        state.matcher.sync(state.output)
        return state.matcher

    def set_forcer(self, request_id: str, source: ForcedSource | None) -> None:
        """Give ``request_id`` a source of forced ids (m14; its grammar's matcher), or take it away (None).

        After each sampling item of the request the executor tells ``source`` the ids it appended
        and reports ``source.forced_tokens()`` in ``Outcome.forced`` (see ``executor/forcing.py``).
        A request that asks for logprobs is not forced: a forced id has no logits when it is
        appended, and the grammar's mask gives the same id one step later.
        """
        self._state(request_id).forcer = source

    def release(self, request_id: str) -> None:
        """Forget a request that left: its state (history, params, untaken logprobs: take them first), its
        drafting state and acceptance estimate; the proposer is told its output (``Proposer.release``)."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.proposer.release(state.record, state.output)
        self.acceptance.release(request_id)

    def take_failures(self) -> list[RequestFailure]:
        """The requests that failed on their own account in the last ``execute`` (module docstring), then
        forget them."""
        failures, self._failures = self._failures, []
        return failures

    def _fail(self, request_id: str, param: str | None, exc: BaseException) -> None:
        """``request_id`` failed inside this step: report it once (one line), skip its hooks from now on."""
        state = self._state(request_id)
        if not state.failed:
            state.failed = True
            self._failures.append(RequestFailure(request_id, param, f"{type(exc).__name__}: {first_line(exc)}"))

    def settle(self, windows: Mapping[str, int]) -> None:
        """Count this step's decode windows by what each request kept: ``windows[id]`` accepted guesses.

        ``ExecutorStats`` (windows, slots, proposed, accepted, emitted) and the acceptance estimates
        ``advise`` weighs are updated here, from the control side's cut verdict (the step record's
        ``accepted``), never from this executor's own; a window not settled before the next
        ``execute`` is not counted.  Ids unknown to this step are ignored.
        """
        stats = self.counters
        for rid, kept in windows.items():
            window = self._windows.pop(rid, None)
            if window is None:
                continue
            slots, real = window
            stats.windows += 1
            stats.slots += slots
            stats.proposed += real
            stats.accepted += min(kept, real)
            stats.emitted += kept + 1
            self.acceptance.observe(rid, real, min(kept, real))

    def history(self, request_id: str) -> list[int]:
        """The ids this executor knows for ``request_id``, by position (-1 = unknown)."""
        state = self._requests.get(request_id)
        return [] if state is None else list(state.history)

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """What was recorded for ``request_id`` since the last call, then forget it.

        One entry per id the executor appended (accepted guesses and the
        sampled id, in order), only for a request registered with
        ``params.logprobs`` set.  The control side may keep fewer ids than
        were appended (an EOS or stop id inside an accepted run, a length
        cap): cut to the step record's ``tokens``.
        """
        state = self._requests.get(request_id)
        if state is None:
            return []
        found, state.logprobs = state.logprobs, []
        return found

    def take_prompt_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """The prompt logprobs recorded for ``request_id`` since the last call, then forget them.

        One ``TokenLogprobs`` per prompt position 1, 2, ... in order (the prompt id's logprob under
        the logits of the position before it, and the top N), for a request registered with
        ``params.prompt_logprobs`` and its prompt.  Every position is recorded by the end of the
        step that samples the request's first token.
        """
        state = self._requests.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return []
        found, state.prompt_logprobs.found = state.prompt_logprobs.found, []
        return found

    def advise(self, caps: Sequence[tuple[str, int]], max_k: int) -> Advice:
        """The ``spec_len`` (``0..max_k``) that pays best next step and each caught-up request's draft
        limit (m16), for requests about to draft.

        ``caps``: ``(request_id, cap)`` per caught-up request, ``cap`` the guesses the spec allows it
        (``min(max_k, max_new_tokens - generated - 1)``).  First asks the governor whether any guess could
        pay were every window full (``Governor.may_pay``, exact: else ``decide`` would say 0 whatever the
        proposer has) and, if none could, answers 0 without asking the proposer; otherwise asks the proposer
        how many guesses it has for each (from the ids this executor knows) and weighs them with each
        request's acceptance so far (``Governor.decide``); a request backing off (``Acceptance.waiting``)
        counts as having none.
        Every request in ``caps`` gets a limit in the answer: the governor's (``None`` where ``may_pay``
        answered for it: no limit of its own, the step's ``spec_len`` being 0), else 0 for one with no guess
        to make (cap 0, or unknown here).
        """
        candidates = []
        ids = []
        limits: dict[str, int | None] = {}
        for rid, cap in caps:
            state = self._requests.get(rid)
            if cap > 0 and state is not None and state.history:
                # its guesses kept failing: it sits this one out (no guess to make)
                available = 0 if self.acceptance.waiting(rid) else cap
                candidates.append(Candidate(cap, available, self.acceptance.rate(rid)))
                ids.append(rid)
            else:
                limits[rid] = 0
        may_pay = getattr(self.governor, "may_pay", None)  # a governor of another kind is always asked
        if may_pay is not None and not may_pay(candidates, max_k):
            # no number of guesses, however likely, could pay: ``decide`` would say 0 whatever the proposers have
            limits.update(dict.fromkeys(ids))
            return Advice(0, limits)
        for i, (rid, c) in enumerate(zip(ids, candidates)):
            if c.available:
                state = self._requests[rid]
                candidates[i] = Candidate(c.cap, self.proposer.available(state.record, state.history, c.cap), c.alpha)
        spec_len, chosen = self.governor.decide(candidates, max_k)
        limits.update(zip(ids, chosen))
        return Advice(spec_len, limits)

    # One step -----------------------------------------------------------------------------------------------------

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        """Run one step: drafts, one target forward over all items, then verdicts and sampled ids per item."""
        self._windows = {}
        if not plan:
            return ()
        windows = [self._window(item) for item in plan]
        began = self.clock()
        proposed = self._isolated(windows, lambda: self.proposer.propose(windows))
        drafted = self.clock()
        self._proposed = [len(d.tokens) for d in proposed]
        step = self._flatten(plan, [self._fill(d, w) for d, w in zip(proposed, windows)])
        self._recompute_prompt_logprobs(plan)
        hidden: list[torch.Tensor] | None = [] if self._hidden else None
        if hidden is None:
            logits = self.model.forward(step.input_ids, step.positions, self.cache, step.batch, step.logit_rows)
        else:
            logits = self.model.forward(
                step.input_ids, step.positions, self.cache, step.batch, step.logit_rows, hidden_out=hidden
            )
        self.counters.forwards += 1
        self.counters.rows += int(step.input_ids.numel())
        logits = sampling_logits(logits, step.rows, host=bool(step.prompt_rows or step.num_logprobs or step.sampled))
        sampling = logits[: len(step.rows)]
        if step.prompt_rows:
            self._record_prompt_logprobs(step.prompt_rows, logits[len(step.rows) :])
        targets = self._isolated(step.rows, lambda: self._targets(step, sampling))
        recorded = self._record_logprobs(step, sampling, targets) if step.num_logprobs else None
        outcomes = self._verdicts(plan, step.guesses, targets, recorded)
        if hidden is not None:
            self._observe_hidden(plan, step, outcomes, hidden[0])
        if self.costs is not None:
            self._measure(plan, step, drafted - began, self.clock() - drafted)
        return outcomes

    def _measure(self, plan: tuple[PlanItem, ...], step: _Step, draft_s: float, step_s: float) -> None:
        """Feed the cost estimates (``self.costs``) this step's timings: the proposal (``draft_s``) by windows
        that drafted and rounds, and, for a step of decode windows only (a prompt chunk's rows cost
        attention over its context and are no guess's price), the target step (``step_s``: from the
        proposal to the verdicts) by rows."""
        assert self.costs is not None
        rounds = max(self._proposed, default=0)
        if rounds > 0:
            self.costs.observe_draft(sum(1 for n in self._proposed if n > 0), rounds, draft_s)
        if all(item.decode for item in plan) and not step.prompt_rows:
            self.costs.observe_step(int(step.input_ids.numel()), step_s)

    def _observe_hidden(
        self, plan: tuple[PlanItem, ...], step: _Step, outcomes: tuple[Outcome, ...], hidden: torch.Tensor
    ) -> None:
        """Hand each sampling item's kept rows of ``hidden`` ([R + prompt rows, hidden] float32, the sampling
        rows first) to the proposer's ``observe``: the last known row and the accepted guesses' rows."""
        observe = getattr(self.proposer, "observe", None)
        if observe is None:
            return
        row = 0
        for item, guesses, outcome in zip(plan, step.guesses, outcomes):
            if not item.sample:
                continue
            kept = outcome.accepted_draft_tokens + 1
            position = item.start_position + len(item.token_ids) - 1
            ids = [item.token_ids[-1], *guesses[: outcome.accepted_draft_tokens]]
            observe(self._requests[item.request_id].record, position, ids, hidden[row : row + kept])
            row += len(guesses) + 1

    def _isolated(self, rows: list[Any], call: Callable[[], T]) -> T:
        """``call()``, with a request whose row processing raises (``RowError``) failed alone: its rows among
        ``rows`` (sampling ``Row``s, or proposer ``Window``s and their first rows) become plain greedy rows and
        the call runs again.  Processing happens before any random draw, so the other rows draw what they
        would have."""
        while True:
            try:
                return call()
            except RowError as e:
                request = e.row.request
                if request is None or self._state(request.request_id).failed:
                    raise e.cause from e
                self._fail(request.request_id, None, e.cause)
                for j, x in enumerate(rows):
                    row: Row = x.row if isinstance(x, Window) else x
                    if row.request is not None and row.request.request_id == request.request_id:
                        plain = Row(GREEDY, row.token_index, request=row.request)
                        rows[j] = dataclasses.replace(x, row=plain) if isinstance(x, Window) else plain

    def _recompute_prompt_logprobs(self, plan: tuple[PlanItem, ...]) -> None:
        """Record the prompt logprobs a request needs at positions this step does not compute for it
        (served from the prefix cache): one forward of its prompt up to its first computed position,
        alone, into a scratch KV cache."""
        for item in plan:
            state = self._requests[item.request_id].prompt_logprobs
            if state is None or not state.pending or item.start_position < state.next:
                continue
            upto = item.start_position  # positions [0, upto) are cached; their rows give tokens 1 .. upto
            ids = state.prompt[:upto]
            ps = self.page_size
            pages = -(-upto // ps)
            arch = self.model.arch
            batch = build_attention_batch(
                [Span(0, 0, upto, tuple(range(pages)))],
                list(range(upto)),
                ps,
                arch.num_heads // arch.num_kv_heads,
                self.model.distinct_sliding_windows,
            )
            first = state.next  # the prompt position whose logprob the first recomputed row gives
            rows = torch.arange(first - 1, upto, dtype=torch.int64)
            logits = self.model.forward(
                torch.tensor(ids, dtype=torch.int64),
                torch.arange(upto, dtype=torch.int64),
                self.model.new_cache(pages, ps, self.kv_dtype),
                batch,
                rows,
            )
            self.counters.forwards += 1
            self.counters.rows += upto
            self._record_prompt_logprobs([(item.request_id, first, upto - first + 1)], logits.cpu())

    def _record_prompt_logprobs(self, prompt_rows: Sequence[tuple[str, int, int]], logits: torch.Tensor) -> None:
        """Record ``(request_id, first position, count)`` prompt logprobs from ``logits`` (their rows, in order)."""
        targets: list[int] = []
        tops: list[int] = []
        states = [self._requests[rid].prompt_logprobs for rid, _, _ in prompt_rows]
        for state, (_, first, count) in zip(states, prompt_rows):
            assert state is not None
            targets += state.prompt[first : first + count]
            tops += [state.num_top] * count
        found = iter(token_logprobs(logits[: len(targets)], targets, tops))
        for state, (_, first, count) in zip(states, prompt_rows):
            assert state is not None
            state.found += [next(found) for _ in range(count)]
            state.next = first + count

    @staticmethod
    def _fill(d: Draft, w: Window) -> Draft:
        """``d`` padded with the last known id to the window's ``slots`` guesses (every position is computed)."""
        missing = w.slots - len(d.tokens)
        if missing <= 0:
            return d
        if d.q is not None:
            raise ValueError(f"{w.item.request_id}: a sampled draft must fill its window")
        return Draft((*d.tokens, *[w.history[-1]] * missing))

    def _window(self, item: PlanItem) -> Window:
        """Check the item, update the request's history with its known ids; the proposer's view of it."""
        known = len(item.token_ids)
        if not 0 < known <= item.num_tokens:
            raise ValueError(f"{item.request_id}: {known} known id(s) for {item.num_tokens} token(s)")
        if known < item.num_tokens and not item.decode:
            raise ValueError(f"{item.request_id}: {item.num_tokens - known} guess position(s) outside a decode window")
        if len(item.page_table) * self.page_size < item.start_position + item.num_tokens:
            raise ValueError(
                f"{item.request_id}: page table does not back position {item.start_position + item.num_tokens - 1}"
            )
        state = self._state(item.request_id)
        hist = self._observe(state, item)
        return Window(item, hist, item.num_tokens - known, state.row(item.generated, hist))

    def _flatten(self, plan: tuple[PlanItem, ...], drafts: list[Draft]) -> _Step:
        """Lay the items out as one flat batch: known ids then guesses per item, in plan order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
        logit_rows: list[int] = []
        rows: list[Row] = []
        windows: list[tuple[int, Draft]] = []
        logprob_rows: list[range] = []
        num_logprobs: list[int] = []
        prompt_rows: list[tuple[str, int, int]] = []
        prompt_logit_rows: list[int] = []
        ps = self.page_size
        constrained: list[tuple[_RequestState, PlanItem, int, list[int]]] = []  # (state, item, first row, guesses)
        for item, d in zip(plan, drafts):
            state = self._requests[item.request_id]
            known = len(item.token_ids)
            row = len(input_ids)
            spans.append(Span(row, item.start_position, item.num_tokens, item.page_table))
            input_ids += [*item.token_ids, *d.tokens]
            positions += [p for p, _, _ in item.placements]
            slots += [page * ps + offset for _, page, offset in item.placements]
            span = range(len(rows), len(rows) + len(d.tokens) + 1) if item.sample else range(0)
            if item.sample:
                # the last known row predicts the first guess; each guess row predicts the next
                logit_rows += range(row + known - 1, row + item.num_tokens)
                params = state.record.params
                windows.append((len(rows), d))
                if state.matcher is not None and not state.failed:
                    constrained.append((state, item, len(rows), list(d.tokens)))
                before = state.history if params.filtered else []
                rows += [state.row(item.generated + j, [*before, *d.tokens[:j]]) for j in range(len(d.tokens) + 1)]
                if params.logprobs is not None:
                    num_logprobs += [params.logprobs] * len(span)
                else:
                    span = range(0)
            logprob_rows.append(span)
            pl = state.prompt_logprobs
            if pl is not None and pl.pending:
                # position p's row gives prompt position p + 1's logprob; the recompute covered the rest
                first = max(pl.next, item.start_position + 1)
                last = min(item.start_position + known, pl.prompt_len - 1)  # inclusive
                if first <= last:
                    prompt_rows.append((item.request_id, first, last - first + 1))
                    prompt_logit_rows += range(row + first - 1 - item.start_position, row + last - item.start_position)
        if constrained:
            began = time.perf_counter()
            self._mask_rows(constrained, rows)
            self.grammar_mask_s += time.perf_counter() - began
        arch = self.model.arch
        batch = build_attention_batch(
            spans, slots, ps, arch.num_heads // arch.num_kv_heads, self.model.distinct_sliding_windows
        )
        return _Step(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            batch=batch,
            logit_rows=torch.tensor([*logit_rows, *prompt_logit_rows], dtype=torch.int64),
            rows=rows,
            guesses=[list(d.tokens) for d in drafts],
            sampled=[(first, d) for first, d in windows if d.q is not None],
            logprob_rows=logprob_rows,
            num_logprobs=num_logprobs,
            prompt_rows=prompt_rows,
        )

    def _mask_rows(self, constrained: list[tuple[_RequestState, PlanItem, int, list[int]]], rows: list[Row]) -> None:
        """Give each sampling row of a constrained request its grammar mask (``Row.allowed``), in place.

        ``constrained``: per constrained sampling item, its state, the item, its first row and its guesses.  The
        request's matcher is first synced to its output so far (``history[prompt_len:]``, which the
        item's known ids end: a rejected guess, a stop cut or a recompute after preemption rolls it
        back or rebuilds it); row ``j`` of a decode window gets the state after the window's first
        ``j`` guesses (``GrammarMatcher.window_masks``).  A request whose matcher raises fails alone
        (``_fail``): its rows stay unmasked."""
        bitmask = new_bitmask(sum(len(g) + 1 for _, _, _, g in constrained), self.model.arch.vocab_size)
        masked: list[tuple[int, int, int]] = []  # (first row, rows, first bitmask row)
        at = 0
        for state, item, first, guesses in constrained:
            m = state.matcher
            assert m is not None
            try:
                output = state.output
                if len(output) != item.generated or -1 in output:
                    raise ValueError(
                        f"{item.request_id}: the executor knows {len(output)} output id(s) of {item.generated} "
                        "(a constrained request needs its whole output)"
                    )
                m.sync(output)
                m.window_masks(guesses, bitmask, at)
            except Exception as exc:
                self._fail(state.record.request_id, "structured_outputs", exc)
                continue
            masked.append((first, len(guesses) + 1, at))
            at += len(guesses) + 1
        if not masked:
            return
        allowed = allowed_rows(bitmask[:at], self.model.arch.vocab_size)  # [C, V] bool
        for first, count, mask_at in masked:
            for j in range(count):
                rows[first + j] = rows[first + j]._replace(allowed=allowed[mask_at + j])

    def _targets(self, step: _Step, logits: torch.Tensor) -> list[int]:
        """One id per sampling row, such that accepting each window's guesses while they equal the ids is the verdict.

        Rows of point-mass windows: the id ``Sampler.choose`` draws from ``p``.  Rows of a window
        drafted from ``q``: its accepted guesses, then the residual or bonus id, then (rows the
        verdict never reaches) the guesses themselves (``_reject_sample``).
        """
        if not step.sampled:
            return self.sampler.choose(logits, step.rows) if step.rows else []  # the hot path
        mine = {r for first, d in step.sampled for r in range(first, first + len(d.tokens) + 1)}
        point = [r for r in range(len(step.rows)) if r not in mine]
        targets = [0] * len(step.rows)
        if point:
            for r, t in zip(point, self.sampler.choose(logits[point], [step.rows[r] for r in point])):
                targets[r] = t
        for first, d in step.sampled:
            targets[first : first + len(d.tokens) + 1] = self._reject_sample(step, logits, first, d)
        return targets

    def _reject_sample(self, step: _Step, logits: torch.Tensor, first: int, d: Draft) -> list[int]:
        """Rejection sampling of one window whose guesses were drawn from ``d.q`` (``verify_draft``): its
        rows' targets (accepted guesses, the residual or bonus id, then the rest of the guesses)."""
        assert d.q is not None
        k = len(d.tokens)
        rows = step.rows[first : first + k + 1]
        p = self.sampler.probs(logits[first : first + k + 1], rows)  # [k+1, V]
        a, dist = verify_draft(p, d.q, d.tokens, self.sampler.uniforms(rows[:k]))
        (t,) = self.sampler.draw(dist.unsqueeze(0).clone(), [rows[a]])
        return [*d.tokens[:a], t, *d.tokens[a:]][: k + 1]

    def _record_logprobs(self, step: _Step, logits: torch.Tensor, targets: list[int]) -> list[list[TokenLogprobs]]:
        """Raw logprobs of the targets at the rows of items that ask; one list per item (empty if it does not)."""
        wanted = [i for span in step.logprob_rows for i in span]
        found = iter(token_logprobs(logits[wanted], [targets[i] for i in wanted], step.num_logprobs))
        return [[next(found) for _ in span] for span in step.logprob_rows]

    def _verdicts(
        self,
        plan: tuple[PlanItem, ...],
        guesses: list[list[int]],
        targets: list[int],
        recorded: list[list[TokenLogprobs]] | None,
    ) -> tuple[Outcome, ...]:
        """Accept each decode window's leading guesses that match the targets; append the ids to history."""
        outcomes = []
        offset = 0
        for n, (item, g) in enumerate(zip(plan, guesses)):
            accepted = 0
            ids: tuple[int, ...] = ()
            forced: tuple[int, ...] = ()  # m14
            if item.sample:
                state = self._requests[item.request_id]
                t = targets[offset : offset + len(g) + 1]
                offset += len(g) + 1
                if item.decode:
                    while accepted < len(g) and g[accepted] == t[accepted]:
                        accepted += 1
                ids = (*g[:accepted], t[accepted])
                state.history += ids
                forced = self._forced(state, ids)
                if recorded is not None and recorded[n]:
                    # accepted guesses equal the targets, so the appended ids are t0 .. t_a
                    state.logprobs.extend(recorded[n][: accepted + 1])
            if item.decode:  # counted once the control side says what was kept (settle)
                self._windows[item.request_id] = (len(g), self._proposed[n])
            outcomes.append(
                Outcome(item.request_id, item.start_position, item.num_tokens, accepted, item.placements, ids, forced)
            )
        return tuple(outcomes)

    def _forced(self, state: _RequestState, ids: tuple[int, ...]) -> tuple[int, ...]:
        """m14: tell the request's forced-id source what was appended; the ids it forces next (often none).

        A source that raises fails the request alone (it forces nothing)."""
        if state.failed or state.record.params.logprobs is not None:
            return ()
        try:
            if state.forcer is None:
                forced = self._grammar_forced(state)
            else:
                state.forcer.consume_tokens(ids)
                forced = tuple(state.forcer.forced_tokens())
                if forced:
                    state.forcer.consume_tokens(forced)
        except Exception as exc:
            self._fail(state.record.request_id, "structured_outputs" if state.matcher else None, exc)
            return ()
        if forced:
            state.history += forced
            self.counters.forced += len(forced)
        return forced

    def _grammar_forced(self, state: _RequestState) -> tuple[int, ...]:
        """m14 for a constrained request: the ids its grammar's mask allows alone, one after another (at
        most ``MAX_FORCED_RUN``), consumed by its matcher."""
        m = state.matcher
        if m is None:
            return ()
        m.sync(state.output)
        forced: list[int] = []
        while len(forced) < MAX_FORCED_RUN:
            token = m.only_token()
            if token is None:
                break
            m.accept([token])
            forced.append(token)
        return tuple(forced)

    def _observe(self, state: _RequestState, item: PlanItem) -> list[int]:
        """Update the request's history with the item's known ids; it then ends at the first guess."""
        hist = state.history
        start = item.start_position
        if len(hist) < start:
            hist.extend([-1] * (start - len(hist)))
        del hist[start:]
        hist.extend(item.token_ids)
        return hist


__all__ = ["ProposerFn", "TorchExecutor"]
