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
  budget, preemption, the adaptive spec_len), so its ids may differ between configurations,
  unlike the point-mass case.

The boundary requires every planned position to be computed and written, so a point-mass proposal
shorter than its window is padded with the last known id (a pad is verified like any guess).
Proposing fewer guesses than the window holds therefore saves nothing here; the control side
avoids it by sizing the windows (``advise``, used by ``EngineCore``; see ``speculative``).

The executor keeps each request's token history (known ids from the plans, plus its own accepted
outputs) for the proposer.  A plan may begin mid-prompt after a prefix-cache hit: positions it never
saw are kept as unknown (-1) unless the prompt was registered with ``add_request``.  The control
side decides what stays (rollback, EOS, stop ids, freeing pages).  Requests that ask for
``logprobs`` get one ``TokenLogprobs`` per appended id on a side channel, ``take_logprobs``.
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
from functools import partial

import torch

from mechserve.api.config import SpeculativeConfig
from mechserve.api.outputs import TokenLogprobs
from mechserve.api.params import GREEDY, SamplingParams
from mechserve.executor.forcing import ForcedSource
from mechserve.executor.governor import Acceptance, Candidate, Governor, draft_governor
from mechserve.executor.proposers import (
    CallableProposer,
    Draft,
    DraftModelProposer,
    NgramProposer,
    Window,
    propose_ngram,
)
from mechserve.executor.proposers import Proposer as DraftProposer
from mechserve.executor.protocol import ExecutorStats
from mechserve.executor.sampling import Row, Sampler, sampling_logits, token_logprobs
from mechserve.executor.structured import CompiledGrammar, GrammarMatcher, allowed_rows, new_bitmask
from mechserve.executor.verify import verify_draft
from mechserve.kv.paged import AttentionBatch, Span, build_attention_batch
from mechserve.model.protocol import Model
from mechserve.spec.m14_forced_runs import Outcome, PlanItem

# (history, num) -> up to num point-mass guesses; the executor pads a short proposal with the last known id.
ProposerFn = Callable[[Sequence[int], int], Sequence[int]]
# For callers that import the old name.
Proposer = ProposerFn


@dataclass(frozen=True, slots=True)
class _Sampling:
    """What sampling needs of one request: its params, the ids min_tokens bans, its prompt length
    and its bad words' token ids (for penalties and filters)."""

    params: SamplingParams
    banned: tuple[int, ...]
    prompt_len: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()

    def row(self, token_index: int, history: Sequence[int]) -> Row:
        """The sampling row of output token ``token_index``; ``history``: every id before it (only kept
        when the params need it)."""
        if not self.params.filtered:
            return Row(self.params, token_index, self.banned)
        return Row(self.params, token_index, self.banned, tuple(history), self.prompt_len, self.bad_words)


_DEFAULT = _Sampling(GREEDY, ())


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


