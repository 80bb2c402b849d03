"""How far it pays to speculate: acceptance estimates and the governor that chooses the next ``spec_len``.

The spec (m09) decides how many guesses a decode window carries, ``draft_len = min(spec_len,
max_new_tokens - generated - 1)``, and commits the verdict (m12: rollback, tail-page free, the cut at
the first EOS or stop id).  Behind the boundary the executor fills the window with guesses and
verifies them exactly (``torch_executor``); in front of it, the control side may choose the next
step's ``spec_len``::

    SpeculativeConfig            method "ngram" (prompt lookup) or "draft" (a smaller model with the
                                 same vocabulary), num_speculative_tokens (the most guesses per
                                 window: spec_len), n-gram bounds, adaptive
    proposers.NgramProposer      guesses from the request's own ids (no model)
    proposers.DraftModelProposer guesses from a draft model whose KV lives in its own pages, indexed
                                 by the same page tables (paging, prefix reuse, rollback and
                                 preemption apply to it unchanged)
    Acceptance                   per-request estimate of how often a guess is accepted
    Governor                     (adaptive) the spec_len for the next step, between 0 and
                                 num_speculative_tokens: guesses cost target rows (and draft
                                 rounds) and pay only when accepted
    costs.MeasuredCosts          what those rows and rounds cost, in seconds, measured on the
                                 loaded model in its mode (a calibration when the executor is
                                 built, then every decode step); each method's registry entry
                                 gives the prior (``ProposerMethod.governor``: a draft model's
                                 weight share, an EAGLE head's layer and LM head rows)

Why the control side: the boundary requires every planned position to be computed and written, so a
window the proposer cannot fill still costs its rows.  ``EngineCore`` therefore asks, before each
step, how many guesses each caught-up request's proposer has and how often its guesses were accepted,
and sets the engine's ``spec_len`` to what the expected speedup favours (``Governor``).  At batch 1
the window is then exactly the proposal, so proposing nothing costs a plain decode step; with
several requests one ``spec_len`` serves them all (a per-request cap would need a spec change).

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
    """Decayed counts of one request's accepted and rejected guesses; its windows in a row whose guesses were
    all rejected (``misses``) and the windows it still sits out (``wait``)."""

    accepted: float = 0.0
    rejected: float = 0.0
    misses: int = 0
    wait: int = 0


class Acceptance:
    """Per-request acceptance estimates: ``alpha``, the chance that the next guess is accepted, and a back-off.

    ``(accepted + 1) / (accepted + rejected + 2)`` over counts that decay by ``decay`` per decode
    window (a window's first rejection counts once; guesses after it were never judged).  A window
    with nothing proposed only decays them, so a request that stopped proposing drifts back to 0.5
    and is tried again.

    That estimate never falls below about ``1 - decay`` / 2 (0.14 with the defaults), which at batch > 1,
    where a guess row costs little, still looks worth a guess, and at batch 1 brings a probe every ~11
    steps.  So a request whose windows keep failing also backs off exponentially: after ``misses >=
    GRACE`` windows in a row with every guess rejected it sits out ``2 ** (misses - GRACE + 1)`` windows
    (at most ``2 ** MAX_BACKOFF``; ``waiting``), and the first accepted guess ends the back-off.
    """

    GRACE = 2
    MAX_BACKOFF = 8

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._records: dict[str, _Record] = {}

    def rate(self, request_id: str) -> float:
        r = self._records.get(request_id)
        return 0.5 if r is None else (r.accepted + 1.0) / (r.accepted + r.rejected + 2.0)

    def waiting(self, request_id: str) -> bool:
        """Whether the request sits out the coming window (its guesses kept failing)."""
        r = self._records.get(request_id)
        return r is not None and r.wait > 0

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One decode window's verdict: ``accepted`` of the ``proposed`` guesses."""
        r = self._records.setdefault(request_id, _Record())
        r.accepted = r.accepted * self.decay + accepted
        r.rejected = r.rejected * self.decay + (1.0 if accepted < proposed else 0.0)
        if r.wait > 0:
            r.wait -= 1
        if proposed and accepted:
            r.misses = r.wait = 0
        elif proposed:
            r.misses += 1
            if r.misses >= self.GRACE:
                r.wait = 2 ** min(r.misses - self.GRACE + 1, self.MAX_BACKOFF)

    def release(self, request_id: str) -> None:
        self._records.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request about to draft: ``cap`` guesses allowed (spec_len and its length cap), ``available``
    guesses its proposer has (prompt lookup: the match's length; a draft model: ``cap``) and its
    acceptance estimate ``alpha``."""

    cap: int
    available: int
    alpha: float


class Governor:
    """Chooses the engine's ``spec_len`` for the next step: the one the expected speedup favours.

    The spec gives every caught-up request the same ``draft_len = min(spec_len, cap)``, and the
    boundary makes the executor compute every position of a window, so a guess the proposer does
    not have is computed anyway (a pad, almost never accepted).  For each ``k`` in ``0..max_k``::

        tokens(k) = sum over requests of  1 + alpha + ... + alpha ** g,   g = min(k, cap, available)
        cost(k)   = costs.step(sum of (1 + min(k, cap)))  +  costs.draft(min(k, max cap), drafting windows)
        choose the k with the largest tokens(k) / cost(k)   (ties: the smaller k)

    and speculates (``k > 0``) only when that beats ``k = 0`` by more than ``margin`` (0.03: the cost
    model's measurement noise; a guess that pays less is not worth the risk of a slower step).

    ``costs`` (``executor.costs``): ``StaticCosts(row_cost, jump_cost, draft_costs)`` in units of a
    one-row step when not given; the executor gives a ``MeasuredCosts`` (seconds measured on the loaded
    model in its mode, at start and step by step) for the adaptive engine, with the method's static
    costs (its draft rounds' weight share) as the prior.  Windows that draft: those with a guess to
    make (``min(k, cap, available) > 0``).
    """

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

    def rates(self, candidates: Sequence[Candidate], max_k: int) -> list[float]:
        """Expected tokens per unit of cost for each ``k`` in ``0..max_k`` (the class docstring)."""
        out = []
        top = max((c.cap for c in candidates), default=0)
        for k in range(max_k + 1):
            tokens = 0.0
            rows = 0
            drafting = 0
            for c in candidates:
                g = min(k, c.cap, c.available)
                tokens += sum(c.alpha**j for j in range(g + 1))
                rows += 1 + min(k, c.cap)
                drafting += g > 0
            cost = self.costs.step(rows) + self.costs.draft(min(k, top), drafting)
            out.append(tokens / cost if cost > 0 else 0.0)
        return out

    def choose(self, candidates: Sequence[Candidate], max_k: int) -> int:
        """The ``spec_len`` in ``0..max_k`` with the best expected tokens per unit of cost (0 without candidates)."""
        if not candidates or max_k <= 0:
            return 0
        rates = self.rates(candidates, max_k)
        best, best_rate = 0, rates[0] * (1.0 + self.margin)
        for k in range(1, max_k + 1):
            if rates[k] > best_rate * (1.0 + 1e-9):
                best, best_rate = k, rates[k]
        return best


def draft_governor(proposer: object, draft: Model, target: Model, max_k: int) -> Governor:
    """A ``Governor`` whose draft rounds cost what ``draft``'s weights cost next to ``target``'s
    (``weight_share``): round 1 adds the draft's LM head rows (its layers run anyway, to keep its
    KV), every later round a whole draft step.  (The registry's governor factory: ``proposer``, the
    built ``DraftModelProposer``, is not needed.)"""
    layers, head = weight_share(draft, target)
    return Governor(draft_costs=(head, *([layers + head] * max(0, max_k - 1))))


__all__ = ["Acceptance", "Candidate", "Governor", "draft_governor"]
