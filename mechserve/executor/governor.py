"""How far it pays to speculate: acceptance estimates and the governor that chooses the next ``spec_len``
and each request's draft limit.

The spec decides how many guesses a decode window carries, ``draft_len = min(spec_len,
max_new_tokens - generated - 1, draft_limit)`` (m09's rule D1 with m16's per-request limit), and commits the verdict (m12: rollback, tail-page free, the cut at
the first EOS or stop id).  Behind the boundary the executor fills the window with guesses and
verifies them exactly (``torch_executor``); in front of it, the control side may choose the next
step's ``spec_len`` and each request's ``draft_limit`` (m16)::

    SpeculativeConfig            method "ngram" (prompt lookup) or "draft" (a smaller model with the
                                 same vocabulary), num_speculative_tokens (the most guesses per
                                 window: spec_len), n-gram bounds, adaptive
    proposers.NgramProposer      guesses from the request's own ids (no model)
    proposers.DraftModelProposer guesses from a draft model whose KV lives in its own pages, indexed
                                 by the same page tables (paging, prefix reuse, rollback and
                                 preemption apply to it unchanged)
    Acceptance                   per-request estimate of how often a guess is accepted
    Governor                     (adaptive) the spec_len for the next step, between 0 and
                                 num_speculative_tokens, and each caught-up request's limit
                                 (``Advice``): guesses cost target rows (and draft rounds) and
                                 pay only when accepted
    costs.MeasuredCosts          what those rows and rounds cost, in seconds, measured on the
                                 loaded model in its mode (a calibration when the executor is
                                 built, then every decode step); each method's registry entry
                                 gives the prior (``ProposerMethod.governor``: a draft model's
                                 weight share, an EAGLE head's layer and LM head rows)

Why the control side: the boundary requires every planned position to be computed and written, so a
window the proposer cannot fill still costs its rows.  ``EngineCore`` therefore asks, before each
step, how many guesses each caught-up request's proposer has and how often its guesses were accepted,
and sets the engine's ``spec_len`` and each request's draft limit to what the expected speedup
favours (``Governor``).  Each request's window is then exactly its proposal (a request limited to
the guesses its proposer has), so proposing nothing costs a plain decode row, at batch 1 and in a
batch alike; a request whose own guesses do not pay is limited to 0 (m16).

Draft models are written ``MODEL[:layers=N]``: ``smollm2:layers=4`` keeps the first 4 of SmolLM2's 30
layers (sharing the target's weights when the target is the same model); a directory names any
Llama-family checkpoint with the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mechserve.executor.costs import CostModel, StaticCosts
from mechserve.model.draft import weight_share
from mechserve.model.protocol import Model


@dataclass(slots=True)
class _Record:
    """Decayed counts of one request's accepted and rejected guesses, the same counts over its whole life
    (``total_*``); its windows in a row whose guesses were all rejected (``misses``) and the windows it still
    sits out (``wait``)."""

    accepted: float = 0.0
    rejected: float = 0.0
    total_accepted: float = 0.0
    total_rejected: float = 0.0
    misses: int = 0
    wait: int = 0


class Acceptance:
    """Per-request acceptance estimates: ``alpha``, the chance that the next guess is accepted, and a back-off.

    ``(accepted + w * prior) / (accepted + rejected + w)`` over counts that decay by ``decay`` per decode
    window (a window's first rejection counts once; guesses after it were never judged), ``w`` =
    ``PRIOR_WEIGHT`` pseudo-guesses.  ``prior`` is what the requests that left this engine had kept
    (empirical Bayes): ``(accepted + 1) / (accepted + rejected + 2)`` over their lifetime counts, pooled at
    ``release`` and decayed by ``pool_decay`` per request released (one with a window observed); 0.5 before
    any, and always 0.5 with ``pool_decay=None`` (the fixed prior).  A window with nothing proposed only decays a request's counts, so a
    request that stopped proposing drifts back to the prior and is tried again; a request that never proposed
    adds nothing when it leaves, so an engine that stopped drafting drifts back to 0.5 as requests leave.

    Why a prior from past requests: one request's record is a few windows long, and after one lucky window (two
    guesses of three kept) a fixed prior of 0.5 reads 0.6, and after a second with both its guesses kept 0.72:
    enough for a guess row at batch 8 on text whose guesses are kept a quarter of the time.  And where guesses are kept (a conversation's next turn,
    copying), a new request on a fixed prior starts at 0.5, which at batch 8 buys no row, so it drafts only after
    its own luck.  Only requests that left are pooled, so a request's own windows never count twice (at batch 1
    the running request would otherwise be its own prior), and a pool fed by every window would keep a bad
    spell's verdict once the governor stopped drafting (measured: a batch-1 engine that met open-ended text first
    then never drafted on code edits).  Lifetime counts weigh a request by its verdicts: one long request
    counts for more than many short ones, and takes more releases to fade.

    That estimate never falls below about ``w * prior * (1 - decay) / (1 + w * (1 - decay))`` (0.14 with the
    defaults and a prior of 0.5), which at batch > 1, where a guess row costs little, may still look worth a
    guess, and at batch 1 brings a probe every ~11 steps (with a prior of 0.5; fewer with a lower one).  So a
    request whose windows keep failing also backs off exponentially: after ``misses >= GRACE`` windows in a row
    with every guess rejected it sits out ``2 ** (misses - GRACE + 1)`` windows (at most ``2 ** MAX_BACKOFF``;
    ``waiting``), and the first accepted guess ends the back-off.
    """

    GRACE = 2
    MAX_BACKOFF = 8
    PRIOR_WEIGHT = 2.0

    def __init__(self, decay: float = 0.8, pool_decay: float | None = 0.9) -> None:
        if not 0.0 <= decay <= 1.0 or (pool_decay is not None and not 0.0 <= pool_decay <= 1.0):
            raise ValueError(f"decay and pool_decay must be in [0, 1], got {decay!r} and {pool_decay!r}")
        self.decay = decay
        self.pool_decay = pool_decay
        self._records: dict[str, _Record] = {}
        # released requests' lifetime counts of accepted and rejected guesses, decayed by pool_decay per release
        self._pool_accepted = self._pool_rejected = 0.0

    @property
    def prior(self) -> float:
        """The prior mean of every request's estimate: the released requests' pooled acceptance (0.5 before any
        was released, and with ``pool_decay=None``)."""
        return (self._pool_accepted + 1.0) / (self._pool_accepted + self._pool_rejected + 2.0)

    def rate(self, request_id: str) -> float:
        r = self._records.get(request_id)
        prior = self.prior
        if r is None:
            return prior
        w = self.PRIOR_WEIGHT
        return (r.accepted + w * prior) / (r.accepted + r.rejected + w)

    def waiting(self, request_id: str) -> bool:
        """Whether the request sits out the coming window (its guesses kept failing)."""
        r = self._records.get(request_id)
        return r is not None and r.wait > 0

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One decode window's verdict: ``accepted`` of the ``proposed`` guesses."""
        r = self._records.setdefault(request_id, _Record())
        rejected = 1.0 if accepted < proposed else 0.0
        r.accepted = r.accepted * self.decay + accepted
        r.rejected = r.rejected * self.decay + rejected
        r.total_accepted += accepted
        r.total_rejected += rejected
        if r.wait > 0:
            r.wait -= 1
        if proposed and accepted:
            r.misses = r.wait = 0
        elif proposed:
            r.misses += 1
            if r.misses >= self.GRACE:
                r.wait = 2 ** min(r.misses - self.GRACE + 1, self.MAX_BACKOFF)

    def release(self, request_id: str) -> None:
        """The request left: its record is dropped and its lifetime counts join the pool (``prior``)."""
        r = self._records.pop(request_id, None)
        if r is not None and self.pool_decay is not None:
            self._pool_accepted = self._pool_accepted * self.pool_decay + r.total_accepted
            self._pool_rejected = self._pool_rejected * self.pool_decay + r.total_rejected