@dataclass(frozen=True, slots=True)
class _Step:
    """One step's flat batch.

    ``input_ids``/``positions``: [T] int64; ``logit_rows``: [R] int64 rows that sample, with ``rows``
    (R entries); ``guesses``: per item, the ids placed after its known ids; ``sampled``: the windows
    drafted from a distribution, as (index of their first of the R rows, draft); ``logprob_rows``:
    per item, the indices into the R rows whose logprobs are recorded (empty for items that do not
    ask), and ``num_logprobs`` the N of each of those rows; ``prompt_rows``: per request recording
    prompt logprobs this step, ``(request_id, first prompt position, count)``, whose logits follow
    the R sampling rows in order (``logit_rows`` holds them after the R).
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
    with a fresh seed for unseeded requests).  Guesses come from, in this order: ``draft_model`` (a
    ``Model`` with the target's vocabulary, its KV in its own pages of the same geometry),
    ``proposer`` (a ``(history, num) -> ids`` function), prompt lookup with the n-gram bounds of
    ``speculative`` (``NgramProposer``), or without ``speculative`` the original ``propose_ngram``
    (``max_ngram``, the most recent match).  ``governor`` prices guesses for ``advise``
    (default: the CPU costs, with the draft model's own rounds).  Raises ``ValueError`` for a
    draft model with another vocabulary, or a ``speculative`` method that does not match
    ``draft_model``.
    """

    def __init__(
        self,
        model: Model,
        num_pages: int,
        page_size: int,
        *,
        kv_dtype: torch.dtype | None = None,
        max_ngram: int = 3,
        sampler: Sampler | None = None,
        proposer: ProposerFn | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: Model | None = None,
        governor: Governor | None = None,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.kv_dtype = kv_dtype
        self.cache = model.new_cache(num_pages, page_size, kv_dtype)
        self.max_ngram = max_ngram
        self.sampler = sampler or Sampler()
        self.speculative = speculative
        self.proposer: DraftProposer = self._new_proposer(num_pages, kv_dtype, proposer, draft_model)
        max_k = speculative.num_speculative_tokens if speculative is not None else 8
        self.governor = governor or (draft_governor(draft_model, model, max_k) if draft_model else Governor())
        self.acceptance = Acceptance()
        self.counters = ExecutorStats()
        self._proposed: list[int] = []  # this step's proposal lengths, per item (before padding)
        self._windows: dict[str, tuple[int, int]] = {}  # this step's decode windows: (slots, proposed), until settled
        self._history: dict[str, list[int]] = {}
        self._sampling: dict[str, _Sampling] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}
        self._prompt_logprobs: dict[str, _PromptLogprobs] = {}
        self._forcers: dict[str, ForcedSource] = {}  # m14: per request, where its forced ids come from
        self._matchers: dict[str, GrammarMatcher] = {}
        # Structured outputs' cost on the step: seconds spent syncing matchers and filling and unpacking
        # masks (``_mask_rows``), and the sampling rows masked (read by ``mechserve bench structured``).
        self.grammar_mask_s = 0.0
        self.grammar_rows = 0

    def _new_proposer(
        self, num_pages: int, kv_dtype: torch.dtype | None, fn: ProposerFn | None, draft: Model | None
    ) -> DraftProposer:
        spec = self.speculative
        if draft is not None:
            if spec is not None and spec.method != "draft":
                raise ValueError(f'a draft model was given but the speculative method is "{spec.method}"')
            if draft.arch.vocab_size != self.model.arch.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft.arch.vocab_size} ids) differs from the target's "
                    f"({self.model.arch.vocab_size})"
                )
            return DraftModelProposer(draft, num_pages, self.page_size, self.sampler, kv_dtype=kv_dtype)
        if spec is not None and spec.method == "draft":
            raise ValueError('speculative method "draft" needs a draft_model')
        if fn is not None:
            return CallableProposer(fn)
        if spec is None:  # the original prompt lookup: most recent match, padded by the proposer itself
            return CallableProposer(partial(propose_ngram, max_ngram=self.max_ngram))
        return NgramProposer(spec.ngram_min, spec.ngram_max)

    @property
    def draft_cache(self) -> object | None:
        """The draft model's paged KV cache (None without a draft model)."""
        return getattr(self.proposer, "cache", None)

    def rank_executors(self) -> list[TorchExecutor]:
        """One rank: m14's group joins this executor alone."""
        return [self]

    def stats(self) -> ExecutorStats:
        """A copy of the counters (``ExecutorStats``)."""
        return dataclasses.replace(self.counters)

    def close(self) -> None:
        """Nothing to stop: the model and the KV cache live in this process."""

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int] | None = None,
        params: SamplingParams = GREEDY,
        *,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        bad_words_ids: Sequence[Sequence[int]] = (),
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Register a request's sampling params, its end ids and (optionally) its prompt, for drafting,
        penalties and prompt logprobs.

        ``grammar``: the compiled ``params.structured_outputs`` (``GrammarCompiler.compile``, done by
        the caller before admission); the request gets its own matcher, and every sampling row of it
        is masked by the grammar.  A constrained request needs ``prompt_ids``.

        While fewer than ``params.min_tokens`` tokens exist, the stop ids
        (``stop_token_ids`` and ``params.stop_token_ids``) and, unless
        ``params.ignore_eos``, the ``eos_token_ids`` are never chosen.
        ``bad_words_ids``: ``params.bad_words`` as token ids (the control side tokenizes them).
        Penalties, bad words and ``params.prompt_logprobs`` need ``prompt_ids``.  An unregistered
        request is greedy with no min_tokens.
        """
        ends = [*stop_token_ids, *params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        banned = tuple(dict.fromkeys(ends)) if params.min_tokens > 0 else ()
        prompt_len = len(prompt_ids) if prompt_ids is not None else 0
        bad = tuple(tuple(w) for w in bad_words_ids if w)
        self._sampling[request_id] = _Sampling(params, banned, prompt_len, bad)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        if params.prompt_logprobs is not None and prompt_ids is not None:
            self._prompt_logprobs[request_id] = _PromptLogprobs(params.prompt_logprobs, tuple(prompt_ids))
        if prompt_ids is not None:
            self._history[request_id] = list(prompt_ids)
        self._matchers.pop(request_id, None)
        if grammar is not None:
            if prompt_ids is None:
                raise ValueError(f"{request_id}: a constrained request must be registered with its prompt")
            self._matchers[request_id] = grammar.matcher(eos_token_ids)

    def matcher(self, request_id: str) -> GrammarMatcher | None:
        """The grammar matcher of a constrained request (None for another), e.g. for its ``forced_tokens()``.

        Its state is synced to the request's output at each of its sampling rows; between steps it is
        the state after the ids this executor last saw kept (call ``sync_matcher`` for the current
        output)."""
        return self._matchers.get(request_id)

    def sync_matcher(self, request_id: str) -> GrammarMatcher | None:
        """The matcher of ``request_id`` brought to the state after every output id this executor knows."""
        m = self._matchers.get(request_id)
        if m is not None:
            s = self._sampling[request_id]
            m.sync(self._history[request_id][s.prompt_len :])
        return m

    def set_forcer(self, request_id: str, source: ForcedSource | None) -> None:
        """Give ``request_id`` a source of forced ids (m14; its grammar's matcher), or take it away (None).

        After each sampling item of the request the executor tells ``source`` the ids it appended
        and reports ``source.forced_tokens()`` in ``Outcome.forced`` (see ``executor/forcing.py``).
        A request that asks for logprobs is not forced: a forced id has no logits when it is
        appended, and the grammar's mask gives the same id one step later.
        """
        if source is None:
            self._forcers.pop(request_id, None)
        else:
            self._forcers[request_id] = source

    def release(self, request_id: str) -> None:
        """Forget a finished request's history, params, drafting state and untaken logprobs (take them first)."""
        self._forcers.pop(request_id, None)
        self._history.pop(request_id, None)
        self._sampling.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self.proposer.release(request_id)
        self.acceptance.release(request_id)

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
        return list(self._history.get(request_id, ()))

    def take_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """What was recorded for ``request_id`` since the last call, then forget it.

        One entry per id the executor appended (accepted guesses and the
        sampled id, in order), only for a request registered with
        ``params.logprobs`` set.  The control side may keep fewer ids than
        were appended (an EOS or stop id inside an accepted run, a length
        cap): cut to the step record's ``tokens``.
        """
        return self._logprobs.pop(request_id, [])

    def take_prompt_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """The prompt logprobs recorded for ``request_id`` since the last call, then forget them.

        One ``TokenLogprobs`` per prompt position 1, 2, ... in order (the prompt id's logprob under
        the logits of the position before it, and the top N), for a request registered with
        ``params.prompt_logprobs`` and its prompt.  Every position is recorded by the end of the
        step that samples the request's first token.
        """
        state = self._prompt_logprobs.get(request_id)
        if state is None:
            return []
        found, state.found = state.found, []
        return found

    def advise(self, caps: Sequence[tuple[str, int]], max_k: int) -> int:
        """The ``spec_len`` (``0..max_k``) that pays best next step, for requests about to draft.

        ``caps``: ``(request_id, cap)`` per caught-up request, ``cap`` the guesses the spec allows it
        (``min(max_k, max_new_tokens - generated - 1)``).  Asks the proposer how many guesses it has
        for each (from the ids this executor knows) and weighs them with each request's acceptance so
        far (``Governor.choose``).
        """
        candidates = [
            Candidate(cap, self.proposer.available(self._history.get(rid, ()), cap), self.acceptance.rate(rid))
            for rid, cap in caps
            if cap > 0 and self._history.get(rid)
        ]
        return self.governor.choose(candidates, max_k)

    def execute(self, plan: tuple[PlanItem, ...]) -> tuple[Outcome, ...]:
        """Run one step: drafts, one target forward over all items, then verdicts and sampled ids per item."""
        self._windows = {}
        if not plan:
            return ()
        windows = [self._window(item) for item in plan]
        proposed = self.proposer.propose(windows)
        self._proposed = [len(d.tokens) for d in proposed]
        step = self._flatten(plan, [self._fill(d, w) for d, w in zip(proposed, windows)])
        self._recompute_prompt_logprobs(plan)
        logits = self.model.forward(step.input_ids, step.positions, self.cache, step.batch, step.logit_rows)
        self.counters.forwards += 1
        self.counters.rows += int(step.input_ids.numel())
        logits = sampling_logits(logits, step.rows, host=bool(step.prompt_rows or step.num_logprobs or step.sampled))
        sampling = logits[: len(step.rows)]
        if step.prompt_rows:
            self._record_prompt_logprobs(step.prompt_rows, logits[len(step.rows) :])
        targets = self._targets(step, sampling)
        recorded = self._record_logprobs(step, sampling, targets) if step.num_logprobs else None
        return self._verdicts(plan, step.guesses, targets, recorded)

    def _recompute_prompt_logprobs(self, plan: tuple[PlanItem, ...]) -> None:
        """Record the prompt logprobs a request needs at positions this step does not compute for it
        (served from the prefix cache): one forward of its prompt up to its first computed position,
        alone, into a scratch KV cache."""
        for item in plan:
            state = self._prompt_logprobs.get(item.request_id)
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
                self.model.distinct_windows,
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
        for rid, first, count in prompt_rows:
            state = self._prompt_logprobs[rid]
            targets += state.prompt[first : first + count]
            tops += [state.num_top] * count
        found = iter(token_logprobs(logits[: len(targets)], targets, tops))
        for rid, first, count in prompt_rows:
            state = self._prompt_logprobs[rid]
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
        hist = self._observe(item)
        s = self._sampling.get(item.request_id, _DEFAULT)
        return Window(item, hist, item.num_tokens - known, s.row(item.generated, hist))

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
        for item, d in zip(plan, drafts):
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
                s = self._sampling.get(item.request_id, _DEFAULT)
                windows.append((len(rows), d))
                before = self._history.get(item.request_id, []) if s.params.filtered else []
                rows += [s.row(item.generated + j, [*before, *d.tokens[:j]]) for j in range(len(d.tokens) + 1)]
                if s.params.logprobs is not None:
                    num_logprobs += [s.params.logprobs] * len(span)
                else:
                    span = range(0)
            logprob_rows.append(span)
            state = self._prompt_logprobs.get(item.request_id)
            if state is not None and state.pending:
                # position p's row gives prompt position p + 1's logprob; the recompute covered the rest
                first = max(state.next, item.start_position + 1)
                last = min(item.start_position + known, state.prompt_len - 1)  # inclusive
                if first <= last:
                    prompt_rows.append((item.request_id, first, last - first + 1))
                    prompt_logit_rows += range(row + first - 1 - item.start_position, row + last - item.start_position)
        if self._matchers:
            began = time.perf_counter()
            self._mask_rows(plan, drafts, rows)
            self.grammar_mask_s += time.perf_counter() - began
        arch = self.model.arch
        batch = build_attention_batch(
            spans, slots, ps, arch.num_heads // arch.num_kv_heads, self.model.distinct_windows
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

    def _mask_rows(self, plan: tuple[PlanItem, ...], drafts: list[Draft], rows: list[Row]) -> None:
        """Give each sampling row of a constrained request its grammar mask (``Row.allowed``), in place.

        The request's matcher is first synced to its output so far (``hist[prompt_len:]``, which the
        item's known ids end: a rejected guess, a stop cut or a recompute after preemption rolls it
        back or rebuilds it); row ``j`` of a decode window gets the state after the window's first
        ``j`` guesses (``GrammarMatcher.window_masks``)."""
        todo: list[tuple[GrammarMatcher, int, list[int]]] = []
        first = 0
        for item, d in zip(plan, drafts):
            if not item.sample:
                continue
            m = self._matchers.get(item.request_id)
            if m is not None:
                s = self._sampling[item.request_id]
                hist = self._history[item.request_id]
                output = hist[s.prompt_len :]
                if len(output) != item.generated or -1 in output:
                    raise ValueError(
                        f"{item.request_id}: the executor knows {len(output)} output id(s) of {item.generated} "
                        "(a constrained request needs its whole output)"
                    )
                m.sync(output)
                todo.append((m, first, list(d.tokens)))
            first += len(d.tokens) + 1
        if not todo:
            return
        bitmask = new_bitmask(sum(len(g) + 1 for _, _, g in todo), self.model.arch.vocab_size)
        at = 0
        for m, _, guesses in todo:
            m.window_masks(guesses, bitmask, at)
            at += len(guesses) + 1
        allowed = allowed_rows(bitmask, self.model.arch.vocab_size)  # [C, V] bool
        self.grammar_rows += allowed.shape[0]
        at = 0
        for _, first, guesses in todo:
            for j in range(len(guesses) + 1):
                rows[first + j] = rows[first + j]._replace(allowed=allowed[at])
                at += 1

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
                t = targets[offset : offset + len(g) + 1]
                offset += len(g) + 1
                if item.decode:
                    while accepted < len(g) and g[accepted] == t[accepted]:
                        accepted += 1
                ids = (*g[:accepted], t[accepted])
                self._history[item.request_id] += ids
                forced = self._forced(item.request_id, ids)
                if recorded is not None and recorded[n]:
                    # accepted guesses equal the targets, so the appended ids are t0 .. t_a
                    self._logprobs.setdefault(item.request_id, []).extend(recorded[n][: accepted + 1])
            if item.decode:  # counted once the control side says what was kept (settle)
                self._windows[item.request_id] = (len(g), self._proposed[n])
            outcomes.append(
                Outcome(item.request_id, item.start_position, item.num_tokens, accepted, item.placements, ids, forced)
            )
        return tuple(outcomes)

    def _forced(self, request_id: str, ids: tuple[int, ...]) -> tuple[int, ...]:
        """m14: tell the request's forced-id source what was appended; the ids it forces next (often none)."""
        source = self._forcers.get(request_id)
        if self._sampling.get(request_id, _DEFAULT).params.logprobs is not None:
            return ()
        if source is None:
            return self._grammar_forced(request_id)
        source.consume_tokens(ids)
        forced = tuple(source.forced_tokens())
        if forced:
            source.consume_tokens(forced)
            self._history[request_id] += forced
            self.counters.forced += len(forced)
        return forced

    def _grammar_forced(self, request_id: str) -> tuple[int, ...]:
        """m14 for a constrained request: the ids its grammar's mask allows alone, one after another (at
        most ``MAX_FORCED_RUN``), consumed by its matcher and appended to its history."""
        m = self.sync_matcher(request_id)
        forced: list[int] = []
        while m is not None and len(forced) < MAX_FORCED_RUN:
            token = m.only_token()
            if token is None:
                break
            m.accept([token])
            forced.append(token)
        if forced:
            self._history[request_id] += forced
            self.counters.forced += len(forced)
        return tuple(forced)

    def _observe(self, item: PlanItem) -> list[int]:
        """Update the request's history with the item's known ids; it then ends at the first guess."""
        hist = self._history.setdefault(item.request_id, [])
        start = item.start_position
        if len(hist) < start:
            hist.extend([-1] * (start - len(hist)))
        del hist[start:]
        hist.extend(item.token_ids)
        return hist


__all__ = ["Proposer", "ProposerFn", "TorchExecutor"]