@dataclass(frozen=True, slots=True)
class Advice:
    """What the governor advises for the coming step: the engine's ``spec_len`` and, per request
    about to draft, its ``draft_limit`` (m16: None is no limit, 0 no guesses)."""

    spec_len: int
    limits: dict[str, int | None]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request about to draft: ``cap`` guesses allowed (spec_len and its length cap), ``available``
    guesses its proposer has (prompt lookup: the match's length; a draft model: ``cap``) and its
    acceptance estimate ``alpha``."""

    cap: int
    available: int
    alpha: float


class Governor:
    """Chooses the engine's ``spec_len`` for the next step and each request's draft limit (m16).

    The boundary makes the executor compute every position of a window, so the control side limits
    each request's window to the guesses its proposer has (m16's ``draft_limit``): request ``i``'s
    window is exactly ``g_i = min(k, cap_i, available_i)`` guesses, no pads, or 0 when the request
    is dropped (limited to 0).  For each ``k`` in ``0..max_k`` and a set ``D`` of dropped requests::

        tokens(k, D) = sum over requests of  1 + alpha + ... + alpha ** g_i    (g_i = 0 for i in D)
        cost(k, D)   = costs.step(sum of (1 + g_i))  +  costs.draft(min(k, max cap), windows with g_i > 0)
        rate(k, D)   = tokens(k, D) / cost(k, D)

    The choice (``advise``), after SmartSpec's per-request goodput (Liu et al. 2024, arXiv 2406.14066)
    in a greedy form:

    1. ``k`` := the best ``k`` with nobody dropped (ties: the smaller ``k``);
    2. while some request drafts at ``k``: drop the drafting request with the lowest ``alpha`` (ties:
       the later one) if that raises ``rate(k, D)``, else stop;
    3. ``k`` := the best ``k`` again with ``D`` dropped;
    4. speculate (``k > 0``) only when ``rate(k, D)`` beats ``k = 0`` by more than ``margin`` (0.03: the
       cost model's measurement noise; a guess that pays less is not worth the risk of a slower step).

    Each dropped request gets limit 0; a request whose proposer has fewer than ``min(k, cap)``
    guesses gets limit ``available``; every other one no limit.  A draft model or EAGLE head
    (``available = cap``) thus behaves as with one ``spec_len`` for all unless a request is dropped.

    ``costs`` (``executor.costs``): ``StaticCosts(row_cost, jump_cost, draft_costs)`` in units of a
    one-row step when not given; the executor gives a ``MeasuredCosts`` (seconds measured on the loaded
    model in its mode, at start and step by step) for the adaptive engine, with the method's static
    costs (its draft rounds' weight share) as the prior.  Windows that draft: those with a guess to
    make (``min(k, cap, available) > 0``).
    """

    SCAN = 64  # may_pay checks at most this many possible guesses (batch 8 at spec_len 8)

    def __init__(
        self,
        row_cost: float = 0.05,
        jump_cost: float = 0.45,
        draft_costs: Sequence[float] = (),
        *,
        costs: CostModel | None = None,
        margin: float = 0.03,
    ) -> None:
        self.costs: CostModel = costs if costs is not None else StaticCosts(row_cost, jump_cost, tuple(draft_costs))
        self.margin = margin

    def step_cost(self, rows: int) -> float:
        """A target step of ``rows`` rows, in the cost model's unit."""
        return self.costs.step(rows)

    def rate(self, candidates: Sequence[Candidate], k: int, dropped: frozenset[int] = frozenset()) -> float:
        """Expected tokens per unit of cost at ``spec_len`` ``k`` with the candidates at the indices in
        ``dropped`` limited to 0 (the class docstring)."""
        return _Pricing(self.costs, candidates).rate(k, dropped)

    def rates(self, candidates: Sequence[Candidate], max_k: int, dropped: frozenset[int] = frozenset()) -> list[float]:
        """``rate`` for each ``k`` in ``0..max_k``."""
        return [self.rate(candidates, k, dropped) for k in range(max_k + 1)]

    @staticmethod
    def _best_k(pricing: _Pricing, max_k: int, dropped: frozenset[int]) -> tuple[int, float]:
        """The ``k`` in ``1..max_k`` with the best rate (ties: the smaller), and that rate."""
        best, best_rate = 1, pricing.rate(1, dropped)
        for k in range(2, max_k + 1):
            r = pricing.rate(k, dropped)
            if r > best_rate * (1.0 + 1e-9):
                best, best_rate = k, r
        return best, best_rate

    def decide(self, candidates: Sequence[Candidate], max_k: int) -> tuple[int, list[int | None]]:
        """The ``spec_len`` in ``0..max_k`` and one draft limit per candidate (None: no limit), by the
        class docstring's steps; ``(0, [None, ...])`` when speculation does not pay.

        Asked before every step of an adaptive engine, so it prices cheaply: when no candidate has a guess
        (``min(cap, available) == 0`` for all), every ``k`` costs and yields what ``k = 0`` does and the
        answer is ``(0, [None, ...])`` without asking the cost model; otherwise each row count's step cost
        and each draft call's cost is asked once per call (``_Pricing``)."""
        none: list[int | None] = [None] * len(candidates)
        if not candidates or max_k <= 0 or all(min(c.cap, c.available) <= 0 for c in candidates):
            return 0, none
        pricing = _Pricing(self.costs, candidates)
        plain = pricing.rate(0)
        k, _ = self._best_k(pricing, max_k, frozenset())
        dropped: frozenset[int] = frozenset()
        current = pricing.rate(k, dropped)
        while True:
            drafting = [i for i, c in enumerate(candidates) if i not in dropped and min(k, c.cap, c.available) > 0]
            if not drafting:
                break
            worst = min(drafting, key=lambda i: (candidates[i].alpha, -i))
            trial = dropped | {worst}
            r = pricing.rate(k, trial)
            if r <= current * (1.0 + 1e-9):
                break
            dropped, current = trial, r
        k, best = self._best_k(pricing, max_k, dropped)
        if best <= plain * (1.0 + self.margin) * (1.0 + 1e-9):
            return 0, none
        limits: list[int | None] = []
        for i, c in enumerate(candidates):
            if i in dropped:
                limits.append(0)
            elif c.available < min(k, c.cap):
                limits.append(c.available)
            else:
                limits.append(None)
        return k, limits

    def may_pay(self, candidates: Sequence[Candidate], max_k: int) -> bool:
        """Whether speculation could pay next step, with each candidate's ``available`` read as an upper bound
        on what its proposer has (``cap`` where the proposer was not asked yet): False means ``decide`` answers
        ``k = 0`` for any proposals within those bounds, so the caller need not ask the proposers
        (``TorchExecutor.advise``: at batch 8 on text whose guesses are seldom kept, asking a suffix proposer
        cost ~2% of the step).

        The bound: any windows of ``g_i <= b_i = min(cap_i, available_i, max_k)`` guesses, ``E`` in all, expect at
        most ``n`` plus the ``E`` largest of the ``alpha_i ** j`` (``j <= b_i``: guess ``j`` of a window is kept
        with chance ``alpha ** j``) and cost at least ``step(n + E)`` (draft rounds cost nothing or more), so
        ``decide`` speculates only if, for some ``E``, ``(n + top_E) / step(n + E)`` beats ``k = 0`` by the
        margin (compared with a relative slack of 1e-9, so a sum rounded in another order does not flip it).
        True without checking (the proposers are asked) where the check could cost more than it saves or not
        hold: more than ``SCAN`` possible guesses, a step priced at zero or less, or a subclass with its own
        ``decide``."""
        if not candidates or max_k <= 0:
            return False
        if type(self).decide is not Governor.decide:
            return True
        gains = sorted(
            (c.alpha**j for c in candidates for j in range(1, min(c.cap, c.available, max_k) + 1)), reverse=True
        )
        if len(gains) > self.SCAN:
            return True
        n = len(candidates)
        base = self.costs.step(n)
        if base <= 0:
            return True
        need = n / base * (1.0 + self.margin) * (1.0 - 1e-9)
        tokens = float(n)
        for extra, gain in enumerate(gains, 1):
            tokens += gain
            cost = self.costs.step(n + extra)
            if cost <= 0 or tokens / cost > need:
                return True
        return False

    def choose(self, candidates: Sequence[Candidate], max_k: int) -> int:
        """The ``spec_len`` of ``decide`` (0 without candidates)."""
        return self.decide(candidates, max_k)[0]


class _Pricing:
    """``Governor.rate`` for one set of candidates, with what it asks remembered: each candidate's expected
    tokens ``1 + alpha + ... + alpha ** g`` by ``g`` (summed in that order, so the figures are the ones a
    fresh sum gives) and the cost model's answer for each step size and draft call asked."""

    __slots__ = ("_drafts", "_steps", "_tokens", "candidates", "costs", "top")

    def __init__(self, costs: CostModel, candidates: Sequence[Candidate]) -> None:
        self.costs = costs
        self.candidates = candidates
        self.top = max((c.cap for c in candidates), default=0)
        self._tokens: list[list[float]] = []  # by candidate, by g
        for c in candidates:
            sums: list[float] = []
            total = 0.0
            for j in range(max(0, min(c.cap, c.available)) + 1):
                total += c.alpha**j
                sums.append(total)
            self._tokens.append(sums)
        self._steps: dict[int, float] = {}
        self._drafts: dict[tuple[int, int], float] = {}

    def rate(self, k: int, dropped: frozenset[int] = frozenset()) -> float:
        """Expected tokens per unit of cost at ``spec_len`` ``k`` with ``dropped`` limited to 0."""
        tokens = 0.0
        rows = 0
        drafting = 0
        for i, c in enumerate(self.candidates):
            g = 0 if i in dropped else max(0, min(k, c.cap, c.available))
            tokens += self._tokens[i][g]
            rows += 1 + g
            drafting += g > 0
        step = self._steps.get(rows)
        if step is None:
            step = self._steps[rows] = self.costs.step(rows)
        key = (min(k, self.top), drafting)
        draft = self._drafts.get(key)
        if draft is None:
            draft = self._drafts[key] = self.costs.draft(*key)
        cost = step + draft
        return tokens / cost if cost > 0 else 0.0


def draft_governor(proposer: object, draft: Model, target: Model, max_k: int) -> Governor:
    """A ``Governor`` whose draft rounds cost what ``draft``'s weights cost next to ``target``'s
    (``weight_share``): round 1 adds the draft's LM head rows (its layers run anyway, to keep its
    KV), every later round a whole draft step.  (The registry's governor factory: ``proposer``, the
    built ``DraftModelProposer``, is not needed.)"""
    layers, head = weight_share(draft, target)
    return Governor(draft_costs=(head, *([layers + head] * max(0, max_k - 1))))


__all__ = ["Acceptance", "Advice", "Candidate", "Governor", "draft_governor"]
